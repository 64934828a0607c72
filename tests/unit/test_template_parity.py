"""Rendering parity with transformers, and tool-call round trips, for chat templates shaped like
the major model families' (tests/fixtures/templates/): ChatML with tools (Qwen2.5, hermes
calls), Llama 3.1 (JSON calls, ipython results), Mistral v0.3 ([AVAILABLE_TOOLS] /
[TOOL_CALLS]) and Qwen3-Coder (XML calls).

Each family's tokenizer is the tiny model's byte-level BPE with the family's special tokens
added, saved by transformers (``PreTrainedTokenizerFast.save_pretrained``) and loaded by
``ChatTemplate.from_dir``: the text and the token ids of ``ChatTemplate.render`` /
``render_prompt`` are compared with ``apply_chat_template``'s. transformers is given tool call
arguments as objects, the shape its documentation asks for (what the proxy passes such
templates); the proxy is given the OpenAI messages as a harness sends them."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer
from transformers import PreTrainedTokenizerFast

from rollstream.inference.tinymodel import CHAT_TEMPLATE, train_tokenizer
from rollstream.producers.proxy.chat import (
    ChatInputError,
    ChatMemory,
    ChatTemplate,
    normalize_messages,
    normalize_tools,
    read_reply,
    render_prompt,
    render_turn,
)

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class Family:
    template: str  # file under tests/fixtures/templates
    tool_format: str  # what detect() must find
    special: tuple[str, ...]  # special tokens of the family
    added: tuple[str, ...]  # added tokens that are not special (kept by decode)
    bos: str | None
    eos: str


FAMILIES = {
    "qwen25": Family("chatml_qwen25.jinja", "hermes", CHATML, ("<tool_call>", "</tool_call>"),
                     None, "<|im_end|>"),
    "llama31": Family("llama31.jinja", "llama3_json",
                      ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                       "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"), (),
                      "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": Family("mistral_v3.jinja", "mistral",
                      ("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                       "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
                       "[/TOOL_RESULTS]"), (), "<s>", "</s>"),
    "qwen3_coder": Family("qwen3_coder.jinja", "qwen3_coder", CHATML,
                          ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
                          None, "<|im_end|>"),
}  # fmt: skip

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {"type": "object"},
                "fresh": {"type": "boolean"},
                "limit": {"type": ["integer", "null"]},
            },
        },
    },
}
TOOLS = [WEATHER, SEARCH]


def call(cid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}  # fmt: skip


SYSTEM = {"role": "system", "content": "You are a careful assistant."}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
ONE_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [call("abcDEF123", "get_weather", {"city": "Paris", "days": 2})],
}
TWO_CALLS = {"role": "assistant", "content": "Checking both.",
             "tool_calls": [call("abcDEF123", "get_weather", {"city": "Paris"}),
                            call("xyzUVW789", "search", {"query": "Paris events",
                                                         "filters": {"lang": "fr"},
                                                         "fresh": True})]}  # fmt: skip
RESULT = {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny, 21C"}
RESULT2 = {"role": "tool", "tool_call_id": "xyzUVW789", "content": "a concert"}
SUNNY = {"role": "assistant", "content": "It is sunny in Paris."}
MORE = {"role": "user", "content": "And tomorrow?"}

CONVERSATIONS = {
    "user": [ASK],
    "system_user": [SYSTEM, ASK],
    "tool_call_and_result": [SYSTEM, ASK, ONE_CALL, RESULT],
    "tool_turn_then_user": [SYSTEM, ASK, ONE_CALL, RESULT, SUNNY, MORE],
    "two_calls": [ASK, TWO_CALLS, RESULT, RESULT2],
    "turns": [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": "Tell me a joke."},
              {"role": "assistant", "content": " Why did the chicken cross the road? "}, MORE],
}  # fmt: skip


def named_arguments(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def for_transformers(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers documents them: tool call arguments as objects."""
    out = copy.deepcopy(messages)
    for msg in out:
        for c in msg.get("tool_calls") or ():
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, ChatTemplate]]:
    """Per family: transformers' tokenizer and the proxy's ChatTemplate of the same saved
    model directory."""
    base = train_tokenizer().backend_tokenizer.to_str()
    out = {}
    for name, fam in FAMILIES.items():
        tok = Tokenizer.from_str(base)
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fam.special])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam.added])
        hf = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=fam.bos, eos_token=fam.eos,
            clean_up_tokenization_spaces=False, model_max_length=4096,
        )  # fmt: skip
        hf.chat_template = (TEMPLATES / fam.template).read_text()
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        out[name] = (hf, ChatTemplate.from_dir(path))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_tool_format_is_detected_from_the_template(
    models: dict[str, tuple[Any, ChatTemplate]], family: str
) -> None:
    _, chat = models[family]
    assert chat.tool_format.name == FAMILIES[family].tool_format
    assert chat.object_arguments  # none of these templates takes arguments as text
    tiny = ChatTemplate(train_tokenizer().backend_tokenizer, CHAT_TEMPLATE)
    assert tiny.tool_format.name == "hermes" and not tiny.object_arguments


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [True, False])
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_render_equals_transformers(
    models: dict[str, tuple[Any, ChatTemplate]],
    family: str,
    conv: str,
    with_tools: bool,
    add_generation_prompt: bool,
) -> None:
    hf, chat = models[family]
    messages = normalize_messages(CONVERSATIONS[conv])
    tools = normalize_tools(TOOLS if with_tools else None)
    kwargs: dict[str, Any] = {"tools": tools, "add_generation_prompt": add_generation_prompt}
    try:
        theirs = hf.apply_chat_template(for_transformers(messages), tokenize=False, **kwargs)
    except jinja2.TemplateError as exc:  # the template refuses it (Llama 3.1: one call a turn)
        with pytest.raises(ChatInputError, match=re.escape(str(exc))):
            chat.render(messages, tools, add_generation_prompt)
        return
    assert chat.render(messages, tools, add_generation_prompt) == theirs
    ids = hf.apply_chat_template(
        for_transformers(messages), tokenize=True, return_dict=False, **kwargs
    )
    prompt = render_prompt(
        chat, ChatMemory(), messages, tools, add_generation_prompt=add_generation_prompt
    )
    assert prompt.ids.tolist() == list(ids)
    if "tool_calls" in json.dumps(CONVERSATIONS[conv]):  # the calls are in the text
        assert "Paris" in theirs and ("get_weather" in theirs)


# The replies a model of each family writes for a call (after the generation prompt, before
# its stop token), and the calls they mean.
PARIS = ("get_weather", {"city": "Paris", "days": 3})
EVENTS = ("search", {"query": "Paris\nevents", "filters": {"lang": "fr", "n": [1, 2]},
                     "fresh": False, "limit": None})  # fmt: skip
REPLIES: dict[str, list[tuple[str, list[tuple[str, dict[str, Any]]]]]] = {
    "qwen25": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
         "</tool_call>", [PARIS]),
        ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
         '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": '
         '"Paris\\nevents", "filters": {"lang": "fr", "n": [1, 2]}, "fresh": false, '
         '"limit": null}}\n</tool_call>', [PARIS, EVENTS]),
    ],
    "llama31": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', [PARIS]),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
         [PARIS]),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
         '{"name": "search", "arguments": {"query": "Paris\\nevents", "filters": {"lang": '
         '"fr", "n": [1, 2]}, "fresh": false, "limit": null}}]', [PARIS, EVENTS]),
    ],
    "qwen3_coder": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", [PARIS]),
        ("Let me look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
         "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=search>\n<parameter=query>\nParis\nevents\n</parameter>\n"
         '<parameter=filters>\n{"lang": "fr", "n": [1, 2]}\n</parameter>\n<parameter=fresh>\n'
         "False\n</parameter>\n<parameter=limit>\nNone\n</parameter>\n</function>\n"
         "</tool_call>", [PARIS, EVENTS]),
    ],
}  # fmt: skip
CASES = [(family, i) for family, replies in REPLIES.items() for i in range(len(replies))]


@pytest.mark.parametrize(("family", "index"), CASES)
def test_a_reply_in_the_family_format_round_trips(
    models: dict[str, tuple[Any, ChatTemplate]], family: str, index: int
) -> None:
    """The model's reply parses into its calls; rendered back in history, the calls give the
    text the model wrote (Mistral's template adds the call ids to it); the next turn, with the
    tool results, extends the previous call's ids (the generated ids kept)."""
    _, chat = models[family]
    text, expected = REPLIES[family][index]
    mem = ChatMemory()
    user = [ASK]
    turn = render_turn(chat, mem, messages=user, tools=TOOLS)
    prompt_text = chat.render(normalize_messages(user), normalize_tools(TOOLS), True)
    assert turn.prompt.ids.tolist() == chat.encode(prompt_text).tolist()
    assert chat.eos_id is not None
    gen = np.concatenate([chat.encode(text), np.array([chat.eos_id], np.uint32)])

    reply = read_reply(chat, mem, turn, gen, "c1")
    got = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls
    ]
    assert got == expected
    assert reply.content == ("Let me look." if text.startswith("Let me look.") else None)
    ids = [c["id"] for c in reply.tool_calls]
    assert len(set(ids)) == len(ids)
    if family == "mistral":
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)  # what its template takes

    history = chat.render(normalize_messages([*user, reply.message()]), normalize_tools(TOOLS))
    written = text
    if family == "mistral":  # its template writes each call's id after the arguments
        parts = iter(ids)
        written = re.sub(r"\}\}(?=, \{|\]$)", lambda m: f'}}, "id": "{next(parts)}"}}', text)
    assert history.startswith(prompt_text + written + FAMILIES[family].eos)
    # and what the template wrote back reads as the same calls
    assert named_arguments(chat.tool_format.parse(written, normalize_tools(TOOLS))[1]) == got

    results = [{"role": "tool", "tool_call_id": i, "content": f"result {n}"}
               for n, i in enumerate(ids)]  # fmt: skip
    turn2 = render_turn(chat, mem, messages=[*user, reply.message(), *results], tools=TOOLS)
    assert turn2.prompt.reused == 1
    head = [*turn.prompt.ids.tolist(), *gen.tolist()]
    assert turn2.prompt.ids[: len(head)].tolist() == head
    assert [r.name for r in turn2.tool_results] == [name for name, _ in expected]
