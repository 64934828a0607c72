"""One stage's Kafka consumer in a worker process (``StageWorker``, a thread per stage) and the
watcher of cancelled jobs (``JobWatcher``); workers.py runs them for ``rollstream workers``
and holds what a message's stage does (``Service``).

A StageWorker takes messages while it has room (its concurrency; for RUN, the controller's
budget too), runs each on a thread pool, and commits each partition's offsets in order once
their work is durable (stages.OffsetBook). While full it pauses its partitions and keeps
polling, so the group never drops it for a long stage; a message fetched before the pause
took hold is sought back. A message that cannot be decoded is dead-lettered with the reason;
a proxy call without an answer, or a send the broker did not take, is tried again every
``RETRY_S`` (the offset waits); a stage that fails otherwise dead-letters its message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Final, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from prometheus_client import Histogram

from rollstream.adapters.metrics import ServiceMetrics
from rollstream.producers.errors import RolloutCallError
from rollstream.producers.rollouts.capacity import Capacity, StageLoadMeter
from rollstream.producers.rollouts.settings import RolloutSettings
from rollstream.producers.rollouts.stages import JobRecord, OffsetBook, StageMessage, StageName
from rollstream.schemas.control import StageLoad
from rollstream.schemas.dlq import CODE_INVALID, CODE_UNDECODABLE
from rollstream.schemas.topics import Topics

__all__ = ["POLL_S", "RETRY_S", "JobWatcher", "StageService", "StageWorker", "group_name"]

log = logging.getLogger("rollstream.producers.rollouts.workers")  # the service's one logger

POLL_S: Final = 0.2
RETRY_S: Final = 2.0  # between tries of a message whose proxy call got no answer


class StageService(Protocol):
    """What a StageWorker and the JobWatcher use of the worker process's service
    (workers.Service): its settings and topics, the stop, the controller's budget, metrics,
    the cancelled jobs, and what one message's stage does."""

    settings: RolloutSettings
    topics: Topics
    stop: threading.Event
    capacity: Capacity
    metrics: ServiceMetrics
    stage_seconds: Histogram
    cancelled: set[str]

    def handle(self, msg: StageMessage) -> None: ...

    def lost(self, msg: StageMessage, exc: RolloutCallError) -> None: ...

    def dead_letter(self, raw: Message, reason: str, stage: str, code: str) -> None: ...


def group_name(settings: RolloutSettings, stage: str) -> str:
    prefix = f"{settings.namespace}." if settings.namespace else ""
    return f"{prefix}rollstream.rollouts.{stage}"


class StageWorker(threading.Thread):
    """One stage's consumer: takes messages while it has room, runs them on a thread pool,
    commits each partition's offsets in order as their work is durable."""

    def __init__(self, service: StageService, stage: StageName, concurrency: int) -> None:
        super().__init__(name=f"rollouts-{stage}", daemon=True)
        self.service, self.stage, self.concurrency = service, stage, concurrency
        self.meter = StageLoadMeter(concurrency)
        self.topic = service.topics.task(stage)
        self.book = OffsetBook()
        self.finished: queue.Queue[tuple[int, int]] = queue.Queue()
        self.wake = threading.Event()  # set when a message's work ends
        self.paused = False
        self.error: BaseException | None = None
        settings = service.settings
        self.consumer = Consumer(
            {
                **settings.kafka_config(),
                "group.id": group_name(settings, stage),
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "max.poll.interval.ms": 600_000,  # polled while full (paused), never idle long
                "session.timeout.ms": 10_000,  # a killed worker's partitions move on soon
                "fetch.wait.max.ms": 100,  # a queue: a message waits little for its fetch
                "partition.assignment.strategy": "cooperative-sticky",
            }
        )

    def limit(self) -> int:
        """How many messages this worker may hold now: its concurrency; for RUN, no more than
        it holds once the controller's budget for it is spent (capacity.py)."""
        held = self.book.count()
        if self.stage == "run" and not self.service.capacity.may_start(self.meter.started):
            return min(held, self.concurrency)
        return self.concurrency

    def load(self) -> StageLoad:
        return self.meter.load(self.book.count(), self.limit())

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            self.error = exc
            log.exception("the %s worker stopped", self.stage)
            self.service.stop.set()

    def _loop(self) -> None:
        stop = self.service.stop
        self.consumer.subscribe([self.topic], on_assign=self._assigned, on_revoke=self._revoked)
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix=f"{self.stage}-")
        try:
            while not stop.is_set():
                self.service.metrics.health.beat()
                self._commit_finished()
                full = self.book.count() >= self.limit()
                if full != self.paused:
                    self._pause(full)
                if full:  # wake as soon as a message's work ends, not at the next poll's end
                    self.wake.wait(POLL_S)
                    self.wake.clear()
                raw = self.consumer.poll(0 if full else POLL_S)
                if raw is None:
                    continue
                error = raw.error()
                if error is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        log.warning("%s: %s", self.topic, error)
                    continue
                partition, offset = raw.partition() or 0, raw.offset() or 0
                if self.book.count() >= self.limit():  # fetched before the pause took hold:
                    # leave it for later (the resume seeks to the position, this offset)
                    self.consumer.seek(TopicPartition(self.topic, partition, offset))
                    continue
                self.book.take(partition, offset)
                pool.submit(self._work, raw, partition, offset, self.meter.begin())
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            with contextlib.suppress(KafkaException, RuntimeError):
                self._commit_finished()
            held = {p: sorted(offsets) for p, offsets in self.book.inflight.items() if offsets}
            if held:
                log.warning(
                    "%s: stopping with messages in flight, not committed (they come back): %s",
                    self.topic,
                    held,
                )
            with contextlib.suppress(KafkaException, RuntimeError):
                self.consumer.close()

    def _pause(self, pause: bool) -> None:
        """Pause the assignment while full; on resume, seek each partition to the message after
        the last one taken (pausing drops what was fetched ahead, and the fetcher would go on
        after it)."""
        assignment = self.consumer.assignment()
        if pause:
            self.consumer.pause(assignment)
        else:
            self.consumer.resume(assignment)
            for tp in self.consumer.position(assignment):
                if tp.offset >= 0:
                    self.consumer.seek(tp)
        self.paused = pause

    def _work(self, raw: Message, partition: int, offset: int, began: float) -> None:
        try:
            self._do(raw, partition, offset)
        finally:
            self.meter.end(began)
            self.service.stage_seconds.labels(self.stage).observe(time.monotonic() - began)

    def _do(self, raw: Message, partition: int, offset: int) -> None:
        service = self.service
        try:
            msg = StageMessage.decode(raw.value() or b"")
        except ValueError as exc:
            log.warning("%s[%d]@%d: dead-lettered: %s", self.topic, partition, offset, exc)
            service.dead_letter(raw, str(exc), self.stage, CODE_UNDECODABLE)
            self._finished(partition, offset)
            return
        while not service.stop.is_set():
            try:
                service.handle(msg)
                break
            except RolloutCallError as exc:
                if exc.status == 404:  # the proxy forgot it (restarted): a new attempt
                    try:
                        service.lost(msg, exc)
                        break
                    except KafkaException as err:  # the retry's send: try it all again
                        log.warning("rollout %s: %s; trying again", msg.rollout_id, err)
                        service.stop.wait(RETRY_S)
                        continue
                if exc.status is not None:
                    log.error("rollout %s: the proxy refused: %s", msg.rollout_id, exc)
                    break  # the rollout is finished as far as the proxy lets it be
                log.warning("rollout %s: %s; trying again", msg.rollout_id, exc)
                service.stop.wait(RETRY_S)
            except KafkaException as exc:  # a send the broker did not take (it is away): the
                # claim says what was done, so handling the message again resends or redoes
                log.warning("rollout %s: %s; trying again", msg.rollout_id, exc)
                service.stop.wait(RETRY_S)
            except Exception as exc:  # a job its worker cannot run (an agent that cannot be
                # built), or a bug: the rollout, if open, was finished failed by the stage;
                # the message goes to the dead letters with the reason, never dropped
                log.exception("rollout %s: %s stage failed", msg.rollout_id, self.stage)
                service.dead_letter(raw, f"{type(exc).__name__}: {exc}", self.stage, CODE_INVALID)
                break
        else:
            return  # stopping: the offset stays uncommitted, the message comes back
        self._finished(partition, offset)

    def _finished(self, partition: int, offset: int) -> None:
        self.finished.put((partition, offset))
        self.wake.set()

    def _commit_finished(self) -> None:
        commits: dict[int, int] = {}
        while True:
            try:
                partition, offset = self.finished.get_nowait()
            except queue.Empty:
                break
            upto = self.book.done(partition, offset)
            if upto is not None:
                commits[partition] = upto
        if commits:
            offsets = [TopicPartition(self.topic, p, o) for p, o in commits.items()]
            try:
                self.consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as exc:  # revoked meanwhile (its new owner goes on), or the
                # broker away: the messages come back, their stages judged from their claims
                level = logging.WARNING if self.service.stop.is_set() else logging.INFO
                log.log(level, "%s: offsets %s not committed: %s", self.topic, commits, exc)

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if self.paused:
            consumer.pause(partitions)

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._commit_finished()
        self.book.revoke(p.partition for p in partitions)


class JobWatcher(threading.Thread):
    """Keeps ``service.cancelled`` up to date from ``rollout.jobs`` (read from the start)."""

    def __init__(self, service: StageService) -> None:
        super().__init__(name="rollouts-jobs", daemon=True)
        self.service = service
        s = service.settings
        self.consumer = Consumer(
            {
                **s.kafka_config(),
                "group.id": f"rollstream-rollouts-jobs-{os.getpid()}",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
            }
        )

    def run(self) -> None:
        self.consumer.subscribe([self.service.topics.jobs])
        try:
            while not self.service.stop.is_set():
                raw = self.consumer.poll(POLL_S)
                if raw is None or raw.error() is not None:
                    continue
                with contextlib.suppress(ValueError):
                    record = JobRecord.decode(raw.value() or b"")
                    if record.type == "cancelled":
                        self.service.cancelled.add(record.job_id)
        finally:
            self.consumer.close()
