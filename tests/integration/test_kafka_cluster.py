"""A local 3-node KRaft cluster (``rollstream up --brokers 3``): its topics are replicated three
times with min.insync.replicas 2, and SIGKILLing a node while the SDK's producer settings write
(idempotent, acks=all) loses no acknowledged record, duplicates none, and writing goes on."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource

from rollstream.infra import stack
from rollstream.infra.cluster import cluster_layout, replication_of
from rollstream.infra.stack import StackSettings
from rollstream.producers.sdk.settings import RecorderSettings, kafka_producer_options

pytestmark = pytest.mark.integration


def _free_run(n: int) -> int:
    """A base port with ``n`` free ports after it."""
    for base in range(31000, 60000, 97):
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port run")


def test_layout_gives_each_node_its_ports_and_one_quorum(tmp_path: Path) -> None:
    nodes = cluster_layout(tmp_path, "127.0.0.1", 9092, 3)
    assert [(n.node_id, n.port, n.controller_port) for n in nodes] == [
        (1, 9092, 9093),
        (2, 9094, 9095),
        (3, 9096, 9097),
    ]
    assert {n.voters for n in nodes} == {"1@127.0.0.1:9093,2@127.0.0.1:9095,3@127.0.0.1:9097"}
    assert replication_of(1) == (1, 1) and replication_of(3) == (3, 2)
    assert replication_of(5) == (3, 2) and replication_of(2) == (2, 1)
    with pytest.raises(ValueError, match="brokers must be"):
        cluster_layout(tmp_path, "127.0.0.1", 9092, 6)


def test_killing_a_node_loses_no_acknowledged_record(tmp_path: Path, kafka_classpath: str) -> None:
    base = _free_run(6)
    settings = StackSettings(
        home=tmp_path,
        kafka_bootstrap=f"127.0.0.1:{base}",
        kafka_brokers=3,
        kafka_heap="320m",
        namespace="ha",
    )
    cluster = stack.cluster_for(settings)
    assert cluster is not None
    try:
        created = stack.up(settings)
        topic = settings.topics().events
        assert topic in created
        admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
        meta = admin.list_topics(topic, timeout=10).topics[topic]
        assert {len(p.replicas) for p in meta.partitions.values()} == {3}
        config = admin.describe_configs([ConfigResource("topic", topic)])
        isr = next(iter(config.values())).result()["min.insync.replicas"].value
        assert isr == "2"

        acked: list[int] = []
        failed: list[str] = []
        stop = threading.Event()
        options = kafka_producer_options(RecorderSettings(linger_ms=5))
        producer = Producer({**options, "bootstrap.servers": cluster.bootstrap})

        def delivered(err: object, msg: object) -> None:
            if err is not None:
                failed.append(str(err))
            else:
                acked.append(int(msg.value()))  # type: ignore[attr-defined]

        def write() -> None:
            i = 0
            while not stop.is_set():
                producer.produce(topic, key=str(i % 50).encode(), value=str(i).encode(),
                                 on_delivery=delivered)  # fmt: skip
                producer.poll(0)
                i += 1
                time.sleep(0.002)
            producer.flush(60)

        writer = threading.Thread(target=write)
        writer.start()
        deadline = time.monotonic() + 30
        while len(acked) < 300 and time.monotonic() < deadline:
            time.sleep(0.1)
        before = len(acked)
        assert before >= 300, failed
        cluster.kill(0)  # node 1: the bootstrap address a single-address client would use
        deadline = time.monotonic() + 40
        while len(acked) < before + 300 and time.monotonic() < deadline:
            time.sleep(0.2)
        after_kill = len(acked)
        stop.set()
        writer.join(90)
        assert not failed, failed[:5]
        assert after_kill >= before + 300, "writing did not go on when one node of three died"

        consumer = Consumer(
            {"bootstrap.servers": cluster.bootstrap, "group.id": "ha-check",
             "auto.offset.reset": "earliest", "enable.auto.commit": False}
        )  # fmt: skip
        parts = admin.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        seen: list[int] = []
        deadline = time.monotonic() + 60
        while len(seen) < len(acked) and time.monotonic() < deadline:
            for msg in consumer.consume(1000, 1.0):
                if msg.error() is None:
                    seen.append(int(msg.value()))
        consumer.close()
        assert len(seen) == len(set(seen)), "a record was written twice"
        assert set(acked) <= set(seen), f"lost {len(set(acked) - set(seen))} acknowledged"
        assert cluster.running() == [False, True, True]
    finally:
        stack.down(settings)
    assert not any(cluster.running())
