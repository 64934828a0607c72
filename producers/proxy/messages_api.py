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

The rollout token comes as ``x-api-key`` (Anthropic's client with ``api_key``) or as a bearer
token (``auth_token``). Every error, the token's included, is answered in Anthropic's shape.
"""

from __future__ import annotations

import logging
from typing import Any

from rollstream.producers.errors import ApiError, ChatError, ChatInputError
from rollstream.producers.proxy.anthropic_wire import (
    content_blocks,
    context_limit,
    error_answer,
    message_answer,
    message_body,
    parse_messages_request,
    prompt_too_long,
    stop_reason,
)
from rollstream.producers.proxy.openai_wire import Answer, HttpRequest, as_api_error
from rollstream.producers.proxy.rollout_api import OpenRollout
from rollstream.producers.proxy.turns import Pipeline

__all__ = ["MessagesApi", "Pipeline"]

log = logging.getLogger("rollstream.producers.proxy.service")


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
            if not isinstance(exc, ApiError | ChatError):
                log.exception("unhandled error on /v1/messages")
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

    def _overflow(self, exc: ApiError, prompt_tokens: int, max_tokens: int) -> ApiError:
        """A context overflow (the budget's, or the backend's) in Anthropic's words."""
        proxy = self.proxy
        if exc.param == "messages" and proxy.max_prompt:  # over the prompt limit
            return prompt_too_long(prompt_tokens, proxy.max_prompt)
        if prompt_tokens >= proxy.max_model_len:
            return prompt_too_long(prompt_tokens, proxy.max_model_len)
        return context_limit(prompt_tokens, max_tokens, proxy.max_model_len)
