"""The group side of the processor's book-keeping (see books.py for the scheme): the group
aggregator's steps over ``core.add_to_group`` / ``core.expire_group``. It reads the
trajectories topic, which the builder partitions by group (``Route``); a trajectory on another
partition than its group's goes to the DLQ (code ``misrouted``): with several workers its
group would be split between them. No faust in here."""

from __future__ import annotations

from collections.abc import Iterable

from rollstream.schemas import Codec, DecodeError, Trajectory
from rollstream.schemas.dlq import CODE_MISROUTED, CODE_UNDECODABLE
from rollstream.streams.core import (
    GroupClosed,
    GroupConfig,
    GroupOutput,
    GroupState,
    add_to_group,
    expire_group,
    should_evict_group,
    state_from_bytes,
)

from .books import (
    Book,
    Out,
    Route,
    Sink,
    Slot,
    Step,
    Write,
    closed_key,
    pack,
    split_key,
    tally,
    traj_key,
    unpack,
)

__all__ = ["GroupBook"]


class GroupBook(Book):
    """The group aggregator's shell logic over ``core.add_to_group`` / ``expire_group``."""

    stage = "aggregator"

    def __init__(
        self,
        config: GroupConfig,
        codec: Codec,
        *,
        source_topic: str,
        processor: str = "",
        route: Route | None = None,
    ) -> None:
        super().__init__(codec, source_topic, processor)
        self.config = config
        self.route = route  # None: any partition is accepted (one worker, tests)
        self.open: dict[str, Slot[GroupState]] = {}
        self.closed: dict[str, Slot[GroupState]] = {}

    def on_record(
        self,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        wall_us: int,
        decoded: Trajectory | None = None,
    ) -> Step:
        """``decoded``: the record's Trajectory, already at hand (the batch path: the one the
        builder encoded into ``value``), so it is not decoded again."""
        step = Step(partition)
        tally(self.stats, "records")
        if decoded is not None and value is not None:
            trajectory = decoded
        else:
            try:
                if value is None:
                    raise DecodeError("a record with no value", b"")
                trajectory = self.codec.decode(value, expect=Trajectory)
            except DecodeError as exc:
                step.sends.append(
                    self._dlq(key, value, CODE_UNDECODABLE, exc.reason, partition, offset)
                )
                return step
        gid, rid = trajectory.group_id, trajectory.rollout_id
        if self.route is not None and (home := self.route(gid)) != partition:
            reason = f"trajectory of group {gid!r} on partition {partition}, its group's is {home}"
            step.sends.append(self._dlq(key, value, CODE_MISROUTED, reason, partition, offset))
            return step
        if self.clock.observe(partition, trajectory.finished_ts, wall_us):
            tally(self.stats, "future_ts")
        slot = self.open.get(gid) or self.closed.get(gid)
        if slot is None:
            slot = self.open[gid] = Slot(GroupState(gid), partition)
        state = slot.state
        was_open = not state.closed
        known = rid in state.trajectories or rid in state.closed_rollouts
        _, outputs = add_to_group(state, trajectory, self.config)
        current = (trajectory, key, value, offset)
        step.sends = [s for o in outputs for s in self._outs(o, slot, current)]
        if was_open and not known and (rid in state.trajectories or rid in state.closed_rollouts):
            if self.tables:
                step.writes.append((traj_key(partition, gid, rid), pack(offset, value)))
            slot.offsets[rid] = offset
        if was_open and state.closed:
            self._close(step, gid, slot)
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
            steps.append(Step(slot.partition, writes=[(closed_key(slot.partition, gid), None)]))
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
            kind, partition = split_key(key)
            if partition not in partitions:
                continue
            if kind == b"c":
                state = state_from_bytes(value)
                assert isinstance(state, GroupState)
                tombstones.append((partition, state))
            elif kind == b"t":
                offset, raw = unpack(value)
                trajectory = self.codec.decode(raw, expect=Trajectory)
                gathered.setdefault(trajectory.group_id, []).append((partition, offset, trajectory))
        steps: list[Step] = []
        for partition, state in sorted(tombstones, key=lambda t: t[1].opened_ts):
            self.closed[state.group_id] = Slot(state, partition)
        for gid, stored in gathered.items():
            stored.sort(key=lambda s: s[2].rollout_id)
            partition = stored[0][0]
            if gid in self.closed:
                writes: list[Write] = [(traj_key(p, gid, t.rollout_id), None) for p, _, t in stored]
                steps.append(Step(partition, writes=writes))
                continue
            slot = self.open[gid] = Slot(GroupState(gid), partition)
            outputs: list[GroupOutput] = []
            for _, offset, trajectory in stored:
                self.clock.observe(partition, trajectory.finished_ts, wall_us)
                slot.offsets[trajectory.rollout_id] = offset
                outputs += add_to_group(slot.state, trajectory, self.config)[1]
            if slot.state.closed:
                step = Step(partition, [s for o in outputs for s in self._outs(o, slot, None)])
                self._close(step, gid, slot)
                steps.append(step)
        tally(self.stats, "rebuilt_open", len(self.open))
        return steps

    # --- internals ------------------------------------------------------------------------

    _member_key = staticmethod(traj_key)  # (partition, group_id, rollout_id): a trajectory

    def _outs(
        self,
        output: GroupOutput,
        slot: Slot[GroupState],
        current: tuple[Trajectory, bytes | None, bytes, int] | None,
    ) -> list[Out]:
        if isinstance(output, GroupClosed):
            stats = output.stats
            tally(self.stats, "groups_closed")
            tally(self.stats, "groups_dropped_zero_variance", int(stats.dropped_zero_variance))
            tally(self.stats, "samples", len(output.samples))
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
