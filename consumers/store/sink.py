"""The ClickHouse sink loop: Kafka topics -> rows -> ClickHouse, idempotently.

    run(settings, beside=None) -> SinkStats     create topics, open the store (migrations),
                                    consume until SIGTERM/SIGINT; ``beside(sink)``: a context
                                    that runs next to the loop (``rollstream sink`` serves the
                                    analytics API there: analytics/service.py)
    Sink(settings)                  the loop itself (``run()``, ``stop()``, ``stats``) for tests
    settings.SinkSettings           ROLLSTREAM_SINK_*
    writer.py                       the writer thread: dead letters (dead_letters.py), inserts,
                                    retries, verification (verify.py)

One confluent-kafka consumer (group ``<ns>.rollstream-sink-v1``, auto-commit off) reads the
events, trajectories, samples and policy.versions topics of a namespace. Messages are cut into
batches per topic partition; each batch is decoded (Codec) and mapped to columns
(columnar.ColumnBatch) by the consume loop, or by ``sink_map_workers`` worker processes
(workers.MapPool: decode, map and Arrow tables off the loop's GIL); a writer thread takes
the batches in the order they were cut, dead-letters their bad records, inserts them
(``chstore.insert_arrow_tables``) under the token ``topic:partition:first:last`` (ClickHouse
works without the GIL meanwhile), and only then does the loop commit their offsets,
synchronously, in order. A rebalance first waits until everything handed to the writer is
inserted and committed. Records that cannot be decoded or mapped go to the dead-letter topic
unchanged, with the reason in headers, and the sink carries on. While it runs, the cyclic GC
collects its young generation every 50,000 allocations instead of 700
(``workers.mapping_gc``: a batch keeps ~4 tracked objects per message alive).

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
which nothing is stored; rows still missing go in under a fresh token (verify.py).

A clean stop stores the caught-up partial batches (with intents) and leaves the rest to be read
again. It is bounded while the broker is unreachable: a commit fails within seconds, waits for
dead letters are cut to ``STOP_DLQ_TIMEOUT_S``, and what was not committed is logged (its
batches are read again at restart and dropped by their tokens); the loop exits cleanly.

Metrics (``rollstream_sink_*``, docs/metrics.md): ``Sink.stats`` read at scrape time (rows by
table, batches, retries, dead letters, commits) and the consumer lag per topic from the last
fetch; ``run`` serves them on ``metrics_port`` when set. Live while the loop goes round; ready
once the loop consumes (``Sink.ready``).

Errors (rollstream.consumers.errors)::

    SinkError                   root of the sink loop's errors
    ├── DeadLetterError         a dead-letter record was not delivered (nothing was committed)
    └── InsertRetryError        a retryable insert kept failing for sink_insert_retry_s
    (and the store's StoreError tree: ConnectError, MigrationError, non-retryable InsertError)
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from rollstream.adapters.codecs import build_codec
from rollstream.adapters.metrics import ServiceMetrics, serve_metrics
from rollstream.consumers.errors import DeadLetterError, InsertRetryError, SinkError
from rollstream.consumers.store import chstore
from rollstream.consumers.store.batches import INTENT_PREFIX, BatchCutter, RawBatch, parse_intent
from rollstream.consumers.store.dead_letters import DeadLetters
from rollstream.consumers.store.migrations import apply_migrations
from rollstream.consumers.store.settings import SinkSettings
from rollstream.consumers.store.stats import SinkStats
from rollstream.consumers.store.workers import MapJob, MapPool, map_columns, mapping_gc
from rollstream.consumers.store.writer import BatchStore, Mapped, WriterThread, message_offset

__all__ = [
    "DeadLetterError",
    "InsertRetryError",
    "Sink",
    "SinkError",
    "SinkSettings",
    "SinkStats",
    "run",
]

log = logging.getLogger(__name__)

STOP_DLQ_TIMEOUT_S: Final = 5.0  # once stopping: the longest wait for dead letters' acks


class Sink:
    """The consume -> map -> insert -> commit loop. ``run()`` blocks until ``stop()``."""

    def __init__(self, settings: SinkSettings, *, client: Any | None = None) -> None:
        self.settings = s = settings
        self.database = s.database
        self.stats = SinkStats()
        self.codec = build_codec(s)  # the loop's (in-process mapping)
        self._topics = s.topic_names()
        self._stop = threading.Event()
        self._dlq_timeout = 30.0  # wait for dead letters' acks before a commit (cut at stop)
        self._stop_commit_failed = False  # a commit failed while stopping: no more are tried
        self._cutters: dict[tuple[str, int], BatchCutter] = {}
        # partitions whose re-read batches are checked against the tables (verify.py)
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
        self._dead_letters = DeadLetters(s)
        self._batch_store = BatchStore(
            s,
            self._client,
            codec=build_codec(s),  # the writer thread's own (records of a rejected batch)
            dead_letters=self._dead_letters,
            stats=self.stats,
            verifying=self._verifying,
        )
        self._last_stats = time.monotonic()
        self._writer: WriterThread | None = None
        self._pool: MapPool | None = None
        if s.sink_map_workers > 0:
            self._pool = MapPool(s.sink_map_workers, s)
            try:
                self._pool.warm_up()
            except BaseException:
                self._pool.close()
                raise
        self.ready = threading.Event()
        self.metrics = self._metrics()

    def _metrics(self) -> ServiceMetrics:
        m, stats = ServiceMetrics("sink"), self.stats
        m.counter_fn("messages", "messages consumed", lambda: stats.messages)
        m.counter_fn("batches", "batches inserted", lambda: stats.batches)
        m.counter_fn(
            "rows", "rows inserted, by table", lambda: {(t,): n for t, n in stats.rows.items()},
            ("table",),
        )  # fmt: skip
        m.counter_fn("dead_letters", "records sent to the dead letters", lambda: stats.dead_letters)
        m.counter_fn("insert_retries", "inserts tried again", lambda: stats.insert_retries)
        m.counter_fn("split_batches", "batches split after a refusal", lambda: stats.split_batches)
        m.counter_fn("commits", "offset commits", lambda: stats.commits)
        m.counter_fn("commit_failures", "offset commits refused", lambda: stats.commit_failures)
        m.counter_fn("intents", "partial batches cut with an intent", lambda: stats.intents)
        m.counter_fn(
            "verified_batches", "re-read batches checked against the tables",
            lambda: stats.verified_batches,
        )  # fmt: skip
        m.counter_fn(
            "dropped_on_revoke", "uncommitted messages dropped at a revoke (read again)",
            lambda: stats.dropped_on_revoke,
        )  # fmt: skip
        m.gauge_fn("consumer_lag", "messages behind the log end, by topic", self._lag, ("topic",))
        m.health.watch(
            "consuming", lambda: (self.ready.is_set(), "" if self.ready.is_set() else "starting")
        )
        return m

    def _lag(self) -> dict[tuple[str, ...], int]:
        """Messages between the consumer's position and the high watermark of the last fetch,
        summed per topic (partitions not fetched yet are left out)."""
        lag: dict[tuple[str, ...], int] = {}
        tps = [TopicPartition(t, p) for t, p in list(self._cutters)]
        for tp in self.consumer.position(tps) if tps else []:
            _, high = self.consumer.get_watermark_offsets(tp, cached=True)
            if tp.offset >= 0 and high >= 0:
                lag[(tp.topic,)] = lag.get((tp.topic,), 0) + max(0, high - tp.offset)
        return lag

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
        self._dlq_timeout = STOP_DLQ_TIMEOUT_S
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
        self._writer = writer = WriterThread(
            self._batch_store.store, s.sink_pipeline_depth + s.sink_map_workers
        )
        self.ready.set()
        try:
            while not self._stop.is_set():
                self.metrics.health.beat()
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
                    cut = cutter.add(message_offset(msg), len(value) if value else 0, msg, now)
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
            self._final_flush()
        finally:
            writer.close()
            self._writer = None
            self.close()
        return self.stats

    def _final_flush(self) -> None:
        """A clean stop stores the caught-up partial batches; the rest are read again. Dead
        letters not acknowledged in time (the broker away) leave their offsets uncommitted."""
        assert self._writer is not None
        now = time.monotonic()
        final = [
            b
            for c in self._cutters.values()
            if (b := c.due(now, 0.0, self._log_end(c))) is not None
        ]
        try:
            if final:
                self._flush(final)
            self._writer.drain()
            self._commit_done()
        except DeadLetterError as exc:
            log.warning("stopping: %s; their offsets not committed (read again at restart)", exc)

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
        partial: list[tuple[RawBatch, Mapped | None]] = []
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
        self._dead_letters.finish(
            self._dlq_timeout, stopping=self._stop.is_set, stop_wait=STOP_DLQ_TIMEOUT_S
        )
        if not self._commit(offsets):
            return  # a rebalance is coming: partial batches are not stored without an intent
        self.stats.intents += len(partial)
        for batch, mapped in partial:
            self._submit(mapped or self._map(batch))

    def _submit(self, mapped: Mapped) -> None:
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
            try:
                self._dead_letters.finish(
                    self._dlq_timeout, stopping=self._stop.is_set, stop_wait=STOP_DLQ_TIMEOUT_S
                )
            except DeadLetterError:
                log.warning("not committed: %s", _listed(offsets))
                raise
            if self.settings.sink_debug_commit_delay_s:
                time.sleep(self.settings.sink_debug_commit_delay_s)
            self._commit(offsets)

    def _commit(self, offsets: dict[tuple[str, int], tuple[int, str]]) -> bool:
        tps = [TopicPartition(t, p, o, metadata=m) for (t, p), (o, m) in offsets.items()]
        if self._stop_commit_failed:  # each try waits for the coordinator: once is enough
            log.warning("stopping, the broker unreachable: not committed: %s", _listed(offsets))
            return False
        try:
            self.consumer.commit(offsets=tps, asynchronous=False)
        except KafkaException as exc:
            # rebalancing or fenced: the next owner re-reads these batches with the same
            # boundaries, so their inserts are dropped by their tokens
            self.stats.commit_failures += 1
            self._stop_commit_failed = self._stop.is_set()
            log.warning(
                "offset commit failed (%s): not committed: %s; those batches will be re-read",
                exc,
                _listed(offsets),
            )
            return False
        self.stats.commits += 1
        log.debug("committed %s", ", ".join(f"{t}:{p}:{o}:{m}" for t, p, o, m in _tps(tps)))
        return True

    def _map(self, batch: RawBatch) -> Mapped:
        """Decode and map the batch here, or hand it to a worker (``sink_map_workers``)."""
        kind = self._topics[batch.topic]
        items: list[Message] = batch.items
        job = MapJob(
            batch.topic, batch.partition, kind, batch.token,
            [message_offset(m) for m in items], [m.value() for m in items],
            None if kind == "events" else [max(m.timestamp()[1], 0) * 1000 for m in items],
        )  # fmt: skip
        if self._pool is not None:
            return Mapped(batch, future=self._pool.submit(job))
        return Mapped(batch, result=map_columns(job, self.codec))

    def close(self) -> None:
        try:
            self.consumer.close()
        except (KafkaException, RuntimeError) as exc:
            log.warning("closing the consumer: %s", exc)
        self._dead_letters.close(min(self._dlq_timeout, 10.0))
        if self._pool is not None:
            self._pool.close()
        if self._owns_client:
            self._client.close()


def _listed(offsets: dict[tuple[str, int], tuple[int, str]]) -> str:
    return ", ".join(f"{t}[{p}]@{o}" for (t, p), (o, _) in sorted(offsets.items()))


def _tps(tps: Iterable[TopicPartition]) -> Sequence[tuple[str, int, int, str]]:
    return [(tp.topic, tp.partition, tp.offset, tp.metadata or "") for tp in tps]


def run(
    settings: SinkSettings,
    *,
    beside: Callable[[Sink], AbstractContextManager[object]] | None = None,
) -> SinkStats:
    """Create missing topics, open the store (migrations) and consume until SIGTERM / SIGINT
    (signal handlers are installed when called from the main thread). A ``sink_log_level``
    other than info sets the level of the store's loggers. ``beside(sink)`` is entered once
    the store is open and exited after the loop has stopped: what runs next to the loop in this
    process (the analytics server of ``rollstream sink``; the store does not know what it is)."""
    from rollstream.adapters.topics import ensure_topics

    level = logging.getLevelNamesMapping().get(settings.sink_log_level.upper())
    if level is None:
        raise SinkError(f"sink_log_level {settings.sink_log_level!r} is not a log level")
    if level != logging.INFO:  # info: as the process's logging says (rollstream -v sink: debug)
        logging.getLogger("rollstream.consumers.store").setLevel(level)
    ensure_topics(settings)
    sink = Sink(settings)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: sink.stop())
    with contextlib.ExitStack() as stack:
        try:
            metrics_server = serve_metrics(settings, sink.metrics)
            if metrics_server is not None:
                stack.callback(metrics_server.stop)
            if beside is not None:
                stack.enter_context(beside(sink))
        except BaseException:
            sink.close()  # the loop never ran: it closes the clients when it does
            raise
        stats = sink.run()
    log.info("sink stopped: %s", stats.as_dict())
    return stats
