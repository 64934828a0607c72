"""A job's status from its records and its rollouts' events (jobstatus.py, pure): per stage
counts, per plan the latest attempt, totals and the job's state; retries after an abort; a
cancelled job; which rollouts are the job's; and the same status from the same items shuffled
and duplicated."""

from __future__ import annotations

import random
from typing import Any

import pytest

from rollstream.producers.rollouts.jobs import JobSpec, parse_job, resolve_tasks, rollout_id
from rollstream.producers.rollouts.jobstatus import (
    JobFold,
    JobStatus,
    StageCounts,
    apply,
    fold,
    job_rows,
    rollout_pattern,
)
from rollstream.producers.rollouts.stages import JobRecord, job_record
from rollstream.schemas import (
    Event,
    Reward,
    RewardKind,
    RolloutFinished,
    RolloutStarted,
    RolloutStatus,
    StageEvent,
    StageName,
    StagePhase,
    ToolCall,
)

T0 = 1_800_000_000.0


def make_job(**changes: Any) -> JobSpec:
    spec = {
        "job_id": "status-job",
        "tasks": {"suite": "pycoding", "ids": ["balanced-brackets", "caesar-shift"]},
        "samples_per_task": 2,
        "agent": {"kind": "tool"},
        "attempts": 2,
        **changes,
    }
    return parse_job(spec)


JOB = make_job()
TASKS = resolve_tasks(JOB)
SUBMITTED = job_record(JOB, TASKS, now=T0)
A, B = "balanced-brackets", "caesar-shift"


class Log:
    """The events of rollouts, each rollout's seq counted from 0 as the proxy does."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.seqs: dict[str, int] = {}

    def add(self, rid: str, body: Any) -> None:
        seq = self.seqs.get(rid, 0)
        self.seqs[rid] = seq + 1
        self.events.append(Event(f"{rid}:{seq}", rid, seq, int(T0 * 1e6) + seq, body))

    def start(
        self, task: str, sample: int, attempt: int = 0, *, job: str = "status-job", rid: str = ""
    ) -> str:
        rid = rid or rollout_id(job, task, sample, attempt)
        meta = {"job_id": job, "sample": str(sample), "attempt": str(attempt)}
        self.add(rid, RolloutStarted(task, f"g-{task}", attempt=attempt, metadata=meta))
        return rid

    def stage(
        self, rid: str, stage: str, status: str | None = None, *, job: str = "status-job"
    ) -> None:
        """Started, and finished with ``status`` when one is given."""
        name = StageName(stage)
        self.add(rid, StageEvent(stage=name, phase=StagePhase.STARTED, job_id=job))
        if status is not None:
            reason = "" if status == "ok" else f"{stage} went {status}"
            body = StageEvent(
                stage=name, phase=StagePhase.FINISHED, status=status, duration_ms=5.0,
                job_id=job, reason=reason,
            )  # fmt: skip
            self.add(rid, body)

    def finish(self, rid: str, status: str, error: str | None = None) -> None:
        self.add(rid, RolloutFinished(RolloutStatus(status), error))

    def reward(self, rid: str, value: float, kind: RewardKind = RewardKind.FINAL) -> None:
        self.add(rid, Reward(value, kind))


def running_log() -> Log:
    """A0 completed (reward 1), A1 running in RUN, B0 aborted then attempt 1 done with INIT
    (queued at RUN), B1 not started; plus another job's rollout and a tool call."""
    log = Log()
    a0 = log.start(A, 0)
    log.stage(a0, "init", "ok")
    log.stage(a0, "run", "ok")
    log.add(a0, ToolCall("t1", "bash"))
    log.stage(a0, "eval", "ok")
    log.reward(a0, 0.5, RewardKind.MILESTONE)
    log.reward(a0, 1.0)
    log.finish(a0, "completed")
    a1 = log.start(A, 1)
    log.stage(a1, "init", "ok")
    log.stage(a1, "run")
    b0 = log.start(B, 0)
    log.stage(b0, "init", "ok")
    log.stage(b0, "run")
    log.finish(b0, "aborted", "the worker died")
    b0_retry = log.start(B, 0, attempt=1)
    log.stage(b0_retry, "init", "ok")
    other = log.start(A, 0, job="another-job")
    log.stage(other, "init", "ok", job="another-job")
    log.finish(other, "completed")
    return log


def by_plan(status: JobStatus) -> dict[tuple[str, int], Any]:
    return {(p.task_id, p.sample): p for p in status.plans}


def test_a_running_job_per_stage_and_per_plan() -> None:
    status = fold("status-job", [SUBMITTED, *running_log().events])
    assert status.state == "running"
    assert status.stages == {
        "init": StageCounts(queued=1, done=4),  # B1 waits; A0, A1, B0, B0's retry did INIT
        "run": StageCounts(queued=1, running=1, done=1, failed=1),  # retry / A1 / A0 / B0
        "eval": StageCounts(done=1),
    }
    plans = by_plan(status)
    assert list(plans) == [(A, 0), (A, 1), (B, 0), (B, 1)]  # the plan's order
    a0, a1, b0, b1 = plans.values()
    assert (a0.state, a0.stage, a0.reward, a0.attempt, a0.attempts) == (
        "completed", "eval", 1.0, 0, 1,
    )  # fmt: skip
    assert (a1.state, a1.reward) == ("run", None)
    assert (b0.state, b0.attempt, b0.attempts) == ("run", 1, 2)  # the retry, queued at RUN
    assert b0.rollout_id == rollout_id("status-job", B, 0, 1)
    assert (b1.state, b1.attempts) == ("queued", 0)
    assert b1.rollout_id == rollout_id("status-job", B, 1, 0)
    assert (status.totals.planned, status.totals.finished, status.totals.completed) == (4, 1, 1)
    assert status.totals.mean_reward == 1.0
    assert status.submitted == SUBMITTED and status.cancelled is None


@pytest.mark.parametrize("seed", range(8))
def test_shuffled_and_duplicated_items_give_the_same_status(seed: int) -> None:
    items: list[JobRecord | Event] = [SUBMITTED, *running_log().events]
    expected = fold("status-job", items).to_json()
    rng = random.Random(seed)
    noisy = items + rng.sample(items, len(items) // 2) + [SUBMITTED]
    rng.shuffle(noisy)
    assert fold("status-job", noisy).to_json() == expected
    assert fold("status-job", noisy).events == fold("status-job", items).events


def test_an_event_seen_twice_counts_once() -> None:
    state = JobFold("status-job").state
    log = Log()
    rid = log.start(A, 0)
    log.reward(rid, 0.25)
    for event in log.events * 3:
        state = apply(state, event)
    assert state.events == 2


def test_a_job_before_any_rollout_is_queued_and_unknown_events_change_nothing() -> None:
    status = fold("status-job", [SUBMITTED])
    assert status.state == "queued"
    assert status.stages["init"] == StageCounts(queued=4)
    assert {p.state for p in status.plans} == {"queued"}
    assert status.totals.mean_reward is None
    log = Log()
    other = log.start(A, 0, job="another-job")
    log.finish(other, "completed")
    with_other = fold("status-job", [SUBMITTED, *log.events]).to_json()
    assert {**with_other, "events": 0} == status.to_json()  # folded, and then left out


def test_a_finished_job_is_done_with_its_mean_reward() -> None:
    log = Log()
    for i, (task, sample) in enumerate([(A, 0), (A, 1), (B, 0), (B, 1)]):
        rid = log.start(task, sample)
        for stage in ("init", "run", "eval"):
            log.stage(rid, stage, "ok")
        if i < 3:
            log.reward(rid, [1.0, 0.0, 0.5][i])
            log.finish(rid, "completed")
        else:  # the evaluator timed out: no reward; the rollout ends as a timeout
            log.finish(rid, "timeout", "eval: past 120 s")
    status = fold("status-job", [SUBMITTED, *log.events])
    assert status.state == "done"
    assert (status.totals.finished, status.totals.completed) == (4, 3)
    assert status.totals.mean_reward == pytest.approx(0.5)
    assert by_plan(status)[(B, 1)].state == "timeout"
    assert by_plan(status)[(B, 1)].reason == "eval: past 120 s"
    assert status.stages["eval"] == StageCounts(done=4)


def test_a_failed_stage_then_the_rollout_finished_failed() -> None:
    log = Log()
    rid = log.start(A, 0)
    log.stage(rid, "init", "failed")
    status = fold("status-job", [SUBMITTED, *log.events])
    plan = by_plan(status)[(A, 0)]
    assert (plan.state, plan.stage, plan.reason) == ("init", "init", "init went failed")
    assert status.stages["init"].failed == 1
    log.finish(rid, "failed")
    plan = by_plan(fold("status-job", [SUBMITTED, *log.events]))[(A, 0)]
    assert (plan.state, plan.stage, plan.reason) == ("failed", "init", "init went failed")


def test_an_open_stage_of_an_ended_rollout_is_not_running() -> None:
    log = Log()
    rid = log.start(A, 0)
    log.stage(rid, "init", "ok")
    log.stage(rid, "run")
    log.finish(rid, "timeout", "idle")
    status = fold("status-job", [SUBMITTED, *log.events])
    assert status.stages["run"] == StageCounts(timeout=1)
    assert by_plan(status)[(A, 0)].state == "timeout"


def test_an_abort_is_retried_while_attempts_last() -> None:
    log = Log()
    rid = log.start(A, 0)
    log.finish(rid, "aborted", "sandbox gone")
    plan = by_plan(fold("status-job", [SUBMITTED, *log.events]))[(A, 0)]
    assert (plan.state, plan.attempt, plan.attempts) == ("queued", 1, 1)
    retry = log.start(A, 0, attempt=1)
    log.finish(retry, "aborted", "sandbox gone again")
    status = fold("status-job", [SUBMITTED, *log.events])
    plan = by_plan(status)[(A, 0)]  # attempts: 2, all used
    assert (plan.state, plan.attempt, plan.attempts, plan.reason) == (
        "aborted", 1, 2, "sandbox gone again",
    )  # fmt: skip
    assert status.totals.finished == 1


def test_a_cancelled_job() -> None:
    cancel = JobRecord(type="cancelled", job_id="status-job", at=T0 + 5, reason="enough")
    status = fold("status-job", [SUBMITTED, *running_log().events, cancel])
    assert status.state == "cancelled"
    assert status.cancelled == cancel
    plans = by_plan(status)
    assert plans[(A, 0)].state == "completed"  # ended before the cancel: stays so
    assert {plans[k].state for k in [(A, 1), (B, 0), (B, 1)]} == {"cancelled"}
    assert plans[(B, 1)].reason == "enough"
    assert all(counts.queued == 0 for counts in status.stages.values())
    assert status.stages["run"].running == 1  # still runs until a worker stops it


def test_rollouts_of_the_job_by_metadata_or_stage_event() -> None:
    log = Log()
    by_meta = log.start(A, 0, rid="harness-chosen-id")  # metadata job_id, sample 0
    log.stage(by_meta, "init", "ok")
    rid = "stage-only-id"
    log.add(rid, RolloutStarted(B, "g", attempt=0, metadata={}))  # no job in the metadata
    log.stage(rid, "init", "ok")  # its StageEvent names the job
    status = fold("status-job", [SUBMITTED, *log.events])
    plans = by_plan(status)
    assert plans[(A, 0)].rollout_id == "harness-chosen-id"
    assert plans[(A, 0)].state == "run"
    assert plans[(B, -1)].rollout_id == "stage-only-id"  # no sample known: a plan of its own
    assert len(status.plans) == 5


def test_the_sample_comes_from_the_rollout_id_when_the_metadata_lacks_it() -> None:
    log = Log()
    rid = rollout_id("status-job", B, 1, 0)
    log.add(rid, RolloutStarted(B, "g", attempt=0, metadata={"job_id": "status-job"}))
    plan = by_plan(fold("status-job", [SUBMITTED, *log.events]))[(B, 1)]
    assert (plan.rollout_id, plan.state) == (rid, "init")


def test_rollout_pattern_matches_the_jobs_ids_only() -> None:
    pattern = rollout_pattern("a")
    assert pattern.fullmatch(rollout_id("a", A, 0, 0))
    assert not pattern.fullmatch(rollout_id("a-b", A, 0, 0))
    assert not rollout_pattern("a-b").fullmatch(rollout_id("a", A, 0, 0))


def test_job_rows_one_per_job_with_its_cancel() -> None:
    other = job_record(make_job(job_id="other-job", samples_per_task=1), TASKS, now=T0 + 1)
    cancel = JobRecord(type="cancelled", job_id="status-job", at=T0 + 2, reason="why")
    rows = job_rows([SUBMITTED, other, cancel, SUBMITTED])
    assert [(r["job_id"], r["rollouts"], r["cancelled"], r["reason"]) for r in rows] == [
        ("status-job", 4, True, "why"),
        ("other-job", 2, False, ""),
    ]
