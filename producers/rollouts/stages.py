"""What travels between the rollout service's stages, and the pure rules the workers follow.

A job is a record on ``<ns>.rollout.jobs`` (key: the job id) and one stage message per planned
rollout on ``<ns>.rollout.tasks.init``. A worker of a stage takes a message, does the stage and
hands the rollout on with a message to the next stage's topic (key: the rollout id, so the
messages of one rollout stay in order on one partition)::

    rollout.jobs         JobRecord      submitted (the plan: tasks x samples) | cancelled
    rollout.tasks.init   StageMessage   plan, job spec (this task inline), attempt
    rollout.tasks.run    StageMessage   + the sandbox id and the rollout's endpoint
    rollout.tasks.eval   StageMessage   + the agent's outcome

Messages are JSON (``encode`` / ``decode``), self-contained (the job spec with only this
rollout's task, so a worker needs nothing else to do its stage) and bounded
(``MAX_MESSAGE_BYTES``, under the broker's default 1 MiB). The rollout token in a run / eval
message is scoped to that one rollout.

Handing a sandbox from one stage's worker to the next (``Claim``, ``judge``): a worker holds a
sandbox while it works in it; on hand-off it writes the claim as *released*, so the sandbox
is nobody's until the next stage's worker claims it. Whoever finds a sandbox held by a dead
worker (a redelivered message, or the periodic sweep) destroys it, finishes its rollout
``aborted`` and queues the next attempt (``retry``), so a killed worker loses no rollout and
leaks no sandbox. The rules are pure functions here; workers.py does the I/O.

Pure: no Kafka, no HTTP, no files.

Errors::

    ProducerError                  (rollstream.producers.errors)
    └── JobSpecError               a job that cannot be queued (ValueError); .field
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from rollstream.producers.errors import JobSpecError
from rollstream.producers.rollouts.jobs import (
    ROLLOUT_ID_PATTERN,
    JobSpec,
    RolloutPlan,
    TaskSource,
    expand,
    next_attempt,
)
from rollstream.producers.rollouts.tasks import Task

__all__ = [
    "MAX_MESSAGE_BYTES",
    "STAGES",
    "AgentSummary",
    "Claim",
    "Endpoint",
    "JobRecord",
    "OffsetBook",
    "StageMessage",
    "StageName",
    "Verdict",
    "first_messages",
    "job_record",
    "judge",
    "next_stage",
    "retry",
]

MAX_MESSAGE_BYTES: Final = 900_000  # a stage message (the broker's default max is 1 MiB)
MAX_REASON: Final = 2_000

StageName = Literal["init", "run", "eval"]
STAGES: Final[tuple[StageName, ...]] = ("init", "run", "eval")

RolloutId = Annotated[str, StringConstraints(pattern=ROLLOUT_ID_PATTERN)]
SandboxId = Annotated[str, StringConstraints(pattern=r"^sbx-[0-9a-f]{8,64}$")]


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Endpoint(_Msg):
    """The rollout's place at the proxy (runner.RolloutEndpoint, as the proxy opened it)."""

    base_url: Annotated[str, StringConstraints(min_length=1, max_length=2048)]
    token: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    api_url: Annotated[str, StringConstraints(min_length=1, max_length=2048)]
    policy_version: Annotated[int, Field(ge=0)] = 0


class AgentSummary(_Msg):
    """How RUN went (agents.AgentOutcome, without its transcript)."""

    status: Literal["ok", "failed", "timeout"]
    stop: Annotated[str, StringConstraints(max_length=200)] = ""
    reason: Annotated[str, StringConstraints(max_length=MAX_REASON)] = ""
    turns: Annotated[int, Field(ge=0)] = 0


class StageMessage(_Msg):
    """One rollout, queued for one stage. ``job`` is the job's spec with ``tasks`` replaced by
    this rollout's task inline (``job.job_id`` is the job's id, kept)."""

    v: Literal[1] = 1
    stage: StageName
    job: JobSpec
    task_id: str
    sample_index: Annotated[int, Field(ge=0)]
    attempt: Annotated[int, Field(ge=0)]
    group_size: Annotated[int, Field(ge=1)]
    rollout_id: RolloutId
    sandbox_id: SandboxId | None = None  # run, eval: the sandbox INIT made
    endpoint: Endpoint | None = None  # run, eval: where the agent calls
    agent: AgentSummary | None = None  # eval: how RUN went
    durations: Annotated[dict[StageName, float], Field(max_length=3)] = Field(default_factory=dict)
    enqueued_at: float = 0.0  # unix seconds, when this message was queued

    @property
    def plan(self) -> RolloutPlan:
        plan = RolloutPlan.of(
            self.job.id, self.task_id, self.sample_index, self.attempt, self.group_size
        )
        if plan.rollout_id != self.rollout_id:  # checked in decode; a constructed one too
            raise ValueError(f"rollout_id {self.rollout_id!r} is not the plan's")
        return plan

    @property
    def task(self) -> Task:
        inline = self.job.tasks.inline
        assert inline is not None and len(inline) == 1  # as first_messages builds it
        return inline[0]

    def encode(self) -> bytes:
        return self.model_dump_json(exclude_defaults=False).encode()

    @classmethod
    def decode(cls, raw: bytes) -> StageMessage:
        """A message from the topic; anything else raises ValueError with the reason (the
        worker dead-letters it)."""
        if len(raw) > MAX_MESSAGE_BYTES:
            raise ValueError(f"message of {len(raw)} bytes (max {MAX_MESSAGE_BYTES})")
        try:
            msg = cls.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise ValueError(f"{where}: {first.get('msg')}"[:500]) from exc
        inline = msg.job.tasks.inline
        if inline is None or len(inline) != 1 or inline[0].task_id != msg.task_id:
            raise ValueError("job.tasks: a stage message carries exactly its own task inline")
        _ = msg.plan  # ValueError when its rollout id is not the plan's
        if msg.stage != "init" and (msg.sandbox_id is None or msg.endpoint is None):
            raise ValueError(f"a {msg.stage} message names its sandbox and endpoint")
        if msg.stage == "eval" and msg.agent is None:
            raise ValueError("an eval message carries the agent's outcome")
        return msg


def _for_task(job: JobSpec, task: Task) -> JobSpec:
    return job.model_copy(update={"tasks": TaskSource(inline=[task])})


def first_messages(job: JobSpec, tasks: Iterable[Task], *, now: float) -> list[StageMessage]:
    """The INIT messages of a job: one per task x sample, attempt 0 (task-major). A task too
    large for one message is a JobSpecError naming it."""
    tasks = list(tasks)
    by_id = {t.task_id: t for t in tasks}
    out = []
    for plan in expand(job, tasks):
        msg = StageMessage(
            stage="init",
            job=_for_task(job, by_id[plan.task_id]),
            task_id=plan.task_id,
            sample_index=plan.sample_index,
            attempt=plan.attempt,
            group_size=plan.group_size,
            rollout_id=plan.rollout_id,
            enqueued_at=now,
        )
        if plan.sample_index == 0 and len(msg.encode()) > MAX_MESSAGE_BYTES:
            i = tasks.index(by_id[plan.task_id])
            raise JobSpecError(
                f"task {plan.task_id!r} makes a message over {MAX_MESSAGE_BYTES} bytes",
                field=f"tasks[{i}]",
            )
        out.append(msg)
    return out


def next_stage(msg: StageMessage, *, now: float, **changes: Any) -> StageMessage:
    """The message that hands ``msg``'s rollout to the stage after it, with ``changes``
    (sandbox_id and endpoint after INIT, agent after RUN)."""
    following: dict[str, StageName] = {"init": "run", "run": "eval"}
    if msg.stage not in following:
        raise ValueError("eval is the last stage")
    data = {**msg.model_dump(), **changes, "stage": following[msg.stage], "enqueued_at": now}
    return StageMessage.model_validate(data)


def retry(msg: StageMessage, *, now: float) -> StageMessage | None:
    """The INIT message of the rollout's next attempt (a new rollout id, the same group), or
    None when the job's attempts are used up."""
    following = next_attempt(msg.plan, msg.job)
    if following is None:
        return None
    return StageMessage(
        stage="init",
        job=msg.job,
        task_id=msg.task_id,
        sample_index=msg.sample_index,
        attempt=following.attempt,
        group_size=msg.group_size,
        rollout_id=following.rollout_id,
        enqueued_at=now,
    )


# --------------------------------------------------------------------------- job records


class JobRecord(_Msg):
    """A job's own facts on ``rollout.jobs``: submitted (what it plans) or cancelled. What
    happened to its rollouts is on ``rollout.events``; status folds the two (jobstatus.py)."""

    v: Literal[1] = 1
    type: Literal["submitted", "cancelled"]
    job_id: str
    at: float  # unix seconds
    task_ids: Annotated[list[str], Field(max_length=100_000)] = Field(default_factory=list)
    samples_per_task: Annotated[int, Field(ge=0)] = 0
    attempts: Annotated[int, Field(ge=0)] = 0
    rollouts: Annotated[int, Field(ge=0)] = 0  # planned (attempt 0)
    run_id: str = ""
    agent: str = ""  # kinds, for listings
    sandbox: str = ""
    evaluator: str = ""
    reason: Annotated[str, StringConstraints(max_length=MAX_REASON)] = ""  # cancelled: why

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, raw: bytes) -> JobRecord:
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise ValueError(str(exc.errors(include_url=False)[0].get("msg"))) from exc


def job_record(job: JobSpec, tasks: Iterable[Task], *, now: float) -> JobRecord:
    ids = [t.task_id for t in tasks]
    return JobRecord(
        type="submitted",
        job_id=job.id,
        at=now,
        task_ids=ids,
        samples_per_task=job.samples_per_task,
        attempts=job.attempts,
        rollouts=len(ids) * job.samples_per_task,
        run_id=job.run_id,
        agent=job.agent.kind,
        sandbox=job.sandbox.kind,
        evaluator=job.evaluator.kind,
    )


# --------------------------------------------------------------------------- claims


@dataclass(frozen=True, slots=True)
class Claim:
    """Who holds a sandbox now. ``stage``: the stage it is in (or was handed on from, when
    ``released``); ``holder``: the worker process (host, pid, start) holding it, empty when
    released; ``alive``: whether that holder still runs (as this host can tell)."""

    stage: StageName
    holder: str
    released: bool
    alive: bool


Verdict = Literal["take", "busy", "dead", "gone", "resend", "skip"]


def judge(claim: Claim | None, stage: StageName, *, me: str) -> Verdict:
    """What a worker of ``stage`` (this process: ``me``) does with a message whose rollout's
    sandbox has ``claim`` (None: no claim here). The caller first checks that this process is
    not running the rollout already.

    - ``take``: claim it and do the stage (the stage before released it);
    - ``busy``: a live worker holds it (a redelivery after a rebalance): skip, it is handled;
    - ``dead``: the worker holding it died: destroy the sandbox, abort the rollout, retry;
    - ``gone``: no sandbox: abort the rollout (a no-op when it has finished), retry;
    - ``resend``: this stage is done and handed on already (the worker stopped before its
      offset was committed): send the claim's next-stage message again, harmlessly;
    - ``skip``: a later stage has it (a stale redelivery).
    """
    if claim is None:
        return "gone"
    at, want = STAGES.index(claim.stage), STAGES.index(stage)
    if at > want:
        return "skip"
    if at == want and claim.released:
        return "resend"
    if at == want - 1 and claim.released:
        return "take"
    if at < want - 1:
        return "gone"  # released two stages back: a message was lost; start over
    if claim.holder == me:
        return "take"  # this process's own leftover (the caller knows it is not running)
    return "busy" if claim.alive else "dead"


# --------------------------------------------------------------------------- offsets


@dataclass
class OffsetBook:
    """Which offsets of each partition a worker may commit while it works on several messages
    at once: the lowest offset still in flight, or one past the highest taken when none is.
    ``revoke`` forgets partitions another worker now owns (their work finishes uncommitted)."""

    inflight: dict[int, set[int]] = field(default_factory=dict)
    high: dict[int, int] = field(default_factory=dict)

    def take(self, partition: int, offset: int) -> None:
        self.inflight.setdefault(partition, set()).add(offset)
        self.high[partition] = max(self.high.get(partition, -1), offset)

    def done(self, partition: int, offset: int) -> int | None:
        """Mark ``offset`` finished; the offset to commit for ``partition`` now (the next one
        to read), or None when the partition was revoked meanwhile."""
        pending = self.inflight.get(partition)
        if pending is None:
            return None
        pending.discard(offset)
        return min(pending) if pending else self.high[partition] + 1

    def revoke(self, partitions: Iterable[int]) -> None:
        for p in partitions:
            self.inflight.pop(p, None)
            self.high.pop(p, None)

    def count(self) -> int:
        return sum(len(v) for v in self.inflight.values())
