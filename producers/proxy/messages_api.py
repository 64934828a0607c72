"""``POST /v1/messages`` (and ``/rollouts/{rollout_id}/v1/messages``): the Anthropic Messages API
over the proxy's chat pipeline, so a harness built on Anthropic's client points its base URL at
``<proxy>/rollouts/{rollout_id}`` and every call becomes an LlmCall of the rollout.

A Messages call is the chat call's seven steps (service.py) with Anthropic's wire at both ends:

    1 parse      anthropic_wire.parse_messages_request   the request in the chat form (400)
    2 render     chat.render_turn                        the same render as a chat completion:
                                                         earlier replies' generated ids spliced
                                                         in, tool_result blocks found as tool
                                                         results
    3 budget     Proxy._budget                           an overflow worded as Anthropic words
                                                         it ("prompt is too long: N tokens > M
                                                         maximum")
    4 generate   Proxy._generate                         pool, failover, 429 while paused
    5 read       chat.read_reply                         text and tool calls; the reply
                                                         remembered, so its tool_use blocks
                                                         coming back chain the next call
    6 record     Proxy._record                           tool results, then the LlmCall
    7 answer     anthropic_wire.message_answer           the Message, or its SSE events

The rollout token comes as ``x-api-key`` (Anthropic's client with ``api_key``) or as a bearer
token (``auth_token``). Every error, the token's included, is answered in Anthropic's shape.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np

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
from rollstream.producers.proxy.backends import Completion
from rollstream.producers.proxy.chat import ChatTemplate, ToolResult, read_reply, render_turn
from rollstream.producers.proxy.openai_wire import Answer, CallParams, HttpRequest, as_api_error
from rollstream.producers.proxy.rollout_api import OpenRollout
from rollstream.producers.sdk.ids import new_ulid

__all__ = ["MessagesApi", "Pipeline"]

log = logging.getLogger("rollstream.producers.proxy.service")


class Pipeline(Protocol):
    """What a Messages call uses of the proxy (service.Proxy is one): its template and limits,
    the token check, and the chat pipeline's budget, generate and record steps."""

    chat: ChatTemplate
    model: str
    max_prompt: int
    max_model_len: int

    def open_rollout(self, token: str | None, rollout_id: str | None) -> OpenRollout: ...

    def _budget(self, prompt_len: int, requested: int | None, default: int) -> int: ...

    async def _generate(
        self,
        ro: OpenRollout,
        call_id: str,
        prompt: np.ndarray,
        params: CallParams,
        stop_token_ids: list[int],
        max_tokens: int,
        tool_results: list[ToolResult],
    ) -> list[Completion]: ...

    def _record(
        self,
        ro: OpenRollout,
        call_id: str,
        prompt: np.ndarray,
        out: Completion,
        drift: int,
        tool_results: list[ToolResult],
    ) -> None: ...


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
        # 2 render
        try:
            turn = render_turn(
                proxy.chat,
                ro.memory,
                messages=chat.messages,
                tools=chat.tools,
                tool_choice=chat.tool_choice,
                stop=params.stop,
            )
        except ChatInputError as exc:
            if exc.param != "stop":
                raise
            msg = str(exc).replace("`stop` strings", "stop sequences")
            raise ChatInputError(msg, "stop_sequences", code=exc.code) from exc
        prompt = turn.prompt.ids
        # 3 budget
        try:
            max_tokens = proxy._budget(len(prompt), params.max_tokens, 1)
        except ApiError as exc:
            if exc.code != "context_length_exceeded":
                raise
            raise self._overflow(exc, len(prompt), params.max_tokens or 1) from exc
        call_id = new_ulid()
        # 4 generate
        try:
            (out,) = await proxy._generate(  # n = 1: Messages has no choices
                ro, call_id, prompt, params, turn.stop_token_ids, max_tokens, turn.tool_results
            )
        except ApiError as exc:
            if exc.code != "context_length_exceeded":
                raise
            msg = f"prompt is too long: {len(prompt)} tokens ({exc.message})"
            raise ApiError(400, msg, code=exc.code) from exc
        # 5 read the reply
        reply = read_reply(
            proxy.chat, ro.memory, turn, out.token_ids, call_id, stop_reason=out.stop_reason
        )
        # 6 record
        proxy._record(ro, call_id, prompt, out, turn.prompt.drift_tokens, turn.tool_results)
        # 7 answer
        stop_sequence = None
        if out.stop_reason is not None and out.stop_reason in turn.stop_token_ids:
            stop_sequence = params.stop[turn.stop_token_ids.index(out.stop_reason)]
        ext = {
            "call_id": call_id,
            "rollout_id": ro.rollout_id,
            "backend": out.backend,
            "policy_version": out.policy_version,
            "drift_tokens": turn.prompt.drift_tokens,
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
        """The budget's context overflow in Anthropic's words."""
        proxy = self.proxy
        if exc.param == "messages" and proxy.max_prompt:  # over the prompt limit
            return prompt_too_long(prompt_tokens, proxy.max_prompt)
        if prompt_tokens >= proxy.max_model_len:
            return prompt_too_long(prompt_tokens, proxy.max_model_len)
        return context_limit(prompt_tokens, max_tokens, proxy.max_model_len)
