"""What steps 2 to 6 of a model call leave (``Proxy.turn``), whichever API the call came in by
(chat completions, Anthropic Messages, OpenAI Responses): each API's answer is built from it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rollstream.producers.errors import ApiError
from rollstream.producers.proxy.backends import Completion
from rollstream.producers.proxy.chat import AssistantReply, ChatTemplate, ChatTurn
from rollstream.producers.proxy.openai_wire import ChatRequest
from rollstream.producers.proxy.rollout_api import OpenRollout
from rollstream.producers.proxy.stream_turn import StreamedTurn

__all__ = ["Pipeline", "Turn"]


@dataclass(frozen=True, slots=True)
class Turn:
    """One call, rendered, generated, read and recorded: ``chat`` the rendered turn (its stop
    token ids, tool results), ``prompt`` its token ids, then per choice its completion, reply
    and LlmCall id; ``drift`` the retokenization drift of the prompt (recorded with choice 0)."""

    chat: ChatTurn
    prompt: np.ndarray
    outs: Sequence[Completion]
    replies: Sequence[AssistantReply]
    call_ids: Sequence[str]
    drift: int


class Pipeline(Protocol):
    """What an API route other than chat uses of the proxy (service.Proxy is one)."""

    chat: ChatTemplate
    model: str
    max_prompt: int
    max_model_len: int

    def open_rollout(self, token: str | None, rollout_id: str | None) -> OpenRollout: ...

    async def turn(
        self,
        ro: OpenRollout,
        request: ChatRequest,
        *,
        default_max_tokens: int | None = None,
        format_param: str = "response_format",
        overflow: Callable[[ApiError, int, int], ApiError] | None = None,
    ) -> Turn: ...

    async def open_stream(
        self,
        ro: OpenRollout,
        request: ChatRequest,
        *,
        default_max_tokens: int | None = None,
        format_param: str = "response_format",
        overflow: Callable[[ApiError, int, int], ApiError] | None = None,
    ) -> StreamedTurn: ...
