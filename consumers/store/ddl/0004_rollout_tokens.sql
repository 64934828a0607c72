-- 0004: per-rollout LLM call sizes and finish state, pre-aggregated for the tokens_per_rollout
-- report (consumers/reports.py), which otherwise joins llm_calls FINAL to rollout_status.
-- One AggregatingMergeTree row per rollout (per part, until merges combine them), fed by two
-- materialized views: every insert into rollouts and into llm_calls adds its rollouts' states.
-- Every state is duplicate-proof, so a re-inserted batch (the sink after a crash, a backfill
-- run twice) changes no result:
--   seen            max(1): the rollout has a rollouts row (it is in rollout_status)
--   finished        argMax(status != 'running', version): rollout_status.status != 'running'
--   policy_version  argMinIf(policy_version, version, source != 'finished'): as rollout_status
--   calls           groupUniqArray((seq, event_id, completion length, prompt_delta length)):
--                   the distinct llm_calls rows of the rollout, as FINAL sees them (its key is
--                   (rollout_id, seq, event_id)); an identical duplicate row adds nothing.
-- Readers use FINAL (states merged per rollout_id in key order) and finalizeAggregation.

CREATE TABLE IF NOT EXISTS {db}.rollout_tokens
(
    rollout_id     String,
    seen           SimpleAggregateFunction(max, UInt8),
    finished       AggregateFunction(argMax, UInt8, UInt64),
    policy_version AggregateFunction(argMinIf, Int64, UInt64, UInt8),
    calls          AggregateFunction(groupUniqArray, Tuple(UInt64, String, UInt32, UInt32))
)
ENGINE = AggregatingMergeTree
ORDER BY rollout_id;

CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.rollout_tokens_from_rollouts
TO {db}.rollout_tokens
AS SELECT
    rollout_id,
    toUInt8(1) AS seen,
    argMaxState(toUInt8(status != 'running'), version) AS finished,
    argMinIfState(policy_version, version, source != 'finished') AS policy_version
FROM {db}.rollouts
GROUP BY rollout_id;

CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.rollout_tokens_from_llm_calls
TO {db}.rollout_tokens
AS SELECT
    rollout_id,
    groupUniqArrayState(
        (seq, event_id, toUInt32(length(completion_ids)), toUInt32(length(prompt_delta)))
    ) AS calls
FROM {db}.llm_calls
GROUP BY rollout_id;

-- Backfill the rows stored before the views existed, one merged row per rollout (.size0
-- reads only the array offsets; the views see the inserted block, where length() is as
-- cheap). The views come first, so a row inserted meanwhile is in the views' output, the
-- backfill's, or both (states are duplicate-proof); rerunning this file after a crash
-- half-way is safe too.
INSERT INTO {db}.rollout_tokens (rollout_id, seen, finished, policy_version, calls)
SELECT rollout_id, r.seen, r.finished, r.policy_version, l.calls
FROM
(
    SELECT
        rollout_id,
        toUInt8(1) AS seen,
        argMaxState(toUInt8(status != 'running'), version) AS finished,
        argMinIfState(policy_version, version, source != 'finished') AS policy_version
    FROM {db}.rollouts
    GROUP BY rollout_id
) AS r
FULL OUTER JOIN
(
    SELECT
        rollout_id,
        groupUniqArrayState(
            (seq, event_id, toUInt32(completion_ids.size0), toUInt32(prompt_delta.size0))
        ) AS calls
    FROM {db}.llm_calls
    GROUP BY rollout_id
) AS l USING (rollout_id);
