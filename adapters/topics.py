"""Topic manager: creates the topics declared in rollstream.schemas.topics, idempotently.

An existing topic is left as it is (its partitions and config are reported, not changed, except
that missing config keys are set); a missing one is created with the declared partitions,
replication, retention and cleanup policy.

    TopicError                       root of rollstream.adapters.topics
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic

from rollstream.schemas import CommonSettings, TopicSpec

__all__ = [
    "GroupLag",
    "TopicError",
    "TopicState",
    "admin_client",
    "describe_topics",
    "ensure_topics",
    "group_lag",
    "high_watermarks",
    "lag_rows",
    "namespace_lag",
    "watermarks",
]


class TopicError(Exception):
    """A topic could not be created or described."""


@dataclass(frozen=True, slots=True)
class TopicState:
    name: str
    partitions: int
    messages: int
    created: bool = False


def admin_client(settings: CommonSettings) -> AdminClient:
    return AdminClient(settings.kafka_config())


def ensure_topics(
    settings: CommonSettings,
    specs: list[TopicSpec] | None = None,
    *,
    admin: AdminClient | None = None,
    timeout: float = 30.0,
) -> list[str]:
    """Create the missing topics; returns the names created now. Safe to call any time."""
    admin = admin or admin_client(settings)
    specs = specs if specs is not None else settings.topics().specs()
    try:
        existing = set(admin.list_topics(timeout=timeout).topics)
    except KafkaException as exc:
        raise TopicError(f"cannot list topics at {settings.kafka_bootstrap}: {exc}") from exc
    missing = [s for s in specs if s.name not in existing]
    if not missing:
        return []
    futures = admin.create_topics(
        [
            NewTopic(
                s.name,
                num_partitions=s.partitions,
                replication_factor=s.replication,
                config=s.broker_config(),
            )
            for s in missing
        ],
        operation_timeout=timeout,
        request_timeout=timeout,
    )
    created: list[str] = []
    for name, fut in futures.items():
        try:
            fut.result()
            created.append(name)
        except KafkaException as exc:
            err = exc.args[0]
            if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                continue  # a concurrent creator won the race: same outcome
            raise TopicError(f"creating {name}: {exc}") from exc
    _wait_for_leaders(admin, created, timeout)
    _wait_for_offsets(settings, created, timeout)
    return sorted(created)


def _wait_for_offsets(settings: CommonSettings, names: list[str], timeout: float) -> None:
    """Metadata names a leader before that leader serves the partition (NOT_LEADER for a moment
    after creation): ask each new partition for its offsets, so the topics are usable at once."""
    if not names:
        return
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({**settings.kafka_config(), "group.id": "rollstream-topics-ready"})
    try:
        md = known_metadata(consumer, names, timeout)
        for name in names:
            for p in md.topics[name].partitions:
                watermarks(consumer, TopicPartition(name, p), timeout)
    finally:
        consumer.close()


def known_metadata(client: Any, names: list[str], timeout: float) -> Any:
    """Cluster metadata once it names every topic in ``names`` with its partitions.

    Each broker learns of a new topic on its own: the broker this client asks may not know it
    yet though the admin's broker already named its leaders. Ask again until all are known.
    """
    deadline = time.monotonic() + timeout
    while True:
        md = client.list_topics(timeout=max(0.1, deadline - time.monotonic()))
        unknown = [n for n in names if n not in md.topics or not md.topics[n].partitions]
        if not unknown:
            return md
        if time.monotonic() >= deadline:
            raise TopicError(f"brokers do not know {sorted(unknown)} after {timeout:.0f}s")
        time.sleep(0.1)


def _wait_for_leaders(admin: AdminClient, names: list[str], timeout: float) -> None:
    """New partitions have no leader for a moment; wait so callers can use them at once."""
    deadline = time.monotonic() + timeout
    pending = set(names)
    while pending and time.monotonic() < deadline:
        md = admin.list_topics(timeout=timeout)
        for name in list(pending):
            topic = md.topics.get(name)
            if (
                topic is not None
                and topic.error is None
                and topic.partitions
                and all(p.leader >= 0 and p.error is None for p in topic.partitions.values())
            ):
                pending.discard(name)
        if pending:
            time.sleep(0.1)
    if pending:
        raise TopicError(f"no partition leaders after {timeout:.0f}s for {sorted(pending)}")


def describe_topics(settings: CommonSettings, *, timeout: float = 10.0) -> list[TopicState]:
    """Partitions and message counts (high - low watermark) of this namespace's topics."""
    from confluent_kafka import Consumer, TopicPartition

    admin = admin_client(settings)
    md = admin.list_topics(timeout=timeout)
    names = [s.name for s in settings.topics().specs()]
    consumer = Consumer(
        {
            **settings.kafka_config(),
            "group.id": "rollstream-topics-describe",
            "enable.auto.commit": False,
        }
    )
    out: list[TopicState] = []
    try:
        for name in names:
            topic = md.topics.get(name)
            if topic is None or topic.error is not None:
                continue
            total = 0
            for p in topic.partitions:
                lo, hi = watermarks(consumer, TopicPartition(name, p), timeout)
                total += hi - lo
            out.append(TopicState(name, len(topic.partitions), total))
    finally:
        consumer.close()
    return out


def watermarks(consumer: Any, tp: Any, timeout: float) -> tuple[int, int]:
    """Watermarks, retrying while a just-created partition's leader is still loading."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            lo, hi = consumer.get_watermark_offsets(tp, timeout=timeout)
            return int(lo), int(hi)
        except KafkaException as exc:
            if time.monotonic() > deadline:
                raise TopicError(f"watermarks of {tp.topic}[{tp.partition}]: {exc}") from exc
            time.sleep(0.2)


def high_watermarks(consumer: Any, topic: str, timeout: float = 10.0) -> dict[int, int]:
    """Partition -> high watermark (the next offset) of every partition of ``topic``."""
    meta = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
    if meta is None or meta.error is not None:
        raise TopicError(f"topic {topic} does not exist")
    return {p: watermarks(consumer, TopicPartition(topic, p), timeout)[1] for p in meta.partitions}


def group_lag(
    admin: AdminClient, group: str, highs: dict[int, int], topic: str, timeout: float = 10.0
) -> int:
    """Records of ``topic`` the consumer ``group`` has not committed past: the sum over
    partitions of high watermark - committed offset (a partition with no commit counts from
    0, so a group that never committed lags by everything)."""
    request = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p) for p in highs])
    try:
        answer = admin.list_consumer_group_offsets([request])[group].result(timeout=timeout)
    except KafkaException as exc:
        raise TopicError(f"offsets of group {group}: {exc}") from exc
    committed = {tp.partition: tp.offset for tp in answer.topic_partitions if tp.offset >= 0}
    return sum(max(high - committed.get(p, 0), 0) for p, high in highs.items())


MAX_LAG_GROUPS = 64  # consumer groups of a namespace a lag answer covers (by name)


@dataclass(frozen=True, slots=True)
class GroupLag:
    group: str
    topic: str
    partitions: int  # partitions of the topic the group has committed offsets on
    lag: int  # records past its committed offsets (sum over those partitions)


def lag_rows(
    committed: dict[str, dict[tuple[str, int], int]], highs: dict[tuple[str, int], int]
) -> list[GroupLag]:
    """Per (group, topic): partitions with a commit and the records behind it (high watermark -
    committed, never below 0). Partitions without a high watermark are left out."""
    out = []
    for group in sorted(committed):
        by_topic: dict[str, list[int]] = {}
        for (topic, p), offset in committed[group].items():
            if (topic, p) in highs:
                by_topic.setdefault(topic, []).append(max(highs[(topic, p)] - offset, 0))
        out += [GroupLag(group, t, len(lags), sum(lags)) for t, lags in sorted(by_topic.items())]
    return out


def namespace_lag(settings: CommonSettings, timeout: float = 3.0) -> list[GroupLag]:
    """The lag of every consumer group of ``settings.namespace`` (groups named ``<ns>.*``; every
    group without a namespace; the first MAX_LAG_GROUPS by name) on each topic it committed
    offsets on. Each broker call waits at most ``timeout`` s; a failure is TopicError."""
    admin = admin_client(settings)
    prefix = f"{settings.namespace}." if settings.namespace else ""
    try:
        listing = admin.list_consumer_groups(request_timeout=timeout).result(timeout)
        names = sorted(g.group_id for g in listing.valid if g.group_id.startswith(prefix))
        committed: dict[str, dict[tuple[str, int], int]] = {}
        for group in names[:MAX_LAG_GROUPS]:
            future = admin.list_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(group)], request_timeout=timeout
            )[group]
            answer = future.result(timeout)
            committed[group] = {
                (tp.topic, tp.partition): tp.offset
                for tp in answer.topic_partitions
                if tp.offset >= 0
            }
    except (KafkaException, TimeoutError) as exc:
        what = str(exc) or f"no answer within {timeout} s"
        raise TopicError(f"consumer groups {prefix + '*' if prefix else '(all)'}: {what}") from exc
    wanted = set().union(*committed.values()) if committed else set()
    highs: dict[tuple[str, int], int] = {}
    if wanted:
        consumer = Consumer(
            {**settings.kafka_config(), "group.id": f"{prefix}rollstream-lag-probe",
             "enable.auto.commit": False}
        )  # fmt: skip
        try:
            for topic, p in wanted:
                _, highs[(topic, p)] = watermarks(consumer, TopicPartition(topic, p), timeout)
        finally:
            consumer.close()
    return lag_rows(committed, highs)
