"""The sink's columnar mapper (store.columnar.ColumnBatch) against the row mapper
(rows.RowBatch + chstore.arrow_tables): the same Arrow tables, row for row, for every body type
and edge value; the same records rejected with the same reasons; the same token and counts."""

from __future__ import annotations

import gc
import math
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.consumers.store import chstore
from rollstream.consumers.store.columnar import ColumnBatch
from rollstream.consumers.store.rows import RowBatch, RowError
from rollstream.consumers.store.tables import MAX_TS_US
from rollstream.consumers.store.workers import (
    MAPPING_GC_THRESHOLD,
    MapJob,
    map_batch,
    map_columns,
    mapping_gc,
)
from rollstream.schemas import (
    Branch,
    Codec,
    EvaluatorOutput,
    Event,
    LlmCall,
    PolicyVersion,
    Reward,
    RewardRecord,
    RolloutError,
    RolloutFinished,
    RolloutStarted,
    Sample,
    SandboxEvent,
    StageEvent,
    ToolCall,
    Trajectory,
    TrajectoryNode,
    Usage,
)

TS = 1_735_689_600_000_000


def _llm(i: int, **kw: Any) -> LlmCall:
    args: dict[str, Any] = dict(
        call_id=f"c{i}", parent_call_id=None if i % 2 else f"c{i - 1}", prefix_len=i,
        prompt_delta=np.arange(i % 5, dtype=np.uint32),
        completion_ids=np.arange(3, dtype=np.uint32),
        completion_logprobs=np.full(3, -0.5, np.float32), model="m", backend="b",
        policy_version=i, latency_ms=float(i), usage=Usage(i, 3, 1), drift_tokens=i % 3,
    )  # fmt: skip
    args.update(kw)
    return LlmCall(**args)


def bodies(i: int) -> list[Any]:
    """Every body type, with optional fields set and unset and non-finite floats."""
    return [
        RolloutStarted(f"task{i}", f"g{i}", attempt=i, harness="h", policy_version=i,
                       group_size=8 if i % 2 else None, run_id="run" if i % 3 else "",
                       sampling={"temperature": 0.7} if i % 2 else {}, metadata={"k": "v"}),
        RolloutStarted("t", "g", sampling={"t": float("nan")}),  # the stdlib JSON path
        _llm(i),
        _llm(i + 1, latency_ms=float("inf")),
        ToolCall(f"t{i}", "bash", '{"cmd": "ls"}', "é\n\x00ok", result_truncated=bool(i % 2),
                 is_error=not i % 2, duration_ms=1.5 * i, sandbox="bwrap" if i % 2 else None,
                 at_call_id=f"c{i}" if i % 3 else None),
        ToolCall("t", "py", duration_ms=float("-inf")),
        Reward(0.25 * i, "milestone", "tests", f"c{i}" if i % 2 else None, "pytest"),
        Reward(float("nan")),
        Branch(f"b{i}", "rewind", None if i % 2 else "c1", "edited"),
        RolloutError("proxy", "down", 503, None if i % 2 else "c2", "b1"),
        RolloutFinished("completed" if i % 2 else "timeout", None if i % 2 else "wall clock"),
        StageEvent("run" if i % 2 else "init", "finished" if i % 2 else "started",
                   "ok" if i % 2 else "", 12.5 * i, f"job{i % 3}", "w1", "é\x00why"),
        StageEvent("eval", "finished", "timeout", float("inf")),
        SandboxEvent(f"sb{i}", "ready" if i % 2 else "released", "bwrap", 3.25 * i, "job"),
        EvaluatorOutput("suite", "ok" if i % 2 else "failed", i, 2 * i, "out\n" * i,
                        bool(i % 2), f"job{i}"),
    ]  # fmt: skip


def trajectory(rid: str) -> Trajectory:
    node = TrajectoryNode("c1", None, 0, np.arange(4, dtype=np.uint32),
                          np.arange(3, dtype=np.uint32), np.zeros(3, np.float32))  # fmt: skip
    return Trajectory(
        rollout_id=rid, task_id="t", group_id="g", status="completed", score=0.5, nodes=[node],
        rewards=[RewardRecord(0.5, "partial", "tests", "c1")], last_seq=3, started_ts=TS,
    )  # fmt: skip


def both(records: list[tuple[Any, int]], topic: str = "rollout.events", partition: int = 2):
    """(RowBatch, ColumnBatch) fed the same records, and the RowErrors each raised."""
    rows, cols = RowBatch(topic, partition), ColumnBatch(topic, partition)
    errors: tuple[list[str], list[str]] = ([], [])
    for record, offset in records:
        for batch, errs in ((rows, errors[0]), (cols, errors[1])):
            try:
                batch.add(record, offset, timestamp_us=TS + offset)
            except RowError as exc:
                errs.append(f"{offset}:{exc.kind}:{exc.reason}")
    assert errors[0] == errors[1]
    assert rows.token == cols.token and len(rows) == len(cols)
    assert cols.counts == {t: len(r) for t, r in rows.tables.items() if r}
    assert cols.num_rows == rows.num_rows
    return rows, cols, errors[0]


def assert_same_tables(rows: RowBatch, cols: ColumnBatch) -> None:
    want = chstore.arrow_tables(rows.tables, rows.token)
    got = cols.arrow()
    assert set(got) == set(want)
    for name, table in want.items():
        assert got[name].schema.equals(table.schema), name
        # row for row, in order (repr: NaN equals NaN)
        assert repr(got[name].to_pylist()) == repr(table.to_pylist()), name


def test_every_body_type_gives_the_row_mappers_tables() -> None:
    records = []
    offset = 100
    for i in range(12):
        for body in bodies(i):
            ev = Event(f"e{offset}", f"r{i}", i, TS + offset, body, f"p{i % 2}",
                       schema_version=1 + i % 2)  # fmt: skip
            records.append((ev, offset))
            offset += 1 + i % 2  # gaps in the offsets, as after dead letters or compaction
    rows, cols, errors = both(records)
    assert not errors
    assert set(rows.tables) == {
        "events", "rollouts", "llm_calls", "tool_calls", "rewards", "stages", "sandboxes",
        "evaluator_outputs",
    }  # fmt: skip
    assert_same_tables(rows, cols)
    stored = cols.arrow()["rollouts"]  # started and finished rows, back in offset order
    assert stored.column("kafka_offset").to_pylist() == sorted(
        stored.column("kafka_offset").to_pylist()
    )
    assert set(stored.column("source").to_pylist()) == {"started", "finished"}


def test_bad_records_fail_alike_and_keep_their_offsets() -> None:
    good = Reward(1.0)
    records: list[tuple[Any, int]] = [
        (Event("a", "r", 0, TS, good, "p"), 0),
        (Event("b", "r", -1, TS, good, "p"), 1),  # negative seq
        (Event("", "r", 1, TS, good, "p"), 2),  # empty event_id
        (Event("c", "", 1, TS, good, "p"), 3),
        (Event("d", "r", 1, MAX_TS_US + 1, good, "p"), 4),
        (Event("e", "r", 1, TS, _llm(3, prefix_len=-1), "p"), 5),
        (Event("f", "r", 1, TS, object(), "p"), 6),  # not a body
        (Event("g", "r", 1, TS, RolloutStarted("t", "g", metadata={"k": b"\xff"}), "p"), 7),
        (Event("h", "r", 1, TS, _llm(3, usage=None), "p"), 8),  # AttributeError -> RowError
        (Event("i", "r", 2, TS, RolloutFinished("failed"), "p"), 9),
        (trajectory(""), 10),
        (Usage(), 11),
    ]
    rows, cols, errors = both(records)
    assert [e.split(":")[0] for e in errors] == [str(o) for o in range(1, 9)] + ["10", "11"]
    assert rows.token == "rollout.events:2:0:11"
    assert_same_tables(rows, cols)
    with pytest.raises(ValueError, match="not after"):
        cols.add(Event("z", "r", 1, TS, good, "p"), 11)


def test_other_records_share_tables_in_offset_order() -> None:
    pv = PolicyVersion(3, "u", 1, TS, metrics={"loss": 0.5})
    sample = Sample(
        sample_id="s1", rollout_id="r1", group_id="g", task_id="t",
        input_ids=np.arange(4, dtype=np.uint32), loss_mask=np.array([0, 1, 1, 1], np.uint8),
        behaviour_logprobs=np.zeros(4, np.float32), advantage=0.5, reward=1.0, policy_version=2,
    )  # fmt: skip
    records = [
        (trajectory("r0"), 1),
        (Event("e2", "r0", 0, TS, RolloutStarted("t", "g"), "p"), 2),
        (pv, 3),
        (Event("e4", "r0", 1, TS, RolloutFinished("completed"), "p"), 4),
        (sample, 5),
        (trajectory("r1"), 6),
        (Event("e7", "r1", 0, TS, RolloutStarted("t", "g"), "p"), 7),
    ]
    rows, cols, _ = both(records)
    assert [r[-1] for r in rows.tables["rollouts"]] == [1, 2, 4, 6, 7]
    assert_same_tables(rows, cols)


def test_values_that_do_not_fit_are_a_rejected_insert() -> None:
    cols = ColumnBatch("rollout.events", 0)
    cols.add(Event("e", "r", 1, TS, Reward(1.0), "test", schema_version=2**40), 7)  # not Int32
    with pytest.raises(chstore.InsertError) as info:
        cols.arrow()
    assert not info.value.retryable and info.value.token == "rollout.events:0:7:7:events"
    big = ColumnBatch("rollout.events", 0)
    big.add(Event("e", "r", 2**62, TS, RolloutFinished(), "test"), 1)  # version overflows
    with pytest.raises(chstore.InsertError) as info:
        big.arrow()
    assert info.value.token == "rollout.events:0:1:1:rollouts"


def test_an_empty_batch_has_no_tables() -> None:
    cols = ColumnBatch("t", 0)
    cols.skip(5)
    assert cols.arrow() == {} and cols.counts == {} and cols.token == "t:0:5:5"


text = st.text(max_size=6)
opt_text = st.none() | text
floats = st.floats(allow_nan=True, allow_infinity=True)
body_strategy = st.one_of(
    st.builds(ToolCall, text, text, text, text, st.booleans(), st.booleans(), floats, opt_text,
              opt_text),
    st.builds(Reward, floats, st.sampled_from(["final", "partial", "milestone", "penalty"]),
              text, opt_text, text),
    st.builds(RolloutStarted, text, text, st.integers(0, 2**31 - 1), text,
              st.integers(-(2**63), 2**63 - 1), st.none() | st.integers(0, 2**31 - 1), text,
              st.dictionaries(text, floats, max_size=2), st.dictionaries(text, text, max_size=2)),
    st.builds(RolloutFinished, st.sampled_from(["completed", "failed", "timeout"]), opt_text),
    st.builds(Branch, text, st.sampled_from(["retry", "fork"]), opt_text, text),
    st.builds(StageEvent, st.sampled_from(["init", "run", "eval"]),
              st.sampled_from(["started", "finished"]), text, floats, text, text, text),
    st.builds(SandboxEvent, text, st.sampled_from(["ready", "released"]), text, floats, text),
    st.builds(EvaluatorOutput, text, text, st.integers(0, 2**31 - 1),
              st.integers(0, 2**31 - 1), text, st.booleans(), text),
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(body_strategy, text, st.integers(0, 2**40), st.integers(0, MAX_TS_US), text),
        max_size=25,
    )
)
def test_random_small_events_map_alike(items: list[tuple[Any, str, int, int, str]]) -> None:
    records = [
        (Event(f"e{i}", rid or "r", seq, ts, body, producer), 10 + 2 * i)
        for i, (body, rid, seq, ts, producer) in enumerate(items)
    ]
    rows, cols, _ = both(records)
    if rows.tables:
        assert_same_tables(rows, cols)


def test_map_columns_decodes_like_map_batch() -> None:
    codec = Codec()
    values: list[bytes | None] = [
        codec.encode(Event(f"e{i}", f"r{i // 11}", i, TS + i, body, "p"))
        for i, body in enumerate(bodies(1) + bodies(2))
    ]
    values[3] = b"\x00 garbage"
    values[5] = None
    job = MapJob("rollout.events", 1, "events", f"rollout.events:1:40:{40 + len(values) - 1}",
                 list(range(40, 40 + len(values))), values)  # fmt: skip
    old, new = map_batch(job, codec), map_columns(job, codec)
    assert (new.token, new.bad, new.counts) == (old.token, old.bad, old.counts)
    assert new.columns is not None and old.rows is not None
    want = chstore.arrow_tables(old.rows, old.token)
    got = new.columns.arrow()
    assert {t: repr(a.to_pylist()) for t, a in got.items()} == {
        t: repr(a.to_pylist()) for t, a in want.items()
    }
    assert math.isinf(got["llm_calls"].column("latency_ms").to_pylist()[2])


def test_mapping_gc_raises_the_young_threshold_until_the_last_sink_leaves() -> None:
    before = gc.get_threshold()
    entered, leave = threading.Event(), threading.Event()

    def other_sink() -> None:
        with mapping_gc():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other_sink)
    with mapping_gc():
        assert gc.get_threshold()[0] == max(MAPPING_GC_THRESHOLD, before[0])
        assert gc.get_threshold()[1:] == before[1:]
        thread.start()
        assert entered.wait(10)
    assert gc.get_threshold()[0] == max(MAPPING_GC_THRESHOLD, before[0])  # the other is inside
    leave.set()
    thread.join(10)
    assert gc.get_threshold() == before


def test_binary_column_is_one_buffer() -> None:
    cols = ColumnBatch("t", 0)
    cols.add(Event("e", "r", 0, TS, Branch("b", "fork"), "p"), 0)
    cols.add(Event("f", "r", 1, TS, RolloutFinished(), "p"), 1)
    body = cols.arrow()["events"].column("body_json")
    assert body.type == pa.binary() and body.num_chunks == 1
    assert body.to_pylist() == [
        b'{"branch_id":"b","kind":"fork","source_call_id":null,"reason":""}',
        b'{"status":"completed","error":null}',
    ]
