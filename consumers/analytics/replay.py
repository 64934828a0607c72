"""Replay (``rollstream replay``): re-publish raw rollout events into another namespace, where
the processors (and the trainer) run again, with new settings or unchanged ones.

    ReplaySettings(CommonSettings)    ROLLSTREAM_REPLAY_* (docs/sink-and-replay.md)
    run(settings) -> ReplayResult     replay with a rich progress bar
    ReplaySettings.rollout_filter()   which rollouts: a store.queries.RolloutFilter (the store
                                      side of a replay, ``rollout_page`` and ``count_rollouts``,
                                      is in store/queries.py too)

A replay selects *whole rollouts*: a rollout is replayed when its RolloutStarted matches every
filter (started in [since, until), task, group, run_id, policy version, rollout id), and then
all its events are, in seq order, keyed by rollout_id. Sources:

- ``kafka``: the namespace's events topic, from the beginning, from given offsets
  (``replay_from_offsets``: partition -> offset) or from a time (``offsets_for_times`` at
  ``since - replay_time_slack_s``: Kafka time and event time may differ a little), up to the
  high watermarks seen at start. Values are copied byte for byte. With no filter and from the
  beginning nothing is decoded (undecodable records are copied too: the processors there
  dead-letter them again); otherwise the first message of each rollout key is decoded and
  decides for the rollout (a rollout whose first message in range is not its RolloutStarted
  started before the range and is skipped; undecodable records are counted and skipped).
- ``clickhouse``: the events table (FINAL) of the namespace's database, a page of whole
  rollouts at a time, in (rollout_id, seq) order, re-encoded with the Codec (rows.event_from_row
  is lossless: the bytes are those the producer wrote, for the default wire format). When the
  sink holds the chDB path, set ``analytics_url``: the pages come from its analytics server
  (analytics.client.AnalyticsClient), with ``analytics_api_key`` when the server wants one.

Per-rollout order: one rollout's events are read in order (one Kafka partition, or seq order)
and produced in that order by an idempotent producer (acks=all), so they land in order in one
partition of the target topic.

Errors: ``ReplayError`` (bad settings, delivery failed; rollstream.consumers.errors), and
through the clickhouse source the store's ``StoreError`` and the analytics ``AnalyticsError``.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from pydantic import SecretStr
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from rollstream.adapters.codecs import build_codec
from rollstream.consumers.analytics.client import AnalyticsClient
from rollstream.consumers.errors import ReplayError
from rollstream.consumers.store import chstore
from rollstream.consumers.store.queries import RolloutFilter, count_rollouts, rollout_page
from rollstream.schemas import CommonSettings, DecodeError, Event

__all__ = [
    "ReplayError",
    "ReplayResult",
    "ReplaySettings",
    "RolloutFilter",
    "run",
]

_US = 1_000_000


class ReplaySettings(CommonSettings):
    """``namespace`` is the source; ``replay_to`` the target namespace."""

    replay_to: str = ""  # the target namespace (required; not the source one)
    replay_source: Literal["kafka", "clickhouse"] = "kafka"  # where the events come from
    replay_since: dt.datetime | None = None  # rollouts started at or after (naive = UTC)
    replay_until: dt.datetime | None = None  # ... and before
    replay_task_ids: list[str] = []  # rollouts of these tasks (RolloutStarted.task_id)
    replay_group_ids: list[str] = []  # ... of these GRPO groups
    replay_run_ids: list[str] = []  # ... of these runs (RolloutStarted.run_id)
    replay_policy_versions: list[int] = []  # ... started under these policy versions
    replay_rollout_ids: list[str] = []  # ... these rollouts
    replay_from_offsets: dict[int, int] = {}  # kafka: partition -> first offset
    replay_time_slack_s: float = 300.0  # kafka: seek this much before since (clock skew)
    replay_page_rollouts: int = 500  # clickhouse: whole rollouts per page
    replay_progress: bool = True  # a rich progress bar on stderr
    replay_linger_ms: float = 20.0  # producer linger.ms
    analytics_url: str | None = None  # the sink's analytics server (clickhouse source)
    analytics_api_key: SecretStr | None = None  # ... and an analyst key of it (Bearer)

    def rollout_filter(self) -> RolloutFilter:
        return RolloutFilter(
            since_us=_to_us(self.replay_since),
            until_us=_to_us(self.replay_until),
            task_ids=tuple(self.replay_task_ids),
            group_ids=tuple(self.replay_group_ids),
            run_ids=tuple(self.replay_run_ids),
            policy_versions=tuple(self.replay_policy_versions),
            rollout_ids=tuple(self.replay_rollout_ids),
        )


def _to_us(value: dt.datetime | None) -> int | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return int(value.timestamp() * _US)


# --- run -----------------------------------------------------------------------------------


@dataclass
class ReplayResult:
    source: str
    target_topic: str
    read: int = 0
    published: int = 0
    rollouts_selected: int | None = 0  # None: not counted (a Kafka replay of everything)
    rollouts_skipped: int = 0
    undecodable: int = 0
    elapsed_s: float = 0.0
    partitions: dict[int, tuple[int, int]] = field(default_factory=dict)  # kafka: [start, end)

    @property
    def events_per_s(self) -> float:
        return self.published / self.elapsed_s if self.elapsed_s else 0.0


class _Publisher:
    def __init__(self, settings: ReplaySettings, topic: str) -> None:
        self.topic = topic
        self.errors: list[str] = []
        self.producer = Producer(
            {
                **settings.kafka_config(),
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": settings.replay_linger_ms,
                "batch.size": 4_000_000,
                "queue.buffering.max.messages": 1_000_000,
                "queue.buffering.max.kbytes": 1_048_576,
                "message.max.bytes": 20_000_000,
                "delivery.report.only.error": True,
                "on_delivery": self._delivered,
            }
        )

    def _delivered(self, err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            self.errors.append(str(err))

    def send(self, key: bytes | None, value: bytes | None) -> None:
        while True:
            try:
                self.producer.produce(self.topic, value=value, key=key)
                return
            except BufferError:
                self.producer.poll(0.05)

    def finish(self) -> None:
        left = self.producer.flush(120)
        if left or self.errors:
            raise ReplayError(
                f"{left} events not delivered to {self.topic}; errors: {self.errors[:3]}"
            )


def _progress(settings: ReplaySettings) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not settings.replay_progress,
        transient=False,
    )


def _kafka_ranges(
    settings: ReplaySettings, consumer: Consumer, topic: str, flt: RolloutFilter
) -> dict[int, tuple[int, int]]:
    md = consumer.list_topics(topic, timeout=30)
    if topic not in md.topics or md.topics[topic].error is not None:
        raise ReplayError(f"source topic {topic} does not exist")
    partitions = sorted(md.topics[topic].partitions)
    marks = {
        p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30) for p in partitions
    }
    starts = {p: lo for p, (lo, _) in marks.items()}
    if settings.replay_from_offsets:
        unknown = set(settings.replay_from_offsets) - set(partitions)
        if unknown:
            raise ReplayError(f"{topic} has no partitions {sorted(unknown)}")
        for p, offset in settings.replay_from_offsets.items():
            starts[p] = max(offset, marks[p][0])
    elif flt.since_us is not None:
        ms = max(0, flt.since_us // 1000 - int(settings.replay_time_slack_s * 1000))
        found = consumer.offsets_for_times(
            [TopicPartition(topic, p, ms) for p in partitions], timeout=30
        )
        for tp in found:
            starts[tp.partition] = tp.offset if tp.offset >= 0 else marks[tp.partition][1]
    return {p: (starts[p], marks[p][1]) for p in partitions}


def _from_kafka(settings: ReplaySettings, out: _Publisher, result: ReplayResult) -> None:
    topic = settings.topics().events
    flt = settings.rollout_filter()
    consumer = Consumer(
        {
            **settings.kafka_config(),
            "group.id": f"{settings.topics().name('rollstream-replay')}-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "fetch.max.bytes": 64 << 20,
            "max.partition.fetch.bytes": 16 << 20,
        }
    )
    codec = build_codec(settings)
    try:
        ranges = _kafka_ranges(settings, consumer, topic, flt)
        result.partitions = ranges
        select_all = not flt.active and not settings.replay_from_offsets
        pending = {p: end for p, (start, end) in ranges.items() if start < end}
        total = sum(end - start for start, end in ranges.values() if start < end)
        consumer.assign([TopicPartition(topic, p, ranges[p][0]) for p in pending])
        decided: dict[bytes, bool] = {}
        with _progress(settings) as progress:
            task = progress.add_task(f"replay {topic} -> {out.topic}", total=total, rate="")
            started = time.monotonic()
            while pending:
                msgs = _poll(consumer)
                if not msgs:
                    _drop_finished(consumer, topic, pending)
                    continue
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        if err.fatal():
                            raise ReplayError(f"consumer error: {err}")
                        continue
                    p, offset = msg.partition(), msg.offset()
                    end = pending.get(p) if p is not None else None
                    if p is None or offset is None or end is None or offset >= end:
                        continue
                    if offset >= end - 1:
                        del pending[p]
                    result.read += 1
                    if select_all:
                        out.send(msg.key(), msg.value())
                        result.published += 1
                        continue
                    key = msg.key()
                    verdict = decided.get(key) if key else None
                    if verdict is None:
                        try:
                            event = codec.decode(msg.value(), expect=Event)
                        except DecodeError:
                            result.undecodable += 1
                            continue
                        key = event.rollout_id.encode()
                        verdict = decided.get(key)
                        if verdict is None:
                            verdict = decided[key] = flt.matches(event)
                            if verdict:
                                result.rollouts_selected = (result.rollouts_selected or 0) + 1
                            else:
                                result.rollouts_skipped += 1
                    if verdict:
                        out.send(key, msg.value())
                        result.published += 1
                out.producer.poll(0)
                rate = result.read / max(time.monotonic() - started, 1e-9)
                progress.update(task, completed=result.read, rate=f"{rate:,.0f} ev/s")
            out.finish()
            progress.update(task, completed=total)
        if select_all:
            result.rollouts_selected = None  # not counted: nothing was decoded
    finally:
        consumer.close()


def _poll(consumer: Consumer, n: int = 10_000, timeout: float = 0.5) -> list[Any]:
    """What the client has queued, at once; else wait for one message (``consume(n, t)``
    would wait the whole timeout whenever fewer than n are queued: large events)."""
    msgs = consumer.consume(n, 0)
    if msgs:
        return msgs
    first = consumer.poll(timeout)
    return [] if first is None else [first, *consumer.consume(n - 1, 0)]


def _drop_finished(consumer: Consumer, topic: str, pending: dict[int, int]) -> None:
    """Partitions whose position reached their end (the last offsets may be gaps)."""
    positions = consumer.position([TopicPartition(topic, p) for p in pending])
    for tp in positions:
        if tp.offset >= 0 and tp.offset >= pending.get(tp.partition, 0):
            pending.pop(tp.partition, None)


def _pages(settings: ReplaySettings, flt: RolloutFilter) -> tuple[int, int, Iterator[list[bytes]]]:
    page = settings.replay_page_rollouts
    if settings.analytics_url:
        remote = AnalyticsClient(settings.analytics_url, api_key=settings.analytics_api_key)
        remote.health()
        rollouts, events = remote.count(settings.namespace, flt.to_json())

        def remote_pages() -> Iterator[list[bytes]]:
            try:
                yield from remote.events(settings.namespace, flt.to_json(), page_rollouts=page)
            finally:
                remote.close()

        return rollouts, events, remote_pages()
    client = chstore.connect(settings.clickhouse_url)
    database = chstore.database_for(settings.namespace)
    rollouts, events = count_rollouts(client, database, flt)
    codec = build_codec(settings)

    def local_pages() -> Iterator[list[bytes]]:
        after: str | None = None
        try:
            while True:
                records, after = rollout_page(client, database, flt, after, page, codec)
                if records:
                    yield records
                if after is None:
                    return
        finally:
            client.close()

    return rollouts, events, local_pages()


def _from_clickhouse(settings: ReplaySettings, out: _Publisher, result: ReplayResult) -> None:
    rollouts, total, pages = _pages(settings, settings.rollout_filter())
    result.rollouts_selected = rollouts
    with _progress(settings) as progress:
        task = progress.add_task(
            f"replay {chstore.database_for(settings.namespace)} -> {out.topic}",
            total=total, rate="",
        )  # fmt: skip
        started = time.monotonic()
        for records in pages:
            for i in range(0, len(records), 2):
                out.send(records[i], records[i + 1])
            n = len(records) // 2
            result.read += n
            result.published += n
            out.producer.poll(0)
            rate = result.read / max(time.monotonic() - started, 1e-9)
            progress.update(task, completed=result.read, rate=f"{rate:,.0f} ev/s")
        out.finish()


def run(settings: ReplaySettings) -> ReplayResult:
    """Replay the selected rollouts of ``settings.namespace`` into ``settings.replay_to``."""
    from rollstream.adapters.topics import ensure_topics

    target_ns = settings.replay_to.strip(".")
    if not target_ns:
        raise ReplayError("set the target namespace (replay_to / --to)")
    if target_ns == settings.namespace.strip("."):
        raise ReplayError("the target namespace must differ from the source namespace")
    target = settings.model_copy(update={"namespace": target_ns})
    ensure_topics(target)
    out = _Publisher(settings, target.topics().events)
    result = ReplayResult(settings.replay_source, out.topic)
    started = time.monotonic()
    if settings.replay_source == "kafka":
        _from_kafka(settings, out, result)
    else:
        _from_clickhouse(settings, out, result)
    result.elapsed_s = time.monotonic() - started
    return result
