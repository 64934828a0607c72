"""Chat rendering and retokenization-safe bookkeeping (proxy/chat.py), with the tiny model's
real tokenizer and ChatML template."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollstream.inference.tinymodel import CHAT_TEMPLATE, train_tokenizer
from rollstream.producers.proxy.chat import (
    ChatInputError,
    ChatMemory,
    ChatTemplate,
    ChatTemplateError,
    message_key,
    normalize_messages,
    normalize_tools,
    parse_reply,
    read_replies,
    read_reply,
    render_prompt,
    render_text,
    render_turn,
    tool_results,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]


@pytest.fixture(scope="module")
def hf_tok() -> Any:
    return train_tokenizer()


@pytest.fixture(scope="module")
def chat(hf_tok: Any) -> ChatTemplate:
    return ChatTemplate(
        hf_tok.backend_tokenizer, CHAT_TEMPLATE,
        special_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        max_model_len=2048,
    )  # fmt: skip


def ids_of(chat: ChatTemplate, pieces: list[str]) -> np.ndarray:
    """A NON-canonical tokenization: each piece one token (single characters are always in a
    byte-level vocabulary), e.g. "Hello" as H e l l o."""
    return np.array([chat.tokenizer.token_to_id(p) for p in pieces], dtype=np.uint32)


def byte_ids(chat: ChatTemplate, text: str) -> np.ndarray:
    return ids_of(chat, list(text.replace(" ", "Ġ"))) if text else np.zeros(0, np.uint32)


def eos(chat: ChatTemplate) -> np.ndarray:
    assert chat.eos_id is not None
    return np.array([chat.eos_id], dtype=np.uint32)


CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                  {"type": "text", "text": "in Paris?"}]}],
    [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
]  # fmt: skip


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_render_matches_transformers(
    chat: ChatTemplate, hf_tok: Any, conv: Any, tools: Any
) -> None:
    messages = normalize_messages(conv)
    ours = chat.render(messages, tools, True)
    theirs = hf_tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert ours == theirs
    prompt = render_prompt(chat, ChatMemory(), messages, tools)
    assert prompt.ids.tolist() == hf_tok(theirs, add_special_tokens=False)["input_ids"]
    assert prompt.reused == 0 and prompt.drift_tokens == 0


def test_generated_ids_are_spliced_and_drift_counted_once(chat: ChatTemplate) -> None:
    mem = ChatMemory()
    msgs = normalize_messages([{"role": "user", "content": "Say hello"}])
    p1 = render_prompt(chat, mem, msgs)
    gen = np.concatenate([byte_ids(chat, "Hello world"), eos(chat)])  # not how BPE writes it
    reply = parse_reply(chat, gen, tools_enabled=False)
    assert reply.content == "Hello world"
    mem.remember(len(msgs), reply, gen, "c1")

    msgs2 = normalize_messages([*msgs, reply.message(), {"role": "user", "content": "again"}])
    p2 = render_prompt(chat, mem, msgs2)
    seq1 = np.concatenate([p1.ids, gen])
    assert p2.ids[: len(seq1)].tolist() == seq1.tolist()  # append-only: the sampled ids
    naive = chat.encode(chat.render(msgs2, None, True))
    assert naive.tolist() != p2.ids.tolist()  # re-tokenizing would have lost them
    retok = [*chat.encode("Hello world").tolist(), chat.eos_id]
    expected = max(len(gen), len(retok)) - next(
        i for i, (a, b) in enumerate(zip(gen.tolist(), retok, strict=False)) if a != b
    )
    assert p2.drift_tokens == expected > 0
    assert p2.reused == 1

    gen2 = np.concatenate([chat.encode("Fine."), eos(chat)])  # canonical: no drift
    reply2 = parse_reply(chat, gen2, tools_enabled=False)
    mem.remember(len(msgs2), reply2, gen2, "c2")
    msgs3 = normalize_messages([*msgs2, reply2.message(), {"role": "user", "content": "bye"}])
    p3 = render_prompt(chat, mem, msgs3)
    seq2 = np.concatenate([p2.ids, gen2])
    assert p3.ids[: len(seq2)].tolist() == seq2.tolist()
    assert p3.drift_tokens == 0 and p3.reused == 2  # the first reply is not counted again
    assert mem.drift_tokens == expected and mem.drift_replies == 1 and mem.reused_replies == 3


def test_reply_cut_by_length_keeps_the_template_closing(chat: ChatTemplate) -> None:
    mem = ChatMemory()
    msgs = normalize_messages([{"role": "user", "content": "count"}])
    p1 = render_prompt(chat, mem, msgs)
    gen = byte_ids(chat, "one two")  # no stop token: finish_reason length
    reply = parse_reply(chat, gen, tools_enabled=False)
    mem.remember(len(msgs), reply, gen, "c1")
    p2 = render_prompt(chat, mem, normalize_messages([*msgs, reply.message()]), None,
                       add_generation_prompt=False)  # fmt: skip
    n = len(p1.ids) + len(gen)
    assert p2.ids[:n].tolist() == [*p1.ids.tolist(), *gen.tolist()]
    assert chat.decode(p2.ids[n:], skip_special_tokens=False) == "<|im_end|>\n"


def test_edited_reply_is_rendered_from_its_text(chat: ChatTemplate) -> None:
    mem = ChatMemory()
    msgs = normalize_messages([{"role": "user", "content": "Say hello"}])
    gen = np.concatenate([byte_ids(chat, "Hello world"), eos(chat)])
    mem.remember(1, parse_reply(chat, gen, tools_enabled=False), gen, "c1")
    edited = normalize_messages([*msgs, {"role": "assistant", "content": "Hello, world!"}])
    p = render_prompt(chat, mem, edited, None, add_generation_prompt=False)
    assert p.reused == 0 and p.retokenized == 1
    assert p.ids.tolist() == chat.encode(chat.render(edited, None, False)).tolist()


def test_reply_found_by_text_at_another_position(chat: ChatTemplate) -> None:
    mem = ChatMemory()
    gen = np.concatenate([byte_ids(chat, "Hi"), eos(chat)])
    mem.remember(1, parse_reply(chat, gen, tools_enabled=False), gen, "c1")
    msgs = normalize_messages([{"role": "system", "content": "summary of earlier turns"},
                               {"role": "user", "content": "x"},
                               {"role": "assistant", "content": " Hi "}])  # fmt: skip
    p = render_prompt(chat, mem, msgs, None, add_generation_prompt=False)
    assert p.reused == 1 and gen.tolist() == p.ids[-len(gen) - 1 : -1].tolist()


def test_tool_call_round_trip(chat: ChatTemplate) -> None:
    mem = ChatMemory()
    msgs = normalize_messages([{"role": "user", "content": "Weather in Paris?"}])
    p1 = render_prompt(chat, mem, msgs, TOOLS)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    gen = np.concatenate([chat.encode(text), eos(chat)])
    reply = parse_reply(chat, gen, tools_enabled=True)
    assert reply.content is None and len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    mem.remember(len(msgs), reply, gen, "c1")
    # the harness sends the call back with its arguments re-serialised, then the tool result
    args = json.dumps({"city": "Paris"}, indent=2)
    back = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": args}}]}  # fmt: skip
    msgs2 = normalize_messages([*msgs, back, {"role": "tool", "tool_call_id": call["id"],
                                              "content": "sunny, 21C"}])  # fmt: skip
    p2 = render_prompt(chat, mem, msgs2, TOOLS)
    assert p2.reused == 1
    assert p2.ids[: len(p1.ids) + len(gen)].tolist() == [*p1.ids.tolist(), *gen.tolist()]
    results = tool_results(mem, msgs2)
    assert [(r.name, r.result, r.at_call_id) for r in results] == [
        ("get_weather", "sunny, 21C", "c1")
    ]
    assert tool_results(mem, msgs2) == []  # reported once


def test_the_pipeline_steps_render_then_read_the_reply(chat: ChatTemplate) -> None:
    """render_turn (step 2) and read_reply (after the backend): the same ids and tool calls as
    the building blocks, tool results found but left for the recorder to claim, errors with the
    param and code the proxy answers with."""
    mem = ChatMemory()
    user = [{"role": "user", "content": "Weather in Paris?"}]
    turn = render_turn(chat, mem, messages=user, tools=TOOLS, stop=["\n"])
    alone = render_prompt(chat, ChatMemory(), normalize_messages(user), TOOLS)
    assert turn.prompt.ids.tolist() == alone.ids.tolist()
    assert turn.tools_enabled and turn.messages == 1 and turn.tool_results == []
    assert turn.stop_token_ids == chat.encode("\n").tolist()
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    gen = np.concatenate([chat.encode(text), eos(chat)])
    reply = read_reply(chat, mem, turn, gen, "c1", token_texts=True)
    (call,) = reply.tool_calls
    assert reply.token_texts is not None and len(reply.token_texts) == len(gen)
    back = [*user, reply.message(), {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
    turn2 = render_turn(chat, mem, messages=back, tools=TOOLS)
    assert turn2.prompt.reused == 1 and [t.result for t in turn2.tool_results] == ["ok"]
    assert render_turn(chat, mem, messages=back, tools=TOOLS).tool_results  # not claimed yet
    assert mem.claim_tool_result(call["id"]) and not mem.claim_tool_result(call["id"])
    assert render_turn(chat, mem, messages=back, tools=TOOLS).tool_results == []
    none = render_turn(chat, mem, messages=back, tools=TOOLS, tool_choice="none")
    assert not none.tools_enabled
    with pytest.raises(ChatInputError) as err:
        render_turn(chat, mem, messages=[{"role": "user"}])
    assert (err.value.param, err.value.code) == ("messages[0].content", "invalid_value")
    with pytest.raises(ChatInputError) as err:
        render_turn(chat, mem, messages=user, stop=["two words"])
    assert (err.value.param, err.value.code) == ("stop", "unsupported")
    assert render_text(chat, "Hi there").ids.tolist() == chat.encode("Hi there").tolist()
    assert render_text(chat, [1, 2]).ids.dtype == np.uint32
    with pytest.raises(ChatInputError) as err:
        render_text(chat, [1, 10**9])
    assert err.value.param == "prompt"


def test_parse_reply_keeps_invalid_blocks_as_text(chat: ChatTemplate) -> None:
    text = "let me see <tool_call>{not json}</tool_call>"
    reply = parse_reply(chat, chat.encode(text), tools_enabled=True)
    assert reply.tool_calls == [] and reply.content == text
    good = 'ok <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_reply(chat, chat.encode(good), tools_enabled=False).tool_calls == []
    both = parse_reply(chat, chat.encode(good), tools_enabled=True)
    assert both.content == "ok" and both.tool_calls[0]["function"]["arguments"] == "{}"


def test_message_key_canonical() -> None:
    a = message_key(" hi ", [{"function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}])
    b = message_key("hi", [{"function": {"name": "f", "arguments": '{"a":2,"b":1}'}}])
    assert a == b
    assert message_key("hi") != message_key("hi", [{"function": {"name": "f", "arguments": "{}"}}])


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
         "messages[0].content[0]"),
        ([{"role": "assistant", "tool_calls": [{"function": {}}]}],
         "messages[0].tool_calls[0].function.name"),
    ],
)  # fmt: skip
def test_normalize_messages_rejects(raw: Any, param: str) -> None:
    with pytest.raises(ChatInputError) as err:
        normalize_messages(raw)
    assert err.value.param == param


def test_normalize_tools() -> None:
    assert normalize_tools(None) is None and normalize_tools([]) is None
    assert normalize_tools(TOOLS) == TOOLS
    with pytest.raises(ChatInputError):
        normalize_tools([{"type": "code_interpreter"}])
    with pytest.raises(ChatInputError):
        normalize_tools({"a": 1})


def test_template_errors_are_input_errors(hf_tok: Any) -> None:
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    chat = ChatTemplate(hf_tok.backend_tokenizer, strict + "{{ messages[0]['content'] }}")
    with pytest.raises(ChatInputError, match="user first"):
        chat.render(normalize_messages([{"role": "system", "content": "x"}]))
    with pytest.raises(ChatTemplateError):
        ChatTemplate(hf_tok.backend_tokenizer, "{% if %}")
    with pytest.raises(ChatInputError) as err:  # as the pipeline step: the messages are at fault
        render_turn(chat, ChatMemory(), messages=[{"role": "system", "content": "x"}])
    assert (err.value.param, err.value.code) == ("messages", None)


def test_from_dir(tmp_path: Path, hf_tok: Any) -> None:
    hf_tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    chat = ChatTemplate.from_dir(tmp_path)
    assert chat.max_model_len == 512 and chat.eos_id == hf_tok.convert_tokens_to_ids("<|im_end|>")
    msgs = normalize_messages([{"role": "user", "content": "hi"}])
    assert chat.render(msgs) == hf_tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                           tokenize=False)  # fmt: skip
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_dir(tmp_path / "missing")


def test_piece_cache_is_bounded(chat: ChatTemplate) -> None:
    mem = ChatMemory(max_pieces=4)
    for i in range(10):
        render_prompt(chat, mem, normalize_messages([{"role": "user", "content": f"q{i}"}]))
    assert len(mem.pieces) == 4
    mem = ChatMemory(max_piece_chars=100)
    for i in range(10):
        render_prompt(chat, mem, normalize_messages([{"role": "user", "content": f"q{i}" * 20}]))
    assert mem.piece_chars <= 100 and len(mem.pieces) <= 1


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(turns=st.lists(st.lists(st.integers(3, 511), min_size=1, max_size=12), min_size=1,
                      max_size=4),
       stop=st.booleans())  # fmt: skip
def test_any_sampled_ids_give_append_only_prompts(
    chat: ChatTemplate, turns: list[list[int]], stop: bool
) -> None:
    """Whatever the model samples (even ids that decode to broken UTF-8), each prompt extends
    the previous call's prompt + completion exactly."""
    mem, msgs = ChatMemory(), [{"role": "user", "content": "start"}]
    prev: np.ndarray | None = None
    for i, sampled in enumerate(turns):
        prompt = render_prompt(chat, mem, normalize_messages(msgs), TOOLS)
        if prev is not None:
            assert prompt.ids[: len(prev)].tolist() == prev.tolist()
        gen = np.asarray(sampled + ([chat.eos_id] if stop else []), dtype=np.uint32)
        reply = parse_reply(chat, gen, tools_enabled=True)
        mem.remember(len(msgs), reply, gen, f"c{i}")
        msgs += [reply.message(), {"role": "user", "content": f"turn {i}"}]
        prev = np.concatenate([prompt.ids, gen])


_PIECES = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<|endoftext|>", " ",
           "  ", "\n", "\t", "a", "hello", " world", "é", "<|im", "_end|>", "<", "|", "{\"x\": 2}",
           "1", "ü", "😀"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(_PIECES), max_size=30))
def test_segment_cache_encodes_like_the_tokenizer(parts: list[str]) -> None:
    """encode() cuts at added tokens and caches the pieces between them: the same ids as
    tokenizing the whole text, cached or not, and arrays the caller may change."""
    chat = _shared_chat()
    text = "".join(parts)
    whole = chat.tokenizer.encode(text, add_special_tokens=False).ids
    assert chat._split is not None
    first, again = chat.encode(text), chat.encode(text)
    assert first.tolist() == again.tolist() == whole
    assert first.dtype == np.uint32
    first[:] = 0  # a copy: the cache is not changed through it
    assert chat.encode(text).tolist() == whole


_CHAT: list[ChatTemplate] = []


def _shared_chat() -> ChatTemplate:
    if not _CHAT:
        _CHAT.append(ChatTemplate(train_tokenizer().backend_tokenizer, CHAT_TEMPLATE))
    return _CHAT[0]


def test_segment_cache_off_when_added_tokens_strip_spaces(hf_tok: Any) -> None:
    """An added token with rstrip eats the spaces after it: cutting there would not give the
    tokenizer's ids, so encode() tokenizes the whole text."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    tok.add_special_tokens([AddedToken("<|sep|>", rstrip=True, lstrip=True)])
    chat = ChatTemplate(tok, CHAT_TEMPLATE)
    assert chat._split is None
    text = "a  <|sep|>  b <|im_end|>\n x"
    assert chat.encode(text).tolist() == tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("name", ["chat", "messages", "chat_template", "openai_wire"])
def test_chat_modules_are_pure(name: str) -> None:
    """STYLE 1: the chat step (chat.py, messages.py, chat_template.py) and the wire format
    (openai_wire.py) import no HTTP, Kafka or ClickHouse library."""
    import importlib

    mod = importlib.import_module(f"rollstream.producers.proxy.{name}")
    tree = ast.parse(Path(str(mod.__file__)).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    forbidden = {"httpx", "starlette", "uvicorn", "confluent_kafka", "faust", "clickhouse_connect",
                 "chdb", "aiokafka"}  # fmt: skip
    assert roots & forbidden == set()


def test_read_replies_remembers_every_choice_and_the_next_turn_follows_the_one_sent_back(
    chat: ChatTemplate,
) -> None:
    """n choices of one request: each reply is remembered at the request's position, so the
    next request splices in the generated ids of whichever choice the harness sent back; equal
    texts are one key and choice 0's ids win."""
    mem = ChatMemory()
    user = [{"role": "user", "content": "Name a colour."}]
    turn = render_turn(chat, mem, messages=user)
    texts = ["Red", "Blue", "Red"]
    gens = [np.concatenate([byte_ids(chat, t), eos(chat)]) for t in texts]  # non-canonical
    gens[2] = np.concatenate([chat.encode("Red"), eos(chat)])  # same text, other ids
    replies = read_replies(chat, mem, turn, [(g, None, None) for g in gens], ["c0", "c1", "c2"])
    assert [r.content for r in replies] == texts
    for k, want in ((1, "c1"), (0, "c0"), (2, "c0")):  # choice 2's text is choice 0's
        back = [*user, replies[k].message(), {"role": "user", "content": "Another."}]
        nxt = render_turn(chat, mem, messages=back)
        assert nxt.prompt.reused == 1
        gen = mem.lookup(1, message_key(texts[k]))
        assert gen is not None and gen.call_id == want
        start = len(turn.prompt.ids)
        spliced = nxt.prompt.ids[start : start + len(gen.ids)]
        assert spliced.tolist() == gen.ids.tolist()
        assert nxt.prompt.ids[:start].tolist() == turn.prompt.ids.tolist()


def test_read_reply_gives_the_text_of_each_alternative(chat: ChatTemplate) -> None:
    mem = ChatMemory()
    turn = render_turn(chat, mem, messages=[{"role": "user", "content": "hi"}])
    gen = chat.encode("Hello there")
    alts = [[int(t), int(chat.encode("x")[0])] for t in gen.tolist()]
    reply = read_reply(chat, mem, turn, gen, "c1", token_texts=True, top_ids=alts)
    assert reply.token_texts is not None and reply.top_texts is not None
    assert [t[0] for t in reply.top_texts] == reply.token_texts
    assert all(t[1] == "x" for t in reply.top_texts)
    assert "".join(reply.token_texts) == "Hello there"
    plain = read_reply(chat, mem, turn, gen, "c2", token_texts=True)
    assert plain.top_texts is None and plain.tool_choice_met is None


def test_tool_choice_none_required_and_named(chat: ChatTemplate) -> None:
    """ "none" keeps the tools in the prompt (the same prompt as "auto") but parses no tool call;
    "required" and a named function are checked against the tools and reported as met or not
    (no constrained decoding: the reply is what was sampled)."""
    user = [{"role": "user", "content": "Weather in Paris?"}]
    tools2 = [*TOOLS, {"type": "function", "function": {"name": "get_time"}}]
    auto = render_turn(chat, ChatMemory(), messages=user, tools=tools2, tool_choice="auto")
    none = render_turn(chat, ChatMemory(), messages=user, tools=tools2, tool_choice="none")
    assert none.prompt.ids.tolist() == auto.prompt.ids.tolist()
    assert auto.tools_enabled and not none.tools_enabled
    assert auto.required_tool is None and none.required_tool is None
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    gen = np.concatenate([chat.encode(call), eos(chat)])
    assert read_reply(chat, ChatMemory(), none, gen, "c").tool_calls == []
    named = {"type": "function", "function": {"name": "get_time"}}
    cases = [("required", gen, True), ("required", chat.encode("no tool"), False),
             ({"type": "function", "function": {"name": "get_weather"}}, gen, True),
             (named, gen, False)]  # fmt: skip
    for choice, ids, met in cases:
        mem = ChatMemory()
        turn = render_turn(chat, mem, messages=user, tools=tools2, tool_choice=choice)
        assert turn.tools_enabled and turn.required_tool is not None
        assert turn.prompt.ids.tolist() == auto.prompt.ids.tolist()
        assert read_reply(chat, mem, turn, ids, "c").tool_choice_met is met, choice
    bad = [({"type": "function", "function": {"name": "nope"}}, tools2), ("required", None)]
    for choice, tools in bad:
        with pytest.raises(ChatInputError) as err:
            render_turn(chat, ChatMemory(), messages=user, tools=tools, tool_choice=choice)
        assert (err.value.param, err.value.code) == ("tool_choice", "invalid_value")


def test_drift_equals_the_common_prefix_count(chat: ChatTemplate) -> None:
    """_drift's shortcut for generated ids equal to the re-tokenized text gives what the
    common-prefix count gives, for equal ids of either dtype and for every kind of difference."""
    from rollstream.producers.proxy.chat import _drift, _Generation
    from rollstream.producers.sdk.context import common_prefix

    text = "Sure, here is a short answer."
    naive = chat.encode(text + "<|im_end|>")
    variants = [
        naive,
        naive.astype(np.int64),
        naive[:-1],
        np.concatenate([naive, naive[:1]]),
        np.concatenate([naive[:2], naive[3:]]),
        naive[::-1].copy(),
        np.zeros(0, np.uint32),
    ]
    for ids in variants:
        memory = ChatMemory()
        gen = _Generation("c", ids, 1, text)
        shared = common_prefix(naive, ids)
        want = 0 if shared == len(naive) == len(ids) else max(len(naive), len(ids)) - shared
        got = _drift(chat, memory, gen, {"role": "assistant", "content": text}, "<|im_end|>")
        assert got == want, ids
