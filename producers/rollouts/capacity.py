"""The stage workers' side of the elastic controller: load reports out, decisions in.

``StageLoadMeter`` counts what one stage worker holds and has done; ``Reporter`` publishes the
process's ``WorkerReport`` (schemas/control.py) on ``<ns>.control.workers`` every
``rollouts_report_s`` (and a last one, ``stopping``, when the worker stops), so the controller
knows which RUN workers are live and what they hold. ``DecisionWatcher`` follows
``<ns>.control.decisions`` from its newest record; ``Capacity.run_limit`` is then the RUN
worker's share of the decided RUN slots (staleness-aware admission and the rollout/training
split). Without a controller, or when its newest decision is older than the decision's
``ttl_s``, a worker runs at its own concurrency: a stopped controller never stops the service
(it can only waste rollouts, never lose one).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Final

from confluent_kafka import Consumer, KafkaException, Message, Producer, TopicPartition
from pydantic import ValidationError

from rollstream.producers.rollouts.settings import RolloutSettings
from rollstream.schemas.control import (
    CapacityDecision,
    StageLoad,
    WorkerReport,
    decode_decision,
)
from rollstream.schemas.errors import SchemaError

__all__ = ["Capacity", "DecisionWatcher", "Reporter", "StageLoadMeter"]

log = logging.getLogger("rollstream.producers.rollouts.capacity")

POLL_S: Final = 0.2


class StageLoadMeter:
    """What one stage worker has taken and done (thread-safe counters; ``begin`` is called by
    the consuming thread as it takes a message, so the count is never behind what it took)."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self._lock = threading.Lock()
        self.started = 0
        self.done = 0
        self.busy_s = 0.0

    def begin(self) -> float:
        with self._lock:
            self.started += 1
        return time.monotonic()

    def end(self, began: float) -> None:
        with self._lock:
            self.done += 1
            self.busy_s += time.monotonic() - began

    def load(self, in_flight: int, limit: int) -> StageLoad:
        with self._lock:
            return StageLoad(
                in_flight=in_flight,
                limit=limit,
                concurrency=self.concurrency,
                started=self.started,
                done=self.done,
                busy_s=round(self.busy_s, 3),
            )


class Capacity:
    """The newest decision this worker knows, and whether it may start a RUN under it."""

    def __init__(self, worker: str, follow: bool) -> None:
        self.worker = worker
        self.follow = follow
        self.decision: CapacityDecision | None = None
        self._stale_said = False

    def may_start(self, started: int) -> bool:
        """``started``: this worker's RUN messages taken so far."""
        decision = self.decision
        if not self.follow or decision is None:
            return True
        now = time.time()
        stale = decision.stale(now)
        if stale and not self._stale_said:
            log.warning(
                "the controller's newest decision is %.0f s old (ttl %.0f s): running at "
                "full concurrency until a new one comes",
                now - decision.ts,
                decision.ttl_s,
            )
        self._stale_said = stale
        return decision.may_start(self.worker, started, now)


class DecisionWatcher(threading.Thread):
    """Keeps ``capacity.decision`` at the newest record of ``<ns>.control.decisions`` (from
    the record before the end at start: the decision in force)."""

    def __init__(
        self,
        settings: RolloutSettings,
        capacity: Capacity,
        stop: threading.Event,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(name="rollouts-decisions", daemon=True)
        self.capacity, self.stop, self.on_change = capacity, stop, on_change
        self.topic = settings.topics().control_decisions
        self.consumer = Consumer(
            {
                **settings.kafka_config(),
                "group.id": f"rollstream-decisions-{uuid.uuid4().hex[:12]}",  # assigned only
                "enable.auto.commit": False,
            }
        )

    def prime(self, timeout: float = 10.0) -> None:
        """Read the decision in force (the topic's last record) before the RUN worker takes a
        message, so a worker that starts under a live controller never starts unbudgeted."""
        tp = TopicPartition(self.topic, 0)
        low, high = self.consumer.get_watermark_offsets(tp, timeout=10)
        self.consumer.assign([TopicPartition(self.topic, 0, max(low, high - 1))])
        deadline = time.monotonic() + timeout
        while high > low and self.capacity.decision is None and time.monotonic() < deadline:
            self._take(self.consumer.poll(POLL_S))

    def _take(self, raw: Message | None) -> None:
        if raw is None or raw.error() is not None:
            return
        try:
            decision = decode_decision(raw.value() or b"")
        except SchemaError as exc:
            log.warning("%s@%d: ignored: %s", self.topic, raw.offset() or 0, exc)
            return
        self.capacity.decision = decision
        self.on_change()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self._take(self.consumer.poll(POLL_S))
        finally:
            with contextlib.suppress(KafkaException, RuntimeError):
                self.consumer.close()


class Reporter(threading.Thread):
    """Publishes this process's ``WorkerReport`` every ``rollouts_report_s``; ``loads`` gives
    the current load of each stage it serves."""

    def __init__(
        self,
        settings: RolloutSettings,
        worker: str,
        producer: Producer,
        loads: Callable[[], Mapping[str, StageLoad]],
        stop: threading.Event,
    ) -> None:
        super().__init__(name="rollouts-reports", daemon=True)
        self.worker, self.producer, self.loads, self.stop = worker, producer, loads, stop
        self.period = settings.rollouts_report_s
        self.topic = settings.topics().control_workers

    def report(self, stopping: bool = False) -> None:
        try:
            record = WorkerReport.model_validate(
                {
                    "worker": self.worker,
                    "ts": time.time(),
                    "period_s": self.period,
                    "stages": dict(self.loads()),
                    "stopping": stopping,
                }
            )
        except ValidationError as exc:  # a worker id the contract refuses: said, not fatal
            log.error("no load report: %s", exc.errors()[0]["msg"])
            return
        try:
            self.producer.produce(self.topic, key=self.worker, value=record.encode())
            self.producer.poll(0)
        except (KafkaException, BufferError) as exc:  # a lost report: the next one says it all
            log.info("load report not sent: %s", exc)

    def run(self) -> None:
        self.report()  # at once: a controller budgets only the workers it has heard from
        while not self.stop.wait(self.period):
            self.report()
        self.report(stopping=True)
