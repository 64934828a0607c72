"""The local stack: the Kafka broker under ``<home>/kafka`` plus the topics of the namespace.

With ``kafka_brokers`` > 1 (``rollstream up --brokers 3``) a local KRaft cluster instead
(infra/cluster.py: nodes under ``<home>/kafka-<i>``, on ``port``, ``port + 2``, ...), whose
topics are created replicated (3 copies, min.insync.replicas 2 for three nodes or more).

``StackSettings`` is the settings class of the stack deployable (``rollstream up/down/status``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from rollstream.adapters.topics import TopicState, describe_topics, ensure_topics
from rollstream.infra.cluster import MAX_BROKERS, KafkaCluster, cluster_layout, replication_of
from rollstream.infra.kafka import BrokerConfig, KafkaBroker
from rollstream.schemas import CommonSettings

__all__ = ["StackSettings", "StackStatus", "broker_for", "cluster_for", "down", "status", "up"]


class StackSettings(CommonSettings):
    """Local stack. The broker listens on the host/port of ``kafka_bootstrap`` unless
    ``kafka_port`` is set; the KRaft controller on ``kafka_controller_port`` (default port+1)."""

    kafka_port: int | None = None  # broker port (default: the port of KAFKA_BOOTSTRAP)
    kafka_controller_port: int | None = None  # KRaft controller port (default: port + 1)
    kafka_heap: str = "768m"  # JVM heap of the broker
    java: str = "java"  # the Java 17+ executable
    start_timeout: float = 120.0  # seconds to wait for the broker to answer metadata
    kafka_brokers: int = Field(1, ge=1, le=MAX_BROKERS)  # >1: a local KRaft cluster (--brokers)

    def _address(self) -> tuple[str, int]:
        host, _, port_text = self.kafka_bootstrap.split(",")[0].rpartition(":")
        return host or "127.0.0.1", self.kafka_port or int(port_text)

    def broker_config(self) -> BrokerConfig:
        host, port = self._address()
        return BrokerConfig(
            data_dir=self.home / "kafka",
            host=host,
            port=port,
            controller_port=self.kafka_controller_port or port + 1,
            heap=self.kafka_heap,
            java=self.java,
        )


def broker_for(settings: StackSettings) -> KafkaBroker:
    return KafkaBroker(settings.broker_config())


def cluster_for(settings: StackSettings) -> KafkaCluster | None:
    """The local cluster of ``kafka_brokers`` > 1 nodes, None for a single broker."""
    if settings.kafka_brokers == 1:
        return None
    host, port = settings._address()
    return KafkaCluster(
        cluster_layout(
            settings.home,
            host,
            port,
            settings.kafka_brokers,
            heap=settings.kafka_heap,
            java=settings.java,
        )
    )


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
    cluster = cluster_for(settings)
    if cluster is not None:
        cluster.start(timeout=settings.start_timeout)
        replication = max(settings.topic_replication, replication_of(settings.kafka_brokers)[0])
        update = {"kafka_bootstrap": cluster.bootstrap, "topic_replication": replication}
        return ensure_topics(settings.model_copy(update=update))
    broker = broker_for(settings)
    if broker.is_running() or not broker.is_ready(timeout=1.0):
        broker.start(timeout=settings.start_timeout)
    # else: a broker we did not start already serves this address (a shared or CI broker): use it
    return ensure_topics(settings)


def down(settings: StackSettings) -> bool:
    """Stop the broker; returns whether one was running. Data stays under ``home``."""
    cluster = cluster_for(settings)
    if cluster is not None:
        was = any(cluster.running())
        cluster.stop()
        return was
    broker = broker_for(settings)
    was_running = broker.is_running()
    broker.stop()
    return was_running


def status(settings: StackSettings) -> StackStatus:
    cluster = cluster_for(settings)
    if cluster is not None:  # shown as its first node, with every node's address
        first, running = cluster.brokers[0], all(cluster.running())
        ready = running and first.is_ready()
        every = settings.model_copy(update={"kafka_bootstrap": cluster.bootstrap})
        topics = describe_topics(every) if ready else []
        return StackStatus(
            running, ready, first.pid(), cluster.bootstrap, first.data_dir, first.log_file, topics
        )
    broker = broker_for(settings)
    pid = broker.pid()
    ready = pid is not None and broker.is_ready()
    topics = describe_topics(settings) if ready else []
    return StackStatus(
        pid is not None, ready, pid, broker.bootstrap, broker.data_dir, broker.log_file, topics
    )
