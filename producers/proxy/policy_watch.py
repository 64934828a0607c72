"""The proxy follows the trainer: it consumes ``policy.versions`` and, for each new version,
pauses new requests, drains in-flight calls, has every backend reload the checkpoint, and
resumes (``BackendPool.update_weights``). LlmCalls after that carry the new policy_version.

A background thread polls Kafka (confluent-kafka is blocking) and hands each newer
PolicyVersion to the proxy's event loop; updates are applied one at a time, in version order,
and a version older than or equal to the pool's is skipped. On start it reads the topic's last
record, so a proxy that starts after the trainer catches up with the current weights.

A record that is not a PolicyVersion is dead-lettered, unchanged, to ``Topics(ns).dlq`` with the
shared headers (rollstream.schemas.dlq: stage ``policy_watcher``, code ``undecodable``) by an
idempotent acks=all producer, and the watcher carries on with the next record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from confluent_kafka import OFFSET_END, Consumer, Producer, TopicPartition

from rollstream.adapters.codecs import build_codec
from rollstream.schemas import CommonSettings, DecodeError, PolicyVersion
from rollstream.schemas.dlq import CODE_UNDECODABLE, dlq_headers

__all__ = ["STAGE", "PolicyWatcher"]

log = logging.getLogger("rollstream.producers.policy")

STAGE = "policy_watcher"  # the dead-letter ``stage`` header

Apply = Callable[[str, int], Awaitable[Any]]


class _Consumer(Protocol):  # the part of confluent_kafka.Consumer the watcher uses
    def poll(self, timeout: float) -> Any: ...
    def close(self) -> None: ...


class _Producer(Protocol):  # the part of confluent_kafka.Producer the dead letters use
    def produce(self, topic: str, *args: Any, **kwargs: Any) -> None: ...
    def flush(self, timeout: float) -> int: ...


class PolicyWatcher:
    """Consume PolicyVersion records and apply them on ``loop`` through ``apply(uri, version)``.
    ``current()`` says which version is served now (to skip old ones). ``consumer`` and
    ``producer`` replace the Kafka clients (the watcher closes the consumer and flushes the
    producer when it stops)."""

    def __init__(
        self,
        settings: CommonSettings,
        loop: asyncio.AbstractEventLoop,
        apply: Apply,
        current: Callable[[], int],
        *,
        poll_s: float = 0.5,
        consumer: _Consumer | None = None,
        producer: _Producer | None = None,
    ) -> None:
        self._settings = settings
        self._loop = loop
        self._apply = apply
        self._current = current
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._codec = build_codec(settings)
        self._lock = asyncio.Lock()
        self._group = f"rollstream-proxy-policy-{uuid.uuid4().hex[:8]}"
        self._consumer_given, self._producer_given = consumer, producer
        self._dlq_producer: _Producer | None = producer
        self.applied: list[int] = []
        self.dead_letters = 0  # records sent to the DLQ
        self._thread = threading.Thread(target=self._run, name="policy-watch", daemon=True)

    def start(self) -> PolicyWatcher:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _consumer(self) -> Consumer:
        topic = self._settings.topics().policy
        consumer = Consumer(
            {
                **self._settings.kafka_config(),
                "group.id": self._group,
                "enable.auto.commit": False,
                "session.timeout.ms": 6000,
            }
        )
        md = consumer.list_topics(topic, timeout=10)
        parts = list(md.topics[topic].partitions) if topic in md.topics else [0]
        assignment = []
        for p in parts:
            lo, hi = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            # the newest record, if any: a late proxy catches up with the current weights
            assignment.append(TopicPartition(topic, p, hi - 1 if hi > lo else OFFSET_END))
        consumer.assign(assignment)
        return consumer

    def _producer(self) -> _Producer:
        """The dead-letter producer, made on the first dead letter (idempotent, acks=all)."""
        if self._dlq_producer is None:
            self._dlq_producer = Producer(
                {
                    **self._settings.kafka_config(),
                    "enable.idempotence": True,
                    "acks": "all",
                    "client.id": self._group,
                }
            )
        return self._dlq_producer

    def _run(self) -> None:
        consumer: _Consumer | None = None
        try:
            consumer = self._consumer_given or self._consumer()
            while not self._stop.is_set():
                msg = consumer.poll(self._poll_s)
                if msg is None or msg.error():
                    continue
                self.handle(msg)
        except Exception:
            log.exception("policy watcher stopped")
        finally:
            if consumer is not None:
                consumer.close()
            if self._dlq_producer is not None:
                self._dlq_producer.flush(10)

    def handle(self, msg: Any) -> None:
        """One record (a confluent-kafka Message): apply it (blocking until the update is done)
        or dead-letter it."""
        try:
            pv = self._codec.decode(msg.value() or b"", expect=PolicyVersion)
        except DecodeError as exc:
            self._dead_letter(msg, exc.reason)
            return
        fut = asyncio.run_coroutine_threadsafe(self._update(pv), self._loop)
        with contextlib.suppress(Exception):
            fut.result()

    def _dead_letter(self, msg: Any, reason: str) -> None:
        """Send ``msg`` unchanged to the DLQ topic with the shared headers; wait for the ack."""
        topic = self._settings.topics().dlq
        headers = dlq_headers(
            reason=reason,
            code=CODE_UNDECODABLE,
            topic=msg.topic(),
            partition=msg.partition(),
            offset=msg.offset(),
            stage=STAGE,
            processor=self._group,
        )
        failed: list[Any] = []

        def on_delivery(err: Any, _msg: Any) -> None:
            if err is not None:
                failed.append(err)

        log.error(
            "undecodable record on %s [%d] @%d: %s (dead-lettered to %s)",
            msg.topic(),
            msg.partition(),
            msg.offset(),
            reason,
            topic,
        )
        producer = self._producer()
        producer.produce(
            topic, key=msg.key(), value=msg.value(), headers=headers, on_delivery=on_delivery
        )
        if producer.flush(10) or failed:
            log.error("dead letter to %s not acknowledged: %s", topic, failed or "timeout")
            return
        self.dead_letters += 1

    async def _update(self, pv: PolicyVersion) -> None:
        async with self._lock:
            if pv.version <= self._current():
                return
            log.info("policy version %d: reloading backends from %s", pv.version, pv.checkpoint_uri)
            try:
                await self._apply(pv.checkpoint_uri, pv.version)
                self.applied.append(pv.version)
            except Exception:
                log.exception("weight update to version %d failed", pv.version)
