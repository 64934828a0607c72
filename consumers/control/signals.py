"""From what the log says to the controller's ``Signals``, and from a ``Decision`` to the
``CapacityDecision`` the workers follow. Pure: the controller (controller.py) reads the records
and the offsets, this module does the arithmetic.

What is measured and how (``SignalBook``):

    trained_version      newest PolicyVersion on policy.versions
    samples_per_step     mean samples_trained growth over the last versions (B);
                         ``default_samples_per_step`` before the first version
    step_time_s          mean time between the last versions (their ts)
    samples_waiting      the trainer group's lag on the samples topic (W)
    samples_per_rollout  samples produced / trajectories produced (rollouts the processors
                         closed), since the controller started; ``default_samples_per_rollout``
                         until both are known (s). Groups still gathering make it low for a
                         while (their rollouts are closed, their samples not out yet).
    rollouts_in_flight   rollouts taken by RUN since the controller started and not closed by
                         the processors yet: RUN started - trajectories produced; never less
                         than what the RUN and EVAL workers hold now (I). A rollout of a group
                         DAPO drops counts until its trajectory is out, then never again.
    rollouts_running     what the live RUN workers hold now (R <= I)
    rollouts_queued      the RUN group's lag minus what RUN workers hold
    run_slots_max        the live RUN workers' summed concurrency
    rollout_time_s       mean RUN stage time of the rollouts done since the controller started
    backend_utilisation  RUN slots held / run_slots_max (the proxy's own figure is not read)
    trainer_idle_s       the period when no sample waits for a trainer that has published a
                         version (it waits for samples), else 0

A worker is live while its newest report is younger than 3 of its periods and not
``stopping``. Counters of a worker that restarted (they went down) start over from the new
values.

``split`` turns the decided new starts (``admit``) into per-worker budgets on each worker's own
RUN-started counter (schemas/control.py): the starts go to the workers with free slots, in
proportion to them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final

from rollstream.consumers.control.policy import Decision, Signals
from rollstream.schemas import PolicyVersion
from rollstream.schemas.control import CapacityDecision, WorkerReport

__all__ = ["SignalBook", "split", "to_capacity"]

VERSION_WINDOW: Final = 8
MAX_WORKERS: Final = 4096


@dataclass
class _Worker:
    report: WorkerReport
    base_started: int  # RUN started when first seen (or at its restart)
    base_run_done: int
    base_run_busy: float
    run_started: int = 0  # since the controller saw it first (summed across its restarts)
    run_done: int = 0
    run_busy: float = 0.0


def _counts(report: WorkerReport) -> tuple[int, int, float]:
    """(RUN started, RUN done, RUN seconds busy) of a report."""
    run = report.stages.get("run")
    return (run.started, run.done, run.busy_s) if run else (0, 0, 0.0)


@dataclass
class SignalBook:
    max_staleness: int
    default_samples_per_rollout: float = 1.0
    default_samples_per_step: float = 64.0
    workers: dict[str, _Worker] = field(default_factory=dict)
    versions: deque[PolicyVersion] = field(default_factory=lambda: deque(maxlen=VERSION_WINDOW))
    samples_at_start: int | None = None
    samples_now: int = 0
    closed_at_start: int | None = None
    closed_now: int = 0
    samples_waiting: int = 0
    run_lag: int = 0

    # --- feeding ---

    def report(self, rep: WorkerReport) -> None:
        started, run_done, run_busy = _counts(rep)
        w = self.workers.get(rep.worker)
        if w is None:
            if len(self.workers) >= MAX_WORKERS:  # forget the oldest report's worker
                del self.workers[min(self.workers, key=lambda k: self.workers[k].report.ts)]
            self.workers[rep.worker] = _Worker(rep, started, run_done, run_busy)
            return
        prev = _counts(w.report)
        if started < prev[0] or run_done < prev[1]:  # restarted: its counters start over
            w.run_started += prev[0] - w.base_started
            w.run_done += prev[1] - w.base_run_done
            w.run_busy += prev[2] - w.base_run_busy
            w.base_started, w.base_run_done, w.base_run_busy = 0, 0, 0.0
        w.report = rep

    def version(self, record: PolicyVersion) -> None:
        if not self.versions or record.version > self.versions[-1].version:
            self.versions.append(record)

    def offsets(
        self, samples_total: int, closed_total: int, samples_waiting: int, run_lag: int
    ) -> None:
        """``samples_total`` / ``closed_total``: summed high watermarks of the samples and the
        trajectories topics now."""
        if self.samples_at_start is None or self.closed_at_start is None:
            self.samples_at_start, self.closed_at_start = samples_total, closed_total
        self.samples_now, self.closed_now = samples_total, closed_total
        self.samples_waiting, self.run_lag = samples_waiting, run_lag

    # --- reading ---

    def live(self, now: float) -> list[WorkerReport]:
        return [
            w.report
            for w in self.workers.values()
            if not w.report.stopping and now - w.report.ts <= 3 * w.report.period_s
        ]

    def _totals(self) -> tuple[int, int, float]:
        """RUN started, done and seconds busy since the controller saw each worker first."""
        started = run_done = 0
        busy = 0.0
        for w in self.workers.values():
            s, r, b = _counts(w.report)
            started += w.run_started + s - w.base_started
            run_done += w.run_done + r - w.base_run_done
            busy += w.run_busy + b - w.base_run_busy
        return started, run_done, busy

    def signals(self, now: float, inference_share: float, period_s: float = 0.0) -> Signals:
        live = self.live(now)
        run_loads = [r.stages["run"] for r in live if "run" in r.stages]
        eval_loads = [r.stages["eval"] for r in live if "eval" in r.stages]
        held_run = sum(s.in_flight for s in run_loads)
        held = held_run + sum(s.in_flight for s in eval_loads)
        slots_max = sum(s.concurrency for s in run_loads)
        started, run_done, busy = self._totals()
        produced = self.samples_now - (self.samples_at_start or 0)
        closed = self.closed_now - (self.closed_at_start or 0)
        per_rollout = (
            produced / closed if produced > 0 and closed > 0 else self.default_samples_per_rollout
        )
        in_flight = max(held, started - closed)
        v = list(self.versions)
        per_step, step_time = self.default_samples_per_step, 0.0
        if len(v) >= 2:
            per_step = (v[-1].samples_trained - v[0].samples_trained) / (
                v[-1].version - v[0].version
            )
            step_time = (v[-1].ts - v[0].ts) / 1e6 / (v[-1].version - v[0].version)
        elif v and v[-1].version > 0:
            per_step = v[-1].samples_trained / v[-1].version
        return Signals(
            t=now,
            trained_version=v[-1].version if v else 0,
            max_staleness=self.max_staleness,
            samples_waiting=self.samples_waiting,
            samples_per_step=max(per_step, 1.0),
            samples_per_rollout=max(per_rollout, 1e-3),
            rollouts_in_flight=in_flight,
            rollouts_running=min(held_run, in_flight),
            rollouts_queued=max(self.run_lag - held_run, 0),
            run_slots_max=slots_max,
            inference_share=inference_share,
            backend_utilisation=held_run / slots_max if slots_max else 0.0,
            step_time_s=max(step_time, 0.0),
            rollout_time_s=busy / run_done if run_done else 0.0,
            trainer_idle_s=period_s if self.samples_waiting == 0 and v else 0.0,
        )


def split(admit: int, live: list[WorkerReport]) -> dict[str, int]:
    """Each live RUN worker's RUN-started budget: its counter now plus its share of ``admit``
    new starts, shared in proportion to its free slots (largest remainders, ties by id)."""
    loads = {r.worker: r.stages["run"] for r in live if "run" in r.stages}
    room = {w: max(s.concurrency - s.in_flight, 0) for w, s in loads.items()}
    total = sum(room.values())
    grant = min(admit, total)
    shares = {w: grant * r // total if total else 0 for w, r in room.items()}
    left = grant - sum(shares.values())
    for w in sorted(room, key=lambda w: (-(grant * room[w] % total) if total else 0, w)):
        if left <= 0:
            break
        if shares[w] < room[w]:
            shares[w] += 1
            left -= 1
    return {w: s.started + shares[w] for w, s in loads.items()}


def to_capacity(
    decision: Decision,
    signals: Signals,
    live: list[WorkerReport],
    now: float,
    ttl_s: float,
    limited: bool = True,
) -> CapacityDecision:
    """The record of ``decision`` on the log: per-worker budgets and the signals it saw;
    ``limited`` False (admission off): no budgets, every RUN slot open."""
    numbers = {
        "trained_version": signals.trained_version,
        "samples_waiting": signals.samples_waiting,
        "samples_per_step": signals.samples_per_step,
        "samples_per_rollout": signals.samples_per_rollout,
        "rollouts_in_flight": signals.rollouts_in_flight,
        "rollouts_queued": signals.rollouts_queued,
        "run_slots_max": signals.run_slots_max,
        "backend_utilisation": signals.backend_utilisation,
        "step_time_s": signals.step_time_s,
        "rollout_time_s": signals.rollout_time_s,
    }
    return CapacityDecision(
        ts=now,
        ttl_s=ttl_s,
        run_slots=decision.run_slots,
        admit=decision.admit,
        limited=limited,
        per_worker=split(decision.admit, live) if limited else {},
        inference_share=decision.inference_share,
        reason=decision.reason[:200],
        signals={k: round(float(v), 6) for k, v in numbers.items()},
    )
