-- 0001: the raw log (events) and the typed event tables.
-- {db} is the namespace's database. Every table is a ReplacingMergeTree keyed by the record's
-- natural id (duplicates collapse on merge and under FINAL) with a deduplication window, so an
-- insert retried with the same insert_deduplication_token is dropped at insert time.
-- ORDER BY starts with rollout_id: rows of a rollout sit together (replay, per-rollout reports,
-- compression); event_id ends the key so distinct events never collapse.
-- Token ids: ZSTD(3) measured best (0.95 B/token on BPE ids; T64+ZSTD 1.20, Delta+ZSTD 1.34,
-- LZ4 1.39); logprobs: ZSTD(1) (FPC/Gorilla do not beat it). See docs/analytics.md.

CREATE TABLE IF NOT EXISTS {db}.events
(
    event_id        String,
    rollout_id      String,
    seq             UInt64,
    ts              DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    type            LowCardinality(String),
    producer        LowCardinality(String),
    schema_version  Int32,
    body_json       String CODEC(ZSTD(3)),
    kafka_topic     LowCardinality(String),
    kafka_partition Int32,
    kafka_offset    Int64 CODEC(Delta, ZSTD(1)),
    INDEX idx_event_id event_id TYPE bloom_filter(0.01) GRANULARITY 4
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (rollout_id, seq, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS {db}.llm_calls
(
    event_id            String,
    rollout_id          String,
    seq                 UInt64,
    ts                  DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    call_id             String,
    parent_call_id      String,
    prefix_len          UInt32,
    prompt_len          UInt32,
    prompt_delta        Array(UInt32) CODEC(ZSTD(3)),
    completion_ids      Array(UInt32) CODEC(ZSTD(3)),
    completion_logprobs Array(Float32) CODEC(ZSTD(1)),
    finish_reason       LowCardinality(String),
    model               LowCardinality(String),
    backend             LowCardinality(String),
    policy_version      Int64,
    latency_ms          Float64,
    prompt_tokens       Int32,
    completion_tokens   Int32,
    cached_tokens       Int32,
    drift_tokens        Int32,
    kafka_topic         LowCardinality(String),
    kafka_partition     Int32,
    kafka_offset        Int64 CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (rollout_id, seq, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS {db}.tool_calls
(
    event_id         String,
    rollout_id       String,
    seq              UInt64,
    ts               DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    tool_call_id     String,
    name             LowCardinality(String),
    arguments        String CODEC(ZSTD(3)),
    result           String CODEC(ZSTD(3)),
    result_truncated Bool,
    is_error         Bool,
    duration_ms      Float64,
    sandbox          LowCardinality(String),
    at_call_id       String,
    kafka_topic      LowCardinality(String),
    kafka_partition  Int32,
    kafka_offset     Int64 CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (rollout_id, seq, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS {db}.rewards
(
    event_id        String,
    rollout_id      String,
    seq             UInt64,
    ts              DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    value           Float64,
    kind            LowCardinality(String),
    name            LowCardinality(String),
    at_call_id      String,
    evaluator       LowCardinality(String),
    kafka_topic     LowCardinality(String),
    kafka_partition Int32,
    kafka_offset    Int64 CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (rollout_id, seq, event_id)
SETTINGS non_replicated_deduplication_window = 10000;
