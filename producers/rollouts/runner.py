"""One rollout, INIT -> RUN -> EVAL, in one process: the functions the stage workers call.

``run_rollout(plan, job, task, ...)`` runs one planned rollout on real parts: the recording
proxy (its rollout API, over HTTP, with the admin key), a sandbox provider, an agent and an
evaluator. In order:

1. Open the rollout at the proxy (``POST /v1/rollouts`` with the plan's deterministic
   ``rollout_id``, task, group, attempt, group size, run id, the agent's sampling and metadata
   ``{job_id, sample, attempt, agent, evaluator, sandbox, policy}``): the proxy records
   RolloutStarted. A 409 (the id is taken: the same stage message delivered twice) raises
   ``RolloutExists`` and nothing else happens. The rollout is opened before the sandbox so
   that a failure of INIT is on the log too (RolloutFinished ``failed``, reason ``init: ...``).
2. INIT: create the sandbox from the job's spec, labelled with the job, rollout and stage, with
   the task's workdir files in it; past ``timeouts.init`` it is a ``timeout``.
3. RUN: the agent, with the rollout's base URL and token and the ``timeouts.run`` deadline.
4. EVAL (when the agent did not fail): the evaluator with the ``timeouts.eval`` deadline; when it
   judged, its final reward (kind ``final``, name and ``evaluator`` = the evaluator's name) and
   milestones (kind ``milestone``, name = the check) are posted with the admin key, so they are
   told apart from anything a harness posts with the rollout token.
5. Destroy the sandbox, whatever happened.
6. Finish the rollout: ``completed``; ``failed`` or ``timeout`` with ``<stage>: <reason>``
   (an agent past its deadline is still evaluated, and the rollout is ``timeout``).

Lifecycle events (``POST /v1/rollouts/{id}/events``, admin key) put the stages on the log, each
posted when it happens, so they sit between the rollout's other events in this order:

    RolloutStarted
    StageEvent init started
    SandboxEvent ready (duration_ms: create time)     when the sandbox started
    StageEvent init finished (ok | failed | timeout, duration_ms, reason)
    StageEvent run started
      ... the agent's LlmCall / ToolCall / RolloutError events ...
    StageEvent run finished (ok | failed | timeout, duration_ms, reason)
    StageEvent eval started                           when the agent did not fail
    EvaluatorOutput (status, passed / total, output cut to 8 KiB)
    StageEvent eval finished (ok | failed | timeout, duration_ms, reason)
    SandboxEvent released (duration_ms: destroy time)   when the sandbox was destroyed
    Reward (milestones, then final)                    when the evaluator judged
    RolloutFinished                                     always last, exactly once

A stage that ends the rollout early (INIT failed, the agent failed) is the last StageEvent.
StageEvent's ``worker`` is the worker id, ``job_id`` the plan's job. EvaluatorOutput's
passed / total: the evaluation's own count of checks (0 / 0 for an evaluator that reports
none).

What happens in a stage (a sandbox that cannot start, an agent or evaluator that fails or
raises) is in the returned ``RolloutResult`` and on the log, never raised. Only the proxy's
rollout API failing (no answer, a refusal) raises ``RolloutCallError``, after a best-effort
finish: the stage worker must not commit its offset then.

Errors (producers/errors.py): ``RolloutCallError``, ``RolloutExists``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

import httpx
from pydantic import SecretStr

from rollstream.producers.errors import RolloutCallError, RolloutExists, SandboxError
from rollstream.producers.rollouts.agents import (
    Agent,
    AgentContext,
    AgentOutcome,
    RolloutEndpoint,
    ToolAgent,
    clip,
)
from rollstream.producers.rollouts.evaluators import Evaluation, Evaluator
from rollstream.producers.rollouts.jobs import JobSpec, RolloutPlan
from rollstream.producers.rollouts.sandbox import Sandbox, SandboxLabels, SandboxProvider
from rollstream.producers.rollouts.tasks import Task

__all__ = [
    "FinalStatus",
    "KeySource",
    "ProxyClient",
    "RolloutCallError",
    "RolloutExists",
    "RolloutResult",
    "RolloutStages",
    "Stage",
    "open_rollout",
    "run_rollout",
]

FinalStatus = Literal["completed", "failed", "timeout"]
Stage = Literal["init", "run", "eval", "done"]

MAX_REASON: Final = 2_000
MAX_OUTPUT: Final = 8_192  # EvaluatorOutput.output, as the proxy bounds it

# A bearer key asked for at each call: ``keys(False)``, and ``keys(True)`` for a renewed one
# after a 401 (``ProxyClient.keyed``). It may raise RolloutCallError (minting a key failed).
KeySource = Callable[[bool], str | None]


@dataclass(frozen=True, slots=True)
class RolloutResult:
    """How one rollout went. ``stage``: where it ended (``done``: every stage ran);
    ``rewards``: (kind, name, value) as posted; ``durations``: seconds per stage run."""

    plan: RolloutPlan
    status: FinalStatus
    stage: Stage
    reason: str = ""
    agent: AgentOutcome | None = None
    evaluation: Evaluation | None = None
    rewards: tuple[tuple[str, str, float], ...] = ()
    sandbox_id: str | None = None
    policy_version: int = 0
    durations: Mapping[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------- the proxy


class ProxyClient:
    """The rollout API calls of the runner, with the admin key (None: a proxy without one);
    ``keyed`` gives a client on the same connections with keys from a ``KeySource``."""

    def __init__(
        self,
        proxy_url: str,
        admin_key: SecretStr | str | None,
        *,
        transport: httpx.BaseTransport | None = None,
        timeout: float = 30.0,
        http: httpx.Client | None = None,
    ) -> None:
        self.url = proxy_url.rstrip("/")
        key = admin_key.get_secret_value() if isinstance(admin_key, SecretStr) else admin_key
        self._keys: KeySource = lambda _renew: key
        self._renews = False  # try a 401 again with keys(True)
        self._owner = http is None  # ``http``: another client's connections (``keyed``)
        self._http = httpx.Client(transport=transport, timeout=timeout) if http is None else http

    def keyed(self, keys: KeySource) -> ProxyClient:
        """A client on this one's connections whose calls send ``keys(False)`` as their bearer
        key and, after a 401, once more with ``keys(True)``. Closing it closes nothing."""
        client = ProxyClient(self.url, None, http=self._http)
        client._keys, client._renews = keys, True
        return client

    def close(self) -> None:
        if self._owner:
            self._http.close()

    def __enter__(self) -> ProxyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(
        self,
        plan: RolloutPlan,
        *,
        run_id: str = "",
        harness: str = "",
        sampling: Mapping[str, float] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> RolloutEndpoint:
        body = {
            "rollout_id": plan.rollout_id,
            "task_id": plan.task_id,
            "group_id": plan.group_id,
            "attempt": plan.attempt,
            "group_size": plan.group_size,
            "run_id": run_id,
            "harness": harness,
            "sampling": dict(sampling or {}),
            "metadata": dict(metadata or {}),
        }
        answer = self._post("/v1/rollouts", body, ok=201)
        if answer.get("rollout_id") != plan.rollout_id:
            raise RolloutCallError(
                f"the proxy opened {answer.get('rollout_id')!r}, not {plan.rollout_id!r}"
            )
        try:
            return RolloutEndpoint(
                rollout_id=plan.rollout_id,
                base_url=str(answer["base_url"]),
                token=str(answer["token"]),
                api_url=self.url,
                policy_version=int(answer.get("policy_version") or 0),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RolloutCallError(f"the proxy's rollout answer lacks {exc}") from exc

    def rewards(self, rollout_id: str, rewards: Sequence[Mapping[str, Any]]) -> None:
        self._post(f"/v1/rollouts/{rollout_id}/rewards", {"rewards": list(rewards)}, ok=200)

    def events(self, rollout_id: str, items: Sequence[Mapping[str, Any]]) -> None:
        """Lifecycle events (``{type: stage | sandbox | evaluator_output, ...}``), in order."""
        self._post(f"/v1/rollouts/{rollout_id}/events", {"events": list(items)}, ok=200)

    def finish(self, rollout_id: str, status: str, error: str | None) -> bool:
        """``status``: a RolloutStatus value (completed, failed, timeout, aborted...). True when
        this call finished it, False when it had finished before."""
        body = {"status": status, "error": error}
        answer = self._post(f"/v1/rollouts/{rollout_id}/finish", body, ok=200)
        return bool(answer.get("finished", True))

    def evaluator_token(self, job_id: str) -> str:
        """The job's evaluator token (``POST /v1/jobs/{job_id}/evaluator-token``, with the
        admin or evaluator key): it scores, finishes and posts lifecycle events of that job's
        rollouts only. An older proxy without the route: RolloutCallError status 404."""
        answer = self._post(f"/v1/jobs/{job_id}/evaluator-token", {}, ok=200)
        token = answer.get("token")
        if not isinstance(token, str) or not token:
            raise RolloutCallError(f"the proxy's evaluator-token answer for job {job_id} lacks it")
        return token

    def _send(self, path: str, body: Mapping[str, Any], key: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            return self._http.post(self.url + path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            msg = f"POST {path}: no answer from the proxy: {type(exc).__name__}: {exc}"
            raise RolloutCallError(msg) from exc

    def _post(self, path: str, body: Mapping[str, Any], *, ok: int) -> dict[str, Any]:
        response = self._send(path, body, self._keys(False))
        if response.status_code == 401 and self._renews:  # e.g. a token of a restarted proxy
            response = self._send(path, body, self._keys(True))
        if response.status_code == 409 and path == "/v1/rollouts":
            raise RolloutExists(f"rollout {body.get('rollout_id')} exists already", status=409)
        if response.status_code != ok:
            msg = f"POST {path}: the proxy answered {response.status_code}: "
            raise RolloutCallError(msg + clip(response.text, 500), status=response.status_code)
        try:
            data = response.json()
        except ValueError as exc:
            raise RolloutCallError(f"POST {path}: the answer is not JSON") from exc
        return data if isinstance(data, dict) else {}


# --------------------------------------------------------------------------- one rollout


def _sampling(agent: Agent) -> dict[str, float]:
    if isinstance(agent, ToolAgent):
        s = agent.spec
        return {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens}
    return {}


def open_rollout(
    proxy: ProxyClient, plan: RolloutPlan, job: JobSpec, agent: Agent, evaluator: Evaluator
) -> RolloutEndpoint:
    """Open the plan's rollout at the proxy (RolloutStarted with the job's metadata); a taken
    id raises RolloutExists."""
    metadata = {
        "job_id": plan.job_id,
        "sample": str(plan.sample_index),
        "attempt": str(plan.attempt),
        "agent": agent.name,
        "evaluator": evaluator.name,
        "sandbox": job.sandbox.kind,
    }
    if job.policy:
        metadata["policy"] = job.policy
    return proxy.create(
        plan, run_id=job.run_id, harness=agent.name, sampling=_sampling(agent), metadata=metadata
    )


def run_rollout(
    plan: RolloutPlan,
    job: JobSpec,
    task: Task,
    *,
    proxy_url: str,
    admin_key: SecretStr | str | None,
    sandbox_provider: SandboxProvider,
    agent: Agent,
    evaluator: Evaluator,
    worker_id: str = "",
    transport: httpx.BaseTransport | None = None,
    logger: logging.Logger | None = None,
) -> RolloutResult:
    """Run one rollout (module docstring). ``transport``: the httpx transport of the calls to
    the proxy's rollout API (tests)."""
    log = logger or logging.getLogger(__name__)
    if task.task_id != plan.task_id:
        raise ValueError(f"task {task.task_id!r} is not the plan's {plan.task_id!r}")
    with ProxyClient(proxy_url, admin_key, transport=transport) as proxy:
        endpoint = open_rollout(proxy, plan, job, agent, evaluator)
        log.debug("rollout %s opened (task %s)", plan.rollout_id, plan.task_id)
        run = RolloutStages(
            plan, job, task, endpoint, sandbox_provider, agent, evaluator, worker_id, log, proxy
        )
        try:
            result = run.stages()
            run.destroy()
        except BaseException as exc:  # a bug, the worker stopping, the proxy refusing an event:
            run.fail(exc)  # it still ends
            raise
        result = run.conclude(result)
    log.info(
        "rollout %s %s (%s%s)",
        plan.rollout_id,
        result.status,
        result.stage,
        f": {result.reason}" if result.reason else "",
    )
    return result


def _reward_items(evaluation: Evaluation, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [
        {"value": value, "kind": "milestone", "name": check[:200], "evaluator": name}
        for check, value in evaluation.milestones
    ]
    items.append({"value": evaluation.final, "kind": "final", "name": name, "evaluator": name})
    return items


class RolloutStages:
    """The stages of one rollout, and what they leave behind (the sandbox to destroy)."""

    def __init__(
        self,
        plan: RolloutPlan,
        job: JobSpec,
        task: Task,
        endpoint: RolloutEndpoint,
        provider: SandboxProvider,
        agent: Agent,
        evaluator: Evaluator,
        worker_id: str,
        log: logging.Logger,
        proxy: ProxyClient,
    ) -> None:
        self.plan, self.job, self.task, self.endpoint = plan, job, task, endpoint
        self.provider, self.agent, self.evaluator = provider, agent, evaluator
        self.worker_id, self.log, self.proxy = worker_id, log, proxy
        self.stage: Stage = "init"
        self.sandbox: Sandbox | None = None
        self.sandbox_id: str | None = None  # kept after the sandbox is destroyed
        self.durations: dict[str, float] = {}

    # --- lifecycle events (module docstring) ---

    def post(self, *items: dict[str, Any]) -> None:
        self.proxy.events(self.plan.rollout_id, items)

    def started(self, stage: str) -> dict[str, Any]:
        return {
            "type": "stage",
            "stage": stage,
            "phase": "started",
            "job_id": self.plan.job_id,
            "worker": self.worker_id,
        }

    def finished(self, stage: str, status: str, reason: str = "") -> dict[str, Any]:
        return {
            **self.started(stage),
            "phase": "finished",
            "status": status,
            "duration_ms": self.durations.get(stage, 0.0) * 1000.0,
            "reason": clip(reason, MAX_REASON),
        }

    def sandbox_event(self, phase: str, sandbox_id: str, seconds: float) -> dict[str, Any]:
        return {
            "type": "sandbox",
            "phase": phase,
            "sandbox_id": sandbox_id,
            "kind": self.job.sandbox.kind,
            "duration_ms": seconds * 1000.0,
            "job_id": self.plan.job_id,
        }

    def evaluator_output(self, evaluation: Evaluation) -> dict[str, Any]:
        return {
            "type": "evaluator_output",
            "evaluator": self.evaluator.name,
            "status": evaluation.status,
            "passed": evaluation.passed,
            "total": evaluation.total,
            "output": evaluation.output[:MAX_OUTPUT],
            "output_truncated": len(evaluation.output) > MAX_OUTPUT,
            "job_id": self.plan.job_id,
        }

    def result(
        self, status: FinalStatus, reason: str = "", *, where: str | None = None, **kw: Any
    ) -> RolloutResult:
        """The result as it stands; ``reason`` is prefixed with ``where`` (default: the stage)."""
        prefix = f"{self.stage}: " if where is None else where
        text = clip(prefix + reason, MAX_REASON) if reason else ""
        return RolloutResult(
            plan=self.plan,
            status=status,
            stage=self.stage,
            reason=text,
            sandbox_id=self.sandbox_id,
            policy_version=self.endpoint.policy_version,
            durations=dict(self.durations),
            **kw,
        )

    def stages(self) -> RolloutResult:
        """INIT, RUN and EVAL in a row (run_rollout)."""
        failed = self.init_stage()
        if failed is not None:
            return failed
        outcome = self.run_stage()
        if isinstance(outcome, RolloutResult):
            return outcome
        return self.eval_stage(outcome)

    def init_stage(self) -> RolloutResult | None:
        """Create the sandbox; None when it is ready, the rollout's result when not."""
        self.stage = "init"
        self.post(self.started("init"))
        t0 = time.monotonic()
        labels = SandboxLabels(
            job_id=self.plan.job_id,
            rollout_id=self.plan.rollout_id,
            stage="init",
            worker_id=self.worker_id,
        )
        files = {path: text.encode() for path, text in self.task.workdir_files().items()}
        try:
            self.sandbox = self.provider.create(self.job.sandbox.to_spec(labels, files))
        except SandboxError as exc:
            self.durations["init"] = time.monotonic() - t0
            reason = f"the sandbox could not start: {exc}"
            self.post(self.finished("init", "failed", reason))
            return self.result("failed", reason)
        self.durations["init"] = elapsed = time.monotonic() - t0
        self.sandbox_id = self.sandbox.id
        ready = self.sandbox_event("ready", self.sandbox.id, elapsed)
        if elapsed > self.job.timeouts.init:
            reason = f"took {elapsed:.1f} s (limit {self.job.timeouts.init:g})"
            self.post(ready, self.finished("init", "timeout", reason))
            return self.result("timeout", reason)
        self.post(ready, self.finished("init", "ok"))
        return None

    def run_stage(self) -> AgentOutcome | RolloutResult:
        """The agent in the sandbox; its outcome, or the rollout's result when it failed."""
        assert self.sandbox is not None  # INIT made it, or the worker attached it
        self.stage = "run"
        self.post(self.started("run"))
        t0 = time.monotonic()
        ctx = AgentContext(
            sandbox=self.sandbox,
            task_id=self.task.task_id,
            instructions=self.task.instructions(),
            endpoint=self.endpoint,
            deadline=t0 + self.job.timeouts.run,
            logger=self.log,
        )
        try:
            outcome = self.agent.run(ctx)
        except Exception as exc:  # an agent must not raise; if it does, the rollout fails
            self.log.exception("agent %s raised", self.agent.name)
            outcome = AgentOutcome("failed", "error", f"the agent raised {exc!r}")
        self.durations["run"] = time.monotonic() - t0
        why = outcome.reason or outcome.stop if outcome.status != "ok" else ""
        self.post(self.finished("run", outcome.status, why))
        if outcome.status == "failed":
            return self.result("failed", why, agent=outcome)
        return outcome

    def eval_stage(self, outcome: AgentOutcome) -> RolloutResult:
        """The evaluator on what the agent left; the rollout's result."""
        assert self.sandbox is not None
        self.stage = "eval"
        self.post(self.started("eval"))
        t0 = time.monotonic()
        try:
            evaluation = self.evaluator.evaluate(
                self.task, self.sandbox, t0 + self.job.timeouts.eval
            ).bounded()
        except Exception as exc:  # an evaluator must not raise either
            self.log.exception("evaluator %s raised", self.evaluator.name)
            evaluation = Evaluation.not_judged("failed", f"the evaluator raised {exc!r}")
        self.durations["eval"] = time.monotonic() - t0
        self.post(
            self.evaluator_output(evaluation),
            self.finished("eval", evaluation.status, evaluation.reason),
        )
        done = {"agent": outcome, "evaluation": evaluation}
        if evaluation.status != "ok":
            return self.result(evaluation.status, evaluation.reason, **done)
        self.stage = "done"
        if outcome.status == "timeout":  # evaluated all the same: what it did is scored
            reason = f"run: {outcome.reason or 'deadline'}"
            return self.result("timeout", reason, where="", **done)
        return self.result("completed", **done)

    def conclude(self, result: RolloutResult) -> RolloutResult:
        """Post the evaluator's rewards (when it judged) and finish the rollout; the result
        with the rewards as posted. Posting failing finishes the rollout ``failed`` and
        raises RolloutCallError."""
        plan, proxy = self.plan, self.proxy
        try:
            if result.evaluation is not None and result.evaluation.status == "ok":
                items = _reward_items(result.evaluation, self.evaluator.name)
                proxy.rewards(plan.rollout_id, items)
                posted = tuple((i["kind"], i["name"], float(i["value"])) for i in items)
                result = replace(result, rewards=posted)
            proxy.finish(plan.rollout_id, result.status, result.reason or None)
        except RolloutCallError as exc:
            reason = clip(f"eval: posting the outcome failed: {exc}", MAX_REASON)
            with contextlib.suppress(RolloutCallError):
                proxy.finish(plan.rollout_id, "failed", reason)
            raise
        return result

    def fail(self, exc: BaseException) -> None:
        """After an exception in a stage: finish the rollout (``failed``; ``aborted`` when the
        worker is stopping) and destroy the sandbox, best effort."""
        status = "failed" if isinstance(exc, Exception) else "aborted"
        try:
            with contextlib.suppress(RolloutCallError):
                reason = clip(f"{self.stage}: {exc!r}", MAX_REASON)
                self.proxy.finish(self.plan.rollout_id, status, reason)
        finally:
            self.destroy(record=False)

    def destroy(self, *, record: bool = True) -> None:
        """Destroy the sandbox (once); ``record``: post its SandboxEvent released (not when
        the rollout is being finished after an error: the event would come after its end)."""
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is None:
            return
        t0 = time.monotonic()
        try:
            sandbox.destroy()
        except SandboxError:  # the reaper takes what is left; no released event
            self.log.warning("sandbox %s could not be destroyed", sandbox.id, exc_info=True)
            return
        if record:
            self.post(self.sandbox_event("released", sandbox.id, time.monotonic() - t0))
