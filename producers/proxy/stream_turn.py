"""A chat call answered as it is generated (``stream: true``, one choice): steps 5 and 6 of the
pipeline (service.py) run as the backend's tokens arrive, and each API turns the content deltas
into its own events (chat completion chunks here, ``chat_events``; Anthropic's in
messages_api.py; OpenAI Responses' in responses_api.py).

    Proxy.open_stream      steps 2-4 up to the backend's FIRST token: render, budget, route,
                           failover; every failure so far is an HTTP error answer (4xx/5xx)
    StreamedTurn.deltas()  then, per chunk of tokens: the text they complete (incremental
                           detokenization: only whole UTF-8 characters go out), held back
                           from where a tool-call marker may start (streaming.ContentStream);
                           after the last token: the reply read as a whole (tool calls parsed,
                           remembered for the next turn) and the LlmCall recorded, once,
                           with exactly the streamed token ids and logprobs

Outcomes that do not end in an LlmCall, each recorded as a RolloutError of the call (with the
request's tool results first, as for any failed call):

- the backend fails after the first token (cut off, an error event, a malformed chunk): code
  502; the client gets an error event (OpenAI: ``data: {"error": ...}``, which the openai
  client raises as an APIError; Anthropic: ``event: error``), then the end of the stream. Not
  retried: the client has tokens of this sample already.
- the client hangs up before the last token: code 499 ("the client closed the stream after N
  tokens"); the backend request is ended by closing its connection (the reference server and
  vLLM abort a request whose client went away). The partial sample is not recorded as an
  LlmCall: the harness never saw the whole reply, so no later call extends it, and a trainer
  would learn from an answer cut off at a random point.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollstream.adapters.asgi_stream import LastPart
from rollstream.producers.errors import ApiError, BackendError
from rollstream.producers.proxy.backends import Completion, TokenChunk
from rollstream.producers.proxy.chat import AssistantReply, ChatTemplate, ChatTurn, read_reply
from rollstream.producers.proxy.openai_wire import (
    FINISH_REASONS,
    CallParams,
    SseTemplate,
    chat_chunk,
    dumps,
    error_body,
    stream_logprobs,
    usage,
)
from rollstream.producers.proxy.rollout_api import OpenRollout
from rollstream.producers.proxy.streaming import ContentStream, IncrementalText

__all__ = ["Delta", "StreamedTurn", "chat_events"]

CLIENT_CLOSED = 499  # the code of the RolloutError of a stream the client hung up on
DRAIN_S = 1.0  # how long the end of a finished backend stream ([DONE]) is waited for


@dataclass(frozen=True, slots=True)
class Delta:
    """Content that may be sent now (``text``, possibly empty) and the completion's tokens
    that arrived with it (``start``..``end``: their logprobs go with this delta)."""

    text: str
    start: int
    end: int


Record = Callable[[OpenRollout, str, np.ndarray, Completion, int, list[Any]], None]
Fail = Callable[[OpenRollout, str, list[Any], str, int, str], None]


class StreamedTurn:
    """One streamed chat call after its first token (``Proxy.open_stream`` makes it). Iterate
    ``deltas()`` once; afterwards ``out`` (the Completion), ``reply`` (the AssistantReply)
    and ``rest`` (content still to send) are set. ``close()`` when the answer is sent."""

    def __init__(
        self,
        *,
        chat: ChatTemplate,
        ro: OpenRollout,
        turn: ChatTurn,
        prompt: np.ndarray,
        call_id: str,
        params: CallParams,
        first: TokenChunk,
        chunks: AsyncGenerator[TokenChunk, None],
        drift: int,
        model: str,
        record: Record,
        fail: Fail,
        started: float,
    ) -> None:
        self.chat, self.ro, self.turn, self.prompt = chat, ro, turn, prompt
        self.call_id, self.params, self.drift, self.model = call_id, params, drift, model
        self._first: TokenChunk | None = first
        self._chunks, self._record, self._fail, self._started = chunks, record, fail, started
        self.backend = first.backend
        self.policy_version = first.policy_version or 0
        # parts before an interrupting weight update: (token count, policy version) each
        self.parts: list[tuple[int, int]] = []
        self._part_start = 0
        self._new_part = False
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] | None = [] if params.top_logprobs else None
        self.out: Completion | None = None
        self.reply: AssistantReply | None = None
        self.rest = ""
        fmt = chat.tool_format
        self._content = ContentStream(
            tools=turn.tools_enabled, markers=fmt.markers, whole_json=fmt.name == "llama3_json"
        )
        marks = chat.marker_ids if turn.tools_enabled else frozenset()
        # not shown, as read_reply decodes them (no set built per call when nothing is kept)
        self._hidden = chat.special_ids - marks if marks else chat.special_ids
        decode = chat.tokenizer.decode
        self._text = IncrementalText(lambda ids: decode(ids, skip_special_tokens=False))

    def token_texts(self, start: int, end: int) -> list[str]:
        return list(
            self.chat.tokenizer.decode_batch(
                [[t] for t in self.ids[start:end]], skip_special_tokens=False
            )
        )

    def top_texts(self, start: int, end: int) -> list[list[str]] | None:
        if self.tops is None:
            return None
        steps = self.tops[start:end]
        flat = self.chat.tokenizer.decode_batch(
            [[t] for step in steps for t, _ in step], skip_special_tokens=False
        )
        it = iter(flat)
        return [[next(it) for _ in step] for step in steps]

    async def deltas(self) -> AsyncIterator[Delta]:
        """The content deltas as the tokens arrive; after the last, the reply is read and the
        LlmCall recorded (then ``out``, ``reply``, ``rest``). A backend failure is recorded
        and raised as an ApiError (502); a hang-up (the iterator closed early) is recorded."""
        done = False
        try:
            chunk = self._first
            self._first = None
            while chunk is not None:
                start = len(self.ids)
                self._take(chunk)
                shown = chunk.token_ids
                if not self._hidden.isdisjoint(shown):
                    shown = [t for t in shown if t not in self._hidden]
                last = chunk.finish_reason is not None
                if last and self._user_stop(chunk) and shown and shown[-1] == chunk.stop_reason:
                    shown = shown[:-1]  # a stop string the request asked for: not content
                piece = self._text.push(shown) + (self._text.flush() if last else "")
                yield Delta(self._content.push(piece), start, len(self.ids))
                if last:
                    break
                chunk = await anext(self._chunks, None)
            else:
                raise BackendError("the stream ended without a finish reason", backend=self.backend)
            done = True  # what follows is answered as an error event, not a hang-up
            self._finish(chunk)
        except BackendError as exc:
            done = True
            msg = f"the backend failed after {len(self.ids)} streamed tokens: {exc}"
            self._fail(self.ro, self.call_id, self.turn.tool_results, msg, 502, self.backend)
            raise ApiError(502, msg, code="backend_error") from exc
        finally:
            if not done:
                msg = f"the client closed the stream after {len(self.ids)} tokens"
                self._fail(
                    self.ro, self.call_id, self.turn.tool_results, msg, CLIENT_CLOSED, self.backend
                )
            if self.out is None:  # not finished: the backend's connection is closed now
                await self._chunks.aclose()

    async def close(self) -> None:
        """After the answer's last event: read the backend's stream to its end (its [DONE],
        within DRAIN_S), so its keep-alive connection goes back to the pool, then close it.
        Closing a stream that did not finish closes the backend's connection."""
        if self.out is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(DRAIN_S):
                    async for _ in self._chunks:
                        pass
        await self._chunks.aclose()

    def _user_stop(self, chunk: TokenChunk) -> bool:
        return chunk.stop_reason is not None and chunk.stop_reason in self.turn.stop_token_ids

    def _take(self, chunk: TokenChunk) -> None:
        if self._new_part:  # a continuation's first chunk: the pool names its policy version
            self._new_part = False
            if chunk.policy_version is not None:
                self.policy_version = chunk.policy_version
        self.ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        if self.tops is not None:
            self.tops += chunk.top_logprobs or [[] for _ in chunk.token_ids]
        if chunk.part_end:
            if len(self.ids) > self._part_start:  # a part cut before its first token: none
                self.parts.append((len(self.ids) - self._part_start, self.policy_version))
            self._part_start, self._new_part = len(self.ids), True

    def _finish(self, last: TokenChunk) -> None:
        """Steps 5 and 6 on the whole reply: read (tool calls, memory) and record."""
        out = Completion(
            token_ids=np.asarray(self.ids, dtype=np.uint32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            finish_reason=last.finish_reason or "length",
            policy_version=self.policy_version,
            prompt_tokens=len(self.prompt),
            stop_reason=last.stop_reason,
            top_logprobs=self.tops,
            backend=self.backend,
            model=self.model,
            latency_s=time.perf_counter() - self._started,
            parts=(
                (*self.parts, (len(self.ids) - self._part_start, self.policy_version))
                if self.parts
                else ()
            ),
        )
        reply = read_reply(
            self.chat,
            self.ro.memory,
            self.turn,
            out.token_ids,
            self.call_id,
            stop_reason=out.stop_reason,
        )
        self._record(self.ro, self.call_id, self.prompt, out, self.drift, self.turn.tool_results)
        self.out, self.reply = out, reply
        self.rest = self._content.finish(reply.content)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + dumps(data) + b"\n\n"


async def chat_events(call: StreamedTurn, *, created: int, rollout_id: str) -> AsyncIterator[bytes]:
    """A streamed chat completion's SSE body: the role chunk, a content chunk per delta (with
    its tokens' logprobs when asked for), after the last token the rest of the content, the
    tool calls (one chunk, parsed from the whole reply) and the finish chunk (with the
    ``rollstream`` extension: call_id, backend, policy version), the usage chunk when asked
    for, ``data: [DONE]``: the events after the last token in one LastPart (one write with the
    end of the body). A content delta is a pre-rendered chunk with only its text escaped
    (``SseTemplate``). A failure after the first byte is an error event."""
    params = call.params
    head = {
        "id": f"chatcmpl-{call.call_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": call.model,
    }
    role = _sse(chat_chunk(head, {"role": "assistant", "content": ""}))
    content = SseTemplate(b"data: ", chat_chunk(head, {"content": SseTemplate.SLOT}))
    try:
        async for d in call.deltas():
            if params.logprobs:
                lps = call.logprobs[d.start : d.end]
                tops = call.tops[d.start : d.end] if call.tops is not None else None
                texts = call.token_texts(d.start, d.end)
                lp = stream_logprobs(texts, lps, tops, call.top_texts(d.start, d.end))
                yield role + _sse(chat_chunk(head, {"content": d.text}, lp=lp))
                role = b""
            elif d.text:
                yield role + content.fill(d.text)
                role = b""  # sent with the first content: one write
        out, reply = call.out, call.reply
        assert out is not None and reply is not None
        tail = [role]  # the last events in one write
        if call.rest:
            tail.append(_sse(chat_chunk(head, {"content": call.rest})))
        finish = FINISH_REASONS.get(out.finish_reason, "stop")
        if reply.tool_calls:
            calls = [{"index": i, **tc} for i, tc in enumerate(reply.tool_calls)]
            tail.append(_sse(chat_chunk(head, {"tool_calls": calls})))
            finish = "tool_calls"
        last = chat_chunk(head, {}, finish)
        if reply.tool_choice_met is not None:  # a tool call was required: whether it came
            last["choices"][0]["tool_choice_met"] = reply.tool_choice_met
        last["rollstream"] = {
            "call_id": call.call_id,
            "rollout_id": rollout_id,
            "backend": out.backend,
            "policy_version": out.policy_version,
            "drift_tokens": call.drift,
        }
        tail.append(_sse(last))
        if params.include_usage:
            use = usage(len(call.prompt), len(out.token_ids))
            tail.append(_sse({**head, "choices": [], "usage": use}))
        yield LastPart(b"".join(tail) + b"data: [DONE]\n\n")
    except ApiError as exc:
        yield LastPart(role + b"data: " + error_body(exc) + b"\n\ndata: [DONE]\n\n")
    finally:
        await call.close()
