"""Where a job stands: its records on ``rollout.jobs`` and its rollouts' events on
``rollout.events``, folded into a ``JobStatus``. Pure: no Kafka, no HTTP (jobqueue.py reads the
topics and calls this).

The fold is a reducer: ``state = apply(state, item)`` for every ``JobRecord`` and ``Event``, in
any order and any number of times, then ``view(state)``. Only facts are kept (which stage of a
rollout started, finished and how, how it ended, its final reward), each keyed so that a
duplicate is a no-op and a late arrival lands where it belongs: the same items shuffled or
duplicated give the same status. Events are deduplicated by ``(rollout_id, seq)``; of two facts
of one kind, the higher ``seq`` wins.

Which rollouts are the job's: those whose RolloutStarted has ``metadata["job_id"]`` the job's
id, or with a StageEvent whose ``job_id`` is, or whose id is one the job's plan makes
(``<job_id>-`` and 20 hex digits, jobs.rollout_id). A rollout is placed (task, sample, attempt)
once its RolloutStarted is folded; until then its facts wait.

Per rollout (one attempt of one plan), stage by stage::

    no RolloutStarted yet                     queued at init
    RolloutStarted, no stage event            queued at init
    StageEvent(S, started), not finished      running in S
    StageEvent(S, finished, ok)               done in S; queued at the next stage until it starts
    StageEvent(S, finished, failed|timeout)   failed | timeout in S
    RolloutFinished                           its status decides the end: completed | failed |
                                              timeout | aborted (truncated counts as completed);
                                              a stage left open is failed (timeout) in it

A plan (task, sample) shows its latest attempt. An aborted attempt with attempts left in the job
is retried (stages.py: whoever aborts a rollout queues its next attempt), so the plan shows
that next attempt queued at init until it starts. Once a job is cancelled, its unfinished plans
show ``cancelled`` and nothing counts as queued; what still runs is counted running until it
ends.

Job state: ``cancelled`` after a cancelled record; ``done`` when every planned rollout has
finished; ``running`` once any rollout of it started; ``queued`` before.

Training (``JobTraining``), from the trainer's ledger on ``trainer.steps`` (``TrainStep``
items, schemas/steps.py), joined by rollout id: the job's sample records trained and dropped
(stale, duplicate, skipped), their tokens, the rollouts with a sample trained, and the rollouts
*wasted*: finished, none of their samples trained, at least one dropped stale (generated for
nothing). The ledger is folded by ``steps.Verdicts``: one fact per sample record, keyed by its
coordinates, so a ledger record folded twice changes nothing. Dead letters carry no ids and
count for no job.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, TypeAlias

from rollstream.producers.rollouts.jobs import rollout_id
from rollstream.producers.rollouts.stages import STAGES, JobRecord
from rollstream.schemas import (
    Event,
    Reward,
    RewardKind,
    RolloutFinished,
    RolloutStarted,
    RolloutStatus,
    StageEvent,
    StagePhase,
    TrainStep,
    Verdicts,
)

__all__ = [
    "DROP_VERDICTS",
    "FINISHED_STATES",
    "MAX_WASTED_LISTED",
    "JobFold",
    "JobState",
    "JobStatus",
    "JobTotals",
    "JobTraining",
    "PlanState",
    "PlanStatus",
    "StageCounts",
    "apply",
    "fold",
    "job_rows",
    "rollout_pattern",
    "view",
]

PlanState = Literal[
    "queued", "init", "run", "eval", "completed", "failed", "timeout", "aborted", "cancelled"
]
JobStateName = Literal["queued", "running", "done", "cancelled"]
FINISHED_STATES: Final[frozenset[str]] = frozenset({"completed", "failed", "timeout", "aborted"})
MAX_REASON: Final = 500  # characters of a reason shown per plan
MAX_WASTED_LISTED: Final = 100  # wasted rollout ids listed (all are counted)
DROP_VERDICTS: Final = ("stale", "duplicate", "skipped")  # a job's samples can be dropped so

_END: Final[dict[str, PlanState]] = {
    RolloutStatus.COMPLETED: "completed",
    RolloutStatus.TRUNCATED: "completed",
    RolloutStatus.FAILED: "failed",
    RolloutStatus.TIMEOUT: "timeout",
    RolloutStatus.ABORTED: "aborted",
}


def rollout_pattern(job_id: str) -> re.Pattern[str]:
    """The ids jobs.rollout_id gives the rollouts of ``job_id`` (every task, sample, attempt)."""
    return re.compile(rf"{re.escape(job_id)}-[0-9a-f]{{20}}")


# --------------------------------------------------------------------------- facts (the state)


@dataclass(slots=True)
class _Rollout:
    """What is known of one rollout; every field keyed by seq, so folding is order-free."""

    seen: set[int] = field(default_factory=set)
    started: tuple[int, str, int, int | None, str] | None = None  # seq, task, attempt, sample, job
    stage_started: dict[str, int] = field(default_factory=dict)  # stage -> lowest seq
    stage_finished: dict[str, tuple[int, str, str]] = field(default_factory=dict)  # seq, st, why
    stage_jobs: set[str] = field(default_factory=set)  # job ids named by its StageEvents
    finished: tuple[int, str, str] | None = None  # seq, status, error
    final: tuple[int, float] | None = None  # seq, value of the latest final reward


@dataclass(slots=True)
class JobState:
    """The accumulator of one job's fold. ``apply`` updates it in place and returns it."""

    job_id: str
    submitted: JobRecord | None = None
    cancelled: JobRecord | None = None
    rollouts: dict[str, _Rollout] = field(default_factory=dict)
    events: int = 0  # distinct events folded (of the kinds the status reads)
    ledger: Verdicts = field(default_factory=Verdicts)  # trainer.steps, by rollout id


def _earliest(current: JobRecord | None, record: JobRecord) -> JobRecord:
    if current is None:
        return record
    return min(current, record, key=lambda r: (r.at, r.encode()))  # a total order: order-free


def _sample_of(metadata: Mapping[str, str]) -> int | None:
    raw = metadata.get("sample", "")
    return int(raw) if raw.isdigit() and len(raw) <= 6 else None


Item: TypeAlias = JobRecord | Event | TrainStep


def apply(state: JobState, item: Item) -> JobState:
    """Fold one record of ``rollout.jobs``, one event of ``rollout.events`` or one ledger
    record of ``trainer.steps`` into ``state``. Records of other jobs and events that say
    nothing about a job's progress (model and tool calls, ...) change nothing; ledger entries
    are kept by rollout id until ``view`` knows which rollouts are the job's."""
    if isinstance(item, TrainStep):
        state.ledger.add(item)
        return state
    if isinstance(item, JobRecord):
        if item.job_id == state.job_id:
            if item.type == "submitted":
                state.submitted = _earliest(state.submitted, item)
            else:
                state.cancelled = _earliest(state.cancelled, item)
        return state
    body = item.body
    if not isinstance(body, RolloutStarted | StageEvent | RolloutFinished | Reward):
        return state
    if isinstance(body, Reward) and body.kind != RewardKind.FINAL:
        return state
    ro = state.rollouts.get(item.rollout_id)
    if ro is None:
        ro = state.rollouts[item.rollout_id] = _Rollout()
    if item.seq in ro.seen:
        return state
    ro.seen.add(item.seq)
    state.events += 1
    seq = item.seq
    if isinstance(body, RolloutStarted):
        if ro.started is None or seq < ro.started[0]:
            sample, job = _sample_of(body.metadata), body.metadata.get("job_id", "")
            ro.started = (seq, body.task_id, body.attempt, sample, job)
    elif isinstance(body, StageEvent):
        stage = str(body.stage)
        if body.job_id:
            ro.stage_jobs.add(body.job_id)
        if body.phase == StagePhase.STARTED:
            ro.stage_started[stage] = min(seq, ro.stage_started.get(stage, seq))
        else:
            old = ro.stage_finished.get(stage)
            if old is None or seq > old[0]:
                ro.stage_finished[stage] = (seq, body.status or "ok", body.reason)
    elif isinstance(body, RolloutFinished):
        if ro.finished is None or seq > ro.finished[0]:
            ro.finished = (seq, str(body.status), body.error or "")
    elif ro.final is None or seq > ro.final[0]:
        ro.final = (seq, float(body.value))
    return state


@dataclass(slots=True)
class JobFold:
    """The fold as an object: ``JobFold(job_id).feed(items).status()``."""

    state: JobState

    def __init__(self, job_id: str) -> None:
        self.state = JobState(job_id)

    def feed(self, items: Iterable[Item]) -> JobFold:
        for item in items:
            apply(self.state, item)
        return self

    def status(self) -> JobStatus:
        return view(self.state)


def fold(job_id: str, items: Iterable[Item]) -> JobStatus:
    """The status of ``job_id`` from its records, events and ledger records, in any order."""
    return JobFold(job_id).feed(items).status()


# --------------------------------------------------------------------------- the status


@dataclass(frozen=True, slots=True)
class StageCounts:
    """Rollouts (attempts) per state in one stage."""

    queued: int = 0
    running: int = 0
    done: int = 0
    failed: int = 0
    timeout: int = 0


@dataclass(frozen=True, slots=True)
class PlanStatus:
    """One planned rollout (task x sample) as its latest attempt stands. ``attempts``: the
    attempts started so far; ``stage``: the stage it is in or ended in ("" before INIT);
    ``reward``: the latest attempt's final reward, if any."""

    task_id: str
    sample: int
    rollout_id: str
    attempt: int
    attempts: int
    state: PlanState
    stage: str = ""
    reward: float | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class JobTotals:
    """``finished``: plans whose latest attempt ended (and is not being retried);
    ``mean_reward``: over the plans with a final reward (None: none has one)."""

    planned: int
    finished: int
    completed: int
    mean_reward: float | None


@dataclass(frozen=True, slots=True)
class JobTraining:
    """What the trainer did with the job's samples (sample records of the samples topic).
    ``samples_dropped`` by verdict; ``tokens_stale``: tokens of the stale ones;
    ``rollouts_wasted``: finished rollouts none of whose samples was trained and at least one
    dropped stale (``wasted``: the first ``MAX_WASTED_LISTED`` of their ids, sorted);
    ``first_step``/``last_step``: the steps that trained its samples (None: none did)."""

    samples_trained: int = 0
    samples_dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_VERDICTS, 0))
    tokens_trained: int = 0
    tokens_stale: int = 0
    rollouts_trained: int = 0
    rollouts_wasted: int = 0
    wasted: list[str] = field(default_factory=list)
    first_step: int | None = None
    last_step: int | None = None


def _training(state: JobState, rollouts: Iterable[tuple[str, _Rollout]]) -> JobTraining:
    dropped = dict.fromkeys(DROP_VERDICTS, 0)
    trained = tokens = stale_tokens = trained_rollouts = 0
    steps: list[int] = []
    wasted: list[str] = []
    for rid, ro in rollouts:
        facts = state.ledger.of(rid)
        verdicts = [f.verdict for f in facts]
        for step, verdict, _, n in facts:
            if verdict == "trained":
                trained, tokens = trained + 1, tokens + n
                steps.append(step)
            elif verdict in dropped:
                dropped[verdict] += 1
                stale_tokens += n if verdict == "stale" else 0
        if "trained" in verdicts:
            trained_rollouts += 1
        elif "stale" in verdicts and ro.finished is not None:
            wasted.append(rid)
    wasted.sort()
    return JobTraining(
        trained, dropped, tokens, stale_tokens, trained_rollouts, len(wasted),
        wasted[:MAX_WASTED_LISTED], min(steps, default=None), max(steps, default=None),
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class JobStatus:
    job_id: str
    state: JobStateName
    stages: dict[str, StageCounts]
    plans: list[PlanStatus]
    totals: JobTotals
    submitted: JobRecord | None = None
    cancelled: JobRecord | None = None
    events: int = 0
    training: JobTraining = field(default_factory=JobTraining)

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "state": self.state,
            "stages": {name: asdict(counts) for name, counts in self.stages.items()},
            "plans": [asdict(p) for p in self.plans],
            "totals": asdict(self.totals),
            "submitted": self.submitted.model_dump(mode="json") if self.submitted else None,
            "cancelled": self.cancelled.model_dump(mode="json") if self.cancelled else None,
            "events": self.events,
            "training": asdict(self.training),
        }


def _belongs(state: JobState, rid: str, ro: _Rollout, pattern: re.Pattern[str]) -> bool:
    if ro.started is not None and ro.started[4] == state.job_id:
        return True
    return state.job_id in ro.stage_jobs or pattern.fullmatch(rid) is not None


def _where(ro: _Rollout) -> tuple[str, str, str]:
    """(stage, phase, reason) of an unfinished attempt: phase is queued | running | failed |
    timeout; stage "" never happens (queued at init before any stage event)."""
    for stage in reversed(STAGES):
        done = ro.stage_finished.get(stage)
        if done is not None:
            _, status, reason = done
            if status != "ok":
                return stage, status if status == "timeout" else "failed", reason
            nxt = STAGES.index(stage) + 1
            return (STAGES[nxt], "queued", "") if nxt < len(STAGES) else (stage, "done", "")
        if stage in ro.stage_started:
            return stage, "running", ""
    return "init", "queued", ""


def _count(
    counts: dict[str, dict[str, int]], ro: _Rollout, *, cancelled: bool
) -> tuple[str, str, str]:
    """Add one attempt's stages to ``counts``; (stage, phase, reason) as ``_where``."""
    end = ro.finished[1] if ro.finished is not None else None
    for stage in STAGES:
        done = ro.stage_finished.get(stage)
        if done is not None:
            status = done[1]
            key = "done" if status == "ok" else "timeout" if status == "timeout" else "failed"
            counts[stage][key] += 1
        elif stage in ro.stage_started:
            if end is None:
                counts[stage]["running"] += 1
            else:  # ended while the stage was open (a dead worker: aborted)
                counts[stage]["timeout" if end == RolloutStatus.TIMEOUT else "failed"] += 1
    stage, phase, reason = _where(ro)
    if end is None and phase == "queued" and not cancelled:
        counts[stage]["queued"] += 1
    return stage, phase, reason


def _last_stage(ro: _Rollout) -> str:
    known = [s for s in STAGES if s in ro.stage_started or s in ro.stage_finished]
    return known[-1] if known else ""


def view(state: JobState) -> JobStatus:
    """The status the folded facts give (module docstring)."""
    job_id, sub = state.job_id, state.submitted
    cancelled = state.cancelled is not None
    pattern = rollout_pattern(job_id)
    attempts_allowed = sub.attempts if sub is not None else 1
    # the plans: planned ones first, in plan order; then any other the events name, sorted
    by_plan: dict[tuple[str, int], list[tuple[int, str, _Rollout]]] = {}
    if sub is not None:
        for task in sub.task_ids:
            for sample in range(sub.samples_per_task):
                by_plan[(task, sample)] = []
    others: dict[tuple[str, int], list[tuple[int, str, _Rollout]]] = {}
    members: list[tuple[str, _Rollout]] = []
    for rid, ro in state.rollouts.items():
        if ro.started is None or not _belongs(state, rid, ro, pattern):
            continue
        members.append((rid, ro))
        _, task, attempt, known, _ = ro.started
        sample = known if known is not None else _sample_from_id(job_id, task, attempt, rid, sub)
        into = by_plan if (task, sample) in by_plan else others
        into.setdefault((task, sample), []).append((attempt, rid, ro))
    by_plan.update(sorted(others.items()))

    counts: dict[str, dict[str, int]] = {s: dict.fromkeys(_COUNT_KEYS, 0) for s in STAGES}
    plans: list[PlanStatus] = []
    for (task, sample), tries in by_plan.items():
        tries.sort(key=lambda t: (t[0], t[1]))
        where = ("init", "queued", "")
        for _, _, ro in tries:
            where = _count(counts, ro, cancelled=cancelled)
        if not tries:
            plans.append(_queued(job_id, task, sample, 0, 0, counts, state))
            continue
        attempt, rid, ro = tries[-1]
        if ro.finished is not None:
            end = _END.get(ro.finished[1], "failed")
            if end == "aborted" and attempt + 1 < attempts_allowed and not cancelled:
                plans.append(_queued(job_id, task, sample, attempt + 1, len(tries), counts, state))
                continue
            reason = ro.finished[2] or _failed_reason(ro)
            plans.append(
                PlanStatus(
                    task, sample, rid, attempt, len(tries), end, _last_stage(ro),
                    ro.final[1] if ro.final else None, reason[:MAX_REASON],
                )
            )  # fmt: skip
            continue
        stage, _, reason = where
        plan_state: PlanState = "cancelled" if cancelled else stage  # type: ignore[assignment]
        if cancelled:
            reason = state.cancelled.reason if state.cancelled else ""
        plans.append(
            PlanStatus(
                task, sample, rid, attempt, len(tries), plan_state, stage,
                ro.final[1] if ro.final else None, reason[:MAX_REASON],
            )
        )  # fmt: skip

    finished = [p for p in plans if p.state in FINISHED_STATES]
    rewards = [p.reward for p in plans if p.reward is not None and math.isfinite(p.reward)]
    planned = sub.rollouts if sub is not None else len(plans)
    totals = JobTotals(
        planned=planned,
        finished=len(finished),
        completed=sum(p.state == "completed" for p in plans),
        mean_reward=sum(rewards) / len(rewards) if rewards else None,
    )
    job_state: JobStateName
    if cancelled:
        job_state = "cancelled"
    elif planned > 0 and len(finished) >= planned and len(finished) == len(plans):
        job_state = "done"
    elif any(tries for tries in by_plan.values()):
        job_state = "running"
    else:
        job_state = "queued"
    return JobStatus(
        job_id=job_id,
        state=job_state,
        stages={s: StageCounts(**counts[s]) for s in STAGES},
        plans=plans,
        totals=totals,
        submitted=sub,
        cancelled=state.cancelled,
        events=state.events,
        training=_training(state, members),
    )


_COUNT_KEYS: Final = ("queued", "running", "done", "failed", "timeout")


def _queued(
    job_id: str,
    task: str,
    sample: int,
    attempt: int,
    tries: int,
    counts: dict[str, dict[str, int]],
    state: JobState,
) -> PlanStatus:
    """A plan whose next attempt has not started: queued at init (or cancelled)."""
    rid = rollout_id(job_id, task, sample, attempt)
    if state.cancelled is not None:
        reason = state.cancelled.reason[:MAX_REASON]
        return PlanStatus(task, sample, rid, attempt, tries, "cancelled", "", None, reason)
    counts["init"]["queued"] += 1
    return PlanStatus(task, sample, rid, attempt, tries, "queued", "")


def _failed_reason(ro: _Rollout) -> str:
    for stage in reversed(STAGES):
        done = ro.stage_finished.get(stage)
        if done is not None and done[1] != "ok":
            return done[2]
    return ""


def _sample_from_id(job_id: str, task: str, attempt: int, rid: str, sub: JobRecord | None) -> int:
    """The sample index a plan's rollout id encodes (RolloutStarted without a ``sample`` in its
    metadata); -1 when it is none of the job's."""
    for sample in range(sub.samples_per_task if sub is not None else 0):
        if rollout_id(job_id, task, sample, attempt) == rid:
            return sample
    return -1


# --------------------------------------------------------------------------- job listings


def job_rows(records: Sequence[JobRecord]) -> list[dict[str, Any]]:
    """One row per submitted job, in submit order: its plan and whether it was cancelled."""
    rows: dict[str, dict[str, Any]] = {}
    cancels: dict[str, JobRecord] = {}
    for rec in records:
        if rec.type == "submitted" and rec.job_id not in rows:
            rows[rec.job_id] = {
                "job_id": rec.job_id,
                "submitted_at": rec.at,
                "tasks": len(rec.task_ids),
                "samples_per_task": rec.samples_per_task,
                "rollouts": rec.rollouts,
                "attempts": rec.attempts,
                "agent": rec.agent,
                "sandbox": rec.sandbox,
                "evaluator": rec.evaluator,
                "run_id": rec.run_id,
                "cancelled": False,
                "reason": "",
            }
        elif rec.type == "cancelled" and rec.job_id not in cancels:
            cancels[rec.job_id] = rec
    for job_id, rec in cancels.items():
        if job_id in rows:
            rows[job_id].update(cancelled=True, reason=rec.reason)
    return list(rows.values())
