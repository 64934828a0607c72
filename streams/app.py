"""The stream processor: a faust-streaming app built from ``ProcessorSettings``.

    create_processor(settings) -> Processor    the app, its topics, tables, agents and timer
    run(settings) -> int                       a worker until SIGTERM / SIGINT (rollstream process),
                                               stopped within STOP_GRACE_S of the signal

Agents (names, topics and tables all carry the namespaced, versioned app id):

    builder     <ns>.rollout.events -> <ns>.trajectories  table <app_id>-rollouts-changelog
                (key rollout_id, partitioned by group_id: each group's trajectories together)
    aggregator  <ns>.trajectories   -> <ns>.samples       table <app_id>-groups-changelog
    timer       every proc_timer_interval_s: inactivity timeouts, group timeouts, evictions
    (every stage: refused records -> <ns>.rollout.events.dlq, reason in headers)

The logic is in books.py (no faust); this module only carries out its Steps (sends, table
writes, writes deferred until the sends are acknowledged) and rebuilds the books when faust
has recovered the tables after a rebalance.
Delivery is at-least-once (faust flushes the producer before it commits offsets); correctness
comes from deterministic output ids and the write ordering described in books.py, never from
Kafka transactions. Any unexpected exception stops the worker (a restart recovers the state).

Metrics (``rollstream_processor_*``, docs/metrics.md) on ``metrics_port`` when set: the books'
counters and open slots read at scrape time, dead letters by stage and code, the offset guard's
seeks, faust's commit latency and rebalances. Live while the timer ticks; ready once both tables
are recovered and no rebalance is in progress.

    ProcessorError                   the faust shell's errors (errors.py, under StreamsError)
    └── TopicMissingError            a source topic does not exist on the broker
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from contextlib import suppress
from typing import Any, Final, cast

import faust
from aiokafka import TopicPartition
from aiokafka.helpers import create_ssl_context
from aiokafka.partitioner import murmur2
from confluent_kafka.admin import AdminClient
from faust.sensors.monitor import Monitor
from faust.types import TP
from mode import CrashingSupervisor

from rollstream.adapters.codecs import build_codec
from rollstream.adapters.metrics import ServiceMetrics, serve_metrics
from rollstream.schemas import TopicSpec
from rollstream.schemas.dlq import HEADER_NAMES

from .aggregation import GroupBook
from .books import PartitionClock, RolloutBook, Route, Sink, Step, Write
from .errors import ProcessorError, TopicMissingError
from .offsets import Admit, OffsetGuard
from .settings import ProcessorSettings

__all__ = [
    "Processor",
    "ProcessorError",
    "TopicMissingError",
    "create_processor",
    "group_route",
    "run",
]

log = logging.getLogger(__name__)

_NEVER = 1 << 62  # a record count faust's inline commit never reaches
STOP_GRACE_S: Final = 8.0  # SIGTERM / SIGINT -> exit, at most (faust's own stop is unbounded)


async def _no_gap(tp: Any, offset_from: int, offset_to: int) -> None:
    return None


def _wall_us() -> int:
    return time.time_ns() // 1000


def partition_counts(settings: ProcessorSettings, timeout: float = 30.0) -> dict[str, int]:
    """Partitions of the topics the processor reads, from the broker."""
    topics = settings.topics()
    wanted = [topics.events, topics.trajectories]
    metadata = AdminClient(settings.kafka_config()).list_topics(timeout=timeout)
    counts = {
        name: len(metadata.topics[name].partitions) for name in wanted if name in metadata.topics
    }
    missing = [name for name in wanted if not counts.get(name)]
    if missing:
        raise TopicMissingError(f"topics missing at {settings.kafka_bootstrap}: {missing}")
    return counts


class _QuietMonitor(Monitor):
    """faust's Monitor without its per-record counters (messages, stream events, sends,
    table keys): they feed faust's web stats, which the worker does not serve, and cost ~3% of
    its CPU. Commit, assignment and rebalance hooks stay as they are."""

    def on_message_in(self, tp: Any, offset: int, message: Any) -> None:
        return None

    def on_stream_event_in(self, tp: Any, offset: int, stream: Any, event: Any) -> None:
        return None

    def on_stream_event_out(
        self, tp: Any, offset: int, stream: Any, event: Any, state: Any = None
    ) -> None:
        return None

    def on_message_out(self, tp: Any, offset: int, message: Any) -> None:
        return None

    def on_send_initiated(
        self, producer: Any, topic: str, message: Any, keysize: int, valsize: int
    ) -> None:
        return None

    def on_send_completed(self, producer: Any, state: Any, metadata: Any) -> None:
        return None

    def on_table_get(self, table: Any, key: Any) -> None:
        return None

    def on_table_set(self, table: Any, key: Any, value: Any) -> None:
        return None

    def on_table_del(self, table: Any, key: Any) -> None:
        return None


def group_route(partitions: int) -> Route:
    """group_id -> the partition a record keyed by group_id gets from Kafka's default
    partitioner (murmur2, as the Java client and aiokafka): where the builder writes a group's
    trajectories, and what the aggregator checks."""

    def route(group_id: str) -> int:
        return (murmur2(group_id.encode()) & 0x7FFFFFFF) % partitions

    return route


def _credentials(settings: ProcessorSettings) -> Any:
    protocol = settings.kafka_security_protocol.upper()
    if protocol == "PLAINTEXT":
        return None
    ssl = create_ssl_context(cafile=settings.kafka_ssl_ca_location) if "SSL" in protocol else None
    if protocol.startswith("SASL"):
        password = settings.kafka_sasl_password
        return faust.SASLCredentials(
            username=settings.kafka_sasl_username,
            password=None if password is None else password.get_secret_value(),
            ssl_context=ssl,
            mechanism=settings.kafka_sasl_mechanism,
        )
    return faust.SSLCredentials(ssl)


class Processor:
    """One processor worker's app. Build with ``create_processor``; run with ``run`` (or
    ``faust.Worker(processor.app)``)."""

    def __init__(self, settings: ProcessorSettings, partitions: Mapping[str, int]) -> None:
        self.settings = s = settings
        topics = s.topics()
        n_events = partitions[topics.events]
        n_groups = partitions[topics.trajectories]
        max_bytes = {"max.message.bytes": str(s.proc_max_message_bytes)}
        s.data_dir.mkdir(parents=True, exist_ok=True)  # faust's datadir (nothing kept there)
        self.app = app = faust.App(
            s.app_id,
            broker=[f"kafka://{host.strip()}" for host in s.kafka_bootstrap.split(",")],
            broker_credentials=_credentials(s),
            autodiscover=False,
            datadir=str(s.data_dir),
            store="memory://",
            key_serializer="raw",
            value_serializer="raw",
            processing_guarantee="at_least_once",
            consumer_auto_offset_reset="earliest",
            topic_allow_declare=True,
            topic_disable_leader=True,
            topic_replication_factor=s.topic_replication,
            topic_partitions=n_events,
            broker_session_timeout=s.proc_session_timeout_s,
            broker_heartbeat_interval=s.proc_heartbeat_interval_s,
            broker_rebalance_timeout=s.proc_rebalance_timeout_s,
            broker_commit_interval=s.proc_commit_interval_s,
            # commits on the timer only: faust also commits every 10,000 records from inside its
            # delivery loop, which then stops handing records to the agents until the producer
            # is flushed and the offsets are committed (a stall of every record in flight)
            broker_commit_every=_NEVER,
            broker_request_timeout=s.proc_request_timeout_s,
            stream_wait_empty=False,
            stream_buffer_maxsize=s.proc_stream_buffer_maxsize,
            producer_linger_ms=s.proc_producer_linger_ms,
            producer_max_batch_size=s.proc_producer_batch_bytes,
            producer_acks=s.proc_producer_acks,
            producer_max_request_size=s.proc_max_message_bytes,
            consumer_max_fetch_size=s.proc_fetch_max_bytes,
            table_standby_replicas=s.proc_standby_replicas,
            web_enabled=False,
            agent_supervisor=CrashingSupervisor,
            monitor=_QuietMonitor(),
        )
        raw: dict[str, Any] = {"key_type": bytes, "value_type": bytes}
        events = app.topic(topics.events, allow_empty=True, **raw)
        trajectories = app.topic(topics.trajectories, allow_empty=True, **raw)
        self._sinks = {
            Sink.TRAJECTORIES: topics.trajectories,
            Sink.SAMPLES: topics.samples,
            Sink.DLQ: topics.dlq,
        }
        # Any: faust's TableT type leaves out what is used here (changelog_topic_name, data)
        self.rollouts_table: Any = cast(
            Any, app.Table("rollouts", partitions=n_events, extra_topic_configs=max_bytes, **raw)
        )
        self.groups_table: Any = cast(
            Any, app.Table("groups", partitions=n_groups, extra_topic_configs=max_bytes, **raw)
        )
        codec = build_codec(s)
        route = group_route(n_groups)
        self.rollouts = RolloutBook(
            s.builder_config(),
            codec,
            source_topic=topics.events,
            processor=s.app_id,
            route=route,
        )
        self.groups = GroupBook(
            s.group_config(),
            codec,
            source_topic=topics.trajectories,
            processor=s.app_id,
            route=route,
        )
        for book in (self.rollouts, self.groups):
            book.clock = PartitionClock(s.max_clock_ahead_us(), _wall_us)
        self.internal_topics = [
            TopicSpec(
                changelog,
                n,
                "table key",
                f"changelog of the {name} table",
                cleanup_policy="compact",
                replication=s.topic_replication,
                config=max_bytes,
            )
            for changelog, n, name in (
                (self.rollouts_table.changelog_topic_name, n_events, "rollouts"),
                (self.groups_table.changelog_topic_name, n_groups, "groups"),
            )
        ]
        self._recovered = {"rollouts": False, "groups": False}
        self._sources = {topics.events, topics.trajectories}
        self.guard = OffsetGuard()
        self._assigned_generation: int | None = None
        # faust marks an offset jump as a gap that may be committed past; rollstream's source
        # topics have none, so a jump is a hole the guard refills (offsets.py)
        consumer: Any = app.consumer  # faust internals from here on (see offsets.py)
        self._faust_add_gap = consumer._add_gap
        consumer._add_gap = _no_gap
        self._last_stats = time.monotonic()
        self._deferred: set[asyncio.Future[None]] = set()  # writes waiting for acks
        self._frozen = False  # gc.freeze() done (after the first recovery)
        self.metrics = self._metrics()
        self._wire(events, trajectories)

    # --- metrics ----------------------------------------------------------------------------

    def _metrics(self) -> ServiceMetrics:
        m = ServiceMetrics("processor")
        rollouts, groups, guard = self.rollouts, self.groups, self.guard
        self.dead_letters = m.counter(
            "dead_letters", "records sent to the dead-letter topic", ("stage", "code")
        )

        def stat(book: Any, name: str) -> Any:
            return lambda: book.stats.get(name, 0)

        m.counter_fn(
            "records",
            "source records read, by stage (builder: events, aggregator: trajectories)",
            lambda: {("builder",): rollouts.stats.get("records", 0),
                     ("aggregator",): groups.stats.get("records", 0)},
            ("stage",),
        )  # fmt: skip
        m.gauge_fn("rollouts_open", "rollouts being rebuilt", lambda: len(rollouts.open))
        m.counter_fn("rollouts_closed", "trajectories emitted", stat(rollouts, "trajectories"))
        m.counter_fn("invalid_events", "events refused by the builder", stat(rollouts, "invalid"))
        m.gauge_fn("groups_open", "groups being gathered", lambda: len(groups.open))
        m.counter_fn("groups_closed", "groups closed", stat(groups, "groups_closed"))
        m.counter_fn(
            "groups_dropped_zero_variance",
            "groups dropped for equal rewards (DAPO)",
            stat(groups, "groups_dropped_zero_variance"),
        )
        m.counter_fn("samples", "training samples emitted", stat(groups, "samples"))
        m.counter_fn("offset_seeks", "seeks back over offset holes", lambda: guard.seeks)
        m.counter_fn("offset_gaps_accepted", "offset gaps accepted", lambda: guard.accepted)
        monitor: Any = self.app.monitor
        m.counter_fn("rebalances", "consumer group rebalances (faust)", lambda: monitor.rebalances)
        m.gauge_fn(
            "commit_latency_seconds",
            "mean of faust's recent offset commits",
            lambda: sum(monitor.commit_latency) / max(1, len(monitor.commit_latency)),
        )

        def ready() -> tuple[bool, str]:
            if self.app.rebalancing:
                return False, "rebalancing"
            waiting = [name for name, done in self._recovered.items() if not done]
            return not waiting, f"recovering {','.join(waiting)}" if waiting else "recovered"

        m.health.watch("tables", ready)
        return m

    def _count_dead_letters(self, stage: str, headers: Any) -> None:
        code = next((v for k, v in headers if k == HEADER_NAMES[1]), b"")
        self.dead_letters.labels(stage, code.decode(errors="replace")).inc()

    # --- faust wiring -----------------------------------------------------------------------

    def _wire(self, events: Any, trajectories: Any) -> None:
        app, s = self.app, self.settings
        rollouts_table, groups_table = self.rollouts_table, self.groups_table

        @app.agent(events, name=f"{s.app_id}.builder")
        async def builder(stream: Any) -> None:
            async for event in stream.events():
                m = event.message
                if await self._admit(m):
                    step = self.rollouts.on_record(
                        m.partition, m.offset, m.key, m.value, _wall_us()
                    )
                    await self._execute(step, rollouts_table)

        @app.agent(trajectories, name=f"{s.app_id}.aggregator")
        async def aggregator(stream: Any) -> None:
            async for event in stream.events():
                m = event.message
                if await self._admit(m):
                    step = self.groups.on_record(m.partition, m.offset, m.key, m.value, _wall_us())
                    await self._execute(step, groups_table)

        @rollouts_table.on_recover
        async def rollouts_recovered() -> None:
            await self._rebuild("rollouts", self.rollouts, rollouts_table, events.get_topic_name())

        @groups_table.on_recover
        async def groups_recovered() -> None:
            await self._rebuild("groups", self.groups, groups_table, trajectories.get_topic_name())

        @app.timer(s.proc_timer_interval_s, name=f"{s.app_id}.timer")
        async def tick() -> None:
            self.metrics.health.beat()
            await self._guard(self._tick())

    async def _guard(self, coro: Any) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("processor failed; stopping the worker")
            await self.app.crash(exc)

    async def _admit(self, message: Any) -> bool:
        """Should the agent process this record (see offsets.py)? Seeks back over holes."""
        action, offset = self.guard.admit(
            (message.topic, message.partition), message.offset, time.monotonic()
        )
        if action is Admit.SEEK:
            log.warning(
                "%s[%d]: offset %d delivered, %d expected: seeking back",
                message.topic,
                message.partition,
                message.offset,
                offset,
            )
            await self._seek(message.topic, message.partition, offset)
        elif action is Admit.ACCEPT:
            log.error(
                "%s[%d]: offsets %d..%d never came after %d seeks: a real gap",
                message.topic,
                message.partition,
                offset,
                message.offset - 1,
                self.guard.accept_after,
            )
            await self._faust_add_gap(message.tp, offset, message.offset - 1)
        return action in (Admit.PROCESS, Admit.ACCEPT)

    async def _seek(self, topic: str, partition: int, offset: int) -> None:
        """Seek in the Kafka client's own thread (faust's Consumer.seek calls it from the
        event loop's thread, racing the fetcher: measured, such seeks were lost), then reset
        faust's read offset so the records are not dropped as already read."""
        consumer: Any = self.app.consumer
        thread = consumer._thread
        tp = TopicPartition(topic, partition)

        async def seek() -> None:
            thread._ensure_consumer().seek(tp, offset)

        await thread.call_thread(seek)
        consumer._read_offset[TP(topic, partition)] = offset if offset else None

    def _highwater(self, key: Any) -> int | None:
        try:
            return self.app.consumer.highwater(TP(*key))
        except Exception:  # not assigned any more (a rebalance is starting)
            return None

    async def _after_assignment(self) -> None:
        """Once per assignment, when the tables are recovered: pause the changelog partitions
        in the Kafka client, and expect each source partition from its committed offset.

        faust pauses the changelogs only in its own bookkeeping, so aiokafka keeps fetching the
        processor's own table writes and buffers them for good; each such buffer holds back
        every fetch from that broker for 100 ms (aiokafka's prefetch backoff): measured, a hop
        between two agents took 0.4-2 s instead of milliseconds. A new assignment starts
        unpaused, so the next recovery reads them again."""
        generation = self.app.consumer_generation_id
        if generation == self._assigned_generation:
            return
        changelogs = set(self.app.tables.changelog_topics)
        consumer: Any = self.app.consumer
        thread = consumer._thread
        paused = [
            TopicPartition(tp.topic, tp.partition)
            for tp in self.app.assignor.assigned_actives()
            if tp.topic in changelogs
        ]

        async def pause() -> None:
            thread._ensure_consumer().pause(*paused)

        if paused:
            await thread.call_thread(pause)
        actives = [tp for tp in self.app.assignor.assigned_actives() if tp.topic in self._sources]
        committed = await consumer.seek_to_committed()
        missing = [tp for tp in actives if committed.get(tp) is None]
        earliest = await consumer.earliest_offsets(*missing) if missing else {}
        self.guard.reset(
            {
                (tp.topic, tp.partition): committed.get(tp)
                if committed.get(tp) is not None
                else earliest.get(tp)
                for tp in actives
            },
            time.monotonic(),
        )
        self._assigned_generation = generation

    async def _rebuild(self, name: str, book: Any, table: Any, topic: str) -> None:
        async def rebuild() -> None:
            self._recovered[name] = False
            await self._after_assignment()
            actives = self.app.assignor.assigned_actives()
            partitions = {tp.partition for tp in actives if tp.topic == topic}
            started = time.monotonic()
            steps = book.rebuild(list(table.data.items()), partitions, _wall_us())
            for step in steps:
                await self._execute(step, table)
            self._recovered[name] = True
            if all(self._recovered.values()) and not self._frozen:
                _freeze_heap()
                self._frozen = True
            log.info(
                "%s: rebuilt %d open, %d closed in %.2fs for partitions %s (%d steps)",
                name,
                len(book.open),
                len(book.closed),
                time.monotonic() - started,
                sorted(partitions),
                len(steps),
            )

        await self._guard(rebuild())

    async def _tick(self) -> None:
        if self.app.rebalancing or not all(self._recovered.values()):
            return
        for (topic, partition), offset in self.guard.due(time.monotonic(), self._highwater):
            log.warning("%s[%d]: offset %d not delivered: seeking to it", topic, partition, offset)
            await self._seek(topic, partition, offset)
        wall = _wall_us()
        for step in self.rollouts.expire(wall):
            await self._execute(step, self.rollouts_table)
        for step in self.groups.expire(wall):
            await self._execute(step, self.groups_table)
        interval = self.settings.proc_stats_interval_s
        if interval and time.monotonic() - self._last_stats >= interval:
            self._last_stats = time.monotonic()
            log.info("stats %s", self.stats())

    async def _execute(self, step: Step, table: Any) -> None:
        """Send; wait for the acks when the step has a barrier; write the table. The deferred
        writes wait for the acks in a task of their own: the agent goes on."""
        futures = []
        send = self.app.producer.send  # the client, not Topic.send: a quarter of the CPU
        for out in step.sends:
            headers = list(out.headers) or None
            if out.sink is Sink.DLQ:
                stage = "builder" if table is self.rollouts_table else "aggregator"
                self._count_dead_letters(stage, out.headers)
            futures.append(
                await send(self._sinks[out.sink], out.key, out.value, out.partition, None, headers)
            )
        if step.barrier and futures:
            await asyncio.gather(*futures)
        await self._write(table, step.partition, step.writes)
        if step.deferred:
            task = asyncio.ensure_future(self._guard(self._after_acks(futures, step, table)))
            self._deferred.add(task)
            task.add_done_callback(self._deferred.discard)
        elif step.on_done is not None:
            step.on_done()

    async def _after_acks(self, futures: list[Any], step: Step, table: Any) -> None:
        await asyncio.gather(*futures)
        await self._write(table, step.partition, step.deferred)
        if step.on_done is not None:
            step.on_done()

    async def _write(self, table: Any, partition: int, writes: list[Write]) -> None:
        """The store, and the changelog partition, in order: straight into the producer's
        batches (not faust's send_soon buffer, whose flush before a commit can return early
        with records still queued)."""
        if not writes:
            return
        send, changelog = self.app.producer.send, table.changelog_topic_name
        for key, value in writes:
            if value is None:
                with suppress(KeyError):
                    del table.data[key]
            else:
                table.data[key] = value
            await send(changelog, key, value, partition, None, None)

    @property
    def waiting_for_acks(self) -> set[asyncio.Future[None]]:
        """Deferred table writes whose sends are not acknowledged yet."""
        return self._deferred

    def uncommitted(self) -> dict[str, str]:
        """Source partitions read past their committed offset: ``topic[p]`` -> the offsets
        ``first..last`` a restart reads again (read from another thread: a snapshot)."""
        consumer: Any = self.app.consumer
        read, committed = dict(consumer._read_offset), dict(consumer._committed_offset)
        out = {}
        for tp, last in sorted(read.items()):
            first = committed.get(tp) or 0
            if tp.topic in self._sources and last is not None and last >= first:
                out[f"{tp.topic}[{tp.partition}]"] = f"{first}..{last}"
        return out

    def stats(self) -> dict[str, Any]:
        """Counters of the two stages and the offset guard, and the open slots held in memory."""
        return {
            "builder": {**self.rollouts.stats, "open": len(self.rollouts.open)},
            "offsets": {"seeks": self.guard.seeks, "gaps_accepted": self.guard.accepted},
            "aggregator": {**self.groups.stats, "open": len(self.groups.open)},
        }


def _freeze_heap() -> None:
    """Move everything alive after start-up (faust, mode, aiokafka, the books as recovered) out
    of the collector's reach: a full collection scanned them all, 50-100 ms with the worker
    stopped (measured on the shared box), often enough to set the latency tail. Objects made
    later are collected as usual; frozen ones are still freed when their count drops."""
    gc.collect()
    gc.freeze()


class _Worker(faust.Worker):
    """faust's worker with a bounded stop. faust stops its Kafka consumer by committing and
    leaving the group, and aiokafka retries both for as long as the coordinator is away: with
    the broker unreachable the worker never exits. A signal that asks for the stop also starts
    a watchdog; past ``grace_s`` it logs what is not committed and ends the process with 0.
    Nothing is lost by that: faust commits an offset only after the producer has flushed the
    sends and table writes of the records before it, so what was not committed is read again
    at restart and its outputs, deterministic, are deduplicated downstream."""

    def __init__(self, processor: Processor, grace_s: float, **kwargs: Any) -> None:
        super().__init__(processor.app, **kwargs)
        self.processor, self.grace_s = processor, grace_s
        self._watchdog: threading.Thread | None = None

    def _schedule_shutdown(self, sig: signal.Signals) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._bound_stop, name="stop-watchdog", daemon=True
            )
            self._watchdog.start()
        super()._schedule_shutdown(sig)

    def _bound_stop(self) -> None:
        time.sleep(self.grace_s)
        p = self.processor
        log.warning(
            "stop not done %.0f s after the signal (the broker unreachable?): exiting; "
            "offsets not committed (read again at restart): %s; %d writes waiting for acks",
            self.grace_s,
            p.uncommitted() or "none",
            len(p.waiting_for_acks),
        )
        logging.shutdown()  # the log's handlers flushed: os._exit runs no atexit
        os._exit(0)


def _use_event_loop(kind: str) -> None:
    """uvloop (a dependency through uvicorn[standard]) for the worker's loops, the main one and
    faust's consumer thread's, unless asked for asyncio's or uvloop is missing."""
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("uvloop is not installed: running on asyncio's event loop")
            return
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def create_processor(
    settings: ProcessorSettings, partitions: Mapping[str, int] | None = None
) -> Processor:
    """Build the processor app. ``partitions`` (topic -> partition count) defaults to what the
    broker reports for the events and trajectories topics."""
    return Processor(settings, partitions if partitions is not None else partition_counts(settings))


def run(settings: ProcessorSettings) -> int:
    """Create the missing topics (the contract's, then the processor's internal ones: faust
    declares them too, but a topic it creates at start-up can miss the first assignment), then
    run one worker until it is stopped."""
    from rollstream.adapters.topics import ensure_topics  # the topic manager (I/O edge)

    ensure_topics(settings)
    _use_event_loop(settings.proc_event_loop)  # before faust makes its loops
    processor = create_processor(settings)
    ensure_topics(settings, processor.internal_topics)
    processor.metrics.health.stale_s = max(60.0, 10 * settings.proc_timer_interval_s)
    metrics_server = serve_metrics(settings, processor.metrics)
    worker = _Worker(
        processor,
        STOP_GRACE_S,
        loglevel=settings.proc_log_level,
        redirect_stdouts=False,
        quiet=True,
        # json: faust (mode) keeps the command's handlers instead of its own text ones
        override_logging=settings.log_format != "json",
    )
    # faust's terminal spinner, kept at log levels >= warning, sets the root logger to DEBUG
    # (it spins on every record): every debug call of aiokafka (one per produced record) then
    # builds a LogRecord; measured, 5% of the worker's CPU at --log-level warning
    worker.spinner = None
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        if metrics_server is not None:
            metrics_server.stop()
    return 0
