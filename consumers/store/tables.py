"""The columns of the store's tables as the mappers write them. Pure: no ClickHouse client.

``TABLES[table]`` lists every column of a table the sink inserts into, in the order of its DDL
(``ddl/*.sql``), with the kind of value the mappers put there: the row mapper (rows.py) builds
row tuples in this order, the column mapper (columnar.py) and ``chstore.to_arrow`` build Arrow
columns of these names and kinds. The DDL is the schema ClickHouse holds; these lists must match
it column for column (name, order, and a kind that fits the type):
tests/integration/test_table_columns.py applies the migrations to a real chDB and compares
``system.columns`` with them, so a column added to the DDL alone (or here alone) fails the test.

Kinds (``Column.kind``) and the ClickHouse types they fit (``CLICKHOUSE_TYPES``):

    str         String, LowCardinality(String), FixedString(N)
    bytes       String (UTF-8 text handed over as bytes: events.body_json)
    bool        Bool
    i32 i64     Int32 Int64
    u32 u64     UInt32 UInt64
    f64         Float64
    ts          DateTime64(6, 'UTC') (integer microseconds since the epoch)
    u32[] f32[] i32[] i64[] f64[]   Array(UInt32) ... (numpy arrays or lists)
    str[]       Array(String), Array(LowCardinality(String))
    map:str     Map(String or LowCardinality(String), String)
    map:f64     Map(String or LowCardinality(String), Float64)
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, TypeAlias

__all__ = [
    "CLICKHOUSE_TYPES",
    "COLUMNS",
    "MAX_TS_US",
    "TABLES",
    "Column",
    "TableRows",
    "fits",
]

TableRows: TypeAlias = dict[str, list[tuple[Any, ...]]]

# DateTime64(6) holds 1900-01-01 .. 2299-12-31; we accept the epoch onwards.
MAX_TS_US = 10_413_791_999_999_999


class Column(NamedTuple):
    """A column and the kind of value the mappers write into it (module docstring)."""

    name: str
    kind: str


def _cols(spec: str) -> tuple[Column, ...]:
    return tuple(Column(*item.split(":", 1)) for item in spec.split())


_KAFKA = " kafka_topic:str kafka_partition:i32 kafka_offset:i64"
_HEAD = "event_id:str rollout_id:str seq:u64 ts:ts "

TABLES: dict[str, tuple[Column, ...]] = {
    "events": _cols(_HEAD + "type:str producer:str schema_version:i32 body_json:bytes" + _KAFKA),
    "llm_calls": _cols(
        _HEAD + "call_id:str parent_call_id:str prefix_len:u32 prompt_len:u32 prompt_delta:u32[] "
        "completion_ids:u32[] completion_logprobs:f32[] finish_reason:str model:str "
        "backend:str policy_version:i64 latency_ms:f64 prompt_tokens:i32 completion_tokens:i32 "
        "cached_tokens:i32 drift_tokens:i32" + _KAFKA
    ),
    "tool_calls": _cols(
        _HEAD + "tool_call_id:str name:str arguments:str result:str result_truncated:bool "
        "is_error:bool duration_ms:f64 sandbox:str at_call_id:str" + _KAFKA
    ),
    "rewards": _cols(_HEAD + "value:f64 kind:str name:str at_call_id:str evaluator:str" + _KAFKA),
    "stages": _cols(
        _HEAD
        + "job_id:str stage:str phase:str status:str duration_ms:f64 worker:str reason:str"
        + _KAFKA
    ),
    "sandboxes": _cols(
        _HEAD + "sandbox_id:str phase:str kind:str duration_ms:f64 job_id:str" + _KAFKA
    ),
    "evaluator_outputs": _cols(
        _HEAD + "evaluator:str status:str passed:i32 total:i32 output:str output_truncated:bool "
        "job_id:str" + _KAFKA
    ),
    "rollouts": _cols(
        "rollout_id:str source:str version:u64 ts:ts task_id:str group_id:str run_id:str "
        "attempt:i32 group_size:i32 harness:str policy_version:i64 status:str error:str "
        "score:f64 num_events:i32 num_llm_calls:u32 num_completion_tokens:u64 "
        "started_ts:ts finished_ts:ts" + _KAFKA
    ),
    "trajectories": _cols(
        "rollout_id:str ts:ts task_id:str group_id:str run_id:str attempt:i32 group_size:i32 "
        "status:str error:str score:f64 score_source:str num_events:i32 last_seq:i64 "
        "started_ts:ts finished_ts:ts num_nodes:u32 num_completion_tokens:u64 "
        "node_call_ids:str[] node_parent_ids:str[] node_prefix_lens:i32[] "
        "node_prompt_lens:u32[] node_completion_lens:u32[] node_policy_versions:i64[] "
        "node_finish_reasons:str[] reward_values:f64[] reward_kinds:str[] reward_names:str[] "
        "reward_at_call_ids:str[] metadata:map:str" + _KAFKA
    ),
    "samples": _cols(
        "sample_id:str rollout_id:str group_id:str task_id:str ts:ts mode:str advantage:f64 "
        "reward:f64 loss_weight:f64 policy_version:i64 min_policy_version:i64 "
        "policy_versions:i64[] leaf_id:str num_tokens:i32 input_len:u32 num_loss_tokens:u32 "
        "digest:str" + _KAFKA
    ),
    "policy_versions": _cols(
        "version:i64 ts:ts checkpoint_uri:str trainer_step:i64 samples_trained:i64 "
        "metrics:map:f64" + _KAFKA
    ),
}
COLUMNS: dict[str, tuple[str, ...]] = {t: tuple(c.name for c in cs) for t, cs in TABLES.items()}

# kind -> ClickHouse types (as system.columns spells them, LowCardinality(...) removed) it fits
CLICKHOUSE_TYPES: dict[str, tuple[str, ...]] = {
    "str": ("String", "FixedString(*)"),
    "bytes": ("String",),
    "bool": ("Bool",),
    "i32": ("Int32",),
    "i64": ("Int64",),
    "u32": ("UInt32",),
    "u64": ("UInt64",),
    "f64": ("Float64",),
    "ts": ("DateTime64(6, 'UTC')",),
    "u32[]": ("Array(UInt32)",),
    "f32[]": ("Array(Float32)",),
    "i32[]": ("Array(Int32)",),
    "i64[]": ("Array(Int64)",),
    "f64[]": ("Array(Float64)",),
    "str[]": ("Array(String)",),
    "map:str": ("Map(String, String)",),
    "map:f64": ("Map(String, Float64)",),
}
_LOW_CARDINALITY = re.compile(r"LowCardinality\(([^()]*)\)")
_FIXED_STRING = re.compile(r"FixedString\(\d+\)")


def fits(kind: str, clickhouse_type: str) -> bool:
    """Whether values of ``kind`` go into a column of ``clickhouse_type`` (system.columns'
    spelling) as the store inserts them: LowCardinality is storage only, FixedString(N) any N."""
    base = _LOW_CARDINALITY.sub(r"\1", clickhouse_type)
    base = _FIXED_STRING.sub("FixedString(*)", base)
    return base in CLICKHOUSE_TYPES.get(kind, ())
