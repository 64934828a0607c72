"""Chat messages -> token IDs, with the token IDs that were actually generated kept (pure; no I/O).

The recording proxy is token in, token out: it renders OpenAI chat messages with the model's own
chat template (Jinja, as transformers runs it), tokenizes them, and sends token IDs to the
backend. A harness, though, sends its history back as TEXT. Re-tokenizing an assistant turn's
text often gives other IDs than the ones the model sampled (BPE is not injective: " hello" can be
sampled as " h" + "ello"), so training on the re-tokenized history would train on tokens the
policy never produced, and the next prompt would not extend the previous call's sequence.

Approach (piecewise rendering with sentinels)::

    messages            [sys, user, ASSISTANT(known), tool, ASSISTANT(unknown), user]
    render (one pass)   "<|im_start|>system ... assistant\\n" S0 "<|im_end|>\\n<|im_start|>tool ..."
                         '----------- text piece 0 -----------'  '-------- text piece 1 -------->
    token ids           encode(piece 0)  +  generated ids of S0  +  encode(piece 1) ...

1. ``ChatMemory`` remembers, per rollout, the generated IDs of each assistant reply the proxy
   returned, keyed by (position in the message list, canonical text of the reply: content
   stripped + tool calls with JSON arguments normalised). A later request's assistant message
   that matches a remembered reply (same position and text; else the same text at another
   position) is a KNOWN segment; any other assistant message is rendered from its text.
2. The conversation is rendered ONCE with each known assistant message replaced by a unique
   sentinel string as its content (tool calls dropped). The template places the sentinel exactly
   where the model's own emission went: after the generation prompt ("...assistant\\n"), before
   the template's closing ("<|im_end|>\\n").
3. The text is split at the sentinels. Text pieces are tokenized (one call per piece, memoised
   per rollout so an append-only conversation only tokenizes its new text); each sentinel is
   replaced by the generated IDs. When those end with a special stop token and the text after
   the sentinel starts with that token's text, that text is skipped (the model emitted it).

Why the result extends the previous call exactly: turn n's prompt was ``encode(render(m[:k],
add_generation_prompt=True))``, which is the text before the sentinel of reply k at turn n+1,
cut at the same earlier sentinels; so the new prompt starts with the old prompt's IDs followed
by the old completion's IDs, and the context trie sees an append-only call. Pieces are cut only
right after the generation prompt and right after the emission (before a special token in
ChatML-like templates), so a piece is tokenized the same way the model saw it. Text a template
adds between the generation prompt and a reply in history (``chat.history_gap``: Mistral's " "
before the content) is cut from the piece before a known reply: the model generated right after
the prompt. Limits: a template that renders the generation prompt otherwise differently from an
in-history assistant header (e.g. Qwen3's empty think block) gives a rewind instead of an
append; a template that looks at an assistant message's tool_calls outside the message itself
renders known segments without them.

Drift: the first time a remembered reply comes back, its text is rendered (after a one-word
user turn, then cut out of the template's wrapping) and re-tokenized; if that differs from the
generated IDs, the tokens from the first difference on
(``max(len(generated), len(retokenized)) - common prefix``) are counted as drift: what a
re-tokenizing proxy would have gotten wrong. ``RenderedPrompt.drift_tokens`` feeds
``LlmCall.drift_tokens``; each reply is counted once per rollout, so the rollout's total is the
sum over its calls.

Replies: generated IDs are decoded (special tokens skipped); with tools enabled, each
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` block holding valid JSON becomes an
OpenAI tool call and is removed from the content (the tiny model's template renders tool calls
back the same way). ``tool_choice``: "none" renders the tools (the prompt stays the one the
other turns extend) but parses no tool call; "required" or a named function cannot be forced
without constrained decoding, so the reply is read as sampled and ``tool_choice_met`` says
whether it holds a (matching) tool call.

Several choices of one request (``n`` > 1, ``read_replies``): every reply is remembered at the
same position, so whichever the harness sends back in its next request is found and its
generated ids spliced in (the next call then extends that choice); two choices with the same
text are one key, and choice 0's ids are the ones kept.

The proxy's pipeline calls two steps here, each once per call: ``render_turn`` (step 2: normalize
the messages and tools, render, splice in generated ids, count drift, find new tool results, turn
stop strings into token ids) before the budget and the backend, and ``read_reply`` (decode the
completion, parse tool calls, remember the reply) after it. ``render_text`` is step 2 of a text
completion. The building blocks (``normalize_messages``, ``render_prompt``, ``parse_reply``...)
stay public.

Errors (producers/errors.py): ChatInputError (a ChatError and a ValueError) with ``param`` and
``code`` for input that cannot be rendered; ChatTemplateError for a model without a template.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from rollstream.producers.errors import ChatError, ChatInputError, ChatTemplateError
from rollstream.producers.proxy.chat_template import ChatTemplate
from rollstream.producers.proxy.messages import message_key, normalize_messages, normalize_tools
from rollstream.producers.sdk.context import common_prefix

__all__ = [
    "AssistantReply",
    "ChatError",
    "ChatInputError",
    "ChatMemory",
    "ChatTemplate",
    "ChatTemplateError",
    "ChatTurn",
    "RenderedPrompt",
    "TextTurn",
    "ToolResult",
    "message_key",
    "normalize_messages",
    "normalize_tools",
    "parse_reply",
    "read_replies",
    "read_reply",
    "render_prompt",
    "render_text",
    "render_turn",
    "stop_token_ids",
    "tool_results",
]

_U32 = np.dtype("<u4")
Tokens = npt.NDArray[Any]


# --------------------------------------------------------------------------- per-rollout memory


@dataclass(slots=True)
class _Generation:
    call_id: str
    ids: Tokens
    position: int
    key: str
    counted: bool = False


class ToolResult(NamedTuple):
    """A tool message answering a tool call the proxy returned (becomes a ToolCall event)."""

    tool_call_id: str
    name: str
    arguments: str
    result: str
    at_call_id: str


@dataclass(slots=True)
class ChatMemory:
    """What the proxy remembers about one rollout's chat: the generated IDs of its replies, the
    tool calls it returned, and a cache of tokenized text pieces. Not thread-safe (one rollout;
    the proxy's event loop serialises access)."""

    max_pieces: int = 4096  # cached text pieces, and the characters they may hold in all
    max_piece_chars: int = 4 << 20
    by_key: dict[tuple[int, str], _Generation] = field(default_factory=dict)
    by_text: dict[str, _Generation] = field(default_factory=dict)
    pieces: OrderedDict[str, Tokens] = field(default_factory=OrderedDict)
    # tool_call_id -> (name, arguments, call_id of the reply)
    tool_calls: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    tool_results_seen: set[str] = field(default_factory=set)
    drift_tokens: int = 0  # totals over the rollout
    drift_replies: int = 0
    reused_replies: int = 0
    piece_chars: int = 0

    def remember(
        self, position: int, reply: AssistantReply, ids: Tokens, call_id: str
    ) -> None:  # fmt: skip
        """Record the reply returned for a request of ``position`` messages."""
        gen = _Generation(call_id, ids, position, message_key(reply.content, reply.tool_calls))
        self.by_key[(position, gen.key)] = gen
        self.by_text[gen.key] = gen
        for call in reply.tool_calls:
            fn = call["function"]
            self.tool_calls[call["id"]] = (fn["name"], fn["arguments"], call_id)

    def claim_tool_result(self, tool_call_id: str) -> bool:
        """True the first time a tool result is reported (then it is recorded), else False."""
        if tool_call_id in self.tool_results_seen:
            return False
        self.tool_results_seen.add(tool_call_id)
        return True

    def lookup(self, position: int, key: str) -> _Generation | None:
        return self.by_key.get((position, key)) or self.by_text.get(key)

    def encode(self, chat: ChatTemplate, text: str) -> Tokens:
        ids = self.pieces.get(text)
        if ids is None:
            ids = chat.encode(text)
            self.pieces[text] = ids
            self.piece_chars += len(text)
            while self.pieces and (
                len(self.pieces) > self.max_pieces or self.piece_chars > self.max_piece_chars
            ):
                old, _ = self.pieces.popitem(last=False)
                self.piece_chars -= len(old)
        else:
            self.pieces.move_to_end(text)
        return ids


# --------------------------------------------------------------------------- rendering


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    ids: Tokens  # (N,) uint32: the full prompt
    drift_tokens: int  # drift counted in this call (replies seen back for the first time)
    reused: int  # assistant messages whose generated ids were spliced in
    retokenized: int  # assistant messages rendered from text (not generated here, or edited)


def render_prompt(
    chat: ChatTemplate,
    memory: ChatMemory,
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> RenderedPrompt:
    """Token ids of normalised ``messages`` (see the module docstring for the method)."""
    render_msgs: list[dict[str, Any]] = []
    known: list[tuple[_Generation, dict[str, Any]]] = []
    retokenized = 0
    for pos, msg in enumerate(messages):
        if msg["role"] != "assistant":
            render_msgs.append(msg)
            continue
        gen = memory.lookup(pos, message_key(msg.get("content"), msg.get("tool_calls")))
        if gen is None:
            retokenized += 1
            render_msgs.append(msg)
            continue
        render_msgs.append({"role": "assistant", "content": chat.sentinel(len(known))})
        known.append((gen, msg))
    text = chat.render(render_msgs, tools, add_generation_prompt)
    if not known:
        return RenderedPrompt(memory.encode(chat, text), 0, 0, retokenized)

    parts: list[Tokens] = []
    drift = 0
    pieces = chat._sentinel_re.split(text)  # [text, index, text, index, ..., text]
    skip = 0  # characters of the next piece already emitted by the model (its stop token)
    for i in range(0, len(pieces), 2):
        piece = pieces[i][skip:]
        gap = chat.history_gap  # the template's text before a reply, not the model's
        if gap and i + 1 < len(pieces) and piece.endswith(gap):
            piece = piece[: -len(gap)]
        if piece:
            parts.append(memory.encode(chat, piece))
        if i + 1 >= len(pieces):
            break
        gen, msg = known[int(pieces[i + 1])]
        parts.append(gen.ids)
        stop = chat.special_text(int(gen.ids[-1])) if len(gen.ids) else None
        skip = len(stop) if stop and pieces[i + 2].startswith(stop) else 0
        if not gen.counted:
            gen.counted = True
            drift += _drift(chat, memory, gen, msg, stop if skip else None)
    memory.drift_tokens += drift
    memory.drift_replies += drift > 0
    memory.reused_replies += len(known)
    ids = np.concatenate(parts) if parts else np.zeros(0, _U32)
    return RenderedPrompt(ids, drift, len(known), retokenized)


def _drift(
    chat: ChatTemplate, memory: ChatMemory, gen: _Generation, msg: dict[str, Any], stop: str | None
) -> int:
    """Tokens a re-tokenizing proxy would have gotten wrong for this reply (0: none). A reply
    without tool calls is its content; one with tool calls is rendered by the template."""
    text = chat.emission_text(msg) if msg.get("tool_calls") else (msg.get("content") or "")
    naive = memory.encode(chat, text + (stop or ""))
    if naive.dtype == gen.ids.dtype and naive.tobytes() == gen.ids.tobytes():
        return 0  # the usual case, without numpy's per-call cost on the first token's path
    shared = common_prefix(naive, gen.ids)
    if shared == len(naive) == len(gen.ids):
        return 0
    return max(len(naive), len(gen.ids)) - shared


# --------------------------------------------------------------------------- replies


@dataclass(frozen=True, slots=True)
class AssistantReply:
    """The OpenAI assistant message for generated ids."""

    text: str  # decoded, special tokens skipped
    content: str | None
    tool_calls: list[dict[str, Any]]
    token_texts: list[str] | None = None  # each generated token's text (read_reply, on demand)
    top_texts: list[list[str]] | None = None  # the text of each step's alternatives (on demand)
    tool_choice_met: bool | None = None  # a tool call was required: whether the reply has one

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def parse_reply(
    chat: ChatTemplate,
    ids: Tokens,
    *,
    tools_enabled: bool,
    call_id_prefix: str = "call_",
    tools: Sequence[dict[str, Any]] | None = None,
) -> AssistantReply:
    """Decode generated ids; with tools, the tool calls written in the model's format
    (``chat.tool_format``: hermes ``<tool_call>{json}</tool_call>`` blocks, Llama 3's JSON,
    Mistral's ``[TOOL_CALLS]``, Qwen3-Coder's XML; tool_formats.py) become OpenAI tool calls;
    text that is not a well-formed call stays content. ``tools`` (the request's) type the
    values of formats that write them as text."""
    text = chat.decode(ids)
    if not tools_enabled:
        return AssistantReply(text, text, [])
    content, calls = chat.tool_format.parse(
        chat.decode_for_tools(ids, text), tools, id_prefix=call_id_prefix
    )
    if not calls:
        return AssistantReply(text, text, [])
    return AssistantReply(text, content, calls)


def _pending_tool_results(
    memory: ChatMemory, messages: Sequence[dict[str, Any]]
) -> list[ToolResult]:
    """Tool messages answering tool calls this rollout's replies made, not reported yet."""
    out = []
    for msg in messages:
        if msg["role"] != "tool":
            continue
        tid = msg.get("tool_call_id", "")
        ref = memory.tool_calls.get(tid)
        if ref is None or tid in memory.tool_results_seen:
            continue
        out.append(ToolResult(tid, ref[0], ref[1], msg.get("content") or "", ref[2]))
    return out


def tool_results(memory: ChatMemory, messages: Sequence[dict[str, Any]]) -> list[ToolResult]:
    """Tool messages answering tool calls this rollout's replies made, not reported before
    (each is reported once: ``memory.claim_tool_result``)."""
    return [
        tr
        for tr in _pending_tool_results(memory, messages)
        if memory.claim_tool_result(tr.tool_call_id)
    ]


# --------------------------------------------------------------------------- pipeline steps


def stop_token_ids(chat: ChatTemplate, stop: Sequence[str]) -> list[int]:
    """The token id of each stop string (the backends stop on token ids: one token each)."""
    ids = [chat.encode(s) for s in stop]
    if any(len(i) != 1 for i in ids):
        msg = "`stop` strings must each be one token here (the backend stops on token ids)"
        raise ChatInputError(msg, "stop", code="unsupported")
    return [int(i[0]) for i in ids]


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """A chat request rendered for one rollout: what the budget, the backend, the recorder and
    ``read_reply`` need of it."""

    prompt: RenderedPrompt
    messages: int  # how many messages the request had: the position of its reply
    tools_enabled: bool  # tools given and tool_choice not "none": parse tool calls in the reply
    stop_token_ids: list[int]
    tool_results: list[ToolResult]  # tool messages answering earlier replies, not recorded yet
    required_tool: str | None = None  # tool_choice "required" (""), a named function, else None
    tools: list[dict[str, Any]] | None = None  # the request's tools (types of XML call values)


def render_turn(
    chat: ChatTemplate,
    memory: ChatMemory,
    *,
    messages: Any,
    tools: Any = None,
    tool_choice: Any = None,
    add_generation_prompt: bool = True,
    stop: Sequence[str] = (),
) -> ChatTurn:
    """Step 2 of a chat call: normalize the OpenAI ``messages`` and ``tools`` as sent, render
    them into token ids with the generated ids of earlier replies spliced in (drift counted),
    find the tool results that answer earlier replies, and turn ``stop`` into token ids.
    Raises ChatInputError (``param``, ``code``) for input that cannot be rendered."""
    msgs = normalize_messages(messages)
    tool_list = normalize_tools(tools)
    required = _required_tool(tool_choice, tool_list)
    stop_ids = stop_token_ids(chat, stop)
    try:
        prompt = render_prompt(
            chat, memory, msgs, tool_list, add_generation_prompt=add_generation_prompt
        )
    except ChatInputError as exc:
        raise ChatInputError(str(exc), exc.param or "messages", code=exc.code) from exc
    return ChatTurn(
        prompt=prompt,
        messages=len(msgs),
        tools_enabled=tool_list is not None and tool_choice != "none",
        stop_token_ids=stop_ids,
        tool_results=_pending_tool_results(memory, msgs),
        required_tool=required,
        tools=tool_list,
    )


def _required_tool(tool_choice: Any, tools: list[dict[str, Any]] | None) -> str | None:
    """The tool call ``tool_choice`` requires: "" for any ("required"), a function's name, or
    None (none required). A required call without tools, or a name that is not one of them,
    is a ChatInputError on ``tool_choice``."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    name = "" if tool_choice == "required" else str(tool_choice["function"]["name"])
    names = {t["function"]["name"] for t in tools or ()}
    if not names:
        msg = "`tool_choice` requires a tool call but no `tools` were given"
        raise ChatInputError(msg, "tool_choice", code="invalid_value")
    if name and name not in names:
        msg = f"`tool_choice` names {name!r}, which is not one of the `tools`"
        raise ChatInputError(msg, "tool_choice", code="invalid_value")
    return name


def read_reply(
    chat: ChatTemplate,
    memory: ChatMemory,
    turn: ChatTurn,
    token_ids: Tokens,
    call_id: str,
    *,
    stop_reason: int | None = None,
    token_texts: bool = False,
    top_ids: Sequence[Sequence[int]] | None = None,
) -> AssistantReply:
    """After the backend answered ``turn``: decode the generated ids into the assistant message
    (tool calls parsed when the turn has tools; a stop token the request asked for is not part
    of the text), remember them for the rollout's next turns, and with ``token_texts`` give each
    token's text (for logprobs) and the text of each step's alternatives ``top_ids``."""
    ids = token_ids
    user_stop = stop_reason is not None and len(ids) > 0 and int(ids[-1]) == stop_reason
    reply = parse_reply(
        chat, ids[:-1] if user_stop else ids, tools_enabled=turn.tools_enabled, tools=turn.tools
    )
    memory.remember(turn.messages, reply, ids, call_id)
    if turn.required_tool is not None:
        met = any(turn.required_tool in ("", c["function"]["name"]) for c in reply.tool_calls)
        reply = dataclasses.replace(reply, tool_choice_met=met)
    if token_texts:
        singles = [[t] for t in ids.tolist()]
        alts = [[int(t)] for step in top_ids or () for t in step]
        texts = list(chat.tokenizer.decode_batch(singles + alts, skip_special_tokens=False))
        top_texts = None
        if top_ids is not None:
            flat = iter(texts[len(singles) :])
            top_texts = [[next(flat) for _ in step] for step in top_ids]
        reply = dataclasses.replace(reply, token_texts=texts[: len(singles)], top_texts=top_texts)
    return reply


def read_replies(
    chat: ChatTemplate,
    memory: ChatMemory,
    turn: ChatTurn,
    completions: Sequence[tuple[Tokens, int | None, Sequence[Sequence[int]] | None]],
    call_ids: Sequence[str],
    *,
    token_texts: bool = False,
) -> list[AssistantReply]:
    """``read_reply`` for each choice of one request (``completions``: token ids, stop reason,
    alternatives' ids), in choice order. All are remembered at the request's position; the
    last one remembered wins a tie of equal texts, so they are read from the last choice to
    the first: choice 0 is the one the memory continues from."""
    replies = [
        read_reply(
            chat, memory, turn, ids, call_id, stop_reason=stop, token_texts=token_texts, top_ids=top
        )
        for (ids, stop, top), call_id in zip(reversed(completions), reversed(call_ids), strict=True)
    ]
    return replies[::-1]


@dataclass(frozen=True, slots=True)
class TextTurn:
    """A text completion's prompt as token ids, and its stop token ids."""

    ids: Tokens
    stop_token_ids: list[int]


def render_text(chat: ChatTemplate, prompt: str | list[int], stop: Sequence[str] = ()) -> TextTurn:
    """Step 2 of a text completion: a string prompt tokenized, or token ids checked against the
    vocabulary (ChatInputError, param ``prompt``)."""
    if isinstance(prompt, str):
        ids = chat.encode(prompt)
    else:
        arr = np.asarray(prompt, dtype=np.int64)
        vocab = chat.tokenizer.get_vocab_size(with_added_tokens=True)
        if arr.min() < 0 or arr.max() >= vocab:
            raise ChatInputError(f"token ids must be in [0, {vocab})", "prompt")
        ids = arr.astype(np.uint32)
    return TextTurn(ids, stop_token_ids(chat, stop))
