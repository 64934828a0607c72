"""Where the sink's batches end (pure: offsets, sizes and a clock; no Kafka, no ClickHouse).

A batch is consecutive messages of one topic partition. Its offset range is its ClickHouse
dedup token, so the boundaries must be a function of the log, never of timing: a batch retried
after a crash must cover exactly the same offsets. A batch that starts at offset ``a`` ends at
the first of: the aligned boundary ``(a // N + 1) * N - 1``; the message that brings it to
``max_bytes``; a gap in the offsets that jumps over its end; or an *intent* (``(a, last)``,
read back from the metadata of the group's committed offset, ``INTENT_PREFIX + str(last)``):
where the flush timer cut it before a crash. ``BatchCutter.due`` cuts a partial batch only
when it holds everything the partition has (rollstream.consumers.store.sink explains why that is
safe). tests/unit/test_sink_batches.py simulates crashes at every step against these rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["INTENT_PREFIX", "BatchCutter", "RawBatch", "parse_intent"]

INTENT_PREFIX = "rollstream-sink:end="


def parse_intent(metadata: str | None) -> int | None:
    """The batch end an offset commit's metadata announces, if any."""
    if metadata and metadata.startswith(INTENT_PREFIX):
        try:
            return int(metadata[len(INTENT_PREFIX) :])
        except ValueError:
            return None
    return None


@dataclass
class RawBatch:
    """Consecutive messages of one partition, as consumed (offsets ``first..last``)."""

    topic: str
    partition: int
    first: int
    last: int
    items: list[Any]
    nbytes: int
    partial: bool = False  # ended by the timer (or a stop): needs an intent before its insert

    @property
    def token(self) -> str:
        return f"{self.topic}:{self.partition}:{self.first}:{self.last}"


class BatchCutter:
    """Cuts one partition's messages into batches at reproducible offsets (module docstring).
    Pure: offsets, sizes and a clock; ``items`` are whatever the caller keeps per message."""

    def __init__(
        self,
        topic: str,
        partition: int,
        *,
        align: int,
        max_bytes: int,
        intent: tuple[int, int] | None = None,
    ) -> None:
        if align < 1 or max_bytes < 1:
            raise ValueError("align and max_bytes must be positive")
        self.topic = topic
        self.partition = partition
        self.align = align
        self.max_bytes = max_bytes
        self.intent = intent  # (first offset, last offset) of the next batch, from Kafka
        self.items: list[Any] = []
        self.first = self.last = self.end = -1
        self.nbytes = 0
        self.started = 0.0
        self._fixed = False

    def add(self, offset: int, size: int, item: Any, now: float) -> list[RawBatch]:
        """Take one message; returns the batches it completes (0, 1 or 2)."""
        out: list[RawBatch] = []
        if self.items and offset <= self.last:
            raise ValueError(f"offset {offset} is not after {self.last} in {self.topic}")
        if self.items and offset > self.end:  # a gap in the offsets jumped over the end
            out.append(self._close(partial=False))
        if not self.items:
            self._begin(offset, now)
        self.items.append(item)
        self.last = offset
        self.nbytes += size
        if offset >= self.end or (not self._fixed and self.nbytes >= self.max_bytes):
            out.append(self._close(partial=False))
        return out

    def _begin(self, offset: int, now: float) -> None:
        self.first = offset
        self.started = now
        intent, self.intent = self.intent, None
        if intent is not None and intent[0] == offset and intent[1] >= offset:
            self.end, self._fixed = intent[1], True
        else:
            self.end, self._fixed = (offset // self.align + 1) * self.align - 1, False

    def _close(self, *, partial: bool) -> RawBatch:
        batch = RawBatch(
            self.topic, self.partition, self.first, self.last, self.items, self.nbytes, partial
        )
        self.items = []
        self.nbytes = 0
        return batch

    def due(
        self, now: float, interval: float, log_end: int | None, max_wait: float = math.inf
    ) -> RawBatch | None:
        """The pending batch, cut at its last message, once it has waited ``interval`` seconds
        and holds everything the partition has (``log_end``, the high watermark). Cutting
        while more is in the log could cut a batch shorter than the one a crashed run inserted
        from the same offset, with a different token; a caught-up batch cannot be: that run's
        messages were in the log before ours. ``max_wait``: cut anyway after this long (a log
        that ends in transaction markers never looks caught up). A batch that follows an
        intent is never cut: its messages are in the log and its end is fixed."""
        if not self.items or self._fixed:
            return None
        age = now - self.started
        caught_up = log_end is not None and self.last + 1 >= log_end
        if (age >= interval and caught_up) or age >= max_wait:
            return self.cut()
        return None

    def cut(self) -> RawBatch | None:
        """The pending batch, ended at its last message (a partial batch: it needs an intent
        before its insert). Callers go through ``due``, which knows when cutting is safe."""
        if not self.items:
            return None
        return self._close(partial=True)

    def __len__(self) -> int:
        return len(self.items)
