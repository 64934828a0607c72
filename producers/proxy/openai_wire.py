"""The OpenAI HTTP surface of the recording proxy, with no HTTP framework and no state: request
parsing (step 1 of a model call), answers (its last step) and error objects. The service
(service.py) calls it; the ASGI app (app.py) only moves bytes. The OpenAPI document of the
routes is openapi.py.

Chat options beyond sampling: ``n`` (1..16) choices, each its own backend sample;
``logprobs`` with ``top_logprobs`` (0..20) alternatives per token; ``tool_choice`` ("none",
"auto", "required" or one named function; no constrained decoding, so a reply that misses a
required tool call is answered as sampled, with ``tool_choice_met: false`` on the choice);
``response_format`` (``text``; ``json_object`` / ``json_schema`` only where every backend
decodes under a grammar: the service refuses them otherwise, never ignores them).

    parse_chat_request(body) -> ChatRequest        validated options; messages left to chat.py
    parse_text_request(body) -> TextRequest
    chat_answer(...) / text_answer(...) -> Answer   JSON or the complete SSE sequence
    error_answer(exc) -> Answer                     {"error": {message, type, param, code}}

Errors are answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status (400 invalid, 401 no or bad token, 403 another rollout's token, 404 unknown rollout,
409 finished rollout, 413 body or token budget exceeded, 429 paused (Retry-After), 502 backend
answered garbage, 503 no backend). ApiError and its place in the tree: producers/errors.py.
"""

from __future__ import annotations

import json as _json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rollstream.adapters.auth import bearer_token
from rollstream.producers.errors import ApiError, ChatError, ChatInputError, ProxyError
from rollstream.schemas.events import SAFE_INT_MAX, TOKEN_ID_MAX

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
    "BRANCH_ID_PATTERN",
    "ERROR_TYPES",
    "FINISH_REASONS",
    "MAX_BRANCHES",
    "MAX_BRANCH_REASON",
    "MAX_CHOICES",
    "MAX_JSON_DEPTH",
    "MAX_REWARDS",
    "MAX_TOP_LOGPROBS",
    "Answer",
    "ApiError",
    "CallParams",
    "ChatChoice",
    "ChatRequest",
    "HttpRequest",
    "ProxyError",
    "SseTemplate",
    "TextRequest",
    "as_api_error",
    "bearer_token",
    "chat_answer",
    "chat_chunk",
    "chat_chunks",
    "chat_logprobs",
    "dumps",
    "error_answer",
    "error_body",
    "flag",
    "json_answer",
    "json_text",
    "loads",
    "number",
    "parse_chat_request",
    "parse_json",
    "parse_text_request",
    "sse_body",
    "stream_logprobs",
    "text_answer",
    "text_chunks",
    "too_deep",
    "too_large",
    "usage",
]

# the OpenAI error type of each status an answer may have
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 409: "conflict_error", 413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error", 502: "backend_error", 503: "service_unavailable",
}  # fmt: skip


# --------------------------------------------------------------------------- HTTP in and out


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """What a route handler sees of an HTTP request, whatever server carries it: the bearer
    token, the URL's path parameters and query, the base URL, and the body read on demand (so a
    handler checks the token before the body is read: 401 comes before 413)."""

    token: str | None
    path: Mapping[str, str]
    query: Mapping[str, str]
    base_url: str
    read_json: Callable[[], Awaitable[dict[str, Any]]]
    read_bytes: Callable[[], Awaitable[bytes]] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)  # names in lower case

    async def json(self) -> dict[str, Any]:
        """The body as a JSON object (413 past the body limit, 400 if not a JSON object)."""
        return await self.read_json()

    async def body(self) -> bytes:
        """The body as it came (413 past the body limit)."""
        return b"" if self.read_bytes is None else await self.read_bytes()


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP answer: a JSON body (``sse``: a complete server-sent-events body), its status
    and extra headers. ``stream``: a server-sent-events body sent part by part as the parts
    come (``body`` is then empty); the server closes it when the client hangs up."""

    body: bytes
    status: int = 200
    sse: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    stream: AsyncIterator[bytes] | None = None


def json_answer(data: Any, status: int = 200) -> Answer:
    return Answer(dumps(data), status)


def error_body(exc: ApiError) -> bytes:
    """The JSON error object of ``exc`` (its status and headers are the caller's to send)."""
    kind = ERROR_TYPES.get(
        exc.status, "server_error" if exc.status >= 500 else "invalid_request_error"
    )
    return dumps(
        {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code}}
    )


def error_answer(exc: ApiError) -> Answer:
    return Answer(error_body(exc), exc.status, headers=exc.headers)


def as_api_error(exc: Exception) -> ApiError:
    """The error answer for an exception a handler raised: ApiError as it is, a chat input
    error as a 400 (its param and code), anything else a 500 with the reason (the caller logs
    it), never a dropped connection."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ChatInputError):
        return ApiError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, ChatError):
        return ApiError(400, str(exc))
    return ApiError(500, f"{type(exc).__name__}: {exc}", code="internal")


def too_large(declared: str | bytes | None, limit: int) -> None:
    """413 when a declared Content-Length is over ``limit``."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")


# how deep objects and arrays may nest in a request body (its top-level object counts as 1) and
# in the JSON texts a request or a reply carries (tool call arguments): far past what any API's
# body needs (a chat body with tool schemas: about 10), and far inside what the JSON libraries
# themselves stop at (orjson writes 254 levels, Python's json recurses about 1,000 deep), so a
# hostile body is a 400 here and never an encoder's error (a 500) where the value is used
MAX_JSON_DEPTH = 32


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether objects and arrays nest more than ``limit`` levels in ``value`` (a scalar: 0,
    ``{}``: 1). Level by level, without recursion, however deep ``value`` is; plain dicts and
    lists only (what a JSON parser makes)."""
    level = [value] if type(value) is dict or type(value) is list else []
    for _ in range(limit):
        if not level:
            return False
        deeper: list[Any] = []
        for item in level:
            children = item.values() if type(item) is dict else item
            deeper += [c for c in children if type(c) is dict or type(c) is list]
        level = deeper
    return bool(level)


def json_text(text: str | bytes) -> Any:
    """A JSON text (tool call arguments) parsed, as Python's json parses it; ValueError when it
    is not JSON or nests deeper than MAX_JSON_DEPTH (never a RecursionError)."""
    try:
        value = _json.loads(text)
    except RecursionError as exc:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from exc
    if too_deep(value):
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object (empty: ``{}``); 400 if it is not one, or if a field
    nests objects and arrays deeper than MAX_JSON_DEPTH (``param`` names the field)."""
    try:
        data = loads(raw or b"{}")
    except JSONDecodeError as exc:
        raise ApiError(400, f"invalid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_body")
    for key, value in data.items():
        if too_deep(value, MAX_JSON_DEPTH - 1):
            msg = f"`{key}` nests objects and arrays deeper than {MAX_JSON_DEPTH} levels"
            raise ApiError(400, msg, param=key, code="invalid_value")
    return data


# --------------------------------------------------------------------------- requests


def number(
    body: dict[str, Any], key: str, default: Any, kind: type = int,
    lo: float | None = None, hi: float | None = None,
) -> Any:  # fmt: skip
    """``body[key]`` as an int (a float with ``kind=float``) in [lo, hi]; 400 otherwise. An int
    is always within +-SAFE_INT_MAX (2**53 - 1: what JSON readers read back exactly, inside
    the Avro long), a float always finite, whatever ``lo`` and ``hi`` say."""
    value = body.get(key)
    if value is None:
        return default
    ok = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        word = "an integer" if kind is int else "a number"
        raise ApiError(400, f"`{key}` must be {word}", param=key, code="invalid_value")
    low = -SAFE_INT_MAX if lo is None else lo
    high = SAFE_INT_MAX if hi is None else hi
    if not low <= value <= high:  # exact for ints of any size: no float conversion
        raise ApiError(400, f"`{key}` must be in [{low}, {high}]", param=key, code="invalid_value")
    return kind(value)


def flag(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"`{key}` must be a boolean", param=key, code="invalid_value")
    return value


MAX_CHOICES = 16  # n of one chat request: that many backend samples of one prompt
MAX_TOP_LOGPROBS = 20  # OpenAI's and vLLM's limit
MAX_REWARDS = 1_000  # rewards in one POST /v1/rollouts/{id}/rewards
MAX_BRANCHES = 1_000  # branch points of one rollout (POST /v1/rollouts/{id}/branches)
MAX_BRANCH_REASON = 4_096  # characters of a branch point's reason
BRANCH_ID_PATTERN = r"^[A-Za-z0-9_\-]{1,128}$"  # a branch_id the harness names
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


@dataclass(frozen=True, slots=True)
class CallParams:
    """The validated, endpoint-independent part of a completion request."""

    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: the endpoint's default, capped by the room left
    sampling: dict[str, Any]  # temperature, top_p, seed
    stop: tuple[str, ...]  # stop strings; the chat step turns them into token ids
    logprobs: bool
    return_token_ids: bool  # vLLM's extension: answer the prompt and completion token ids
    n: int = 1  # choices (chat only): n backend samples of the same prompt
    top_logprobs: int = 0  # alternatives per generated token (chat, with logprobs)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A /chat/completions request, options validated. ``messages`` and ``tools`` are as sent:
    normalizing them is the chat step's (chat.py), with the template at hand.
    ``response_format`` is None for plain text, else the object as sent (json_object or
    json_schema), for a backend that decodes under a grammar."""

    messages: Any
    tools: Any
    tool_choice: Any
    add_generation_prompt: bool
    params: CallParams
    response_format: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class TextRequest:
    """A /completions request: one prompt, a non-empty string or a list of token ids."""

    prompt: str | list[int]
    params: CallParams


def _call_params(body: dict[str, Any], *, chat: bool = False) -> CallParams:
    """Sampling and output options shared by /chat/completions and /completions. Unsupported
    options that would change the result (penalties, echo, best_of; on /completions n > 1 and
    top_logprobs) are refused with 400 rather than ignored."""
    n = number(body, "n", 1, lo=1, hi=MAX_CHOICES)
    if n > 1 and not chat:
        raise ApiError(400, "only n=1 is supported on /completions", param="n", code="unsupported")
    for key in ("presence_penalty", "frequency_penalty"):
        if number(body, key, 0.0, float):
            raise ApiError(400, f"`{key}` is not supported", param=key, code="unsupported")
    top_logprobs = 0
    if chat:
        top_logprobs = number(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
        if top_logprobs and not body.get("logprobs"):
            msg = "`top_logprobs` needs `logprobs: true`"
            raise ApiError(400, msg, param="top_logprobs", code="invalid_value")
    elif body.get("top_logprobs"):
        msg = "`top_logprobs` is not supported on /completions"
        raise ApiError(400, msg, param="top_logprobs", code="unsupported")
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
    stops: tuple[str, ...] = ()
    if stop:
        raw = [stop] if isinstance(stop, str) else stop
        if not isinstance(raw, list) or not all(isinstance(s, str) and s for s in raw):
            raise ApiError(400, "`stop` must be a string or a list of strings", param="stop")
        stops = tuple(raw)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "`stream_options` must be an object", param="stream_options")
    return CallParams(
        stream=flag(body, "stream"),
        include_usage=bool((opts or {}).get("include_usage")),
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stops,
        logprobs=bool(body.get("logprobs")),
        return_token_ids=flag(body, "return_token_ids"),
        n=n,
        top_logprobs=top_logprobs,
    )


def _tool_choice(raw: Any) -> Any:
    """``tool_choice`` checked: None, "none", "auto", "required" or ``{"type": "function",
    "function": {"name": str}}`` (whether the name is one of the tools is the chat step's)."""
    if raw is None or raw in ("none", "auto", "required"):
        return raw
    fn = raw.get("function") if isinstance(raw, dict) else None
    if (
        isinstance(fn, dict)
        and raw.get("type", "function") == "function"
        and isinstance(fn.get("name"), str)
        and fn["name"]
    ):
        return raw
    msg = (
        '`tool_choice` must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}'
    )
    raise ApiError(400, msg, param="tool_choice", code="invalid_value")


def _response_format(raw: Any) -> dict[str, Any] | None:
    """``response_format`` checked: None for text, else a json_object or json_schema object."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in RESPONSE_FORMATS:
        msg = "`response_format.type` must be one of " + ", ".join(RESPONSE_FORMATS)
        raise ApiError(400, msg, param="response_format", code="invalid_value")
    if kind == "text":
        return None
    if kind == "json_schema" and not isinstance(raw.get("json_schema"), dict):
        msg = "`response_format.json_schema` must be an object"
        raise ApiError(400, msg, param="response_format", code="invalid_value")
    return dict(raw)


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """Step 1 of a chat call: the request's options, validated (400 on a bad one)."""
    params = _call_params(body, chat=True)
    return ChatRequest(
        messages=body.get("messages"),
        tools=body.get("tools"),
        tool_choice=_tool_choice(body.get("tool_choice")),
        add_generation_prompt=flag(body, "add_generation_prompt", True),
        params=params,
        response_format=_response_format(body.get("response_format")),
    )


def parse_text_request(body: dict[str, Any]) -> TextRequest:
    """Step 1 of a text completion: the prompt (one) and the options, validated."""
    raw: Any = body.get("prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]  # a batch of one prompt
    if not (isinstance(raw, str) and raw) and not (
        isinstance(raw, list) and raw and all(type(t) is int for t in raw)
    ):
        msg = "`prompt` must be a non-empty string or list of token ids (one prompt)"
        raise ApiError(400, msg, param="prompt")
    if isinstance(raw, list) and not all(0 <= t <= TOKEN_ID_MAX for t in raw):
        msg = f"`prompt` token ids must be in [0, {TOKEN_ID_MAX}] (uint32)"
        raise ApiError(400, msg, param="prompt", code="invalid_value")
    return TextRequest(prompt=raw, params=_call_params(body))


# --------------------------------------------------------------------------- answers

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop"}


class Generation(Protocol):
    """What an answer reports of the backend's completion (backends.Completion is one)."""

    @property
    def token_ids(self) -> np.ndarray: ...
    @property
    def logprobs(self) -> np.ndarray: ...
    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None: ...
    @property
    def finish_reason(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def policy_version(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ChatChoice:
    """One choice of a chat answer: the backend's completion, the assistant message read from
    it and the id of its LlmCall. ``token_texts`` (each generated token's text) and
    ``top_texts`` (the text of each of ``out.top_logprobs``' alternatives) when logprobs were
    asked for; ``tool_choice_met`` when a tool call was required ("required" or a named
    function): whether the reply holds one."""

    out: Generation
    message: dict[str, Any]
    call_id: str
    token_texts: list[str] | None = None
    top_texts: list[list[str]] | None = None
    tool_choice_met: bool | None = None


def usage(prompt_len: int, completion_len: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_len, "completion_tokens": completion_len,
            "total_tokens": prompt_len + completion_len}  # fmt: skip


def sse_body(chunks: list[dict[str, Any]]) -> bytes:
    """A complete server-sent-events body: one ``data:`` line per chunk, then [DONE]."""
    return b"".join(b"data: " + dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def chat_chunk(
    head: dict[str, Any], delta: dict[str, Any], finish: str | None = None, lp: Any = None,
    index: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """One chat.completion.chunk of choice ``index`` (``head``: id, object, created, model)."""
    return {**head, "choices": [{"index": index, "delta": delta, "logprobs": lp,
                                 "finish_reason": finish}]}  # fmt: skip


class SseTemplate:
    """One server-sent event rendered once with a slot for a string (``SseTemplate.SLOT``,
    exactly once among ``data``'s values); ``fill(text)`` is then the event with ``text`` in the
    slot, byte for byte what ``prefix + dumps(data with text) + b"\\n\\n"`` gives, for one
    string escape per event (a streamed reply's content deltas)."""

    SLOT = "\x00slot-" + secrets.token_hex(8) + "\x00"  # no model name or id holds this

    __slots__ = ("_post", "_pre")

    def __init__(self, prefix: bytes, data: Any) -> None:
        whole = prefix + dumps(data) + b"\n\n"
        slot = dumps(self.SLOT)
        if whole.count(slot) != 1:
            raise ValueError("an SSE template holds its slot exactly once")
        self._pre, self._post = whole.split(slot)

    def fill(self, text: str) -> bytes:
        return self._pre + dumps(text) + self._post


def stream_logprobs(
    texts: list[str], logprobs: list[float], tops: list[list[tuple[int, float]]] | None,
    top_texts: list[list[str]] | None,
) -> dict[str, Any]:  # fmt: skip
    """OpenAI's ``logprobs`` of a streamed chunk: ``{"content": [...]}``, one entry per token
    that came with it (as ``chat_logprobs``)."""
    content = []
    for j, (text, lp) in enumerate(zip(texts, logprobs, strict=True)):
        alts: list[dict[str, Any]] = []
        if tops is not None and top_texts is not None:
            pairs = zip(tops[j], top_texts[j], strict=True)
            alts = [_token_logprob(t, a_lp) for (_, a_lp), t in pairs]
        content.append({**_token_logprob(text, lp), "top_logprobs": alts})
    return {"content": content}


def chat_chunks(
    head: dict[str, Any], message: dict[str, Any], finish: str, use: dict[str, int] | None,
    logprobs: dict[str, Any] | None = None, index: int = 0,
) -> list[dict[str, Any]]:  # fmt: skip
    """chat.completion.chunk objects for a whole reply (an assistant ``message``, choice
    ``index``): role, content, tool calls, finish, and the usage chunk when ``use`` is given
    (``stream_options.include_usage``)."""
    base = {**head, "object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], fin: str | None = None, lp: Any = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": index, "delta": delta, "logprobs": lp,
                                     "finish_reason": fin}]}  # fmt: skip

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}, lp=logprobs))
    if message.get("tool_calls"):
        calls = [{"index": i, **tc} for i, tc in enumerate(message["tool_calls"])]
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


def _answer(
    head: dict[str, Any],
    choices: list[dict[str, Any]],
    use: dict[str, int],
    params: CallParams,
    prompt_ids: np.ndarray,
    outs: list[Generation],
    call_id: str,
    rollout_id: str,
    **ext: Any,
) -> Answer:
    if params.return_token_ids:
        for choice, out in zip(choices, outs, strict=True):
            choice["token_ids"] = out.token_ids.tolist()
            choice["prompt_token_ids"] = prompt_ids.tolist()
    ext |= {
        "call_id": call_id,
        "rollout_id": rollout_id,
        "backend": outs[0].backend,
        "policy_version": outs[0].policy_version,
    }
    return Answer(dumps(head | {"choices": choices, "usage": use, "rollstream": ext}))


def _token_logprob(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(choice: ChatChoice) -> dict[str, Any] | None:
    """OpenAI's ``choices[i].logprobs``: ``{"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}, ...]}, ...]}``, one entry per generated token
    (None without ``token_texts``)."""
    if choice.token_texts is None:
        return None
    tops, top_texts = choice.out.top_logprobs, choice.top_texts
    content = []
    lps = choice.out.logprobs.tolist()
    for j, (text, lp) in enumerate(zip(choice.token_texts, lps, strict=True)):
        alts: list[dict[str, Any]] = []
        if tops is not None and top_texts is not None:
            pairs = zip(tops[j], top_texts[j], strict=True)
            alts = [_token_logprob(t, a_lp) for (_, a_lp), t in pairs]
        content.append({**_token_logprob(text, lp), "top_logprobs": alts})
    return {"content": content}


def chat_answer(
    params: CallParams,
    *,
    created: int,
    model: str,
    rollout_id: str,
    prompt_ids: np.ndarray,
    choices: list[ChatChoice],
    drift_tokens: int,
) -> Answer:
    """The last step of a chat call: the chat.completion object (or its SSE chunks) with one
    choice per completion (index 0..n-1). Usage counts the prompt once and every choice's
    completion; ``rollstream.call_id`` is choice 0's LlmCall, ``rollstream.call_ids`` each
    choice's. Streamed, the chunks of choice 0 come first, then those of choice 1, ... (each
    chunk carries its choice's index), then the usage chunk."""
    first = choices[0]
    head = {"id": f"chatcmpl-{first.call_id}", "created": created, "model": model}
    completion_tokens = sum(len(c.out.token_ids) for c in choices)
    use = usage(len(prompt_ids), completion_tokens)
    bodies = []
    for i, c in enumerate(choices):
        finish = FINISH_REASONS.get(c.out.finish_reason, "stop")
        if c.message.get("tool_calls"):
            finish = "tool_calls"
        body: dict[str, Any] = {"index": i, "message": c.message, "logprobs": chat_logprobs(c)}
        body["finish_reason"] = finish
        if c.tool_choice_met is not None:
            body["tool_choice_met"] = c.tool_choice_met
        bodies.append(body)
    if params.stream:
        chunks = []
        for i, body in enumerate(bodies):
            message, finish, lp = body["message"], body["finish_reason"], body["logprobs"]
            chunks += chat_chunks(head, message, finish, None, lp, index=i)
        if params.include_usage:
            chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": use})
        return Answer(sse_body(chunks), sse=True)
    head["object"] = "chat.completion"
    ext: dict[str, Any] = {"drift_tokens": drift_tokens}
    if len(choices) > 1:
        ext["call_ids"] = [c.call_id for c in choices]
    outs = [c.out for c in choices]
    return _answer(head, bodies, use, params, prompt_ids, outs, first.call_id, rollout_id, **ext)


def text_answer(
    params: CallParams,
    *,
    call_id: str,
    created: int,
    model: str,
    rollout_id: str,
    prompt_ids: np.ndarray,
    out: Generation,
    text: str,
) -> Answer:
    """The last step of a text completion: the text_completion object (or its SSE chunks)."""
    finish = FINISH_REASONS.get(out.finish_reason, "stop")
    use = usage(len(prompt_ids), len(out.token_ids))
    head = {"id": f"cmpl-{call_id}", "object": "text_completion", "created": created}
    head["model"] = model
    if params.stream:
        use_chunk = use if params.include_usage else None
        return Answer(sse_body(text_chunks(head, text, finish, use_chunk)), sse=True)
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return _answer(head, [choice], use, params, prompt_ids, [out], call_id, rollout_id)
