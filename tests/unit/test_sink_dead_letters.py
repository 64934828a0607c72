"""The sink's dead-letter producer: a stop cuts a wait for acknowledgements already under way
(the broker unreachable), and nothing unacknowledged passes for delivered."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from rollstream.consumers.errors import DeadLetterError
from rollstream.consumers.store.dead_letters import DeadLetters
from rollstream.consumers.store.settings import SinkSettings


class _Msg:
    """A consumed record, as confluent-kafka's Message answers (the I/O edge)."""

    def __init__(self, offset: int) -> None:
        self._offset = offset

    def topic(self) -> str:
        return "t.rollout.events"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes:
        return b"k"

    def value(self) -> bytes:
        return b"\x00junk"


@pytest.fixture
def dead_letters(tmp_path: Any) -> DeadLetters:
    # nothing listens on port 1: every record stays unacknowledged
    settings = SinkSettings(home=tmp_path, kafka_bootstrap="127.0.0.1:1", insecure=True)
    return DeadLetters(settings)


def test_a_stop_cuts_a_long_wait_already_under_way(dead_letters: DeadLetters) -> None:
    dead_letters.send(_Msg(1), reason="bad bytes", code="undecodable", kind="")
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(DeadLetterError, match="not delivered"):
        dead_letters.finish(30.0, stopping=stop.is_set, stop_wait=1.0)
    took = time.monotonic() - t0
    assert 1.3 <= took < 3.5, took  # the stop at 0.5 s, then 1 s: not the 30 s asked for


def test_without_a_stop_the_timeout_holds(dead_letters: DeadLetters) -> None:
    dead_letters.send(_Msg(2), reason="bad bytes", code="undecodable", kind="")
    t0 = time.monotonic()
    with pytest.raises(DeadLetterError):
        dead_letters.finish(1.2)
    assert 1.1 <= time.monotonic() - t0 < 3.0


def test_nothing_sent_nothing_waited(dead_letters: DeadLetters) -> None:
    t0 = time.monotonic()
    dead_letters.finish(30.0)
    assert time.monotonic() - t0 < 0.5
