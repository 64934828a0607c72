"""The Anthropic Messages API surface of the recording proxy (``POST /v1/messages``), with no HTTP
framework and no state: request parsing (step 1 of a model call), the Message answer (its last
step) and Anthropic's error objects. messages_api.py runs the chat pipeline between them, so a
Messages call renders, generates and records exactly as a chat completion does.

    parse_messages_request(body) -> MessagesRequest    Anthropic fields validated (400 naming
                                                        the field), brought to the chat form: a
                                                        ChatRequest (openai_wire) for render_turn
    message_body(...) -> dict                           the Message object
    message_answer(message, stream) -> Answer           JSON, or the complete SSE event sequence
    error_answer(exc) -> Answer                         {"type": "error", "error": {type, message}}
    prompt_too_long(n, m) / context_limit(n, t, m)      context overflows as Anthropic words them

The request in the chat form:

    system (string or text blocks)        a first system message
    user text blocks                      one user message (texts joined with newlines)
    user tool_result blocks               tool messages (tool_call_id = tool_use_id), before the
                                          user message; content a string or text blocks
    assistant text + tool_use blocks      one assistant message with tool_calls (input as JSON)
    tools [{name, description,            function tools (parameters = input_schema); server
           input_schema}]                 tools (a ``type`` other than "custom") are refused
    tool_choice auto|any|tool|none        auto | required | {function: {name}} | none
    max_tokens (required), temperature    the same; temperature in [0, 1] as Anthropic bounds it
    (0..1), top_p, stop_sequences         top_p and stop (one token each, as on the chat route)
    metadata {user_id}, service_tier      checked and ignored; thinking only {"type": "disabled"};
                                          top_k refused (the backends have no top-k)

Unknown fields are refused (400 naming them), at the top level and in every block, unless
null (clients send a response block back as they got it, its unset fields included); the keys
``cache_control`` and ``citations`` are accepted and ignored. A final assistant message (a
prefill) is refused: the chat template renders every assistant message closed.

The answer: ``{id: "msg_<call_id>", type: "message", role: "assistant", model, content: [text
and tool_use blocks], stop_reason: end_turn | max_tokens | stop_sequence | tool_use,
stop_sequence, usage: {input_tokens, output_tokens}, rollstream: {call_id, rollout_id, backend,
policy_version, drift_tokens}}``.

Streaming: ``stream_events`` is the complete event sequence of a finished message (message_start,
per block content_block_start / content_block_delta (text_delta or input_json_delta) /
content_block_stop, message_delta (stop_reason, stop_sequence, usage), message_stop); the
Messages route streams the same events as the tokens come (messages_api.py).

Errors are ``{"type": "error", "error": {"type", "message"}}`` with the status the chat route
answers (400 invalid_request_error, 401 authentication_error, 403 permission_error, 404
not_found_error, 409 invalid_request_error, 413 request_too_large, 429 rate_limit_error, 502
api_error, 503 overloaded_error, 500 api_error); the message starts with the field it names
(``max_tokens: ...``, as Anthropic words it). A 409 (finished rollout) carries
``x-should-retry: false`` so Anthropic's client does not retry it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rollstream.producers.errors import ApiError
from rollstream.producers.proxy.openai_wire import (
    Answer,
    ChatRequest,
    dumps,
    flag,
    json_text,
    number,
    parse_chat_request,
)

__all__ = [
    "ERROR_TYPES",
    "MAX_STOP_SEQUENCES",
    "MAX_TOOLS",
    "STOP_REASONS",
    "MessagesRequest",
    "content_blocks",
    "context_limit",
    "error_answer",
    "error_body",
    "message_answer",
    "message_body",
    "parse_messages_request",
    "prompt_too_long",
    "sse_events",
    "stop_reason",
    "stream_events",
]

# the Anthropic error type of each status an answer may have
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
}
STOP_REASONS = ("end_turn", "max_tokens", "stop_sequence", "tool_use")
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_TOOLS = 256
MAX_TOOL_NAME = 128
MAX_USER_ID = 256

_FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream",
    "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking", "service_tier",
})  # fmt: skip
_IGNORED = frozenset({"cache_control", "citations"})
_BLOCK_KEYS = {
    "text": frozenset({"type", "text"}),
    "tool_use": frozenset({"type", "id", "name", "input"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error"}),
}


# --------------------------------------------------------------------------- requests


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _known(obj: dict[str, Any], allowed: frozenset[str], param: str) -> None:
    for key in obj:
        if key not in allowed and key not in _IGNORED and obj[key] is not None:
            raise _bad(f"unknown field `{key}`", f"{param}.{key}" if param else key, "unknown")


def _block(raw: Any, param: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    """A content block of one of ``kinds``, its keys checked."""
    if not isinstance(raw, dict):
        raise _bad("each content block must be an object", param)
    kind = raw.get("type")
    if kind not in kinds:
        msg = f"content block type {kind!r} is not supported here ({', '.join(kinds)})"
        raise _bad(msg, f"{param}.type", "unsupported")
    _known(raw, _BLOCK_KEYS[kind], param)
    return raw


def _text(block: dict[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad("a text block needs a string `text`", f"{param}.text")
    return text


def _texts(raw: Any, param: str) -> str:
    """A string, or text blocks joined with newlines."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise _bad("must be a string or a list of text blocks", param)
    return "\n".join(
        _text(_block(b, f"{param}[{j}]", ("text",)), f"{param}[{j}]") for j, b in enumerate(raw)
    )


def _user(content: Any, param: str) -> list[dict[str, Any]]:
    """A user message: tool messages for its tool_result blocks, then its text."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise _bad("`content` must be a string or a non-empty list of blocks", param)
    tools: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, raw in enumerate(content):
        p = f"{param}[{j}]"
        block = _block(raw, p, ("text", "tool_result"))
        if block["type"] == "text":
            texts.append(_text(block, p))
            continue
        tid = block.get("tool_use_id")
        if not isinstance(tid, str) or not tid:
            raise _bad("a tool_result block needs `tool_use_id`", f"{p}.tool_use_id")
        if not isinstance(block.get("is_error", False), bool):
            raise _bad("`is_error` must be a boolean", f"{p}.is_error")
        result = block.get("content")
        text = "" if result is None else _texts(result, f"{p}.content")
        tools.append({"role": "tool", "tool_call_id": tid, "content": text})
    return tools + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant(content: Any, param: str) -> dict[str, Any]:
    """An assistant message: its text blocks joined, its tool_use blocks as tool calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad("`content` must be a string or a list of blocks", param)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, raw in enumerate(content):
        p = f"{param}[{j}]"
        block = _block(raw, p, ("text", "tool_use"))
        if block["type"] == "text":
            texts.append(_text(block, p))
            continue
        for key in ("id", "name"):
            if not isinstance(block.get(key), str) or not block[key]:
                raise _bad(f"a tool_use block needs `{key}`", f"{p}.{key}")
        if not isinstance(block.get("input"), dict):
            raise _bad("a tool_use block needs an object `input`", f"{p}.input")
        arguments = json.dumps(block["input"], ensure_ascii=False)
        calls.append(
            {
                "id": block["id"],
                "type": "function",
                "function": {"name": block["name"], "arguments": arguments},
            }
        )
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise _bad("`messages` must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad("each message must be an object", p)
        _known(msg, frozenset({"role", "content"}), p)
        if msg.get("role") == "user":
            out += _user(msg.get("content"), f"{p}.content")
        elif msg.get("role") == "assistant":
            if i == len(raw) - 1:
                msg_ = "a final assistant message (a prefill) is not supported"
                raise _bad(msg_, p, "unsupported")
            out.append(_assistant(msg.get("content"), f"{p}.content"))
        else:
            raise _bad("`role` must be user or assistant", f"{p}.role")
    return out


def _system(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    text = _texts(raw, "system")
    return [{"role": "system", "content": text}] if text else []


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    """Anthropic tools as the function tools chat templates take."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise _bad(f"`tools` must be a list of at most {MAX_TOOLS} tools", "tools")
    out = []
    for i, tool in enumerate(raw):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad("each tool must be an object", p)
        if tool.get("type", "custom") not in ("custom", None):
            msg = f"tool type {tool['type']!r} is not supported (custom tools only)"
            raise _bad(msg, f"{p}.type", "unsupported")
        _known(tool, frozenset({"type", "name", "description", "input_schema"}), p)
        name = tool.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TOOL_NAME:
            raise _bad(f"a tool needs a `name` of 1 to {MAX_TOOL_NAME} characters", f"{p}.name")
        if not isinstance(tool.get("input_schema"), dict):
            raise _bad("a tool needs an object `input_schema`", f"{p}.input_schema")
        fn: dict[str, Any] = {"name": name, "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise _bad("`description` must be a string", f"{p}.description")
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> Any:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _bad("`tool_choice` must be an object", "tool_choice")
    _known(raw, frozenset({"type", "name", "disable_parallel_tool_use"}), "tool_choice")
    kind = raw.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        names = {t["function"]["name"] for t in tools or ()}
        if raw.get("name") not in names:
            raise _bad("`name` must name one of the tools", "tool_choice.name")
        return {"type": "function", "function": {"name": raw["name"]}}
    raise _bad("`type` must be auto, any, tool or none", "tool_choice.type")


def _stop_sequences(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if (
        not isinstance(raw, list)
        or len(raw) > MAX_STOP_SEQUENCES
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in raw)
    ):
        msg = f"must be a list of at most {MAX_STOP_SEQUENCES} non-empty strings"
        raise _bad(msg, "stop_sequences")
    return tuple(raw)


def _ignored(body: dict[str, Any]) -> None:
    """The fields that change nothing here, checked all the same."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("`model` must be a string", "model")
    meta = body.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            raise _bad("`metadata` must be an object", "metadata")
        _known(meta, frozenset({"user_id"}), "metadata")
        uid = meta.get("user_id")
        if uid is not None and (not isinstance(uid, str) or len(uid) > MAX_USER_ID):
            raise _bad(f"must be a string of at most {MAX_USER_ID} characters", "metadata.user_id")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise _bad("`service_tier` must be auto or standard_only", "service_tier")
    thinking = body.get("thinking")
    if thinking is not None and thinking != {"type": "disabled"}:
        raise _bad("extended thinking is not supported", "thinking", "unsupported")
    if body.get("top_k") is not None:
        number(body, "top_k", None, lo=0)
        raise _bad(
            "`top_k` is not supported (the backends sample without it)", "top_k", "unsupported"
        )


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A /v1/messages request in the chat form: ``chat`` is what the chat pipeline takes
    (OpenAI-shaped messages and tools; ``chat.params.stop`` are the stop sequences)."""

    chat: ChatRequest
    stream: bool


def parse_messages_request(body: dict[str, Any]) -> MessagesRequest:
    """Step 1 of a Messages call: every field checked (400 naming the field: unknown fields,
    ``max_tokens`` missing, a block of an unsupported type...) and the conversation brought
    to the chat form."""
    _known(body, _FIELDS, "")
    if body.get("max_tokens") is None:
        raise _bad("Field required", "max_tokens", "missing")
    max_tokens = number(body, "max_tokens", None, lo=1)
    temperature = number(body, "temperature", 1.0, float, 0, 1)
    top_p = number(body, "top_p", None, float, 0, 1)
    _ignored(body)
    stream = flag(body, "stream")
    stops = _stop_sequences(body.get("stop_sequences"))
    messages = [*_system(body.get("system")), *_messages(body.get("messages"))]
    tools = _tools(body.get("tools"))
    chat: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stop": list(stops) or None,
    }
    if top_p is not None:
        chat["top_p"] = top_p
    if tools is not None:
        chat["tools"] = tools
        chat["tool_choice"] = _tool_choice(body.get("tool_choice"), tools)
    return MessagesRequest(parse_chat_request(chat), stream)


# --------------------------------------------------------------------------- answers


def stop_reason(finish_reason: str, *, tool_use: bool, stop_sequence: str | None) -> str:
    """Anthropic's stop_reason for a completion's finish reason."""
    if tool_use:
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if finish_reason == "length" else "end_turn"


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json_text(arguments)
    except ValueError:  # not JSON, or nested past MAX_JSON_DEPTH
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(text: str | None, tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content of an assistant reply: its text (when not empty), then a tool_use block per
    OpenAI-shaped tool call (arguments that are not a JSON object become ``{}``)."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for call in tool_calls:
        fn = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": fn["name"],
                "input": _input(fn["arguments"]),
            }
        )
    return blocks


def message_body(
    *,
    call_id: str,
    model: str,
    content: list[dict[str, Any]],
    stop_reason: str | None,
    stop_sequence: str | None,
    input_tokens: int,
    output_tokens: int,
    ext: dict[str, Any],
) -> dict[str, Any]:
    """The Message object (``ext``: the rollstream extension, call_id and the like)."""
    return {
        "id": f"msg_{call_id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        "rollstream": ext,
    }


def stream_events(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (event, data) sequence of a finished Message, as Anthropic streams one."""
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**message["usage"], "output_tokens": 0},
    }
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": start})
    ]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            empty: dict[str, Any] = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            empty = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": dumps(block["input"]).decode()}
        events += [
            (
                "content_block_start",
                {"type": "content_block_start", "index": i, "content_block": empty},
            ),
            ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": i}),
        ]
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    usage = {"output_tokens": message["usage"]["output_tokens"]}
    events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def sse_events(events: list[tuple[str, dict[str, Any]]]) -> bytes:
    """A complete server-sent-events body: an ``event:`` and a ``data:`` line per event."""
    return b"".join(
        b"event: " + name.encode() + b"\ndata: " + dumps(data) + b"\n\n" for name, data in events
    )


def message_answer(message: dict[str, Any], *, stream: bool) -> Answer:
    """The last step of a Messages call: the Message as JSON, or its events as SSE."""
    if stream:
        return Answer(sse_events(stream_events(message)), sse=True)
    return Answer(dumps(message))


# --------------------------------------------------------------------------- errors


def prompt_too_long(prompt_tokens: int, maximum: int) -> ApiError:
    """A prompt over the limit, worded as Anthropic words it (400 invalid_request_error)."""
    msg = f"prompt is too long: {prompt_tokens} tokens > {maximum} maximum"
    return ApiError(400, msg, code="context_length_exceeded")


def context_limit(prompt_tokens: int, max_tokens: int, limit: int) -> ApiError:
    """A prompt that fits, with ``max_tokens`` that does not, worded as Anthropic words it."""
    msg = (
        f"input length and `max_tokens` exceed context limit: {prompt_tokens} + {max_tokens} > "
        f"{limit}, decrease input length or `max_tokens` and try again"
    )
    return ApiError(400, msg, param=None, code="context_length_exceeded")


def error_body(exc: ApiError) -> bytes:
    """The Anthropic error object of ``exc``: the field it names leads the message."""
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else ERROR_TYPES[400])
    message = exc.message
    if exc.param and not message.startswith(exc.param):
        message = f"{exc.param}: {message}"
    return dumps({"type": "error", "error": {"type": kind, "message": message}})


def error_answer(exc: ApiError) -> Answer:
    headers = dict(exc.headers)
    if exc.status == 409:  # a finished rollout stays finished
        headers["x-should-retry"] = "false"
    return Answer(error_body(exc), exc.status, headers=headers)
