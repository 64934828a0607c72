"""Dead-letter records: the headers every rollstream stage puts on a record it refuses.

The record itself travels unchanged (same key, same value bytes) to ``Topics(ns).dlq``; the
headers say why and where it came from (the same names as consumers/dataset.py's DLQ):

    reason              human-readable cause (DecodeError.reason, Invalid.reason, ...)
    code                stable short code: "undecodable", "wrong_key", "misrouted" (a
                        trajectory not on its group's partition) or an InvalidCode value
    original_topic      topic / partition / offset of the refused record; offset "-1" when the
    original_partition  record is not the one being processed (an event buffered earlier and
    original_offset     refused when its rollout closed is re-encoded with the Codec)
    stage               builder | aggregator
    processor           the processor's app id
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CODE_MISROUTED",
    "CODE_UNDECODABLE",
    "CODE_WRONG_KEY",
    "HEADER_NAMES",
    "dlq_headers",
    "read_headers",
]

CODE_MISROUTED = "misrouted"
CODE_UNDECODABLE = "undecodable"
CODE_WRONG_KEY = "wrong_key"
HEADER_NAMES = (
    "reason",
    "code",
    "original_topic",
    "original_partition",
    "original_offset",
    "stage",
    "processor",
)


def dlq_headers(
    *,
    reason: str,
    code: str,
    topic: str,
    partition: int,
    offset: int,
    stage: str,
    processor: str,
) -> tuple[tuple[str, bytes], ...]:
    values = (reason, code, topic, str(partition), str(offset), stage, processor)
    return tuple((name, value.encode()) for name, value in zip(HEADER_NAMES, values, strict=True))


def read_headers(headers: Iterable[tuple[str, bytes | None]] | None) -> dict[str, str]:
    """Headers of a record as ``{name: text}`` (the last value wins; None values are "")."""
    return {name: (value or b"").decode(errors="replace") for name, value in headers or ()}
