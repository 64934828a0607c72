"""Reading a topic back to its end, for the tests (one copy, shared by every test directory:
tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from rollstream.adapters.topics import watermarks


def read_topic(config: dict[str, Any] | Any, topic: str, timeout: float = 60.0) -> list[Any]:
    """Every message of ``topic`` up to the high watermarks seen now, each partition in offset
    order (partitions interleaved). ``config``: a client config dict, or settings with
    ``kafka_config()``. Fails when a partition cannot be read to that end within ``timeout``."""
    conf = config if isinstance(config, dict) else config.kafka_config()
    consumer = Consumer(
        {**conf, "group.id": f"it-read-{uuid.uuid4().hex}", "enable.auto.commit": False}
    )
    try:
        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        ranges = {p: watermarks(consumer, TopicPartition(topic, p), 30) for p in parts}
        limit = {p: hi for p, (lo, hi) in ranges.items() if hi > lo}
        consumer.assign([TopicPartition(topic, p, ranges[p][0]) for p in limit])
        ends = dict(limit)  # partitions not read to their limit yet
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while ends and time.monotonic() < deadline:
            for msg in consumer.consume(1000, 0.5):
                p, offset = msg.partition(), msg.offset()
                if msg.error() is None and p is not None and offset is not None:
                    if offset < limit[p]:  # later messages are not "up to now"
                        out.append(msg)
                    if offset >= limit[p] - 1:
                        ends.pop(p, None)
        assert not ends, f"could not read {topic} to its end: {ends}"
        return out
    finally:
        consumer.close()
