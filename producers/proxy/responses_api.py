"""``POST /v1/responses`` (and ``/rollouts/{rollout_id}/v1/responses``): the OpenAI Responses API
over the proxy's chat pipeline, so a harness built on it (Codex-style, or the openai client's
``responses.create``) points its base URL at ``<proxy>/rollouts/{rollout_id}/v1`` and every call
becomes an LlmCall of the rollout.

A Responses call is the chat call's seven steps (service.py) with the Responses wire at both
ends:

    1 parse      responses_wire.parse_responses_request   the request in the chat form (400); a
                                                          JSON text.format the pool cannot
                                                          decode under is refused (400)
    2-6          Proxy.turn                               the chat call's render (earlier
                                                          replies' generated ids spliced in,
                                                          function_call_output items found as
                                                          tool results), budget (400
                                                          context_length_exceeded, param
                                                          ``input`` or ``max_output_tokens``),
                                                          generate, read (the reply remembered,
                                                          so its function_call items coming back
                                                          chain the next call) and record
    7 answer     responses_wire.response_answer           the Response, or its SSE events

Streaming (``stream: true``): steps 2-4 run up to the backend's first token (failures before it
are error answers with their status), then the events go out as the tokens come
(``response_events``): response.created, response.in_progress; at the first text the message
item (response.output_item.added, response.content_part.added) and a response.output_text.delta
per content delta; after the last token response.output_text.done / content_part.done /
output_item.done with the text parsed from the whole reply, one function_call item per tool
call (its arguments as one delta), and response.completed (or response.incomplete). A failure
after the first byte is an ``error`` event (stream_turn.py says what is recorded).

Nothing is stored: ``previous_response_id`` is refused, the harness sends the conversation
(``store: false``, as Codex does). Errors are OpenAI's error objects; a 409 (finished rollout)
carries ``x-should-retry: false`` so the openai client does not retry it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from rollstream.adapters.asgi_stream import LastPart
from rollstream.producers.errors import ApiError, ChatError
from rollstream.producers.proxy.anthropic_wire import sse_events
from rollstream.producers.proxy.openai_wire import (
    Answer,
    HttpRequest,
    as_api_error,
    error_answer,
)
from rollstream.producers.proxy.responses_wire import (
    item_events,
    output_items,
    parse_responses_request,
    response_answer,
    response_body,
)
from rollstream.producers.proxy.rollout_api import OpenRollout
from rollstream.producers.proxy.stream_turn import StreamedTurn
from rollstream.producers.proxy.turns import Pipeline

__all__ = ["Pipeline", "ResponsesApi", "responses_error"]

log = logging.getLogger("rollstream.producers.proxy.service")

# chat parameter names as the Responses API names them
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def responses_error(exc: ApiError) -> ApiError:
    """``exc`` with the chat pipeline's parameter names in the Responses API's words
    (``messages[2].content`` -> ``input``, ``max_tokens`` -> ``max_output_tokens``)."""
    param = exc.param
    if param is None:
        return exc
    head = param.split("[", 1)[0].split(".", 1)[0]
    if head not in _PARAMS:
        return exc
    return ApiError(
        exc.status, exc.message, param=_PARAMS[head], code=exc.code, headers=exc.headers
    )


class ResponsesApi:
    """The Responses route of a proxy: ``responses`` is the route handler, ``call`` the Python
    entry (an open rollout and a request body in, an Answer out)."""

    def __init__(self, proxy: Pipeline) -> None:
        self.proxy = proxy

    async def responses(self, request: HttpRequest) -> Answer:
        """The route: the rollout of the token (401, 403, 404, 409), the body (413, 400), the
        call; any error as OpenAI's error object (a 500 with the reason for a bug)."""
        try:
            ro = self.proxy.open_rollout(request.token, request.path.get("rollout_id"))
            return await self.call(ro, await request.json())
        except Exception as exc:
            if not isinstance(exc, ApiError | ChatError):
                log.exception("unhandled error on /v1/responses")
            err = responses_error(as_api_error(exc))
            if err.status == 409:  # a finished rollout stays finished
                err = ApiError(
                    409,
                    err.message,
                    param=err.param,
                    code=err.code,
                    headers={**err.headers, "x-should-retry": "false"},
                )
            return error_answer(err)

    async def call(self, ro: OpenRollout, body: dict[str, Any]) -> Answer:
        """A Responses call for ``ro`` (the module docstring's seven steps). Raises ApiError or
        ChatInputError."""
        proxy = self.proxy
        # 1 parse
        request = parse_responses_request(body)
        if request.stream:  # 2-4 now, 5-7 as the tokens come
            call = await proxy.open_stream(ro, request.chat, format_param="text.format")
            events = self.response_events(call, ro.rollout_id, request.echo)
            return Answer(b"", sse=True, stream=events)
        # 2-6: Proxy.turn (a JSON text.format the pool cannot decode under: 400 text.format)
        done = await proxy.turn(ro, request.chat, format_param="text.format")
        prompt, drift = done.prompt, done.drift
        (out,), (reply,), (call_id,) = done.outs, done.replies, done.call_ids  # n = 1
        # 7 answer
        incomplete = out.finish_reason == "length"
        ext: dict[str, Any] = {
            "call_id": call_id,
            "rollout_id": ro.rollout_id,
            "backend": out.backend,
            "policy_version": out.policy_version,
            "drift_tokens": drift,
        }
        if reply.tool_choice_met is not None:
            ext["tool_choice_met"] = reply.tool_choice_met
        response = response_body(
            call_id=call_id,
            created_at=int(time.time()),
            model=proxy.model,
            output=output_items(call_id, reply.content, reply.tool_calls, incomplete=incomplete),
            incomplete=incomplete,
            input_tokens=len(prompt),
            output_tokens=len(out.token_ids),
            echo=request.echo,
            ext=ext,
        )
        return response_answer(response, stream=request.stream)

    async def response_events(
        self, call: StreamedTurn, rollout_id: str, echo: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        """A streamed Response's events as the tokens come (the module docstring)."""
        seq = 0

        def event(data: dict[str, Any]) -> bytes:
            nonlocal seq
            data["sequence_number"] = seq
            seq += 1
            return sse_events([(data["type"], data)])

        created = int(time.time())
        ext: dict[str, Any] = {"call_id": call.call_id, "rollout_id": rollout_id}
        start = response_body(
            call_id=call.call_id,
            created_at=created,
            model=self.proxy.model,
            output=[],
            incomplete=False,
            input_tokens=len(call.prompt),
            output_tokens=0,
            echo=echo,
            ext=ext,
        )
        start |= {"status": "in_progress", "usage": None}
        # the events of one step go out as one part: the first two with the first text
        pending = [
            event({"type": "response.created", "response": start}),
            event({"type": "response.in_progress", "response": start}),
        ]
        item_id = f"msg_{call.call_id}"
        at = {"item_id": item_id, "output_index": 0, "content_index": 0}
        opened = False
        try:
            async for d in call.deltas():
                if not d.text:
                    continue
                if not opened:
                    opened = True
                    item = {"type": "message", "id": item_id, "role": "assistant",
                            "status": "in_progress", "content": []}  # fmt: skip
                    part = {"type": "output_text", "text": "", "annotations": []}
                    pending.append(
                        event(
                            {"type": "response.output_item.added", "output_index": 0, "item": item}
                        )
                    )
                    pending.append(
                        event({"type": "response.content_part.added", **at, "part": part})
                    )
                pending.append(
                    event(
                        {
                            "type": "response.output_text.delta",
                            **at,
                            "delta": d.text,
                            "logprobs": [],
                        }
                    )
                )
                yield b"".join(pending)
                pending = []
            out, reply = call.out, call.reply
            assert out is not None and reply is not None
            incomplete = out.finish_reason == "length"
            output = output_items(call.call_id, reply.content, reply.tool_calls,
                                  incomplete=incomplete)  # fmt: skip
            if call.rest and opened:
                pending.append(
                    event(
                        {
                            "type": "response.output_text.delta",
                            **at,
                            "delta": call.rest,
                            "logprobs": [],
                        }
                    )
                )
            for i, item in enumerate(output):
                events = item_events(i, item)
                if opened and i == 0:  # the message item is open: only its end is left
                    events = [e for e in events if e["type"] not in (
                        "response.output_item.added", "response.content_part.added",
                        "response.output_text.delta")]  # fmt: skip
                pending += [event(e) for e in events]
            ext |= {
                "backend": out.backend,
                "policy_version": out.policy_version,
                "drift_tokens": call.drift,
            }
            if reply.tool_choice_met is not None:
                ext["tool_choice_met"] = reply.tool_choice_met
            final = response_body(
                call_id=call.call_id,
                created_at=created,
                model=self.proxy.model,
                output=output,
                incomplete=incomplete,
                input_tokens=len(call.prompt),
                output_tokens=len(out.token_ids),
                echo=echo,
                ext=ext,
            )
            kind = "response.incomplete" if incomplete else "response.completed"
            pending.append(event({"type": kind, "response": final}))
            yield LastPart(b"".join(pending))
        except ApiError as exc:
            err = responses_error(exc)
            body = {"code": err.code, "message": err.message, "param": err.param}
            pending.append(event({"type": "error", **body, "error": body}))
            yield LastPart(b"".join(pending))
        finally:
            await call.close()
