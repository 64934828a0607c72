"""Streamed completions, the pure part (no I/O): reading a backend's server-sent events into
token chunks, and turning the tokens of a reply into text deltas as they come.

    SseParser       bytes as they arrive -> the ``data:`` payload of each complete event
    parse_chunk     one ``text_completion`` chunk (vLLM's streamed format, which the reference
                    server speaks too) -> TokenChunk: the step's token ids, their logprobs and
                    alternatives, the finish and stop reasons on the last
    IncrementalText token ids one by one -> text pieces, each handed out once it decodes to
                    complete UTF-8 (as vLLM's incremental detokenizer does)
    ContentStream   the text of a reply -> the content deltas a client may be sent now: with
                    tools, text from where a tool-call marker may be starting is held back
                    (the call is parsed from the whole reply at the end and sent as one
                    tool_calls delta), and so is trailing white space (the parsers strip it
                    before a call)

Formats of a streamed chunk (``vllm/entrypoints/openai/completion/serving.py``,
``completion_stream_generator``): ``choices[0].token_ids`` the step's ids (with
``return_token_ids``, vLLM >= 0.10.2), ``choices[0].logprobs`` the step's ``token_logprobs``,
``tokens`` ("token_id:N") and ``top_logprobs``, ``finish_reason`` / ``stop_reason`` on the chunk
of the last token; a usage chunk with ``choices: []``; an error as ``{"error": {...}}``;
``data: [DONE]`` at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_EVENT_BYTES",
    "ContentStream",
    "IncrementalText",
    "SseParser",
    "TokenChunk",
    "merge_chunks",
    "parse_chunk",
]

MAX_EVENT_BYTES = 1 << 20  # one event of a backend's stream (a chunk holds one step's tokens)
_NUMBER = (int, float)


class SseParser:
    """Server-sent events, fed bytes as they arrive: ``feed`` returns the ``data`` of every
    event completed by these bytes (several ``data:`` lines of one event joined by newlines;
    comments and other fields skipped; CRLF or LF line ends). ValueError for an event over
    ``max_event_bytes``."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buf = b""
        self._max = max_event_bytes

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *events, self._buf = buf.split(b"\n\n")
        if len(self._buf) > self._max:
            raise ValueError(f"a stream event over {self._max} bytes")
        out = []
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:  # one data line: the usual
                out.append(event[6:])
                continue
            lines = [
                line[5:].removeprefix(b" ")
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            ]
            if lines:
                out.append(b"\n".join(lines))
        return out


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """The tokens one streamed chunk adds (usually one decoding step). ``finish_reason`` and
    ``stop_reason`` are set on the chunk of the last token; ``policy_version`` is the reference
    server's (None from vLLM)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    policy_version: int | None = None
    model: str | None = None
    backend: str = ""  # set on the first chunk by the backend client
    # set by BackendPool on the last chunk before an interrupting weight update: the tokens
    # after it come from a continuation under the new policy (its first chunk names it)
    part_end: bool = False


def _token_id(t: Any) -> int:
    if not isinstance(t, str) or not t.startswith("token_id:"):
        raise ValueError(f"logprobs token {t!r:.40} is not of the form 'token_id:N'")
    try:
        return int(t[9:])
    except ValueError as exc:
        raise ValueError(f"logprobs token {t!r:.40} is not of the form 'token_id:N'") from exc


def parse_chunk(data: Any, top_k: int = 0) -> TokenChunk | None:
    """The TokenChunk of one parsed ``text_completion`` chunk; None for a chunk without tokens
    (the usage chunk, an empty step). ``top_k``: how many alternatives per token to keep.
    Raises ValueError for a chunk whose fields do not line up (an error event, ``{"error":
    ...}``, is the caller's to check first)."""
    if not isinstance(data, dict):
        raise ValueError("a stream chunk is not an object")
    choices = data.get("choices")
    if not isinstance(choices, list):
        raise ValueError("a stream chunk without `choices`")
    if not choices:
        return None
    choice = choices[0]
    if not isinstance(choice, dict):
        raise ValueError("a stream chunk's choice is not an object")
    lp = choice.get("logprobs") or {}
    logprobs = lp.get("token_logprobs") if isinstance(lp, dict) else None
    ids = choice.get("token_ids")
    if ids is None:  # vLLM < 0.10.2: the logprobs tokens carry the ids
        ids = [_token_id(t) for t in (lp.get("tokens") or [])] if isinstance(lp, dict) else []
    finish = choice.get("finish_reason")
    if not ids and finish is None:
        return None
    if not isinstance(ids, list):
        raise ValueError("a stream chunk's `token_ids` are not token ids")
    for t in ids:  # loops, not all(generator): this runs per token
        if type(t) is not int or not 0 <= t < 2**32:
            raise ValueError("a stream chunk's `token_ids` are not token ids")
    if not isinstance(logprobs, list) or len(logprobs) != len(ids):
        raise ValueError(f"{len(ids)} token ids but logprobs {logprobs!r:.80}")
    values = []
    for v in logprobs:
        if type(v) is float:
            values.append(v)
        elif isinstance(v, _NUMBER) and type(v) is not bool:
            values.append(float(v))
        else:
            raise ValueError("a generated token has no logprob")
    tops = None
    if top_k:
        steps = lp.get("top_logprobs")
        if not isinstance(steps, list) or len(steps) != len(ids):
            raise ValueError(f"top_logprobs for {len(ids)} tokens expected")
        tops = []
        for step in steps:
            if not isinstance(step, dict):
                raise ValueError("a top_logprobs step is not an object")
            pairs = [(_token_id(t), float(v)) for t, v in step.items() if v is not None]
            pairs.sort(key=lambda p: -p[1])
            tops.append(pairs[:top_k])
    version = data.get("policy_version")
    stop = choice.get("stop_reason")
    return TokenChunk(
        token_ids=ids,
        logprobs=values,
        top_logprobs=tops,
        finish_reason=str(finish) if finish is not None else None,
        stop_reason=stop if type(stop) is int else None,
        policy_version=version if type(version) is int and version >= 0 else None,
        model=data.get("model") if isinstance(data.get("model"), str) else None,
    )


def merge_chunks(chunks: Sequence[TokenChunk]) -> TokenChunk:
    """Several chunks that arrived together as one (their tokens in order; the finish and stop
    reasons, version and model of the last that has them): what came in one read is passed
    on, and sent to the client, in one piece."""
    if len(chunks) == 1:
        return chunks[0]
    ids = [t for c in chunks for t in c.token_ids]
    lps = [v for c in chunks for v in c.logprobs]
    tops = None
    if any(c.top_logprobs is not None for c in chunks):
        tops = [s for c in chunks for s in (c.top_logprobs or [[] for _ in c.token_ids])]
    last = chunks[-1]
    version = next((c.policy_version for c in chunks if c.policy_version is not None), None)
    return TokenChunk(
        token_ids=ids,
        logprobs=lps,
        top_logprobs=tops,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        policy_version=version,
        model=last.model,
        backend=chunks[0].backend,
    )


class IncrementalText:
    """Text of a growing list of token ids, handed out in pieces as the ids come: a piece is
    given once it decodes to complete UTF-8 (a character split across byte-level tokens waits
    for its last byte). Only a window of recent ids is decoded per token. ``flush()`` at the
    end gives what is left, so the pieces joined equal ``decode(ids)``. ``decode`` is a
    tokenizer's ``decode(ids) -> str``."""

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # the window starts here
        self._read = 0  # ids up to here are handed out as text

    def push(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        # an empty window decodes to "": not decoded (the first token's piece, one call less)
        before = (
            str(self._decode(self.ids[self._prefix : self._read]))
            if self._read > self._prefix
            else ""
        )
        after = str(self._decode(self.ids[self._prefix :]))
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        before = (
            str(self._decode(self.ids[self._prefix : self._read]))
            if self._read > self._prefix
            else ""
        )
        after = str(self._decode(self.ids[self._prefix :]))
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


def _partial_marker(text: str, markers: Sequence[str]) -> int:
    """Where a tool-call marker starts in ``text``, or may be starting at its end (a suffix
    that begins a marker); ``len(text)`` when neither."""
    cut = len(text)
    for m in markers:
        i = text.find(m)
        if i >= 0:
            cut = min(cut, i)
            continue
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


class ContentStream:
    """The content deltas of a reply whose text arrives piece by piece. Without tools every
    piece goes out as it comes. With tools (``markers``: the texts that open a tool call in
    the model's format), text from a marker on is held back for good, text that may be the
    start of a marker waits for the next piece, and trailing white space waits for what
    follows it; ``whole_json`` (Llama 3's format, where a whole reply that is a JSON object is
    a call) holds a reply while it is empty or starts with ``{``. ``finish(content)`` gives the
    rest of the final content (parsed from the whole reply) after what was sent."""

    def __init__(
        self, *, tools: bool, markers: Sequence[str] = (), whole_json: bool = False
    ) -> None:
        self.tools, self.markers, self.whole_json = tools, tuple(markers), whole_json
        self.text = ""
        self.sent = ""
        self._held = False

    def push(self, piece: str) -> str:
        self.text += piece
        if not self.tools:
            self.sent += piece
            return piece
        if self._held:
            return ""
        text = self.text
        if self.whole_json and (not text.strip() or text.lstrip().startswith("{")):
            return ""
        cut = _partial_marker(text, self.markers)
        if cut < len(text) and any(m in text for m in self.markers):
            self._held = True
        ready = text[:cut].rstrip()
        if len(ready) <= len(self.sent):
            return ""
        delta = ready[len(self.sent) :]
        self.sent = ready
        return delta

    def finish(self, content: str | None) -> str:
        """The rest of ``content`` after what was sent ("" when it does not continue it: the
        client then has the sent text, and the recorded call the exact tokens)."""
        final = content or ""
        if final.startswith(self.sent):
            rest = final[len(self.sent) :]
            self.sent = final
            return rest
        return ""
