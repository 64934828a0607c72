"""Tool-call formats (proxy/tool_formats.py): each family's parser, its bounds, detection from
the chat template, and the special-token markers kept when a reply is decoded (chat.py's
parse_reply through ChatTemplate.decode_for_tools)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from rollstream.inference.tinymodel import CHAT_TEMPLATE, train_tokenizer
from rollstream.producers.errors import ChatTemplateError
from rollstream.producers.proxy.chat import ChatTemplate, parse_reply
from rollstream.producers.proxy.openai_wire import MAX_JSON_DEPTH
from rollstream.producers.proxy.tool_formats import FORMATS, MAX_TOOL_CALLS, detect, resolve

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
HERMES, LLAMA = FORMATS["hermes"], FORMATS["llama3_json"]
MISTRAL, CODER = FORMATS["mistral"], FORMATS["qwen3_coder"]
XML = "<tool_call><function=f><parameter=o>{}</parameter></function></tool_call>"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": {"s": {"type": "string"}, "i": {"type": "integer"},
                         "x": {"type": "number"}, "b": {"type": "boolean"},
                         "o": {"type": "object"}, "a": {"type": "array"},
                         "n": {"type": ["integer", "null"]}}}}}]  # fmt: skip


def calls_of(fmt: Any, text: str, tools: Any = None) -> tuple[str | None, list[tuple[str, Any]]]:
    content, calls = fmt.parse(text, tools)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_detect_and_resolve() -> None:
    found = {p.name: detect(p.read_text()) for p in sorted(TEMPLATES.glob("*.jinja"))}
    assert found == {"chatml_qwen25.jinja": "hermes", "llama31.jinja": "llama3_json",
                     "mistral_v3.jinja": "mistral", "qwen3_coder.jinja": "qwen3_coder"}  # fmt: skip
    assert detect(CHAT_TEMPLATE) == "hermes"
    assert detect("{{ messages[0]['content'] }}") == "hermes"  # no markers: today's default
    assert resolve("auto", CHAT_TEMPLATE) is HERMES
    assert resolve("mistral", CHAT_TEMPLATE) is MISTRAL  # the setting wins over the template
    with pytest.raises(ChatTemplateError, match="unknown tool call format"):
        resolve("gorilla", CHAT_TEMPLATE)
    tok = train_tokenizer().backend_tokenizer
    assert ChatTemplate(tok, CHAT_TEMPLATE, tool_format="qwen3_coder").tool_format is CODER


def test_hermes() -> None:
    text = 'ok <tool_call>{"name": "f", "parameters": {"s": "a"}}</tool_call> '
    text += "<tool_call>{bad}</tool_call>"
    assert calls_of(HERMES, text) == ("ok  <tool_call>{bad}</tool_call>", [("f", {"s": "a"})])
    assert calls_of(HERMES, "<tool_call>[1]</tool_call>") == ("<tool_call>[1]</tool_call>", [])
    assert calls_of(HERMES, '<tool_call>{"name": "g"}</tool_call>') == (None, [("g", {})])
    _, calls = HERMES.parse('<tool_call>{"name": "g", "arguments": "{\\"k\\": 1}"}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"k": 1}'  # a string is taken as sent
    assert re.fullmatch(r"call_[0-9a-f]{16}", calls[0]["id"]) and calls[0]["type"] == "function"


def test_llama3_json() -> None:
    one = '{"name": "f", "parameters": {"s": "a;b"}}'
    assert calls_of(LLAMA, one) == (None, [("f", {"s": "a;b"})])
    assert calls_of(LLAMA, f"  {one} ; {one}\n") == (None, [("f", {"s": "a;b"})] * 2)
    assert calls_of(LLAMA, f"Let me check.<|python_tag|>{one}") == (
        "Let me check.", [("f", {"s": "a;b"})])  # fmt: skip
    assert calls_of(LLAMA, '{"name": "f", "arguments": {}}') == (None, [("f", {})])
    for text in ["The answer is 4.", f"{one} and more", f"{one};", f"{one}; oops",
                 '{"name": "f"}', '{"name": 3, "parameters": {}}', '{"name": "f", "parameters": 1}',
                 '{"name": "f", "parameters": {', '[{"name": "f", "parameters": {}}]',
                 f"Sure: {one}"]:  # fmt: skip
        assert calls_of(LLAMA, text) == (text, []), text


def test_mistral() -> None:
    text = ('Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"i": 1}, "id": "zzzzzzzzz"}, '
            '{"name": "g", "arguments": "{}"}] done')  # fmt: skip
    content, calls = MISTRAL.parse(text)
    assert content == "Sure. done"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("f", '{"i": 1}'), ("g", "{}")]  # fmt: skip
    ids = [c["id"] for c in calls]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids) and "zzzzzzzzz" not in ids
    for bad in ["[TOOL_CALLS] []", "[TOOL_CALLS] {}", '[TOOL_CALLS] [{"name": 1}]',
                '[TOOL_CALLS] [{"name": "f", "arguments": 3}]', "[TOOL_CALLS] [", "no calls",
                '[TOOL_CALLS] ["f"]']:  # fmt: skip
        assert calls_of(MISTRAL, bad) == (bad, []), bad


def test_qwen3_coder_values_are_typed_by_the_schema() -> None:
    params = {"s": "  two\nlines ", "i": "42", "x": "2.5", "b": "True", "o": '{"k": [1]}',
              "a": "[1, 2]", "n": "None", "u": "17"}  # fmt: skip
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    text = f"Thinking.\n<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"
    expected = {"s": "  two\nlines ", "i": 42, "x": 2.5, "b": True, "o": {"k": [1]},
                "a": [1, 2], "n": None, "u": "17"}  # fmt: skip
    assert calls_of(CODER, text, TOOLS) == ("Thinking.", [("f", expected)])
    untyped = {k: v.strip() if k != "s" else v for k, v in params.items()}
    assert calls_of(CODER, text)[1][0][1] == untyped  # no tools: every value is text
    wrong = text.replace("\n42\n", "\nforty\n").replace("\nTrue\n", "\nyes\n")
    values = calls_of(CODER, wrong, TOOLS)[1][0][1]
    assert (values["i"], values["b"]) == ("forty", "yes")  # a value that does not fit: text
    good = "<tool_call>\n<function=g>\n</function>\n</tool_call>"
    for bad in ["<tool_call><function=f>stray<parameter=s>x</parameter></function></tool_call>",
                "<tool_call><function=f><parameter=s>x</parameter></tool_call>",
                "<tool_call>{\"name\": \"f\"}</tool_call>",
                "<tool_call><function=f><parameter=s>x</function></tool_call>"]:  # fmt: skip
        assert calls_of(CODER, bad, TOOLS) == (bad, []), bad
        assert calls_of(CODER, bad + good, TOOLS) == (bad, [("g", {})])  # the good one is read


def test_bounds() -> None:
    """At most MAX_TOOL_CALLS calls a reply; JSON nested past MAX_JSON_DEPTH stays text, never
    a RecursionError, however deep."""
    block = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    content, calls = HERMES.parse(block * (MAX_TOOL_CALLS + 2))
    assert len(calls) == MAX_TOOL_CALLS and content == block * 2
    one = '{"name": "f", "parameters": {}}'
    assert len(LLAMA.parse(";".join([one] * MAX_TOOL_CALLS))[1]) == MAX_TOOL_CALLS
    assert LLAMA.parse(";".join([one] * (MAX_TOOL_CALLS + 1)))[1] == []
    entries = ", ".join(['{"name": "f", "arguments": {}}'] * (MAX_TOOL_CALLS + 1))
    many = f"[TOOL_CALLS] [{entries}]"
    assert MISTRAL.parse(many) == (many, [])
    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        deep = "[" * depth + "]" * depth
        for fmt, text in [
            (HERMES, f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>'),
            (LLAMA, f'{{"name": "f", "parameters": {{"k": {deep}}}}}'),
            (MISTRAL, f'[TOOL_CALLS] [{{"name": "f", "arguments": {{"k": {deep}}}}}]'),
            (CODER, XML.format(deep)),
        ]:
            content, calls = fmt.parse(text, TOOLS)
            if fmt is CODER:  # the value stays text, the call is made
                assert json.loads(calls[0]["function"]["arguments"]) == {"o": deep}
            else:
                assert (content, calls) == (text, []), (fmt.name, depth)


JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.text(st.characters(blacklist_characters="<"), max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(args=st.dictionaries(st.text(min_size=1, max_size=6), JSONISH, max_size=4),
       name=st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True))  # fmt: skip
def test_json_formats_read_back_what_they_write(args: dict[str, Any], name: str) -> None:
    obj = json.dumps(args, ensure_ascii=False)
    texts = {
        HERMES: f'<tool_call>\n{{"name": "{name}", "arguments": {obj}}}\n</tool_call>',
        LLAMA: f'{{"name": "{name}", "parameters": {obj}}}',
        MISTRAL: f'[TOOL_CALLS] [{{"name": "{name}", "arguments": {obj}}}]',
    }
    for fmt, text in texts.items():
        assert calls_of(fmt, text) == (None, [(name, args)]), fmt.name


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=60))
def test_text_without_a_call_is_left_as_it_is(text: str) -> None:
    for fmt in FORMATS.values():
        content, calls = fmt.parse(text, TOOLS)
        if not calls:
            assert content == text


@pytest.fixture(scope="module")
def base() -> str:
    return str(train_tokenizer().backend_tokenizer.to_str())


def _chat(base: str, template: str, special: list[str], eos: str) -> ChatTemplate:
    tok = Tokenizer.from_str(base)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    src = (TEMPLATES / template).read_text()
    return ChatTemplate(tok, src, special_tokens={"eos_token": eos})


def test_special_markers_are_kept_for_parsing(base: str) -> None:
    """Llama's <|python_tag|> and Mistral's [TOOL_CALLS] are special tokens, which decoding
    skips: the reply is read for calls with them kept, and its text stays without them."""
    llama = _chat(base, "llama31.jinja", ["<|python_tag|>", "<|eot_id|>", "<|eom_id|>"],
                  "<|eot_id|>")  # fmt: skip
    ids = llama.encode(
        'Let me check.<|python_tag|>{"name": "f", "parameters": {"s": "x"}}<|eom_id|>'
    )
    assert "<|python_tag|>" not in llama.decode(ids)
    reply = parse_reply(llama, ids, tools_enabled=True)
    assert reply.content == "Let me check." and reply.tool_calls[0]["function"]["name"] == "f"
    assert "<|eom_id|>" not in reply.text and "python_tag" not in reply.text
    off = parse_reply(llama, ids, tools_enabled=False)
    assert off.tool_calls == [] and off.content == llama.decode(ids)

    mistral = _chat(base, "mistral_v3.jinja", ["<s>", "</s>", "[TOOL_CALLS]"], "</s>")
    ids = mistral.encode('[TOOL_CALLS] [{"name": "f", "arguments": {"i": 2}}]</s>')
    assert mistral.decode(ids).startswith(" [")  # the marker is gone from the plain text
    reply = parse_reply(mistral, ids, tools_enabled=True)
    assert reply.content is None
    assert reply.tool_calls[0]["function"] == {"name": "f", "arguments": '{"i": 2}'}
    plain = mistral.encode("Hello</s>")
    assert parse_reply(mistral, plain, tools_enabled=True).content == "Hello"


def test_tool_formats_is_pure() -> None:
    """STYLE 1: no HTTP, Kafka, ClickHouse or torch import in tool_formats.py."""
    import rollstream.producers.proxy.tool_formats as mod

    tree = ast.parse(Path(str(mod.__file__)).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    assert roots <= {"__future__", "json", "re", "secrets", "string", "collections", "dataclasses",
                     "typing", "rollstream"}  # fmt: skip


def test_string_arguments_are_objects_only_for_templates_that_want_them(base: str) -> None:
    """A template that tests ``arguments is string`` gets the JSON text as sent; one that does
    not (Qwen2.5's applies tojson) gets the object; arguments that are not a JSON object stay."""
    fn: dict[str, Any] = {"name": "f", "arguments": '{"k":1}'}
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c", "type": "function", "function": fn}]}]  # fmt: skip
    tiny = ChatTemplate(Tokenizer.from_str(base), CHAT_TEMPLATE)
    assert '"arguments": {"k":1}}' in tiny.render(msgs, None, False)
    qwen = _chat(base, "chatml_qwen25.jinja", [], "<|im_end|>")
    assert '"arguments": {"k": 1}}' in qwen.render(msgs, None, False)
    assert fn["arguments"] == '{"k":1}'  # the caller's messages are left as they were
    fn["arguments"] = "not json"
    assert '"arguments": "not json"}' in qwen.render(msgs, None, False)
