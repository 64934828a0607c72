"""Rollout events mapped to ClickHouse rows, and the row batch of a topic partition. Pure: no
ClickHouse client.

One message gives rows for one or more tables (``TableRows``: table name -> row tuples in the
column order of ``tables.TABLES``):

    Event(RolloutStarted)   -> events, rollouts (source "started")
    Event(LlmCall)          -> events, llm_calls
    Event(ToolCall)         -> events, tool_calls
    Event(Reward)           -> events, rewards
    Event(RolloutFinished)  -> events, rollouts (source "finished")
    Event(StageEvent)       -> events, stages
    Event(SandboxEvent)     -> events, sandboxes
    Event(EvaluatorOutput)  -> events, evaluator_outputs
    Event(Branch | RolloutError) -> events
    Trajectory, Sample, PolicyVersion   -> derived_rows.py (``rows_for_record`` dispatches)

``rollouts.version`` is ``seq * 4 + rank`` (started 0, finished 1, trajectory 2, with the
trajectory's last_seq): the highest version holds a rollout's current status.
Every row carries the Kafka coordinates it came from (topic, partition, offset). Timestamps are
integer microseconds since the epoch (UTC); token arrays stay numpy arrays (no copy) until the
store converts them to Arrow columns in one ``np.concatenate`` per column. ``events`` is
lossless: ``body_json`` holds every body field except the three token arrays of an LlmCall,
which live once, in ``llm_calls`` (same event_id); ``event_from_row`` rebuilds the Event.

A record that cannot be stored raises ``RowError`` (with a reason) so the sink can route it to
the dead-letter topic (rollstream.consumers.errors draws the tree).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import operator
from collections.abc import Mapping
from typing import Any, TypeAlias

import orjson

from rollstream.consumers.errors import RowError, StoreError
from rollstream.consumers.store.derived_rows import (
    rows_for_policy_version,
    rows_for_sample,
    rows_for_trajectory,
)
from rollstream.consumers.store.tables import MAX_TS_US, TableRows
from rollstream.schemas import (
    BODY_TYPES,
    EvaluatorOutput,
    Event,
    LlmCall,
    PolicyVersion,
    Record,
    Reward,
    RolloutFinished,
    RolloutStarted,
    Sample,
    SandboxEvent,
    StageEvent,
    ToolCall,
    Trajectory,
)

__all__ = [
    "OffsetRange",
    "RowBatch",
    "RowError",
    "StoreError",
    "event_from_row",
    "rows_for_event",
    "rows_for_record",
]

_NAN = float("nan")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_US = dt.timedelta(microseconds=1)


# --- checks ---------------------------------------------------------------------------------


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


def _stage_row(event: Event, body: StageEvent, head: tuple[Any, ...], kafka: Any) -> _Typed:
    return "stages", (
        *head, body.job_id, str(body.stage), str(body.phase), body.status, body.duration_ms,
        body.worker, body.reason, *kafka,
    )  # fmt: skip


def _sandbox_row(event: Event, body: SandboxEvent, head: tuple[Any, ...], kafka: Any) -> _Typed:
    return "sandboxes", (
        *head, body.sandbox_id, str(body.phase), body.kind, body.duration_ms, body.job_id, *kafka,
    )  # fmt: skip


def _evaluator_output_row(
    event: Event, body: EvaluatorOutput, head: tuple[Any, ...], kafka: Any
) -> _Typed:
    return "evaluator_outputs", (
        *head, body.evaluator, body.status, body.passed, body.total, body.output,
        body.output_truncated, body.job_id, *kafka,
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
        StageEvent: _stage_row,
        SandboxEvent: _sandbox_row,
        EvaluatorOutput: _evaluator_output_row,
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
    return {"events": [row], table: [typed]}


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
                rows.append(typed)
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
