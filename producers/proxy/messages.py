"""OpenAI chat messages and tools, validated and brought to the shape chat templates expect
(pure; no I/O), and the canonical key that identifies an assistant reply when a harness sends it
back. Part of the chat step (chat.py); errors are ChatInputError with ``param`` naming the field
(``messages[2].content``) and ``code`` "invalid_value"."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from rollstream.producers.errors import ChatInputError
from rollstream.producers.proxy.openai_wire import json_text

__all__ = ["ROLES", "message_key", "normalize_messages", "normalize_tools"]

ROLES = ("system", "developer", "user", "assistant", "tool")


def _invalid(message: str, param: str) -> ChatInputError:
    return ChatInputError(message, param, code="invalid_value")


def _text_content(content: Any, param: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise _invalid("a text part needs a string `text`", f"{param}[{i}].text")
                parts.append(text)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                msg = f"content part type {kind!r} is not supported (text only)"
                raise _invalid(msg, f"{param}[{i}]")
        return "".join(parts)
    raise _invalid("`content` must be a string, a list of text parts, or null", param)


def _arguments(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    raise _invalid("tool call `arguments` must be a JSON string or object", param)


def _tool_calls(raw: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise _invalid("`tool_calls` must be a list", param)
    calls = []
    for i, call in enumerate(raw):
        p = f"{param}[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _invalid("a tool call needs `function.name`", f"{p}.function.name")
        calls.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {
                    "name": fn["name"],
                    "arguments": _arguments(fn.get("arguments", "{}"), f"{p}.function"),
                },
            }
        )
    return calls


def normalize_messages(raw: Any) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and bring them to the shape templates expect: content a
    string (text parts joined) or None, ``developer`` as ``system``, tool call arguments as JSON
    strings. Raises ChatInputError with ``param`` like ``messages[2].content``."""
    if not isinstance(raw, list) or not raw:
        raise _invalid("`messages` must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(raw):  # the param names are built only for errors (hot path)
        if not isinstance(msg, dict):
            raise _invalid("each message must be an object", f"messages[{i}]")
        role = msg.get("role")
        if role not in ROLES:
            raise _invalid(f"`role` must be one of {', '.join(ROLES)}", f"messages[{i}].role")
        content = msg.get("content")
        if content is not None and type(content) is not str:
            content = _text_content(content, f"messages[{i}].content")
        m: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant":
            if msg.get("tool_calls"):
                m["tool_calls"] = _tool_calls(msg["tool_calls"], f"messages[{i}].tool_calls")
        elif content is None:
            raise _invalid("`content` is required", f"messages[{i}].content")
        elif role == "tool":
            m["tool_call_id"] = str(msg.get("tool_call_id") or "")
        if "name" in msg and isinstance(msg["name"], str):
            m["name"] = msg["name"]
        out.append(m)
    return out


def normalize_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Validate the ``tools`` array (function tools only); None when absent or empty."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise _invalid("`tools` must be a list", "tools")
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _invalid("only function tools are supported", f"tools[{i}]")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _invalid("a tool needs a `function` object", f"tools[{i}].function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _invalid("a tool needs `function.name`", f"tools[{i}].function.name")
    return raw


def _canonical_arguments(arguments: str) -> str:
    try:
        return json.dumps(
            json_text(arguments), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
    except ValueError:  # not JSON, or nested past MAX_JSON_DEPTH: the text itself
        return arguments.strip()


def message_key(content: str | None, tool_calls: Iterable[dict[str, Any]] | None = None) -> str:
    """Canonical text of an assistant message: what identifies a reply when it comes back
    (content stripped; tool calls as name + JSON arguments with sorted keys; ids ignored)."""
    key = (content or "").strip()
    for call in tool_calls or ():
        fn = call.get("function", call)
        key += f"\x1f{fn.get('name', '')}\x1e{_canonical_arguments(str(fn.get('arguments', '')))}"
    return key
