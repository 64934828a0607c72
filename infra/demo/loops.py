"""The demo's two ways of feeding the rollout service.

- ``rounds``: one job per round (a group per task); the next round is submitted when this one's
  rollouts finished, and in ``demo_sync`` mode only once the proxy serves the policy trained on
  them (strictly on-policy: every sample trained at staleness 0 when the trainer's batch is one
  round). Ends when the newest policy has rollouts of its own, or once ``solved_rounds`` rounds
  in a row scored the top reward on every rollout (``round_solved``: every group without
  spread, so the DAPO filter drops them all and no step is left to train).
- ``stream``: jobs of one group each are submitted continuously so the RUN stage always has
  work queued (``demo_workers`` rollouts plus a group); the trainer and the rollouts overlap freely,
  bounded by the trainer's staleness filter, and by the controller's admission when it runs.
  Ends when the proxy serves policy ``demo_steps``.

Both record when the proxy first served each policy version (``VersionClock``), so a benchmark
compares the time to train the same number of samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from rollstream.infra.demo.agent import AgentResult, DemoTask
from rollstream.infra.demo.service import EventReader, ResultFold, demo_job, wait_round
from rollstream.producers.rollouts.jobs import JobSpec

__all__ = [
    "Feed",
    "VersionClock",
    "job_maker",
    "latest_version",
    "measured_version",
    "round_has_spread",
    "round_solved",
    "rounds",
    "stream",
]


def latest_version(results: list[AgentResult]) -> int:
    return max((max(r.policy_versions) for r in results if r.policy_versions), default=0)


def measured_version(results: list[AgentResult]) -> int:
    """The newest policy some rollout ran under from its first call: the demo runs until the last
    trained policy has rollouts of its own (a rollout that merely saw a reload mid-way counts
    under the version it started with, as in `rewards_by_version`)."""
    return max(
        (min(r.policy_versions) for r in results if r.policy_versions and r.error is None),
        default=0,
    )


TOP_REWARD = 1.0  # the demo's final reward is a share of digits: 1.0 is every answer all digits


def round_solved(results: Sequence[AgentResult], expected: int) -> bool:
    """Every one of the round's ``expected`` rollouts finished, without error, at the top
    reward: its groups have no spread left to learn from."""
    return (
        expected > 0
        and len(results) >= expected
        and all(r.error is None and r.final >= TOP_REWARD - 1e-9 for r in results)
    )


def round_has_spread(results: Sequence[AgentResult]) -> bool:
    """Some group of the round has rollouts with different final rewards: the processors make
    samples of it even with the DAPO filter on (a group without spread is dropped), so the
    trainer gets something to train."""
    finals: dict[str, set[float]] = {}
    for r in results:
        if r.error is None:
            finals.setdefault(r.group_id, set()).add(r.final)
    return any(len(values) > 1 for values in finals.values())


@dataclass
class VersionClock:
    """When the proxy first served each policy version (seconds since ``t0``)."""

    admin: httpx.Client
    t0: float
    seen: dict[int, float] = field(default_factory=dict)
    _next_poll: float = 0.0

    def served(self) -> int:
        return max(self.seen, default=0)

    def poll(self, every_s: float = 0.25) -> int:
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + every_s
            resp = self.admin.get("/v1/admin/status")
            resp.raise_for_status()
            version = int(resp.json().get("policy_version", 0))
            self.seen.setdefault(version, round(now - self.t0, 2))
        return self.served()

    def wait_for(self, version: int, deadline: float, check: Callable[[], Any]) -> None:
        while self.served() < version and time.monotonic() < deadline:
            check()
            self.poll(0.2)
            time.sleep(0.05)


@dataclass
class Feed:
    """What both loops need: the job template, the reader of the events and the deadline."""

    reader: EventReader
    fold: ResultFold
    clock: VersionClock
    prefix: str
    tasks: Sequence[DemoTask]
    make_job: Callable[[int], JobSpec]  # round number -> that round's job
    submit: Callable[[JobSpec], Any]
    steps: int
    deadline: float
    check: Callable[[], Any]
    progress: Callable[[list[AgentResult], int], None]  # (results, rounds submitted)
    solved: bool = False  # set by ``rounds`` when it ended on ``solved_rounds``


def rounds(
    feed: Feed,
    per_round: int,
    sync: bool,
    stop_at_trained: bool = False,
    solved_rounds: int = 0,
    drop_zero_variance: bool = True,
) -> list[AgentResult]:
    """``stop_at_trained``: end as soon as the proxy serves policy ``steps`` (its own rollouts
    are not run). ``solved_rounds`` (0: never): end after that many solved rounds in a row
    (``round_solved``). ``drop_zero_variance``: the processors drop groups without spread, so
    in ``sync`` mode a round without any (``round_has_spread``) waits for no policy."""
    results: list[AgentResult] = []
    round_no = streak = 0
    while (
        time.monotonic() < feed.deadline
        and measured_version(results) < feed.steps
        and not (stop_at_trained and feed.clock.poll(0) >= feed.steps)
        and not (solved_rounds and streak >= solved_rounds)
    ):
        feed.check()
        job = feed.make_job(round_no)
        feed.submit(job)
        # a rollout not finished by then is counted failed; the demo overruns
        # demo_max_minutes by 30 s at most
        limits = job.timeouts
        round_end = min(
            time.monotonic() + limits.init + limits.run + limits.eval + 30.0, feed.deadline + 30.0
        )
        round_results = wait_round(
            feed.reader, feed.fold, f"{job.id}-", per_round, round_end, feed.check
        )
        results.extend(round_results)
        solved = round_solved(round_results, per_round)
        streak = streak + 1 if solved else 0
        round_no += 1
        feed.clock.poll(0)
        trainable = round_has_spread(round_results) if drop_zero_variance else bool(round_results)
        if sync and trainable and latest_version(results) < feed.steps:
            # strictly alternating: wait for the policy these rollouts will train (a round the
            # trainer gets nothing from would wait for a policy that never comes)
            feed.clock.wait_for(latest_version(round_results) + 1, feed.deadline, feed.check)
        feed.progress(results, round_no)
    feed.solved = bool(solved_rounds) and streak >= solved_rounds
    return results


def stream(feed: Feed, group_size: int, workers: int) -> list[AgentResult]:
    """Keep ``workers + group_size`` rollouts submitted and unfinished until the proxy serves
    version ``steps``, one group (job) at a time, so a group's rollouts run together and its
    samples come out soon; the results are the finished rollouts (those still running at the
    end are not counted). ``feed.make_job`` makes job k of one task."""
    submitted = job_no = 0
    shown = 0.0
    while time.monotonic() < feed.deadline and feed.clock.poll() < feed.steps:
        feed.check()
        finished = len(feed.fold.finished(feed.prefix))
        if submitted - finished < workers + group_size:
            feed.submit(feed.make_job(job_no))
            submitted += group_size
            job_no += 1
        feed.fold.feed(feed.reader.poll(0.25))
        if time.monotonic() - shown > 1.0:
            shown = time.monotonic()
            feed.progress(_finished(feed), job_no)
    return _finished(feed)


def _finished(feed: Feed) -> list[AgentResult]:
    return [feed.fold.result(rid) for rid in sorted(feed.fold.finished(feed.prefix))]


def job_maker(
    prefix: str,
    tasks: Sequence[DemoTask],
    *,
    group_size: int,
    turns: int,
    max_tokens: int,
    run_id: str,
    env: dict[str, float],
    one_task: bool = False,
) -> Callable[[int], JobSpec]:
    """Job k: every task (a round), or with ``one_task`` task k mod n alone (one group)."""

    def make(round_no: int) -> JobSpec:
        return demo_job(
            prefix,
            round_no,
            [tasks[round_no % len(tasks)]] if one_task else tasks,
            group_size=group_size,
            turns=turns,
            max_tokens=max_tokens,
            run_id=run_id,
            env=env,
        )

    return make
