"""The trainer's policy topic: each committed checkpoint's ``PolicyVersion``, published after
the commit (acks=all, flushed), and the version a crash left unpublished found at the next start.

    PolicyPublisher(settings, codec, stop_wait, stopping)
        .publish(ckpt) -> bool              delivered; not delivered: TrainerError, or False
                                            once a stop is asked (a restart publishes it)
        .publish_missing(latest)            the latest checkpoint's version, if the topic's
                                            last record is older (a crash between commit
                                            and publish)
        .close(wait, latest)                deliver what is queued within ``wait`` s (None:
                                            ``train_publish_timeout_s``), log what is left
    last_published_version(settings) -> int | None    the highest version among the last
                                            record of each policy-topic partition

``stop_wait()`` and ``stopping()`` are the trainer's: seconds left for the broker after a stop
(None while not stopping; the first call after a stop starts that budget), and whether a stop
was asked. Every flush here is cut to ``stop_wait()``, so a stop is seen within 0.5 s.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

from rollstream.adapters.codecs import build_codec
from rollstream.consumers.errors import TrainerError
from rollstream.consumers.training.checkpoint import Checkpoint
from rollstream.consumers.training.dataset import close_producer
from rollstream.consumers.training.settings import TrainerSettings
from rollstream.schemas import Codec, CommonSettings, DecodeError, PolicyVersion

__all__ = ["PolicyPublisher", "last_published_version"]

log = logging.getLogger("rollstream.trainer")


class PolicyPublisher:
    """The trainer's PolicyVersion producer (idempotent, acks=all, no linger)."""

    def __init__(
        self,
        settings: TrainerSettings,
        codec: Codec,
        stop_wait: Callable[[], float | None],
        *,
        stopping: Callable[[], bool],
    ) -> None:
        self.settings = settings
        self.codec = codec
        self.topic = settings.topics().policy
        self.stop_wait = stop_wait
        self.stopping = stopping
        self.producer = Producer(
            {**settings.kafka_config(), "enable.idempotence": True, "acks": "all", "linger.ms": 0}
        )

    def publish(self, ckpt: Checkpoint) -> bool:
        """Publish the checkpoint's PolicyVersion (acks=all, flushed). Not delivered: raises
        TrainerError, or once a stop is asked logs it and returns False; then the caller does
        not commit the group's offsets either (a commit the broker does not answer holds the
        consumer's close for its session timeout; those offsets are for lag only)."""
        meta = ckpt.meta
        record = PolicyVersion(
            version=meta.policy_version,
            checkpoint_uri=str(ckpt.model_dir.resolve()),
            trainer_step=meta.step,
            ts=time.time_ns() // 1000,
            samples_trained=meta.samples_trained,
            metrics=dict(meta.metrics),
        )
        errors: list[str] = []

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                errors.append(str(err))

        self.producer.produce(self.topic, value=self.codec.encode(record), on_delivery=delivered)
        left = self._flush(self.settings.train_publish_timeout_s)
        if not (left or errors):
            return True
        what = (
            f"PolicyVersion {meta.policy_version} not published to {self.topic}: "
            f"{errors or 'flush timed out'} (checkpoint {ckpt.path} is committed; a restart "
            "publishes it)"
        )
        if not self.stopping():
            raise TrainerError(what)
        log.warning("stopping: %s", what)  # not an error: the next start publishes it
        return False

    def _flush(self, timeout: float) -> int:
        """Flush for up to ``timeout`` s, or what ``stop_wait`` leaves once a stop is asked
        (before or during the flush); the records left."""
        deadline = time.monotonic() + timeout
        left = len(self.producer)
        while left:
            wait = deadline - time.monotonic()
            stop_wait = self.stop_wait()
            wait = wait if stop_wait is None else min(wait, stop_wait)
            if wait <= 0:
                break
            left = self.producer.flush(min(wait, 0.5))  # slices: a SIGTERM is seen within 0.5 s
        return left

    def publish_missing(self, latest: Checkpoint | None) -> None:
        """Publish the latest checkpoint's PolicyVersion if a crash came before it was."""
        if latest is None:
            return
        last = last_published_version(self.settings)
        if last is None or last < latest.meta.policy_version:
            log.info("publishing PolicyVersion %d (missing)", latest.meta.policy_version)
            self.publish(latest)

    def close(self, wait: float | None, latest: Checkpoint | None) -> None:
        """Deliver what is queued: for ``train_publish_timeout_s`` when ``wait`` is None, else
        for ``wait`` s, logging a PolicyVersion left undelivered (the next start publishes
        the committed version)."""
        if wait is None:
            close_producer(self.producer, self.settings.train_publish_timeout_s)
            return
        left = self.producer.flush(wait)
        if left and latest is not None:
            log.warning(
                "stopping: PolicyVersion %d not delivered to %s (checkpoint %s is "
                "committed: the next start publishes it)",
                latest.meta.policy_version,
                self.topic,
                latest.path,
            )
        close_producer(self.producer, 0.0)


def last_published_version(settings: CommonSettings, timeout: float = 10.0) -> int | None:
    """The highest version among the last record of each policy-topic partition."""
    topic = settings.topics().policy
    consumer = Consumer(
        {
            **settings.kafka_config(),
            "group.id": f"rollstream-policy-probe-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
        }
    )
    codec = build_codec(settings)
    try:
        meta = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        if meta is None or meta.error is not None:
            return None
        wanted = {}
        for p in meta.partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)
            if high > low:
                wanted[p] = high - 1
        if not wanted:
            return None
        consumer.assign([TopicPartition(topic, p, o) for p, o in wanted.items()])
        best: int | None = None
        deadline = time.monotonic() + timeout
        while wanted and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            if wanted.get(msg.partition()) == msg.offset():
                del wanted[msg.partition()]
                try:
                    record = codec.decode(msg.value(), expect=PolicyVersion)
                except DecodeError:
                    continue
                best = record.version if best is None else max(best, record.version)
        return best
    finally:
        consumer.close()
