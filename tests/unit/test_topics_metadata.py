"""known_metadata asks again until every broker answer names the new topics (a 3-node cluster
learns of a created topic one broker at a time)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from rollstream.adapters.topics import TopicError, known_metadata


@dataclass
class _Topic:
    partitions: dict[int, Any]


@dataclass
class _Metadata:
    topics: dict[str, _Topic]


@dataclass
class _Client:
    """Answers list_topics from a script of metadata, the last one for ever."""

    answers: list[_Metadata]
    calls: list[float] = field(default_factory=list)

    def list_topics(self, timeout: float) -> _Metadata:
        self.calls.append(timeout)
        return self.answers[min(len(self.calls) - 1, len(self.answers) - 1)]


def test_waits_until_a_lagging_broker_knows_the_topics() -> None:
    known = _Metadata({"a": _Topic({0: None}), "b": _Topic({0: None, 1: None})})
    client = _Client([_Metadata({"a": _Topic({0: None})}), _Metadata({"b": _Topic({})}), known])
    assert known_metadata(client, ["a", "b"], timeout=5.0) is known
    assert len(client.calls) == 3
    assert all(0.1 <= t <= 5.0 for t in client.calls)


def test_names_the_topics_no_broker_knows_after_the_timeout() -> None:
    client = _Client([_Metadata({"a": _Topic({0: None})})])
    with pytest.raises(TopicError, match=r"\['b', 'c'\]"):
        known_metadata(client, ["a", "c", "b"], timeout=0.3)
    assert len(client.calls) >= 2
