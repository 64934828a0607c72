"""The sink's dead letters: a record that cannot be stored goes to ``Topics(ns).dlq`` unchanged
(same key, same value bytes) with the headers of the one dead-letter contract,
``rollstream.schemas.dlq.dlq_headers``: stage ``sink``, processor the sink's consumer group,
kind the record type that could not be mapped ("" when it could not be decoded), code
``undecodable`` or ``unmappable`` (the row mapper refused it: workers.py decides both) or
``rejected`` (ClickHouse refused its row).

Sending is asynchronous (an idempotent producer, acks=all). ``finish()`` waits until every
record sent so far is acknowledged and raises ``DeadLetterError`` if one was not: the sink
calls it before committing offsets, so a record is never skipped without its dead letter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from confluent_kafka import KafkaError, Message, Producer

from rollstream.consumers.errors import DeadLetterError
from rollstream.consumers.store.settings import SinkSettings
from rollstream.schemas.dlq import dlq_headers

__all__ = ["CODE_REJECTED", "STAGE", "DeadLetters"]

log = logging.getLogger(__name__)

STAGE = "sink"
CODE_REJECTED = "rejected"  # mapped, but ClickHouse refused its row (a non-retryable insert)


class DeadLetters:
    """The dead-letter producer of one sink (module docstring). ``sent`` counts the records
    handed to the producer; ``send`` is called by the writer thread, ``finish`` by the loop."""

    def __init__(self, settings: SinkSettings) -> None:
        self.topic = settings.topics().dlq
        self.processor = settings.group_id
        self.sent = 0
        self._errors: list[str] = []
        self._producer = Producer(
            {
                **settings.kafka_config(),
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "message.max.bytes": 20_000_000,
            }
        )

    def _delivered(self, err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            self._errors.append(str(err))

    def send(self, msg: Message, *, reason: str, code: str, kind: str) -> None:
        """Send the consumed record ``msg`` to the DLQ (asynchronously)."""
        partition, offset = msg.partition(), msg.offset()
        headers = dlq_headers(
            reason=reason,
            code=code,
            kind=kind,
            topic=msg.topic() or "",
            partition=-1 if partition is None else partition,
            offset=-1 if offset is None else offset,
            stage=STAGE,
            processor=self.processor,
        )
        while True:
            try:
                self._producer.produce(
                    self.topic, value=msg.value(), key=msg.key(), headers=headers,
                    on_delivery=self._delivered,
                )  # fmt: skip
                break
            except BufferError:
                self._producer.poll(0.1)
        self.sent += 1
        log.warning(
            "dead-lettered %s[%s]@%s (%s): %s", msg.topic(), partition, offset, code, reason
        )

    def finish(
        self,
        timeout: float = 30.0,
        *,
        stopping: Callable[[], bool] = lambda: False,
        stop_wait: float = 5.0,
    ) -> None:
        """Wait until every dead letter sent so far is acknowledged; DeadLetterError if one
        was not (or ``timeout`` passed). ``stopping()`` is asked every 0.5 s: once it is true,
        the wait ends within ``stop_wait`` s (a stop during a long wait shortens it)."""
        if self.sent == 0:
            return
        deadline = time.monotonic() + timeout
        cut = False
        left = len(self._producer)
        while left:
            now = time.monotonic()
            if not cut and stopping():
                cut, deadline = True, min(deadline, now + stop_wait)
            if now >= deadline:
                break
            left = self._producer.flush(min(deadline - now, 0.5))
        if left or self._errors:
            errors, self._errors = self._errors, []
            raise DeadLetterError(
                f"dead-letter records not delivered ({left} pending): {errors[:3]}"
            )

    def close(self, timeout: float = 10.0) -> None:
        self._producer.flush(timeout)
