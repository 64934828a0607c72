"""The ClickHouse sink (``rollstream sink``): Kafka topics -> rows -> ClickHouse, idempotently.

    SinkSettings(CommonSettings)    ROLLSTREAM_SINK_*, ROLLSTREAM_ANALYTICS_* (see docs)
    run(settings) -> SinkStats      apply migrations, serve analytics, consume until SIGTERM/SIGINT
    Sink(settings)                  the loop itself (``run()``, ``stop()``, ``stats``) for tests
    python -m rollstream.consumers.store.sink    the same as run(SinkSettings()), for supervisors

One confluent-kafka consumer (group ``<ns>.rollstream-sink-v1``, auto-commit off) reads the
events, trajectories, samples and policy.versions topics of a namespace. Messages are cut into
batches per topic partition; each batch is decoded (Codec) and mapped to columns
(columnar.ColumnBatch) by the consume loop, or by ``sink_map_workers`` worker processes
(sink_workers.MapPool: decode, map and Arrow tables off the loop's GIL); a writer thread takes
the batches in the order they were cut, dead-letters their bad records, inserts them
(``chstore.insert_arrow_tables``) under the token ``topic:partition:first:last`` (ClickHouse
works without the GIL meanwhile), and only then does the loop commit their offsets,
synchronously, in order. A rebalance first waits until everything handed to the writer is
inserted and committed. Records that cannot be decoded or mapped go to the dead-letter topic
unchanged, with the reason in headers, and the sink carries on. While it runs, the cyclic GC
collects its young generation every 50,000 allocations instead of 700
(``sink_workers.mapping_gc``: a batch keeps ~4 tracked objects per message alive).

Batch boundaries are a function of the log, not of timing, so a batch retried after a crash
covers exactly the same offsets and ClickHouse drops it by its token (the raw row count does
not change). A batch that starts at offset ``a`` ends at the first of:

    - the aligned boundary: the last offset before the next multiple of ``sink_batch_messages``
      (``(a // N + 1) * N - 1``);
    - the message that brings the batch to ``sink_batch_bytes`` of values;
    - an *intent*: where the flush timer cut a partial batch, written to Kafka *before* the
      insert, as the metadata of an offset commit of ``a`` (``rollstream-sink:end=<last>``).
      After a restart the batch that starts at the committed offset ends where the intent
      says, whatever the consumer has fetched meanwhile. The timer cuts a batch only when it
      holds everything the partition has (its last offset + 1 is the high watermark of the
      last fetch): a run that crashed after inserting a longer batch from ``a`` saw messages
      that are in the log before ours, so we cannot be caught up short of them.
      (``sink_flush_max_wait_s`` cuts anyway: for a log that ends in transaction markers.)

A rebalance drops the uncommitted batches of revoked partitions; the next owner reads them again
from the committed offsets and builds the same batches (same rules, same intents).

Tokens alone do not make a retry safe: a process killed inside an insert can leave the token in
ClickHouse's deduplication log without the rows, and the retry is then dropped. So after each
assignment the batches of a partition are *verified* against the tables until the first one of
which nothing is stored; rows still missing go in under a fresh token (sink_verify.py).

A clean stop stores the caught-up partial batches (with intents) and leaves the rest to be read
again.

Errors::

    SinkError                   root of rollstream.consumers.store.sink
    ├── DeadLetterError         a dead-letter record was not delivered (nothing was committed)
    └── InsertRetryError        a retryable insert kept failing for sink_insert_retry_s
    (chstore's StoreError tree: ConnectError, MigrationError, non-retryable InsertError, ...)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from rollstream.consumers.store import chstore
from rollstream.consumers.store import verify as sink_verify
from rollstream.consumers.store.batches import INTENT_PREFIX, BatchCutter, RawBatch, parse_intent
from rollstream.consumers.store.migrations import apply_migrations
from rollstream.consumers.store.rows import RowBatch
from rollstream.consumers.store.workers import (
    EXPECT,
    MapJob,
    MapPool,
    MapResult,
    map_columns,
    mapping_gc,
)
from rollstream.schemas import Codec, CommonSettings

__all__ = [
    "INTENT_PREFIX",
    "BatchCutter",
    "DeadLetterError",
    "InsertRetryError",
    "RawBatch",
    "Sink",
    "SinkError",
    "SinkSettings",
    "SinkStats",
    "dlq_headers",
    "main",
    "parse_intent",
    "run",
]

T = TypeVar("T")
log = logging.getLogger("rollstream.consumers.store.sink")

SinkTopic = Literal["events", "trajectories", "samples", "policy"]


class SinkError(Exception):
    """Root of the sink's errors."""


class DeadLetterError(SinkError):
    """A dead-letter record could not be delivered; the batch's offsets were not committed."""


class InsertRetryError(SinkError):
    """A retryable insert (transport failure) kept failing for ``sink_insert_retry_s``."""


class SinkSettings(CommonSettings):
    """The ClickHouse sink deployable (``rollstream sink``); its analytics server's settings too."""

    sink_group_id: str = "rollstream-sink-v1"  # consumer group (prefixed with the namespace)
    sink_instance_id: str | None = None  # Kafka static membership: restarts skip the rebalance
    sink_topics: list[SinkTopic] = ["events", "trajectories", "samples", "policy"]  # read these
    sink_batch_messages: int = 20_000  # N: batches never cross a multiple of N offsets
    sink_batch_bytes: int = 32 << 20  # ... nor this many value bytes
    sink_flush_interval_s: float = 1.0  # a caught-up partial batch this old is flushed (intent)
    sink_flush_max_wait_s: float = 60.0  # ... and any partial batch this old
    sink_poll_messages: int = 10_000  # at most this many messages per poll
    sink_poll_timeout_s: float = 0.2  # wait this long for a message when none is queued
    sink_session_timeout_ms: int = 6_000  # Kafka session.timeout.ms
    sink_max_poll_interval_ms: int = 300_000  # Kafka max.poll.interval.ms
    sink_max_partition_fetch_bytes: int = 8 << 20  # Kafka max.partition.fetch.bytes
    sink_pipeline_depth: int = 4  # mapped batches waiting for the writer thread
    sink_map_workers: int = 0  # processes that decode + map batches (0: the consume loop)
    sink_insert_retry_s: float = 120.0  # retry a failing (transport) insert, then exit
    sink_stats_interval_s: float = 30.0  # counters in the log this often (0: never)
    sink_log_level: str = "info"  # python -m ...sink; debug logs every insert and commit
    sink_debug_commit_delay_s: float = 0.0  # tests: widen the insert -> commit window
    analytics_enabled: bool = True  # serve the analytics API in the sink process
    analytics_host: str = "127.0.0.1"  # analytics server address (--host)
    analytics_port: int = 8300  # analytics server port (--port; 0: any free port)
    analytics_max_execution_time_s: float = 30.0  # per query (max_execution_time)
    analytics_max_result_rows: int = 1_000_000  # per query; more is an error
    analytics_max_memory_bytes: int = 0  # 0: the engine's default

    @property
    def group_id(self) -> str:
        return self.topics().name(self.sink_group_id)

    @property
    def database(self) -> str:
        return chstore.database_for(self.namespace)

    def topic_names(self) -> dict[str, str]:
        """Kafka topic -> contract name (events, trajectories, samples, policy)."""
        topics = self.topics()
        return {getattr(topics, name): name for name in self.sink_topics}


# --- the sink ----------------------------------------------------------------------------


@dataclass
class SinkStats:
    messages: int = 0
    batches: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    dead_letters: int = 0
    intents: int = 0
    commits: int = 0
    commit_failures: int = 0
    insert_retries: int = 0
    split_batches: int = 0
    verified_batches: int = 0  # re-read after an assignment, checked against the tables
    verified_rows_present: int = 0  # ... rows of them that were stored already (not re-sent)
    dropped_on_revoke: int = 0
    first_message_at: float = 0.0  # time.monotonic() of the first message (benchmarks)
    last_insert_at: float = 0.0  # ... and of the last insert

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "rows": dict(self.rows)}


def dlq_headers(
    msg: Message, *, reason: str, code: str, kind: str, processor: str
) -> list[tuple[str, str | bytes | None]]:
    """Headers of a dead-lettered record (the names streams/dlq.py and dataset.py use, plus
    ``kind``: the record type that could not be mapped)."""
    values = {
        "reason": reason,
        "code": code,
        "kind": kind,
        "original_topic": msg.topic() or "",
        "original_partition": str(msg.partition()),
        "original_offset": str(msg.offset()),
        "stage": "sink",
        "processor": processor,
    }
    return [(k, v.encode()) for k, v in values.items()]


def _offset(msg: Message) -> int:
    """A consumed message's offset (the client's type says it may be None; it is not)."""
    offset = msg.offset()
    if offset is None:
        raise SinkError(f"message of {msg.topic()}[{msg.partition()}] without an offset")
    return offset


@dataclass
class _Mapped:
    """A batch handed to the writer: mapped in the loop (``result``) or being mapped by a worker
    (``future``). Its bad records are dead-lettered by the writer, before the insert."""

    batch: RawBatch
    result: MapResult | None = None
    future: Future[MapResult] | None = None

    def wait(self) -> MapResult:
        if self.result is None:
            assert self.future is not None
            self.result, self.future = self.future.result(), None
        return self.result


class _Writer:
    """The thread that inserts, in order, the batches the consume loop has mapped, so ClickHouse
    (which releases the GIL) works while the loop decodes the next ones. The loop commits what
    ``done()`` returns: offsets are committed by the thread that polls (a synchronous commit
    from another thread waits on the poller and can hang). ``drain()`` waits until everything
    handed over is inserted; a failure is raised in the loop by ``check``/``submit``/``drain``."""

    def __init__(self, store: Callable[[_Mapped], None], depth: int) -> None:
        self._store = store
        self._jobs: queue.Queue[_Mapped | None] = queue.Queue(maxsize=max(1, depth))
        self._done: queue.SimpleQueue[_Mapped] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sink-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self.error is None:
                    self._store(job)
                    self._done.put(job)
            except BaseException as exc:  # handed to the loop, which raises it
                self.error = exc
            finally:
                self._jobs.task_done()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, job: _Mapped, timeout: float) -> bool:
        """Hand a batch over; False if the queue stayed full for ``timeout`` seconds."""
        self.check()
        try:
            self._jobs.put(job, timeout=timeout)
        except queue.Full:
            return False
        return True

    def done(self) -> list[_Mapped]:
        """The batches inserted since the last call, in order."""
        out: list[_Mapped] = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self._done.get_nowait())
        return out

    def drain(self) -> None:
        self._jobs.join()
        self.check()

    def close(self, timeout: float = 60.0) -> None:
        with contextlib.suppress(queue.Full):
            self._jobs.put(None, timeout=timeout)
        self._thread.join(timeout)


class Sink:
    """The consume -> map -> insert -> commit loop. ``run()`` blocks until ``stop()``."""

    def __init__(self, settings: SinkSettings, *, client: Any | None = None) -> None:
        self.settings = s = settings
        self.database = s.database
        self.stats = SinkStats()
        self.codec = Codec()  # the loop's (in-process mapping)
        self._writer_codec = Codec()  # the writer's (records of a rejected batch, one by one)
        self._topics = s.topic_names()
        self._stop = threading.Event()
        self._cutters: dict[tuple[str, int], BatchCutter] = {}
        # partitions whose re-read batches are checked against the tables (sink_verify.py)
        self._verifying: set[tuple[str, int]] = set()
        self._client = client if client is not None else chstore.connect(s.clickhouse_url)
        self._owns_client = client is None
        apply_migrations(self._client, self.database)
        conf: dict[str, Any] = {
            **s.kafka_config(),
            "group.id": s.group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": s.sink_session_timeout_ms,
            "max.poll.interval.ms": s.sink_max_poll_interval_ms,
            "max.partition.fetch.bytes": s.sink_max_partition_fetch_bytes,
        }
        if s.sink_instance_id:
            conf["group.instance.id"] = s.sink_instance_id
        self.consumer = Consumer(conf)
        self.producer = Producer(
            {
                **s.kafka_config(),
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "message.max.bytes": 20_000_000,
            }
        )
        self._dlq_errors: list[str] = []
        self._last_stats = time.monotonic()
        self._writer: _Writer | None = None
        self._pool: MapPool | None = None
        if s.sink_map_workers > 0:
            self._pool = MapPool(s.sink_map_workers)
            try:
                self._pool.warm_up()
            except BaseException:
                self._pool.close()
                raise
        self.ready = threading.Event()

    # --- rebalance --------------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        committed = consumer.committed(partitions, timeout=30) if partitions else []
        for tp in committed:
            end = parse_intent(tp.metadata)
            intent = (tp.offset, end) if end is not None and tp.offset >= 0 else None
            self._cutters[(tp.topic, tp.partition)] = BatchCutter(
                tp.topic,
                tp.partition,
                align=self.settings.sink_batch_messages,
                max_bytes=self.settings.sink_batch_bytes,
                intent=intent,
            )
            self._verifying.add((tp.topic, tp.partition))
        log.info("assigned %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if self._writer is not None:
            self._writer.drain()  # commit what was handed over while the partitions are ours
            self._commit_done()
        for tp in partitions:
            cutter = self._cutters.pop((tp.topic, tp.partition), None)
            self._verifying.discard((tp.topic, tp.partition))
            if cutter is not None:
                self.stats.dropped_on_revoke += len(cutter)
        log.info("revoked %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in partitions))

    # --- loop -------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> SinkStats:
        with mapping_gc():  # fewer young collections while batches are mapped
            return self._run()

    def _run(self) -> SinkStats:
        s = self.settings
        self.consumer.subscribe(
            list(self._topics), on_assign=self._on_assign, on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )  # fmt: skip
        log.info("sink ready: %s -> %s (group %s)", sorted(self._topics), self.database, s.group_id)
        self._writer = writer = _Writer(self._store, s.sink_pipeline_depth + s.sink_map_workers)
        self.ready.set()
        try:
            while not self._stop.is_set():
                writer.check()
                self._commit_done()
                msgs = self._poll()
                now = time.monotonic()
                ready: list[RawBatch] = []
                cutters = self._cutters
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        self._on_error(err)
                        continue
                    cutter = cutters.get((msg.topic(), msg.partition()))  # type: ignore[arg-type]
                    if cutter is None:  # not assigned any more (a revoke raced the fetch)
                        continue
                    value = msg.value()
                    cut = cutter.add(_offset(msg), len(value) if value else 0, msg, now)
                    if cut:
                        ready += cut
                if msgs and not self.stats.messages:
                    self.stats.first_message_at = now
                self.stats.messages += len(msgs)
                for cutter in self._cutters.values():
                    if not cutter.items or now - cutter.started < s.sink_flush_interval_s:
                        continue
                    end = self._log_end(cutter)
                    batch = cutter.due(now, s.sink_flush_interval_s, end, s.sink_flush_max_wait_s)
                    if batch is not None:
                        ready.append(batch)
                if ready:
                    self._flush(ready)
                self._log_stats()
            # a clean stop stores the caught-up partial batches; the rest are read again
            now = time.monotonic()
            final = [
                b
                for c in self._cutters.values()
                if (b := c.due(now, 0.0, self._log_end(c))) is not None
            ]
            if final:
                self._flush(final)
            writer.drain()
            self._commit_done()
        finally:
            writer.close()
            self._writer = None
            self.close()
        return self.stats

    def _poll(self) -> list[Message]:
        """What the client has queued, at once; else wait for one message and take what came
        with it. (``consume(n, timeout)`` waits the whole timeout for n messages: with large
        messages the client's queue never holds n, and every call would wait.)"""
        n, timeout = self.settings.sink_poll_messages, self.settings.sink_poll_timeout_s
        msgs = self.consumer.consume(n, 0)
        if msgs:
            return msgs
        first = self.consumer.poll(timeout)
        if first is None:
            return []
        return [first, *self.consumer.consume(n - 1, 0)]

    def _log_end(self, cutter: BatchCutter) -> int | None:
        """The partition's high watermark from the last fetch response (no request)."""
        tp = TopicPartition(cutter.topic, cutter.partition)
        try:
            _, high = self.consumer.get_watermark_offsets(tp, cached=True)
        except KafkaException:
            return None
        return high if high >= 0 else None

    def _on_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError._PARTITION_EOF:
            return
        if err.fatal():
            raise SinkError(f"fatal consumer error: {err}")
        log.warning("consumer error: %s", err)

    def _log_stats(self) -> None:
        interval = self.settings.sink_stats_interval_s
        if interval and time.monotonic() - self._last_stats >= interval:
            self._last_stats = time.monotonic()
            log.info("stats %s", self.stats.as_dict())

    # --- flush: map, dead-letter, insert, commit ----------------------------------------------

    def _flush(self, batches: list[RawBatch]) -> None:
        """Decode and map the batches and hand them to the writer. Partial batches wait until
        everything before them is inserted and committed, then their intents are committed,
        and only then are they handed over. Mapped here, a batch is mapped just before it is
        handed over, so the writer inserts the one before meanwhile (ClickHouse releases the
        GIL); map workers get every batch at once."""
        assert self._writer is not None
        early = [self._map(b) if self._pool is not None else None for b in batches]
        partial: list[tuple[RawBatch, _Mapped | None]] = []
        for batch, mapped in zip(batches, early, strict=True):
            if batch.partial:
                partial.append((batch, mapped))
            else:
                self._submit(mapped or self._map(batch))
        if not partial:
            return
        self._writer.drain()
        offsets = self._done_offsets()
        for b, _ in partial:
            offsets[(b.topic, b.partition)] = (b.first, f"{INTENT_PREFIX}{b.last}")
        self._finish_dead_letters()
        if not self._commit(offsets):
            return  # a rebalance is coming: partial batches are not stored without an intent
        self.stats.intents += len(partial)
        for batch, mapped in partial:
            self._submit(mapped or self._map(batch))

    def _submit(self, mapped: _Mapped) -> None:
        """Hand a batch to the writer, committing what it has inserted while waiting."""
        assert self._writer is not None
        while True:
            self._commit_done()
            if self._writer.submit(mapped, timeout=0.05):
                return

    def _done_offsets(self) -> dict[tuple[str, int], tuple[int, str]]:
        """Offsets to commit for the batches the writer has inserted (later ones win)."""
        assert self._writer is not None
        return {
            (m.batch.topic, m.batch.partition): (m.batch.last + 1, "") for m in self._writer.done()
        }

    def _commit_done(self) -> None:
        offsets = self._done_offsets()
        if offsets:
            self._finish_dead_letters()
            if self.settings.sink_debug_commit_delay_s:
                time.sleep(self.settings.sink_debug_commit_delay_s)
            self._commit(offsets)

    def _commit(self, offsets: dict[tuple[str, int], tuple[int, str]]) -> bool:
        tps = [TopicPartition(t, p, o, metadata=m) for (t, p), (o, m) in offsets.items()]
        try:
            self.consumer.commit(offsets=tps, asynchronous=False)
        except KafkaException as exc:
            # rebalancing or fenced: the next owner re-reads these batches with the same
            # boundaries, so their inserts are dropped by their tokens
            self.stats.commit_failures += 1
            log.warning("offset commit failed (%s); uncommitted batches will be re-read", exc)
            return False
        self.stats.commits += 1
        log.debug("committed %s", ", ".join(f"{t}:{p}:{o}:{m}" for t, p, o, m in _tps(tps)))
        return True

    def _map(self, batch: RawBatch) -> _Mapped:
        """Decode and map the batch here, or hand it to a worker (``sink_map_workers``)."""
        kind = self._topics[batch.topic]
        items: list[Message] = batch.items
        job = MapJob(
            batch.topic, batch.partition, kind, batch.token,
            [_offset(m) for m in items], [m.value() for m in items],
            None if kind == "events" else [max(m.timestamp()[1], 0) * 1000 for m in items],
        )  # fmt: skip
        if self._pool is not None:
            return _Mapped(batch, future=self._pool.submit(job))
        return _Mapped(batch, result=map_columns(job, self.codec))

    def _store(self, mapped: _Mapped) -> None:
        """(Writer thread.) Dead-letter the batch's bad records, then insert its rows."""
        batch, result = mapped.batch, mapped.wait()
        if result.token != batch.token:  # cannot happen: map_columns counts every offset
            raise SinkError(f"batch token {result.token} != {batch.token}")
        for index, code, reason, kind in result.bad:
            self._dead_letter(batch.items[index], reason, code, kind)
        key = (batch.topic, batch.partition)
        verify = key in self._verifying
        try:
            if result.arrow_error is not None:
                raise chstore.InsertError(
                    result.arrow_error, table="", token=batch.token, retryable=False
                )
            if result.arrow is not None:
                tables = result.arrow
            elif result.columns is not None:
                tables = result.columns.arrow()
            elif result.rows:
                tables = chstore.arrow_tables(result.rows, batch.token)
            else:
                tables = {}
            if not verify:
                self._insert_arrow(tables, batch.token)
            elif tables and not self._insert_verified(batch, batch.first, batch.last, tables):
                self._verifying.discard(key)  # nothing of it was stored: never attempted after
        except chstore.InsertError as exc:
            if exc.retryable:
                raise
            log.warning(
                "batch %s rejected (%s): inserting its records one by one", batch.token, exc
            )
            self.stats.split_batches += 1
            self._store_one_by_one(batch, {index for index, *_ in result.bad}, verify)
        self.stats.batches += 1
        self.stats.last_insert_at = time.monotonic()
        for table, n in result.counts.items():
            self.stats.rows[table] = self.stats.rows.get(table, 0) + n
        log.debug(
            "inserted %s (%d messages, %d rows)", batch.token, len(batch.items), result.num_rows
        )

    def _store_one_by_one(self, batch: RawBatch, bad: set[int], verify: bool = False) -> None:
        """A rejected batch: each record that mapped is inserted alone (token
        ``topic:partition:o:o``; checked against the tables first when ``verify``); the ones the
        server rejects go to the DLQ (``rejected``)."""
        expect = EXPECT[self._topics[batch.topic]]
        for index, msg in enumerate(batch.items):
            if index in bad:
                continue
            record = self._writer_codec.decode(msg.value(), expect=expect)
            one = RowBatch(batch.topic, batch.partition)
            one.add(record, _offset(msg), timestamp_us=max(msg.timestamp()[1], 0) * 1000)
            try:
                if not verify:
                    self._insert(one)
                elif one.tables:
                    offset = _offset(msg)
                    tables = chstore.arrow_tables(one.tables, one.token)
                    self._insert_verified(batch, offset, offset, tables, one.token)
            except chstore.InsertError as err:
                if err.retryable:
                    raise
                self._dead_letter(msg, str(err), "rejected", type(record).__name__)

    def _insert(self, rows: RowBatch) -> None:
        if rows.tables:
            self._insert_arrow(chstore.arrow_tables(rows.tables, rows.token), rows.token)

    def _insert_verified(
        self, batch: RawBatch, first: int, last: int, tables: dict[str, Any], token: str = ""
    ) -> bool:
        """Store the rows of offsets ``first..last`` of the batch's partition (``token``: their
        dedup token, the batch's by default) without trusting the token: the rows go in under
        their own token (ClickHouse drops what it holds under it, and the materialized views
        see every row, as on any retry), then what is still missing — the rows of a poisoned
        token — under a fresh one. Never a fresh token first: rows stored under a token no
        later attempt knows would be stored again by that attempt's re-send (the own token, by
        contrast, is for each table either stored with its rows or poisoned, and a re-send
        under it adds nothing either way). Returns whether any row was stored already."""
        token = token or batch.token
        self.stats.verified_batches += 1
        stored = sum(self._present(batch, first, last, tables, sink_verify.present_count).values())
        self.stats.verified_rows_present += stored
        self._insert_arrow(tables, token)
        # a record gives at most one row per table: a table holding as many of the batch's
        # offsets as it has rows is complete; the offsets are fetched only for the others
        counts = self._present(batch, first, last, tables, sink_verify.present_count)
        short = {name: t for name, t in tables.items() if counts[name] < t.num_rows}
        offsets = self._present(batch, first, last, short, sink_verify.present_offsets)
        tables = sink_verify.missing_rows(short, offsets)
        if tables:
            self._insert_arrow(tables, sink_verify.fresh_token(token))
        log.debug("verified %s[%d..%d]: %d rows stored already", token, first, last, stored)
        return stored > 0

    def _present(
        self, batch: RawBatch, first: int, last: int, tables: dict[str, Any], ask: Callable[..., T]
    ) -> dict[str, T]:
        """``ask`` (sink_verify.present_count or present_offsets) for each table."""
        return {
            name: self._retrying(
                f"verify of {batch.token}",
                functools.partial(
                    ask, self._client, self.database, name, batch.topic, batch.partition, first,
                    last,
                ),
            )
            for name in tables
        }  # fmt: skip

    def _retrying(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, retried with backoff for ``sink_insert_retry_s`` on a transport failure (a
        QueryError, or a retryable InsertError); a rejected insert is raised at once."""
        deadline = time.monotonic() + self.settings.sink_insert_retry_s
        delay = 0.2
        while True:
            try:
                return fn()
            except (chstore.QueryError, chstore.InsertError) as exc:
                if isinstance(exc, chstore.InsertError) and not exc.retryable:
                    raise
                if time.monotonic() + delay > deadline:
                    raise InsertRetryError(f"{what} kept failing: {exc}") from exc
                self.stats.insert_retries += 1
                log.warning("%s failed (%s); retrying in %.1fs", what, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _insert_arrow(self, tables: dict[str, Any], token: str) -> None:
        """Insert with the batch's token; a retryable failure is retried with backoff."""
        if tables:
            self._retrying(
                f"insert of {token}",
                lambda: chstore.insert_arrow_tables(
                    self._client, tables, token, database=self.database
                ),
            )

    def _dead_letter(self, msg: Message, reason: str, code: str, kind: str) -> None:
        headers = dlq_headers(
            msg, reason=reason, code=code, kind=kind, processor=self.settings.group_id
        )

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                self._dlq_errors.append(str(err))

        while True:
            try:
                self.producer.produce(
                    self.settings.topics().dlq, value=msg.value(), key=msg.key(),
                    headers=headers, on_delivery=delivered,
                )  # fmt: skip
                break
            except BufferError:
                self.producer.poll(0.1)
        self.stats.dead_letters += 1
        log.warning(
            "dead-lettered %s[%d]@%d (%s): %s", msg.topic(), msg.partition(), msg.offset(),
            code, reason,
        )  # fmt: skip

    def _finish_dead_letters(self) -> None:
        if self.stats.dead_letters == 0:
            return
        left = self.producer.flush(30)
        if left or self._dlq_errors:
            errors, self._dlq_errors = self._dlq_errors, []
            raise DeadLetterError(
                f"dead-letter records not delivered ({left} pending): {errors[:3]}"
            )

    def close(self) -> None:
        try:
            self.consumer.close()
        except (KafkaException, RuntimeError) as exc:
            log.warning("closing the consumer: %s", exc)
        self.producer.flush(10)
        if self._pool is not None:
            self._pool.close()
        if self._owns_client:
            self._client.close()


def _tps(tps: Iterable[TopicPartition]) -> Sequence[tuple[str, int, int, str]]:
    return [(tp.topic, tp.partition, tp.offset, tp.metadata or "") for tp in tps]


def run(settings: SinkSettings) -> SinkStats:
    """Create missing topics, open the store (migrations), serve analytics in a thread (when
    enabled) and consume until SIGTERM / SIGINT."""
    from rollstream.adapters.topics import ensure_topics
    from rollstream.consumers.analytics.server import serve

    ensure_topics(settings)
    sink = Sink(settings)
    server = None
    if settings.analytics_enabled:
        server = serve(settings, stats=sink.stats.as_dict)
        log.info("analytics at %s", server.url)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: sink.stop())
    try:
        return sink.run()
    finally:
        if server is not None:
            server.stop()


def main() -> int:
    settings = SinkSettings()
    logging.basicConfig(
        level=settings.sink_log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    stats = run(settings)
    log.info("sink stopped: %s", stats.as_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
