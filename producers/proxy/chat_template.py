"""A model's chat template and tokenizer, rendering exactly as transformers'
``apply_chat_template`` does, without importing transformers (pure; no I/O past loading).

The template is compiled once in a sandboxed Jinja environment configured like transformers'
(trim/lstrip blocks, loop controls, its ``tojson``, ``raise_exception``, ``strftime_now``, the
``{% generation %}`` tag) and the special tokens are passed as variables; the tokenizer is the
model's ``tokenizer.json`` run by the ``tokenizers`` library. ``chat.py`` builds on it.

Tool calls: the template's text names the format the model writes tool calls in
(``tool_formats.detect``; a setting may name it instead), kept as ``tool_format``. Assistant
tool calls arrive with OpenAI's JSON-text ``arguments``; a template that does not test whether
``arguments`` is a string (Qwen2.5, Llama 3.1, Mistral and Qwen3-Coder's templates apply
``tojson`` or ``|items`` to it) gets them as objects, the shape transformers documents and vLLM
passes (``object_arguments``); arguments that are not a JSON object stay text.

Errors (producers/errors.py): ChatTemplateError when the model directory has no usable
tokenizer or chat template, ChatInputError when the template rejects the messages; both are
ChatError, a ProxyError.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
import numpy.typing as npt
from jinja2.runtime import new_context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from rollstream.producers.errors import ChatError, ChatInputError, ChatTemplateError
from rollstream.producers.proxy.openai_wire import json_text
from rollstream.producers.proxy.tool_formats import ToolCallFormat, resolve

__all__ = ["ChatError", "ChatInputError", "ChatTemplate", "ChatTemplateError"]

_U32 = np.dtype("<u4")
Tokens = npt.NDArray[Any]


# --------------------------------------------------------------------------- template + tokenizer


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant mask tag): body only."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    # transformers' override: no HTML escaping, json.dumps options exposed
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


# a template that tests the type of ``arguments`` itself (``arguments is string``) takes them
# as sent; any other is given objects (see the module docstring)
_ARGUMENTS_TYPE_TEST = re.compile(r"arguments[\]'\"]*\s+is\s+(?:not\s+)?(?:string|mapping)")


def _object_arguments(messages: Sequence[dict[str, Any]]) -> Sequence[dict[str, Any]]:
    """``messages`` with each assistant tool call's JSON-object ``arguments`` text as the
    object (new dicts where changed; the input is left as it is)."""
    out: list[dict[str, Any]] | None = None
    for i, msg in enumerate(messages):
        calls = msg.get("tool_calls")
        if not calls:
            continue
        new_calls = []
        for call in calls:
            fn = call.get("function")
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if isinstance(args, str):
                try:
                    value = json_text(args)
                except ValueError:
                    value = None
                if isinstance(value, dict):
                    call = {**call, "function": {**fn, "arguments": value}}
            new_calls.append(call)
        if out is None:
            out = list(messages)
        out[i] = {**msg, "tool_calls": new_calls}
    return messages if out is None else out


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template and its tokenizer (``tokenizers.Tokenizer``), rendering the way
    ``transformers``' ``apply_chat_template`` does (sandboxed Jinja, trim/lstrip blocks, the same
    ``tojson``, special tokens as variables). Thread-safe; one per model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str,
        *,
        special_tokens: dict[str, str] | None = None,
        max_model_len: int | None = None,
        name: str = "",
        tool_format: str = "auto",
    ) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self._env = env
        # Template.render merges the globals (a ChainMap) into a new context on every call;
        # merged once here, each render builds its context from a plain dict (same variables)
        self._globals = dict(self._template.globals)
        self.tokenizer = tokenizer
        self.source = template
        self.name = name
        self.special_tokens = dict(special_tokens or {})
        self.max_model_len = max_model_len
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._special_text = {i: added[i].content for i in self.special_ids}
        eos = self.special_tokens.get("eos_token")
        eos_id = tokenizer.token_to_id(eos) if eos else None
        self.eos_id: int | None = eos_id
        self.tool_format: ToolCallFormat = resolve(tool_format, template)
        # the format's markers that are special tokens here: kept when a reply is read for calls
        self._marker_ids = frozenset(
            i for i in self.special_ids if self._special_text[i] in self.tool_format.markers
        )
        self.object_arguments = _ARGUMENTS_TYPE_TEST.search(template) is None
        self._segments: dict[str, Tokens] = {}  # text between added tokens -> its ids
        self._segment_chars = 0
        self._split = self._segment_splitter(tokenizer, added)
        nonce = secrets.token_hex(6)
        self._sentinel = f"\ue000rs{nonce}#{{}}\ue001"
        self._sentinel_re = re.compile(f"\ue000rs{nonce}#(\\d+)\ue001")
        # how the template wraps an assistant message's own part (for drift counting)
        self._probe_head: list[dict[str, Any]] = [{"role": "user", "content": "?"}]
        self._around: tuple[str, str] | None = None
        # text a template writes between the generation prompt and an assistant message's
        # content in history (Mistral: " "), which the model did not see when it generated
        self.history_gap = ""
        probe = {"role": "assistant", "content": self.sentinel(0)}
        with contextlib.suppress(ChatInputError):
            head, _, tail = self.render([*self._probe_head, probe], None, False).partition(
                self.sentinel(0)
            )
            prompt = self.render(self._probe_head, None, True)
            if head.startswith(prompt):
                head, self.history_gap = prompt, head[len(prompt) :]
            self._around = (head, tail)

    @classmethod
    def from_dir(
        cls, path: str | Path, *, max_model_len: int | None = None, tool_format: str = "auto"
    ) -> ChatTemplate:
        """Load ``tokenizer.json`` and the chat template (``chat_template.jinja`` or
        ``tokenizer_config.json``'s ``chat_template``) of a local model directory;
        ``tool_format``: ``auto`` (detected from the template) or a format's name."""
        p = Path(path)
        try:
            tokenizer = Tokenizer.from_file(str(p / "tokenizer.json"))
            config = _read_json(p / "tokenizer_config.json")
            model_config = _read_json(p / "config.json")
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises plain Exception
            raise ChatTemplateError(f"cannot load the tokenizer of {p}: {exc}") from exc
        template: Any = None
        if (p / "chat_template.jinja").is_file():
            template = (p / "chat_template.jinja").read_text()
        else:
            template = config.get("chat_template")
            if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in template}
                template = named.get("default") or next(iter(named.values()), None)
        if not isinstance(template, str) or not template:
            raise ChatTemplateError(f"no chat template in {p}")
        special = {
            k: v
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (v := _token_content(config.get(k))) is not None
        }
        if max_model_len is None:
            max_model_len = model_config.get("max_position_embeddings") or config.get(
                "model_max_length"
            )
        return cls(
            tokenizer, template, special_tokens=special,
            max_model_len=int(max_model_len) if max_model_len else None, name=p.name,
            tool_format=tool_format,
        )  # fmt: skip

    def sentinel(self, index: int) -> str:
        return self._sentinel.format(index)

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The template's text for ``messages`` (raises ChatInputError on a template error)."""
        t = self._template
        if self.object_arguments:
            messages = _object_arguments(messages)
        variables = {**self._globals, "messages": messages, "tools": tools or None,
                     "documents": None, "add_generation_prompt": add_generation_prompt,
                     **self.special_tokens, **kwargs}  # fmt: skip
        try:
            # what Template.render does, minus re-merging the globals and rewriting tracebacks
            context = new_context(self._env, t.name, t.blocks, variables, True, None, None)
            return str(self._env.concat(t.root_render_func(context)))
        except jinja2.TemplateError as exc:
            raise ChatInputError(f"the chat template rejected the messages: {exc}") from exc
        except (TypeError, KeyError, AttributeError) as exc:
            raise ChatInputError(f"the chat template cannot render the messages: {exc}") from exc

    MAX_SEGMENTS = 65_536  # the shared segment cache: entries, and characters (x 64) in all

    def _segment_splitter(
        self, tokenizer: Tokenizer, added: dict[int, Any]
    ) -> re.Pattern[str] | None:
        """A regex matching the added tokens the way ``tokenizers`` splits on them (leftmost,
        longest first), or None when splitting there would not give the same ids: an added
        token that strips spaces or matches whole words only, or one matched after a
        normalizer, or a Metaspace pre-tokenizer that treats the first split apart."""
        if not added or '"prepend_scheme":"first"' in tokenizer.to_str().replace(" ", ""):
            return None
        for t in added.values():
            if t.lstrip or t.rstrip or t.single_word or (t.normalized and tokenizer.normalizer):
                return None
        self._added_ids = {t.content: np.asarray([i], dtype=_U32) for i, t in added.items()}
        contents = sorted(self._added_ids, key=len, reverse=True)
        split = re.compile("|".join(re.escape(c) for c in contents))
        # and check it: each added token between text, spaces and newlines, both ways
        self._split = split
        probe = "".join(f"x{c} y\n{c}\n\n  z{c}{c}{c.upper()}" for c in contents) + " end "
        if self.encode(probe).tolist() != self._encode_whole(probe).tolist():
            return None
        return split

    def _encode_whole(self, text: str) -> Tokens:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=_U32)

    def encode(self, text: str) -> Tokens:
        """Token ids of ``text`` (special tokens in the text become their ids; no BOS added).

        ``tokenizers`` cuts the text at added tokens (``<|im_start|>``...) and tokenizes each
        piece between them on its own, so this does the same and remembers each piece's ids in
        a cache shared by every caller: the template's scaffolding (``\n``, ``assistant\n``)
        and text repeated across rollouts (a group's system prompt and tool list) are
        tokenized once. When the tokenizer's added tokens do not allow that cut (see
        ``_segment_splitter``; checked against the tokenizer at load), the whole text is
        tokenized every time."""
        split = self._split
        if split is None:
            return self._encode_whole(text)
        parts: list[Tokens] = []
        pos = 0
        for m in split.finditer(text):
            start = m.start()
            if start > pos:
                parts.append(self._segment(text[pos:start]))
            parts.append(self._added_ids[m.group()])
            pos = m.end()
        if pos < len(text):
            parts.append(self._segment(text[pos:]))
        if len(parts) == 1:
            return parts[0].copy()
        return np.concatenate(parts) if parts else np.zeros(0, _U32)

    def _segment(self, text: str) -> Tokens:
        ids = self._segments.get(text)
        if ids is None:
            ids = self._encode_whole(text)
            ids.flags.writeable = False  # shared: callers get a view they cannot change
            if (
                len(self._segments) >= self.MAX_SEGMENTS
                or self._segment_chars > 64 * self.MAX_SEGMENTS
            ):
                self._segments.clear()  # rarely: simpler and thread-safe, unlike an LRU
                self._segment_chars = 0
            self._segments[text] = ids
            self._segment_chars += len(text)
        return ids

    def decode(self, ids: Any, *, skip_special_tokens: bool = True) -> str:
        seq = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        return str(self.tokenizer.decode(seq, skip_special_tokens=skip_special_tokens))

    def decode_for_tools(self, ids: Any, decoded: str | None = None) -> str:
        """``ids`` decoded for reading tool calls: special tokens skipped, except the ones that
        open a tool call in this model's format (Mistral's ``[TOOL_CALLS]``, Llama's
        ``<|python_tag|>``). ``decoded``: ``decode(ids)`` when the caller has it already
        (returned as is when no such token is among the ids)."""
        marks = self._marker_ids
        if not marks and decoded is not None:  # no marker is a special token here
            return decoded
        seq = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        if not marks or marks.isdisjoint(seq):
            return self.decode(seq) if decoded is None else decoded
        special = self.special_ids
        kept = [t for t in seq if t not in special or t in marks]
        return str(self.tokenizer.decode(kept, skip_special_tokens=False))

    @property
    def marker_ids(self) -> frozenset[int]:
        """The special tokens that open a tool call in this model's format (kept when a reply
        is read for tool calls)."""
        return self._marker_ids

    def special_text(self, token_id: int) -> str | None:
        """The text of a special token (``<|im_end|>``), None for ordinary tokens."""
        return self._special_text.get(token_id)

    def emission_text(self, message: dict[str, Any]) -> str:
        """What the template writes for an assistant message's own part (content + tool calls),
        without the generation prompt before it and the closing after it."""
        if self._around is not None:
            head, tail = self._around
            with contextlib.suppress(ChatInputError):
                real = self.render([*self._probe_head, message], None, False)
                if real.startswith(head) and real.endswith(tail) and len(real) >= len(head + tail):
                    return real[len(head) : len(real) - len(tail)]
        content = message.get("content")
        return content if isinstance(content, str) else ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
