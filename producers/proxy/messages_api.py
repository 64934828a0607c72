"""``POST /v1/messages`` (and ``/rollouts/{rollout_id}/v1/messages``): the Anthropic Messages API
over the proxy's chat pipeline, so a harness built on Anthropic's client points its base URL at
``<proxy>/rollouts/{rollout_id}`` and every call becomes an LlmCall of the rollout.

A Messages call is the chat call's seven steps (service.py) with Anthropic's wire at both ends:

    1 parse      anthropic_wire.parse_messages_request   the request in the chat form (400)
    2-6          Proxy.turn                              the chat call's render (earlier
                                                         replies' generated ids spliced in,
                                                         tool_result blocks found as tool
                                                         results), budget, generate, read (the
                                                         reply remembered, so its tool_use
                                                         blocks coming back chain the next
                                                         call) and record; an overflow worded
                                                         as Anthropic words it ("prompt is too
                                                         long: N tokens > M maximum")
    7 answer     anthropic_wire.message_answer           the Message, or its SSE events

Streaming (``stream: true``): the call's steps 2-4 run up to the backend's first token
(failures before it are error answers with their status), then the events go out as the
tokens come (``message_events``): ``message_start``, a text block (``content_block_start``,
a ``text_delta`` per content delta, ``content_block_stop``) opened at the first text, after the
last token one ``tool_use`` block per tool call (parsed from the whole reply; its input as one
``input_json_delta``), ``message_delta`` (stop reason, output tokens), ``message_stop``. A
failure after the first byte is an ``error`` event (stream_turn.py says what is recorded).

The rollout token comes as ``x-api-key`` (Anthropic's client with ``api_key``) or as a bearer
token (``auth_token``). Every error, the token's included, is answered in Anthropic's shape.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from rollstream.adapters.asgi_stream import LastPart
from rollstream.producers.errors import ApiError, ChatError, ChatInputError
from rollstream.producers.proxy.anthropic_wire import (
    content_blocks,
    context_limit,
    error_answer,
    error_body,
    message_answer,
    message_body,
    parse_messages_request,
    prompt_too_long,
    sse_events,
    stop_reason,
)
from rollstream.producers.proxy.openai_wire import (
    Answer,
    HttpRequest,
    SseTemplate,
    as_api_error,
    dumps,
)
from rollstream.producers.proxy.rollout_api import OpenRollout
from rollstream.producers.proxy.stream_turn import StreamedTurn
from rollstream.producers.proxy.turns import Pipeline

__all__ = ["MessagesApi", "Pipeline"]

log = logging.getLogger("rollstream.producers.proxy.service")

# a text block's delta event (the same for every call: built once)
_TEXT_DELTA = SseTemplate(
    b"event: content_block_delta\ndata: ",
    {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": SseTemplate.SLOT},
    },
)


class MessagesApi:
    """The Messages route of a proxy: ``messages`` is the route handler, ``call`` the Python
    entry (an open rollout and a request body in, an Answer out)."""

    def __init__(self, proxy: Pipeline) -> None:
        self.proxy = proxy

    async def messages(self, request: HttpRequest) -> Answer:
        """The route: the rollout of the token (401, 403, 404, 409), the body (413, 400), the
        call; any error as Anthropic's error object (a 500 with the reason for a bug)."""
        try:
            ro = self.proxy.open_rollout(request.token, request.path.get("rollout_id"))
            return await self.call(ro, await request.json())
        except Exception as exc:
            return self.error(exc)

    def error(self, exc: Exception) -> Answer:
        """The answer to a failed Messages call: Anthropic's error object (a 500 with the
        reason, logged, for an error that is not an ApiError or ChatError: a bug)."""
        if not isinstance(exc, ApiError | ChatError):
            log.error("unhandled error on /v1/messages", exc_info=exc)
        return error_answer(as_api_error(exc))

    async def call(self, ro: OpenRollout, body: dict[str, Any]) -> Answer:
        """A Messages call for ``ro`` (the module docstring's seven steps). Raises ApiError or
        ChatInputError."""
        proxy = self.proxy
        # 1 parse
        request = parse_messages_request(body)
        chat, params = request.chat, request.chat.params
        # 2-6: Proxy.turn (max_tokens is required here: no default)
        try:
            if request.stream:
                call = await proxy.open_stream(
                    ro, chat, default_max_tokens=1, overflow=self._overflow
                )
                return Answer(b"", sse=True, stream=self.message_events(call, ro.rollout_id))
            done = await proxy.turn(ro, chat, default_max_tokens=1, overflow=self._overflow)
        except ChatInputError as exc:
            if exc.param != "stop":
                raise
            msg = str(exc).replace("`stop` strings", "stop sequences")
            raise ChatInputError(msg, "stop_sequences", code=exc.code) from exc
        turn, prompt, drift = done.chat, done.prompt, done.drift
        (out,), (reply,), (call_id,) = done.outs, done.replies, done.call_ids  # n = 1
        # 7 answer
        stop_sequence = None
        if out.stop_reason is not None and out.stop_reason in turn.stop_token_ids:
            stop_sequence = params.stop[turn.stop_token_ids.index(out.stop_reason)]
        ext = {
            "call_id": call_id,
            "rollout_id": ro.rollout_id,
            "backend": out.backend,
            "policy_version": out.policy_version,
            "drift_tokens": drift,
        }
        message = message_body(
            call_id=call_id,
            model=proxy.model,
            content=content_blocks(reply.content, reply.tool_calls),
            stop_reason=stop_reason(
                out.finish_reason, tool_use=bool(reply.tool_calls), stop_sequence=stop_sequence
            ),
            stop_sequence=stop_sequence,
            input_tokens=len(prompt),
            output_tokens=len(out.token_ids),
            ext=ext,
        )
        return message_answer(message, stream=request.stream)

    async def message_events(self, call: StreamedTurn, rollout_id: str) -> AsyncIterator[bytes]:
        """A streamed Message's events as the tokens come (the module docstring): the events
        of one step in one part (``message_start`` with the first text), the last ones in a
        LastPart."""

        def event(name: str, data: dict[str, Any]) -> bytes:
            return sse_events([(name, data)])

        ext: dict[str, Any] = {"call_id": call.call_id, "rollout_id": rollout_id}
        start = message_body(
            call_id=call.call_id,
            model=call.model,
            content=[],
            stop_reason=None,  # not known yet: Anthropic sends it in message_delta
            stop_sequence=None,
            input_tokens=len(call.prompt),
            output_tokens=0,
            ext=ext,
        )
        pending = event("message_start", {"type": "message_start", "message": start})
        text_open, index = False, 0
        text_delta = _TEXT_DELTA

        def text(piece: str) -> bytes:
            nonlocal text_open
            if text_open:
                return text_delta.fill(piece)
            text_open = True
            block = {"type": "text", "text": ""}
            opened = {"type": "content_block_start", "index": 0, "content_block": block}
            return event("content_block_start", opened) + text_delta.fill(piece)

        try:
            async for d in call.deltas():
                if d.text:
                    yield pending + text(d.text)
                    pending = b""
            out, reply = call.out, call.reply
            assert out is not None and reply is not None
            tail = [pending]
            if call.rest:
                tail.append(text(call.rest))
            if text_open:
                tail.append(event("content_block_stop", {"type": "content_block_stop", "index": 0}))
                index = 1
            for block in content_blocks(None, reply.tool_calls):
                empty = {**block, "input": {}}
                partial = {
                    "type": "input_json_delta",
                    "partial_json": dumps(block["input"]).decode(),
                }
                tail += [
                    event(
                        "content_block_start",
                        {"type": "content_block_start", "index": index, "content_block": empty},
                    ),
                    event(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": index, "delta": partial},
                    ),
                    event("content_block_stop", {"type": "content_block_stop", "index": index}),
                ]
                index += 1
            stops, params = call.turn.stop_token_ids, call.params
            stop_sequence = None
            if out.stop_reason is not None and out.stop_reason in stops:
                stop_sequence = params.stop[stops.index(out.stop_reason)]
            reason = stop_reason(
                out.finish_reason, tool_use=bool(reply.tool_calls), stop_sequence=stop_sequence
            )
            delta = {"stop_reason": reason, "stop_sequence": stop_sequence}
            usage = {"output_tokens": len(out.token_ids)}
            ext |= {
                "backend": out.backend,
                "policy_version": out.policy_version,
                "drift_tokens": call.drift,
            }
            tail.append(
                event(
                    "message_delta",
                    {"type": "message_delta", "delta": delta, "usage": usage, "rollstream": ext},
                )
            )
            tail.append(event("message_stop", {"type": "message_stop"}))
            yield LastPart(b"".join(tail))
        except ApiError as exc:
            yield LastPart(pending + b"event: error\ndata: " + error_body(exc) + b"\n\n")
        finally:
            await call.close()

    def _overflow(self, exc: ApiError, prompt_tokens: int, max_tokens: int) -> ApiError:
        """A context overflow (the budget's, or the backend's) in Anthropic's words."""
        proxy = self.proxy
        if exc.param == "messages" and proxy.max_prompt:  # over the prompt limit
            return prompt_too_long(prompt_tokens, proxy.max_prompt)
        if prompt_tokens >= proxy.max_model_len:
            return prompt_too_long(prompt_tokens, proxy.max_model_len)
        return context_limit(prompt_tokens, max_tokens, proxy.max_model_len)
