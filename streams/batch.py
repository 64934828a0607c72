"""The stream processors' batch path: a finished run's raw events in, the trajectories, samples
and dead letters the faust processor would produce for them out, without faust or Kafka.

    process_batch(records | events, config, codec) -> BatchOutput     everything, in memory
    BatchProcessor(config, codec, partitions=...)                     the same, a record at a time:
        .feed(record) / .end_partition(p) / .finish() -> [Out]       (outputs as they are ready)

It drives the books of the faust agents themselves (``RolloutBook``, ``GroupBook``: the same
``apply`` / ``add_to_group`` / ``expire`` calls, the same ``Out`` records: keys, value bytes,
headers, partitions), leaving out only their table bookkeeping (``Book.tables`` False: a batch
job has nothing to recover) and, in one process, the aggregator's decoding of each trajectory:
it gets the Trajectory the builder encoded into the record (``GroupBook.on_record(decoded=)``).
What the faust path leaves to timing, the batch path fixes as follows (times are event time):

- Ideal timers: the faust timer runs every ``proc_timer_interval_s``; here the timeouts and
  evictions happen between every two records, at the exact instant they fall due. A per-partition
  clock (``PartitionClock``) that gains no wall time while records are read: a processor
  infinitely fast compared with the log, as a fast replay is.
- One book per source partition and one per trajectories partition (as with one worker per
  partition): a partition's outputs depend on that partition's records alone.
- Trajectories reach the aggregator in the order they were made, in event time: ordered by the
  clock of their builder partition when they were made (ties: partition, then making order).
- At the end of the input, wall time moves on until nothing is open: each open rollout closes
  (status truncated, ``RolloutState.last_ts`` as its finish time) once its partition's clock
  passes ``last_ts + inactivity_timeout``, each open group once its partition's clock passes its
  earliest finish time + ``group_timeout``, in that time order; at equal times, as in a faust
  timer tick, the rollouts expire, then the groups, then the new trajectories arrive. Groups
  that never fill (no group_size, or rollouts missing) close with what they gathered.

What is the same byte for byte: the encoded Sample records, as a multiset keyed by sample_id
(and the Trajectory records keyed by rollout_id), whenever the faust path and the batch path
gather the same rollouts into each group and close each rollout at the same event. For a
finished run (every rollout ends with RolloutFinished; each group gets its group_size
rollouts, all agreeing on it, none beyond it) that holds for any order of the input that keeps
each partition's order, duplicates included. Where a timeout decides (a group without a size,
a rollout that never finishes), both follow the same rules, but the faust worker's clocks also
gain the wall time it takes to get to each record (a partition fetched late, a timer tick every
``proc_timer_interval_s``): its outcome can differ when that time approaches the timeout; the
batch path's is the one a worker infinitely fast compared with the log gives. Dead letters
carry the same key, value and reason; in the aggregator's headers ``original_offset`` is -1
(its trajectories were never read from a topic), and ``processor`` is the batch job's id.

Pure: no faust, no Kafka client (the route of a group_id comes in ``BatchConfig.route``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rollstream.schemas import Codec, Event, Trajectory
from rollstream.streams.core import RolloutOutput, RolloutState  # as books.py names them

from .aggregation import GroupBook
from .books import GROUP_HEADER, Out, PartitionClock, RolloutBook, Route, Sink, Slot, Step, tally
from .core import (
    BuilderConfig,
    GroupConfig,
    Phase,
    should_evict,
    should_evict_group,
)
from .errors import StreamsError
from .settings import ProcessorSettings

__all__ = [
    "BatchConfig",
    "BatchOutput",
    "BatchProcessor",
    "SourceRecord",
    "process_batch",
]

_WALL0 = 0  # the wall clock of the input phase: it stands still while records are read
_TERMINAL = frozenset({Phase.CLOSED, Phase.REJECTED})
_BATCH_APP_ID = "rollstream-batch-v1"
_SWEEP = 1024  # records (trajectories) between timer runs that forget old tombstones


class SourceRecord(NamedTuple):
    """One record of the events topic: where it was, its key and value bytes."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """What the batch path needs: the pure configs, the names its dead letters carry, and the
    partitioning of the topics (``route``: group_id -> trajectories partition, None: one
    partition; ``event_partition``: rollout_id -> events partition for ``Event`` inputs,
    None: partition 0)."""

    builder: BuilderConfig = field(default_factory=BuilderConfig)
    groups: GroupConfig = field(default_factory=GroupConfig)
    events_topic: str = "rollout.events"
    trajectories_topic: str = "trajectories"
    processor: str = _BATCH_APP_ID
    route: Route | None = None
    event_partition: Route | None = None
    # the partition clocks' bound on event times ahead of real time (books.PartitionClock);
    # both or neither: ``real_now`` is the shell's clock (microseconds since the epoch)
    max_clock_ahead_us: int | None = None
    real_now: Callable[[], int] | None = None

    def clock(self) -> PartitionClock:
        return PartitionClock(self.max_clock_ahead_us, self.real_now)

    @classmethod
    def from_settings(
        cls,
        settings: ProcessorSettings,
        *,
        route: Route | None,
        events_topic: str | None = None,
        event_partition: Route | None = None,
        real_now: Callable[[], int] | None = None,
    ) -> BatchConfig:
        """The configs a ``rollstream process`` worker with ``settings`` uses; dead letters
        name ``events_topic`` (default: the settings' own) and ``<ns>.rollstream-batch-v1``."""
        topics = settings.topics()
        return cls(
            builder=settings.builder_config(),
            groups=settings.group_config(),
            events_topic=events_topic or topics.events,
            trajectories_topic=topics.trajectories,
            processor=topics.name(_BATCH_APP_ID),
            route=route,
            event_partition=event_partition,
            max_clock_ahead_us=settings.max_clock_ahead_us(),
            real_now=real_now,
        )


@dataclass(slots=True)
class BatchOutput:
    """Everything the batch path produced, as the faust path's ``Out`` records, and counters."""

    trajectories: list[Out] = field(default_factory=list)
    samples: list[Out] = field(default_factory=list)
    dlq: list[Out] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, outs: Iterable[Out]) -> None:
        for out in outs:
            sink = out.sink
            if sink is Sink.SAMPLES:
                self.samples.append(out)
            elif sink is Sink.TRAJECTORIES:
                self.trajectories.append(out)
            else:
                self.dlq.append(out)


def _run(step: Step, outs: list[Out]) -> bool:
    """Carry out a step as if its sends were acknowledged at once (no table: nothing to write).
    True when it closed a rollout or group."""
    outs += step.sends
    if step.on_done is not None:
        step.on_done()
        return True
    return False


class _BatchRolloutBook(RolloutBook):
    """A RolloutBook without tables that keeps each Trajectory it encodes beside its record
    (``made``: id of the Out -> the Trajectory), so the aggregator need not decode it again."""

    tables = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.made: dict[int, Trajectory] = {}

    def _out(
        self,
        output: RolloutOutput,
        slot: Slot[RolloutState],
        event: Event | None,
        key: bytes | None,
        value: bytes,
        offset: int,
    ) -> Out:
        out = super()._out(output, slot, event, key, value, offset)
        if out.sink is Sink.TRAJECTORIES:
            assert isinstance(output, Trajectory)
            self.made[id(out)] = output
        return out


def _text(key: bytes) -> str:
    """A record key as the rollout_id it should be (undecodable bytes replaced)."""
    try:
        return key.decode()
    except UnicodeDecodeError:
        return key.decode(errors="replace")


class _BuilderLane:
    """The trajectory builder of one source partition, with ideal timers."""

    def __init__(self, partition: int, config: BatchConfig, codec: Codec) -> None:
        self.partition = partition
        self.config = config.builder
        self.book = _BatchRolloutBook(
            config.builder,
            codec,
            source_topic=config.events_topic,
            processor=config.processor,
            route=config.route,
        )
        self.book.clock = config.clock()
        self.timeout = config.builder.inactivity_timeout_us
        self.due: list[tuple[int, str]] = []  # (lower bound of last_ts + timeout, rollout_id)
        self.expired = 0  # rollouts closed by the inactivity timeout while records came
        self.expired_at_end = 0  # ... after the end of the input (left open by the log)
        self.fed = 0

    def clock(self, wall: int = _WALL0) -> int:
        return self.book.clock.now(self.partition, wall)

    def feed(self, offset: int, key: bytes | None, value: bytes | None, outs: list[Out]) -> int:
        """One record, then the timers due; returns the partition's clock."""
        book = self.book
        self.fed += 1
        closed = book.closed
        if closed:
            # the timer forgets old tombstones: before a record of one comes (what decides an
            # output), and now and then (what bounds memory); any run of it between two
            # records is one the faust timer may make
            slot = None if key is None else closed.get(_text(key))
            if self.fed % _SWEEP == 0:
                slot = next(iter(closed.values()))
            if slot is not None and should_evict(slot.state, self.clock(), self.config):
                self._expire(_WALL0, outs)
        open_ = book.open
        opened = len(open_)
        step = book.on_record(self.partition, offset, key, value, _WALL0)
        if step.sends:
            outs += step.sends
        if step.on_done is not None:  # as _run: its sends count as acknowledged at once
            step.on_done()
        if len(open_) > opened:
            rid = next(reversed(open_))
            heapq.heappush(self.due, (open_[rid].state.last_ts + self.timeout, rid))
        now = book.clock.now(self.partition, _WALL0)
        due = self.due
        if due and due[0][0] <= now:
            self._fire(outs)
        return now

    def _fire(self, outs: list[Out]) -> None:
        """Check the rollouts whose deadline may have passed; expire if one has."""
        now, open_, due = self.clock(), self.book.open, self.due
        fire = False
        while due and due[0][0] <= now:
            _, rid = heapq.heappop(due)
            slot = open_.get(rid)
            if slot is None or slot.state.phase in _TERMINAL:
                continue
            deadline = slot.state.last_ts + self.timeout
            if deadline <= now:
                fire = True
            else:
                heapq.heappush(due, (deadline, rid))
        if fire:
            self.expired += self._expire(_WALL0, outs)

    def _expire(self, wall: int, outs: list[Out]) -> int:
        return sum(_run(step, outs) for step in self.book.expire(wall))

    def drain(self) -> list[tuple[int, list[Out]]]:
        """Let wall time pass until every rollout of the partition is closed: (wall time since
        the end of the input, what the timer sent then), in time order."""
        now = self.clock()
        deltas = sorted(
            {
                max(0, slot.state.last_ts + self.timeout - now)
                for slot in self.book.open.values()
                if slot.state.phase not in _TERMINAL
            }
        )
        ticks: list[tuple[int, list[Out]]] = []
        for delta in deltas:
            outs: list[Out] = []
            self.expired_at_end += self._expire(_WALL0 + delta, outs)
            ticks.append((delta, outs))
        return ticks


class _GroupLane:
    """The group aggregator of one trajectories partition, with ideal timers."""

    def __init__(self, partition: int, config: BatchConfig, codec: Codec) -> None:
        self.partition = partition
        self.config = config.groups
        self.book = GroupBook(
            config.groups,
            codec,
            source_topic=config.trajectories_topic,
            processor=config.processor,
            route=config.route,
        )
        self.book.tables = False
        self.book.clock = config.clock()
        self.timeout = config.groups.timeout_us
        self.due: list[tuple[int, str]] = []  # (opened_ts + timeout, group_id)
        self.pushed: dict[str, int] = {}  # group_id -> the deadline last pushed
        self.wall = _WALL0  # wall time this lane has reached
        self.expired = 0  # groups closed by their timeout while records came
        self.expired_at_end = 0  # ... after the end of the input
        self.delivered = 0

    def deliver(self, out: Out, made: Trajectory | None, wall: int, outs: list[Out]) -> None:
        """A trajectory arrives (after the timers due by ``wall`` ran); ``made``: the
        Trajectory ``out`` holds encoded (None: decoded from ``out.value``)."""
        self.advance(wall, outs)
        book, gid = self.book, dict(out.headers)[GROUP_HEADER].decode()
        self.delivered += 1
        slot = book.closed.get(gid)  # as for the builder's tombstones
        if self.delivered % _SWEEP == 0 and book.closed:
            slot = next(iter(book.closed.values()))
        if slot is not None:
            now = book.clock.now(slot.partition, wall)
            if should_evict_group(slot.state, now, self.config):
                self._expire(wall, outs)
        _run(book.on_record(self.partition, -1, out.key, out.value, wall, made), outs)
        slot = book.open.get(gid)
        if slot is not None and slot.state.trajectories:
            deadline = slot.state.opened_ts + self.timeout
            if self.pushed.get(gid) != deadline:
                self.pushed[gid] = deadline
                heapq.heappush(self.due, (deadline, gid))
        self._fire(wall, outs)

    def advance(self, wall: int, outs: list[Out]) -> None:
        """Run the group timeouts that fall due up to ``wall``, each at its own time."""
        while (at := self._next_due()) is not None and at <= wall:
            self._fire(at, outs)
        self.wall = max(self.wall, wall)

    def _valid_top(self) -> int | None:
        """The earliest deadline of an open group (stale entries dropped), in clock time."""
        due, open_ = self.due, self.book.open
        while due:
            deadline, gid = due[0]
            slot = open_.get(gid)
            state = None if slot is None else slot.state
            if (
                state is not None
                and state.trajectories
                and not state.closed
                and state.opened_ts + self.timeout == deadline
            ):
                return deadline
            heapq.heappop(due)
            if self.pushed.get(gid) == deadline:
                del self.pushed[gid]
        return None

    def _next_due(self) -> int | None:
        """The wall time at which the earliest open group's timeout falls due (the clock moves
        with the wall from ``self.wall`` on, until the next trajectory arrives)."""
        deadline = self._valid_top()
        if deadline is None:
            return None
        return self.wall + max(0, deadline - self.book.clock.now(self.partition, self.wall))

    def _fire(self, wall: int, outs: list[Out]) -> None:
        self.wall = max(self.wall, wall)
        deadline = self._valid_top()
        if deadline is not None and deadline <= self.book.clock.now(self.partition, self.wall):
            closed = self._expire(self.wall, outs)
            if self.wall > _WALL0:
                self.expired_at_end += closed
            else:
                self.expired += closed

    def _expire(self, wall: int, outs: list[Out]) -> int:
        return sum(_run(step, outs) for step in self.book.expire(wall))


class BatchProcessor:
    """The batch path a record at a time. ``partitions``: the source partitions that will be
    fed (each in offset order); with it, trajectories go on to the aggregator as soon as no
    partition can still make an earlier one (memory stays bounded by the partitions' clock
    skew); without it they wait for ``finish``. Either way the outputs are the same. A record
    of a partition not announced, ended, or after ``finish`` raises ``StreamsError``."""

    def __init__(
        self, config: BatchConfig, codec: Codec, *, partitions: Iterable[int] | None = None
    ) -> None:
        self.config = config
        self.codec = codec
        self.builders: dict[int, _BuilderLane] = {}
        self.groups: dict[int, _GroupLane] = {}
        self.unfinished: set[int] | None = None if partitions is None else set(partitions)
        # (made at, partition, n, out, its Trajectory)
        self.waiting: list[tuple[int, int, int, Out, Trajectory]] = []
        self._made = itertools.count()
        self._blocker: int | None = None  # the partition the first waiting one waits for
        # ... until its clock passes (made at, partition) of that first one
        self._blocked_at: tuple[int, int] = (0, 0)
        self.records = 0
        self.finished = False

    def feed(self, record: SourceRecord) -> list[Out]:
        """Process one record; returns what is ready to produce."""
        p = record.partition
        lane = self.builders.get(p)
        if lane is None:
            if self.finished or (self.unfinished is not None and p not in self.unfinished):
                raise StreamsError(f"a record of partition {p}, which was not announced")
            lane = self.builders[p] = _BuilderLane(p, self.config, self.codec)
        elif self.finished or (self.unfinished is not None and p not in self.unfinished):
            raise StreamsError(f"a record of partition {p} after its end")
        self.records += 1
        outs: list[Out] = []
        now = lane.feed(record.offset, record.key, record.value, outs)
        made = False
        for out in outs:
            if out.sink is Sink.TRAJECTORIES:
                trajectory = lane.book.made.pop(id(out))
                heapq.heappush(self.waiting, (now, p, next(self._made), out, trajectory))
                made = True
        # what waits can go when a new one came, or the partition that held it back passed it
        # (while it has not, _release would find it still in the way: clocks never go back)
        if self.waiting and self.unfinished is not None:
            if made or self._blocker is None:
                self._release(outs)
            elif self._blocker == p:
                at, first = self._blocked_at
                if now > at or (now == at and p > first):
                    self._release(outs)
        return outs

    def end_partition(self, partition: int) -> list[Out]:
        """No more records of ``partition``: what waited for it can go on."""
        outs: list[Out] = []
        if self.unfinished is not None:
            self.unfinished.discard(partition)
            self._release(outs)
        return outs

    def finish(self) -> list[Out]:
        """The end of the input: the waiting trajectories go on, then time passes until every
        rollout and group is closed."""
        outs: list[Out] = []
        self.unfinished = set()
        self._release(outs)
        # (wall since the end, partition, n, out, its Trajectory)
        made: list[tuple[int, int, int, Out, Trajectory]] = []
        for p in sorted(self.builders):
            book = self.builders[p].book
            for delta, sent in self.builders[p].drain():
                for out in sent:
                    if out.sink is Sink.TRAJECTORIES:
                        made.append((delta, p, next(self._made), out, book.made.pop(id(out))))
                outs += sent
        made.sort(key=lambda m: m[:3])
        for delta, _, _, out, trajectory in made:
            self._group_lane(out).deliver(out, trajectory, _WALL0 + delta, outs)
        for lane in self.groups.values():
            lane.advance(1 << 62, outs)
        self.finished = True
        return outs

    def counts(self) -> dict[str, int]:
        """What the two stages counted (the books' counters) and how things closed."""
        counts: dict[str, int] = {"records": self.records}
        for stage, lanes in (("builder", self.builders), ("aggregator", self.groups)):
            for lane in lanes.values():
                for name, n in lane.book.stats.items():
                    tally(counts, f"{stage}_{name}", n)
        for name, lanes in (("rollouts", self.builders), ("groups", self.groups)):
            counts[f"{name}_expired"] = sum(lane.expired for lane in lanes.values())
            counts[f"{name}_expired_at_end"] = sum(lane.expired_at_end for lane in lanes.values())
        counts["rollouts_open"] = sum(
            1
            for lane in self.builders.values()
            for slot in lane.book.open.values()
            if slot.state.phase not in _TERMINAL
        )
        counts["groups_open"] = sum(len(lane.book.open) for lane in self.groups.values())
        return counts

    # --- internals ------------------------------------------------------------------------

    def _release(self, outs: list[Out]) -> None:
        """Hand the aggregator every waiting trajectory that no partition can precede now: a
        partition yet to end makes its next ones at its clock or later, after its earlier ones."""
        if self.unfinished is None:
            return
        clocks = [(self._clock(p), p) for p in self.unfinished]
        waiting = self.waiting
        self._blocker = None
        while waiting:
            at, partition = waiting[0][:2]
            for c, p in clocks:
                if p != partition and (c < at or (c == at and p < partition)):
                    self._blocker, self._blocked_at = p, (at, partition)
                    return
            _, _, _, out, trajectory = heapq.heappop(waiting)
            self._group_lane(out).deliver(out, trajectory, _WALL0, outs)

    def _clock(self, partition: int) -> int:
        lane = self.builders.get(partition)
        return -(1 << 62) if lane is None else lane.clock()

    def _group_lane(self, out: Out) -> _GroupLane:
        q = 0 if out.partition is None else out.partition
        lane = self.groups.get(q)
        if lane is None:
            lane = self.groups[q] = _GroupLane(q, self.config, self.codec)
        return lane


def _records(
    items: Iterable[SourceRecord | Event], config: BatchConfig, codec: Codec
) -> Iterable[SourceRecord]:
    """Events become the records a producer keyed by rollout_id would have written."""
    offsets: dict[int, int] = {}
    where = config.event_partition
    for item in items:
        if isinstance(item, Event):
            rid = item.rollout_id
            p = 0 if where is None else where(rid)
            offset = offsets[p] = offsets.get(p, -1) + 1
            yield SourceRecord(p, offset, rid.encode(), codec.encode(item))
        else:
            yield item


def process_batch(
    items: Iterable[SourceRecord | Event],
    config: BatchConfig | None = None,
    codec: Codec | None = None,
) -> BatchOutput:
    """Run the batch path over a finished run's records (each partition in offset order) or
    events (each rollout's in the order they were produced). Returns every output and the
    counters; nothing is left open."""
    config = config or BatchConfig()
    codec = codec or Codec()
    processor = BatchProcessor(config, codec)
    result = BatchOutput()
    feed, add = processor.feed, result.add
    for record in _records(items, config, codec):
        outs = feed(record)
        if outs:
            add(outs)
    result.add(processor.finish())
    result.counts = processor.counts()
    return result
