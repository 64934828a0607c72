"""The processor's shell logic without faust (streams/books.py, streams/offsets.py): steps,
DLQ records, timeouts, and a simulated SIGKILL at every point of a run (durable changelog
prefix, outputs acknowledged or not, any committed offset the flush-before-commit rule allows)
followed by a rebuild: nothing is lost."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
from aiokafka.partitioner import DefaultPartitioner

from rollstream.schemas import (
    Codec,
    Event,
    LlmCall,
    Reward,
    RolloutFinished,
    RolloutStarted,
    Sample,
    Trajectory,
)
from rollstream.schemas.dlq import read_headers
from rollstream.streams.aggregation import GroupBook
from rollstream.streams.app import group_route
from rollstream.streams.books import Out, PartitionClock, RolloutBook, Sink, Step
from rollstream.streams.core import (
    BuilderConfig,
    GroupClosed,
    GroupConfig,
    add_to_group,
    replay,
)
from rollstream.streams.offsets import Admit, OffsetGuard

codec = Codec()
T0 = 1_700_000_000_000_000
TOPIC = "ns.rollout.events"


def make_rollout(
    rng: np.random.Generator, rid: str, gid: str, *, size: int = 2, turns: int = 2, ts: int = T0
) -> list[Event]:
    events: list[Event] = []

    def add(body: Any) -> None:
        events.append(Event(f"{rid}-{len(events)}", rid, len(events), ts + len(events), body))

    add(RolloutStarted(task_id="t", group_id=gid, group_size=size))
    parent, prefix = None, 0
    for turn in range(turns):
        call = f"{rid}-c{turn}"
        ids = rng.integers(0, 100, 4, dtype=np.uint32)
        add(LlmCall(call, parent, prefix, ids, ids[:2].copy(), np.zeros(2, np.float32)))
        parent, prefix = call, prefix + 6
    add(Reward(float(rng.random())))
    add(RolloutFinished())
    return events


def records(events: list[Event]) -> list[tuple[bytes, bytes]]:
    return [(e.rollout_id.encode(), codec.encode(e)) for e in events]


def book() -> RolloutBook:
    return RolloutBook(BuilderConfig(), codec, source_topic=TOPIC, processor="p")


def run_all(b: RolloutBook, recs: list[tuple[bytes, bytes]]) -> list[Step]:
    return [b.on_record(0, i, k, v, T0) for i, (k, v) in enumerate(recs)]


# --- builder ---------------------------------------------------------------------------------


def test_a_rollout_writes_each_event_once_and_its_tombstone_after_the_trajectory() -> None:
    events = make_rollout(np.random.default_rng(0), "r1", "g1")
    steps = run_all(book(), records(events))
    for step in steps:
        assert not step.barrier and len(step.writes) == 1 and step.writes[0][1] is not None
    for step in steps[:-1]:
        assert step.sends == [] and step.deferred == []
    close = steps[-1]
    assert [o.sink for o in close.sends] == [Sink.TRAJECTORIES]
    (want,) = replay(events)[1]
    assert codec.decode(close.sends[0].value) == want
    assert dict(close.sends[0].headers) == {"group_id": b"g1"}
    tombstone, *deletes = close.deferred  # written once the trajectory is acknowledged
    assert tombstone[0].startswith(b"c/0/") and tombstone[1]
    assert sorted(k for k, v in deletes if v is None) == sorted(s.writes[0][0] for s in steps)
    assert close.on_done is not None


def test_duplicates_write_nothing_and_garbage_goes_to_the_dlq() -> None:
    b = book()
    events = make_rollout(np.random.default_rng(1), "r1", "g1")
    recs = records(events)
    run_all(b, recs[:2])
    assert b.on_record(0, 7, *recs[1], T0) == Step(0)  # a re-sent event
    step = b.on_record(3, 9, b"junk", b"\x00garbage", T0)
    (out,) = step.sends
    headers = read_headers(out.headers)
    assert (out.sink, out.key, out.value, step.writes) == (Sink.DLQ, b"junk", b"\x00garbage", [])
    assert headers["code"] == "undecodable" and headers["reason"]
    assert (headers["original_topic"], headers["original_partition"]) == (TOPIC, "3")
    assert (headers["original_offset"], headers["stage"], headers["processor"]) == (
        "9",
        "builder",
        "p",
    )
    (out,) = b.on_record(0, 10, b"other-key", recs[2][1], T0).sends
    assert read_headers(out.headers)["code"] == "wrong_key"


def test_a_consumed_invalid_event_is_written_after_its_dlq_record() -> None:
    events = make_rollout(np.random.default_rng(2), "r1", "g1")
    events[-2].body = Reward(float("nan"))
    steps = run_all(book(), records(events))
    bad = steps[-2]
    (out,) = bad.sends
    assert bad.barrier and len(bad.writes) == 1  # the seq is consumed: replay must not skip it
    assert read_headers(out.headers)["code"] == "bad_reward"


def test_inactivity_timeout_closes_and_old_tombstones_are_forgotten() -> None:
    b = book()
    events = make_rollout(np.random.default_rng(3), "r1", "g1")[:-1]  # never finished
    run_all(b, records(events))
    timeout = b.config.inactivity_timeout_us
    assert b.expire(T0 + timeout // 2) == []
    (step,) = b.expire(T0 + timeout + 10)
    trajectory = codec.decode(step.sends[0].value)
    assert trajectory.status == "truncated" and step.deferred[0][0].startswith(b"c/")
    assert "r1" in b.closed and "r1" not in b.open
    assert b.expire(T0 + 2 * timeout) == []  # busy until the shell ran the step
    step.on_done()
    (evict,) = b.expire(T0 + timeout + b.config.closed_retention_us + 100)
    assert evict.writes == [(step.deferred[0][0], None)] and b.closed == {}


def test_the_clock_follows_event_time_and_moves_on_when_idle() -> None:
    clock = PartitionClock()
    clock.observe(0, 1_000, wall_us=50_000)  # a replay of old events
    assert clock.now(0, 50_000) == 1_000
    clock.observe(0, 900, 50_010)  # an older event does not move it back
    assert clock.now(0, 60_000) == 11_000  # idle: wall time passes
    assert clock.now(1, 70_000) == 70_000  # a partition never seen: the wall clock


def test_a_clock_ahead_moves_no_partition_clock_past_real_time() -> None:
    clock = PartitionClock(max_ahead_us=30_000_000, real_now=lambda: T0)
    assert clock.observe(0, T0 - 5, wall_us=T0) is False  # live, on time
    assert clock.observe(0, T0 + 600_000_000, wall_us=T0) is True  # 10 minutes ahead
    assert clock.now(0, T0) == T0 + 30_000_000  # the bound, not the producer's clock
    assert clock.observe(1, T0 - 86_400_000_000, wall_us=T0) is False  # a replay: in the past
    assert PartitionClock(30, None).observe(0, T0 + 10**12, T0) is False  # no real clock: off


def test_one_producer_ahead_times_out_no_other_rollout() -> None:
    """Rollout A (on time) and rollout B, whose producer's clock is 10 minutes ahead, on one
    partition, a 60 s inactivity timeout: B's event must not close A."""
    rng = np.random.default_rng(3)
    timeout = 60_000_000

    def run(max_ahead: int | None) -> RolloutBook:
        b = RolloutBook(BuilderConfig(inactivity_timeout_us=timeout), codec, source_topic=TOPIC)
        b.clock = PartitionClock(max_ahead, real_now=lambda: T0 + 1_000)
        a = make_rollout(rng, "a", "ga", ts=T0)[:2]  # started, one call: open
        late = make_rollout(rng, "b", "gb", ts=T0 + 600_000_000)[:1]
        for i, (k, v) in enumerate(records(a + late)):
            b.on_record(0, i, k, v, T0 + 1_000)
        b.expire(T0 + 2_000)
        return b

    trusting = run(None)  # the failure mode: the clock follows B and A times out
    assert "a" in trusting.closed
    bounded = run(30_000_000)
    assert set(bounded.open) == {"a", "b"} and bounded.stats["future_ts"] == 1


# --- crash anywhere, rebuild, replay from the committed offset ---------------------------------


def crash_and_recover(
    make_book: Any, recs: list[tuple[bytes, bytes]], rng: random.Random
) -> list[Out]:
    """Run the records; SIGKILL at a random point; rebuild from what the changelog kept;
    replay from a committed offset the flush-before-commit rule allows. Returns every output
    that reached Kafka, before and after the crash.

    The changelog is one ordered log: each step's writes in step order, its deferred writes
    issued at some later point (once its sends were acknowledged); a crash keeps a prefix.
    A step's sends reached Kafka if its barrier writes or its deferred writes are in that
    prefix, or if its record is below the committed offset (flushed), else maybe."""
    first = make_book()
    processed = rng.randrange(len(recs) + 1)  # records processed before the crash
    steps = [first.on_record(0, i, *recs[i], T0) for i in range(processed)]
    log: list[tuple[int, str, bytes, bytes | None]] = []  # (step, kind, key, value)
    later: dict[int, list[int]] = {}  # step index -> steps whose deferred writes come after it
    for i in range(len(steps)):
        later.setdefault(rng.randrange(i, len(steps)), []).append(i)
    for i, step in enumerate(steps):
        log += [(i, "w", k, v) for k, v in step.writes]
        for j in later.get(i, []):
            log += [(j, "d", k, v) for k, v in steps[j].deferred]
    kept = log[: rng.randrange(len(log) + 1)]
    table: dict[bytes, bytes] = {}
    for _, _, key, value in kept:
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value
    written = {(i, kind) for i, kind, _, _ in kept}
    # the committed offset: every write of the records below it is in the kept prefix
    committed = 0
    while committed < processed and ((committed, "w") in written or not steps[committed].writes):
        committed += 1
    committed = rng.randrange(committed + 1)
    durable: list[Out] = []
    for i, step in enumerate(steps):
        acked = (i, "d") in written or (step.barrier and (i, "w") in written) or i < committed
        if acked or rng.random() < 0.5:
            durable += step.sends
    second = make_book()
    after = [o for s in second.rebuild(list(table.items()), {0}, T0) for o in s.sends]
    for i in range(committed, len(recs)):
        after += second.on_record(0, i, *recs[i], T0).sends
    return durable + after


def test_rollouts_survive_a_crash_at_any_point() -> None:
    rng = np.random.default_rng(4)
    rollouts = [make_rollout(rng, f"r{i}", f"g{i // 2}") for i in range(6)]
    rollouts[2][3].body = Reward(float("inf"))  # one in-order violation for the DLQ
    events = [e for i in range(6) for r in rollouts for e in r[i : i + 1]]  # interleaved
    recs = records(events)
    want = {t.rollout_id: t for t in replay(events)[1] if isinstance(t, Trajectory)}
    for seed in range(150):
        outs = crash_and_recover(book, recs, random.Random(seed))
        got = {
            codec.decode(o.value).rollout_id: codec.decode(o.value)
            for o in outs
            if o.sink == "trajectories"
        }
        assert got == want, seed
        assert any(read_headers(o.headers).get("code") == "bad_reward" for o in outs), seed


def test_groups_survive_a_crash_at_any_point() -> None:
    rng = np.random.default_rng(5)
    events = [e for i in range(8) for e in make_rollout(rng, f"r{i}", f"g{i // 2}")]
    trajectories = [t for t in replay(events)[1] if isinstance(t, Trajectory)]
    config = GroupConfig()
    want: dict[str, Sample] = {}
    states: dict[str, Any] = {}
    for t in trajectories:
        states[t.group_id], outs = add_to_group(states.get(t.group_id), t, config)
        want.update((s.sample_id, s) for o in outs if isinstance(o, GroupClosed) for s in o.samples)
    recs = [(t.group_id.encode(), codec.encode(t)) for t in trajectories]
    assert len(want) == 8

    def make() -> GroupBook:
        return GroupBook(config, codec, source_topic="by-group", processor="p")

    for seed in range(150):
        outs = crash_and_recover(make, recs, random.Random(seed))
        got = {}
        for o in outs:
            assert o.sink == Sink.SAMPLES
            sample = codec.decode(o.value, expect=Sample)
            got[sample.sample_id] = sample
        assert got == want, seed


# --- routing by group and the offset guard ----------------------------------------------------


def test_trajectories_go_to_their_groups_partition_and_stray_ones_to_the_dlq() -> None:
    route = group_route(6)
    # the partition Kafka's default partitioner (murmur2) gives a group_id key: where the
    # group's samples go too
    groups_ids = ("g0", "g1", "step12-fizzbuzz-7", "")
    assert [route(g) for g in groups_ids] == [3, 2, 5, 3]
    partitioner = DefaultPartitioner()
    assert [route(g) for g in groups_ids] == [
        partitioner(g.encode(), list(range(6)), list(range(6))) for g in groups_ids
    ]
    rng = np.random.default_rng(6)
    b = RolloutBook(BuilderConfig(), codec, source_topic=TOPIC, processor="p", route=route)
    events = [e for i in range(8) for e in make_rollout(rng, f"r{i}", f"g{i // 2}")]
    outs = [o for s in run_all(b, records(events)) for o in s.sends]
    assert len(outs) == 8 and {o.sink for o in outs} == {Sink.TRAJECTORIES}
    for out in outs:
        trajectory = codec.decode(out.value, expect=Trajectory)
        assert out.key == trajectory.rollout_id.encode()  # the contract's key
        assert out.partition == route(trajectory.group_id)  # the group's partition
    plain = [o for s in run_all(book(), records(events)) for o in s.sends]  # no route: by key
    assert len(plain) == 8 and {o.partition for o in plain} == {None}
    groups = GroupBook(GroupConfig(), codec, source_topic="t", processor="p", route=route)
    raw = outs[0].value
    home = outs[0].partition
    assert home is not None
    stray = (home + 1) % 6
    (out,) = groups.on_record(stray, 5, outs[0].key, raw, T0).sends
    headers = read_headers(out.headers)
    assert (out.sink, out.key, out.value) == (Sink.DLQ, outs[0].key, raw)
    assert (headers["code"], headers["stage"], headers["original_partition"]) == (
        "misrouted",
        "aggregator",
        str(stray),
    )
    assert groups.open == {}
    step = groups.on_record(home, 6, outs[0].key, raw, T0)
    assert step.sends == [] and len(step.writes) == 1 and "g0" in groups.open


def test_the_offset_guard_refills_holes_and_skips_repeats() -> None:
    guard = OffsetGuard(retry_s=1.0, accept_after=2)
    a, b = ("t", 0), ("t", 1)
    guard.reset({a: 10, b: None}, now=0.0)
    assert guard.admit(b, 5, 0.0) == (Admit.PROCESS, 5)  # no committed offset: any start
    assert guard.admit(a, 10, 0.0) == (Admit.PROCESS, 10)
    assert guard.admit(a, 13, 0.0) == (Admit.SEEK, 11)  # 11 and 12 never came
    assert guard.admit(a, 14, 0.5) == (Admit.SKIP, 11)  # seeked a moment ago
    assert guard.admit(a, 11, 0.6) == (Admit.PROCESS, 11)  # refilled
    assert guard.admit(a, 11, 0.6) == (Admit.SKIP, 12)  # a repeat
    assert guard.admit(a, 12, 0.7) == (Admit.PROCESS, 12)
    ends = {a: 15, b: 6}.get
    assert guard.due(1.0, ends) == []  # a record came 0.3 s ago
    assert guard.due(1.8, ends) == []  # behind and quiet: suspect from now
    assert guard.due(2.5, ends) == []
    assert guard.due(2.9, ends) == [(a, 13)]  # still: a stall, seek
    assert guard.due(4.0, {a: 13, b: 6}.get) == []  # caught up: nothing to fetch
    busy = OffsetGuard(retry_s=1.0)
    busy.reset({a: 0, b: 0}, now=0.0)
    for t in range(1, 6):  # b keeps the worker busy: a waits its turn, it is not stalled
        assert busy.admit(b, t - 1, float(t)) == (Admit.PROCESS, t - 1)
        assert busy.due(t + 0.5, {a: 9, b: 99}.get) == []
    assert guard.admit(a, 20, 4.1) == (Admit.SEEK, 13)
    assert guard.admit(a, 20, 5.2) == (Admit.ACCEPT, 13)  # a real gap after 2 seeks
    assert guard.admit(a, 21, 5.2) == (Admit.PROCESS, 21)
    assert (guard.seeks, guard.accepted) == (3, 1)
