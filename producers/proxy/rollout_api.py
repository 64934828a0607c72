"""The proxy's rollout API: rollout-scoped tokens, the registry of open rollouts, and the HTTP
routes a harness that speaks only HTTP uses to create a rollout, post rewards and finish it.

    POST /v1/rollouts                      admin key  {task_id, group_id, metadata, ...}
                                           -> {rollout_id, base_url, token, policy_version}
    GET  /v1/rollouts/{rollout_id}         its token  -> status, calls, drift counters
    POST /v1/rollouts/{rollout_id}/rewards its token  {value, kind, name, at_call_id, evaluator}
                                                      or {"rewards": [...]}
    POST /v1/rollouts/{rollout_id}/tool_calls its token {name, arguments, result, is_error,
                                                      duration_ms, sandbox, at_call_id}
    POST /v1/rollouts/{rollout_id}/branches its token {kind, source_call_id, reason, branch_id}
                                           -> 201 {branch_id}: an explicit branch point (Branch)
    POST /v1/rollouts/{rollout_id}/finish  its token  {status, error}
    POST /v1/rollouts/{rollout_id}/events  admin key  {"events": [{type: stage | sandbox |
                                           evaluator_output, ...}]}: lifecycle facts of the
                                           rollout service (lifecycle.py); a rollout token: 403

A reward's ``value`` is a number in [-REWARD_BOUND, REWARD_BOUND] (1e6, rollstream.schemas);
any other (a string, a bool, 1.7e308) is 400 naming ``value`` (or ``rewards[i].value``) and
nothing of that request is recorded: the stream processors would dead-letter it as
``bad_reward``. NaN, Infinity and 1e400 are not JSON numbers at all (400 ``invalid_json``).

Final rewards: a rollout's harness (its token) may post partial, milestone and penalty rewards;
a ``final`` reward is the evaluator's, posted with the admin key (403 naming ``kind`` for the
token), unless the rollout was created with ``"final_rewards": "harness"`` (a harness that
scores itself). So an agent cannot overwrite its evaluator's verdict.

Tokens: ``rs1.<rollout_id>.<sig>`` with sig = base64url(HMAC-SHA256(secret, rollout_id)). A
token opens only the rollout named in it: a bad signature is 401, a good token used on another
rollout's URL is 403. Admin keys (``proxy_api_keys``) open everything; with no admin key set the
admin routes are open (local use) and a warning is logged at start. Secrets are never logged.

Evaluators: an evaluator key (``proxy_evaluator_keys``) opens the evaluator routes of every
rollout: read (GET), rewards (final ones too), finish and lifecycle events; nothing else (401).
A job evaluator token (job_tokens.py, ``rs1j.<job_id>.<sig>``, minted by jobs_api.py's
``POST /v1/jobs/{job_id}/evaluator-token``) opens the same routes of the rollouts whose
creation metadata holds ``job_id`` = its job; on another job's rollout or one without a
``job_id`` it is 403 naming ``rollout_id``, elsewhere 401. The registry remembers the job of
the open and the recently finished rollouts (``keep_finished``), so a finish retried after the
rollout ended is still answered. Neither is rate-limited.

Every request a rollout token opens (its model calls and these routes) takes a token from its
rollout's bucket (``Auth.limiter``, ratelimit.py): over the rate, 429 ``rate_limit_exceeded``
with ``Retry-After``, before the body is read; admin keys are not limited.

Branch points: ``POST .../branches`` records a Branch event as ``RolloutHandle.branch`` does
(``source_call_id`` must be a call of the rollout: 400 naming it, since the trajectory builder
would dead-letter the event). The rollout's next model call, if its prompt continues the source
call's full sequence, goes on the wire under that call (the SDK's ``ContextTrie.add``), so the
trajectory tree hangs it there.

Every event goes through the SDK (``Recorder`` -> ``RolloutHandle``): ordered per rollout,
spooled while Kafka is away, never lost by the proxy once accepted.

The handlers know no HTTP framework: each takes an ``HttpRequest`` (openai_wire.py) and returns
an ``Answer``; app.py carries them over Starlette. Errors are ApiError (producers/errors.py),
answered as OpenAI error objects.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ulid import ULID

from rollstream.adapters.auth import key_matches
from rollstream.producers.errors import ApiError, ProxyConfigError
from rollstream.producers.proxy.chat import ChatMemory
from rollstream.producers.proxy.job_tokens import JobTokens
from rollstream.producers.proxy.lifecycle import parse_lifecycle
from rollstream.producers.proxy.openai_wire import (
    BRANCH_ID_PATTERN,
    MAX_BRANCH_REASON,
    MAX_BRANCHES,
    MAX_REWARDS,
    Answer,
    HttpRequest,
    dumps,
    json_answer,
    number,
)
from rollstream.producers.proxy.pool import BackendPool
from rollstream.producers.proxy.ratelimit import RateLimiter, retry_after
from rollstream.producers.sdk.recorder import Recorder, RecorderUsageError, RolloutHandle
from rollstream.schemas import REWARD_BOUND, BranchKind, RewardKind, RolloutStatus
from rollstream.schemas.events import (
    SAFE_INT_MAX,
    SAMPLING_MAX_KEYS,
    metadata_problem,
    reward_problem,
)

__all__ = [
    "Auth",
    "OpenRollout",
    "RolloutApi",
    "RolloutTokens",
    "Rollouts",
]

ROLLOUT_ID = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")
NOT_DURABLE_RETRY_S = 5  # Retry-After of a 503 while events cannot be made durable
BRANCH_ID = re.compile(BRANCH_ID_PATTERN)
# Who may post a rollout's final reward: its evaluator (the admin key; the default) or also its
# harness (its rollout token), chosen by whoever creates the rollout.
FINAL_REWARDS = ("evaluator", "harness")


class RolloutTokens:
    """Issues and checks rollout-scoped bearer tokens (HMAC of the rollout id); ``jobs``: the
    job evaluator tokens (job_tokens.py) of the same secret."""

    PREFIX = "rs1."

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ProxyConfigError("the rollout token secret must be at least 16 bytes")
        self._secret = secret
        self._valid: dict[str, str] = {}  # tokens checked already -> their rollout id
        self.jobs = JobTokens(secret)

    def _sig(self, rollout_id: str) -> str:
        mac = hmac.new(self._secret, rollout_id.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def issue(self, rollout_id: str) -> str:
        return f"{self.PREFIX}{rollout_id}.{self._sig(rollout_id)}"

    def verify(self, token: str) -> str | None:
        """The rollout id the token opens, or None if it is not a valid token. Valid tokens
        are remembered (up to 65,536), so a rollout's calls after its first skip the HMAC."""
        rid = self._valid.get(token)
        if rid is not None:
            return rid
        if not token.isascii() or not token.startswith(self.PREFIX):
            return None  # a non-ASCII token is no token of ours (and hmac cannot compare it)
        rollout_id, dot, sig = token[len(self.PREFIX) :].rpartition(".")
        if not dot or not ROLLOUT_ID.fullmatch(rollout_id):  # only ids of rollouts are signed
            return None
        if not hmac.compare_digest(sig, self._sig(rollout_id)):
            return None
        if len(self._valid) >= 65_536:
            self._valid.clear()
        self._valid[token] = rollout_id
        return rollout_id


class Auth:
    """Admin keys and rollout tokens; ``limiter`` (None: no limit) rate-limits every request a
    rollout token opens, by rollout."""

    def __init__(
        self,
        tokens: RolloutTokens,
        admin_keys: Sequence[str],
        *,
        limiter: RateLimiter | None = None,
        evaluator_keys: Sequence[str] = (),
    ) -> None:
        self.tokens = tokens
        self.limiter = limiter
        self._admin = [k.encode() for k in admin_keys if k]
        self._evaluator = [k.encode() for k in evaluator_keys if k]

    @property
    def admin_open(self) -> bool:
        return not self._admin

    def is_admin(self, token: str | None) -> bool:
        return key_matches(token, self._admin)

    def is_evaluator(self, token: str | None) -> bool:
        """An evaluator key: it may score, finish and post lifecycle events of any open rollout
        (``rollout_of(..., evaluator=True)``, ``evaluator_or_admin``), and nothing else."""
        return bool(self._evaluator) and key_matches(token, self._evaluator)

    def job_of(self, token: str | None) -> str | None:
        """The job a job evaluator token opens (``RolloutApi._evaluated``), else None."""
        return None if token is None else self.tokens.jobs.verify(token)

    def evaluator_or_admin(self, token: str | None) -> None:
        if self.is_evaluator(token):
            return
        self.admin(token)

    def admin(self, token: str | None) -> None:
        """Pass when ``token`` (the request's bearer token) is an admin key or no key is set."""
        if self.admin_open:
            return
        if token is None:
            raise ApiError(
                401, "missing admin API key (Authorization: Bearer ...)", code="unauthorized"
            )
        if not self.is_admin(token):
            raise ApiError(401, "invalid admin API key", code="unauthorized")

    def rollout_of(
        self, token: str | None, rollout_id: str | None, *, evaluator: bool = False
    ) -> str:
        """The rollout a request with this bearer token may write: the URL's ``rollout_id``
        (checked against the token) or, on an unscoped URL, the token's own. An admin key opens
        any rollout on its URL; with ``evaluator``, an evaluator key too."""
        if token is None:
            raise ApiError(
                401, "missing rollout token (Authorization: Bearer ...)", code="unauthorized"
            )
        owner = self.tokens.verify(token)
        if owner is None:
            if rollout_id is not None and (
                self.is_admin(token) or (evaluator and self.is_evaluator(token))
            ):
                return rollout_id
            raise ApiError(401, "invalid rollout token", code="unauthorized")
        if rollout_id is not None and owner != rollout_id:
            raise ApiError(403, "this token belongs to another rollout", code="forbidden")
        if self.limiter is not None:
            self._throttle(self.limiter, owner)
        return owner

    @staticmethod
    def _throttle(limiter: RateLimiter, rollout_id: str) -> None:
        """429 ``rate_limit_exceeded`` with Retry-After when the rollout's bucket is empty."""
        wait = limiter.take(rollout_id)
        if wait > 0:
            msg = (
                f"Rate limit reached for rollout {rollout_id}: {limiter.rate:g} requests per "
                f"second (burst {limiter.burst:g}). Please try again in {wait:.2f}s."
            )
            headers = {"Retry-After": str(retry_after(wait))}
            raise ApiError(429, msg, code="rate_limit_exceeded", headers=headers)


# --------------------------------------------------------------------------- registry


@dataclass(eq=False, slots=True)
class OpenRollout:
    handle: RolloutHandle
    memory: ChatMemory = field(default_factory=ChatMemory)
    last_seen: float = field(default_factory=time.monotonic)
    calls: int = 0
    errors: int = 0
    drift_tokens: int = 0
    harness_final: bool = False  # created with final_rewards="harness": its token may score it
    job_id: str | None = None  # metadata["job_id"] at creation: a job token of it may evaluate
    branch_ids: set[str] = field(default_factory=set)  # posted branch points (MAX_BRANCHES)

    @property
    def rollout_id(self) -> str:
        return self.handle.rollout_id


class Rollouts:
    """The proxy's open rollouts (in memory) and the recently finished ones (for 409s)."""

    def __init__(
        self,
        recorder: Recorder,
        pool: BackendPool,
        *,
        keep_finished: int = 100_000,
        max_open: int = 10_000,
        max_calls: int = 10_000,
        max_tokens: int = 16_000_000,
    ) -> None:
        self.recorder, self.pool = recorder, pool
        self.max_open, self.max_calls, self.max_tokens = max_open, max_calls, max_tokens
        self.open: dict[str, OpenRollout] = {}
        self.finished: OrderedDict[str, str] = OrderedDict()
        self.finished_jobs: dict[str, str] = {}  # the job of each one in ``finished`` that had one
        self.keep_finished = keep_finished
        self.created = 0
        self.refused_not_durable = 0  # requests answered 503 by ``durable``

    def create(
        self, *, rollout_id: str | None = None, harness_final: bool = False, **started: Any
    ) -> OpenRollout:
        rid = rollout_id or str(ULID())
        if not ROLLOUT_ID.fullmatch(rid):  # match() would take a trailing newline
            raise ApiError(400, "rollout_id must match [A-Za-z0-9_-]{1,128}", param="rollout_id")
        if rid in self.open or rid in self.finished:
            raise ApiError(
                409, f"rollout {rid} already exists", code="rollout_exists", param="rollout_id"
            )
        if len(self.open) >= self.max_open:
            raise ApiError(
                503,
                f"the proxy holds {len(self.open)} open rollouts, its bound "
                "(proxy_max_open_rollouts): finish some, or retry later",
                code="too_many_open_rollouts",
                headers={"Retry-After": str(NOT_DURABLE_RETRY_S)},
            )
        self.durable()
        try:
            handle = self.recorder.rollout(
                rollout_id=rid, policy_version=self.pool.policy_version, **started
            )
        except RecorderUsageError as exc:  # a value past its bound (the message names it)
            raise ApiError(400, str(exc), code="invalid_value") from exc
        job_id = (started.get("metadata") or {}).get("job_id")
        ro = OpenRollout(handle, harness_final=harness_final, job_id=job_id or None)
        self.open[rid] = ro
        self.created += 1
        return ro

    def durable(self) -> None:
        """503 with Retry-After while the recorder would drop new events (Kafka unreachable and
        its spool missing, full or failing: ``Recorder.accepting``): the proxy takes no work
        whose events it would lose. Nothing accepted before is dropped by this."""
        if not self.recorder.accepting:
            self.refused_not_durable += 1
            raise ApiError(
                503,
                "events cannot be made durable now (Kafka is unreachable and the proxy's spool "
                f"is full or failing); retry in {NOT_DURABLE_RETRY_S} s",
                code="events_not_durable",
                headers={"Retry-After": str(NOT_DURABLE_RETRY_S)},
            )

    def room_for_a_call(self, ro: OpenRollout) -> None:
        """409 ``rollout_too_large`` once the rollout has made ``max_calls`` model calls or its
        context holds ``max_tokens`` tokens: what the proxy keeps of one rollout is bounded.
        Its rewards, tool calls and finish are still taken."""
        held = ro.handle.context.tokens_held
        if ro.calls >= self.max_calls or held >= self.max_tokens:
            raise ApiError(
                409,
                f"rollout {ro.rollout_id} has made {ro.calls} model calls holding {held} tokens;"
                f" one rollout may make {self.max_calls} calls (proxy_max_rollout_calls) and "
                f"hold {self.max_tokens} tokens (proxy_max_rollout_tokens): finish it",
                code="rollout_too_large",
            )

    def get(self, rollout_id: str) -> OpenRollout:
        """The open rollout a request writes to (404 unknown, 409 finished, 503 while events
        cannot be made durable)."""
        ro = self.open.get(rollout_id)
        if ro is not None:
            self.durable()
            ro.last_seen = time.monotonic()
            return ro
        if rollout_id in self.finished:
            status = self.finished[rollout_id]
            raise ApiError(
                409, f"rollout {rollout_id} is finished ({status})", code="rollout_finished"
            )
        raise ApiError(404, f"rollout {rollout_id} not found", code="rollout_not_found")

    def finish(
        self, rollout_id: str, status: RolloutStatus | str, error: str | None = None
    ) -> bool:
        ro = self.open.pop(rollout_id, None)
        if ro is None:
            return False
        ro.handle.finish(status, error)
        self.pool.release(rollout_id)
        self.finished[rollout_id] = str(status)
        if ro.job_id is not None:
            self.finished_jobs[rollout_id] = ro.job_id
        while len(self.finished) > self.keep_finished:
            gone, _ = self.finished.popitem(last=False)
            self.finished_jobs.pop(gone, None)
        return True

    def job_of(self, rollout_id: str) -> str | None:
        """The ``job_id`` an open or recently finished rollout was created with; None when it
        had none; 404 ``rollout_not_found`` when the proxy does not know it."""
        ro = self.open.get(rollout_id)
        if ro is not None:
            return ro.job_id
        if rollout_id in self.finished:
            return self.finished_jobs.get(rollout_id)
        raise ApiError(404, f"rollout {rollout_id} not found", code="rollout_not_found")

    def sweep(self, idle_s: float) -> int:
        """Finish (status timeout) the rollouts idle for longer than ``idle_s``."""
        now = time.monotonic()
        stale = [rid for rid, ro in self.open.items() if now - ro.last_seen > idle_s]
        for rid in stale:
            self.finish(rid, RolloutStatus.TIMEOUT, f"no request for {idle_s:g} s")
        return len(stale)

    def close(self, reason: str) -> int:
        """Finish every open rollout as aborted (the proxy is shutting down)."""
        ids = list(self.open)
        for rid in ids:
            self.finish(rid, RolloutStatus.ABORTED, reason)
        return len(ids)


# --------------------------------------------------------------------------- routes


def _str_dict(value: Any, param: str) -> dict[str, str]:
    """An object as a map of strings (values that are not strings as their JSON), within the
    metadata bounds (METADATA_MAX_KEYS, METADATA_MAX_CHARS of rollstream.schemas.events)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, f"`{param}` must be an object", param=param)
    out = {str(k): v if isinstance(v, str) else dumps(v).decode() for k, v in value.items()}
    problem = metadata_problem(out)
    if problem is not None:
        raise ApiError(400, f"`{param}` {problem}", param=param, code="invalid_value")
    return out


def _sampling(value: Any) -> dict[str, float]:
    """``sampling``: at most SAMPLING_MAX_KEYS names, each mapped to a number within
    +-SAFE_INT_MAX."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()
    ):
        raise ApiError(400, "`sampling` must map names to numbers", param="sampling")
    if len(value) > SAMPLING_MAX_KEYS:
        msg = f"`sampling` has {len(value)} entries, more than {SAMPLING_MAX_KEYS}"
        raise ApiError(400, msg, param="sampling", code="invalid_value")
    for key, v in value.items():
        if not -SAFE_INT_MAX <= v <= SAFE_INT_MAX:  # exact for ints of any size
            msg = f"`sampling.{key}` must be in [-{SAFE_INT_MAX}, {SAFE_INT_MAX}]"
            raise ApiError(400, msg, param=f"sampling.{key}", code="invalid_value")
    return {str(k): float(v) for k, v in value.items()}


def _opt_str(body: dict[str, Any], key: str, default: str | None = "") -> Any:
    value = body.get(key, default)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"`{key}` must be a string", param=key)
    return value


def _opt_int(body: dict[str, Any], key: str, default: int | None) -> Any:
    value = body.get(key, default)
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SAFE_INT_MAX
    ):
        msg = f"`{key}` must be an integer in [0, {SAFE_INT_MAX}]"
        raise ApiError(400, msg, param=key, code="invalid_value")
    return value


def _reward_value(value: Any) -> float | None:
    """A reward value as a float in [-REWARD_BOUND, REWARD_BOUND], else None (not a number, a
    bool, NaN, an infinity or larger: the stream processors would dead-letter it)."""
    return float(value) if reward_problem(value) is None else None


class RolloutApi:
    """Handlers of the rollout routes, over a registry, tokens and admin keys."""

    def __init__(self, rollouts: Rollouts, auth: Auth, *, public_url: str | None) -> None:
        self.rollouts, self.auth = rollouts, auth
        self.public_url = public_url.rstrip("/") if public_url else None

    async def create(self, request: HttpRequest) -> Answer:
        self.auth.admin(request.token)
        body = await request.json()
        task_id = body.get("task_id")
        if not isinstance(task_id, str) or not task_id:
            raise ApiError(400, "`task_id` is required (a non-empty string)", param="task_id")
        sampling = _sampling(body.get("sampling") or None)
        final_rewards = body.get("final_rewards", "evaluator")
        if final_rewards not in FINAL_REWARDS:
            msg = f"`final_rewards` must be one of {', '.join(map(repr, FINAL_REWARDS))}"
            raise ApiError(400, msg, param="final_rewards")
        ro = self.rollouts.create(
            harness_final=final_rewards == "harness",
            rollout_id=_opt_str(body, "rollout_id", None),
            task_id=task_id,
            group_id=_opt_str(body, "group_id", task_id) or task_id,
            attempt=_opt_int(body, "attempt", 0),
            harness=_opt_str(body, "harness"),
            group_size=_opt_int(body, "group_size", None),
            run_id=_opt_str(body, "run_id"),
            sampling=sampling,
            metadata=_str_dict(body.get("metadata"), "metadata"),
        )
        base = self.public_url or request.base_url.rstrip("/")
        rid = ro.rollout_id
        return json_answer({
            "rollout_id": rid, "task_id": task_id, "group_id": ro.handle.group_id,
            "base_url": f"{base}/rollouts/{rid}/v1", "token": self.auth.tokens.issue(rid),
            "policy_version": ro.handle.policy_version, "final_rewards": final_rewards,
        }, 201)  # fmt: skip

    def _open(self, request: HttpRequest, *, evaluator: bool = False) -> OpenRollout:
        if evaluator:
            return self.rollouts.get(self._evaluated(request))
        return self.rollouts.get(self.auth.rollout_of(request.token, request.path["rollout_id"]))

    def _evaluated(self, request: HttpRequest) -> str:
        """The rollout of an evaluator route (read, rewards, finish) on the URL's rollout id:
        the rollout token's own, any with an admin or evaluator key, a job token's job's."""
        rid = request.path["rollout_id"]
        job = self.auth.job_of(request.token)
        if job is None:
            return self.auth.rollout_of(request.token, rid, evaluator=True)
        self._of_job(job, rid)
        return rid

    def _of_job(self, job_id: str, rollout_id: str) -> None:
        """403 naming ``rollout_id`` unless the rollout was created for ``job_id`` (404 when the
        proxy does not know it)."""
        if self.rollouts.job_of(rollout_id) != job_id:
            raise ApiError(
                403,
                f"this token opens the rollouts of job {job_id}; rollout {rollout_id} is not one",
                code="forbidden",
                param="rollout_id",
            )

    async def get(self, request: HttpRequest) -> Answer:
        rid = self._evaluated(request)
        ro = self.rollouts.open.get(rid)
        if ro is None:
            if rid in self.rollouts.finished:
                return json_answer({"rollout_id": rid, "status": self.rollouts.finished[rid]})
            raise ApiError(404, f"rollout {rid} not found", code="rollout_not_found")
        m = ro.memory
        return json_answer({
            "rollout_id": rid, "status": "running", "task_id": ro.handle.task_id,
            "group_id": ro.handle.group_id, "events": ro.handle.seq, "calls": ro.calls,
            "errors": ro.errors, "backend": self.rollouts.pool.backend_of(rid),
            "drift_tokens": m.drift_tokens, "drift_replies": m.drift_replies,
            "reused_replies": m.reused_replies,
        })  # fmt: skip

    async def tool_calls(self, request: HttpRequest) -> Answer:
        """A tool the harness ran: {name, arguments, result, is_error, duration_ms, sandbox,
        at_call_id, tool_call_id}. A tool_call_id already recorded (posted here before, or sent
        as a chat tool message) is answered ``duplicate: true`` and not recorded again."""
        ro = self._open(request)
        body = await request.json()
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "`name` is required (a non-empty string)", param="name")
        arguments = body.get("arguments", "")
        if not isinstance(arguments, str | dict | list):
            msg = "`arguments` must be a string, an object or a list"
            raise ApiError(400, msg, param="arguments")
        result = body.get("result", "")
        duration = number(body, "duration_ms", 0.0, float)  # within +-SAFE_INT_MAX
        opt = {k: _opt_str(body, k, None) for k in ("sandbox", "at_call_id", "tool_call_id")}
        text = result if isinstance(result, str) else dumps(result).decode()
        tid = opt["tool_call_id"]
        if tid and not ro.memory.claim_tool_result(tid):  # recorded already (here or as a chat
            # tool message): one ToolCall per tool_call_id, however often it is reported
            return json_answer(
                {"rollout_id": ro.rollout_id, "tool_call_id": tid, "duplicate": True}
            )
        try:
            tid = ro.handle.tool_call(
                name, arguments, text, is_error=bool(body.get("is_error", False)),
                duration_ms=float(duration), **opt,
            )  # fmt: skip
        except RecorderUsageError as exc:
            raise ApiError(409, str(exc), code="rollout_finished") from exc
        return json_answer({"rollout_id": ro.rollout_id, "tool_call_id": tid})

    async def branches(self, request: HttpRequest) -> Answer:
        """An explicit branch point: {kind (retry | rewind | fork | subagent | summarize; fork),
        source_call_id, reason, branch_id}, recorded as a Branch event (``RolloutHandle.branch``)
        -> 201 {branch_id}. ``source_call_id`` must name a model call of this rollout (400
        naming it); the rollout's next call continuing that call's sequence is recorded under it
        (``ContextTrie.add``). A ``branch_id`` posted before is answered 200 ``duplicate: true``
        and not recorded again (a retried request)."""
        ro = self._open(request)
        body = await request.json()
        try:
            kind = BranchKind(_opt_str(body, "kind", BranchKind.FORK.value))
        except ValueError:
            kinds = ", ".join(k.value for k in BranchKind)
            raise ApiError(400, f"`kind` must be one of {kinds}", param="kind") from None
        source = _opt_str(body, "source_call_id", None)
        reason = _opt_str(body, "reason") or ""
        if len(reason) > MAX_BRANCH_REASON:
            msg = f"`reason` is longer than {MAX_BRANCH_REASON} characters"
            raise ApiError(400, msg, param="reason", code="invalid_value")
        branch_id = _opt_str(body, "branch_id", None)
        if branch_id is not None and not BRANCH_ID.fullmatch(branch_id):
            msg = "`branch_id` must match [A-Za-z0-9_-]{1,128}"
            raise ApiError(400, msg, param="branch_id", code="invalid_value")
        if ro.handle.finished:  # finished while the body was read
            raise ApiError(409, f"rollout {ro.rollout_id} is finished", code="rollout_finished")
        if source is not None and source not in ro.handle.context:
            shown = source if len(source) <= 64 else source[:64] + "..."
            msg = f"`source_call_id` {shown!r} is not a model call of rollout {ro.rollout_id}"
            raise ApiError(400, msg, param="source_call_id", code="unknown_call")
        if branch_id is not None and branch_id in ro.branch_ids:
            return json_answer(
                {"rollout_id": ro.rollout_id, "branch_id": branch_id, "duplicate": True}
            )
        if len(ro.branch_ids) >= MAX_BRANCHES:
            msg = f"rollout {ro.rollout_id} has {MAX_BRANCHES} branch points already"
            raise ApiError(409, msg, code="too_many_branches")
        try:
            branch_id = ro.handle.branch(
                kind, source_call_id=source, reason=reason, branch_id=branch_id
            )
        except RecorderUsageError as exc:
            raise ApiError(409, str(exc), code="rollout_finished") from exc
        ro.branch_ids.add(branch_id)
        answer = {"rollout_id": ro.rollout_id, "branch_id": branch_id, "kind": kind.value}
        return json_answer({**answer, "source_call_id": source}, 201)

    async def rewards(self, request: HttpRequest) -> Answer:
        ro = self._open(request, evaluator=True)
        body = await request.json()
        items = body.get("rewards", [body])
        if not isinstance(items, list) or not items:
            raise ApiError(400, "`rewards` must be a non-empty list", param="rewards")
        if len(items) > MAX_REWARDS:
            msg = f"`rewards` has {len(items)} items, more than {MAX_REWARDS}"
            raise ApiError(400, msg, param="rewards", code="invalid_value")
        parsed = []
        for i, item in enumerate(items):
            p = f"rewards[{i}]" if "rewards" in body else ""
            value = _reward_value(item.get("value") if isinstance(item, dict) else None)
            if value is None:
                raise ApiError(
                    400,
                    f"`value` must be a number in [-{REWARD_BOUND:g}, {REWARD_BOUND:g}]",
                    param=f"{p}.value".lstrip("."),
                )
            try:
                kind = RewardKind(item.get("kind", "final"))
            except ValueError:
                kinds = ", ".join(k.value for k in RewardKind)
                raise ApiError(
                    400, f"`kind` must be one of {kinds}", param=f"{p}.kind".lstrip(".")
                ) from None
            at_call_id = _opt_str(item, "at_call_id", None)
            names = _opt_str(item, "name"), _opt_str(item, "evaluator")
            parsed.append((value, kind, names[0], at_call_id, names[1]))
        harness = request.token is not None and self.auth.tokens.verify(request.token) is not None
        if harness and not ro.harness_final and any(x[1] is RewardKind.FINAL for x in parsed):
            i = next(i for i, x in enumerate(parsed) if x[1] is RewardKind.FINAL)
            msg = ("a final reward of this rollout is its evaluator's (the admin key): the "
                   "harness posts partial, milestone or penalty rewards; create the rollout with "
                   'final_rewards="harness" to let its harness score it')  # fmt: skip
            p = f"rewards[{i}].kind" if "rewards" in body else "kind"
            raise ApiError(403, msg, code="forbidden", param=p)
        ids = []
        for value, kind, name, at_call_id, evaluator in parsed:
            try:
                ids.append(
                    ro.handle.reward(
                        value, kind, name=name, at_call_id=at_call_id, evaluator=evaluator
                    )
                )
            except RecorderUsageError as exc:
                raise ApiError(409, str(exc), code="rollout_finished") from exc
        return json_answer({"rollout_id": ro.rollout_id, "recorded": len(ids), "event_ids": ids})

    async def events(self, request: HttpRequest) -> Answer:
        """Lifecycle facts (stage started/finished, sandbox ready/released, evaluator output)
        about an open rollout, recorded in order; only an evaluator or admin key, or the job
        token of the rollout's job, may post them."""
        token = request.token
        if token is not None and self.auth.tokens.verify(token) is not None:
            msg = "lifecycle events are posted with the admin key, not a rollout token"
            raise ApiError(403, msg, code="forbidden")
        rid = request.path["rollout_id"]
        job = self.auth.job_of(token)
        if job is None:
            self.auth.evaluator_or_admin(token)
        else:
            self._of_job(job, rid)
        bodies = parse_lifecycle(await request.json())
        ro = self.rollouts.get(rid)
        try:
            ids = ro.handle.lifecycle(bodies)
        except RecorderUsageError as exc:
            raise ApiError(409, str(exc), code="rollout_finished") from exc
        return json_answer({"rollout_id": rid, "recorded": len(ids), "event_ids": ids})

    async def finish(self, request: HttpRequest) -> Answer:
        rid = self._evaluated(request)
        body = await request.json()
        try:
            status = RolloutStatus(body.get("status", "completed"))
        except ValueError:
            kinds = ", ".join(s.value for s in RolloutStatus)
            raise ApiError(400, f"`status` must be one of {kinds}", param="status") from None
        error = _opt_str(body, "error", None)
        if rid in self.rollouts.finished:
            return json_answer(
                {"rollout_id": rid, "status": self.rollouts.finished[rid], "finished": False}
            )
        self.rollouts.get(rid)  # 404 when unknown
        self.rollouts.finish(rid, status, error)
        return json_answer({"rollout_id": rid, "status": status.value, "finished": True})
