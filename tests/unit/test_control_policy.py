"""The elastic controller's policy (rollstream.consumers.control.policy): staleness-aware
admission never lets a rollout be trained staler than eta under its stated assumptions (checked
against an explicit FIFO trainer), the split stays in bounds and moves at most once per cooldown,
decisions round-trip through JSON, and bad input names the field."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.consumers.control import ControlError
from rollstream.consumers.control.policy import (
    REASONS,
    Decision,
    PolicyConfig,
    Signals,
    admission_headroom,
    decide,
    rollout_budget,
)
from rollstream.consumers.errors import ConsumerError


def signals(**changes: Any) -> Signals:
    base = Signals(
        t=100.0,
        trained_version=5,
        max_staleness=2,
        samples_waiting=10,
        samples_per_step=32.0,
        samples_per_rollout=1.0,
        rollouts_in_flight=40,
        rollouts_queued=1000,
        run_slots_max=64,
        inference_share=0.5,
        backend_utilisation=0.3,
        step_time_s=20.0,
        rollout_time_s=15.0,
    )
    return replace(base, **changes)


# -- admission -------------------------------------------------------------------------------


def test_headroom_is_the_window_less_what_comes_first() -> None:
    s = signals()  # (2 + 1) * 32 - 10 waiting = 86 samples: 40 in flight, 46 more
    assert rollout_budget(s) == 86
    assert admission_headroom(s) == 46
    assert admission_headroom(replace(s, samples_per_rollout=2.0)) == 43 - 40
    assert admission_headroom(replace(s, rollouts_in_flight=90)) == 0  # clipped
    assert admission_headroom(replace(s, samples_consumed_in_step=20)) == 26
    assert admission_headroom(s, max_staleness=0) == 0  # 32 - 10 = 22 < 40 in flight
    # backends one version behind: the rollout must be trained a step earlier
    assert admission_headroom(replace(s, serving_version=4)) == 46 - 32


def _last_new_sample_step(s: Signals, admitted: int) -> int:
    """Replay the stated assumptions: a FIFO trainer taking B samples per step (the step in
    progress has taken ``consumed``), samples in order: waiting, in flight, then the new
    rollouts'. Returns the step (relative to the trained version) that trains the last new one."""
    b = int(s.samples_per_step)
    before = s.samples_consumed_in_step + s.samples_waiting
    before += (s.rollouts_in_flight + admitted) * int(s.samples_per_rollout)
    return math.ceil(before / b) - 1


@settings(max_examples=200, deadline=None)
@given(
    eta=st.integers(0, 6),
    b=st.integers(1, 64),
    per_rollout=st.integers(1, 8),
    waiting=st.integers(0, 400),
    in_flight=st.integers(0, 200),
    consumed_frac=st.floats(0, 0.99),
    lag=st.integers(0, 2),
)
def test_headroom_never_admits_a_rollout_trained_staler_than_eta(
    eta: int, b: int, per_rollout: int, waiting: int, in_flight: int, consumed_frac: float, lag: int
) -> None:
    s = signals(
        trained_version=10,
        serving_version=10 - lag,
        max_staleness=eta,
        samples_per_step=float(b),
        samples_per_rollout=float(per_rollout),
        samples_waiting=waiting,
        rollouts_in_flight=in_flight,
        samples_consumed_in_step=int(consumed_frac * b),
    )
    headroom = admission_headroom(s)
    if headroom > 0:
        step = _last_new_sample_step(s, headroom)
        assert (s.trained_version + step) - (10 - lag) <= eta  # N - v <= eta
        # ... and it is the most: one more rollout would land beyond the window
        over = _last_new_sample_step(s, headroom + 1)
        assert (s.trained_version + over) - (10 - lag) > eta


# -- decide ----------------------------------------------------------------------------------


def test_run_slots_are_the_budget_and_fall_below_what_runs_once_it_is_spent() -> None:
    config = PolicyConfig(max_staleness=2)
    d = decide(signals(), config, None)
    assert (d.run_slots, d.admit) == (64, 24)  # the budget (86) capped by the 64 slots
    # 9 of the 40 in flight are out of RUN (finished, their group's samples not out yet)
    d = decide(signals(rollouts_running=31), config, None)
    assert (d.run_slots, d.admit) == (64, 33)
    # window 96, 60 waiting: 36 left for the 40 in flight, 20 of them out of RUN: 16 may run
    full = signals(samples_waiting=60, rollouts_running=20, step_time_s=0.0)
    d = decide(full, config, None)
    assert (d.run_slots, d.admit, d.reason) == (16, 0, "staleness")
    assert d.run_slots < 20  # a RUN slot freed now is not refilled
    off = decide(full, replace(config, admission=False), None)
    assert (off.run_slots, off.admit) == (64, 44)


def test_the_split_moves_toward_training_when_samples_pile_up() -> None:
    config = PolicyConfig(cooldown_s=10)
    d = decide(signals(samples_waiting=60, rollouts_in_flight=10), config, None)
    assert (d.inference_share, d.reason, d.share_since) == (0.4, "trainer-behind", 100.0)


def test_the_split_moves_toward_inference_when_the_trainer_waits_and_inference_is_busy() -> None:
    config = PolicyConfig(cooldown_s=10)
    previous = Decision(t=90.0, run_slots=64, admit=0, inference_share=0.5, reason="steady")
    starved = signals(samples_waiting=0, trainer_idle_s=5.0, backend_utilisation=0.8)
    d = decide(starved, config, previous)
    assert (d.inference_share, d.reason) == (0.6, "trainer-starved")
    # the backends are far from their peak: more of them would not help
    idle_backends = decide(replace(starved, backend_utilisation=0.1), config, previous)
    assert (idle_backends.inference_share, idle_backends.reason) == (0.5, "steady")
    # ... unless rollouts the window allows wait for RUN slots that are all taken
    slots = replace(starved, backend_utilisation=0.1, rollouts_in_flight=64)
    assert decide(slots, config, previous).reason == "trainer-starved"


def test_a_move_toward_training_is_proportional_to_the_samples_waiting_beyond_the_target() -> None:
    config = PolicyConfig(cooldown_s=10, share_step=0.1, max_share=1.0, min_share=0.0)
    # target 1 step (32 samples): 60 waiting is less than a target beyond it: one step
    assert decide(signals(samples_waiting=60), config, None).inference_share == 0.4
    # 96 waiting: two targets beyond it, two steps; 160: four
    d = decide(signals(samples_waiting=96, rollouts_in_flight=0), config, None)
    assert (d.inference_share, d.reason, d.share_since) == (0.3, "trainer-behind", 100.0)
    assert (
        decide(signals(samples_waiting=160, rollouts_in_flight=0), config, None).inference_share
        == 0.1
    )
    # ... at most max_steps_per_move steps (4 by default), and not past the bound
    deep = signals(samples_waiting=400, rollouts_in_flight=0, inference_share=0.9)
    assert decide(deep, config, None).inference_share == 0.5
    assert decide(deep, replace(config, max_steps_per_move=1), None).inference_share == 0.8
    assert decide(deep, replace(config, min_share=0.7), None).inference_share == 0.7
    # the target is half the staleness window at most: eta 0 -> half a step (16 samples)
    half = signals(max_staleness=0, samples_waiting=48, rollouts_in_flight=0)
    assert decide(half, config, None).inference_share == 0.3
    # toward inference it is one step, however long the trainer waited
    previous = Decision(t=90.0, run_slots=64, admit=0, inference_share=0.5, reason="steady")
    starved = signals(samples_waiting=0, trainer_idle_s=10.0, backend_utilisation=0.9)
    assert decide(starved, config, previous).inference_share == 0.6


def test_no_move_before_the_trainer_has_a_step_and_at_most_one_per_step() -> None:
    config = PolicyConfig(cooldown_s=5)
    behind = signals(samples_waiting=60, rollouts_in_flight=10)
    assert decide(replace(behind, step_time_s=0.0), config, None).inference_share == 0.5
    first = decide(behind, config, None)  # t=100, step_time 20 s
    second = decide(replace(behind, t=110.0), config, first)
    assert (second.inference_share, second.reason) == (0.4, "cooldown")
    third = decide(replace(behind, t=120.0), config, second)
    assert (third.inference_share, third.reason) == (0.3, "trainer-behind")


def test_the_split_stops_at_its_bounds() -> None:
    config = PolicyConfig(min_share=0.4, max_share=0.6, cooldown_s=0)
    d = decide(
        signals(samples_waiting=60, rollouts_in_flight=10, inference_share=0.4), config, None
    )
    assert (d.inference_share, d.reason) == (0.4, "share-bound")
    clipped = decide(signals(inference_share=1.0), config, None)  # clipped: a change at t
    assert (clipped.inference_share, clipped.share_since) == (0.6, 100.0)


signal_steps = st.fixed_dictionaries(
    {
        "dt": st.floats(0.5, 30),
        "samples_waiting": st.integers(0, 200),
        "rollouts_in_flight": st.integers(0, 150),
        "trainer_idle_s": st.floats(0, 10),
        "backend_utilisation": st.floats(0, 1),
        "step_time_s": st.floats(0, 40),
        "inference_share": st.floats(0, 1),
    }
)


@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(signal_steps, min_size=1, max_size=40),
    bounds=st.tuples(st.floats(0, 1), st.floats(0, 1)).map(sorted),
    share_step=st.floats(0.01, 0.5),
    cooldown=st.floats(0, 60),
    eta=st.integers(0, 5),
    admission=st.booleans(),
    max_steps=st.integers(1, 6),
)
def test_decisions_stay_in_bounds_and_respect_the_cooldown(
    steps: list[dict[str, Any]],
    bounds: list[float],
    share_step: float,
    cooldown: float,
    eta: int,
    admission: bool,
    max_steps: int,
) -> None:
    config = PolicyConfig(
        max_staleness=eta,
        min_share=bounds[0],
        max_share=bounds[1],
        share_step=share_step,
        cooldown_s=cooldown,
        admission=admission,
        max_steps_per_move=max_steps,
    )
    t, previous = 0.0, None
    for step in steps:
        t += step.pop("dt")
        s = signals(t=t, **step)
        d = decide(s, config, previous)
        assert config.min_share - 1e-9 <= d.inference_share <= config.max_share + 1e-9
        assert 0 <= d.run_slots <= s.run_slots_max and d.admit >= 0
        assert d.reason in REASONS
        if not admission:
            assert d.run_slots == s.run_slots_max
        else:
            assert d.admit <= admission_headroom(s, max_staleness=eta)
        if previous is not None and d.inference_share != previous.inference_share:
            assert previous.share_since is None or (
                t - previous.share_since >= max(cooldown, s.step_time_s) - 1e-9
            )
            moved = d.inference_share - previous.inference_share
            assert moved <= share_step + 1e-9  # toward inference: one step
            assert -moved <= share_step * config.max_steps_per_move + 1e-9
            assert d.share_since == t
        previous = d


# -- Decision JSON ---------------------------------------------------------------------------

decisions = st.builds(
    Decision,
    t=st.floats(-1e9, 1e9),
    run_slots=st.integers(0, 10**6),
    admit=st.integers(0, 10**6),
    inference_share=st.floats(0, 1),
    reason=st.sampled_from(REASONS),
    share_since=st.none() | st.floats(-1e9, 1e9),
)


@given(decisions)
def test_decision_json_round_trip(d: Decision) -> None:
    assert Decision.from_json(json.loads(json.dumps(d.to_json()))) == d


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"admit": -1}, "admit"),
        ({"run_slots": 2.5}, "run_slots"),
        ({"run_slots": True}, "run_slots"),
        ({"inference_share": 1.5}, "inference_share"),
        ({"t": "now"}, "t"),
        ({"t": float("nan")}, "t"),
        ({"reason": ""}, "reason"),
        ({"share_since": "x"}, "share_since"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_bad_decision_names_its_field(change: dict[str, Any], field: str) -> None:
    good = Decision(t=1.0, run_slots=3, admit=1, inference_share=0.5, reason="steady").to_json()
    with pytest.raises(ControlError) as caught:
        Decision.from_json({**good, **change})
    assert caught.value.field == field and field in str(caught.value)


def test_a_decision_without_a_field_or_not_an_object_is_refused() -> None:
    good = Decision(t=1.0, run_slots=3, admit=1, inference_share=0.5, reason="steady").to_json()
    del good["admit"]
    with pytest.raises(ControlError) as caught:
        Decision.from_json(good)
    assert caught.value.field == "admit"
    with pytest.raises(ControlError):
        Decision.from_json([1, 2])


def test_bad_signals_and_config_name_their_field() -> None:
    with pytest.raises(ControlError) as caught:
        signals(samples_per_step=0.0)
    assert caught.value.field == "samples_per_step"
    with pytest.raises(ControlError) as caught:
        signals(rollouts_running=41)  # more than in flight
    assert caught.value.field == "rollouts_running"
    with pytest.raises(ControlError) as caught:
        PolicyConfig(min_share=0.8, max_share=0.2)
    assert caught.value.field == "min_share"
    for bad in (0, 1001, 2.0, True):
        with pytest.raises(ControlError) as caught:
            PolicyConfig(max_steps_per_move=bad)
        assert caught.value.field == "max_steps_per_move"
    s = signals()
    assert Signals.from_json(json.loads(json.dumps(s.to_json()))) == s


def test_control_errors_are_consumer_errors_and_value_errors() -> None:
    assert issubclass(ControlError, ConsumerError)
    assert issubclass(ControlError, ValueError)
