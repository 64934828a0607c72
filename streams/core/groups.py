"""Group aggregator: gathers the trajectories of a group (GRPO group_id), then emits training
samples with rollout-level advantages.

A group closes when ``group_size`` trajectories arrived (``Trajectory.group_size``, else
``GroupConfig.group_size``), or through ``expire_group`` once ``timeout_us`` passed since the
earliest ``finished_ts`` among them (it closes with what arrived). On close:

- advantages over the rollouts' scores (``advantages.py``), in rollout_id order;
- a zero-variance group is dropped (DAPO dynamic sampling): no samples, ``stats`` says so;
- each rollout's samples share its advantage and carry loss weights that sum to 1 per rollout
  (``samples.py``), so a rollout counts once however many samples it yields.

Idempotent: a trajectory whose rollout_id was already gathered is ignored (counted in
``duplicates``); a new rollout for a closed group comes out as ``GroupRejected`` (late).
``add_to_group`` updates the state it is given in place and returns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from rollstream.schemas.events import Sample, Trajectory

from .advantages import advantages, is_zero_variance
from .config import GroupConfig
from .errors import InvalidCode, InvalidTrajectory
from .samples import build_samples

__all__ = [
    "GroupClosed",
    "GroupOutput",
    "GroupRejected",
    "GroupState",
    "GroupStats",
    "add_to_group",
    "expire_group",
    "should_evict_group",
]

_DEFAULT = GroupConfig()


@dataclass(slots=True)
class GroupState:
    group_id: str
    trajectories: dict[str, Trajectory] = field(default_factory=dict)  # by rollout_id
    expected_size: int | None = None
    opened_ts: int = 0  # earliest finished_ts gathered: the timeout clock
    closed: bool = False
    closed_rollouts: list[str] = field(default_factory=list)  # tombstone after close
    duplicates: int = 0


@dataclass(frozen=True, slots=True)
class GroupStats:
    group_id: str
    reason: str  # "full" | "timeout"
    num_rollouts: int
    expected_size: int | None
    reward_mean: float
    reward_std: float
    dropped_zero_variance: bool
    num_samples: int
    num_tokens: int
    rollouts_without_samples: int


@dataclass(frozen=True, slots=True)
class GroupClosed:
    """A closed group: its samples (empty when dropped) in rollout_id order, and its stats."""

    group_id: str
    samples: list[Sample]
    stats: GroupStats


@dataclass(frozen=True, slots=True)
class GroupRejected:
    """A trajectory the aggregator could not use (late for its group, or a broken tree)."""

    trajectory: Trajectory
    code: InvalidCode
    reason: str


GroupOutput: TypeAlias = GroupClosed | GroupRejected


def add_to_group(
    state: GroupState | None, trajectory: Trajectory, config: GroupConfig = _DEFAULT
) -> tuple[GroupState, list[GroupOutput]]:
    """Gather one trajectory; closes the group when it is full."""
    if state is None:
        state = GroupState(trajectory.group_id)
    rollout_id = trajectory.rollout_id
    if trajectory.group_id != state.group_id:
        reason = f"trajectory of group {trajectory.group_id} given to {state.group_id}"
        return state, [GroupRejected(trajectory, InvalidCode.BAD_TRAJECTORY, reason)]
    if rollout_id in state.trajectories or rollout_id in state.closed_rollouts:
        state.duplicates += 1
        return state, []
    if state.closed:
        reason = f"group {state.group_id} closed before rollout {rollout_id} arrived"
        return state, [GroupRejected(trajectory, InvalidCode.LATE_TRAJECTORY, reason)]
    if not state.trajectories or trajectory.finished_ts < state.opened_ts:
        state.opened_ts = trajectory.finished_ts
    state.trajectories[rollout_id] = trajectory
    if state.expected_size is None:
        state.expected_size = trajectory.group_size or config.group_size
    if state.expected_size is not None and len(state.trajectories) >= state.expected_size:
        return state, _close(state, "full", config)
    return state, []


def expire_group(
    state: GroupState, now_us: int, config: GroupConfig = _DEFAULT
) -> tuple[GroupState, list[GroupOutput]]:
    """Close an open group ``timeout_us`` after its earliest finished trajectory."""
    if state.closed or not state.trajectories or now_us - state.opened_ts < config.timeout_us:
        return state, []
    return state, _close(state, "timeout", config)


def should_evict_group(state: GroupState, now_us: int, config: GroupConfig = _DEFAULT) -> bool:
    """True when the shell may delete a closed group's tombstone."""
    return (
        state.closed and now_us - state.opened_ts >= config.timeout_us + config.closed_retention_us
    )


def _close(state: GroupState, reason: str, config: GroupConfig) -> list[GroupOutput]:
    trajectories = [state.trajectories[rid] for rid in sorted(state.trajectories)]
    state.closed = True
    state.closed_rollouts = sorted(state.trajectories)
    state.trajectories = {}
    outputs: list[GroupOutput] = []
    per_rollout: list[tuple[Trajectory, list[Sample]]] = []
    adv_config = config.advantage
    drop = adv_config.drop_zero_variance and is_zero_variance(
        [t.score for t in trajectories], adv_config
    )
    for trajectory in trajectories:
        try:
            samples = [] if drop else build_samples(trajectory, config.samples)
        except InvalidTrajectory as exc:
            outputs.append(GroupRejected(trajectory, exc.code, exc.reason))
            continue
        per_rollout.append((trajectory, samples))
    rewards = [t.score for t, _ in per_rollout]
    values = advantages(rewards, adv_config).tolist()
    emitted: list[Sample] = []
    for (_, samples), value in zip(per_rollout, values, strict=True):
        for sample in samples:
            sample.advantage = float(value)
        emitted.extend(samples)
    r = np.asarray(rewards, dtype=np.float64)
    stats = GroupStats(
        group_id=state.group_id,
        reason=reason,
        num_rollouts=len(per_rollout),
        expected_size=state.expected_size,
        reward_mean=float(r.mean()) if len(r) else 0.0,
        reward_std=float(r.std()) if len(r) else 0.0,
        dropped_zero_variance=drop,
        num_samples=len(emitted),
        num_tokens=sum(s.num_tokens for s in emitted),
        rollouts_without_samples=0 if drop else sum(1 for _, s in per_rollout if not s),
    )
    outputs.append(GroupClosed(state.group_id, emitted, stats))
    return outputs
