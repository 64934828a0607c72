"""The I/O edge of delivery: a small producer protocol, its confluent-kafka implementation and an
in-memory one (with fault injection) for unit tests.

``produce`` hands one message over and returns at once (``BufferError`` when the client's buffer
is full); ``on_delivery(err, msg)`` is called later from ``poll``/``flush`` with ``err`` None
when the message was acknowledged, else the client's own error object, which ``describe`` turns
into a ``DeliveryError`` (the callback goes straight to the client: no adapter per message on
the hot path); ``msg`` is the client's message object (opaque).
``purge`` fails every message not yet acknowledged. ``reachable`` answers whether the topic's
partitions have leaders right now. ``delivered`` reads a topic from a timestamp on and tells
which of the given record digests (``spool.record_digest``) are already there; None when it
cannot tell.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rollstream.producers.sdk.spool import record_digest

__all__ = [
    "DeliveryError",
    "KafkaTransport",
    "MemoryMessage",
    "MemoryTransport",
    "OnDelivery",
    "Transport",
]

log = logging.getLogger("rollstream.producers")


@dataclass(frozen=True, slots=True)
class DeliveryError:
    """Why a message was not acknowledged. ``permanent``: retrying cannot help."""

    code: str
    message: str = ""
    permanent: bool = False


OnDelivery = Callable[[Any, Any], None]  # (None | the client's error, the client's message)


class Transport(Protocol):
    def produce(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        on_delivery: OnDelivery,
        *,
        timestamp_ms: int | None = None,
    ) -> None: ...

    def describe(self, err: Any) -> DeliveryError: ...

    def poll(self, timeout: float = 0.0) -> int: ...

    def flush(self, timeout: float) -> int: ...

    def purge(self) -> None: ...

    def reachable(self, topic: str, timeout: float) -> bool: ...

    def delivered(
        self, topic: str, since_ms: int, digests: set[bytes], timeout: float
    ) -> set[bytes] | None: ...

    def close(self) -> None: ...


# --- confluent-kafka ------------------------------------------------------------------------

_PERMANENT = frozenset(
    {
        "MSG_SIZE_TOO_LARGE",
        "_MSG_SIZE_TOO_LARGE",
        "INVALID_MSG_SIZE",
        "INVALID_RECORD",
        "RECORD_LIST_TOO_LARGE",
        "TOPIC_AUTHORIZATION_FAILED",
        "CLUSTER_AUTHORIZATION_FAILED",
        "INVALID_TOPIC_EXCEPTION",
        "UNSUPPORTED_FOR_MESSAGE_FORMAT",
        "_INVALID_ARG",
        "_KEY_SERIALIZATION",
        "_VALUE_SERIALIZATION",
    }
)


_QUIET = frozenset({"_TRANSPORT", "_ALL_BROKERS_DOWN", "_RESOLVE", "_TIMED_OUT", "_MSG_TIMED_OUT"})


class _ClientLog:
    """librdkafka's own log lines (it retries a lost connection many times a second) go to
    DEBUG on ``rollstream.producers.kafka``; errors that matter reach ``error_cb``."""

    _log = logging.getLogger("rollstream.producers.kafka")

    def log(self, level: int, msg: str, *args: Any) -> None:
        self._log.debug(msg, *args)


_CLIENT_LOG = _ClientLog()


def _error(err: Any) -> DeliveryError:
    name = err.name()
    return DeliveryError(name, err.str(), permanent=name in _PERMANENT)


class KafkaTransport:
    """confluent-kafka Producer. ``connection``: bootstrap and security settings (also used by
    the consumer of ``delivered``); ``options``: producer settings (idempotence, acks, ...)."""

    def __init__(self, connection: dict[str, Any], options: dict[str, Any] | None = None) -> None:
        from confluent_kafka import KafkaException

        self._kafka_exception = KafkaException
        self._connection = dict(connection)
        self._options = dict(options or {})
        self._fatal: str | None = None
        self._producer = self._new_producer()

    def _new_producer(self) -> Any:
        from confluent_kafka import Producer

        conf = {
            **self._connection,
            **self._options,
            "error_cb": self._on_error,
            "logger": _CLIENT_LOG,
            "log.connection.close": False,
        }
        return Producer(conf)

    def _on_error(self, err: Any) -> None:
        if err.fatal():
            self._fatal = err.str()
            log.error("Kafka producer fatal error (a new producer will be made): %s", err.str())
        elif err.name() in _QUIET:  # the delivery thread says it once, in its own words
            log.debug("Kafka client: %s", err.str())
        else:
            log.warning("Kafka client error: %s", err.str())

    def produce(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        on_delivery: OnDelivery,
        *,
        timestamp_ms: int | None = None,
    ) -> None:
        try:
            self._producer.produce(
                topic, value, key, on_delivery=on_delivery, timestamp=timestamp_ms or 0
            )
        except self._kafka_exception as exc:
            on_delivery(exc.args[0], None)

    def describe(self, err: Any) -> DeliveryError:
        return _error(err)

    def poll(self, timeout: float = 0.0) -> int:
        return int(self._producer.poll(timeout))

    def flush(self, timeout: float) -> int:
        return int(self._producer.flush(timeout))

    def purge(self) -> None:
        self._producer.purge(in_queue=True, in_flight=True, blocking=True)
        self._producer.poll(0)

    def reachable(self, topic: str, timeout: float) -> bool:
        from confluent_kafka import KafkaException

        if self._fatal is not None:
            self._producer.purge(in_queue=True, in_flight=True, blocking=True)
            self._producer.poll(0)
            self._producer = self._new_producer()
            self._fatal = None
        try:
            md = self._producer.list_topics(topic, timeout=timeout)
        except KafkaException:
            return False
        t = md.topics.get(topic)
        if t is None or t.error is not None:
            log.warning("topic %s is not available: %s", topic, None if t is None else t.error)
            return False
        return bool(t.partitions) and all(
            p.leader >= 0 and p.error is None for p in t.partitions.values()
        )

    def delivered(
        self, topic: str, since_ms: int, digests: set[bytes], timeout: float
    ) -> set[bytes] | None:
        from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

        consumer = Consumer(
            {
                **self._connection,
                "group.id": f"rollstream-spool-check-{os.getpid()}",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "earliest",
                "logger": _CLIENT_LOG,
            }
        )
        deadline = time.monotonic() + timeout
        found: set[bytes] = set()
        try:
            md = consumer.list_topics(topic, timeout=timeout)
            parts = list(md.topics[topic].partitions)
            wanted = [TopicPartition(topic, p, since_ms) for p in parts]
            starts = consumer.offsets_for_times(wanted, timeout=timeout)
            ends: dict[int, int] = {}
            assign = []
            for tp in starts:
                if tp.error is not None or tp.offset < 0:
                    continue  # no record at or after since_ms in this partition
                _, high = consumer.get_watermark_offsets(
                    TopicPartition(topic, tp.partition), timeout=timeout
                )
                if tp.offset < high:
                    ends[tp.partition] = high
                    assign.append(TopicPartition(topic, tp.partition, tp.offset))
            if not assign:
                return found
            consumer.assign(assign)
            while ends and time.monotonic() < deadline:
                for msg in consumer.consume(1000, 0.5):
                    err, part, offset = msg.error(), msg.partition(), msg.offset()
                    if part is None:
                        continue
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            ends.pop(part, None)
                        continue
                    digest = record_digest(topic, msg.key() or b"", msg.value() or b"")
                    if digest in digests:
                        found.add(digest)
                    if offset is not None and offset >= ends.get(part, 0) - 1:
                        ends.pop(part, None)
            return None if ends else found
        except (KafkaException, KeyError) as exc:
            log.warning("could not read %s back to check spooled events: %s", topic, exc)
            return None
        finally:
            consumer.close()

    def close(self) -> None:
        self._producer.flush(0)


# --- in memory ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemoryMessage:
    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes
    timestamp_ms: int


@dataclass(slots=True)
class _Pending:
    topic: str
    key: bytes
    value: bytes
    timestamp_ms: int
    on_delivery: OnDelivery
    t: float
    persisted: bool = False


class MemoryTransport:
    """An in-memory broker + idempotent client, for unit tests.

    ``available = False`` is a broker outage: messages wait (and time out after
    ``message_timeout_s``) and ``reachable`` says no. ``fail_next(n)`` fails the next n
    deliveries, each with the messages after it in its partition (as librdkafka does).
    ``persist_in_flight`` writes the waiting messages to the log without acknowledging them
    (a broker that died before answering)."""

    def __init__(
        self, *, partitions: int = 6, capacity: int = 100_000, message_timeout_s: float = 300.0
    ) -> None:
        self.partitions = partitions
        self.capacity = capacity
        self.message_timeout_s = message_timeout_s
        self.available = True
        self.readable = True  # False: ``delivered`` cannot tell (e.g. no read permission)
        self.produced = 0
        self._lock = threading.Lock()
        self._pending: deque[_Pending] = deque()
        self._reports: deque[tuple[OnDelivery, DeliveryError | None]] = deque()
        self._fail: deque[DeliveryError] = deque()
        self._log: dict[str, list[list[MemoryMessage]]] = {}

    # fault injection and inspection
    def fail_next(self, n: int, error: DeliveryError | None = None) -> None:
        with self._lock:
            self._fail.extend([error or DeliveryError("_TRANSPORT", "injected")] * n)

    def persist_in_flight(self) -> None:
        with self._lock:
            for p in self._pending:
                if not p.persisted:
                    self._append(p)
                    p.persisted = True

    def messages(self, topic: str) -> list[MemoryMessage]:
        """Every message of ``topic``, partition by partition, in offset order."""
        with self._lock:
            return [m for part in self._log.get(topic, []) for m in part]

    def _append(self, p: _Pending) -> None:
        parts = self._log.setdefault(p.topic, [[] for _ in range(self.partitions)])
        n = zlib.crc32(p.key) % self.partitions
        parts[n].append(MemoryMessage(p.topic, n, len(parts[n]), p.key, p.value, p.timestamp_ms))

    # Transport
    def produce(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        on_delivery: OnDelivery,
        *,
        timestamp_ms: int | None = None,
    ) -> None:
        with self._lock:
            if len(self._pending) >= self.capacity:
                raise BufferError("MemoryTransport buffer full")
            ts = timestamp_ms or int(time.time() * 1000)
            self._pending.append(_Pending(topic, key, value, ts, on_delivery, time.monotonic()))
            self.produced += 1

    def poll(self, timeout: float = 0.0) -> int:
        with self._lock:
            now = time.monotonic()
            keep: deque[_Pending] = deque()
            failed: dict[int, DeliveryError] = {}  # like librdkafka: a partition fails in order
            while self._pending:
                p = self._pending.popleft()
                if self.available:
                    part = zlib.crc32(p.key) % self.partitions
                    if self._fail and part not in failed:
                        err = self._fail.popleft()
                        if err.permanent:  # only this message is bad
                            self._reports.append((p.on_delivery, err))
                            continue
                        failed[part] = err
                    if part in failed:
                        self._reports.append((p.on_delivery, failed[part]))
                        continue
                    if not p.persisted:
                        self._append(p)  # idempotent: a persisted retry is not written twice
                    self._reports.append((p.on_delivery, None))
                elif now - p.t >= self.message_timeout_s:
                    self._reports.append(
                        (p.on_delivery, DeliveryError("_MSG_TIMED_OUT", "message timed out"))
                    )
                else:
                    keep.append(p)
            self._pending = keep
            reports = list(self._reports)
            self._reports.clear()
        for callback, report in reports:
            callback(report, None)
        if not reports and timeout > 0:
            time.sleep(min(timeout, 0.002))
        return len(reports)

    def flush(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            self.poll(0.001)
            with self._lock:
                left = len(self._pending)
            if left == 0 or time.monotonic() >= deadline:
                return left

    def purge(self) -> None:
        with self._lock:
            while self._pending:
                p = self._pending.popleft()
                self._reports.append((p.on_delivery, DeliveryError("_PURGE_QUEUE", "purged")))

    def describe(self, err: Any) -> DeliveryError:
        return err  # this transport's errors are DeliveryErrors

    def reachable(self, topic: str, timeout: float) -> bool:
        return self.available

    def delivered(
        self, topic: str, since_ms: int, digests: set[bytes], timeout: float
    ) -> set[bytes] | None:
        if not (self.available and self.readable):
            return None
        return {
            d
            for m in self.messages(topic)
            if m.timestamp_ms >= since_ms and (d := record_digest(topic, m.key, m.value)) in digests
        }

    def close(self) -> None:
        return None
