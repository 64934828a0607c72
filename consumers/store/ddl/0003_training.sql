-- 0003: derived records: rebuilt trajectories, training samples, policy versions.
-- Token arrays are not copied here: a trajectory keeps its tree shape (call ids, parents,
-- prefix and completion lengths), a sample its sizes and a content digest; the tokens live
-- once, in llm_calls.

CREATE TABLE IF NOT EXISTS {db}.trajectories
(
    rollout_id            String,
    ts                    DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    task_id               String,
    group_id              String,
    run_id                LowCardinality(String),
    attempt               Int32,
    group_size            Int32,
    status                LowCardinality(String),
    error                 String CODEC(ZSTD(3)),
    score                 Float64,
    score_source          LowCardinality(String),
    num_events            Int32,
    last_seq              Int64,
    started_ts            DateTime64(6, 'UTC'),
    finished_ts           DateTime64(6, 'UTC'),
    num_nodes             UInt32,
    num_completion_tokens UInt64,
    node_call_ids         Array(String) CODEC(ZSTD(3)),
    node_parent_ids       Array(String) CODEC(ZSTD(3)),
    node_prefix_lens      Array(Int32) CODEC(ZSTD(1)),
    node_prompt_lens      Array(UInt32) CODEC(ZSTD(1)),
    node_completion_lens  Array(UInt32) CODEC(ZSTD(1)),
    node_policy_versions  Array(Int64) CODEC(ZSTD(1)),
    node_finish_reasons   Array(LowCardinality(String)),
    reward_values         Array(Float64),
    reward_kinds          Array(LowCardinality(String)),
    reward_names          Array(LowCardinality(String)),
    reward_at_call_ids    Array(String),
    metadata              Map(LowCardinality(String), String),
    kafka_topic           LowCardinality(String),
    kafka_partition       Int32,
    kafka_offset          Int64
)
ENGINE = ReplacingMergeTree(last_seq)
PARTITION BY toYYYYMMDD(ts)
ORDER BY rollout_id
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS {db}.samples
(
    sample_id          String,
    rollout_id         String,
    group_id           String,
    task_id            String,
    ts                 DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    mode               LowCardinality(String),
    advantage          Float64,
    reward             Float64,
    loss_weight        Float64,
    policy_version     Int64,
    min_policy_version Int64,
    policy_versions    Array(Int64),
    leaf_id            String,
    num_tokens         Int32,
    input_len          UInt32,
    num_loss_tokens    UInt32,
    digest             FixedString(32),
    kafka_topic        LowCardinality(String),
    kafka_partition    Int32,
    kafka_offset       Int64 CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (rollout_id, sample_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS {db}.policy_versions
(
    version         Int64,
    ts              DateTime64(6, 'UTC'),
    checkpoint_uri  String,
    trainer_step    Int64,
    samples_trained Int64,
    metrics         Map(LowCardinality(String), Float64),
    kafka_topic     LowCardinality(String),
    kafka_partition Int32,
    kafka_offset    Int64
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY version
SETTINGS non_replicated_deduplication_window = 10000;
