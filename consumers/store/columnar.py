"""Rollout events mapped straight to Arrow columns: the sink's fast path for small events.

``ColumnBatch`` is ``rows.RowBatch`` without the row tuples: ``add`` checks each record as
``RowBatch.add`` does (the same records raise the same ``RowError``; the same offsets name the
batch), keeps the Events that map, and ``arrow()`` builds each table's columns in one C-level
pass over the kept records (``operator.attrgetter`` over a list) instead of a tuple per row
and a transpose. Constant columns (``kafka_topic``, ``source``, ...) are ``pa.repeat``.
The tables are those ``chstore.arrow_tables(RowBatch.tables)`` gives, row for row and in the
same order (tests/unit/test_sink_columnar.py). What has no column spec here — LlmCall's typed
row (token arrays), trajectories, samples, policy versions — goes through the row mapper and
``chstore.to_arrow``; a table fed by both is ordered by ``kafka_offset``, the order in which
RowBatch adds rows (one partition: one row per offset per table).

A value that does not fit its column (an Int32 out of range, ...) fails ``arrow()`` with the
non-retryable ``chstore.InsertError`` that ``chstore.arrow_tables`` raises for such rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from rollstream.consumers.store import chstore
from rollstream.consumers.store.rows import (
    _TYPED_ROWS,
    OffsetRange,
    RowError,
    _body_json,
    _check_event,
    rows_for_record,
)
from rollstream.consumers.store.tables import COLUMNS, TABLES, TableRows
from rollstream.schemas import (
    EvaluatorOutput,
    Event,
    Record,
    Reward,
    RolloutFinished,
    RolloutStarted,
    SandboxEvent,
    StageEvent,
    ToolCall,
)

__all__ = ["ColumnBatch"]

# How each column of a body's typed table is read from (event, body). Kinds:
#   ("e", attr)     the event's attribute       ("b", attr)   the body's attribute
#   ("b?", attr)    the body's, None as ""      ("c", value)  a constant
#   ("v", rank)     rollouts.version: seq * 4 + rank
# kafka_topic / kafka_partition / kafka_offset come from the batch.
_Spec = tuple[str, Any]
_HEAD: dict[str, _Spec] = {
    "event_id": ("e", "event_id"),
    "rollout_id": ("e", "rollout_id"),
    "seq": ("e", "seq"),
    "ts": ("e", "ts"),
}
_NAN = float("nan")
_SPECS: dict[type, tuple[str, dict[str, _Spec]]] = {
    ToolCall: ("tool_calls", {
        **_HEAD, "tool_call_id": ("b", "tool_call_id"), "name": ("b", "name"),
        "arguments": ("b", "arguments"), "result": ("b", "result"),
        "result_truncated": ("b", "result_truncated"), "is_error": ("b", "is_error"),
        "duration_ms": ("b", "duration_ms"), "sandbox": ("b?", "sandbox"),
        "at_call_id": ("b?", "at_call_id"),
    }),
    Reward: ("rewards", {
        **_HEAD, "value": ("b", "value"), "kind": ("b", "kind"), "name": ("b", "name"),
        "at_call_id": ("b?", "at_call_id"), "evaluator": ("b", "evaluator"),
    }),
    RolloutStarted: ("rollouts", {
        "rollout_id": ("e", "rollout_id"), "source": ("c", "started"), "version": ("v", 0),
        "ts": ("e", "ts"), "task_id": ("b", "task_id"), "group_id": ("b", "group_id"),
        "run_id": ("b", "run_id"), "attempt": ("b", "attempt"),
        "group_size": ("b?", "group_size"), "harness": ("b", "harness"),
        "policy_version": ("b", "policy_version"), "status": ("c", "running"),
        "error": ("c", ""), "score": ("c", _NAN), "num_events": ("c", 0),
        "num_llm_calls": ("c", 0), "num_completion_tokens": ("c", 0),
        "started_ts": ("e", "ts"), "finished_ts": ("c", 0),
    }),
    RolloutFinished: ("rollouts", {
        "rollout_id": ("e", "rollout_id"), "source": ("c", "finished"), "version": ("v", 1),
        "ts": ("e", "ts"), "task_id": ("c", ""), "group_id": ("c", ""), "run_id": ("c", ""),
        "attempt": ("c", 0), "group_size": ("c", 0), "harness": ("c", ""),
        "policy_version": ("c", 0), "status": ("b", "status"), "error": ("b?", "error"),
        "score": ("c", _NAN), "num_events": ("c", 0), "num_llm_calls": ("c", 0),
        "num_completion_tokens": ("c", 0), "started_ts": ("c", 0), "finished_ts": ("e", "ts"),
    }),
    StageEvent: ("stages", {
        **_HEAD, "job_id": ("b", "job_id"), "stage": ("b", "stage"), "phase": ("b", "phase"),
        "status": ("b", "status"), "duration_ms": ("b", "duration_ms"),
        "worker": ("b", "worker"), "reason": ("b", "reason"),
    }),
    SandboxEvent: ("sandboxes", {
        **_HEAD, "sandbox_id": ("b", "sandbox_id"), "phase": ("b", "phase"),
        "kind": ("b", "kind"), "duration_ms": ("b", "duration_ms"), "job_id": ("b", "job_id"),
    }),
    EvaluatorOutput: ("evaluator_outputs", {
        **_HEAD, "evaluator": ("b", "evaluator"), "status": ("b", "status"),
        "passed": ("b", "passed"), "total": ("b", "total"), "output": ("b", "output"),
        "output_truncated": ("b", "output_truncated"), "job_id": ("b", "job_id"),
    }),
}  # fmt: skip
_KAFKA = ("kafka_topic", "kafka_partition", "kafka_offset")
for _table, _spec in _SPECS.values():  # every column has a source: checked at import
    _missing = set(COLUMNS[_table]) - set(_spec) - set(_KAFKA)
    if _missing or list(_spec) != [c for c in COLUMNS[_table] if c not in _KAFKA]:
        raise RuntimeError(f"columnar spec of {_table} does not match its columns: {_missing}")


def _array(values: Sequence[Any], kind: str) -> pa.Array:
    return pa.array(values, type=chstore._SCALAR[kind])


def _binary(data: bytearray, ends: list[int]) -> pa.Array:
    """A binary column from its values end to end and their end offsets (``[0, ...]``)."""
    if ends[-1] >= 2**31:
        raise ValueError(f"{ends[-1]} bytes of binary values do not fit one Arrow array")
    offsets = np.array(ends, dtype=np.int32)
    return pa.Array.from_buffers(
        pa.binary(), len(ends) - 1, [None, pa.py_buffer(offsets), pa.py_buffer(bytes(data))]
    )


class ColumnBatch(OffsetRange):
    """Columns of consecutive messages of one topic partition (module docstring). Same offset
    bookkeeping as ``RowBatch`` (``OffsetRange``: its token); ``add`` counts the offset even
    when the record fails to map (and re-raises its RowError)."""

    def __init__(self, topic: str, partition: int) -> None:
        super().__init__(topic, partition)
        self._events: list[Event] = []  # Events that mapped, in offset order
        self._offsets: list[int] = []
        # body_json values end to end in one buffer: keeping 20k fresh bytes objects alive
        # until the insert made their encoding ~3x slower (2.2 -> 0.6 us each, measured)
        self._json = bytearray()
        self._json_ends: list[int] = [0]
        self._kinds: list[str] = []
        self._typed: dict[type, tuple[list[Event], list[int]]] = {}  # body class -> its events
        self._rows: TableRows = {}  # rows of what has no column spec (row mapper)

    def add(self, record: Record, offset: int, *, timestamp_us: int = 0) -> None:
        self._consume(offset)
        if type(record) is not Event:
            found = rows_for_record(
                record, self.topic, self.partition, offset, timestamp_us=timestamp_us
            )
            for table, table_rows in found.items():
                self._rows.setdefault(table, []).extend(table_rows)
            return
        try:
            kind = _check_event(record)
            body = record.body
            try:
                body_json = _body_json(body)
            except (TypeError, ValueError, orjson.JSONEncodeError) as exc:
                raise RowError(f"body is not JSON-able: {exc}", kind) from exc
            cls = type(body)
            typed = None
            if cls not in _SPECS:  # LlmCall (token arrays), Branch, RolloutError: row mapper
                head = (record.event_id, record.rollout_id, record.seq, record.ts)
                typed = _TYPED_ROWS[cls](record, body, head, (self.topic, self.partition, offset))
        except RowError:
            raise
        except (AttributeError, TypeError, ValueError, OverflowError) as exc:
            raise RowError(f"{type(exc).__name__}: {exc}", "Event") from exc
        self._events.append(record)
        self._offsets.append(offset)
        json_buf = self._json
        json_buf += body_json
        self._json_ends.append(len(json_buf))
        self._kinds.append(kind)
        if typed is not None:
            self._rows.setdefault(typed[0], []).append(typed[1])
        elif cls in _SPECS:
            group = self._typed.get(cls)
            if group is None:
                group = self._typed[cls] = ([], [])
            group[0].append(record)
            group[1].append(offset)

    def skip(self, offset: int) -> None:
        """Count a consumed message that produced no rows (e.g. undecodable, dead-lettered)."""
        self._consume(offset)

    @property
    def counts(self) -> dict[str, int]:
        """Rows per table (tables without rows are left out)."""
        out: dict[str, int] = {}
        if self._events:
            out["events"] = len(self._events)
        for cls, (events, _) in self._typed.items():
            table = _SPECS[cls][0]
            out[table] = out.get(table, 0) + len(events)
        for table, rows in self._rows.items():
            if rows:
                out[table] = out.get(table, 0) + len(rows)
        return out

    @property
    def num_rows(self) -> int:
        return sum(self.counts.values())

    def __len__(self) -> int:
        return self.messages

    # --- Arrow ------------------------------------------------------------------------------

    def arrow(self) -> dict[str, pa.Table]:
        """Each non-empty table as an Arrow table (``chstore.arrow_tables``' columns and row
        order); values that do not fit their columns raise a non-retryable InsertError."""
        parts: dict[str, list[pa.Table]] = {}
        table = "events"
        try:
            if self._events:
                parts["events"] = [self._events_table()]
            for cls, (events, offsets) in self._typed.items():
                table = _SPECS[cls][0]
                parts.setdefault(table, []).append(self._typed_table(cls, events, offsets))
        except (KeyError, ValueError, TypeError, OverflowError, pa.ArrowException) as exc:
            raise chstore.InsertError(
                f"rows for {table} do not fit its columns: {exc}",
                table=table,
                token=f"{self.token}:{table}",
                retryable=False,
            ) from exc
        for name, arrow in chstore.arrow_tables(self._rows, self.token).items():
            parts.setdefault(name, []).append(arrow)
        out: dict[str, pa.Table] = {}
        for name, tables in parts.items():
            if len(tables) == 1:
                out[name] = tables[0]
            else:  # rows of one table from several sources: back in offset order
                merged = pa.concat_tables(tables)
                order = pc.sort_indices(merged.column("kafka_offset"))
                out[name] = merged.take(order).combine_chunks()
        return out

    def _kafka(self, offsets: list[int]) -> list[pa.Array]:
        n = len(offsets)
        return [
            pa.repeat(pa.scalar(self.topic, pa.string()), n),
            pa.repeat(pa.scalar(self.partition, pa.int32()), n),
            pa.array(offsets, type=pa.int64()),
        ]

    def _events_table(self) -> pa.Table:
        events = self._events
        get = _column_getter
        columns = [
            _array(get("event_id")(events), "str"),
            _array(get("rollout_id")(events), "str"),
            _array(get("seq")(events), "u64"),
            _array(get("ts")(events), "ts"),
            _array(self._kinds, "str"),
            _array(get("producer")(events), "str"),
            _array(get("schema_version")(events), "i32"),
            _binary(self._json, self._json_ends),
            *self._kafka(self._offsets),
        ]
        return pa.Table.from_arrays(columns, names=list(COLUMNS["events"]))

    def _typed_table(self, cls: type, events: list[Event], offsets: list[int]) -> pa.Table:
        table, spec = _SPECS[cls]
        n = len(events)
        bodies = list(map(_BODY, events))
        columns: list[pa.Array] = []
        for col in TABLES[table]:
            if col.name in _KAFKA:
                continue
            how, arg = spec[col.name]
            kind = col.kind
            if how == "e":
                columns.append(_array(_column_getter(arg)(events), kind))
            elif how == "b":
                columns.append(_array(_column_getter(arg)(bodies), kind))
            elif how == "b?":  # ``value or <zero>``, as the row mapper writes None
                zero = _ZERO[kind]
                columns.append(_array([v or zero for v in map(attrgetter(arg), bodies)], kind))
            elif how == "v":
                columns.append(_array([s * 4 + arg for s in map(_SEQ, events)], kind))
            else:
                columns.append(pa.repeat(pa.scalar(arg, chstore._SCALAR[kind]), n))
        columns += self._kafka(offsets)
        return pa.Table.from_arrays(columns, names=list(COLUMNS[table]))


_BODY = attrgetter("body")
_SEQ = attrgetter("seq")
_ZERO: dict[str, Any] = {"str": "", "i32": 0}


def _column_getter(name: str) -> Callable[[list[Any]], list[Any]]:
    get = attrgetter(name)
    return lambda items: list(map(get, items))
