"""The OpenAI Responses API surface of the recording proxy (``POST /v1/responses``), with no HTTP
framework and no state: request parsing (step 1 of a model call) and the Response answer (its
last step). responses_api.py runs the chat pipeline between them, so a Responses call renders,
generates and records exactly as a chat completion does. Errors are OpenAI's error objects
(openai_wire.error_answer).

    parse_responses_request(body) -> ResponsesRequest   Responses fields validated (400 naming
                                                         the field), brought to the chat form: a
                                                         ChatRequest (openai_wire) for render_turn
    output_items(...) -> list                            the output: a message item, then a
                                                         function_call item per tool call
    response_body(...) -> dict                           the Response object
    response_answer(response, stream) -> Answer          JSON, or the complete SSE event sequence

The request in the chat form:

    instructions                          a first system message
    input: a string                       one user message
    input: message items                  messages of their role (user, assistant, system,
      {role, content}                     developer); content a string or input_text /
                                          output_text parts (joined)
    input: function_call items            tool_calls of one assistant message: the assistant
      {call_id, name, arguments}          message item just before them, else one without text
    input: function_call_output items     tool messages (tool_call_id = call_id); output a string
      {call_id, output}                   or input_text parts
    tools [{type: function, name,         function tools (other tool types refused)
           description, parameters}]
    tool_choice none|auto|required|       the same; {type: function, name} -> a named function
      {type: function, name}
    max_output_tokens, temperature,       max_tokens, temperature, top_p
    top_p
    text.format text|json_object|         response_format (JSON formats: refused unless every
      json_schema                         backend decodes under a grammar, as on the chat route)

A reply sent back as its output items (the message item, then its function_call items) is the
assistant message the proxy remembered, so the next prompt extends the previous call's ids.

Checked and ignored: ``model``, ``store`` (nothing is stored, whatever it says),
``parallel_tool_calls`` (the reply is read as sampled), ``metadata`` (at most 16 string pairs,
echoed), ``user``, ``safety_identifier``, ``prompt_cache_key``, ``service_tier``,
``stream_options``, ``max_tool_calls``, ``include`` (only ``reasoning.encrypted_content``:
there are no reasoning items), ``truncation`` (only ``disabled``), ``reasoning`` (effort
absent or ``none``, no summary: the backends have no reasoning effort), ``text.verbosity``
(absent or ``medium``). Refused with a 400 naming them: ``previous_response_id`` and
``conversation`` (no response is stored), ``background``, ``prompt``, ``top_logprobs`` > 0,
unknown fields (unless null: a client sends an item back as it got it, its unset fields
included), other item, part and tool types.

The answer: ``{id: "resp_<call_id>", object: "response", created_at, status: completed |
incomplete, incomplete_details: {reason: "max_output_tokens"} | null, model, output, usage:
{input_tokens, output_tokens, total_tokens, ...details}, the request's settings echoed,
rollstream: {call_id, rollout_id, backend, policy_version, drift_tokens, tool_choice_met?}}``.

Streaming: ``stream_events`` is the complete event sequence of a finished response:
response.created, response.in_progress, per output item response.output_item.added,
then (message) response.content_part.added / response.output_text.delta /
response.output_text.done / response.content_part.done or (function call)
response.function_call_arguments.delta / .done, then response.output_item.done; last
response.completed (response.incomplete when the reply hit max_output_tokens). The Responses
route streams the same events as the tokens come (responses_api.py). Every event
carries ``type`` and ``sequence_number``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollstream.producers.errors import ApiError
from rollstream.producers.proxy.anthropic_wire import sse_events
from rollstream.producers.proxy.openai_wire import (
    Answer,
    ChatRequest,
    dumps,
    flag,
    number,
    parse_chat_request,
)

__all__ = [
    "MAX_INPUT_ITEMS",
    "MAX_METADATA",
    "MAX_TOOLS",
    "ResponsesRequest",
    "item_events",
    "output_items",
    "parse_responses_request",
    "response_answer",
    "response_body",
    "stream_events",
]

MAX_INPUT_ITEMS = 10_000
MAX_TOOLS = 256
MAX_TOOL_NAME = 128
MAX_METADATA = 16  # OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_ID = 512  # user, safety_identifier, prompt_cache_key, item ids

_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens",
    "temperature", "top_p", "stream", "store", "parallel_tool_calls", "metadata", "reasoning",
    "text", "previous_response_id", "user", "safety_identifier", "prompt_cache_key",
    "service_tier", "stream_options", "include", "truncation", "max_tool_calls",
    "top_logprobs", "background", "conversation", "prompt",
})  # fmt: skip
_REFUSED = ("previous_response_id", "conversation", "background", "prompt")
_ITEM_KEYS = {
    "message": frozenset({"type", "role", "content", "id", "status", "phase"}),
    "function_call": frozenset({"type", "id", "call_id", "name", "arguments", "status"}),
    "function_call_output": frozenset({"type", "id", "call_id", "output", "status"}),
}
_PART_KEYS = {
    "input_text": frozenset({"type", "text"}),
    "output_text": frozenset({"type", "text", "annotations", "logprobs"}),
}
_ROLES = ("user", "assistant", "system", "developer")


# --------------------------------------------------------------------------- requests


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _known(obj: dict[str, Any], allowed: frozenset[str], param: str) -> None:
    for key in obj:
        if key not in allowed and obj[key] is not None:
            raise _bad(f"unknown field `{key}`", f"{param}.{key}" if param else key, "unknown")


def _string(raw: Any, param: str, limit: int = MAX_ID) -> str | None:
    if raw is not None and (not isinstance(raw, str) or len(raw) > limit):
        raise _bad(f"`{param}` must be a string of at most {limit} characters", param)
    return raw


def _texts(raw: Any, param: str) -> str:
    """A string, or input_text / output_text parts joined."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise _bad("must be a string or a list of text parts", param)
    texts = []
    for j, part in enumerate(raw):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PART_KEYS:
            msg = f"content part type {kind!r} is not supported (input_text, output_text)"
            raise _bad(msg, f"{p}.type", "unsupported")
        _known(part, _PART_KEYS[kind], p)
        if not isinstance(part.get("text"), str):
            raise _bad("a text part needs a string `text`", f"{p}.text")
        texts.append(part["text"])
    return "".join(texts)


def _item_id(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID:
        raise _bad(f"`{key}` must be a string of 1 to {MAX_ID} characters", f"{param}.{key}")
    return value


def _input(raw: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: function_call items join the assistant message item just
    before them (one assistant message, as the proxy answered it)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_INPUT_ITEMS:
        msg = f"`input` must be a string or a list of 1 to {MAX_INPUT_ITEMS} items"
        raise _bad(msg, "input")
    out: list[dict[str, Any]] = []
    open_assistant: dict[str, Any] | None = None  # the message function_call items join
    for i, item in enumerate(raw):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad("each input item must be an object", p)
        kind = item.get("type", "message")
        if kind not in _ITEM_KEYS:
            msg = f"input item type {kind!r} is not supported ({', '.join(_ITEM_KEYS)})"
            raise _bad(msg, f"{p}.type", "unsupported")
        _known(item, _ITEM_KEYS[kind], p)
        if kind == "function_call":
            args = item.get("arguments")
            if not isinstance(args, str):
                raise _bad("a function_call item needs a string `arguments`", f"{p}.arguments")
            call = {
                "id": _item_id(item, "call_id", p),
                "type": "function",
                "function": {"name": _item_id(item, "name", p), "arguments": args},
            }
            if open_assistant is None:
                open_assistant = {"role": "assistant", "content": None}
                out.append(open_assistant)
            open_assistant.setdefault("tool_calls", []).append(call)
            continue
        open_assistant = None
        if kind == "function_call_output":
            text = _texts(item.get("output"), f"{p}.output")
            tid = _item_id(item, "call_id", p)
            out.append({"role": "tool", "tool_call_id": tid, "content": text})
            continue
        role = item.get("role")
        if role not in _ROLES:
            raise _bad(f"`role` must be one of {', '.join(_ROLES)}", f"{p}.role")
        message = {"role": role, "content": _texts(item.get("content"), f"{p}.content")}
        out.append(message)
        if role == "assistant":
            open_assistant = message
    return out


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    """Responses function tools as the chat form's function tools."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise _bad(f"`tools` must be a list of at most {MAX_TOOLS} tools", "tools")
    out = []
    for i, tool in enumerate(raw):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad("each tool must be an object", p)
        if tool.get("type") != "function":
            msg = f"tool type {tool.get('type')!r} is not supported (function tools only)"
            raise _bad(msg, f"{p}.type", "unsupported")
        _known(tool, frozenset({"type", "name", "description", "parameters", "strict"}), p)
        name = tool.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TOOL_NAME:
            raise _bad(f"a tool needs a `name` of 1 to {MAX_TOOL_NAME} characters", f"{p}.name")
        fn: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            fn["description"] = _string(tool["description"], f"{p}.description", 1 << 20)
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad("`parameters` must be a JSON schema object", f"{p}.parameters")
        fn["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise _bad("`strict` must be a boolean", f"{p}.strict")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> Any:
    if raw is None or raw in ("none", "auto", "required"):
        return raw
    if not isinstance(raw, dict):
        raise _bad('`tool_choice` must be "none", "auto", "required" or an object', "tool_choice")
    if raw.get("type") != "function":
        msg = f"tool_choice type {raw.get('type')!r} is not supported (function only)"
        raise _bad(msg, "tool_choice.type", "unsupported")
    _known(raw, frozenset({"type", "name"}), "tool_choice")
    if raw.get("name") not in {t["function"]["name"] for t in tools or ()}:
        raise _bad("`name` must name one of the tools", "tool_choice.name")
    return {"type": "function", "function": {"name": raw["name"]}}


def _text_format(raw: Any) -> dict[str, Any] | None:
    """``text`` as chat's response_format (None for plain text)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _bad("`text` must be an object", "text")
    _known(raw, frozenset({"format", "verbosity"}), "text")
    if raw.get("verbosity") not in (None, "medium"):
        msg = "only the default verbosity (medium) is supported"
        raise _bad(msg, "text.verbosity", "unsupported")
    fmt = raw.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text" or kind == "json_object":
        _known(fmt, frozenset({"type"}), "text.format")
        return None if kind == "text" else {"type": "json_object"}
    if kind != "json_schema":
        raise _bad("`type` must be text, json_object or json_schema", "text.format.type")
    _known(fmt, frozenset({"type", "name", "schema", "strict", "description"}), "text.format")
    if not isinstance(fmt.get("schema"), dict):
        raise _bad("a json_schema format needs an object `schema`", "text.format.schema")
    schema = {"name": _item_id(fmt, "name", "text.format"), "schema": fmt["schema"]}
    for key in ("strict", "description"):
        if fmt.get(key) is not None:
            schema[key] = fmt[key]
    return {"type": "json_schema", "json_schema": schema}


def _metadata(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if (
        not isinstance(raw, dict)
        or len(raw) > MAX_METADATA
        or not all(
            isinstance(k, str)
            and len(k) <= MAX_METADATA_KEY
            and isinstance(v, str)
            and len(v) <= MAX_METADATA_VALUE
            for k, v in raw.items()
        )
    ):
        msg = (
            f"`metadata` must be at most {MAX_METADATA} string pairs (keys of at most "
            f"{MAX_METADATA_KEY} characters, values of at most {MAX_METADATA_VALUE})"
        )
        raise _bad(msg, "metadata")
    return dict(raw)


def _reasoning(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {"effort": None, "summary": None}
    if not isinstance(raw, dict):
        raise _bad("`reasoning` must be an object", "reasoning")
    _known(raw, frozenset({"effort", "summary", "generate_summary"}), "reasoning")
    if raw.get("effort") not in (None, "none"):
        msg = "reasoning effort is not supported (the backends sample without one)"
        raise _bad(msg, "reasoning.effort", "unsupported")
    for key in ("summary", "generate_summary"):
        if raw.get(key) is not None:
            raise _bad("reasoning summaries are not supported", f"reasoning.{key}", "unsupported")
    return {"effort": raw.get("effort"), "summary": None}


def _ignored(body: dict[str, Any]) -> None:
    """The fields that change nothing here, checked all the same; those that would, refused."""
    for key in _REFUSED:
        if body.get(key) not in (None, False):
            msg = f"`{key}` is not supported: the proxy stores no responses or conversations"
            if key in ("background", "prompt"):
                msg = f"`{key}` is not supported"
            raise _bad(msg, key, "unsupported")
    for key in ("model", "user", "safety_identifier", "prompt_cache_key"):
        _string(body.get(key), key)
    flag(body, "store", True)
    flag(body, "parallel_tool_calls", True)
    if body.get("service_tier") not in (None, "auto", "default"):
        raise _bad("`service_tier` must be auto or default", "service_tier")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise _bad("`stream_options` must be an object", "stream_options")
    number(body, "max_tool_calls", None, lo=1)
    if number(body, "top_logprobs", 0, lo=0, hi=20):
        raise _bad("`top_logprobs` is not supported here", "top_logprobs", "unsupported")
    include = body.get("include")
    if include is not None and (
        not isinstance(include, list)
        or not all(x == "reasoning.encrypted_content" for x in include)
    ):
        msg = "`include` may only name reasoning.encrypted_content (there are no reasoning items)"
        raise _bad(msg, "include", "unsupported")
    if body.get("truncation") not in (None, "disabled"):
        msg = "only `truncation: disabled` is supported (an overflow is a 400)"
        raise _bad(msg, "truncation", "unsupported")


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A /v1/responses request in the chat form: ``chat`` is what the chat pipeline takes
    (OpenAI chat messages and tools; ``chat.response_format`` from ``text.format``), ``echo``
    the request's settings as the Response object repeats them."""

    chat: ChatRequest
    stream: bool
    echo: dict[str, Any]


def parse_responses_request(body: dict[str, Any]) -> ResponsesRequest:
    """Step 1 of a Responses call: every field checked (400 naming the field: unknown fields,
    ``previous_response_id``, an item of an unsupported type...) and the conversation brought to
    the chat form."""
    _known(body, _FIELDS, "")
    _ignored(body)
    max_tokens = number(body, "max_output_tokens", None, lo=1)
    temperature = number(body, "temperature", 1.0, float, 0, 2)
    top_p = number(body, "top_p", 1.0, float, 0, 1)
    stream = flag(body, "stream")
    instructions = _string(body.get("instructions"), "instructions", 1 << 24)
    if body.get("input") is None:
        raise _bad("Field required", "input", "missing")
    system = [{"role": "system", "content": instructions}] if instructions else []
    messages = [*system, *_input(body.get("input"))]
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    response_format = _text_format(body.get("text"))
    chat: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "tools": tools,
        "tool_choice": tool_choice,
        "response_format": response_format,
    }
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_tokens,
        "metadata": _metadata(body.get("metadata")),
        "parallel_tool_calls": flag(body, "parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": _reasoning(body.get("reasoning")),
        "store": flag(body, "store", True),
        "temperature": temperature,
        "text": {"format": _format_echo(body.get("text"))},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": top_p,
        "truncation": "disabled",
        "user": body.get("user"),
    }
    return ResponsesRequest(parse_chat_request(chat), stream, echo)


def _format_echo(text: Any) -> dict[str, Any]:
    fmt = text.get("format") if isinstance(text, dict) else None
    return fmt if isinstance(fmt, dict) else {"type": "text"}


# --------------------------------------------------------------------------- answers


def output_items(
    call_id: str, text: str | None, tool_calls: list[dict[str, Any]], *, incomplete: bool
) -> list[dict[str, Any]]:
    """The output of a reply: a message item with its text (unless the reply is only tool
    calls), then a function_call item per OpenAI-shaped tool call, in the order that sent back
    as input gives the assistant message the proxy remembered."""
    items: list[dict[str, Any]] = []
    if text or not tool_calls:
        items.append(
            {
                "type": "message",
                "id": f"msg_{call_id}",
                "role": "assistant",
                "status": "incomplete" if incomplete else "completed",
                "content": [{"type": "output_text", "text": text or "", "annotations": []}],
            }
        )
    for i, call in enumerate(tool_calls):
        fn = call["function"]
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{call_id}_{i}",
                "call_id": call["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
                "status": "completed",
            }
        )
    return items


def response_body(
    *,
    call_id: str,
    created_at: int,
    model: str,
    output: list[dict[str, Any]],
    incomplete: bool,
    input_tokens: int,
    output_tokens: int,
    echo: dict[str, Any],
    ext: dict[str, Any],
) -> dict[str, Any]:
    """The Response object (``echo``: the request's settings; ``ext``: the rollstream
    extension, call_id and the like)."""
    return {
        "id": f"resp_{call_id}",
        "object": "response",
        "created_at": created_at,
        "status": "incomplete" if incomplete else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": model,
        "output": output,
        **echo,
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
        "rollstream": ext,
    }


def item_events(i: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of output item ``i``, from added to done (no sequence numbers yet)."""
    at = {"item_id": item["id"], "output_index": i}
    if item["type"] == "message":
        part = item["content"][0]
        empty = {**part, "text": ""}
        middle = [
            {"type": "response.content_part.added", **at, "content_index": 0, "part": empty},
            {
                "type": "response.output_text.delta",
                **at,
                "content_index": 0,
                "delta": part["text"],
                "logprobs": [],
            },
            {
                "type": "response.output_text.done",
                **at,
                "content_index": 0,
                "text": part["text"],
                "logprobs": [],
            },
            {"type": "response.content_part.done", **at, "content_index": 0, "part": part},
        ]
        started = {**item, "status": "in_progress", "content": []}
    else:
        args = item["arguments"]
        middle = [
            {"type": "response.function_call_arguments.delta", **at, "delta": args},
            {"type": "response.function_call_arguments.done", **at, "arguments": args},
        ]
        started = {**item, "status": "in_progress", "arguments": ""}
    return [
        {"type": "response.output_item.added", "output_index": i, "item": started},
        *middle,
        {"type": "response.output_item.done", "output_index": i, "item": item},
    ]


def stream_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The event sequence of a finished Response, as OpenAI streams one: each event has
    ``type`` and ``sequence_number`` (0, 1, ...)."""
    start = {**response, "status": "in_progress", "output": [], "usage": None}
    start["incomplete_details"] = None
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": start},
        {"type": "response.in_progress", "response": start},
    ]
    for i, item in enumerate(response["output"]):
        events += item_events(i, item)
    last = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    events.append({"type": last, "response": response})
    return [{**e, "sequence_number": n} for n, e in enumerate(events)]


def response_answer(response: dict[str, Any], *, stream: bool) -> Answer:
    """The last step of a Responses call: the Response as JSON, or its events as SSE (an
    ``event:`` and a ``data:`` line each)."""
    if stream:
        events = stream_events(response)
        return Answer(sse_events([(e["type"], e) for e in events]), sse=True)
    return Answer(dumps(response))
