"""A local Apache Kafka cluster: N KRaft nodes (broker + controller each, one JVM each) on one host.

``rollstream up --brokers 3`` runs one: node i (1..N) listens on ``port + 2(i-1)`` and its
controller on the port after it; its data lives under ``<home>/kafka-<i>``. Every node is a
voter of the controller quorum, all share one cluster id (read back from a formatted node's
``meta.properties``, else new), and the internal topics are replicated ``min(N, 3)`` times with
``min.insync.replicas`` = replication - 1 (2 of 3): with acks=all, an acknowledged record is on
two nodes, and one node may die without losing it or stopping producers.

Starting launches every node before waiting for any: a node answers metadata only once the
quorum has a leader, which needs a majority of the voters up.

    cluster_layout(data_root, host, port, n, heap=, java=) -> list[BrokerConfig]   pure
    KafkaCluster(configs).start() / stop() / kill(i) / restart(i) / bootstrap
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rollstream.infra.errors import BrokerStartError
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, new_cluster_id

__all__ = ["FAST_FAILOVER", "MAX_BROKERS", "KafkaCluster", "cluster_layout", "replication_of"]

MAX_BROKERS = 5  # the largest local cluster `rollstream up --brokers` starts
# Failure detection for a local cluster (Kafka's defaults are tuned for data centres: a dead
# node is fenced after 9 s, and acks=all waits on it until then): fenced after 3 s, a new
# controller elected within ~2 s.
FAST_FAILOVER = {
    "broker.heartbeat.interval.ms": "500",
    "broker.session.timeout.ms": "3000",
    "controller.quorum.fetch.timeout.ms": "2000",
    "controller.quorum.election.timeout.ms": "1000",
    "replica.lag.time.max.ms": "5000",
}
_CLUSTER_ID = re.compile(r"^cluster\.id=(\S+)$", re.MULTILINE)


def replication_of(brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) of a cluster of ``brokers`` nodes: up to 3
    copies, and every copy but one in sync for an acks=all write (1 node: 1 and 1)."""
    replication = max(1, min(brokers, 3))
    return replication, max(1, replication - 1)


def cluster_layout(
    data_root: Path, host: str, port: int, brokers: int, *, heap: str = "512m", java: str = "java"
) -> list[BrokerConfig]:
    """The node configs of a local cluster; ``cluster_id`` is left for ``KafkaCluster``."""
    if not 1 <= brokers <= MAX_BROKERS:
        raise ValueError(f"brokers must be 1..{MAX_BROKERS}, got {brokers}")
    voters = ",".join(f"{i}@{host}:{port + 2 * (i - 1) + 1}" for i in range(1, brokers + 1))
    replication, min_insync = replication_of(brokers)
    return [
        BrokerConfig(
            data_dir=data_root / f"kafka-{i}",
            host=host,
            port=port + 2 * (i - 1),
            controller_port=port + 2 * (i - 1) + 1,
            heap=heap,
            java=java,
            node_id=i,
            voters=voters,
            replication=replication,
            min_insync=min_insync,
            extra=dict(FAST_FAILOVER),
        )
        for i in range(1, brokers + 1)
    ]


def _formatted_id(config: BrokerConfig) -> str | None:
    meta = Path(config.data_dir).resolve() / "logs" / "meta.properties"
    try:
        found = _CLUSTER_ID.search(meta.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


class KafkaCluster:
    """The nodes of one local cluster. Like ``KafkaBroker``, safe to construct for a running
    cluster (each node reads its pid file)."""

    def __init__(self, configs: list[BrokerConfig], classpath: str | None = None) -> None:
        ids = {i for i in (_formatted_id(c) for c in configs) if i is not None}
        if len(ids) > 1:
            raise BrokerStartError(f"the nodes were formatted for different clusters: {ids}")
        cluster_id = ids.pop() if ids else new_cluster_id()
        for config in configs:
            config.cluster_id = cluster_id
        self.cluster_id = cluster_id
        self.brokers = [KafkaBroker(c, classpath) for c in configs]

    @property
    def bootstrap(self) -> str:
        """Every node's address: a client that knows them all survives any one's death."""
        return ",".join(b.bootstrap for b in self.brokers)

    def running(self) -> list[bool]:
        return [b.is_running() for b in self.brokers]

    def start(self, timeout: float = 180.0) -> KafkaCluster:
        """Start every node that is not running, then wait until each answers."""
        for broker in self.brokers:
            broker.start(timeout, wait=False)
        deadline = time.monotonic() + timeout
        with ThreadPoolExecutor(len(self.brokers)) as pool:
            waits = [
                pool.submit(b.wait_ready, max(deadline - time.monotonic(), 1.0))
                for b in self.brokers
            ]
            for w in waits:
                w.result()
        return self

    def restart(self, index: int, timeout: float = 120.0) -> None:
        """Start node ``index`` (0-based) again, e.g. after ``kill``; the others keep serving."""
        self.brokers[index].start(timeout)

    def kill(self, index: int) -> None:
        """SIGKILL node ``index`` (0-based): a crash, for fault tests."""
        self.brokers[index].kill()

    def stop(self, timeout: float = 30.0) -> None:
        with ThreadPoolExecutor(len(self.brokers)) as pool:
            list(pool.map(lambda b: b.stop(timeout), self.brokers))
