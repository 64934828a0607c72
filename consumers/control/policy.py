"""The elastic controller's policy: one pure function, ``decide``, shared by the live controller
(controller.py, every ``control_period_s``) and the simulator (sim.py, every control period of a
simulated run), so what ``rollstream simulate`` plans is what ``rollstream controller`` does.

    Signals        one snapshot of the run (trainer, sample log, RUN stage, accelerators)
    PolicyConfig   the knobs: staleness bound, share bounds and step(s), target, cooldown
    Decision       run_slots, admit, inference_share, reason (JSON round trip, validated)
    admission_headroom(signals) -> int
    rollout_budget(signals) -> int      in flight + headroom, before the clip
    decide(signals, config, previous) -> Decision

Staleness. The trainer publishes version V; its next step N = V trains on weights V and
publishes V + 1. A sample generated with weights v is trained at step N only if N - v <= eta
(``max_staleness``); staler ones are dropped by the trainer: generated for nothing.

Admission (``admission_headroom``). A rollout that starts now is generated with the weights the
backends serve (``serving_version``, else V) and must be trained by step serving + eta: the steps
V .. serving + eta, ``windows`` of them (eta + 1 when the backends serve V), train
windows * B samples (B = ``samples_per_step``), less what the step in progress already took
(``samples_consumed_in_step``). The samples already waiting (W) and those of the rollouts in
flight (I rollouts of s samples) come first, so

    headroom = floor((windows * B - consumed - W) / s) - I, clipped to >= 0.

Under these assumptions no admitted rollout is trained staler than eta: the trainer takes
samples in the order they arrive, each step takes B, every rollout yields s samples, and the
rollouts finish in the order they started. The bound is on counts: when rollouts finish out of
order, a slow one admitted at the edge of the window can still land beyond it, and the trainer
drops it (the simulator counts it as waste). A decision can be followed two ways: ``admit`` as
a start budget until the next decision (the live RUN workers and the simulator: never past the
bound), or ``run_slots`` as a cap that workers refill as rollouts end (past the bound by the
rollouts that leave RUN before their group's samples are out, until the next decision).

``decide``:
- RUN slots: run_slots caps the rollouts holding a RUN slot (R = ``rollouts_running``, or I
  when not given); workers refill a freed slot while they hold fewer. With admission on,
  run_slots = min(run_slots_max, max(0, budget - (I - R))) where budget = floor((windows * B -
  consumed - W) / s) is the rollouts the window holds (= I + headroom before the clip) and
  I - R are the rollouts in flight outside RUN (finished, their group's samples not out yet);
  off, run_slots = run_slots_max. admit = max(0, run_slots - R). Once the window is spent
  run_slots falls below R, so a freed slot is not refilled (with run_slots = I + clipped
  headroom, refilled slots would keep I at its level for ever).
- The split (``inference_share``, the fraction of accelerators serving inference) moves
  within [min_share, max_share], at most once per max(``cooldown_s``, ``step_time_s``)
  (hysteresis: a move shows in the trainer's next step, so one move per step at most), and not
  before the trainer has a measured step (``step_time_s`` > 0: while the pipeline fills, the
  trainer waits whatever the split):
  * toward training ("trainer-behind") when more than T steps of samples wait (T =
    ``target_waiting_steps``, at most half the staleness window, (eta + 1) / 2 steps, so the
    signal exists for a small eta) and the trainer did not wait for samples: the trainer is
    the bottleneck. The move is proportional to the imbalance: one ``share_step`` per T steps
    of samples waiting beyond T (W = 3 T B: two steps), at least one and at most
    ``max_steps_per_move``. When generation far outruns training, the first measured step
    finds the window full of samples and the split goes most of the way at once, where one
    ``share_step`` per trainer step would take several steps; a small excess moves one step;
  * toward inference ("trainer-starved"), one ``share_step``, when the trainer waited for
    samples for more than ``idle_tolerance`` of the time since the previous decision and more
    inference would be used: the backends run near their peak (``backend_utilisation >=
    saturation``), or rollouts that the staleness bound allows (headroom > 0) wait for RUN
    slots that are all taken (how long the trainer waited does not say how much inference it
    lacks, so this side does not jump);
  * otherwise it stays. Between "behind" (samples pile up) and "starved" (the trainer waits)
    lies a dead band where nothing moves.
- reason: "trainer-behind" / "trainer-starved" when the share moved; else "staleness" when
  admission is closed by the bound (headroom 0); else "cooldown" / "share-bound" when the share
  wanted to move and could not; else "steady".

A first decision (no previous) starts from ``signals.inference_share`` clipped to the bounds.
Pure: no I/O; bad values raise ``ControlError`` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Final, TypeVar

from rollstream.consumers.control.errors import ControlError

__all__ = [
    "REASONS",
    "ControlError",
    "Decision",
    "PolicyConfig",
    "Signals",
    "admission_headroom",
    "decide",
    "rollout_budget",
]

REASONS: Final = (
    "trainer-behind",
    "trainer-starved",
    "staleness",
    "cooldown",
    "share-bound",
    "steady",
)
MAX_COUNT: Final = 10**12  # samples, rollouts, versions
MAX_SLOTS: Final = 1_000_000_000
MAX_SECONDS: Final = 1e7
MAX_TIME: Final = 1e12  # |t|: wall-clock or monotonic seconds
MAX_STALENESS: Final = 1000
_EPS: Final = 1e-9


def _number(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ControlError(f"must be a number, not {type(value).__name__}", field=name)
    if not math.isfinite(value):
        raise ControlError("must be finite", field=name)
    if value < lo or value > hi or (lo_open and value <= lo):
        bracket = "(" if lo_open else "["
        raise ControlError(f"{value} is outside {bracket}{lo}, {hi}]", field=name)
    return float(value)


def _integer(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ControlError(f"must be an integer, not {type(value).__name__}", field=name)
    if not lo <= value <= hi:
        raise ControlError(f"{value} is outside [{lo}, {hi}]", field=name)
    return value


_T = TypeVar("_T")


def _from_mapping(cls: type[_T], data: Any) -> _T:
    """``cls(**data)`` for a JSON object: unknown and missing fields raise ControlError."""
    if not isinstance(data, Mapping):
        raise ControlError(f"a {cls.__name__} is a JSON object, not {type(data).__name__}")
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    for key in data:
        if key not in names:
            raise ControlError(f"unknown field of {cls.__name__}", field=str(key))
    required = [
        f.name
        for f in fields(cls)  # type: ignore[arg-type]
        if f.name not in data and f.default is MISSING and f.default_factory is MISSING
    ]
    if required:
        raise ControlError(f"missing from {cls.__name__}", field=required[0])
    return cls(**dict(data))


@dataclass(frozen=True)
class Signals:
    """One snapshot of the run, as the live controller or the simulator sees it."""

    t: float  # seconds (any monotonic origin)
    trained_version: int  # newest policy version the trainer published (V >= 0)
    max_staleness: int  # the trainer's bound eta (module docstring)
    samples_waiting: int  # samples on the log the trainer has not consumed (W, its lag)
    samples_per_step: float  # recent mean samples per trainer step (B > 0)
    samples_per_rollout: float  # recent mean samples per finished rollout (s > 0)
    rollouts_in_flight: int  # admitted to RUN, samples not produced yet (I)
    rollouts_queued: int  # waiting to be admitted (RUN queue lag)
    run_slots_max: int  # rollout capacity available (RUN workers x concurrency)
    inference_share: float  # fraction of accelerators serving inference now (0..1)
    backend_utilisation: float  # 0..1: how close the backends run to their capacity
    step_time_s: float  # recent trainer step time (0: unknown)
    rollout_time_s: float  # recent mean rollout time, RUN start -> finished (0: unknown)
    trainer_idle_s: float = 0.0  # seconds the trainer waited for samples since the last snapshot
    samples_consumed_in_step: int = 0  # samples the step in progress already took
    serving_version: int | None = None  # version the backends serve (None: trained_version)
    rollouts_running: int | None = None  # of the in flight, those holding a RUN slot (None: all)

    def __post_init__(self) -> None:
        _number("t", self.t, -MAX_TIME, MAX_TIME)
        _integer("trained_version", self.trained_version, 0, MAX_COUNT)
        _integer("max_staleness", self.max_staleness, 0, MAX_STALENESS)
        _integer("samples_waiting", self.samples_waiting, 0, MAX_COUNT)
        _number("samples_per_step", self.samples_per_step, 0, MAX_COUNT, lo_open=True)
        _number("samples_per_rollout", self.samples_per_rollout, 0, MAX_COUNT, lo_open=True)
        _integer("rollouts_in_flight", self.rollouts_in_flight, 0, MAX_COUNT)
        _integer("rollouts_queued", self.rollouts_queued, 0, MAX_COUNT)
        _integer("run_slots_max", self.run_slots_max, 0, MAX_SLOTS)
        _number("inference_share", self.inference_share, 0.0, 1.0)
        _number("backend_utilisation", self.backend_utilisation, 0.0, 1.0)
        _number("step_time_s", self.step_time_s, 0.0, MAX_SECONDS)
        _number("rollout_time_s", self.rollout_time_s, 0.0, MAX_SECONDS)
        _number("trainer_idle_s", self.trainer_idle_s, 0.0, MAX_SECONDS)
        _integer("samples_consumed_in_step", self.samples_consumed_in_step, 0, MAX_COUNT)
        if self.serving_version is not None:
            _integer("serving_version", self.serving_version, 0, self.trained_version)
        if self.rollouts_running is not None:
            _integer("rollouts_running", self.rollouts_running, 0, self.rollouts_in_flight)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Any) -> Signals:
        return _from_mapping(cls, data)


@dataclass(frozen=True)
class PolicyConfig:
    """The policy's knobs (module docstring); every one bounded."""

    max_staleness: int = 2  # admission bound; the stricter of this and Signals.max_staleness
    min_share: float = 0.1  # inference_share never below ...
    max_share: float = 0.9  # ... nor above
    share_step: float = 0.1  # one move of the split
    target_waiting_steps: float = 1.0  # keep about this many steps of samples waiting
    cooldown_s: float = 10.0  # min time between share changes
    admission: bool = True  # staleness-aware admission on/off
    idle_tolerance: float = 0.05  # trainer idle fraction above which it is starved
    saturation: float = 0.5  # backend_utilisation at which more inference helps
    max_steps_per_move: int = 4  # a move toward training takes up to this many share_steps

    def __post_init__(self) -> None:
        _integer("max_staleness", self.max_staleness, 0, MAX_STALENESS)
        _number("min_share", self.min_share, 0.0, 1.0)
        _number("max_share", self.max_share, 0.0, 1.0)
        if self.min_share > self.max_share:
            raise ControlError(
                f"min_share {self.min_share} > max_share {self.max_share}", field="min_share"
            )
        _number("share_step", self.share_step, 0.0, 1.0, lo_open=True)
        _number("target_waiting_steps", self.target_waiting_steps, 0.0, 1e6)
        _number("cooldown_s", self.cooldown_s, 0.0, MAX_SECONDS)
        if not isinstance(self.admission, bool):
            raise ControlError("must be a boolean", field="admission")
        _number("idle_tolerance", self.idle_tolerance, 0.0, 1.0)
        _number("saturation", self.saturation, 0.0, 1.0)
        _integer("max_steps_per_move", self.max_steps_per_move, 1, 1000)


@dataclass(frozen=True)
class Decision:
    """What the controller decided at ``t`` (module docstring)."""

    t: float
    run_slots: int  # global cap on rollouts in RUN at once (below in flight: none refilled)
    admit: int  # how many new rollouts may start now
    inference_share: float  # share of accelerators serving inference
    reason: str  # one of REASONS (machine-readable)
    share_since: float | None = None  # t at which the share took its value (None: never moved)

    def __post_init__(self) -> None:
        _number("t", self.t, -MAX_TIME, MAX_TIME)
        _integer("run_slots", self.run_slots, 0, MAX_SLOTS)
        _integer("admit", self.admit, 0, MAX_SLOTS)
        _number("inference_share", self.inference_share, 0.0, 1.0)
        if not isinstance(self.reason, str) or not 0 < len(self.reason) <= 200:
            raise ControlError("must be a string of 1 to 200 characters", field="reason")
        if self.share_since is not None:
            _number("share_since", self.share_since, -MAX_TIME, MAX_TIME)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Any) -> Decision:
        return _from_mapping(cls, data)


def rollout_budget(s: Signals, max_staleness: int | None = None) -> int:
    """Rollouts (in flight and new) the staleness window holds: floor((windows * B - consumed
    - W) / s), clipped to [0, MAX_SLOTS] (module docstring)."""
    eta = s.max_staleness if max_staleness is None else max_staleness
    serving = s.trained_version if s.serving_version is None else s.serving_version
    windows = serving + eta - s.trained_version + 1
    if windows <= 0:
        return 0
    room = windows * s.samples_per_step - s.samples_consumed_in_step - s.samples_waiting
    return max(0, min(math.floor(room / s.samples_per_rollout + _EPS), MAX_SLOTS))


def admission_headroom(s: Signals, max_staleness: int | None = None) -> int:
    """Rollouts that can start now and still be trained within the staleness bound (module
    docstring); ``max_staleness`` overrides ``s.max_staleness`` (decide passes the stricter)."""
    return max(0, rollout_budget(s, max_staleness) - s.rollouts_in_flight)


def _clip(share: float, config: PolicyConfig) -> float:
    return round(min(max(share, config.min_share), config.max_share), 9)


def _wanted_move(s: Signals, config: PolicyConfig, previous: Decision | None, headroom: int) -> int:
    """Share steps to move: > 0 toward inference, < 0 toward training, 0: stay (module
    docstring)."""
    eta = min(config.max_staleness, s.max_staleness)
    period = s.t - previous.t if previous is not None else 0.0
    if period > 0:
        idle_fraction = min(s.trainer_idle_s / period, 1.0)
    else:
        idle_fraction = 1.0 if s.trainer_idle_s > 0 else 0.0
    if idle_fraction > config.idle_tolerance:
        running = s.rollouts_in_flight if s.rollouts_running is None else s.rollouts_running
        slots_bound = headroom > 0 and s.rollouts_queued > 0 and running >= s.run_slots_max
        return 1 if s.backend_utilisation >= config.saturation or slots_bound else 0
    behind_at = min(config.target_waiting_steps, (eta + 1) / 2)
    target = behind_at * s.samples_per_step  # samples
    if s.samples_waiting <= target:
        return 0
    if target == 0:
        return -config.max_steps_per_move
    # one share_step per target's worth of samples waiting beyond the target, at least one
    steps = math.floor((s.samples_waiting - target) / target + _EPS)
    return -min(max(steps, 1), config.max_steps_per_move)


def decide(signals: Signals, config: PolicyConfig, previous: Decision | None) -> Decision:
    """The decision for ``signals`` (module docstring); ``previous`` is the last decision."""
    eta = min(config.max_staleness, signals.max_staleness)
    budget = rollout_budget(signals, max_staleness=eta)
    in_flight = signals.rollouts_in_flight
    running = in_flight if signals.rollouts_running is None else signals.rollouts_running
    headroom = max(0, budget - in_flight)
    if config.admission:
        run_slots = min(signals.run_slots_max, max(0, budget - (in_flight - running)))
    else:
        run_slots = signals.run_slots_max
    admit = max(0, run_slots - running)

    if previous is None:
        before, since = signals.inference_share, None
    else:
        before, since = previous.inference_share, previous.share_since
    current = _clip(before, config)
    if current != before:
        since = signals.t  # clipped into new bounds: that is a change too
    move = _wanted_move(signals, config, previous, headroom) if signals.step_time_s > 0 else 0
    share, reason = current, ""
    if move:
        cooldown = max(config.cooldown_s, signals.step_time_s)
        cooled = since is None or signals.t - since >= cooldown
        target = _clip(current + move * config.share_step, config)
        if not cooled:
            reason = "cooldown"
        elif target == current:
            reason = "share-bound"
        else:
            share, since = target, signals.t
            reason = "trainer-starved" if move > 0 else "trainer-behind"
    if reason in ("", "cooldown", "share-bound") and config.admission and headroom == 0:
        reason = "staleness"
    return Decision(
        t=signals.t,
        run_slots=run_slots,
        admit=admit,
        inference_share=share,
        reason=reason or "steady",
        share_since=since,
    )
