"""Decoding and mapping the sink's batches (consumers/store/workers.py): in process and in worker
processes, the same rows, the same dead letters, the batch's own token."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rollstream.consumers.store import chstore
from rollstream.consumers.store.rows import RowBatch
from rollstream.consumers.store.workers import MapJob, MapPool, map_batch, map_to_arrow
from rollstream.schemas import (
    Branch,
    Codec,
    CommonSettings,
    Event,
    LlmCall,
    PolicyVersion,
    Reward,
    RolloutFinished,
    RolloutStarted,
    Sample,
    ToolCall,
)

TS = 1_735_689_600_000_000
codec = Codec()
SETTINGS = CommonSettings(schema_registry_url=None)  # the workers' codec: a plain Codec


def events(n: int) -> list[Event]:
    out = []
    for i in range(n):
        body: object
        k = i % 6
        if k == 0:
            body = RolloutStarted(f"task{i}", "g", policy_version=2, sampling={"t": 0.5})
        elif k == 1:
            body = LlmCall(
                f"c{i}", None, 0, np.arange(5, dtype=np.uint32), np.arange(3, dtype=np.uint32),
                np.full(3, -0.5, np.float32), model="m", latency_ms=float("nan"),
            )  # fmt: skip
        elif k == 2:
            body = ToolCall(f"t{i}", "bash", "{}", "ok", is_error=True, duration_ms=1.5)
        elif k == 3:
            body = Reward(float(i), name="pass")
        elif k == 4:
            body = Branch(f"b{i}", "retry", f"c{i}")
        else:
            body = RolloutFinished("completed")
        out.append(Event(f"e{i}", f"r{i // 6}", i % 6, TS + i, body, "test"))  # type: ignore[arg-type]
    return out


def job(values: list[bytes | None], first: int = 100, kind: str = "events") -> MapJob:
    offsets = list(range(first, first + len(values)))
    token = f"rollout.events:3:{first}:{first + len(values) - 1}"
    stamps = None if kind == "events" else [TS // 1000 * 1000] * len(values)
    return MapJob("rollout.events", 3, kind, token, offsets, values, stamps)


def test_map_batch_gives_the_rows_of_row_batch_and_lists_the_bad_records() -> None:
    evs = events(30)
    values: list[bytes | None] = [codec.encode(e) for e in evs]
    bad_ts = Event("bad", "r", 0, -5, RolloutStarted("t", "g"), "test")
    values[4] = b"\x00 not avro"
    values[9] = codec.encode(bad_ts)
    values[13] = None  # a tombstone
    values[17] = codec.encode(PolicyVersion(1, "u", 1, TS))  # the wrong record type
    result = map_batch(job(values), codec)

    expected = RowBatch("rollout.events", 3)
    for i, e in enumerate(evs):
        if i not in (4, 9, 13, 17):
            expected.add(e, 100 + i)
    assert result.token == "rollout.events:3:100:129"  # bad records stay in the range
    assert result.rows is not None and set(result.rows) == set(expected.tables)
    for table, rows in expected.tables.items():
        got = result.rows[table]
        assert len(got) == len(rows)
        for a, b in zip(got, rows, strict=True):
            assert repr(a) == repr(b)  # (NaN != NaN; arrays compare by repr)
    assert result.counts == {t: len(r) for t, r in expected.tables.items()}
    codes = {i: (code, kind) for i, code, _, kind in result.bad}
    assert codes == {
        4: ("undecodable", ""),
        9: ("unmappable", "RolloutStarted"),
        13: ("undecodable", ""),
        17: ("undecodable", ""),
    }
    reasons = {i: reason for i, _, reason, _ in result.bad}
    assert "ts -5" in reasons[9] and "expected Event" in reasons[17]


def test_map_to_arrow_builds_the_tables_the_store_would() -> None:
    evs = events(12)
    result = map_to_arrow(job([codec.encode(e) for e in evs]), codec)
    assert result.rows is None and result.arrow is not None and result.arrow_error is None
    b = RowBatch("rollout.events", 3)
    for i, e in enumerate(evs):
        b.add(e, 100 + i)
    want = chstore.arrow_tables(b.tables, b.token)
    assert set(result.arrow) == set(want)
    for table, arrow in want.items():
        assert _same(result.arrow[table], arrow), table


def test_samples_get_their_kafka_time() -> None:
    sample = Sample(
        sample_id="s1", rollout_id="r1", group_id="g1", task_id="t1",
        input_ids=np.arange(4, dtype=np.uint32), loss_mask=np.array([0, 1, 1, 1], np.uint8),
        behaviour_logprobs=np.zeros(4, np.float32), advantage=0.5, reward=1.0, policy_version=2,
    )  # fmt: skip
    result = map_batch(job([codec.encode(sample)], kind="samples"), codec)
    assert not result.bad and result.rows is not None
    assert result.rows["samples"][0][4] == TS // 1000 * 1000  # ts column: the Kafka time


def _same(a: object, b: object) -> bool:
    """Arrow tables with equal values (NaN equal to NaN: repr of the Python values)."""
    return repr(a.to_pylist()) == repr(b.to_pylist())  # type: ignore[attr-defined]


def test_rows_that_do_not_fit_their_columns_are_a_rejected_insert() -> None:
    rows = RowBatch("rollout.events", 0)
    rows.add(Event("e", "r", 1, TS, Reward(1.0), "test", schema_version=2**40), 7)  # not Int32
    with pytest.raises(chstore.InsertError) as info:
        chstore.arrow_tables(rows.tables, rows.token)
    assert not info.value.retryable and info.value.token == "rollout.events:0:7:7:events"


def test_pool_workers_give_the_same_results_in_order_and_die_with_the_sink() -> None:
    evs = events(40)
    jobs = [job([codec.encode(e) for e in evs[i : i + 10]], first=i) for i in range(0, 40, 10)]
    jobs[2].values[1] = b"garbage"
    pool = MapPool(2, SETTINGS)
    try:
        pool.warm_up()
        futures = [pool.submit(j) for j in jobs]
        for j, future in zip(jobs, futures, strict=True):
            got, want = future.result(60), map_to_arrow(j, codec)
            assert got.token == j.token and got.bad == want.bad and got.counts == want.counts
            assert got.arrow is not None and want.arrow is not None
            assert all(_same(got.arrow[t], want.arrow[t]) for t in want.arrow)
        pids = [w.proc.pid for w in pool._workers]
    finally:
        pool.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_dead_worker_fails_its_jobs() -> None:
    pool = MapPool(1, SETTINGS)
    try:
        pool.warm_up()
        pool._workers[0].proc.kill()
        future = pool.submit(job([codec.encode(events(1)[0])]))
        with pytest.raises(RuntimeError, match="died"):
            future.result(30)
    finally:
        pool.close()


def test_workers_die_when_the_sink_is_killed() -> None:
    code = (
        "from rollstream.consumers.store.workers import MapPool\n"
        "from rollstream.schemas import CommonSettings\n"
        "pool = MapPool(2, CommonSettings()); pool.warm_up()\n"
        "print(*[w.proc.pid for w in pool._workers], flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.05)
    assert not alive, f"workers {alive} outlived their sink"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False
