-- 0005: the rollout service's lifecycle events (schemas: StageEvent, SandboxEvent,
-- EvaluatorOutput), one typed table each, keyed like the other event tables (0001): a
-- ReplacingMergeTree on (rollout_id, seq, event_id) with a deduplication window.
-- stages: a stage (init | run | eval) started or finished; duration_ms is 0 when started, status
-- is '' when started and ok | failed | timeout when finished. The `stages` report reads it.

CREATE TABLE IF NOT EXISTS {db}.stages
(
    event_id        String,
    rollout_id      String,
    seq             UInt64,
    ts              DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    job_id          LowCardinality(String),
    stage           LowCardinality(String),
    phase           LowCardinality(String),
    status          LowCardinality(String),
    duration_ms     Float64,
    worker          LowCardinality(String),
    reason          String CODEC(ZSTD(3)),
    kafka_topic     LowCardinality(String),
    kafka_partition Int32,
    kafka_offset    Int64 CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (rollout_id, seq, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS {db}.sandboxes
(
    event_id        String,
    rollout_id      String,
    seq             UInt64,
    ts              DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    sandbox_id      String,
    phase           LowCardinality(String),
    kind            LowCardinality(String),
    duration_ms     Float64,
    job_id          LowCardinality(String),
    kafka_topic     LowCardinality(String),
    kafka_partition Int32,
    kafka_offset    Int64 CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (rollout_id, seq, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS {db}.evaluator_outputs
(
    event_id         String,
    rollout_id       String,
    seq              UInt64,
    ts               DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    evaluator        LowCardinality(String),
    status           LowCardinality(String),
    passed           Int32,
    total            Int32,
    output           String CODEC(ZSTD(3)),
    output_truncated Bool,
    job_id           LowCardinality(String),
    kafka_topic      LowCardinality(String),
    kafka_partition  Int32,
    kafka_offset     Int64 CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (rollout_id, seq, event_id)
SETTINGS non_replicated_deduplication_window = 10000;
