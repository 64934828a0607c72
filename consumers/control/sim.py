"""The simulator: a discrete-event model of an RL run, to plan the elastic controller's policy
at cluster scale and to compare it with the published asynchronous RL systems.

    simulate(workload, policy, seed=0, steps=None) -> SimResult     one run
    compare(workload, policies, seeds=(0, 1, 2), steps=None) -> list[PolicySummary]
                                                                    medians over seeds, speedup
                                                                    against sync
    POLICY_NAMES                                                    sync, collocated_async,
                                                                    fully_async, elastic,
                                                                    rollstream,
                                                                    rollstream_partial

The model (sim_engine.py: the clock, the fluid inference pool, rollouts; sim_policies.py: the
systems; sim_workloads.py: the workloads) is described in docs/simulator.md. A run ends when
the trainer has finished ``steps`` steps (``workload.steps`` by default); its wall time is the
time of that moment, ``step_ends`` the time each step ended (the time to version k, the
pipeline's filling included, is ``step_ends[k - 1]``). ``step_s`` is the steady time per
step: from the end of step ``steps // 4`` (the pipeline has filled) to the end, per step;
speedups compare it, as the published figures come from runs of hundreds of steps, where
filling the pipeline is negligible. Utilisation is busy accelerator-seconds over N x wall:
``util_rollout`` while a sequence decodes on it, ``util_train`` while it trains; switching,
weight loads, resharding and waiting are not busy. Staleness is counted per trained sample:
the trainer's version at the step that trained it minus the version of the weights its
rollout started with. Waste is the rollouts generated and then dropped for being staler than
``max_staleness``. Conservation: rollouts started = trained + wasted + waiting (complete, not
trained when the run ended) + in flight.

Pure: no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

from rollstream.consumers.control.errors import WorkloadError
from rollstream.consumers.control.sim_engine import Engine
from rollstream.consumers.control.sim_policies import (
    CollocatedAsync,
    Driver,
    Elastic,
    FullyAsync,
    Sync,
)
from rollstream.consumers.control.sim_rollstream import Rollstream, RollstreamPartial
from rollstream.consumers.control.sim_workloads import Workload

__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "PolicySummary",
    "SimResult",
    "compare",
    "simulate",
    "summarise",
]

POLICIES: Final[dict[str, type[Driver]]] = {
    "sync": Sync,
    "collocated_async": CollocatedAsync,
    "fully_async": FullyAsync,
    "elastic": Elastic,
    "rollstream": Rollstream,
    "rollstream_partial": RollstreamPartial,
}
POLICY_NAMES: Final = tuple(POLICIES)


@dataclass(frozen=True)
class SimResult:
    """One simulated run."""

    workload: str
    policy: str
    seed: int
    wall_s: float
    step_s: float  # steady time per step (module docstring)
    steps: int
    samples_trained: int
    util_rollout: float
    util_train: float
    staleness: dict[int, int]  # samples trained, by staleness
    rollouts_started: int
    rollouts_trained: int
    rollouts_wasted: int
    rollouts_waiting: int
    rollouts_in_flight: int
    mean_inference_share: float
    reasons: dict[str, int]  # rollstream: decisions by reason
    events: int
    step_ends: tuple[float, ...] = ()  # when each trainer step ended

    @property
    def util(self) -> float:
        return self.util_rollout + self.util_train

    @property
    def waste(self) -> float:
        """Rollouts dropped as stale over rollouts finished and consumed (trained + dropped)."""
        done = self.rollouts_trained + self.rollouts_wasted
        return self.rollouts_wasted / done if done else 0.0

    def staleness_quantile(self, q: float) -> int:
        total = sum(self.staleness.values())
        if total == 0:
            return 0
        seen = 0
        for value in sorted(self.staleness):
            seen += self.staleness[value]
            if seen >= q * total:
                return value
        return max(self.staleness)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["staleness"] = {str(k): v for k, v in sorted(self.staleness.items())}
        return out


@dataclass(frozen=True)
class PolicySummary:
    """One policy on one workload: medians over seeds."""

    workload: str
    policy: str
    seeds: int
    wall_s: float
    step_s: float
    speedup: float | None  # median over seeds of sync's step_s / this step_s (same seed)
    util_rollout: float
    util_train: float
    waste: float
    staleness_p50: int
    staleness_max: int  # over all seeds
    mean_inference_share: float

    @property
    def util(self) -> float:
        return self.util_rollout + self.util_train

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "util": round(self.util, 4)}


def simulate(
    workload: Workload, policy: str, *, seed: int = 0, steps: int | None = None
) -> SimResult:
    """One run of ``policy`` on ``workload`` until ``steps`` trainer steps (module docstring)."""
    if policy not in POLICIES:
        known = ", ".join(POLICY_NAMES)
        raise WorkloadError(f"unknown policy {policy!r} (known: {known})", field="policy")
    target = workload.steps if steps is None else steps
    if not 1 <= target <= 100_000:
        raise WorkloadError(f"{target} is outside [1, 100000]", field="steps")
    engine = Engine(workload, seed, float(workload.accelerators))  # drivers set their split
    driver = POLICIES[policy](engine, target)
    engine.run(driver, driver.start)
    wall = engine.now
    ends = [0.0, *engine.step_ends]
    skip = len(engine.step_ends) // 4
    step_s = (ends[-1] - ends[skip]) / (len(ends) - 1 - skip)
    capacity = workload.accelerators * wall if wall > 0 else 1.0
    size = workload.group_size
    waiting = driver.waiting_groups() * size
    reasons: Counter[str] = Counter()
    if isinstance(driver, Rollstream):
        reasons.update(d.reason for d in driver.decisions)
    return SimResult(
        workload=workload.name,
        policy=policy,
        seed=seed,
        wall_s=wall,
        step_s=step_s,
        steps=engine.steps,
        samples_trained=sum(engine.staleness.values()),
        util_rollout=engine.pool.busy_s / capacity,
        util_train=engine.train_busy_s / capacity,
        staleness=dict(engine.staleness),
        rollouts_started=engine.rollouts_started,
        rollouts_trained=engine.rollouts_trained,
        rollouts_wasted=engine.rollouts_wasted,
        rollouts_waiting=waiting,
        rollouts_in_flight=engine.in_flight,
        mean_inference_share=engine.share_area / wall if wall > 0 else 0.0,
        reasons=dict(reasons),
        events=engine.events,
        step_ends=tuple(engine.step_ends),
    )


def _median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def summarise(results: Sequence[SimResult], sync: Sequence[SimResult] | None) -> PolicySummary:
    """Medians of one policy's runs; ``sync`` (same seeds) gives the speedup."""
    first = results[0]
    speedup = None
    if sync:
        by_seed = {r.seed: r.step_s for r in sync}
        ratios = [by_seed[r.seed] / r.step_s for r in results if r.seed in by_seed]
        speedup = _median(ratios) if ratios else None
    p50s = [r.staleness_quantile(0.5) for r in results]
    return PolicySummary(
        workload=first.workload,
        policy=first.policy,
        seeds=len(results),
        wall_s=_median(r.wall_s for r in results),
        step_s=_median(r.step_s for r in results),
        speedup=speedup,
        util_rollout=_median(r.util_rollout for r in results),
        util_train=_median(r.util_train for r in results),
        waste=_median(r.waste for r in results),
        staleness_p50=math.floor(_median(p50s)),
        staleness_max=max(max(r.staleness, default=0) for r in results),
        mean_inference_share=_median(r.mean_inference_share for r in results),
    )


def compare(
    workload: Workload,
    policies: Sequence[str] = POLICY_NAMES,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    steps: int | None = None,
) -> list[PolicySummary]:
    """Every policy on ``workload`` for every seed; sync runs too (the speedup's base)."""
    if not seeds:
        raise WorkloadError("at least one seed", field="seeds")
    runs = {
        policy: [simulate(workload, policy, seed=s, steps=steps) for s in seeds]
        for policy in dict.fromkeys(["sync", *policies])
    }
    return [summarise(runs[p], runs["sync"]) for p in dict.fromkeys(policies)]
