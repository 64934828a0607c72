"""The processor's book-keeping, apart from faust: what to send and what to write to the tables
for each record, each timer tick and each recovery. app.py only carries it out.

    rollout.events --RolloutBook--> trajectories --GroupBook--> samples
                                    (refused records of every stage -> DLQ)

The builder writes each trajectory to the partition of its group (``route``: the partition a
record keyed by group_id would get), so the aggregator reads the trajectories topic itself:
no re-keying hop, no second copy of the trajectory. RolloutBook and the shared parts (Step,
Out, the table key layout, the clock) are here; GroupBook in aggregation.py.

State. The pure core's states (RolloutState, GroupState) live in memory. The faust tables are a
write-ahead log of what is needed to rebuild them, each input written once (no O(n^2) re-writes
of a growing state):

    rollouts table  e/<p>/<rid>/<seq>   offset + raw event bytes, for each event the core
                                        consumed (applied or buffered) while the rollout was open
                    c/<p>/<rid>         the closed rollout's tombstone (core state, tiny)
    groups table    t/<p>/<gid>/<rid>   offset + raw trajectory bytes, each one a group gathered
                    c/<p>/<gid>         the closed group's tombstone (core state, tiny)

(<p> is the source partition, which is also the changelog partition; ids are length-prefixed.)
When a close is acknowledged the tombstone is written and the inputs deleted; tombstones go
after ``closed_retention``. After a rebalance or a restart ``rebuild`` replays the table into
fresh core states; a rollout (group) whose inputs close it but has no tombstone is closed
again there, and its outputs sent again.

Correctness under a crash at any point (at-least-once, no transactions). faust flushes the
producer before it commits source offsets, so everything written for a committed offset is
durable, and records past the committed offset are processed again. A ``Step`` sends its
records, writes its ``writes`` (after the sends' acks when ``barrier`` is set), and writes its
``deferred`` once the sends are acknowledged, in the background. The table is one changelog
partition per source partition, so a later write is never durable without the earlier ones.
The rule: an output that neither replay nor a rebuild would produce again is acknowledged
before the table write that makes them skip it. So:
- a consumed input is always written, the closing one included; the close's tombstone and
  deletes are deferred until the Trajectory (the group's Samples) is acknowledged: a tombstone
  in the changelog proves the output is in Kafka; without it the table still holds every input
  and the rebuild closes it again (a duplicate, same ids). The agent never waits for a close;
- an event the core consumed that yields a DLQ record while its rollout stays open (an in-order
  contract violation) is written only after that record is acknowledged (a rebuild does not
  re-send the DLQ records of open rollouts): the one barrier, on bad input only;
- everything else (duplicates, refusals of a closed rollout, late trajectories) is produced
  again by replay.
A duplicate output is harmless: sample ids are deterministic and consumers deduplicate.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeAlias, TypeVar

from rollstream.schemas import Codec, DecodeError, Event
from rollstream.schemas.dlq import CODE_UNDECODABLE, CODE_WRONG_KEY, dlq_headers
from rollstream.streams.core import (
    BuilderConfig,
    GroupState,
    Invalid,
    Phase,
    RolloutOutput,
    RolloutState,
    apply,
    expire,
    should_evict,
    state_from_bytes,
    state_to_bytes,
)

__all__ = [
    "GROUP_HEADER",
    "Book",
    "Out",
    "PartitionClock",
    "RolloutBook",
    "Route",
    "Sink",
    "Slot",
    "Step",
    "Write",
    "closed_key",
    "pack",
    "split_key",
    "tally",
    "traj_key",
    "unpack",
]

_TERMINAL = frozenset({Phase.CLOSED, Phase.REJECTED})
_OFFSET = struct.Struct("<q")
GROUP_HEADER = "group_id"
S = TypeVar("S", RolloutState, GroupState)


Route: TypeAlias = Callable[[str], int]  # group_id -> partition of the trajectories topic


class Sink(enum.StrEnum):
    TRAJECTORIES = "trajectories"
    SAMPLES = "samples"
    DLQ = "dlq"


@dataclass(frozen=True, slots=True)
class Out:
    """One record to produce (``partition`` None: the producer's partitioner, by key)."""

    sink: Sink
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    partition: int | None = None


Write: TypeAlias = tuple[bytes, bytes | None]  # table key -> value (None deletes)


@dataclass(slots=True)
class Step:
    """Send ``sends``; if ``barrier``, wait for their acks; write ``writes`` to the table
    partition ``partition``. Then, without holding up the caller, once every send is
    acknowledged: write ``deferred`` and call ``on_done``."""

    partition: int
    sends: list[Out] = field(default_factory=list)
    writes: list[Write] = field(default_factory=list)
    barrier: bool = False
    deferred: list[Write] = field(default_factory=list)
    on_done: Callable[[], None] | None = None


class PartitionClock:
    """Event time per partition that keeps moving while the partition is quiet: the largest
    event time seen plus the wall time since it was seen. Live, it follows the wall clock; in a
    replay of old events it follows their timestamps, so timeouts mean the same thing.

    A producer whose clock runs ahead would drag the partition's time with it and time out every
    other open rollout or group there. With ``max_ahead_us`` and ``real_now`` (the real time in
    microseconds since the epoch; the shell passes it, this module reads no clock), an event
    time more than ``max_ahead_us`` past real time counts as real time + ``max_ahead_us``:
    ``observe`` returns True for such an event (the books count them as ``future_ts``). The
    event itself is kept as it is; only the clock does not follow it. Events of a replay are in
    the past, so a replay is never clamped."""

    def __init__(
        self, max_ahead_us: int | None = None, real_now: Callable[[], int] | None = None
    ) -> None:
        self._seen: dict[int, tuple[int, int]] = {}  # partition -> (max ts, wall at that time)
        self.max_ahead_us = max_ahead_us if real_now is not None else None
        self.real_now = real_now

    def observe(self, partition: int, ts_us: int, wall_us: int) -> bool:
        clamped = False
        if self.max_ahead_us is not None and self.real_now is not None:
            bound = self.real_now() + self.max_ahead_us
            if ts_us > bound:
                ts_us, clamped = bound, True
        seen = self._seen.get(partition)
        if seen is None or ts_us > seen[0] + (wall_us - seen[1]):
            self._seen[partition] = (ts_us, wall_us)
        return clamped

    def now(self, partition: int, wall_us: int) -> int:
        seen = self._seen.get(partition)
        return wall_us if seen is None else seen[0] + max(0, wall_us - seen[1])

    def clear(self) -> None:
        self._seen.clear()


def _id(text: str) -> bytes:
    raw = text.encode()
    return b"%d:%s" % (len(raw), raw)


def _event_key(partition: int, rollout_id: str, seq: int) -> bytes:
    return b"e/%d/%s/%012d" % (partition, _id(rollout_id), seq)


def traj_key(partition: int, group_id: str, rollout_id: str) -> bytes:
    return b"t/%d/%s/%s" % (partition, _id(group_id), rollout_id.encode())


def closed_key(partition: int, ident: str) -> bytes:
    return b"c/%d/%s" % (partition, _id(ident))


def split_key(key: bytes) -> tuple[bytes, int]:
    kind, partition, _ = key.split(b"/", 2)
    return kind, int(partition)


def pack(offset: int, raw: bytes) -> bytes:
    return _OFFSET.pack(offset) + raw


def unpack(value: bytes) -> tuple[int, bytes]:
    return _OFFSET.unpack_from(value)[0], value[_OFFSET.size :]


def tally(stats: dict[str, int], name: str, n: int = 1) -> None:
    stats[name] = stats.get(name, 0) + n


@dataclass(slots=True)
class Slot(Generic[S]):
    """One rollout or group: its core state, the partition it lives in, what it holds in the
    table (seq or rollout_id -> source offset)."""

    state: S
    partition: int
    offsets: dict[Any, int] = field(default_factory=dict)
    busy: bool = False  # a close is in flight: the timer leaves the slot alone


class Book:
    """What the stages share: the codec, the clock, counters, DLQ records. ``tables`` False
    (the batch path, which has no table): steps carry no ``writes`` or ``deferred``; their
    sends, ``on_done`` and the books' states are the same."""

    stage = ""
    tables = True

    def __init__(self, codec: Codec, source_topic: str, processor: str) -> None:
        self.codec = codec
        self.source_topic = source_topic
        self.processor = processor
        self.clock = PartitionClock()
        self.stats: dict[str, int] = {}

    def _dlq(
        self,
        key: bytes | None,
        value: bytes | None,
        code: str,
        reason: str,
        partition: int,
        offset: int,
    ) -> Out:
        tally(self.stats, "dlq")
        headers = dlq_headers(
            reason=reason,
            code=code,
            topic=self.source_topic,
            partition=partition,
            offset=offset,
            stage=self.stage,
            processor=self.processor,
        )
        return Out(Sink.DLQ, key, value, tuple(headers))

    # set by the subclasses: open and closed slots by id, and the table key of a member
    open: dict[str, Slot[Any]]
    closed: dict[str, Slot[Any]]
    _member_key: Callable[[int, str, Any], bytes]

    def _close(self, step: Step, ident: str, slot: Slot[Any]) -> None:
        """Close a rollout or group: once the step's sends are acknowledged, write its state as
        the closed marker and delete its members' entries; open -> closed."""
        partition = slot.partition
        if self.tables:
            step.deferred.append((closed_key(partition, ident), state_to_bytes(slot.state)))
            step.deferred += [(self._member_key(partition, ident, m), None) for m in slot.offsets]
        slot.offsets = {}
        step.on_done = self._mark_done(slot)
        del self.open[ident]
        self.closed[ident] = slot

    @staticmethod
    def _mark_done(slot: Slot[Any]) -> Callable[[], None]:
        slot.busy = True

        def done() -> None:
            slot.busy = False

        return done


class RolloutBook(Book):
    """The trajectory builder's shell logic over ``core.apply`` / ``core.expire``."""

    stage = "builder"

    def __init__(
        self,
        config: BuilderConfig,
        codec: Codec,
        *,
        source_topic: str,
        processor: str = "",
        route: Route | None = None,
    ) -> None:
        super().__init__(codec, source_topic, processor)
        self.config = config
        self.route = route  # None: trajectories partitioned by key (rollout_id)
        self.open: dict[str, Slot[RolloutState]] = {}
        self.closed: dict[
            str, Slot[RolloutState]
        ] = {}  # in closing order (eviction scans the front)

    def on_record(
        self, partition: int, offset: int, key: bytes | None, value: bytes | None, wall_us: int
    ) -> Step:
        step = Step(partition)
        stats = self.stats
        stats["records"] = stats.get("records", 0) + 1
        try:
            if value is None:
                raise DecodeError("a record with no value", b"")
            event: Event = self.codec.decode(value, expect=Event)
        except DecodeError as exc:
            step.sends.append(
                self._dlq(key, value, CODE_UNDECODABLE, exc.reason, partition, offset)
            )
            return step
        rid = event.rollout_id
        if key != rid.encode():
            reason = f"record key {key!r} is not the event's rollout_id {rid!r}"
            step.sends.append(self._dlq(key, value, CODE_WRONG_KEY, reason, partition, offset))
            return step
        if self.clock.observe(partition, event.ts, wall_us):
            tally(self.stats, "future_ts")
        slot = self.open.get(rid) or self.closed.get(rid)
        if slot is None:
            slot = self.open[rid] = Slot(RolloutState(rid), partition)
        state = slot.state
        was_open = state.phase not in _TERMINAL
        seq = event.seq
        known = 0 <= seq < state.next_seq or seq in state.pending
        _, outputs = apply(state, event, self.config)
        if outputs:
            step.sends = [self._out(o, slot, event, key, value, offset) for o in outputs]
        closing = was_open and state.phase in _TERMINAL
        if was_open and not known and _holds(state, event):
            if self.tables:
                step.writes.append((_event_key(partition, rid, seq), pack(offset, value)))
            slot.offsets[seq] = offset
            # a DLQ record of a rollout that stays open is not sent again by a rebuild
            step.barrier = bool(step.sends) and not closing
        if closing:
            self._close(step, rid, slot)
        return step

    def expire(self, wall_us: int) -> list[Step]:
        """Close the rollouts idle past the inactivity timeout; forget old tombstones."""
        steps: list[Step] = []
        for rid, slot in list(self.open.items()):
            if slot.busy:
                continue
            now = self.clock.now(slot.partition, wall_us)
            _, outputs = expire(slot.state, now, self.config)
            if outputs:
                step = Step(
                    slot.partition, [self._out(o, slot, None, None, b"", -1) for o in outputs]
                )
                self._close(step, rid, slot)
                steps.append(step)
        for rid, slot in list(self.closed.items()):
            if slot.busy:
                continue
            if not should_evict(slot.state, self.clock.now(slot.partition, wall_us), self.config):
                break
            del self.closed[rid]
            steps.append(Step(slot.partition, writes=[(closed_key(slot.partition, rid), None)]))
        return steps

    def rebuild(
        self, items: Iterable[tuple[bytes, bytes]], partitions: set[int], wall_us: int
    ) -> list[Step]:
        """Forget everything, then rebuild the states of ``partitions`` from the table's items.
        Returns the steps to run: closes the table had not recorded yet, stale inputs."""
        self.open.clear()
        self.closed.clear()
        self.clock.clear()
        events: dict[str, list[tuple[int, int, Event, bytes]]] = {}
        tombstones: list[tuple[int, RolloutState]] = []
        for key, value in items:
            kind, partition = split_key(key)
            if partition not in partitions:
                continue
            if kind == b"c":
                state = state_from_bytes(value)
                assert isinstance(state, RolloutState)
                tombstones.append((partition, state))
            elif kind == b"e":
                offset, raw = unpack(value)
                event = self.codec.decode(raw, expect=Event)
                events.setdefault(event.rollout_id, []).append((partition, offset, event, raw))
        steps: list[Step] = []
        for partition, state in sorted(tombstones, key=lambda t: t[1].last_ts):
            self.closed[state.rollout_id] = Slot(state, partition)
        for rid, stored in events.items():
            stored.sort(key=lambda s: s[2].seq)
            partition = stored[0][0]
            if rid in self.closed:  # closed, the deletes were cut short: finish them
                writes: list[Write] = [(_event_key(p, rid, e.seq), None) for p, _, e, _ in stored]
                steps.append(Step(partition, writes=writes))
                continue
            slot = self.open[rid] = Slot(RolloutState(rid), partition)
            outputs: list[RolloutOutput] = []
            for _, offset, event, _ in stored:
                self.clock.observe(partition, event.ts, wall_us)
                slot.offsets[event.seq] = offset
                outputs += apply(slot.state, event, self.config)[1]
            if slot.state.phase in _TERMINAL:  # closed in the log, not in the table yet
                step = Step(partition, [self._out(o, slot, None, None, b"", -1) for o in outputs])
                self._close(step, rid, slot)
                steps.append(step)
        tally(self.stats, "rebuilt_open", len(self.open))
        return steps

    # --- internals ------------------------------------------------------------------------

    _member_key = staticmethod(_event_key)  # (partition, rollout_id, seq): an event's entry

    def _out(
        self,
        output: RolloutOutput,
        slot: Slot[RolloutState],
        event: Event | None,
        key: bytes | None,
        value: bytes,
        offset: int,
    ) -> Out:
        if isinstance(output, Invalid):
            tally(self.stats, "invalid")
            bad = output.event
            if bad is event:
                raw, at = value, offset
            else:
                raw, at = self.codec.encode(bad), slot.offsets.get(bad.seq, -1)
            return self._dlq(
                bad.rollout_id.encode(), raw, str(output.code), output.reason, slot.partition, at
            )
        tally(self.stats, "trajectories")
        gid = output.group_id
        return Out(
            Sink.TRAJECTORIES,
            output.rollout_id.encode(),
            self.codec.encode(output),
            ((GROUP_HEADER, gid.encode()),),
            None if self.route is None else self.route(gid),
        )


def _holds(state: RolloutState, event: Event) -> bool:
    """Did the core consume the event (applied in order, or buffered)?"""
    seq = event.seq
    if 0 <= seq < state.next_seq:
        return state.event_ids[seq] == event.event_id
    return state.pending.get(seq) is event
