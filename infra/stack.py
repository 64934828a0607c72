"""The local stack: the Kafka broker under ``<home>/kafka`` plus the topics of the namespace.

``StackSettings`` is the settings class of the stack deployable (``rollstream up/down/status``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollstream.adapters.topics import TopicState, describe_topics, ensure_topics
from rollstream.infra.kafka import BrokerConfig, KafkaBroker
from rollstream.schemas import CommonSettings

__all__ = ["StackSettings", "StackStatus", "broker_for", "down", "status", "up"]


class StackSettings(CommonSettings):
    """Local stack. The broker listens on the host/port of ``kafka_bootstrap`` unless
    ``kafka_port`` is set; the KRaft controller on ``kafka_controller_port`` (default port+1)."""

    kafka_port: int | None = None  # broker port (default: the port of KAFKA_BOOTSTRAP)
    kafka_controller_port: int | None = None  # KRaft controller port (default: port + 1)
    kafka_heap: str = "768m"  # JVM heap of the broker
    java: str = "java"  # the Java 17+ executable
    start_timeout: float = 120.0  # seconds to wait for the broker to answer metadata

    def broker_config(self) -> BrokerConfig:
        host, _, port_text = self.kafka_bootstrap.split(",")[0].rpartition(":")
        port = self.kafka_port or int(port_text)
        return BrokerConfig(
            data_dir=self.home / "kafka",
            host=host or "127.0.0.1",
            port=port,
            controller_port=self.kafka_controller_port or port + 1,
            heap=self.kafka_heap,
            java=self.java,
        )


def broker_for(settings: StackSettings) -> KafkaBroker:
    return KafkaBroker(settings.broker_config())


@dataclass(frozen=True, slots=True)
class StackStatus:
    running: bool
    ready: bool
    pid: int | None
    bootstrap: str
    data_dir: Path
    log_file: Path
    topics: list[TopicState]


def up(settings: StackSettings) -> list[str]:
    """Start the broker (if not running) and create missing topics; returns topics created."""
    broker = broker_for(settings)
    if broker.is_running() or not broker.is_ready(timeout=1.0):
        broker.start(timeout=settings.start_timeout)
    # else: a broker we did not start already serves this address (a shared or CI broker): use it
    return ensure_topics(settings)


def down(settings: StackSettings) -> bool:
    """Stop the broker; returns whether one was running. Data stays under ``home``."""
    broker = broker_for(settings)
    was_running = broker.is_running()
    broker.stop()
    return was_running


def status(settings: StackSettings) -> StackStatus:
    broker = broker_for(settings)
    pid = broker.pid()
    ready = pid is not None and broker.is_ready()
    topics = describe_topics(settings) if ready else []
    return StackStatus(
        pid is not None, ready, pid, broker.bootstrap, broker.data_dir, broker.log_file, topics
    )
