"""The OpenAPI 3.1 document of the recording proxy (``GET /openapi.json``): every route, its
request body schema, its security (a rollout token, an admin key or a job evaluator token) and
its error answers."""

from __future__ import annotations

from typing import Any

from rollstream.producers.proxy.openai_wire import (
    BRANCH_ID_PATTERN,
    ERROR_TYPES,
    MAX_BRANCH_REASON,
    MAX_CHOICES,
    MAX_JSON_DEPTH,
    MAX_REWARDS,
    MAX_TOP_LOGPROBS,
)
from rollstream.schemas import REWARD_BOUND, BranchKind, RewardKind, RolloutStatus
from rollstream.schemas.events import (
    METADATA_MAX_KEYS,
    POLICY_VERSION_MAX,
    SAFE_INT_MAX,
    SAMPLING_MAX_KEYS,
    TOKEN_ID_MAX,
)

__all__ = ["OPENAPI"]


def _schema(required: str, **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": required.split(), "properties": props}


def _int(lo: int = -SAFE_INT_MAX, hi: int = SAFE_INT_MAX) -> dict[str, Any]:
    """An integer field and the bounds the proxy enforces (every int within +-2**53 - 1)."""
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float = -SAFE_INT_MAX, hi: float = SAFE_INT_MAX) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, "maximum": hi}


_ANY: dict[str, Any] = {}
_S, _B = {"type": "string"}, {"type": "boolean"}
_I, _N, _COUNT = _int(), _num(), _int(0)
_OBJ, _LIST = {"type": "object"}, {"type": "array", "items": {"type": "object"}}
_TOKENS = {"type": "array", "minItems": 1, "items": _int(0, TOKEN_ID_MAX)}  # uint32 token ids
_CHAT = _schema(
    "messages", model=_S, messages=_LIST, tools=_LIST, tool_choice=_ANY, stream=_B,
    stream_options=_OBJ, max_tokens=_int(1), max_completion_tokens=_int(1),
    temperature=_num(0, 2), top_p=_num(0, 1), seed=_I, n=_int(1, MAX_CHOICES), stop=_ANY,
    logprobs=_B, top_logprobs=_int(0, MAX_TOP_LOGPROBS), response_format=_OBJ,
    return_token_ids=_B,
)  # fmt: skip
_PROMPT = {"oneOf": [{**_S, "minLength": 1}, _TOKENS]}  # or a batch of one: [prompt]
_TEXT = _schema("prompt", model=_S, prompt={"oneOf": [*_PROMPT["oneOf"], {
                    "type": "array", "minItems": 1, "maxItems": 1, "items": _PROMPT}]},
                stream=_B, max_tokens=_int(1), temperature=_num(0, 2), top_p=_num(0, 1),
                seed=_I, return_token_ids=_B)  # fmt: skip
_MESSAGES = _schema(
    "messages max_tokens", model=_S, messages=_LIST, max_tokens=_int(1), system=_ANY,
    tools=_LIST, tool_choice=_OBJ, stream=_B, temperature=_num(0, 1), top_p=_num(0, 1),
    stop_sequences=_ANY, metadata=_OBJ, thinking=_OBJ, service_tier=_S,
)  # fmt: skip
_RESPONSES = _schema(
    "input", model=_S, input=_ANY, instructions=_S, tools=_LIST, tool_choice=_ANY, stream=_B,
    max_output_tokens=_int(1), temperature=_num(0, 2), top_p=_num(0, 1), store=_B,
    parallel_tool_calls=_B, metadata=_OBJ, reasoning=_OBJ, text=_OBJ, include=_ANY,
    truncation=_S, user=_S,
)  # fmt: skip
_ROLLOUT = _schema(
    "task_id", task_id=_S, group_id=_S, rollout_id=_S, attempt=_COUNT, harness=_S,
    group_size=_COUNT, run_id=_S, final_rewards={"enum": ["evaluator", "harness"]},
    sampling={"type": "object", "maxProperties": SAMPLING_MAX_KEYS, "additionalProperties": _N},
    metadata={"type": "object", "maxProperties": METADATA_MAX_KEYS},
)  # fmt: skip
_REWARD = _schema("value", value=_num(-REWARD_BOUND, REWARD_BOUND),
                  kind={"enum": [k.value for k in RewardKind]}, name=_S, at_call_id=_S,
                  evaluator=_S)  # fmt: skip
_REWARDS = {"oneOf": [_REWARD, _schema("rewards", rewards={
    "type": "array", "minItems": 1, "maxItems": MAX_REWARDS, "items": _REWARD})]}  # fmt: skip
_TOOL = _schema("name", name=_S, arguments=_ANY, result=_S, is_error=_B, duration_ms=_N,
                sandbox=_S, at_call_id=_S, tool_call_id=_S)  # fmt: skip
_BRANCH = _schema(
    "", kind={"enum": [k.value for k in BranchKind], "default": BranchKind.FORK.value},
    source_call_id={**_S, "description": "a model call of this rollout (its call_id)"},
    reason={**_S, "maxLength": MAX_BRANCH_REASON},
    branch_id={**_S, "pattern": BRANCH_ID_PATTERN},
)  # fmt: skip
_FINISH = _schema("", status={"enum": [s.value for s in RolloutStatus]}, error=_S)
_LIFECYCLE = _schema(
    "events",
    events={"type": "array", "items": _schema(
        "type", type={"enum": ["stage", "sandbox", "evaluator_output"]}, stage=_S, phase=_S,
        status=_S, duration_ms=_N, job_id=_S, worker=_S, reason=_S, sandbox_id=_S, kind=_S,
        evaluator=_S, passed=_I, total=_I, output=_S, output_truncated=_B,
    )},
)  # fmt: skip
_OTLP = _schema("", resourceSpans=_LIST)  # OTLP/JSON; protobuf: the same message
_WEIGHTS = _schema("path version", path=_S, version=_int(0, POLICY_VERSION_MAX),
                   mode={"enum": ["drain", "interrupt"]})  # fmt: skip
_JOB = _schema("tasks agent", job_id=_S, tasks=_OBJ, samples_per_task=_I, agent=_OBJ,
               sandbox=_OBJ, evaluator=_OBJ, timeouts=_OBJ, attempts=_I, run_id=_S,
               policy=_S)  # fmt: skip
# a rollout token's requests may be rate-limited (429); the admin key's are not
_CALL, _ROLL, _ADMIN = "400 401 403 404 409 413 429 502 503", "400 401 403 404 409 429", "401"

# the evaluator routes: a rollout's own token, an admin or evaluator key, or its job's token
_EVAL = "rolloutToken jobToken"
# (path, method, summary, security (alternatives), request body schema, error statuses)
_ROUTES: list[tuple[str, str, str, str | None, dict[str, Any] | None, str]] = [
    ("/rollouts/{rollout_id}/v1/chat/completions", "post", "chat completion, recorded",
     "rolloutToken", _CHAT, _CALL),
    ("/rollouts/{rollout_id}/v1/completions", "post", "text completion (text or token ids)",
     "rolloutToken", _TEXT, _CALL),
    ("/rollouts/{rollout_id}/v1/messages", "post",
     "Anthropic Messages call, recorded (token as bearer or x-api-key; Anthropic error objects)",
     "rolloutToken", _MESSAGES, _CALL),
    ("/rollouts/{rollout_id}/v1/responses", "post",
     "OpenAI Responses call, recorded (nothing stored: no previous_response_id)",
     "rolloutToken", _RESPONSES, _CALL),
    ("/rollouts/{rollout_id}/v1/models", "get", "the served model", "rolloutToken", None, _ROLL),
    ("/v1/chat/completions", "post", "chat completion; the token names the rollout",
     "rolloutToken", _CHAT, _CALL),
    ("/v1/completions", "post", "text completion; the token names the rollout", "rolloutToken",
     _TEXT, _CALL),
    ("/v1/messages", "post", "Anthropic Messages call; the token names the rollout",
     "rolloutToken", _MESSAGES, _CALL),
    ("/v1/responses", "post", "OpenAI Responses call; the token names the rollout",
     "rolloutToken", _RESPONSES, _CALL),
    ("/v1/models", "get", "the served model", None, None, ""),
    ("/v1/rollouts", "post", "create a rollout -> base_url + token", "adminKey", _ROLLOUT,
     "400 401 409"),
    ("/v1/rollouts/{rollout_id}", "get", "rollout status", _EVAL, None, _ROLL),
    ("/v1/rollouts/{rollout_id}/rewards", "post", "record rewards", _EVAL, _REWARDS, _ROLL),
    ("/v1/rollouts/{rollout_id}/tool_calls", "post", "record a tool call the harness ran",
     "rolloutToken", _TOOL, _ROLL),
    ("/v1/rollouts/{rollout_id}/branches", "post",
     "record an explicit branch point (201 {branch_id}); the next call continuing "
     "source_call_id is recorded under it", "rolloutToken", _BRANCH, _ROLL),
    ("/v1/rollouts/{rollout_id}/finish", "post", "finish a rollout", _EVAL, _FINISH, _ROLL),
    ("/v1/rollouts/{rollout_id}/events", "post",
     "record lifecycle facts (stage, sandbox, evaluator output)", "adminKey jobToken",
     _LIFECYCLE, "400 401 403 404 409"),
    ("/v1/traces", "post",
     "OTLP/HTTP trace export (ExportTraceServiceRequest, application/x-protobuf or "
     "application/json): GenAI spans become rollout events", "adminKey", _OTLP,
     "400 401 413 415"),
    ("/v1/jobs", "post", "queue a rollout job (202 {job_id, rollouts, topic})", "adminKey",
     _JOB, "400 401 409 413 503"),
    ("/v1/jobs", "get", "the submitted jobs", "adminKey", None, "401 503"),
    ("/v1/jobs/{job_id}", "get", "where a job stands: stages, rollouts, totals", "adminKey",
     None, "400 401 404 503"),
    ("/v1/jobs/{job_id}/evaluator-token", "post",
     "the job's evaluator token {job_id, token} (admin or evaluator key): it scores, finishes, "
     "reads and posts lifecycle events of that job's rollouts only", "adminKey", None,
     "400 401"),
    ("/v1/admin/pause", "post", "hold new model calls (?drain=true also waits for in-flight)",
     "adminKey", None, _ADMIN),
    ("/v1/admin/drain", "post", "wait for in-flight calls (?timeout=seconds)", "adminKey", None,
     _ADMIN),
    ("/v1/admin/resume", "post", "serve again", "adminKey", None, _ADMIN),
    ("/v1/admin/update_weights", "post",
     "pause, drain (or cut the generations in flight: mode interrupt), reload, resume",
     "adminKey", _WEIGHTS, "400 401 503"),
    ("/v1/admin/status", "get", "backends, pool and delivery counters", "adminKey", None, _ADMIN),
    ("/health", "get", "ok while a backend is healthy, 503 (degraded) while none is", None, None,
     "503"),
    ("/openapi.json", "get", "this document", None, None, ""),
]  # fmt: skip


_PATH_PARAMS = {
    "rollout_id": {"type": "string", "minLength": 1},
    "job_id": {"type": "string", "minLength": 1, "maxLength": 40, "pattern": "^[A-Za-z0-9_-]+$"},
}


def _openapi() -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for path, method, summary, security, body, codes in _ROUTES:
        anthropic = path.endswith("/v1/messages")  # Anthropic's error objects, x-api-key too
        ref = "#/components/schemas/" + ("AnthropicError" if anthropic else "Error")
        error = {"content": {"application/json": {"schema": {"$ref": ref}}}}
        op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "ok"}}}
        for code in codes.split():
            op["responses"][code] = {"description": ERROR_TYPES[int(code)], **error}
        names = [name for name in _PATH_PARAMS if "{" + name + "}" in path]
        if names:
            op["parameters"] = [
                {"name": n, "in": "path", "required": True, "schema": _PATH_PARAMS[n]}
                for n in names
            ]
        if body is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": body}},
            }
        if security:
            alternatives: list[dict[str, Any]] = [{n: []} for n in security.split()]
            op["security"] = [*alternatives, {"rolloutKey": []}] if anthropic else alternatives
        paths.setdefault(path, {})[method] = op
    err_fields = {"message": _S, "type": _S, "param": {"type": ["string", "null"]},
                  "code": {"type": ["string", "null"]}}  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "rollstream recording proxy",
            "version": "1",
            "description": (
                "Every bound stated here is enforced (a 400 whose `param` names the field). "
                f"A request body nests objects and arrays at most {MAX_JSON_DEPTH} levels deep; "
                "integers are within +-(2**53 - 1); policy versions are in "
                f"[0, {POLICY_VERSION_MAX}], token ids in [0, {TOKEN_ID_MAX}], reward values in "
                f"[-{REWARD_BOUND:g}, {REWARD_BOUND:g}]."
            ),
        },
        "paths": paths,
        "components": {
            "securitySchemes": {
                "rolloutToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "rs1.<rollout_id>.<signature>",
                },
                "adminKey": {"type": "http", "scheme": "bearer"},
                "jobToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "rs1j.<job_id>.<signature>: opens the evaluator routes of "
                    "the rollouts created with that job_id in their metadata",
                },
                "rolloutKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
            "schemas": {
                "Error": _schema("error", error=_schema("message type", **err_fields)),
                "AnthropicError": _schema(
                    "type error",
                    type={"const": "error"},
                    error=_schema("type message", type=_S, message=_S),
                ),
            },
        },
    }


OPENAPI: dict[str, Any] = _openapi()
