"""Settings of the harness SDK (``RecorderSettings``, ROLLSTREAM_ prefix; documented in
docs/configuration.md) and the librdkafka producer options built from them."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from rollstream.schemas import CommonSettings

__all__ = ["RecorderSettings", "kafka_producer_options"]


class RecorderSettings(CommonSettings):
    """Settings of the harness SDK (ROLLSTREAM_ prefix, see docs/configuration.md)."""

    producer: str = Field(default_factory=lambda: f"sdk@{socket.gethostname()}")  # Event.producer
    queue_size: int = 10_000  # events held in memory before new ones go to the spool
    spool_dir: Path | None = Path(".rollstream/spool")  # where events wait while Kafka is down
    spool_fsync: Literal["always", "interval", "never"] = "interval"  # when the spool fsyncs
    spool_fsync_interval_ms: int = 200  # with spool_fsync=interval
    spool_segment_bytes: int = 64 << 20  # spool file size before the next segment
    # past it new events are dropped (counted, on_drop) and the proxy answers 503 (accepting)
    spool_max_bytes: int = Field(1 << 30, ge=1 << 16, le=1 << 40)  # undelivered bytes held
    linger_ms: float = 5.0  # librdkafka linger.ms
    batch_size: int = 1_000_000  # librdkafka batch.size (bytes)
    # zstd: events are kept for good (replay) and token IDs compress well; the broker's CPU per
    # event drops with its bytes; costs CPU in librdkafka's own threads (off the GIL)
    compression: Literal["none", "lz4", "zstd", "snappy", "gzip"] = "zstd"  # compression.type
    message_timeout_ms: int = 300_000  # a message not acknowledged by then is spooled again
    max_message_bytes: int = 16_000_000  # librdkafka message.max.bytes
    client_buffer_kbytes: int = 262_144  # librdkafka queue.buffering.max.kbytes
    degrade_after_s: float = 10.0  # nothing acknowledged this long: spool until Kafka is back
    probe_interval_s: float = 1.0  # how often a degraded recorder checks for Kafka
    close_timeout_s: float = 30.0  # close() delivers for this long, then spools the rest
    max_tool_result_chars: int = 65_536  # longer tool results are cut (result_truncated)
    producer_options: dict[str, str] = Field(default_factory=dict)  # extra librdkafka settings


def kafka_producer_options(settings: RecorderSettings) -> dict[str, Any]:
    """librdkafka producer settings for the SDK (idempotent, acks=all, generous timeout)."""
    return {
        "enable.idempotence": True,
        "acks": "all",
        "max.in.flight.requests.per.connection": 5,
        "linger.ms": settings.linger_ms,
        "batch.size": settings.batch_size,
        "compression.type": settings.compression,
        "message.timeout.ms": settings.message_timeout_ms,
        "message.max.bytes": settings.max_message_bytes,
        "queue.buffering.max.kbytes": settings.client_buffer_kbytes,
        "queue.buffering.max.messages": max(100_000, settings.queue_size),
        "reconnect.backoff.ms": 100,
        "reconnect.backoff.max.ms": 1000,
        "retry.backoff.ms": 100,
        "retry.backoff.max.ms": 1000,
        "client.id": settings.producer,
        **settings.producer_options,
    }
