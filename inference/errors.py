"""The errors of rollstream.inference, one root::

    InferenceError              root of rollstream.inference
    ├── TinyModelError          the tiny model (tinymodel.py): tokenizer, weights, sampling
    │   ├── CheckpointError     a weights path that is missing or does not fit the model
    │   └── GenerationError     a prompt or sampling parameter the model cannot serve
    └── RequestRefused          a request the server refuses; carries the HTTP status (4xx, 503)

The server answers ``RequestRefused`` with its status and ``TinyModelError`` with a 400, both
in vLLM's error body; anything else is a 500 with the reason.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "GenerationError",
    "InferenceError",
    "RequestRefused",
    "TinyModelError",
]


class InferenceError(Exception):
    """Root of every error raised by rollstream.inference."""


class TinyModelError(InferenceError):
    """The tiny model cannot do what was asked (a missing corpus, checkpoint or bad prompt)."""


class CheckpointError(TinyModelError):
    """A weights path is missing, unreadable, or its tensors do not fit the model."""


class GenerationError(TinyModelError):
    """A prompt or sampling parameter the model cannot serve."""


class RequestRefused(InferenceError):
    """A request the server refuses, answered with ``status`` and an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
