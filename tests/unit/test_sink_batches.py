"""The sink's batch boundaries (consumers/store/batches.py): pure, no Kafka, no ClickHouse.

The property that makes the sink idempotent: whatever the timer does and wherever the process
crashes (between an intent and its insert, between an insert and its commit), the batches
inserted over all runs are either the same offset range (same dedup token: ClickHouse drops
the retry) or disjoint ones."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.consumers.store.batches import INTENT_PREFIX, BatchCutter, RawBatch, parse_intent


def cutter(align: int = 10, max_bytes: int = 1 << 30, intent: tuple[int, int] | None = None):
    return BatchCutter("t", 0, align=align, max_bytes=max_bytes, intent=intent)


def feed(c: BatchCutter, offsets: list[int], size: int = 1) -> list[RawBatch]:
    out: list[RawBatch] = []
    for o in offsets:
        out += c.add(o, size, o, 0.0)
    return out


def ranges(batches: list[RawBatch]) -> list[tuple[int, int]]:
    return [(b.first, b.last) for b in batches]


def test_batches_end_at_multiples_of_n() -> None:
    assert ranges(feed(cutter(), list(range(35)))) == [(0, 9), (10, 19), (20, 29)]
    # a start that is not aligned ends at the next boundary
    assert ranges(feed(cutter(), list(range(13, 35)))) == [(13, 19), (20, 29)]


def test_gaps_and_the_byte_cap_are_boundaries_too() -> None:
    # offset 12 is missing: the batch [10, 19] still ends at 19; a jump over 19 closes it
    assert ranges(feed(cutter(), [10, 11, 13, 19, 20])) == [(10, 19)]
    assert ranges(feed(cutter(), [10, 11, 13, 25, 26])) == [(10, 13)]
    # 3 bytes per message, a 7-byte cap: closes on the message that reaches it
    assert ranges(feed(cutter(max_bytes=7), list(range(10)), size=3)) == [
        (0, 2),
        (3, 5),
        (6, 8),
        (9, 9),
    ]


def test_timer_cut_is_partial_and_an_intent_reproduces_it() -> None:
    c = cutter()
    feed(c, [0, 1, 2, 3])
    assert c.due(0.5, 1.0, log_end=4) is None
    batch = c.due(1.0, 1.0, log_end=4)
    assert batch is not None and (batch.first, batch.last, batch.partial) == (0, 3, True)
    # after a crash the consumer resumes at 0 with the intent (0, 3) and sees more messages
    c = cutter(intent=(0, 3))
    assert ranges(feed(c, list(range(12)))) == [(0, 3), (4, 9)]
    # the byte cap does not override an intent
    c = cutter(max_bytes=2, intent=(0, 3))
    assert ranges(feed(c, list(range(5)), size=5)) == [(0, 3), (4, 4)]
    # an intent for another offset is ignored
    assert ranges(feed(cutter(intent=(5, 7)), list(range(10)))) == [(0, 9)]


def test_offsets_must_increase() -> None:
    c = cutter()
    feed(c, [3])
    with pytest.raises(ValueError):
        c.add(3, 1, None, 0.0)


def test_parse_intent() -> None:
    assert parse_intent(f"{INTENT_PREFIX}42") == 42
    assert parse_intent("") is None
    assert parse_intent(None) is None
    assert parse_intent(f"{INTENT_PREFIX}x") is None


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 120),
    align=st.integers(1, 17),
    max_bytes=st.integers(1, 60),
    gaps=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_crashes_anywhere_never_insert_overlapping_ranges(
    n: int, align: int, max_bytes: int, gaps: int, seed: int
) -> None:
    """A log that grows while the sink runs, fetches of random sizes, a flush timer that fires
    at random (cutting only caught-up batches, as the sink does) and crashes at every step
    where one can happen: before an intent's insert, between an insert and its commit, or
    with messages fetched and not yet stored."""
    rng = random.Random(seed)
    log = sorted(rng.sample(range(n + gaps * 5), n))  # offsets with gaps
    sizes = {o: rng.randint(1, 10) for o in log}
    written = 0  # how many of the log's messages exist so far
    committed, intent = 0, None  # the group's committed offset and its metadata
    inserted: set[tuple[int, int]] = set()
    for _run in range(400):
        if committed > log[-1]:
            break
        c = cutter(align, max_bytes, intent)
        position = committed  # the consumer's next offset
        while True:
            written = min(n, written + rng.randint(0, 4))  # producers append
            available = [o for o in log[:written] if o >= position]
            fetched = available[: rng.randint(0, len(available))]
            log_end = log[written - 1] + 1 if written else 0  # the high watermark
            batches: list[RawBatch] = []
            for o in fetched:
                batches += c.add(o, sizes[o], o, 0.0)
                position = o + 1
            if rng.random() < 0.3 and (cut := c.due(1.0, 1.0, log_end)) is not None:
                batches.append(cut)  # the flush timer
            crashed = False
            for b in batches:
                if b.partial:
                    committed, intent = b.first, (b.first, b.last)  # before the insert
                    if rng.random() < 0.15:
                        crashed = True
                        break
                inserted.add((b.first, b.last))
                if rng.random() < 0.15:
                    crashed = True
                    break
                committed, intent = b.last + 1, None
            if crashed or rng.random() < 0.03 or committed > log[-1]:
                break
    assert committed > log[-1], "the simulation did not finish"
    spans = sorted(inserted)
    for (_, last), (first, _) in itertools.pairwise(spans):
        assert last < first, f"overlapping inserts {spans}"
    covered = {o for first, last in spans for o in log if first <= o <= last}
    assert covered == set(log)


def test_the_timer_waits_for_a_caught_up_batch() -> None:
    c = cutter()
    feed(c, [0, 1, 2])
    assert c.due(5.0, 1.0, log_end=7) is None  # more is in the log: it will be fetched
    assert c.due(5.0, 1.0, log_end=None) is None
    assert c.due(5.0, 1.0, log_end=7, max_wait=5.0) is not None  # the safety valve
    feed(c, [3])
    batch = c.due(5.0, 1.0, log_end=4)
    assert batch is not None and (batch.first, batch.last, batch.partial) == (3, 3, True)
