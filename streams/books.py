"""The processor's book-keeping, apart from faust: what to send and what to write to the tables
for each record, each timer tick and each recovery. app.py only carries it out.

    rollout.events --RolloutBook--> trajectories --route_trajectory--> <app_id>-trajectories-
    by-group --GroupBook--> samples          (refused records of every stage -> DLQ)

State. The pure core's states (RolloutState, GroupState) live in memory. The faust tables are a
write-ahead log of what is needed to rebuild them, each input written once (no O(n^2) re-writes
of a growing state):

    rollouts table  e/<p>/<rid>/<seq>   offset + raw event bytes, for each event of an OPEN
                                        rollout that the core consumed (applied or buffered)
                    c/<p>/<rid>         the closed rollout's tombstone (core state, tiny)
    groups table    t/<p>/<gid>/<rid>   offset + raw trajectory bytes, for an OPEN group
                    c/<p>/<gid>         the closed group's tombstone (core state, tiny)

(<p> is the source partition, which is also the changelog partition; ids are length-prefixed.)
On close the tombstone is written and the inputs deleted; tombstones go after
``closed_retention``. After a rebalance or a restart ``rebuild`` replays the table into fresh
core states.

Correctness under a crash at any point (at-least-once, no transactions). faust flushes the
producer before it commits source offsets, so everything written for a committed offset is
durable, and records past the committed offset are processed again. A ``Step`` is executed in
order: send its records; if ``barrier`` is set, wait for the broker's acks; then write to the
table (one changelog partition, so a later write is never durable without the earlier ones).
The rule: an output that replay would not produce again is acknowledged before the table write
that makes replay skip it. So:
- a close sends the Trajectory (or the group's Samples) with a barrier before the tombstone and
  the deletes: a tombstone in the changelog proves the output is in Kafka; without it the
  inputs are still there and the close happens again (a duplicate, same ids);
- an event the core consumed that yields a DLQ record (an in-order contract violation) is
  written only after that record is acknowledged;
- everything else (duplicates, refusals of a closed rollout, late trajectories) is produced
  again by replay and needs no barrier.
A duplicate output is harmless: sample ids are deterministic and consumers deduplicate.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rollstream.schemas import Codec, DecodeError, Event, Trajectory
from rollstream.streams.core import (
    BuilderConfig,
    GroupClosed,
    GroupConfig,
    GroupOutput,
    GroupState,
    Invalid,
    Phase,
    RolloutOutput,
    RolloutState,
    add_to_group,
    apply,
    expire,
    expire_group,
    should_evict,
    should_evict_group,
    state_from_bytes,
    state_to_bytes,
)

from .dlq import CODE_UNDECODABLE, CODE_WRONG_KEY, dlq_headers

__all__ = [
    "GroupBook",
    "Out",
    "PartitionClock",
    "RolloutBook",
    "Sink",
    "Step",
    "TrajectoryRouter",
]

_TERMINAL = frozenset({Phase.CLOSED, Phase.REJECTED})
_OFFSET = struct.Struct("<q")
GROUP_HEADER = "group_id"
S = TypeVar("S", RolloutState, GroupState)


class Sink(enum.StrEnum):
    TRAJECTORIES = "trajectories"
    REPARTITION = "repartition"
    SAMPLES = "samples"
    DLQ = "dlq"


@dataclass(frozen=True, slots=True)
class Out:
    """One record to produce."""

    sink: Sink
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass(slots=True)
class Step:
    """Send ``sends``; if ``barrier``, wait for their acks; then apply ``writes`` (key -> value,
    None deletes) to the table partition ``partition``; then call ``on_done``."""

    partition: int
    sends: list[Out] = field(default_factory=list)
    writes: list[tuple[bytes, bytes | None]] = field(default_factory=list)
    barrier: bool = False
    on_done: Callable[[], None] | None = None


class PartitionClock:
    """Event time per partition that keeps moving while the partition is quiet: the largest
    event time seen plus the wall time since it was seen. Live, it follows the wall clock; in a
    replay of old events it follows their timestamps, so timeouts mean the same thing."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, int]] = {}  # partition -> (max ts, wall at that time)

    def observe(self, partition: int, ts_us: int, wall_us: int) -> None:
        seen = self._seen.get(partition)
        if seen is None or ts_us > seen[0] + (wall_us - seen[1]):
            self._seen[partition] = (ts_us, wall_us)

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


def _traj_key(partition: int, group_id: str, rollout_id: str) -> bytes:
    return b"t/%d/%s/%s" % (partition, _id(group_id), rollout_id.encode())


def _closed_key(partition: int, ident: str) -> bytes:
    return b"c/%d/%s" % (partition, _id(ident))


def _split_key(key: bytes) -> tuple[bytes, int]:
    kind, partition, _ = key.split(b"/", 2)
    return kind, int(partition)


def _pack(offset: int, raw: bytes) -> bytes:
    return _OFFSET.pack(offset) + raw


def _unpack(value: bytes) -> tuple[int, bytes]:
    return _OFFSET.unpack_from(value)[0], value[_OFFSET.size :]


def _tally(stats: dict[str, int], name: str, n: int = 1) -> None:
    stats[name] = stats.get(name, 0) + n


@dataclass(slots=True)
class _Slot(Generic[S]):
    """One rollout or group: its core state, the partition it lives in, what it holds in the
    table (seq or rollout_id -> source offset)."""

    state: S
    partition: int
    offsets: dict[Any, int] = field(default_factory=dict)
    busy: bool = False  # a close is in flight: the timer leaves the slot alone


class _Book:
    stage = ""

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
        _tally(self.stats, "dlq")
        headers = dlq_headers(
            reason=reason,
            code=code,
            topic=self.source_topic,
            partition=partition,
            offset=offset,
            stage=self.stage,
            processor=self.processor,
        )
        return Out(Sink.DLQ, key, value, headers)

    @staticmethod
    def _mark_done(slot: _Slot[Any]) -> Callable[[], None]:
        slot.busy = True

        def done() -> None:
            slot.busy = False

        return done


class RolloutBook(_Book):
    """The trajectory builder's shell logic over ``core.apply`` / ``core.expire``."""

    stage = "builder"

    def __init__(
        self, config: BuilderConfig, codec: Codec, *, source_topic: str, processor: str = ""
    ) -> None:
        super().__init__(codec, source_topic, processor)
        self.config = config
        self.open: dict[str, _Slot[RolloutState]] = {}
        self.closed: dict[
            str, _Slot[RolloutState]
        ] = {}  # in closing order (eviction scans the front)

    def on_record(
        self, partition: int, offset: int, key: bytes | None, value: bytes | None, wall_us: int
    ) -> Step:
        step = Step(partition)
        _tally(self.stats, "records")
        try:
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
        self.clock.observe(partition, event.ts, wall_us)
        slot = self.open.get(rid) or self.closed.get(rid)
        if slot is None:
            slot = self.open[rid] = _Slot(RolloutState(rid), partition)
        state = slot.state
        was_open = state.phase not in _TERMINAL
        seq = event.seq
        known = 0 <= seq < state.next_seq or seq in state.pending
        _, outputs = apply(state, event, self.config)
        step.sends = [self._out(o, slot, event, key, value, offset) for o in outputs]
        if was_open and state.phase in _TERMINAL:
            self._close(step, rid, slot)
        elif was_open and not known and _holds(state, event):
            step.writes.append((_event_key(partition, rid, seq), _pack(offset, value)))
            step.barrier = bool(step.sends)
            slot.offsets[seq] = offset
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
            steps.append(Step(slot.partition, writes=[(_closed_key(slot.partition, rid), None)]))
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
            kind, partition = _split_key(key)
            if partition not in partitions:
                continue
            if kind == b"c":
                state = state_from_bytes(value)
                assert isinstance(state, RolloutState)
                tombstones.append((partition, state))
            elif kind == b"e":
                offset, raw = _unpack(value)
                event = self.codec.decode(raw, expect=Event)
                events.setdefault(event.rollout_id, []).append((partition, offset, event, raw))
        steps: list[Step] = []
        for partition, state in sorted(tombstones, key=lambda t: t[1].last_ts):
            self.closed[state.rollout_id] = _Slot(state, partition)
        for rid, stored in events.items():
            stored.sort(key=lambda s: s[2].seq)
            partition = stored[0][0]
            if rid in self.closed:  # closed, the deletes were cut short: finish them
                writes = [(_event_key(p, rid, e.seq), None) for p, _, e, _ in stored]
                steps.append(Step(partition, writes=writes))
                continue
            slot = self.open[rid] = _Slot(RolloutState(rid), partition)
            outputs: list[RolloutOutput] = []
            for _, offset, event, _ in stored:
                self.clock.observe(partition, event.ts, wall_us)
                slot.offsets[event.seq] = offset
                outputs += apply(slot.state, event, self.config)[1]
            if slot.state.phase in _TERMINAL:  # closed in the log, not in the table yet
                step = Step(partition, [self._out(o, slot, None, None, b"", -1) for o in outputs])
                self._close(step, rid, slot)
                steps.append(step)
        _tally(self.stats, "rebuilt_open", len(self.open))
        return steps

    # --- internals ------------------------------------------------------------------------

    def _close(self, step: Step, rid: str, slot: _Slot[RolloutState]) -> None:
        partition = slot.partition
        step.barrier = True
        step.writes.append((_closed_key(partition, rid), state_to_bytes(slot.state)))
        step.writes += [(_event_key(partition, rid, seq), None) for seq in slot.offsets]
        slot.offsets = {}
        step.on_done = self._mark_done(slot)
        del self.open[rid]
        self.closed[rid] = slot

    def _out(
        self,
        output: RolloutOutput,
        slot: _Slot[RolloutState],
        event: Event | None,
        key: bytes | None,
        value: bytes,
        offset: int,
    ) -> Out:
        if isinstance(output, Invalid):
            _tally(self.stats, "invalid")
            bad = output.event
            if bad is event:
                raw, at = value, offset
            else:
                raw, at = self.codec.encode(bad), slot.offsets.get(bad.seq, -1)
            return self._dlq(
                bad.rollout_id.encode(), raw, str(output.code), output.reason, slot.partition, at
            )
        _tally(self.stats, "trajectories")
        headers = ((GROUP_HEADER, output.group_id.encode()),)
        return Out(
            Sink.TRAJECTORIES, output.rollout_id.encode(), self.codec.encode(output), headers
        )


def _holds(state: RolloutState, event: Event) -> bool:
    """Did the core consume the event (applied in order, or buffered)?"""
    seq = event.seq
    if 0 <= seq < state.next_seq:
        return state.event_ids[seq] == event.event_id
    return state.pending.get(seq) is event


class TrajectoryRouter(_Book):
    """Re-keys trajectories (key rollout_id) by group_id for the aggregator. The group_id comes
    from the builder's ``group_id`` header, else from decoding the record."""

    stage = "regroup"

    def on_record(
        self,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        headers: Iterable[tuple[str, bytes | None]] | None,
    ) -> Step:
        step = Step(partition)
        _tally(self.stats, "records")
        group = next((h for name, h in headers or () if name == GROUP_HEADER and h), None)
        if group is None:
            try:
                group = self.codec.decode(value, expect=Trajectory).group_id.encode()
            except DecodeError as exc:
                step.sends.append(
                    self._dlq(key, value, CODE_UNDECODABLE, exc.reason, partition, offset)
                )
                return step
        step.sends.append(Out(Sink.REPARTITION, group, value, ((GROUP_HEADER, group),)))
        return step


class GroupBook(_Book):
    """The group aggregator's shell logic over ``core.add_to_group`` / ``expire_group``."""

    stage = "aggregator"

    def __init__(
        self, config: GroupConfig, codec: Codec, *, source_topic: str, processor: str = ""
    ) -> None:
        super().__init__(codec, source_topic, processor)
        self.config = config
        self.open: dict[str, _Slot[GroupState]] = {}
        self.closed: dict[str, _Slot[GroupState]] = {}

    def on_record(
        self, partition: int, offset: int, key: bytes | None, value: bytes | None, wall_us: int
    ) -> Step:
        step = Step(partition)
        _tally(self.stats, "records")
        try:
            trajectory: Trajectory = self.codec.decode(value, expect=Trajectory)
        except DecodeError as exc:
            step.sends.append(
                self._dlq(key, value, CODE_UNDECODABLE, exc.reason, partition, offset)
            )
            return step
        self.clock.observe(partition, trajectory.finished_ts, wall_us)
        gid, rid = trajectory.group_id, trajectory.rollout_id
        slot = self.open.get(gid) or self.closed.get(gid)
        if slot is None:
            slot = self.open[gid] = _Slot(GroupState(gid), partition)
        state = slot.state
        was_open = not state.closed
        known = rid in state.trajectories or rid in state.closed_rollouts
        _, outputs = add_to_group(state, trajectory, self.config)
        current = (trajectory, key, value, offset)
        step.sends = [s for o in outputs for s in self._outs(o, slot, current)]
        if was_open and state.closed:
            self._close(step, gid, slot)
        elif was_open and not known and rid in state.trajectories:
            step.writes.append((_traj_key(partition, gid, rid), _pack(offset, value)))
            slot.offsets[rid] = offset
        return step

    def expire(self, wall_us: int) -> list[Step]:
        """Close the groups past their timeout; forget old tombstones."""
        steps: list[Step] = []
        for gid, slot in list(self.open.items()):
            if slot.busy:
                continue
            _, outputs = expire_group(
                slot.state, self.clock.now(slot.partition, wall_us), self.config
            )
            if outputs:
                step = Step(slot.partition, [s for o in outputs for s in self._outs(o, slot, None)])
                self._close(step, gid, slot)
                steps.append(step)
        for gid, slot in list(self.closed.items()):
            if slot.busy:
                continue
            now = self.clock.now(slot.partition, wall_us)
            if not should_evict_group(slot.state, now, self.config):
                break
            del self.closed[gid]
            steps.append(Step(slot.partition, writes=[(_closed_key(slot.partition, gid), None)]))
        return steps

    def rebuild(
        self, items: Iterable[tuple[bytes, bytes]], partitions: set[int], wall_us: int
    ) -> list[Step]:
        """As RolloutBook.rebuild, for groups."""
        self.open.clear()
        self.closed.clear()
        self.clock.clear()
        gathered: dict[str, list[tuple[int, int, Trajectory]]] = {}
        tombstones: list[tuple[int, GroupState]] = []
        for key, value in items:
            kind, partition = _split_key(key)
            if partition not in partitions:
                continue
            if kind == b"c":
                state = state_from_bytes(value)
                assert isinstance(state, GroupState)
                tombstones.append((partition, state))
            elif kind == b"t":
                offset, raw = _unpack(value)
                trajectory = self.codec.decode(raw, expect=Trajectory)
                gathered.setdefault(trajectory.group_id, []).append((partition, offset, trajectory))
        steps: list[Step] = []
        for partition, state in sorted(tombstones, key=lambda t: t[1].opened_ts):
            self.closed[state.group_id] = _Slot(state, partition)
        for gid, stored in gathered.items():
            stored.sort(key=lambda s: s[2].rollout_id)
            partition = stored[0][0]
            if gid in self.closed:
                writes = [(_traj_key(p, gid, t.rollout_id), None) for p, _, t in stored]
                steps.append(Step(partition, writes=writes))
                continue
            slot = self.open[gid] = _Slot(GroupState(gid), partition)
            outputs: list[GroupOutput] = []
            for _, offset, trajectory in stored:
                self.clock.observe(partition, trajectory.finished_ts, wall_us)
                slot.offsets[trajectory.rollout_id] = offset
                outputs += add_to_group(slot.state, trajectory, self.config)[1]
            if slot.state.closed:
                step = Step(partition, [s for o in outputs for s in self._outs(o, slot, None)])
                self._close(step, gid, slot)
                steps.append(step)
        _tally(self.stats, "rebuilt_open", len(self.open))
        return steps

    # --- internals ------------------------------------------------------------------------

    def _close(self, step: Step, gid: str, slot: _Slot[GroupState]) -> None:
        partition = slot.partition
        step.barrier = True
        step.writes.append((_closed_key(partition, gid), state_to_bytes(slot.state)))
        step.writes += [(_traj_key(partition, gid, rid), None) for rid in slot.offsets]
        slot.offsets = {}
        step.on_done = self._mark_done(slot)
        del self.open[gid]
        self.closed[gid] = slot

    def _outs(
        self,
        output: GroupOutput,
        slot: _Slot[GroupState],
        current: tuple[Trajectory, bytes | None, bytes, int] | None,
    ) -> list[Out]:
        if isinstance(output, GroupClosed):
            stats = output.stats
            _tally(self.stats, "groups_closed")
            _tally(self.stats, "groups_dropped_zero_variance", int(stats.dropped_zero_variance))
            _tally(self.stats, "samples", len(output.samples))
            key = output.group_id.encode()
            return [Out(Sink.SAMPLES, key, self.codec.encode(s)) for s in output.samples]
        trajectory = output.trajectory
        if current is not None and trajectory is current[0]:
            key, raw, offset = current[1], current[2], current[3]
        else:
            key = trajectory.group_id.encode()
            raw = self.codec.encode(trajectory)
            offset = slot.offsets.get(trajectory.rollout_id, -1)
        return [self._dlq(key, raw, str(output.code), output.reason, slot.partition, offset)]
