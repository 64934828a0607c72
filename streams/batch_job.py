"""The batch job (I/O shell of streams/batch.py): a namespace's raw events from Kafka through the
batch path, its trajectories, samples and dead letters into another namespace's topics.

    run_batch(source, target) -> dict     one pass; counts and timings
    BatchSettings / run(settings)         the same from one settings object (for a CLI command)

Reads ``<source ns>.rollout.events``, every partition from its low watermark to the high
watermark seen at the start (records written later are not read), each partition in offset
order. Writes ``<target ns>.trajectories`` (each on its group's partition, as the builder does),
``<target ns>.samples`` and ``<target ns>.rollout.events.dlq`` (keyed as the faust processor
keys them, placed by Kafka's default partitioner: murmur2) with an idempotent producer,
acks=all; the job returns once every record is acknowledged. The target's settings decide the
processing (``builder_config()``, ``group_config()``), as they would for ``rollstream process``
there; the route of a group is that of the target's trajectories topic. Running it again
writes the same records again (same ids: consumers deduplicate). The source and the target
namespaces differ, except with ``in_place=True``: a namespace's own events (replayed into it,
as ``rollstream retrain`` does) processed into its own topics, as a processor there would.

With ``workers`` > 1 (``batch_workers``) the batch path runs in that many processes in two
phases (streams/batch_parallel.py, the same records out as multisets), each process with Kafka
clients of its own, made after the fork: in phase 1 each reads its share of the source
partitions into memory, runs their builders and writes their trajectories and dead letters; in
phase 2 each runs the aggregators of its share of the trajectories partitions (over the
trajectories of all, in the hand-over order) and writes their samples and dead letters. Faster
where cores are free, at the cost of holding the run's events and trajectories in memory (one
worker streams them, its memory bounded by the partitions' clock skew). The job returns once
every worker's records are acknowledged.

    ProcessorError                   root of the processor shell (streams/errors.py)
    ├── TopicMissingError            the source events topic does not exist
    └── BatchJobError                bad settings, or records not delivered
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from pydantic import Field

from rollstream.adapters.codecs import build_codec
from rollstream.adapters.topics import admin_client, ensure_topics, watermarks
from rollstream.schemas import Codec, CommonSettings

from .app import group_route
from .batch import BatchConfig, BatchProcessor, SourceRecord
from .batch_parallel import two_phases
from .batch_phases import Built, Made, aggregate_lanes, build_partitions
from .books import Out, Sink
from .errors import ProcessorError, TopicMissingError
from .settings import ProcessorSettings

__all__ = ["BatchJobError", "BatchSettings", "run", "run_batch"]

_POLL = 10_000  # records taken from the client's queue at a time


class BatchJobError(ProcessorError):
    """The batch job cannot run (bad settings) or records were not delivered."""


class BatchSettings(ProcessorSettings):
    """The batch job's settings: ``namespace`` (and every ROLLSTREAM_PROC_* setting) is the
    target, ``batch_source`` the namespace whose events are read."""

    batch_source: str = ""  # the namespace whose rollout.events are read (required)
    batch_linger_ms: float = 20.0  # producer linger.ms
    batch_timeout_s: float = 120.0  # the longest wait for metadata and the final flush
    # processes for the batch path (1: records streamed through one, memory bounded by the
    # partitions' clock skew; N > 1: N processes, each reading its share into memory)
    batch_workers: int = Field(1, ge=1, le=64)


def run(settings: BatchSettings) -> dict[str, Any]:
    """The batch job from ``settings`` (see ``run_batch``)."""
    source = settings.model_copy(update={"namespace": settings.batch_source})
    return run_batch(
        source,
        settings,
        linger_ms=settings.batch_linger_ms,
        timeout_s=settings.batch_timeout_s,
        workers=settings.batch_workers,
    )


class _Output:
    """The target's topics behind one idempotent producer."""

    def __init__(self, target: ProcessorSettings, linger_ms: float) -> None:
        topics = target.topics()
        self.topics = {
            Sink.TRAJECTORIES: topics.trajectories,
            Sink.SAMPLES: topics.samples,
            Sink.DLQ: topics.dlq,
        }
        self.errors: list[str] = []
        self.sent = {sink: 0 for sink in Sink}
        errors = self.errors

        def delivered(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                errors.append(str(err))

        # the callback holds the error list, not this object: no cycle, so the producer (and
        # its threads) goes with the last reference to this object, as a fork needs
        self.producer = Producer(
            {
                **target.kafka_config(),
                "enable.idempotence": True,
                "acks": "all",
                "partitioner": "murmur2_random",  # Kafka's default partitioner, as faust's
                "linger.ms": linger_ms,
                "batch.size": 4_000_000,
                "queue.buffering.max.messages": 1_000_000,
                "queue.buffering.max.kbytes": 1_048_576,
                "message.max.bytes": target.proc_max_message_bytes,
                "delivery.report.only.error": True,
                "on_delivery": delivered,
            }
        )

    def send(self, outs: list[Out]) -> None:
        produce = self.producer.produce
        for out in outs:
            topic = self.topics[out.sink]
            extra: dict[str, Any] = {} if out.partition is None else {"partition": out.partition}
            while True:
                try:
                    produce(topic, out.value, out.key, headers=list(out.headers), **extra)
                    break
                except BufferError:
                    self.producer.poll(0.05)
                except KafkaException as exc:  # refused at once (a record over the size limit)
                    raise BatchJobError(f"cannot write a record to {topic}: {exc}") from exc
            self.sent[out.sink] += 1
        self.producer.poll(0)

    def finish(self, timeout_s: float) -> None:
        left = self.producer.flush(timeout_s)
        if left or self.errors:
            raise BatchJobError(f"{left} records not delivered; errors: {self.errors[:3]}")


def _real_now_us() -> int:
    return time.time_ns() // 1000


def _partitions(client: Any, topic: str, timeout_s: float) -> list[int]:
    """The partitions of ``topic`` (a consumer's or an admin client's metadata)."""
    md = client.list_topics(topic, timeout=timeout_s)
    found = md.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        raise TopicMissingError(f"topic {topic} does not exist")
    return sorted(found.partitions)


def run_batch(
    source: CommonSettings,
    target: ProcessorSettings,
    *,
    linger_ms: float = 20.0,
    timeout_s: float = 120.0,
    in_place: bool = False,
    workers: int = 1,
) -> dict[str, Any]:
    """Read ``source``'s events to the end seen now, process them as one finished run with
    ``target``'s processor settings, write the outputs to ``target``'s topics. Returns counts
    (the batch path's, and records written per topic) and timings. ``in_place``: the source
    may be the target namespace (its events replayed there, no processor running on it).
    ``workers`` > 1: that many processes read, process and write (see the module
    docstring)."""
    target_ns = target.namespace.strip(".")
    if not target_ns or (target_ns == source.namespace.strip(".") and not in_place):
        raise BatchJobError("the target namespace must be set and differ from the source")
    if not 1 <= workers <= 64:
        raise BatchJobError(f"workers must be 1..64, got {workers}")
    started, cpu0 = time.monotonic(), time.process_time()
    ensure_topics(target)
    source_topic = source.topics().events
    consumer = _consumer(source)
    closed = False
    try:
        n_groups = len(_partitions(admin_client(target), target.topics().trajectories, timeout_s))
        ranges = {
            p: watermarks(consumer, TopicPartition(source_topic, p), timeout_s)
            for p in _partitions(consumer, source_topic, timeout_s)
        }
        ends = {p: hi for p, (lo, hi) in ranges.items() if hi > lo}
        config = BatchConfig.from_settings(
            target, route=group_route(n_groups), events_topic=source_topic, real_now=_real_now_us
        )
        codec = build_codec(target)
        read_started = time.monotonic()
        if workers == 1 or len(ends) < 2:
            consumer.assign([TopicPartition(source_topic, p, ranges[p][0]) for p in ends])
            output = _Output(target, linger_ms)
            processor = BatchProcessor(config, codec, partitions=ends)
            _read(consumer, source_topic, ends, processor.feed, processor.end_partition, output)
            output.send(processor.finish())
            events, counts, sent = processor.records, processor.counts(), output.sent
            flush_started = time.monotonic()
            output.finish(timeout_s)
        else:
            consumer.close()  # no Kafka client may live in this process when it forks
            closed = True
            job = _Workers(source, target, config, codec, linger_ms, timeout_s)
            starts = {p: ranges[p][0] for p in ends}
            events, counts, sent = job.run(starts, ends, workers)
            flush_started = time.monotonic()
    finally:
        if not closed:
            consumer.close()
    done = time.monotonic()
    elapsed = done - started
    return {
        "source_topic": source_topic,
        "target_namespace": target.namespace,
        "partitions": {p: list(r) for p, r in ranges.items()},
        "events": events,
        "written": {str(sink): n for sink, n in sent.items()},
        "counts": counts,
        "setup_s": round(read_started - started, 3),
        "read_and_process_s": round(flush_started - read_started, 3),
        "flush_s": round(done - flush_started, 3),
        "elapsed_s": round(elapsed, 3),
        "cpu_s": round(time.process_time() - cpu0, 3),
        "events_per_s": round(events / elapsed) if elapsed else 0,
    }


def _consumer(source: CommonSettings) -> Consumer:
    return Consumer(
        {
            **source.kafka_config(),
            "group.id": f"{source.topics().name('rollstream-batch')}-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "fetch.max.bytes": 64 << 20,
            "max.partition.fetch.bytes": 16 << 20,
        }
    )


@dataclass
class _Workers:
    """The batch path over several processes (streams/batch_parallel.py's two phases), each
    worker reading and writing Kafka itself: in phase 1 each reads its share of the source
    partitions and writes the trajectories and dead letters its builders made; in phase 2 each
    writes the samples and dead letters of its share of the trajectories partitions. Only the
    trajectories (phase 2 needs them in the hand-over order) and the counts come back. Each
    worker's Kafka clients are made after the fork and gone before the next one."""

    source: CommonSettings
    target: ProcessorSettings
    config: BatchConfig
    codec: Codec
    linger_ms: float
    timeout_s: float

    def run(
        self, starts: dict[int, int], ends: dict[int, int], workers: int
    ) -> tuple[int, dict[str, int], dict[Sink, int]]:
        """(events read, counts, records written per sink)."""
        sizes = {p: ends[p] - starts[p] for p in ends}  # offsets: records, or an upper bound
        phases = two_phases(
            sizes,
            workers,
            lambda share, local: self._build(share, starts, ends, local),
            self._aggregate,
        )
        sent = {sink: 0 for sink in Sink}
        for _, part in [*phases.built, *phases.aggregated]:
            for sink, n in part.items():
                sent[sink] += n
        return phases.counts["records"], phases.counts, sent

    def _build(
        self, share: set[int], starts: dict[int, int], ends: dict[int, int], local: bool
    ) -> tuple[Built, dict[Sink, int]]:
        topic = self.source.topics().events
        records: list[SourceRecord] = []
        output = _Output(self.target, self.linger_ms)
        consumer = _consumer(self.source)
        try:
            consumer.assign([TopicPartition(topic, p, starts[p]) for p in sorted(share)])
            mine = {p: ends[p] for p in share}
            _read(consumer, topic, mine, _collect(records), _nothing, output)
        finally:
            consumer.close()
        built = build_partitions(records, self.config, self.codec, share, keep=local)
        output.send([m.out for m in built.made])
        output.send(built.outs)
        output.finish(self.timeout_s)
        return built, output.sent

    def _aggregate(
        self, made: list[Made], share: set[int]
    ) -> tuple[dict[str, int], dict[Sink, int]]:
        output = _Output(self.target, self.linger_ms)
        part = aggregate_lanes(made, self.config, self.codec, share)
        output.send(part.outs)
        output.finish(self.timeout_s)
        return part.counts, output.sent


Feed = Callable[[SourceRecord], list[Out]]


def _collect(records: list[SourceRecord]) -> Feed:
    """A feed that keeps every record (and has nothing to send yet)."""

    def feed(record: SourceRecord) -> list[Out]:
        records.append(record)
        return []

    return feed


def _nothing(_partition: int) -> list[Out]:
    return []


def _read(
    consumer: Consumer,
    topic: str,
    ends: dict[int, int],
    feed: Feed,
    end_partition: Callable[[int], list[Out]],
    output: _Output,
) -> None:
    """Feed every record up to ``ends`` (then ``end_partition``), producing the outputs as
    they come."""
    pending = dict(ends)
    send = output.send
    while pending:
        msgs = _poll(consumer)
        if not msgs:
            _ended(consumer, topic, pending, end_partition, output)
            continue
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.fatal():
                    raise BatchJobError(f"consumer error: {err}")
                continue
            p, offset = msg.partition(), msg.offset()
            end = pending.get(p) if p is not None else None
            if p is None or offset is None or end is None or offset >= end:
                continue
            outs = feed(SourceRecord(p, offset, msg.key(), msg.value()))
            if outs:
                send(outs)
            if offset >= end - 1:
                del pending[p]
                send(end_partition(p))


def _ended(
    consumer: Consumer,
    topic: str,
    pending: dict[int, int],
    end_partition: Callable[[int], list[Out]],
    output: _Output,
) -> None:
    """Partitions whose position reached their end (the last offsets may be no records)."""
    for tp in consumer.position([TopicPartition(topic, p) for p in pending]):
        if tp.offset >= 0 and tp.offset >= pending.get(tp.partition, 1 << 62):
            del pending[tp.partition]
            output.send(end_partition(tp.partition))


def _poll(consumer: Consumer, timeout: float = 0.5) -> list[Any]:
    """What the client has queued, at once; else wait for one record (``consume(n, t)`` waits
    the whole timeout whenever fewer than n are queued)."""
    msgs = consumer.consume(_POLL, 0)
    if msgs:
        return msgs
    first = consumer.poll(timeout)
    return [] if first is None else [first, *consumer.consume(_POLL - 1, 0)]
