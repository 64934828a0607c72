"""How a model writes tool calls, per model family, and how a reply is read back into OpenAI
tool calls (pure; no I/O).

A model writes its tool calls as text in the format its chat template taught it; the proxy
decodes the generated ids and parses that text into the OpenAI ``tool_calls`` of the assistant
message. Four families:

    name         the model writes                                           models
    hermes       <tool_call>{"name": N, "arguments": {...}}</tool_call>     Qwen2.5, Qwen3, Hermes
                 (one block per call, text around them is the content)
    llama3_json  {"name": N, "parameters": {...}}, optionally after         Llama 3.1 / 3.2
                 <|python_tag|>; several joined by ";"; the whole reply
    mistral      [TOOL_CALLS] [{"name": N, "arguments": {...}}, ...]        Mistral v0.3, Nemo
    qwen3_coder  <tool_call><function=N><parameter=P>value</parameter>...   Qwen3-Coder
                 </function></tool_call> (values are text, typed by the
                 tool's JSON schema)

``detect(template_source)`` names the family from the chat template's own text (the markers it
renders tool calls with; hermes when none is found); ``resolve(setting, template_source)`` takes
the setting (``auto`` or a family's name) and gives the ``ToolCallFormat``. Its ``parse(text,
tools)`` gives ``(content, tool_calls)``.

Rules every parser keeps: a block or reply that is not well formed stays text (the content is
then the text unchanged, and no call is made of it); JSON goes through ``openai_wire.json_text``
(nesting bounded by MAX_JSON_DEPTH); at most MAX_TOOL_CALLS calls per reply (blocks past it stay
text; a JSON list longer than that is not read as calls); tool call arguments come out as a JSON
object text. Call ids are ``call_`` + 16 hex digits, except mistral's: 9 letters and digits,
the only ids its templates accept back.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from rollstream.producers.errors import ChatTemplateError
from rollstream.producers.proxy.openai_wire import MAX_JSON_DEPTH, json_text

__all__ = [
    "FORMATS",
    "MAX_TOOL_CALLS",
    "FormatName",
    "ToolCallFormat",
    "ToolFormatSetting",
    "detect",
    "resolve",
]

FormatName = Literal["hermes", "llama3_json", "mistral", "qwen3_coder"]
ToolFormatSetting = Literal["auto", "hermes", "llama3_json", "mistral", "qwen3_coder"]
MAX_TOOL_CALLS = 64  # tool calls read from one reply (OpenAI sets none; 64 is far past use)

# (content, [(name, arguments as a JSON object text), ...]); no calls: the text unchanged
Parsed = tuple[str | None, list[tuple[str, str]]]
Parser = Callable[[str, Sequence[dict[str, Any]] | None], Parsed]


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """One family's tool-call format: its name, the marker texts that open a tool call (those
    that are special tokens of a tokenizer are kept when a reply is decoded for parsing), and
    its parser."""

    name: FormatName
    markers: tuple[str, ...]
    parser: Parser
    id_alphabet: str = ""  # mistral: ids of 9 characters of it; else call_ + hex

    def new_call_id(self, prefix: str = "call_") -> str:
        if self.id_alphabet:
            return "".join(secrets.choice(self.id_alphabet) for _ in range(9))
        return f"{prefix}{secrets.token_hex(8)}"

    def parse(
        self,
        text: str,
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        id_prefix: str = "call_",
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of a reply's text: OpenAI tool calls, each with a new id;
        without calls the content is ``text`` unchanged."""
        content, calls = self.parser(text, tools)
        return content, [
            {
                "id": self.new_call_id(id_prefix),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for name, arguments in calls
        ]


def _arguments_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _json_end(text: str, start: int) -> int | None:
    """The end (exclusive) of the JSON object or array opening at ``text[start]``, found by its
    brackets outside strings; None when it does not close or nests past MAX_JSON_DEPTH."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return None
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _json_at(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON object or array at ``text[start]`` and where it ends, or None."""
    end = _json_end(text, start) if text[start : start + 1] in ("{", "[") else None
    if end is None:
        return None
    try:
        return json_text(text[start:end]), end
    except ValueError:
        return None


def _skip_space(text: str, pos: int) -> int:
    """The index of the first character at or after ``pos`` that is not whitespace."""
    return len(text) - len(text[pos:].lstrip())


# --------------------------------------------------------------------------- hermes

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _parse_hermes(text: str, tools: Sequence[dict[str, Any]] | None) -> Parsed:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks (``parameters`` is
    taken for ``arguments``; none: ``{}``); a block whose JSON is not such an object stays."""
    if "<tool_call>" not in text:
        return text, []
    calls: list[tuple[str, str]] = []

    def take(match: re.Match[str]) -> str:
        if len(calls) >= MAX_TOOL_CALLS:
            return match.group(0)
        try:
            obj = json_text(match.group(1))
        except ValueError:  # not JSON, or nested past MAX_JSON_DEPTH: the block stays text
            return match.group(0)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return match.group(0)
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append((obj["name"], _arguments_text(args)))
        return ""

    content = _HERMES_BLOCK.sub(take, text)
    if not calls:
        return text, []
    return content.strip() or None, calls


# --------------------------------------------------------------------------- llama3_json

_PYTHON_TAG = "<|python_tag|>"


def _parse_llama3_json(text: str, tools: Sequence[dict[str, Any]] | None) -> Parsed:
    """The whole reply (after ``<|python_tag|>``, text before the tag is the content) is one or
    more ``{"name": ..., "parameters": {...}}`` objects joined by ``;``; anything else in it,
    or an object without a string name and an object of parameters, leaves all of it text."""
    head, tag, body = text.partition(_PYTHON_TAG)
    if not tag:
        head, body = "", text
    pos = _skip_space(body, 0)
    if not body.startswith("{", pos):
        return text, []
    calls: list[tuple[str, str]] = []
    while len(calls) < MAX_TOOL_CALLS:
        got = _json_at(body, pos)
        obj = got[0] if got is not None else None
        if got is None or not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("parameters", obj.get("arguments"))
        if not isinstance(args, dict):
            return text, []
        calls.append((obj["name"], _arguments_text(args)))
        pos = _skip_space(body, got[1])
        if pos == len(body):
            return head.strip() or None, calls
        if body[pos] != ";":
            break
        pos = _skip_space(body, pos + 1)
    return text, []


# --------------------------------------------------------------------------- mistral

_TOOL_CALLS = "[TOOL_CALLS]"


def _parse_mistral(text: str, tools: Sequence[dict[str, Any]] | None) -> Parsed:
    """``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}`` (an ``id``
    the model wrote is dropped: ids are the proxy's); text before the marker and after the list
    is the content. A list that is not such objects, or longer than MAX_TOOL_CALLS, stays."""
    head, tag, body = text.partition(_TOOL_CALLS)
    if not tag:
        return text, []
    pos = _skip_space(body, 0)
    got = _json_at(body, pos) if body.startswith("[", pos) else None
    if got is None or not isinstance(got[0], list) or not 0 < len(got[0]) <= MAX_TOOL_CALLS:
        return text, []
    calls: list[tuple[str, str]] = []
    for obj in got[0]:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, dict | str):
            return text, []
        calls.append((obj["name"], _arguments_text(args)))
    content = (head.strip() + " " + body[got[1] :].strip()).strip()
    return content or None, calls


# --------------------------------------------------------------------------- qwen3_coder

_XML_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


def _schema_types(tools: Sequence[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    """Parameter name -> its JSON schema ``type`` in the tool ``name`` (empty: not known)."""
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties")
            if isinstance(props, dict):
                return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def _typed_value(raw: str, kind: Any) -> Any:
    """A parameter's text as its schema type says (a value that does not fit stays text): no
    type or a string type: the text; integer, number, boolean (``true``, ``True``), null
    (``null``, ``None``: what the template writes for Python's values); otherwise JSON."""
    if isinstance(kind, list):  # ["integer", "null"]: the first type that is not null
        kind = next((k for k in kind if k != "null"), None)
    if kind is None or kind in _STRING_TYPES:
        return raw
    text = raw.strip()
    if text.lower() in ("null", "none"):  # the template writes a None value as "None"
        return None
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), raw)
    if kind in ("integer", "number"):
        try:
            number = float(text) if kind == "number" else int(text)
        except ValueError:
            return raw
        if isinstance(number, float) and number.is_integer() and "." not in text:
            return int(number)
        return number
    try:  # object, array, or a type we do not know: JSON when it is JSON
        return json_text(text)
    except ValueError:
        return raw


def _parse_qwen3_coder(text: str, tools: Sequence[dict[str, Any]] | None) -> Parsed:
    """``<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>``
    blocks; a value is the text between its tags less one newline each side, typed by the
    tool's schema. A block with anything else in it stays text."""
    if "<tool_call>" not in text:
        return text, []
    calls: list[tuple[str, str]] = []

    def take(match: re.Match[str]) -> str:
        fn = _XML_FUNCTION.fullmatch(match.group(1))
        if fn is None or len(calls) >= MAX_TOOL_CALLS:
            return match.group(0)
        name, body = fn.group(1).strip(), fn.group(2)
        types = _schema_types(tools, name)
        args: dict[str, Any] = {}
        pos = 0
        for p in _XML_PARAMETER.finditer(body):
            if body[pos : p.start()].strip():
                return match.group(0)
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[p.group(1).strip()] = _typed_value(value, types.get(p.group(1).strip()))
            pos = p.end()
        if body[pos:].strip() or not name:
            return match.group(0)
        calls.append((name, json.dumps(args, ensure_ascii=False)))
        return ""

    content = _XML_BLOCK.sub(take, text)
    if not calls:
        return text, []
    return content.strip() or None, calls


# --------------------------------------------------------------------------- choosing one

FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes", ("<tool_call>",), _parse_hermes),
    "llama3_json": ToolCallFormat("llama3_json", (_PYTHON_TAG,), _parse_llama3_json),
    "mistral": ToolCallFormat(
        "mistral", (_TOOL_CALLS,), _parse_mistral, string.ascii_letters + string.digits
    ),
    "qwen3_coder": ToolCallFormat("qwen3_coder", ("<tool_call>",), _parse_qwen3_coder),
}


def detect(template_source: str) -> FormatName:
    """The family a chat template renders tool calls in, from its text: ``<function=`` and
    ``<parameter=`` (qwen3_coder), ``[TOOL_CALLS]`` (mistral), ``<|python_tag|>`` or an
    ``ipython`` role with ``"parameters"`` (llama3_json); otherwise hermes."""
    src = template_source
    if "<function=" in src and "<parameter=" in src:
        return "qwen3_coder"
    if _TOOL_CALLS in src:
        return "mistral"
    if _PYTHON_TAG in src or ("ipython" in src and '"parameters"' in src):
        return "llama3_json"
    return "hermes"


def resolve(setting: str, template_source: str) -> ToolCallFormat:
    """The format for a setting: ``auto`` detects it from the template; a family's name is
    taken as is. Another name is a ChatTemplateError."""
    if setting == "auto":
        return FORMATS[detect(template_source)]
    if setting not in FORMATS:
        names = ", ".join(get_args(ToolFormatSetting))
        raise ChatTemplateError(f"unknown tool call format {setting!r} (one of {names})")
    return FORMATS[setting]
