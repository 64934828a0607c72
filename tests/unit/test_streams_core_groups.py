"""Group aggregator and rollout-level advantages, checked by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollstream.schemas.events import Trajectory, TrajectoryNode
from rollstream.streams.core import (
    AdvantageConfig,
    ConfigError,
    GroupClosed,
    GroupConfig,
    GroupRejected,
    GroupState,
    InvalidCode,
    SampleConfig,
    add_to_group,
    advantages,
    expire_group,
    is_zero_variance,
    replay,
    should_evict_group,
)

GOLDEN = Path(__file__).parent.parent / "fixtures" / "golden"
_spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
assert _spec is not None and _spec.loader is not None
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)
EPS = 1e-6


def test_advantages_by_hand() -> None:
    r = [1.0, 0.0, 0.0, 1.0]  # mean 0.5, population std 0.5
    np.testing.assert_allclose(advantages(r), np.array([1, -1, -1, 1]) * 0.5 / (0.5 + EPS))
    no_std = AdvantageConfig(normalize_std=False)
    np.testing.assert_allclose(advantages(r, no_std), [0.5, -0.5, -0.5, 0.5])
    # leave-one-out: the baseline of a 1 is (0 + 0 + 1) / 3, of a 0 is (1 + 0 + 1) / 3
    loo = AdvantageConfig(leave_one_out=True, normalize_std=False)
    np.testing.assert_allclose(advantages(r, loo), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    sample_std = AdvantageConfig(std_ddof=1)
    np.testing.assert_allclose(
        advantages(r, sample_std), np.array([0.5, -0.5, -0.5, 0.5]) / (np.sqrt(1 / 3) + EPS)
    )
    np.testing.assert_allclose(advantages([3.0, 1.0]), [1 / (1 + EPS), -1 / (1 + EPS)])
    assert advantages([2.0]).tolist() == [0.0]
    assert is_zero_variance([0.5] * 4) and is_zero_variance([1.0])
    assert not is_zero_variance([0.5, 0.5, 0.5 + 1e-9])
    with pytest.raises(ConfigError):
        AdvantageConfig(std_ddof=2)


def group_of(group_id: str, rewards: list[float], size: int | None = None) -> list[Trajectory]:
    """One trajectory per reward; rollout i has i % 2 + 1 leaves (a rewind for odd ones)."""
    out = []
    for i, reward in enumerate(rewards):
        log = golden.Log(f"{group_id}-r{i}", task_id="t", group_id=group_id, group_size=size)
        log.call("c1", None, 0, [1, 2], [3, 4])
        if i % 2:
            log.call("c2", "c1", 3, [5], [6])  # rewind: a second leaf
        log.add(golden.Reward(reward, "final"))
        _, (trajectory,) = replay(log.add(golden.RolloutFinished()).events)
        trajectory.finished_ts = 1_000 * (i + 1)
        out.append(trajectory)
    return out


def feed(trajectories: list[Trajectory], config: GroupConfig) -> tuple[GroupState, list[Any]]:
    state = None
    outputs: list[Any] = []
    for t in trajectories:
        state, out = add_to_group(state, t, config)
        outputs += out
    assert state is not None
    return state, outputs


def test_a_full_group_closes_with_advantages_and_per_rollout_weights() -> None:
    trajectories = group_of("g", [1.0, 0.0, 0.0, 1.0], size=4)
    state, out = feed(trajectories[::-1] + trajectories[:2], GroupConfig())  # + 2 duplicates
    (closed,) = out
    assert isinstance(closed, GroupClosed)
    assert [s.rollout_id for s in closed.samples] == [
        "g-r0",
        "g-r1",
        "g-r1",
        "g-r2",
        "g-r3",
        "g-r3",
    ]
    a = 0.5 / (0.5 + EPS)
    assert [s.advantage for s in closed.samples] == pytest.approx([a, -a, -a, -a, a, a])
    assert [s.loss_weight for s in closed.samples] == [1.0, 0.5, 0.5, 1.0, 0.5, 0.5]
    assert [s.reward for s in closed.samples] == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    stats = closed.stats
    assert (stats.reason, stats.num_rollouts, stats.expected_size, stats.num_samples) == (
        "full",
        4,
        4,
        6,
    )
    assert (stats.reward_mean, stats.reward_std, stats.dropped_zero_variance) == (0.5, 0.5, False)
    assert stats.num_tokens == sum(s.num_tokens for s in closed.samples)
    assert state.duplicates == 2  # the two re-sent after close
    # after close: a known rollout again is a duplicate, a new one is late
    late = group_of("g", [1.0] * 5, size=4)[4]
    state, out = add_to_group(state, trajectories[0])
    assert out == [] and state.duplicates == 3
    state, out = add_to_group(state, late)
    assert [(type(o), o.code) for o in out] == [(GroupRejected, InvalidCode.LATE_TRAJECTORY)]


def test_duplicates_before_close_count_once() -> None:
    trajectories = group_of("g", [1.0, 0.0, 1.0], size=3)
    state, out = feed([trajectories[0], trajectories[0], trajectories[1]], GroupConfig())
    assert out == [] and len(state.trajectories) == 2 and state.duplicates == 1


def test_zero_variance_group_is_dropped_and_counted() -> None:
    trajectories = group_of("same", [1.0] * 4, size=4)
    _, (closed,) = feed(trajectories, GroupConfig())
    assert closed.samples == [] and closed.stats.dropped_zero_variance
    keep = GroupConfig(advantage=AdvantageConfig(drop_zero_variance=False))
    _, (closed,) = feed(trajectories, keep)
    assert len(closed.samples) == 6 and {s.advantage for s in closed.samples} == {0.0}


def test_timeout_closes_with_what_arrived() -> None:
    config = GroupConfig(group_size=8, timeout_us=5_000)
    trajectories = group_of("slow", [1.0, 0.0, 0.5])  # no group_size: the config's 8
    state, out = feed(trajectories[1:], config)  # finished at 2_000 and 3_000
    assert out == [] and state.expected_size == 8 and state.opened_ts == 2_000
    state, out = add_to_group(state, trajectories[0], config)
    assert out == [] and state.opened_ts == 1_000
    assert expire_group(state, 5_999, config)[1] == []
    state, (closed,) = expire_group(state, 6_000, config)
    assert isinstance(closed, GroupClosed)
    assert (closed.stats.reason, closed.stats.num_rollouts) == ("timeout", 3)
    assert expire_group(state, 10**9, config)[1] == []
    assert not should_evict_group(state, 6_000, config)
    assert should_evict_group(state, 1_000 + config.timeout_us + config.closed_retention_us, config)


def test_tree_mode_groups_and_broken_trajectories() -> None:
    trajectories = group_of("g", [0.0, 1.0], size=3)
    broken = Trajectory(
        "g-bad",
        "t",
        "g",
        "completed",
        0.5,
        [TrajectoryNode("x", "nowhere", 1, [1], [2], [-0.1])],
    )
    config = GroupConfig(samples=SampleConfig(mode="tree"))
    _, out = feed([*trajectories, broken], config)
    rejected, closed = out
    assert isinstance(rejected, GroupRejected) and rejected.code is InvalidCode.BAD_TRAJECTORY
    assert isinstance(closed, GroupClosed)
    assert closed.stats.num_rollouts == 2 and closed.stats.reward_mean == 0.5
    assert [(s.rollout_id, s.loss_weight, s.advantage > 0) for s in closed.samples] == [
        ("g-r0", 1.0, False),
        ("g-r1", 1.0, True),
    ]
    # c1 = [1, 2, 3, 4]; c2 rewinds to [1, 2, 3] and adds [5, 6] under token 3 (index 2)
    assert closed.samples[1].input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert closed.samples[1].parent_indices.tolist() == [-1, 0, 1, 2, 2, 4]
    other = group_of("h", [1.0])[0]
    state, out = add_to_group(None, trajectories[0])
    state, out = add_to_group(state, other)
    assert [o.code for o in out] == [InvalidCode.BAD_TRAJECTORY]
