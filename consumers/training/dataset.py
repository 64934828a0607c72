"""The samples topic as a training input: ``SampleSource`` (the trainer's intake) and
``SamplesDataset``, a torch IterableDataset for external trainers (verl, TRL, a plain loop).

SampleSource is one confluent-kafka consumer in a consumer group over ``Topics(ns).samples``:
    poll -> decode (Codec, expect=Sample) -> validate (batching.validate_sample, token limit)
Records that fail are sent to the dead-letter topic ``Topics(ns).dlq`` unchanged (same key and
value) with the headers of the one dead-letter contract (``rollstream.schemas.dlq``): code
``undecodable`` (not a Sample) or ``invalid`` (a Sample that cannot be trained: inconsistent
arrays, over the token budget), kind ``Sample``, stage ``trainer`` or ``dataset``, processor the
consumer group; they come back from ``poll`` with ``sample=None`` so the caller still accounts
for their offsets. A bad record never raises. Auto-commit is off: whoever uses the source decides
what an offset commit means. Where each assigned partition starts is decided at assignment:
``positions`` (the trainer's checkpoint offsets) first, then ``start`` (earliest, latest, or the
group's committed offset).

SamplesDataset(settings, group_id=...) yields Sample records (or collated batches) and commits,
per consumer group, the offsets of what it has handed out:
    commit="auto"    offsets are committed asynchronously at most every ``commit_interval_s``
                     (when the caller asks for more), and synchronously when the iterator
                     closes and when a rebalance takes partitions away. A clean stop (break,
                     exhaustion, idle timeout) never repeats or skips a record. A crash repeats
                     what was handed out since the last commit; with DataLoader workers, which
                     prefetch, it can also skip records that were prefetched but not trained.
    commit="manual"  nothing is committed until ``commit()``; call it after your checkpoint.
                     For exactly-once, save ``position()`` (next offset per partition after
                     everything handed out) in your checkpoint and pass it back as
                     ``start_offsets`` on restart, with num_workers=0 (what rollstream's own
                     trainer does with its checkpoints).
Each DataLoader worker opens its own consumer in the group, so the group splits the partitions
between workers and every record is read by one of them (use num_workers <= partitions).
The group id is namespaced like the topics (``<namespace>.<group_id>``).

Errors: ``SourceError`` (rollstream.consumers.errors): the Kafka client failed (a fatal
consumer error, a dead-letter record that could not be delivered, a commit that failed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_STORED,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from torch import Tensor
from torch.utils.data import IterableDataset

from rollstream.adapters.codecs import build_codec
from rollstream.consumers.errors import BatchingError, SourceError
from rollstream.consumers.training.batching import TokenBudgetBatcher, validate_sample
from rollstream.consumers.training.batching import collate as collate_samples
from rollstream.schemas import Codec, CommonSettings, DecodeError, Sample
from rollstream.schemas.dlq import CODE_INVALID, CODE_UNDECODABLE, dlq_headers

__all__ = [
    "DATASET_GROUP",
    "Polled",
    "SampleSource",
    "SamplesDataset",
    "SourceError",
    "Start",
    "close_producer",
]

Start = Literal["earliest", "latest", "committed"]
DATASET_GROUP = "rollstream-dataset-v1"


@dataclass(frozen=True, slots=True)
class Polled:
    """One record of the samples topic. ``sample`` is None when the record went to the DLQ."""

    partition: int
    offset: int
    sample: Sample | None
    nbytes: int


class SampleSource:
    """The samples topic through one consumer of ``group_id`` (see the module docstring).

    positions: next offset per partition to start from (a mapping, or a callable read at each
    assignment, so a trainer can hand its latest checkpoint offsets). start: where partitions
    not in positions start. max_tokens: samples longer than this go to the DLQ.
    on_revoke(partitions) runs before partitions are taken away. ``generation`` changes at every
    assignment and revocation: records polled before that may have to be read again."""

    def __init__(
        self,
        settings: CommonSettings,
        *,
        group_id: str,
        instance_id: str | None = None,
        positions: Mapping[int, int] | Callable[[], Mapping[int, int]] | None = None,
        start: Start = "earliest",
        max_tokens: int | None = None,
        session_timeout_ms: int = 6000,
        max_poll_interval_ms: int = 1_800_000,
        consumer_options: Mapping[str, Any] | None = None,
        on_revoke: Callable[[list[int]], None] | None = None,
        stage: str = "trainer",
        codec: Codec | None = None,
    ) -> None:
        topics = settings.topics()
        self.topic = topics.samples
        self.dlq_topic = topics.dlq
        self.stage = stage
        self.group_id = group_id
        self.max_tokens = max_tokens
        self.codec = codec or build_codec(settings)
        self.start = start
        self._positions = positions
        self._on_revoke_hook = on_revoke
        self.generation = 0
        self.assignment: dict[int, int] = {}  # partition -> offset positioned at (or symbolic)
        self.dlq_sent = 0
        self.errors = 0
        self._dlq_failed: list[str] = []
        conf: dict[str, Any] = {
            **settings.kafka_config(),
            "group.id": group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "latest" if start == "latest" else "earliest",
            "session.timeout.ms": session_timeout_ms,
            "heartbeat.interval.ms": max(500, session_timeout_ms // 6),
            "max.poll.interval.ms": max(max_poll_interval_ms, session_timeout_ms),
            "fetch.max.bytes": 64 * 1024 * 1024,
            "max.partition.fetch.bytes": 16 * 1024 * 1024,
            **(consumer_options or {}),
        }
        if instance_id:
            conf["group.instance.id"] = instance_id
        self._consumer = Consumer(conf)
        self._producer = Producer(
            {**settings.kafka_config(), "enable.idempotence": True, "acks": "all"}
        )
        self._consumer.subscribe(
            [self.topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )

    # -- group callbacks (run inside poll)

    def _current_positions(self) -> Mapping[int, int]:
        p = self._positions
        return (p() if callable(p) else p) or {}

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        positions = self._current_positions()
        for tp in partitions:
            if tp.partition in positions:
                tp.offset = positions[tp.partition]
            elif self.start == "earliest":
                tp.offset = OFFSET_BEGINNING
            elif self.start == "latest":
                tp.offset = consumer.get_watermark_offsets(tp, timeout=10)[1]
            else:
                tp.offset = OFFSET_STORED
            self.assignment[tp.partition] = tp.offset
        consumer.assign(partitions)
        self.generation += 1

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if self._on_revoke_hook is not None:
            self._on_revoke_hook([tp.partition for tp in partitions])
        for tp in partitions:
            self.assignment.pop(tp.partition, None)
        self.generation += 1

    # -- reading

    def fetch(self, max_records: int = 500, timeout: float = 0.5) -> list[Message]:
        """Up to ``max_records`` raw records, in order per partition (waits at most ``timeout``
        s). Decode each with ``decode`` when you get to it: a record fetched but never decoded
        is not dead-lettered, so stopping early sends nothing to the DLQ twice."""
        try:
            messages = self._consumer.consume(max_records, timeout)
        except KafkaException as exc:
            raise SourceError(f"consuming {self.topic} failed: {exc}") from exc
        out: list[Message] = []
        for msg in messages:
            err = msg.error()
            if err is not None:
                if err.fatal():
                    raise SourceError(f"fatal consumer error on {self.topic}: {err}")
                self.errors += 1  # transient (the client retries); nothing was consumed
                continue
            out.append(msg)
        return out

    def poll(self, max_records: int = 500, timeout: float = 0.5) -> list[Polled]:
        """``fetch`` and ``decode`` every record."""
        return [self.decode(msg) for msg in self.fetch(max_records, timeout)]

    def decode(self, msg: Message) -> Polled:
        """Decode and validate one record; a bad one goes to the DLQ (``sample`` None)."""
        value = msg.value()
        partition, offset = msg.partition() or 0, msg.offset() or 0  # set on consumed records
        nbytes = 0 if value is None else len(value)
        try:
            sample: Sample = self.codec.decode(value, expect=Sample)
        except DecodeError as exc:
            self.dead_letter(msg, str(exc), CODE_UNDECODABLE)
            return Polled(partition, offset, None, nbytes)
        try:
            validate_sample(sample)
            if self.max_tokens is not None and len(sample.input_ids) > self.max_tokens:
                raise BatchingError(
                    f"sample {sample.sample_id}: {len(sample.input_ids)} tokens exceed the "
                    f"token budget {self.max_tokens}"
                )
        except BatchingError as exc:
            self.dead_letter(msg, str(exc), CODE_INVALID)
            return Polled(partition, offset, None, nbytes)
        return Polled(partition, offset, sample, nbytes)

    # -- dead letters

    def dead_letter(self, msg: Message, reason: str, code: str = CODE_INVALID) -> None:
        """Send the record, unchanged, to the DLQ with the dead-letter headers (``code``:
        CODE_UNDECODABLE or CODE_INVALID; asynchronous: ``flush`` waits and raises if any could
        not be delivered)."""
        partition, offset = msg.partition(), msg.offset()
        headers = dlq_headers(
            reason=reason,
            code=code,
            kind="Sample",
            topic=msg.topic() or self.topic,
            partition=-1 if partition is None else partition,
            offset=-1 if offset is None else offset,
            stage=self.stage,
            processor=self.group_id,
        )

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                self._dlq_failed.append(str(err))

        self._producer.produce(
            self.dlq_topic, value=msg.value(), key=msg.key(), headers=headers, on_delivery=delivered
        )
        self._producer.poll(0)
        self.dlq_sent += 1

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for every dead letter to be acknowledged (acks=all); raise if one was not."""
        left = self._producer.flush(timeout)
        if left or self._dlq_failed:
            failed, self._dlq_failed = self._dlq_failed, []
            raise SourceError(
                f"dead-letter records not delivered to {self.dlq_topic}: "
                f"{left} pending, failures {failed[:3]}"
            )

    # -- offsets

    def commit(self, offsets: Mapping[int, int], *, asynchronous: bool = True) -> None:
        """Commit next offsets per partition for the group (``asynchronous``: fire and forget,
        for lag monitoring; synchronous commits raise SourceError on failure)."""
        if not offsets:
            return
        tps = [TopicPartition(self.topic, p, o) for p, o in sorted(offsets.items())]
        try:
            if asynchronous:
                self._consumer.commit(offsets=tps, asynchronous=True)
                return
            done = self._consumer.commit(offsets=tps, asynchronous=False)
        except KafkaException as exc:
            if asynchronous:
                return
            raise SourceError(f"offset commit for {self.topic} failed: {exc}") from exc
        failed = [f"{tp.partition}: {tp.error}" for tp in done or [] if tp.error]
        if failed:
            raise SourceError(f"offset commit for {self.topic} failed: {failed[:3]}")

    def close(self) -> None:
        """Leave the group (the on_revoke hook is not called: commit before closing)."""
        self._on_revoke_hook = None
        try:
            close_producer(self._producer, 10.0)
        finally:
            self._consumer.close()


def close_producer(producer: Producer, timeout: float) -> None:
    """Flush for up to ``timeout`` s, drop what is left (nothing committed depends on it: the
    caller commits offsets only after a successful flush), and stop the client's threads."""
    if producer.flush(timeout):
        producer.purge()
    producer.close()


class SamplesDataset(IterableDataset):
    """The samples topic as a torch IterableDataset (see the module docstring).

    Yields Sample records, or with ``collate=True`` the dicts of tensors of
    ``batching.collate`` over token-budget batches (``batch_tokens`` padded
    tokens, ``batch_samples`` samples at most). Stops after ``max_samples`` samples (per
    iterator) or ``idle_timeout`` seconds without a record; runs forever with neither."""

    def __init__(
        self,
        settings: CommonSettings,
        *,
        group_id: str = DATASET_GROUP,
        collate: bool = False,
        batch_tokens: int = 16 * 1024,
        batch_samples: int | None = None,
        max_samples: int | None = None,
        idle_timeout: float | None = None,
        commit: Literal["auto", "manual"] = "auto",
        commit_interval_s: float = 1.0,
        start: Start = "committed",
        start_offsets: Mapping[int, int] | None = None,
        poll_timeout: float = 0.2,
        consumer_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.group_id = group_id
        self.collate = collate
        self.batch_tokens = batch_tokens
        self.batch_samples = batch_samples
        self.max_samples = max_samples
        self.idle_timeout = idle_timeout
        self.commit_mode = commit
        self.commit_interval_s = commit_interval_s
        self.start = start
        self.start_offsets = dict(start_offsets or {})
        self.poll_timeout = poll_timeout
        self.consumer_options = dict(consumer_options or {})
        self._source: SampleSource | None = None
        self._taken: dict[int, int] = {}  # partition -> next offset after what was yielded
        self.dlq_sent = 0

    def position(self) -> dict[int, int]:
        """Next offset per partition after everything yielded so far (for your checkpoint)."""
        return dict(self._taken)

    def commit(self) -> None:
        """Commit (synchronously) the offsets of everything handed out so far. Works during
        iteration and after it (then through a short-lived consumer of the group)."""
        if self._source is not None:
            self._source.flush()
            self._source.commit(self._taken, asynchronous=False)
        elif self._taken:
            topic = self.settings.topics().samples
            consumer = Consumer(
                {
                    **self.settings.kafka_config(),
                    "group.id": self.settings.topics().name(self.group_id),
                    "enable.auto.commit": False,
                }
            )
            try:
                tps = [TopicPartition(topic, p, o) for p, o in sorted(self._taken.items())]
                consumer.commit(offsets=tps, asynchronous=False)
            except KafkaException as exc:
                raise SourceError(f"offset commit for {topic} failed: {exc}") from exc
            finally:
                consumer.close()

    def _take(self, partition: int, offset: int) -> None:
        self._taken[partition] = max(self._taken.get(partition, 0), offset + 1)

    def _on_revoke(self, partitions: list[int]) -> None:
        """Commit what was taken from partitions about to move, and forget them: the next
        owner (maybe us again) starts from the group's committed offset."""
        revoked = {p: self._taken.pop(p) for p in partitions if p in self._taken}
        if self.commit_mode == "auto" and self._source is not None:
            self._source.flush()
            self._source.commit(revoked, asynchronous=False)

    def __iter__(self) -> Iterator[Sample] | Iterator[dict[str, Tensor]]:
        return self._batches() if self.collate else self._samples()

    def _open(self) -> SampleSource:
        self._taken = dict(self.start_offsets)
        self._source = SampleSource(
            self.settings,
            group_id=self.settings.topics().name(self.group_id),  # namespaced, like the topics
            positions=lambda: self._taken,
            start=self.start,
            max_tokens=self.batch_tokens if self.collate else None,
            consumer_options=self.consumer_options,
            on_revoke=self._on_revoke,
            stage="dataset",
        )
        return self._source

    def _close(self, source: SampleSource) -> None:
        try:
            if self.commit_mode == "auto":
                self.commit()
        finally:
            self.dlq_sent = source.dlq_sent
            source.close()
            self._source = None

    def _records(self, source: SampleSource) -> Iterator[tuple[Polled, int]]:
        """Polled records with the source generation they were read in; ends when idle."""
        last = time.monotonic()
        last_commit = last
        while True:
            records = source.fetch(512, self.poll_timeout)
            now = time.monotonic()
            if self.commit_mode == "auto" and now - last_commit >= self.commit_interval_s:
                source.commit(self._taken)  # asynchronous: lag monitoring and crash bound
                last_commit = now
            if not records:
                if self.idle_timeout is not None and now - last > self.idle_timeout:
                    return
                continue
            last = now
            generation = source.generation  # callbacks run inside poll: one per batch
            for msg in records:
                yield source.decode(msg), generation

    def _samples(self) -> Iterator[Sample]:
        source = self._open()
        count = 0
        try:
            if self.max_samples is not None and self.max_samples <= 0:
                return
            for rec, _gen in self._records(source):
                self._take(rec.partition, rec.offset)  # handed out (or dead-lettered)
                if rec.sample is not None:
                    count += 1
                    yield rec.sample
                    if self.max_samples is not None and count >= self.max_samples:
                        return
        finally:
            self._close(source)

    def _batches(self) -> Iterator[dict[str, Tensor]]:
        source = self._open()
        batcher = TokenBudgetBatcher(self.batch_tokens, self.batch_samples)
        open_batch: list[Polled] = []  # the records of the batch being filled, DLQ'd included
        generation = source.generation
        count = 0

        def emit(records: list[Polled], samples: list[Sample]) -> Iterator[dict[str, Tensor]]:
            nonlocal count
            batch = collate_samples(samples)
            for r in records:
                self._take(r.partition, r.offset)
            count += len(samples)
            yield batch

        try:
            if self.max_samples is not None and self.max_samples <= 0:
                return
            for rec, gen in self._records(source):
                if gen != generation:  # partitions moved: the open batch is read again
                    batcher.flush()
                    open_batch, generation = [], gen
                if rec.sample is not None:
                    closed = batcher.add(rec.sample)
                    if closed is not None:
                        yield from emit(open_batch, closed)
                        open_batch = []
                open_batch.append(rec)
                if self.max_samples is not None and count + batcher.pending >= self.max_samples:
                    last = batcher.flush()
                    if last is not None:
                        yield from emit(open_batch, last)
                    return
            last = batcher.flush()  # idle: the partial batch
            if last is not None:
                yield from emit(open_batch, last)
        finally:
            self._close(source)
