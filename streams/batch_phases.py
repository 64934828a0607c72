"""The batch path (streams/batch.py) cut into two phases that split across processes:

    build_partitions(records, config, codec, partitions) -> Built     phase 1: the builders
    aggregate_lanes(made, config, codec, lanes) -> Aggregated         phase 2: the aggregators
    order_made(builts) -> [Made]                                      the hand-over between them

A builder lane's outputs depend on its source partition's records alone, and a group lane's on
the trajectories that reach it, in the order they reach it. ``BatchProcessor`` hands the
trajectories over as they are made, ordered by (clock of their builder partition when made,
partition, making order), and after the end of the input the ones the drain makes, ordered by
(wall time since the end, partition, making order). So phase 1 can run any set of source
partitions on its own, to the end of the input and through the drain, tagging each trajectory
with that key; ``order_made`` sorts them all; phase 2 runs any set of trajectories partitions on
their share of that order. Together they give what ``process_batch`` gives: the same records
(a multiset: the order of the output lists differs) and the same counts. The aggregator decodes
a trajectory from its record, as the faust aggregator does, unless phase 1 kept the builder's
object (as ``process_batch`` does: the same bytes come out either way).

Pure: no processes, no I/O (the process pool is streams/batch_parallel.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from rollstream.schemas import Codec, Trajectory

from .batch import _TERMINAL, _WALL0, BatchConfig, SourceRecord, _BuilderLane, _GroupLane
from .books import Out, Sink, tally

__all__ = [
    "Aggregated",
    "Built",
    "Made",
    "aggregate_lanes",
    "build_partitions",
    "lane_of",
    "merge_counts",
    "order_made",
    "split_evenly",
]

_END = 1 << 62  # the wall time at which every group has timed out


class Made(NamedTuple):
    """A trajectory record and where it falls in the hand-over order: ``drained`` False, made
    while records came (``at``: its partition's clock then); True, by the drain after the end
    of the input (``at``: wall time since the end). ``n``: making order within the partition."""

    drained: bool
    at: int
    partition: int
    n: int
    out: Out
    trajectory: Trajectory | None = None  # the Trajectory ``out`` holds (None: decode it)


@dataclass(slots=True)
class Built:
    """Phase 1's result for a set of source partitions."""

    made: list[Made] = field(default_factory=list)
    outs: list[Out] = field(default_factory=list)  # the rest (dead letters)
    counts: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Aggregated:
    """Phase 2's result for a set of trajectories partitions."""

    outs: list[Out] = field(default_factory=list)  # samples and dead letters
    counts: dict[str, int] = field(default_factory=dict)


def build_partitions(
    records: Iterable[SourceRecord],
    config: BatchConfig,
    codec: Codec,
    partitions: set[int],
    *,
    keep: bool = False,
) -> Built:
    """Phase 1: the builder lanes of ``partitions`` over their records (the others skipped),
    then the drain, as ``BatchProcessor`` runs them. ``keep``: each ``Made`` keeps the
    Trajectory its record holds (phase 2 then need not decode it; no use across processes:
    pickling one costs more than decoding it)."""
    lanes: dict[int, _BuilderLane] = {}
    built, fed = Built(), 0
    made, rest = built.made, built.outs
    order: dict[int, int] = {}

    def take(outs: list[Out], drained: bool, at: int, p: int, lane: _BuilderLane) -> None:
        for out in outs:
            if out.sink is Sink.TRAJECTORIES:
                trajectory = lane.book.made.pop(id(out))
                made.append(Made(drained, at, p, order[p], out, trajectory if keep else None))
                order[p] += 1
            else:
                rest.append(out)

    for record in records:
        p = record.partition
        if p not in partitions:
            continue
        lane = lanes.get(p)
        if lane is None:
            lane = lanes[p] = _BuilderLane(p, config, codec)
            order[p] = 0
        fed += 1
        outs: list[Out] = []
        now = lane.feed(record.offset, record.key, record.value, outs)
        if outs:
            take(outs, False, now, p, lane)
    for p in sorted(lanes):
        for delta, sent in lanes[p].drain():
            take(sent, True, delta, p, lanes[p])
    counts = built.counts
    counts["records"] = fed
    for lane in lanes.values():
        for name, n in lane.book.stats.items():
            tally(counts, f"builder_{name}", n)
    counts["rollouts_expired"] = sum(lane.expired for lane in lanes.values())
    counts["rollouts_expired_at_end"] = sum(lane.expired_at_end for lane in lanes.values())
    counts["rollouts_open"] = sum(
        1
        for lane in lanes.values()
        for slot in lane.book.open.values()
        if slot.state.phase not in _TERMINAL
    )
    return built


def order_made(builts: Iterable[Built]) -> list[Made]:
    """Every trajectory in the order ``BatchProcessor`` hands them to the aggregator."""
    return sorted((m for b in builts for m in b.made), key=lambda m: m[:4])


def lane_of(made: Made) -> int:
    """The trajectories partition (group lane) a trajectory goes to."""
    return 0 if made.out.partition is None else made.out.partition


def aggregate_lanes(
    made: Iterable[Made], config: BatchConfig, codec: Codec, lanes: set[int]
) -> Aggregated:
    """Phase 2: the group lanes of ``lanes`` over their trajectories (``made`` in hand-over
    order; those of other lanes skipped), then wall time until every group has closed."""
    groups: dict[int, _GroupLane] = {}
    result = Aggregated()
    outs = result.outs
    for m in made:
        q = lane_of(m)
        if q not in lanes:
            continue
        lane = groups.get(q)
        if lane is None:
            lane = groups[q] = _GroupLane(q, config, codec)
        lane.deliver(m.out, m.trajectory, _WALL0 + m.at if m.drained else _WALL0, outs)
    for lane in groups.values():
        lane.advance(_END, outs)
    counts = result.counts
    for lane in groups.values():
        for name, n in lane.book.stats.items():
            tally(counts, f"aggregator_{name}", n)
    counts["groups_expired"] = sum(lane.expired for lane in groups.values())
    counts["groups_expired_at_end"] = sum(lane.expired_at_end for lane in groups.values())
    counts["groups_open"] = sum(len(lane.book.open) for lane in groups.values())
    return result


def merge_counts(parts: Iterable[dict[str, int]]) -> dict[str, int]:
    """The counters of several phases' shares, summed."""
    total: dict[str, int] = {}
    for part in parts:
        for name, n in part.items():
            tally(total, name, n)
    return total


def split_evenly(weights: Mapping[int, int], shares: int) -> list[set[int]]:
    """Keys (partitions) in at most ``shares`` sets of near-equal total weight (the heaviest
    first, each to the lightest set so far); empty sets left out."""
    loads = [(0, k) for k in range(shares)]
    out: list[set[int]] = [set() for _ in range(shares)]
    for key, weight in sorted(weights.items(), key=lambda kv: (-kv[1], kv[0])):
        load, k = heapq.heappop(loads)
        out[k].add(key)
        heapq.heappush(loads, (load + weight, k))
    return [s for s in out if s]
