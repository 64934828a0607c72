"""Contiguous delivery per source partition, checked by the shell (no faust in here).

Why: faust-streaming 0.15.3 (aiokafka 0.14) can fail to hand an agent some of a partition's
records right after a rebalance. Records fetched while the tables recover race with the seek
to the committed offsets: the agent is given a later stretch first, the re-read copies are
dropped as "already read", and faust's gap logic (meant for compacted topics and transaction
markers) marks the hole as done, so the commit moves past records no agent saw; or the agent
is given nothing more for a partition although the broker has more. Measured on the SIGKILL
test: about one restart in five lost events that way.

rollstream's source topics are written without transactions and never compacted, so their
offsets are contiguous: the guard holds the next expected offset of each partition (reset to
the committed offset after each assignment) and says what to do with each delivered record:
PROCESS it (the expected one), SKIP it (a repeat, already processed; or past a hole, it comes
again), or SEEK back to the expected offset. ``due`` (from a timer) also seeks a partition
that stays behind its high watermark while the whole worker is given nothing, for 2 x
``retry_s`` (a hole nothing came to fill, or a stalled partition). Only when the worker is
quiet: faust delivers the records of all agents through one queue, so an agent behind another
agent's backlog legitimately waits (it is not stalled), and the guard holds the committed
offset of a stalled partition back, so waiting for a quiet moment delays records, never loses
them. The shell
turns faust's gap marking off, so the committed offset cannot pass a hole. A hole that seeking
cannot fill after ``accept_after`` tries is a real gap (a transaction marker from a foreign
producer): the record after it is ACCEPTed and the shell tells faust the gap is real.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

__all__ = ["Admit", "OffsetGuard", "Source"]

Source: TypeAlias = tuple[str, int]  # (topic, partition)


class Admit(enum.Enum):
    PROCESS = "process"
    SKIP = "skip"
    SEEK = "seek"
    ACCEPT = "accept"  # process, and the offsets before it (from the returned one) are a gap


@dataclass(slots=True)
class _Partition:
    expected: int | None  # next offset to process; None: the first record delivered
    seen: float  # when a record of it was last delivered (or the reset)
    seeks: int = 0  # seeks to the current expected offset
    last_seek: float = float("-inf")
    stuck_since: float | None = None  # behind its high watermark and not delivered, since


class OffsetGuard:
    """Next expected offset per source partition."""

    def __init__(self, *, retry_s: float = 1.0, accept_after: int = 30) -> None:
        self.retry_s = retry_s
        self.accept_after = accept_after
        self._parts: dict[Source, _Partition] = {}
        self._last_delivery = float("-inf")  # any record of any partition
        self.seeks = 0
        self.accepted = 0

    def reset(self, expected: Mapping[Source, int | None], now: float) -> None:
        """After an assignment: the committed (or earliest) offset of each partition; None
        takes the first record delivered as the start."""
        self._parts = {key: _Partition(offset, now) for key, offset in expected.items()}
        self._last_delivery = now

    def admit(self, key: Source, offset: int, now: float) -> tuple[Admit, int]:
        """What to do with the record at ``offset``; the int is the offset to seek to (SEEK),
        or where the accepted gap starts (ACCEPT)."""
        part = self._parts.get(key)
        if part is None:
            part = self._parts[key] = _Partition(None, now)
        part.seen = now
        self._last_delivery = now
        expected = part.expected
        if expected is None or offset == expected:
            self._moved(part, offset)
            return Admit.PROCESS, offset
        if offset < expected:
            return Admit.SKIP, expected
        if part.seeks >= self.accept_after:
            self._moved(part, offset)
            self.accepted += 1
            return Admit.ACCEPT, expected
        if now - part.last_seek >= self.retry_s:
            self._seek(part, now)
            return Admit.SEEK, expected
        return Admit.SKIP, expected

    def due(
        self, now: float, highwater: Callable[[Source], int | None]
    ) -> list[tuple[Source, int]]:
        """Partitions behind their high watermark while the worker is quiet: seek them to the
        expected offset."""
        out = []
        quiet = now - self._last_delivery >= self.retry_s
        for key, part in self._parts.items():
            end = highwater(key) if part.expected is not None else None
            idle = now - part.seen >= self.retry_s
            if (
                not quiet
                or end is None
                or part.expected is None
                or end <= part.expected
                or not idle
            ):
                part.stuck_since = None
                continue
            if part.stuck_since is None:
                part.stuck_since = now
            elif now - part.stuck_since >= self.retry_s and now - part.last_seek >= self.retry_s:
                self._seek(part, now)
                out.append((key, part.expected))
        return out

    @staticmethod
    def _moved(part: _Partition, offset: int) -> None:
        part.expected = offset + 1
        part.seeks = 0
        part.last_seek = float("-inf")
        part.stuck_since = None

    def _seek(self, part: _Partition, now: float) -> None:
        part.seeks += 1
        part.last_seek = now
        self.seeks += 1
