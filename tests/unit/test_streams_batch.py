"""The batch path (streams/batch.py) against the faust agents' loop over the same books without
faust (builder steps, the aggregator reading what the builder wrote, a timer tick after every
record, then wall time passing): the same samples and trajectories byte for byte, for the
golden logs and generated runs, whatever the interleaving, shuffled and duplicated; timeouts
closed the same way; a record at a time (bounded memory) the same as all at once."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.schemas import (
    Codec,
    Event,
    LlmCall,
    Reward,
    RolloutFinished,
    RolloutStarted,
    Sample,
    SampleMode,
    Trajectory,
)
from rollstream.schemas.dlq import read_headers
from rollstream.streams.aggregation import GroupBook
from rollstream.streams.app import group_route
from rollstream.streams.batch import (
    BatchConfig,
    BatchOutput,
    BatchProcessor,
    SourceRecord,
    process_batch,
)
from rollstream.streams.books import Out, RolloutBook, Sink, Step
from rollstream.streams.core import (
    AdvantageConfig,
    BuilderConfig,
    GroupConfig,
    Phase,
    SampleConfig,
)
from rollstream.streams.errors import StreamsError

GOLDEN = Path(__file__).parent.parent / "fixtures" / "golden"
CASES = sorted(p.name.removesuffix(".events.jsonl") for p in GOLDEN.glob("*.events.jsonl"))
codec = Codec()
T0 = 1_767_225_600_000_000
S = 1_000_000  # a second, in microseconds
ROUTE = group_route(6)  # the contract's trajectories topic: 6 partitions
EVENTS_ROUTE = group_route(3)
OPEN = (Phase.NEW, Phase.RUNNING)


def one_partition(ident: str) -> int:
    """A topic of one partition: one clock for everything."""
    return 0


def golden(case: str) -> list[Event]:
    lines = (GOLDEN / f"{case}.events.jsonl").read_text().splitlines()
    return [Event.from_json(json.loads(line)) for line in lines]


def config(mode: SampleMode = SampleMode.PATH, route: Any = ROUTE, **groups: Any) -> BatchConfig:
    """Every group yields samples (no zero-variance drop), unless asked otherwise."""
    adv = AdvantageConfig(drop_zero_variance=groups.pop("drop_zero_variance", False))
    builder = BuilderConfig(inactivity_timeout_us=groups.pop("inactivity_us", 600 * S))
    grouping = GroupConfig(advantage=adv, samples=SampleConfig(mode=mode), **groups)
    return BatchConfig(builder=builder, groups=grouping, route=route, event_partition=EVENTS_ROUTE)


def records(events: list[Event], where: Any = EVENTS_ROUTE) -> list[SourceRecord]:
    """What a producer keyed by rollout_id writes, each partition's offsets in order."""
    offsets: dict[int, int] = defaultdict(int)
    out = []
    for e in events:
        p = where(e.rollout_id)
        out.append(SourceRecord(p, offsets[p], e.rollout_id.encode(), codec.encode(e)))
        offsets[p] += 1
    return out


def make_rollout(
    rng: np.random.Generator,
    rid: str,
    gid: str,
    *,
    size: int | None,
    start: int = T0,
    turns: int = 3,
    finish: bool = True,
) -> list[Event]:
    events: list[Event] = []

    def add(body: Any) -> None:
        seq = len(events)
        events.append(Event(f"{rid}-{seq:03d}", rid, seq, start + seq * S, body, "unit"))

    add(RolloutStarted(task_id=f"task-{gid}", group_id=gid, group_size=size))
    parent, prefix = None, 0
    for turn in range(turns):
        call = f"{rid}-c{turn}"
        delta = rng.integers(0, 500, int(rng.integers(1, 12)), dtype=np.uint32)
        completion = rng.integers(0, 500, int(rng.integers(1, 6)), dtype=np.uint32)
        logprobs = -rng.random(len(completion), dtype=np.float32)
        add(LlmCall(call, parent, prefix, delta, completion, logprobs))
        parent, prefix = call, prefix + len(delta) + len(completion)
    add(Reward(float(rng.integers(0, 3))))
    if finish:
        add(RolloutFinished())
    return events


def finished_run(seed: int, groups: int = 6, size: int = 4) -> list[list[Event]]:
    """Whole groups of finished rollouts (and the golden logs), each rollout's events in order."""
    rng = np.random.default_rng(seed)
    rollouts = [
        make_rollout(rng, f"s{seed}-g{g}-r{r}", f"s{seed}-g{g}", size=size, start=T0 + g * S)
        for g in range(groups)
        for r in range(size)
    ]
    for case in CASES:
        by_rollout: dict[str, list[Event]] = defaultdict(list)
        for e in golden(case):
            by_rollout[e.rollout_id].append(e)
        rollouts += by_rollout.values()
    return rollouts


def interleave(rollouts: list[list[Event]], rng: random.Random) -> list[Event]:
    """A random interleaving that keeps each rollout's order (what one partition may hold)."""
    cursors = [0] * len(rollouts)
    live = [i for i, r in enumerate(rollouts) if r]
    out: list[Event] = []
    while live:
        i = rng.choice(live)
        out.append(rollouts[i][cursors[i]])
        cursors[i] += 1
        if cursors[i] == len(rollouts[i]):
            live.remove(i)
    return out


# --- the faust agents' loop over the books, without faust ----------------------------------


def agents(recs: list[SourceRecord], cfg: BatchConfig, drain_step_us: int = S // 10) -> BatchOutput:
    """The builder agent runs each record's Step; the aggregator agent reads what the builder
    wrote to each trajectories partition; the timer ticks (rollouts, then groups) after every
    record. Then wall time passes, a tick every ``drain_step_us``, until nothing is open."""
    rollouts = RolloutBook(
        cfg.builder, codec, source_topic=cfg.events_topic, processor="p", route=cfg.route
    )
    groups = GroupBook(
        cfg.groups, codec, source_topic=cfg.trajectories_topic, processor="p", route=cfg.route
    )
    result = BatchOutput()
    topic: dict[int, list[Out]] = defaultdict(list)
    read: dict[int, int] = defaultdict(int)

    def execute(step: Step) -> None:
        result.add(step.sends)
        for out in step.sends:
            if out.sink is Sink.TRAJECTORIES:
                topic[out.partition or 0].append(out)
        if step.on_done is not None:
            step.on_done()

    def aggregate(wall: int) -> None:
        for q, written in list(topic.items()):
            while read[q] < len(written):
                out = written[read[q]]
                execute(groups.on_record(q, read[q], out.key, out.value, wall))
                read[q] += 1

    def tick(wall: int) -> None:
        for step in rollouts.expire(wall):
            execute(step)
        for step in groups.expire(wall):
            execute(step)

    for r in recs:
        execute(rollouts.on_record(r.partition, r.offset, r.key, r.value, 0))
        aggregate(0)
        tick(0)
        aggregate(0)
    wall = 0
    while groups.open or any(s.state.phase in OPEN for s in rollouts.open.values()):
        wall += drain_step_us
        tick(wall)
        aggregate(wall)
        assert wall < 10_000 * S, "the agents never closed everything"
    return result


# --- comparing outputs ------------------------------------------------------------------------


def by_id(outs: list[Out], kind: type[Any], field: str) -> dict[str, bytes]:
    """Encoded records keyed by id; every copy of an id must be the same bytes."""
    found: dict[str, bytes] = {}
    for out in outs:
        assert out.value is not None
        ident = getattr(codec.decode(out.value, expect=kind), field)
        assert found.setdefault(ident, out.value) == out.value, ident
    return found


def samples(result: BatchOutput) -> dict[str, bytes]:
    return by_id(result.samples, Sample, "sample_id")


def trajectories(result: BatchOutput) -> dict[str, bytes]:
    return by_id(result.trajectories, Trajectory, "rollout_id")


def dead_letters(result: BatchOutput) -> list[tuple[Any, ...]]:
    """Key, value, code, reason and stage of each dead letter (the aggregator's offsets are
    where it read a trajectory: a topic offset for the agents, -1 for the batch path)."""
    rows = []
    for out in result.dlq:
        h = read_headers(out.headers)
        rows.append((out.key, out.value, h["code"], h["reason"], h["stage"]))
    return sorted(rows)


def assert_same(got: BatchOutput, want: BatchOutput, route: Any = ROUTE) -> None:
    assert samples(got) == samples(want)
    assert trajectories(got) == trajectories(want)
    assert dead_letters(got) == dead_letters(want)
    for out in got.trajectories:  # each on its group's partition, with the group header
        group = codec.decode(out.value, expect=Trajectory).group_id
        assert out.partition == route(group) and dict(out.headers)["group_id"] == group.encode()
    assert {out.key for out in got.samples} <= {
        codec.decode(out.value, expect=Sample).group_id.encode() for out in got.samples
    }


# --- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(SampleMode))
def test_golden_logs_give_the_golden_groups(mode: SampleMode) -> None:
    events = [e for case in CASES for e in golden(case)]
    result = process_batch(events, config(mode, drop_zero_variance=True))
    want = {}
    for case in CASES:
        expected = json.loads((GOLDEN / f"{case}.expected.json").read_text())
        want.update({s["sample_id"]: s for g in expected[f"groups_{mode}"] for s in g["samples"]})
        traj = {t["rollout_id"]: t for t in expected["trajectories"]}
        for rid, value in trajectories(result).items():
            if rid in traj:
                assert codec.decode(value, expect=Trajectory).to_json() == traj[rid]
    got = {i: codec.decode(v, expect=Sample).to_json() for i, v in samples(result).items()}
    assert got == want and len(got) == 4  # the one mixed-reward group of four
    invalid = json.loads((GOLDEN / "invalid.expected.json").read_text())["invalid"]
    codes = sorted(read_headers(o.headers)["code"] for o in result.dlq)
    assert codes == sorted(code for _, _, code in invalid)
    counts = result.counts
    assert counts["records"] == len(events) and counts["rollouts_open"] == 0
    assert counts["aggregator_groups_closed"] == counts["builder_trajectories"] - 6


@pytest.mark.parametrize("mode", list(SampleMode))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_finished_run_gives_what_the_agents_give(mode: SampleMode, seed: int) -> None:
    rollouts = finished_run(seed)
    events = interleave(rollouts, random.Random(seed))
    cfg = config(mode)
    want = agents(records(events), cfg)
    got = process_batch(events, cfg)
    assert_same(got, want)
    assert len(samples(got)) >= 24 and got.counts["groups_expired"] == 0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(list(SampleMode)))
def test_any_interleaving_shuffle_and_duplicates_give_the_same_samples(
    seed: int, mode: SampleMode
) -> None:
    rng = random.Random(seed)
    rollouts = finished_run(seed % 4, groups=3)
    cfg = config(mode)
    want = process_batch([e for r in rollouts for e in r], cfg)
    events = interleave(rollouts, rng)  # each rollout in order
    noisy = events + [rng.choice(events) for _ in range(rng.randint(1, 40))]
    rng.shuffle(noisy)  # and now out of order within rollouts too, with duplicates
    for variant in (events, noisy):
        got = process_batch(variant, cfg)
        assert samples(got) == samples(want)
        assert trajectories(got) == trajectories(want)
        assert dead_letters(got) == dead_letters(want)


def test_timeouts_close_what_a_finished_log_leaves_open_as_the_agents_do() -> None:
    rng = np.random.default_rng(7)
    one = one_partition
    cfg = config(route=one, inactivity_us=30 * S, timeout_us=45 * S)
    # a group without a size: closes on its timeout with what it has
    loose = [make_rollout(rng, f"loose-{i}", "loose", size=None, start=T0) for i in range(3)]
    # a group of two whose second rollout never finishes: truncated when its partition's clock
    # passes its last event + 30 s, then the group is full
    pair = [
        make_rollout(rng, "pair-0", "pair", size=2, start=T0),
        make_rollout(rng, "pair-1", "pair", size=2, start=T0 + 10 * S, finish=False),
    ]
    # quiet for 100 s mid-run while others go on: truncated mid-run; its later events are late
    quiet = make_rollout(rng, "quiet", "quiet", size=1, start=T0, turns=6)
    for e in quiet[4:]:
        e.ts += 100 * S
    later = [make_rollout(rng, f"later-{i}", "later", size=2, start=T0 + 60 * S) for i in range(2)]
    # a group with no size that gets a member after its timeout went by: late, to the DLQ
    late = make_rollout(rng, "tardy", "loose", size=None, start=T0 + 200 * S)
    # the last rollout never finishes: closed after the end of the log
    tail = make_rollout(rng, "tail", "tail", size=1, start=T0 + 300 * S, finish=False)
    mixed = interleave([*loose, *pair, quiet, *later, late, tail], random.Random(1))
    events = sorted(mixed, key=lambda e: e.ts)  # as a live run writes them
    recs = records(events, one)
    want = agents(recs, cfg)
    got = process_batch(recs, cfg)
    assert_same(got, want, one)
    status = {
        rid: codec.decode(v, expect=Trajectory).status for rid, v in trajectories(got).items()
    }
    assert status["pair-1"] == status["quiet"] == status["tail"] == "truncated"
    assert status["pair-0"] == "completed"
    codes = [read_headers(o.headers)["code"] for o in got.dlq]
    assert sorted(codes) == ["after_close"] * len(quiet[4:]) + ["late_trajectory"]
    trained = {codec.decode(v, expect=Sample).rollout_id for v in samples(got).values()}
    assert trained >= {"loose-0", "loose-1", "loose-2", "pair-0", "pair-1", "quiet"}
    counts = got.counts
    assert (counts["rollouts_expired"], counts["groups_expired"]) == (2, 1)
    assert (counts["rollouts_expired_at_end"], counts["groups_expired_at_end"]) == (1, 0)
    assert counts["rollouts_open"] == counts["groups_open"] == 0


def test_a_record_at_a_time_gives_the_same_as_all_at_once_and_does_not_hoard() -> None:
    rollouts = finished_run(3, groups=12)
    for i, r in enumerate(rollouts):  # groups finish one after another
        for e in r:
            e.ts += i * 10 * S
    live = sorted(interleave(rollouts, random.Random(3)), key=lambda e: e.ts)
    recs = records(live)
    cfg = config()
    want = process_batch(recs, cfg)
    by_partition: dict[int, list[SourceRecord]] = defaultdict(list)
    for r in recs:
        by_partition[r.partition].append(r)
    processor = BatchProcessor(cfg, codec, partitions=by_partition)
    rng = random.Random(4)
    got = BatchOutput()
    held = 0  # the most trajectories waiting for the other partitions at once
    early = 0  # samples out before any partition ended
    while by_partition:  # the partitions interleaved differently from ``recs``
        p = rng.choice(sorted(by_partition))
        got.add(processor.feed(by_partition[p].pop(0)))
        held = max(held, len(processor.waiting))
        if not by_partition[p]:
            del by_partition[p]
            early = early or len(got.samples)
            got.add(processor.end_partition(p))
    got.add(processor.finish())
    assert_same(got, want)
    assert processor.counts() == want.counts
    assert early > len(got.samples) // 2 and held < len(rollouts) // 3
    with pytest.raises(StreamsError, match="after its end"):
        processor.feed(recs[0])
    with pytest.raises(StreamsError, match="not announced"):
        BatchProcessor(cfg, codec, partitions=[0]).feed(SourceRecord(1, 0, b"r", b""))


def test_events_and_their_records_are_one_input() -> None:
    events = interleave(finished_run(5, groups=2), random.Random(5))
    a = process_batch(events, config())
    b = process_batch(records(events), config())
    assert (a.samples, a.trajectories, a.dlq, a.counts) == (
        b.samples,
        b.trajectories,
        b.dlq,
        b.counts,
    )


def test_garbage_and_wrong_keys_are_dead_letters_of_the_builder() -> None:
    events = finished_run(6, groups=1)[0]
    recs = records(events)
    bad = [SourceRecord(0, 99, b"junk", b"\x00garbage"), SourceRecord(1, 7, b"nope", recs[0].value)]
    result = process_batch([*bad, *recs], config())
    rows = [(o.key, o.value, read_headers(o.headers)) for o in result.dlq]
    assert [
        (k, v, h["code"], h["original_partition"], h["original_offset"]) for k, v, h in rows
    ] == [
        (b"junk", b"\x00garbage", "undecodable", "0", "99"),
        (b"nope", recs[0].value, "wrong_key", "1", "7"),
    ]
    assert {h["stage"] for _, _, h in rows} == {"builder"}
    assert result.counts["builder_dlq"] == 2 and len(result.trajectories) == 1


def test_partitions_read_in_any_interleaving_give_event_time_order() -> None:
    """A group without a size closes when a later trajectory moves its partition's clock past
    its timeout: which rollouts it gathered must not depend on which events partition was
    read first (a faust worker reads them in whatever order the fetches come)."""
    rng = np.random.default_rng(8)
    home = {"a": 0, "b": 1, "c": 0}  # rollout -> events partition

    def where(rid: str) -> int:
        return home[rid]

    cfg = config(route=one_partition, timeout_us=45 * S)
    a = make_rollout(rng, "a", "open", size=None, start=T0)
    b = make_rollout(rng, "b", "open", size=None, start=T0 + 10 * S)
    c = make_rollout(rng, "c", "other", size=1, start=T0 + 100 * S)
    in_time = records(sorted([*a, *b, *c], key=lambda e: e.ts), where)
    p0 = [r for r in in_time if r.partition == 0]
    p1 = [r for r in in_time if r.partition == 1]
    want = agents(in_time, cfg)
    trained = {codec.decode(v, expect=Sample).rollout_id for v in samples(want).values()}
    assert trained == {"a", "b", "c"}
    for order in (in_time, p0 + p1, p1 + p0):
        assert_same(process_batch(order, cfg), want, one_partition)
    # the agents, reading partition 0 to its end first, close the group without b
    assert "late_trajectory" in {read_headers(o.headers)["code"] for o in agents(p0 + p1, cfg).dlq}


def test_old_tombstones_are_forgotten_as_the_faust_timer_forgets_them() -> None:
    """A closed rollout's tombstone goes after its retention: a late copy of its events then
    starts a rollout that never began (refused at the end); a recent one's is still known."""
    rng = np.random.default_rng(9)
    cfg = replace(config(route=one_partition), builder=BuilderConfig(closed_retention_us=20 * S))
    rollouts = [
        make_rollout(rng, f"r{i}", f"g{i // 2}", size=2, start=T0 + i * S, turns=1)
        for i in range(300)
    ]
    events = sorted((e for r in rollouts for e in r), key=lambda e: e.ts)
    # copies of events, before the first sweep of old tombstones: forgotten ones, a known one
    late = [rollouts[0][2], rollouts[0][3], events[799]]
    recs = records(events[:800] + late + events[800:], one_partition)
    want = agents(recs, cfg)
    processor = BatchProcessor(cfg, codec, partitions=[0])
    got = BatchOutput()
    for record in recs:
        got.add(processor.feed(record))
    held = len(processor.builders[0].book.closed)
    got.add(processor.end_partition(0))
    got.add(processor.finish())
    assert_same(got, want, one_partition)
    codes = [(o.key, read_headers(o.headers)["code"]) for o in got.dlq]
    assert codes == [(b"r0", "gap_at_timeout")] * 2
    assert len(samples(got)) == 300 and held < 100  # not every tombstone of the run


@pytest.mark.parametrize("seed", range(8))
def test_a_record_at_a_time_equals_all_at_once_with_timeouts_and_ties(seed: int) -> None:
    """Jittered times (ties across partitions, timeouts that fire mid-run), the partitions read
    in a random interleaving: the same outputs and counts as ``process_batch``."""
    rng = random.Random(seed)
    rollouts = finished_run(seed, groups=5)
    cfg = config(timeout_us=rng.choice([3, 30, 900]) * S, inactivity_us=rng.choice([4, 600]) * S)
    for r in rollouts:
        for e in r:
            e.ts += rng.randint(0, 20) * S
    recs = records(interleave(rollouts, rng))
    want = process_batch(recs, cfg)
    parts: dict[int, list[SourceRecord]] = defaultdict(list)
    for r in recs:
        parts[r.partition].append(r)
    processor = BatchProcessor(cfg, codec, partitions=list(parts))
    got = BatchOutput()
    while parts:
        p = rng.choice(sorted(parts))
        got.add(processor.feed(parts[p].pop(0)))
        if not parts[p]:
            del parts[p]
            got.add(processor.end_partition(p))
    got.add(processor.finish())
    assert samples(got) == samples(want)
    assert trajectories(got) == trajectories(want)
    assert dead_letters(got) == dead_letters(want)
    assert processor.counts() == want.counts
