"""Typed records (rollstream.schemas) mapped to ClickHouse rows. Pure: no ClickHouse client.

One message gives rows for one or more tables (``TableRows``: table name -> row tuples in the
column order of ``TABLES``):

    Event(RolloutStarted)   -> events, rollouts (source "started")
    Event(LlmCall)          -> events, llm_calls
    Event(ToolCall)         -> events, tool_calls
    Event(Reward)           -> events, rewards
    Event(RolloutFinished)  -> events, rollouts (source "finished")
    Event(Branch | RolloutError) -> events
    Trajectory              -> trajectories, rollouts (source "trajectory")
    Sample                  -> samples
    PolicyVersion           -> policy_versions

``rollouts.version`` is ``seq * 4 + rank`` (started 0, finished 1, trajectory 2, with the
trajectory's last_seq): the highest version holds a rollout's current status.
Every row carries the Kafka coordinates it came from (topic, partition, offset). Timestamps are
integer microseconds since the epoch (UTC); token arrays stay numpy arrays (no copy) until the
store converts them to Arrow columns in one ``np.concatenate`` per column. ``events`` is
lossless: ``body_json`` holds every body field except the three token arrays of an LlmCall,
which live once, in ``llm_calls`` (same event_id); ``event_from_row`` rebuilds the Event.

A record that cannot be stored raises ``RowError`` (with a reason) so the sink can route it to
the dead-letter topic; ``RowError`` belongs to the store's error tree drawn in chstore.py.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import operator
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import orjson

from rollstream.schemas import (
    BODY_TYPES,
    Event,
    LlmCall,
    PolicyVersion,
    Record,
    Reward,
    RolloutFinished,
    RolloutStarted,
    Sample,
    ToolCall,
    Trajectory,
)

__all__ = [
    "COLUMNS",
    "MAX_TS_US",
    "TABLES",
    "Column",
    "OffsetRange",
    "RowBatch",
    "RowError",
    "StoreError",
    "TableRows",
    "event_from_row",
    "rows_for_event",
    "rows_for_policy_version",
    "rows_for_record",
    "rows_for_sample",
    "rows_for_trajectory",
    "sample_digest",
]

TableRows: TypeAlias = dict[str, list[tuple[Any, ...]]]

# DateTime64(6) holds 1900-01-01 .. 2299-12-31; we accept the epoch onwards.
MAX_TS_US = 10_413_791_999_999_999


class StoreError(Exception):
    """Root of every error of the ClickHouse store (tree drawn in chstore)."""


class RowError(StoreError):
    """A record that cannot be mapped to rows. ``reason`` says why; ``kind`` names the record."""

    def __init__(self, reason: str, kind: str = "") -> None:
        super().__init__(f"cannot map {kind or 'record'} to rows: {reason}")
        self.reason = reason
        self.kind = kind


class Column(NamedTuple):
    """A column and how the store builds it. Kinds: str, bytes (UTF-8 text as bytes), bool,
    i32, i64, u32, u64, f64, ts (int microseconds -> DateTime64(6)), u32[] f32[] i32[] i64[]
    f64[] (numpy arrays or lists), str[], map:str (Map(String, String)), map:f64."""

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

_NAN = float("nan")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_US = dt.timedelta(microseconds=1)


# --- checks ---------------------------------------------------------------------------------


def _ts(value: int, what: str, kind: str) -> int:
    if not 0 <= value <= MAX_TS_US:
        raise RowError(f"{what} {value} is outside 0..{MAX_TS_US} microseconds", kind)
    return value


def _check_event(event: Event) -> str:
    kind = _BODY_KINDS.get(type(event.body))
    if kind is None:
        raise RowError(f"unknown body type {type(event.body).__name__}", "Event")
    if not event.event_id:
        raise RowError("empty event_id", kind)
    if not event.rollout_id:
        raise RowError("empty rollout_id", kind)
    if event.seq < 0:
        raise RowError(f"negative seq {event.seq}", kind)
    ts = event.ts
    if not 0 <= ts <= MAX_TS_US:
        raise RowError(f"ts {ts} is outside 0..{MAX_TS_US} microseconds", kind)
    return kind


# --- events -----------------------------------------------------------------------------------

_BODY_KINDS: dict[type, str] = {cls: cls.__name__ for cls in BODY_TYPES.values()}
_FLOAT_FIELDS: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _float_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Names of a body's float fields and of its dict[str, float] fields (cached per class)."""
    found = _FLOAT_FIELDS.get(cls)
    if found is None:
        fields = dataclasses.fields(cls)
        found = _FLOAT_FIELDS[cls] = (
            tuple(f.name for f in fields if f.type == "float"),
            tuple(f.name for f in fields if f.type == "dict[str, float]"),
        )
    return found


def _finite_check(cls: type) -> Any:
    """``check(body) -> bool``: every float of a ``cls`` body is finite (None: it has none).
    ``v - v == 0.0`` is False exactly for NaN and infinities (and raises TypeError for a
    value that is not a number, as ``math.isfinite`` does)."""
    scalars, maps = _float_fields(cls)
    if not scalars and not maps:
        return None
    get_scalars = operator.attrgetter(*scalars) if scalars else None
    get_maps = operator.attrgetter(*maps) if maps else None
    if get_scalars is not None and len(scalars) == 1 and not maps:
        get = get_scalars

        def check_one(body: Any) -> bool:
            v: Any = get(body)
            return bool(v - v == 0.0)

        return check_one

    def check(body: Any) -> bool:
        if get_scalars is not None:
            values = get_scalars(body)
            for v in values if len(scalars) > 1 else (values,):
                if v - v != 0.0:
                    return False
        if get_maps is not None:
            found = get_maps(body)
            for m in found if len(maps) > 1 else (found,):
                for v in m.values():
                    if v - v != 0.0:
                        return False
        return True

    return check


_FINITE_CHECKS: dict[type, Any] = {}


def _finite(body: Any) -> bool:
    cls = type(body)
    check = _FINITE_CHECKS.get(cls, _finite)
    if check is _finite:
        check = _FINITE_CHECKS[cls] = _finite_check(cls)
    return True if check is None else bool(check(body))


def _body_json(body: Any) -> bytes:
    """Compact JSON (orjson); a body with NaN or infinite floats goes through the standard
    library, which writes them as NaN/Infinity (orjson would write null) so they read back."""
    finite = _finite(body)
    if isinstance(body, LlmCall):
        u = body.usage
        data = {
            "call_id": body.call_id, "parent_call_id": body.parent_call_id,
            "prefix_len": body.prefix_len, "finish_reason": body.finish_reason,
            "model": body.model, "backend": body.backend, "policy_version": body.policy_version,
            "latency_ms": body.latency_ms, "drift_tokens": body.drift_tokens,
            "usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                      "cached_tokens": u.cached_tokens},
        }  # fmt: skip
    elif finite:  # flat bodies: orjson writes the dataclass itself (enums as values)
        return orjson.dumps(body)
    else:
        data = {name: getattr(body, name) for name in body._field_names()}
    if finite:
        return orjson.dumps(data)
    return json.dumps(data, separators=(",", ":")).encode()


# The typed row of each body (None: the events row only). ``head`` is (event_id, rollout_id,
# seq, ts), ``kafka`` is (topic, partition, offset).
_Typed: TypeAlias = "tuple[str, tuple[Any, ...]] | None"


def _llm_call_row(event: Event, body: LlmCall, head: tuple[Any, ...], kafka: Any) -> _Typed:
    if body.prefix_len < 0:
        raise RowError(f"negative prefix_len {body.prefix_len}", "LlmCall")
    u = body.usage
    return "llm_calls", (
        *head, body.call_id, body.parent_call_id or "", body.prefix_len,
        body.prefix_len + len(body.prompt_delta), body.prompt_delta, body.completion_ids,
        body.completion_logprobs, body.finish_reason, body.model, body.backend,
        body.policy_version, body.latency_ms, u.prompt_tokens, u.completion_tokens,
        u.cached_tokens, body.drift_tokens, *kafka,
    )  # fmt: skip


def _tool_call_row(event: Event, body: ToolCall, head: tuple[Any, ...], kafka: Any) -> _Typed:
    return "tool_calls", (
        *head, body.tool_call_id, body.name, body.arguments, body.result,
        body.result_truncated, body.is_error, body.duration_ms, body.sandbox or "",
        body.at_call_id or "", *kafka,
    )  # fmt: skip


def _reward_row(event: Event, body: Reward, head: tuple[Any, ...], kafka: Any) -> _Typed:
    return "rewards", (
        *head, body.value, str(body.kind), body.name, body.at_call_id or "", body.evaluator,
        *kafka,
    )  # fmt: skip


def _started_row(event: Event, body: RolloutStarted, head: tuple[Any, ...], kafka: Any) -> _Typed:
    return "rollouts", (
        event.rollout_id, "started", event.seq * 4, event.ts,
        body.task_id, body.group_id, body.run_id, body.attempt, body.group_size or 0,
        body.harness, body.policy_version, "running", "", _NAN, 0, 0, 0,
        event.ts, 0, *kafka,
    )  # fmt: skip


def _finished_row(event: Event, body: RolloutFinished, head: tuple[Any, ...], kafka: Any) -> _Typed:
    return "rollouts", (
        event.rollout_id, "finished", event.seq * 4 + 1, event.ts,
        "", "", "", 0, 0, "", 0, str(body.status), body.error or "", _NAN, 0, 0, 0,
        0, event.ts, *kafka,
    )  # fmt: skip


def _no_row(event: Event, body: Any, head: tuple[Any, ...], kafka: Any) -> _Typed:
    return None


_TYPED_ROWS: dict[type, Any] = {
    cls: {
        LlmCall: _llm_call_row,
        ToolCall: _tool_call_row,
        Reward: _reward_row,
        RolloutStarted: _started_row,
        RolloutFinished: _finished_row,
    }.get(cls, _no_row)
    for cls in BODY_TYPES.values()
}


def _event_rows(
    event: Event, kafka: tuple[str, int, int]
) -> tuple[tuple[Any, ...], str | None, tuple[Any, ...] | None]:
    """(events row, typed table or None, typed row or None): ``rows_for_event`` and the
    ``RowBatch`` fast path."""
    kind = _check_event(event)
    body = event.body
    head = (event.event_id, event.rollout_id, event.seq, event.ts)
    try:
        body_json = _body_json(body)
    except (TypeError, ValueError, orjson.JSONEncodeError) as exc:
        raise RowError(f"body is not JSON-able: {exc}", kind) from exc
    row = (*head, kind, event.producer, event.schema_version, body_json, *kafka)
    typed = _TYPED_ROWS[type(body)](event, body, head, kafka)
    if typed is None:
        return row, None, None
    return row, typed[0], typed[1]


def rows_for_event(event: Event, topic: str, partition: int, offset: int) -> TableRows:
    """Rows of one rollout event: its ``events`` row plus the typed table's row."""
    row, table, typed = _event_rows(event, (topic, partition, offset))
    if table is None:
        return {"events": [row]}
    return {"events": [row], table: [typed]}  # type: ignore[list-item]


def event_from_row(row: Mapping[str, Any], llm_call: Mapping[str, Any] | None = None) -> Event:
    """Rebuild an Event from its ``events`` row (a mapping by column name; ``ts`` as int
    microseconds or a datetime) and, for an LlmCall, its ``llm_calls`` row (token arrays)."""
    kind = str(row["type"])
    body_cls = BODY_TYPES.get(f"rollstream.{kind}")
    if body_cls is None:
        raise RowError(f"unknown body type {kind}", "Event")
    data = json.loads(row["body_json"])
    if body_cls is LlmCall:
        if llm_call is None:
            raise RowError("an LlmCall needs its llm_calls row for the token arrays", kind)
        for name in ("prompt_delta", "completion_ids", "completion_logprobs"):
            data[name] = llm_call[name]
    ts = row["ts"]
    if isinstance(ts, dt.datetime):
        ts = (ts if ts.tzinfo else ts.replace(tzinfo=dt.UTC)) - _EPOCH
        ts = ts // _US
    return Event(
        event_id=row["event_id"],
        rollout_id=row["rollout_id"],
        seq=int(row["seq"]),
        ts=int(ts),
        producer=row["producer"],
        schema_version=int(row["schema_version"]),
        body=body_cls.from_json(data),
    )


# --- derived records ----------------------------------------------------------------------


def rows_for_trajectory(
    traj: Trajectory, topic: str, partition: int, offset: int, *, timestamp_us: int = 0
) -> TableRows:
    """Rows of a rebuilt trajectory: ``trajectories`` (tree shape and rewards, not the token
    arrays, which llm_calls holds) and its ``rollouts`` summary (source "trajectory").
    ``ts`` is the rollout start, else its finish, else ``timestamp_us`` (the Kafka time)."""
    kind = "Trajectory"
    if not traj.rollout_id:
        raise RowError("empty rollout_id", kind)
    started = _ts(traj.started_ts, "started_ts", kind)
    finished = _ts(traj.finished_ts, "finished_ts", kind)
    ts = _ts(started or finished or timestamp_us, "ts", kind)
    nodes = traj.nodes
    completion_lens = np.fromiter((len(n.completion_ids) for n in nodes), np.uint32, len(nodes))
    num_completion = int(completion_lens.sum())
    kafka = (topic, partition, offset)
    common = (traj.task_id, traj.group_id, traj.run_id, traj.attempt, traj.group_size or 0)
    k, rewards = len(nodes), traj.rewards
    traj_row = (
        traj.rollout_id, ts, *common, traj.status, traj.error or "", traj.score,
        traj.score_source, traj.num_events, traj.last_seq, started, finished, k, num_completion,
        [n.call_id for n in nodes],
        [n.parent_call_id or "" for n in nodes],
        np.fromiter((n.prefix_len for n in nodes), np.int32, k),
        np.fromiter((len(n.prompt_tokens) for n in nodes), np.uint32, k),
        completion_lens,
        np.fromiter((n.policy_version for n in nodes), np.int64, k),
        [n.finish_reason for n in nodes],
        np.fromiter((r.value for r in rewards), np.float64, len(rewards)),
        [r.kind for r in rewards],
        [r.name for r in rewards],
        [r.at_call_id or "" for r in rewards],
        traj.metadata,
        *kafka,
    )  # fmt: skip

    policy = min((n.policy_version for n in nodes), default=0)
    rollout_row = (
        traj.rollout_id, "trajectory", max(traj.last_seq, 0) * 4 + 2, ts, *common, "", policy,
        traj.status, traj.error or "", traj.score, traj.num_events, len(nodes), num_completion,
        started, finished, *kafka,
    )  # fmt: skip
    return {"trajectories": [traj_row], "rollouts": [rollout_row]}


def sample_digest(sample: Sample) -> str:
    """A digest of the sample's token content (ids, mask, logprobs, tree, versions): two runs
    that produced identical samples have equal digests (replay checks compare them in SQL)."""
    h = hashlib.blake2b(digest_size=16)
    for arr in (
        sample.input_ids,
        sample.loss_mask,
        sample.behaviour_logprobs,
        sample.parent_indices,
        sample.token_policy_versions,
    ):
        h.update(len(arr).to_bytes(8, "little"))
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def rows_for_sample(
    sample: Sample, topic: str, partition: int, offset: int, *, timestamp_us: int
) -> TableRows:
    """Rows of a training sample. A sample has no time of its own: ``timestamp_us`` is the
    Kafka message time (when it became available to the trainer; staleness is measured then).
    Token arrays are not stored, only their sizes and a digest of their content."""
    kind = "Sample"
    if not sample.sample_id:
        raise RowError("empty sample_id", kind)
    if timestamp_us <= 0:
        raise RowError("a sample needs timestamp_us (its Kafka message time)", kind)
    versions = sample.policy_versions
    row = (
        sample.sample_id,
        sample.rollout_id,
        sample.group_id,
        sample.task_id,
        _ts(timestamp_us, "timestamp_us", kind),
        str(sample.mode),
        sample.advantage,
        sample.reward,
        sample.loss_weight,
        sample.policy_version,
        min(versions) if versions else sample.policy_version,
        versions,
        sample.leaf_id,
        sample.num_tokens,
        len(sample.input_ids),
        int(np.count_nonzero(sample.loss_mask)),
        sample_digest(sample),
        topic,
        partition,
        offset,
    )
    return {"samples": [row]}


def rows_for_policy_version(
    pv: PolicyVersion, topic: str, partition: int, offset: int
) -> TableRows:
    kind = "PolicyVersion"
    row = (
        pv.version,
        _ts(pv.ts, "ts", kind),
        pv.checkpoint_uri,
        pv.trainer_step,
        pv.samples_trained,
        pv.metrics,
        topic,
        partition,
        offset,
    )
    return {"policy_versions": [row]}


def rows_for_record(
    record: Record, topic: str, partition: int, offset: int, *, timestamp_us: int = 0
) -> TableRows:
    """Dispatch on the record type. ``timestamp_us`` (the Kafka message time) is needed by
    samples and used by trajectories without a start or finish time."""
    try:
        if isinstance(record, Event):
            return rows_for_event(record, topic, partition, offset)
        if isinstance(record, Trajectory):
            return rows_for_trajectory(record, topic, partition, offset, timestamp_us=timestamp_us)
        if isinstance(record, Sample):
            return rows_for_sample(record, topic, partition, offset, timestamp_us=timestamp_us)
        if isinstance(record, PolicyVersion):
            return rows_for_policy_version(record, topic, partition, offset)
    except RowError:
        raise
    except (AttributeError, TypeError, ValueError, OverflowError) as exc:
        raise RowError(f"{type(exc).__name__}: {exc}", type(record).__name__) from exc
    raise RowError(f"not a storable record: {type(record).__name__}", type(record).__name__)


class OffsetRange:
    """The consecutive offsets of one topic partition a batch consumed. They name its insert:
    ``token`` is ``topic:partition:first:last`` and the store appends ``:table``, so a batch
    retried after a crash (same offsets) is stored once."""

    def __init__(self, topic: str, partition: int) -> None:
        self.topic = topic
        self.partition = partition
        self.first: int | None = None
        self.last: int | None = None
        self.messages = 0

    def _consume(self, offset: int) -> None:
        last = self.last
        if last is None:
            self.first = offset
        elif offset <= last:
            raise ValueError(f"offset {offset} is not after {last} in {self.token}")
        self.last = offset
        self.messages += 1

    @property
    def token(self) -> str:
        return f"{self.topic}:{self.partition}:{self.first}:{self.last}"


class RowBatch(OffsetRange):
    """Rows of consecutive messages of one topic partition (``OffsetRange``: its token).

    ``add`` counts the offset even when the record fails to map (it re-raises the RowError for
    the caller to dead-letter the record): the range is what was consumed, not what was stored.
    """

    def __init__(self, topic: str, partition: int) -> None:
        super().__init__(topic, partition)
        self.tables: TableRows = {}

    def add(self, record: Record, offset: int, *, timestamp_us: int = 0) -> None:
        self._consume(offset)
        if type(record) is Event:  # the common case, without the per-record dicts
            try:
                row, table, typed = _event_rows(record, (self.topic, self.partition, offset))
            except RowError:
                raise
            except (AttributeError, TypeError, ValueError, OverflowError) as exc:
                raise RowError(f"{type(exc).__name__}: {exc}", "Event") from exc
            tables = self.tables
            events = tables.get("events")
            if events is None:
                events = tables["events"] = []
            events.append(row)
            if table is not None:
                rows = tables.get(table)
                if rows is None:
                    rows = tables[table] = []
                rows.append(typed)  # type: ignore[arg-type]
            return
        rows_by_table = rows_for_record(
            record, self.topic, self.partition, offset, timestamp_us=timestamp_us
        )
        for table, table_rows in rows_by_table.items():
            self.tables.setdefault(table, []).extend(table_rows)

    def skip(self, offset: int) -> None:
        """Count a consumed message that produced no rows (e.g. undecodable, dead-lettered)."""
        self._consume(offset)

    @property
    def num_rows(self) -> int:
        return sum(len(rows) for rows in self.tables.values())

    def __len__(self) -> int:
        return self.messages
