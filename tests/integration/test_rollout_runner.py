"""One rollout, INIT -> RUN -> EVAL, on real parts: the reference model server and the recording
proxy started through the CLI (`rollstream serve-model`, `rollstream proxy`) on the session's
Kafka broker, bubblewrap sandboxes, the tool agent and the suite evaluator. The tiny random model
solves nothing, so the first run asserts the mechanics on the log (RolloutStarted, its LlmCalls,
the evaluator's rewards, one RolloutFinished); a scripted agent that writes the reference
solution through the sandbox gets the final reward 1.0 on the log. A redelivered plan makes no
second rollout. Then the runner's stage outcomes (a sandbox that cannot start, a failing or
raising agent, an evaluation past its deadline) against a fake proxy at the HTTP edge: each
finishes its rollout with the stage and the reason, no reward, and leaves no sandbox."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _rollout_stack import events_of, fresh_settings, rollout_stack

from rollstream.infra.kafka import KafkaBroker
from rollstream.producers.rollouts.agents import (
    AgentContext,
    AgentOutcome,
    RolloutClient,
    build_agent,
)
from rollstream.producers.rollouts.bwrap import BwrapProvider
from rollstream.producers.rollouts.evaluators import build_evaluator
from rollstream.producers.rollouts.jobs import JobSpec, expand, parse_job, resolve_tasks
from rollstream.producers.rollouts.local_jobs import run_job
from rollstream.producers.rollouts.runner import RolloutExists, RolloutResult, run_rollout
from rollstream.producers.rollouts.settings import RolloutSettings
from rollstream.producers.rollouts.tasks import Task
from rollstream.schemas import (
    CommonSettings,
    EvaluatorOutput,
    Event,
    LlmCall,
    Reward,
    RolloutFinished,
    RolloutStarted,
    SandboxEvent,
    StageEvent,
    ToolCall,
)

pytestmark = pytest.mark.integration

ADMIN = "admin-key-for-rollout-tests"
TASK_ID = "balanced-brackets"


@pytest.fixture(scope="module")
def settings(kafka: KafkaBroker, tmp_path_factory: pytest.TempPathFactory) -> CommonSettings:
    return fresh_settings(kafka.bootstrap, tmp_path_factory.mktemp("rollouts-home"))


@pytest.fixture(scope="module")
def proxy_url(settings: CommonSettings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("rollout-services")
    with rollout_stack(settings, tmp, admin_key=ADMIN, producer="proxy-rollouts-it") as url:
        yield url


@pytest.fixture(scope="module")
def provider() -> Iterator[BwrapProvider]:
    # bwrap runs as an unprivileged host user when we are root: it must reach the root dir
    root = Path(tempfile.mkdtemp(prefix="rs-runner-"))
    root.chmod(0o755)
    yield BwrapProvider(root / "bwrap")
    shutil.rmtree(root, ignore_errors=True)


def make_job(job_id: str, **changes: Any) -> tuple[JobSpec, Task]:
    spec = {
        "job_id": job_id,
        "tasks": {"suite": "pycoding", "ids": [TASK_ID]},
        "agent": {"kind": "tool", "max_turns": 2, "max_tokens": 16},
        "sandbox": {"kind": "bwrap", "limits": {"timeout": 60}},
        "timeouts": {"init": 60, "run": 60, "eval": 60},
        "run_id": "it",
        **changes,
    }
    job = parse_job(spec)
    (task,) = resolve_tasks(job)
    return job, task


def rewards(events: list[Event]) -> list[Reward]:
    return [e.body for e in events if isinstance(e.body, Reward)]


class ScriptedAgent:
    """Writes the reference solution through the sandbox and records each write."""

    def __init__(self, task: Task) -> None:
        self.task = task

    @property
    def name(self) -> str:
        return "scripted"

    def run(self, ctx: AgentContext) -> AgentOutcome:
        with RolloutClient(ctx.endpoint) as client:
            for path, text in sorted(self.task.solution.items()):
                where = ctx.sandbox.copy_in(text.encode(), path)
                client.tool_call(
                    name="write_file",
                    arguments=json.dumps({"path": path, "content": text}),
                    result=f"wrote {where}",
                    is_error=False,
                    duration_ms=1.0,
                    sandbox=ctx.sandbox.id,
                    at_call_id=None,
                    tool_call_id=None,
                )
        return AgentOutcome("ok", "submit", tool_calls=len(self.task.solution))


def test_tool_agent_rollout_on_the_log(
    settings: CommonSettings, proxy_url: str, provider: BwrapProvider
) -> None:
    job, task = make_job("it-tool")
    (plan,) = expand(job, [task])
    t0 = time.monotonic()
    result = run_rollout(
        plan,
        job,
        task,
        proxy_url=proxy_url,
        admin_key=ADMIN,
        sandbox_provider=provider,
        agent=build_agent(job.agent),
        evaluator=build_evaluator(job.evaluator),
        worker_id="w1",
    )
    assert time.monotonic() - t0 < 60
    assert result.status == "completed" and result.stage == "done", result
    assert result.agent is not None and result.agent.turns >= 1
    assert result.evaluation is not None and result.evaluation.final == 0.0  # unsolved
    assert result.sandbox_id is not None and provider.records() == []  # destroyed

    events = events_of(settings, plan.rollout_id)
    started, finished = events[0].body, events[-1].body
    assert isinstance(started, RolloutStarted) and isinstance(finished, RolloutFinished)
    assert (started.task_id, started.group_id, started.attempt, started.group_size) == (
        TASK_ID,
        plan.group_id,
        0,
        1,
    )
    assert (started.run_id, started.harness) == ("it", "tool")
    assert started.metadata["job_id"] == "it-tool" and started.metadata["sample"] == "0"
    assert started.sampling["max_tokens"] == 16
    calls = [e.body for e in events if isinstance(e.body, LlmCall)]
    assert len(calls) == result.agent.turns >= 1
    assert sum(isinstance(e.body, RolloutFinished) for e in events) == 1
    assert (finished.status.value, finished.error) == ("completed", None)
    got = rewards(events)
    assert got and {r.evaluator for r in got} == {"suite"}
    finals = [r for r in got if r.kind.value == "final"]
    assert [(r.value, r.name) for r in finals] == [(0.0, "suite")]
    milestones = [(r.name, r.value) for r in got if r.kind.value == "milestone"]
    assert milestones == [(n, pytest.approx(v)) for n, v in result.evaluation.milestones]
    assert len(milestones) < len(task.hidden_test_names())

    # the lifecycle events, in the runner's documented order, between the rollout's others
    def lifecycle(e: Event) -> str | None:
        b = e.body
        if isinstance(b, StageEvent):
            return f"{b.stage} {b.phase}"
        if isinstance(b, SandboxEvent):
            return f"sandbox {b.phase}"
        return "evaluator output" if isinstance(b, EvaluatorOutput) else None

    order = [lifecycle(e) or e.kind for e in events]
    first_call = order.index("LlmCall")
    assert order[:first_call] == [
        "RolloutStarted", "init started", "sandbox ready", "init finished", "run started"
    ]  # fmt: skip
    tail = order[order.index("run finished") :]
    assert tail == [
        "run finished", "eval started", "evaluator output", "eval finished", "sandbox released",
        *["Reward"] * len(got), "RolloutFinished",
    ]  # fmt: skip
    assert set(order[first_call : order.index("run finished")]) <= {"LlmCall", "ToolCall"}
    stages = [e.body for e in events if isinstance(e.body, StageEvent)]
    assert {(s.job_id, s.worker) for s in stages} == {("it-tool", "w1")}
    done = {str(s.stage): s for s in stages if s.phase == "finished"}
    assert [done[k].status for k in ("init", "run", "eval")] == ["ok", "ok", "ok"]
    for stage in ("init", "run", "eval"):  # the durations the runner measured
        assert done[stage].duration_ms == pytest.approx(result.durations[stage] * 1000.0)
    assert all(s.status == "" and s.duration_ms == 0.0 for s in stages if s.phase == "started")
    ready, released = (e.body for e in events if isinstance(e.body, SandboxEvent))
    assert isinstance(ready, SandboxEvent) and isinstance(released, SandboxEvent)
    assert ready.sandbox_id == released.sandbox_id == result.sandbox_id
    assert (ready.kind, ready.job_id) == ("bwrap", "it-tool") and ready.duration_ms > 0
    (output,) = [e.body for e in events if isinstance(e.body, EvaluatorOutput)]
    assert (output.evaluator, output.status) == ("suite", "ok")
    assert (output.passed, output.total) == (len(milestones), len(task.hidden_test_names()))
    assert output.output == result.evaluation.output[:8192] and output.job_id == "it-tool"


def test_scripted_agent_writes_the_solution_and_scores_one(
    settings: CommonSettings, proxy_url: str, provider: BwrapProvider
) -> None:
    job, task = make_job("it-scripted")
    (plan,) = expand(job, [task])
    run = {
        "proxy_url": proxy_url,
        "admin_key": ADMIN,
        "sandbox_provider": provider,
        "agent": ScriptedAgent(task),
        "evaluator": build_evaluator(job.evaluator),
    }
    result = run_rollout(plan, job, task, **run)
    assert (result.status, result.evaluation and result.evaluation.final) == ("completed", 1.0)

    events = events_of(settings, plan.rollout_id)
    kinds = [e.kind for e in events]
    assert kinds[0] == "RolloutStarted" and kinds[-1] == "RolloutFinished"
    assert kinds.count("RolloutFinished") == 1 and "LlmCall" not in kinds
    tools = [e.body for e in events if isinstance(e.body, ToolCall)]
    assert [t.name for t in tools] == ["write_file"] * len(task.solution)
    assert {t.sandbox for t in tools} == {result.sandbox_id}
    got = rewards(events)
    assert [(r.value, r.evaluator) for r in got if r.kind.value == "final"] == [(1.0, "suite")]
    names = [r.name for r in got if r.kind.value == "milestone"]
    assert names == task.hidden_test_names()
    assert sum(r.value for r in got if r.kind.value == "milestone") == pytest.approx(1.0)

    # the same plan delivered again: no second rollout, no sandbox
    with pytest.raises(RolloutExists):
        run_rollout(plan, job, task, **run)
    again = events_of(settings, plan.rollout_id)
    assert [e.kind for e in again] == kinds
    assert provider.records() == []


# --------------------------------------------------------------------------- stage outcomes


class FakeProxy:
    """The rollout API at the HTTP edge: opens rollouts (409 for a taken id), takes rewards and
    finishes, and remembers what it was asked."""

    def __init__(self) -> None:
        self.open: set[str] = set()
        self.rewards: dict[str, list[dict[str, Any]]] = {}
        self.finished: dict[str, tuple[str, str | None]] = {}
        self.lifecycle: list[str] = []  # "stage phase [status]", "sandbox phase", "evaluator"

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == f"Bearer {ADMIN}"
        body = json.loads(request.content)
        parts = request.url.path.strip("/").split("/")
        if parts == ["v1", "rollouts"]:
            rid = body["rollout_id"]
            if rid in self.open:
                return httpx.Response(409, json={"error": {"message": "exists"}})
            self.open.add(rid)
            return httpx.Response(
                201,
                json={
                    "rollout_id": rid,
                    "base_url": f"http://proxy.test/rollouts/{rid}/v1",
                    "token": f"rs1.{rid}.sig",
                    "policy_version": 3,
                },
            )
        rid, action = parts[2], parts[3]
        if action == "rewards":
            self.rewards.setdefault(rid, []).extend(body["rewards"])
        elif action == "finish":
            self.finished[rid] = (body["status"], body["error"])
        elif action == "events":
            assert rid not in self.finished  # never after the rollout's end
            for item in body["events"]:
                if item["type"] == "stage":
                    status = f" {item['status']}" if item["phase"] == "finished" else ""
                    self.lifecycle.append(f"{item['stage']} {item['phase']}{status}")
                else:
                    what = item["phase"] if "phase" in item else item["status"]
                    self.lifecycle.append(f"{item['type']} {what}")
        return httpx.Response(200, json={"rollout_id": rid})


class FixedAgent:
    def __init__(self, outcome: AgentOutcome | None) -> None:
        self.outcome = outcome

    @property
    def name(self) -> str:
        return "fixed"

    def run(self, ctx: AgentContext) -> AgentOutcome:
        if self.outcome is None:
            raise RuntimeError("agent bug")
        return self.outcome


def run_faked(
    provider: BwrapProvider, agent: FixedAgent, **changes: Any
) -> tuple[RolloutResult, FakeProxy]:
    job, task = make_job(f"fake-{uuid.uuid4().hex[:8]}", **changes)
    (plan,) = expand(job, [task])
    fake = FakeProxy()
    result = run_rollout(
        plan,
        job,
        task,
        proxy_url="http://proxy.test",
        admin_key=ADMIN,
        sandbox_provider=provider,
        agent=agent,
        evaluator=build_evaluator(job.evaluator),
        transport=httpx.MockTransport(fake.handler),
    )
    assert provider.records() == []  # the sandbox is gone, whatever happened
    assert list(fake.finished) == [plan.rollout_id]
    return result, fake


def test_a_sandbox_that_cannot_start_fails_init(provider: BwrapProvider) -> None:
    result, fake = run_faked(
        provider,
        FixedAgent(AgentOutcome("ok", "submit")),
        sandbox={"kind": "bwrap", "image": "/no/such/rootfs"},
    )
    assert (result.status, result.stage, result.agent) == ("failed", "init", None)
    ((status, error),) = fake.finished.values()
    assert status == "failed" and error is not None and error.startswith("init: ")
    assert "/no/such/rootfs" in error and fake.rewards == {}
    assert fake.lifecycle == ["init started", "init finished failed"]


def test_a_failed_agent_is_not_evaluated(provider: BwrapProvider) -> None:
    result, fake = run_faked(provider, FixedAgent(AgentOutcome("failed", "error", "proxy gone")))
    assert (result.status, result.stage, result.evaluation) == ("failed", "run", None)
    assert list(fake.finished.values()) == [("failed", "run: proxy gone")]
    assert fake.rewards == {}
    assert fake.lifecycle == [
        "init started", "sandbox ready", "init finished ok", "run started",
        "run finished failed", "sandbox released",
    ]  # fmt: skip


def test_an_agent_that_raises_fails_the_rollout(provider: BwrapProvider) -> None:
    result, fake = run_faked(provider, FixedAgent(None))
    ((status, error),) = fake.finished.values()
    assert (result.status, status) == ("failed", "failed") and "agent bug" in (error or "")


def test_an_agent_past_its_deadline_is_scored_and_timed_out(provider: BwrapProvider) -> None:
    outcome = AgentOutcome("timeout", "deadline", "the run's deadline passed")
    result, fake = run_faked(provider, FixedAgent(outcome))
    assert (result.status, result.stage) == ("timeout", "done")
    assert list(fake.finished.values()) == [("timeout", "run: the run's deadline passed")]
    (posted,) = fake.rewards.values()
    assert [r["kind"] for r in posted][-1] == "final" and posted[-1]["value"] == 0.0


def test_an_evaluation_past_its_deadline_is_a_timeout_without_reward(
    provider: BwrapProvider,
) -> None:
    result, fake = run_faked(
        provider,
        FixedAgent(AgentOutcome("ok", "submit")),
        evaluator={"kind": "command", "argv": ["sleep", "30"]},
        timeouts={"eval": 1},
    )
    assert (result.status, result.stage) == ("timeout", "eval")
    ((status, error),) = fake.finished.values()
    assert status == "timeout" and (error or "").startswith("eval: ran past")
    assert fake.rewards == {} and result.rewards == ()
    assert fake.lifecycle[-4:] == [
        "eval started", "evaluator_output timeout", "eval finished timeout", "sandbox released"
    ]  # fmt: skip


def test_a_redelivered_plan_makes_nothing(provider: BwrapProvider) -> None:
    job, task = make_job("fake-redelivered")
    (plan,) = expand(job, [task])
    fake = FakeProxy()
    fake.open.add(plan.rollout_id)
    with pytest.raises(RolloutExists):
        run_rollout(
            plan,
            job,
            task,
            proxy_url="http://proxy.test",
            admin_key=ADMIN,
            sandbox_provider=provider,
            agent=FixedAgent(AgentOutcome("ok", "submit")),
            evaluator=build_evaluator(job.evaluator),
            transport=httpx.MockTransport(fake.handler),
        )
    assert fake.finished == {} and provider.records() == []


# --------------------------------------------------------------------------- whole jobs


def _rollout_settings(settings: CommonSettings, proxy_url: str) -> dict[str, str]:
    root = Path(tempfile.mkdtemp(prefix="rs-jobs-"))
    root.chmod(0o755)  # bwrap runs as an unprivileged host user when we are root
    return {
        "ROLLSTREAM_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "ROLLSTREAM_NAMESPACE": settings.namespace,
        "ROLLSTREAM_HOME": str(settings.home),
        "ROLLSTREAM_ROLLOUTS_PROXY_URL": proxy_url,
        "ROLLSTREAM_ROLLOUTS_ADMIN_KEY": ADMIN,
        "ROLLSTREAM_ROLLOUTS_SANDBOX_ROOT": str(root / "sandboxes"),
        "ROLLSTREAM_ROLLOUTS_CONCURRENCY": "2",
    }


def test_run_job_command_runs_every_sample_to_the_log(
    settings: CommonSettings, proxy_url: str, tmp_path: Path
) -> None:
    spec = {
        "job_id": "it-cli",
        "tasks": {"suite": "pycoding", "ids": [TASK_ID]},
        "samples_per_task": 2,
        "agent": {"kind": "tool", "max_turns": 1, "max_tokens": 8},
        "sandbox": {"kind": "bwrap", "limits": {"timeout": 60}},
        "run_id": "it",
    }
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(spec))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")},
        **_rollout_settings(settings, proxy_url),
    }
    done = subprocess.run(
        [sys.executable, "-m", "rollstream.infra.cli", "run-job", str(job_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "it-cli: 2/2 rollouts completed" in done.stderr, done.stderr[-3000:]
    job = parse_job(spec)
    plans = expand(job, resolve_tasks(job))
    assert [p.sample_index for p in plans] == [0, 1]
    for plan in plans:  # each sample: one rollout on the log, ended once, in its GRPO group
        events = events_of(settings, plan.rollout_id)
        assert isinstance(events[0].body, RolloutStarted)
        assert events[0].body.group_id == plans[0].group_id and events[0].body.group_size == 2
        assert sum(isinstance(e.body, RolloutFinished) for e in events) == 1


def test_run_job_retries_a_rollout_whose_sandbox_cannot_start(
    settings: CommonSettings, proxy_url: str
) -> None:
    env = _rollout_settings(settings, proxy_url)
    rs = RolloutSettings.model_validate(
        {k.removeprefix("ROLLSTREAM_").lower(): v for k, v in env.items()}
    )
    job, _ = make_job(
        "it-retry",
        attempts=2,
        sandbox={"kind": "bwrap", "image": "/nonexistent/rootfs", "limits": {"timeout": 60}},
    )
    (result,) = run_job(job, rs)
    assert (result.status, result.stage, result.plan.attempt) == ("failed", "init", 1)
    assert "image" in result.reason
    first, second = expand(job, resolve_tasks(job))[0], result.plan
    assert first.rollout_id != second.rollout_id and first.group_id == second.group_id
    for plan in (first, second):  # both attempts are on the log, each ended with its reason
        events = events_of(settings, plan.rollout_id)
        assert events[0].body.attempt == plan.attempt
        (finished,) = [e.body for e in events if isinstance(e.body, RolloutFinished)]
        assert finished.status == "failed" and finished.error.startswith("init:")
        assert not [e for e in events if isinstance(e.body, Reward)]  # never a silent zero
