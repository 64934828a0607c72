"""The proxy follows the trainer: it consumes ``policy.versions`` and, for each new version,
pauses new requests, drains in-flight calls, has every backend reload the checkpoint, and
resumes (``BackendPool.update_weights``). LlmCalls after that carry the new policy_version.

A background thread polls Kafka (confluent-kafka is blocking) and hands each newer
PolicyVersion to the proxy's event loop; updates are applied one at a time, in version order,
and a version older than or equal to the pool's is skipped. On start it reads the topic's last
record, so a proxy that starts after the trainer catches up with the current weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from confluent_kafka import OFFSET_END, Consumer, TopicPartition

from rollstream.schemas import Codec, CommonSettings, DecodeError, PolicyVersion

__all__ = ["PolicyWatcher"]

log = logging.getLogger("rollstream.producers.policy")

Apply = Callable[[str, int], Awaitable[Any]]


class PolicyWatcher:
    """Consume PolicyVersion records and apply them on ``loop`` through ``apply(uri, version)``.
    ``current()`` says which version is served now (to skip old ones)."""

    def __init__(
        self,
        settings: CommonSettings,
        loop: asyncio.AbstractEventLoop,
        apply: Apply,
        current: Callable[[], int],
        *,
        poll_s: float = 0.5,
    ) -> None:
        self._settings = settings
        self._loop = loop
        self._apply = apply
        self._current = current
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._codec = Codec()
        self._lock = asyncio.Lock()
        self.applied: list[int] = []
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
                "group.id": f"rollstream-proxy-policy-{uuid.uuid4().hex[:8]}",
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

    def _run(self) -> None:
        consumer = None
        try:
            consumer = self._consumer()
            while not self._stop.is_set():
                msg = consumer.poll(self._poll_s)
                if msg is None or msg.error():
                    continue
                try:
                    pv = self._codec.decode(msg.value(), expect=PolicyVersion)
                except DecodeError as exc:
                    log.error("undecodable record on %s: %s", msg.topic(), exc.reason)
                    continue
                fut = asyncio.run_coroutine_threadsafe(self._update(pv), self._loop)
                with contextlib.suppress(Exception):
                    fut.result()
        except Exception:
            log.exception("policy watcher stopped")
        finally:
            if consumer is not None:
                consumer.close()

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
