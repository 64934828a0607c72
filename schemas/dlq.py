"""Dead-letter records: the one header contract every rollstream stage uses on a record it
refuses (stream processors, the ClickHouse sink, the sample dataset, the policy watcher).

The record itself travels unchanged (same key, same value bytes) to ``Topics(ns).dlq``; the
headers say why and where it came from:

    reason              human-readable cause (DecodeError.reason, Invalid.reason, ...)
    code                stable short code: one of the CODE_* constants below, or a stage's own
                        (the stream core's InvalidCode values, the sink's "rejected")
    kind                the record type that could not be handled ("" when not known)
    original_topic      topic / partition / offset of the refused record; offset "-1" when the
    original_partition  record is not the one being processed (an event buffered earlier and
    original_offset     refused when its rollout closed is re-encoded with the Codec)
    stage               builder | aggregator | sink | dataset | policy_watcher | ...
    processor           the id of the process that refused it (app id, consumer group)

Every header is present on every dead letter, in this order (``HEADER_NAMES``).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CODE_INVALID",
    "CODE_MISROUTED",
    "CODE_UNDECODABLE",
    "CODE_WRONG_KEY",
    "HEADER_NAMES",
    "dlq_headers",
    "read_headers",
]

CODE_UNDECODABLE = "undecodable"  # the bytes are not a record of the contract
CODE_WRONG_KEY = "wrong_key"  # the record's key is not the one the contract asks for
CODE_MISROUTED = "misrouted"  # a trajectory not on its group's partition
CODE_INVALID = "invalid"  # decodable, but its values break the contract
HEADER_NAMES = (
    "reason",
    "code",
    "kind",
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
    kind: str = "",
) -> list[tuple[str, bytes]]:
    """The headers of one dead letter, every name of ``HEADER_NAMES`` in order."""
    values = (reason, code, kind, topic, str(partition), str(offset), stage, processor)
    return [(name, value.encode()) for name, value in zip(HEADER_NAMES, values, strict=True)]


def read_headers(headers: Iterable[tuple[str, bytes | None]] | None) -> dict[str, str]:
    """Headers of a record as ``{name: text}`` (the last value wins; None values are "")."""
    return {name: (value or b"").decode(errors="replace") for name, value in headers or ()}
