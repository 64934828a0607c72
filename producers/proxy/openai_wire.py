"""The OpenAI HTTP surface of the recording proxy: JSON bodies, error objects, request
validation, response and SSE shapes, and the OpenAPI document (no state; used by proxy.py and
rollout_api.py).

Errors are answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status (400 invalid, 401 no or bad token, 403 another rollout's token, 404 unknown rollout,
409 finished rollout, 413 body or token budget exceeded, 429 paused (Retry-After), 502 backend
answered garbage, 503 no backend).

    ProducerError                    root of rollstream.producers (context.py)
    └── ProxyError                   root of the proxy's errors
        └── ApiError                 an HTTP error answer: status, OpenAI error type/code, param
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from rollstream.producers.proxy.chat import AssistantReply, ChatTemplate
from rollstream.producers.sdk.context import ProducerError
from rollstream.schemas import RewardKind, RolloutStatus

try:
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    loads: Callable[[bytes], Any] = orjson.loads
    JSONDecodeError: type[Exception] = orjson.JSONDecodeError
except ImportError:  # pragma: no cover - orjson is optional
    import json

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()

    loads = json.loads
    JSONDecodeError = ValueError

__all__ = [
    "FINISH_REASONS",
    "OPENAPI",
    "ApiError",
    "CallParams",
    "ProxyError",
    "bearer",
    "bearer_token",
    "chat_chunks",
    "dumps",
    "error_body",
    "error_response",
    "flag",
    "json_response",
    "loads",
    "number",
    "parse_call",
    "parse_json",
    "read_json",
    "sse",
    "sse_body",
    "text_chunks",
    "too_large",
    "usage",
]

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 409: "conflict_error", 413: "request_too_large",
    429: "rate_limit_error", 502: "backend_error", 503: "service_unavailable",
}  # fmt: skip


class ProxyError(ProducerError):
    """Root of the recording proxy's errors."""


class ApiError(ProxyError):
    """An error answered to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(data), status, headers, media_type="application/json")


def error_body(exc: ApiError) -> bytes:
    """The JSON error object of ``exc`` (its status and headers are the caller's to send)."""
    kind = _ERROR_TYPES.get(
        exc.status, "server_error" if exc.status >= 500 else "invalid_request_error"
    )
    return dumps(
        {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code}}
    )


def error_response(exc: ApiError) -> Response:
    return Response(error_body(exc), exc.status, exc.headers, media_type="application/json")


def too_large(declared: str | bytes | None, limit: int) -> None:
    """413 when a declared Content-Length is over ``limit``."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object (empty: ``{}``); 400 if it is not one."""
    try:
        data = loads(raw or b"{}")
    except JSONDecodeError as exc:
        raise ApiError(400, f"invalid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_body")
    return data


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object: 413 past ``limit`` bytes, 400 if not a JSON object."""
    too_large(request.headers.get("content-length"), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


def bearer_token(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, else None."""
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def bearer(request: Request) -> str | None:
    return bearer_token(request.headers.get("authorization"))


# --------------------------------------------------------------------------- requests


def number(
    body: dict[str, Any], key: str, default: Any, kind: type = int,
    lo: float | None = None, hi: float | None = None,
) -> Any:  # fmt: skip
    """``body[key]`` as an int (a float with ``kind=float``) in [lo, hi]; 400 otherwise."""
    value = body.get(key)
    if value is None:
        return default
    ok = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        word = "an integer" if kind is int else "a number"
        raise ApiError(400, f"`{key}` must be {word}", param=key, code="invalid_value")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ApiError(400, f"`{key}` must be in [{lo}, {hi}]", param=key, code="invalid_value")
    return kind(value)


def flag(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"`{key}` must be a boolean", param=key, code="invalid_value")
    return value


@dataclass(frozen=True, slots=True)
class CallParams:
    """The validated, endpoint-independent part of a completion request."""

    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: the endpoint's default, capped by the room left
    sampling: dict[str, Any]  # temperature, top_p, seed, stop_token_ids
    logprobs: bool
    return_token_ids: bool  # vLLM's extension: answer the prompt and completion token ids


def parse_call(body: dict[str, Any], chat: ChatTemplate) -> CallParams:
    """Sampling and output options shared by /chat/completions and /completions. Unsupported
    options that would change the result (n > 1, penalties, top_logprobs, echo, multi-token
    stop strings) are refused with 400 rather than ignored."""
    if number(body, "n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n", code="unsupported")
    for key in ("presence_penalty", "frequency_penalty"):
        if number(body, key, 0.0, float):
            raise ApiError(400, f"`{key}` is not supported", param=key, code="unsupported")
    if body.get("top_logprobs"):
        raise ApiError(400, "`top_logprobs` is not supported", param="top_logprobs")
    if body.get("echo") or body.get("best_of", 1) not in (1, None):
        raise ApiError(400, "`echo` and `best_of` are not supported", code="unsupported")
    max_tokens = number(body, "max_completion_tokens", None, lo=1)
    max_tokens = number(body, "max_tokens", max_tokens, lo=1)
    sampling: dict[str, Any] = {
        "temperature": number(body, "temperature", 1.0, float, 0, 2),
        "top_p": number(body, "top_p", 1.0, float, 0, 1) or 1.0,
    }
    if body.get("seed") is not None:
        sampling["seed"] = number(body, "seed", None)
    stop = body.get("stop")
    if stop:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ApiError(400, "`stop` must be a string or a list of strings", param="stop")
        ids = [chat.encode(s) for s in stops]
        if any(len(i) != 1 for i in ids):
            msg = "`stop` strings must each be one token here (the backend stops on token ids)"
            raise ApiError(400, msg, param="stop", code="unsupported")
        sampling["stop_token_ids"] = [int(i[0]) for i in ids]
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "`stream_options` must be an object", param="stream_options")
    return CallParams(
        stream=flag(body, "stream"),
        include_usage=bool((opts or {}).get("include_usage")),
        max_tokens=max_tokens,
        sampling=sampling,
        logprobs=bool(body.get("logprobs")),
        return_token_ids=flag(body, "return_token_ids"),
    )


# --------------------------------------------------------------------------- responses

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop"}


def usage(prompt_len: int, completion_len: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_len, "completion_tokens": completion_len,
            "total_tokens": prompt_len + completion_len}  # fmt: skip


def sse_body(chunks: list[dict[str, Any]]) -> bytes:
    """A complete server-sent-events body: one ``data:`` line per chunk, then [DONE]."""
    return b"".join(b"data: " + dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def sse(chunks: list[dict[str, Any]]) -> Response:
    """A complete server-sent-events answer (``sse_body``)."""
    return Response(
        sse_body(chunks), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def chat_chunks(
    head: dict[str, Any], reply: AssistantReply, finish: str, use: dict[str, int] | None,
    logprobs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """chat.completion.chunk objects for a whole reply: role, content, tool calls, finish, and
    the usage chunk when ``use`` is given (``stream_options.include_usage``)."""
    base = {**head, "object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], fin: str | None = None, lp: Any = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                                     "finish_reason": fin}]}  # fmt: skip

    chunks = [chunk({"role": "assistant", "content": ""})]
    if reply.content:
        chunks.append(chunk({"content": reply.content}, lp=logprobs))
    if reply.tool_calls:
        calls = [{"index": i, **tc} for i, tc in enumerate(reply.tool_calls)]
        chunks.append(chunk({"tool_calls": calls}))
    chunks.append(chunk({}, finish))
    if use is not None:
        chunks.append({**base, "choices": [], "usage": use})
    return chunks


def text_chunks(
    head: dict[str, Any], text: str, finish: str, use: dict[str, int] | None
) -> list[dict[str, Any]]:
    """text_completion chunks for a whole completion (+ usage when ``use`` is given)."""

    def chunk(t: str, fin: str | None) -> dict[str, Any]:
        return {
            **head,
            "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": fin}],
        }

    chunks = [chunk(text, None), chunk("", finish)]
    if use is not None:
        chunks.append({**head, "choices": [], "usage": use})
    return chunks


# --------------------------------------------------------------------------- OpenAPI


def _schema(required: str, **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": required.split(), "properties": props}


_ANY: dict[str, Any] = {}
_S, _I, _N, _B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
_OBJ, _LIST = {"type": "object"}, {"type": "array", "items": {"type": "object"}}
_CHAT = _schema(
    "messages", model=_S, messages=_LIST, tools=_LIST, tool_choice=_ANY, stream=_B,
    stream_options=_OBJ, max_tokens=_I, max_completion_tokens=_I, temperature=_N, top_p=_N,
    seed=_I, n={"enum": [1]}, stop=_ANY, logprobs=_B, return_token_ids=_B,
)  # fmt: skip
_TEXT = _schema("prompt", model=_S, prompt=_ANY, stream=_B, max_tokens=_I, temperature=_N,
                top_p=_N, seed=_I, return_token_ids=_B)  # fmt: skip
_ROLLOUT = _schema(
    "task_id", task_id=_S, group_id=_S, rollout_id=_S, attempt=_I, harness=_S, group_size=_I,
    run_id=_S, sampling=_OBJ, metadata=_OBJ,
)  # fmt: skip
_REWARD = _schema("value", value=_N, kind={"enum": [k.value for k in RewardKind]}, name=_S,
                  at_call_id=_S, evaluator=_S)  # fmt: skip
_REWARDS = {"oneOf": [_REWARD, _schema("rewards", rewards={"type": "array", "items": _REWARD})]}
_TOOL = _schema("name", name=_S, arguments=_ANY, result=_S, is_error=_B, duration_ms=_N,
                sandbox=_S, at_call_id=_S, tool_call_id=_S)  # fmt: skip
_FINISH = _schema("", status={"enum": [s.value for s in RolloutStatus]}, error=_S)
_WEIGHTS = _schema("path version", path=_S, version=_I)
_CALL, _ROLL, _ADMIN = "400 401 403 404 409 413 429 502 503", "400 401 403 404 409", "401"

# (path, method, summary, security, request body schema, error statuses)
_ROUTES: list[tuple[str, str, str, str | None, dict[str, Any] | None, str]] = [
    ("/rollouts/{rollout_id}/v1/chat/completions", "post", "chat completion, recorded",
     "rolloutToken", _CHAT, _CALL),
    ("/rollouts/{rollout_id}/v1/completions", "post", "text completion (text or token ids)",
     "rolloutToken", _TEXT, _CALL),
    ("/rollouts/{rollout_id}/v1/models", "get", "the served model", "rolloutToken", None, _ROLL),
    ("/v1/chat/completions", "post", "chat completion; the token names the rollout",
     "rolloutToken", _CHAT, _CALL),
    ("/v1/completions", "post", "text completion; the token names the rollout", "rolloutToken",
     _TEXT, _CALL),
    ("/v1/models", "get", "the served model", None, None, ""),
    ("/v1/rollouts", "post", "create a rollout -> base_url + token", "adminKey", _ROLLOUT,
     "400 401 409"),
    ("/v1/rollouts/{rollout_id}", "get", "rollout status", "rolloutToken", None, _ROLL),
    ("/v1/rollouts/{rollout_id}/rewards", "post", "record rewards", "rolloutToken", _REWARDS,
     _ROLL),
    ("/v1/rollouts/{rollout_id}/tool_calls", "post", "record a tool call the harness ran",
     "rolloutToken", _TOOL, _ROLL),
    ("/v1/rollouts/{rollout_id}/finish", "post", "finish a rollout", "rolloutToken", _FINISH,
     _ROLL),
    ("/v1/admin/pause", "post", "hold new model calls (?drain=true also waits for in-flight)",
     "adminKey", None, _ADMIN),
    ("/v1/admin/drain", "post", "wait for in-flight calls (?timeout=seconds)", "adminKey", None,
     _ADMIN),
    ("/v1/admin/resume", "post", "serve again", "adminKey", None, _ADMIN),
    ("/v1/admin/update_weights", "post", "pause, drain, reload every backend, resume",
     "adminKey", _WEIGHTS, "400 401 503"),
    ("/v1/admin/status", "get", "backends, pool and delivery counters", "adminKey", None, _ADMIN),
    ("/health", "get", "liveness", None, None, ""),
    ("/openapi.json", "get", "this document", None, None, ""),
]  # fmt: skip


def _openapi() -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    paths: dict[str, Any] = {}
    for path, method, summary, security, body, codes in _ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "ok"}}}
        for code in codes.split():
            op["responses"][code] = {"description": _ERROR_TYPES[int(code)], **error}
        if body is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": body}},
            }
        if security:
            op["security"] = [{security: []}]
        paths.setdefault(path, {})[method] = op
    err_fields = {"message": _S, "type": _S, "param": {"type": ["string", "null"]},
                  "code": {"type": ["string", "null"]}}  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": "rollstream recording proxy", "version": "1"},
        "paths": paths,
        "components": {
            "securitySchemes": {
                "rolloutToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "rs1.<rollout_id>.<signature>",
                },
                "adminKey": {"type": "http", "scheme": "bearer"},
            },
            "schemas": {"Error": _schema("error", error=_schema("message type", **err_fields))},
        },
    }


OPENAPI: dict[str, Any] = _openapi()
