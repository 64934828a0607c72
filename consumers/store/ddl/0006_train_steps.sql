-- 0006: one row per trainer step. The trainer publishes each step as a PolicyVersion whose
-- metrics map holds the step's numbers (ppo.py, step.py, trainer.py); this view spreads the
-- ones the web UI's training page draws into columns. A metric the trainer did not record is
-- NaN (entropy unless the loss computes it). Duplicate rows of a version are identical (the
-- same published record), so any() over them is exact and the view needs no FINAL.

CREATE VIEW IF NOT EXISTS {db}.train_steps AS
SELECT
    v AS policy_version,
    step AS trainer_step,
    published AS ts,
    trained AS samples_trained,
    if(mapContains(m, 'loss'), m['loss'], nan) AS loss,
    if(mapContains(m, 'clip_frac'), m['clip_frac'], nan) AS clip_frac,
    if(mapContains(m, 'approx_kl'), m['approx_kl'], nan) AS approx_kl,
    if(mapContains(m, 'entropy'), m['entropy'], nan) AS entropy,
    if(mapContains(m, 'grad_norm'), m['grad_norm'], nan) AS grad_norm,
    if(mapContains(m, 'step_time_s'), m['step_time_s'], nan) AS step_time_s,
    if(mapContains(m, 'batch_samples'), m['batch_samples'], nan) AS batch_samples,
    if(mapContains(m, 'batch_tokens'), m['batch_tokens'], nan) AS batch_tokens,
    if(mapContains(m, 'lr'), m['lr'], nan) AS lr,
    if(mapContains(m, 'stale_dropped'), m['stale_dropped'], nan) AS stale_dropped,
    if(mapContains(m, 'dlq'), m['dlq'], nan) AS dlq
FROM
(
    SELECT version AS v, any(trainer_step) AS step, any(ts) AS published,
           any(samples_trained) AS trained, any(metrics) AS m
    FROM {db}.policy_versions
    GROUP BY version
);
