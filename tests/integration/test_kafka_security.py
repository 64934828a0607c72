"""Kafka with SASL/SCRAM-SHA-512 over TLS and ACLs (infra/kafka_security.py), on a local broker
configured that way: the SDK records a rollout with a harness credential through the usual
ROLLSTREAM_KAFKA_* settings; that credential can write rollout.events and nothing else (another
topic, reading, admin: refused by the broker); a wrong password, a plaintext client and a client
that does not trust the CA get nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _processor_process import Worker, reading, sample_ids
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from rollstream.adapters.topics import ensure_topics
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port
from rollstream.infra.kafka_security import BrokerSecurity, grant_harness, secure_config
from rollstream.producers import Recorder, RecorderSettings
from rollstream.schemas import Codec, CommonSettings, Event

pytestmark = pytest.mark.integration

NS = "sec"
HARNESS_PASSWORD = "harness-secret-0123456789"


@pytest.fixture(scope="module")
def secure(
    tmp_path_factory: pytest.TempPathFactory, kafka_classpath: str
) -> Iterator[tuple[KafkaBroker, BrokerSecurity]]:
    data = tmp_path_factory.mktemp("kafka-sec")
    sec = BrokerSecurity.create(data, "127.0.0.1", {"harness": HARNESS_PASSWORD})
    config = secure_config(
        BrokerConfig(data_dir=data / "broker", port=free_port(), controller_port=free_port()), sec
    )
    broker = KafkaBroker(config, classpath=kafka_classpath).start(timeout=120)
    try:
        yield broker, sec
    finally:
        broker.stop()


def settings_of(broker: KafkaBroker, sec: BrokerSecurity, user: str, cls: Any = CommonSettings,
                **kw: Any) -> Any:  # fmt: skip
    return cls(kafka_bootstrap=broker.bootstrap, namespace=NS, **sec.client_settings(user), **kw)


def errors_of(client_conf: dict[str, Any]) -> list[KafkaError]:
    seen: list[KafkaError] = []
    client_conf["error_cb"] = seen.append
    return seen


def test_a_harness_credential_can_only_produce_rollout_events(
    secure: tuple[KafkaBroker, BrokerSecurity], tmp_path: Path
) -> None:
    broker, sec = secure
    admin = settings_of(broker, sec, "admin")
    ensure_topics(admin)
    grant_harness(admin, "harness")
    topics = admin.topics()

    # the SDK with the harness credential: every event acknowledged (acks=all, idempotent)
    harness = settings_of(broker, sec, "harness", RecorderSettings, spool_dir=None)
    with Recorder(harness) as recorder:
        with recorder.rollout(task_id="t", group_id="g") as r:
            r.reward(1.0)
        assert recorder.flush(30)
        stats = recorder.stats
    assert (stats.sent, stats.dropped, stats.failed) == (stats.submitted, 0, 0) > (0, 0, 0)

    # the admin reads them back over the same encrypted, authenticated listener
    consumer = Consumer({**admin.kafka_config(), "group.id": "sec-admin-read",
                         "auto.offset.reset": "earliest"})  # fmt: skip
    consumer.subscribe([topics.events])
    events: list[Event] = []
    deadline = time.monotonic() + 30
    while len(events) < stats.sent and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            events.append(Codec().decode(msg.value(), expect=Event))
    consumer.close()
    assert len(events) == stats.sent and {e.rollout_id for e in events} == {r.rollout_id}

    # the same credential may not write another topic ...
    delivered: list[Any] = []
    producer = Producer(harness.kafka_config())
    producer.produce(topics.samples, b"x", on_delivery=lambda err, _msg: delivered.append(err))
    producer.flush(30)
    assert delivered and delivered[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    # ... nor read the one it writes ...
    reader = Consumer({**harness.kafka_config(), "group.id": "harness-read",
                       "auto.offset.reset": "earliest"})  # fmt: skip
    reader.assign([TopicPartition(topics.events, 0, 0)])
    msg = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        msg = reader.poll(0.5)
        if msg is not None:
            break
    reader.close()
    assert msg is not None and msg.error() is not None
    assert msg.error().code() in (KafkaError.TOPIC_AUTHORIZATION_FAILED,
                                  KafkaError.GROUP_AUTHORIZATION_FAILED)  # fmt: skip
    # ... nor administer the cluster
    harness_admin = AdminClient(harness.kafka_config())  # held: the future needs its handle
    future = harness_admin.delete_topics([topics.events])[topics.events]
    with pytest.raises(KafkaException) as err:
        future.result(30)
    assert err.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


@pytest.mark.parametrize(
    "change",
    ["wrong password", "plaintext", "untrusted CA"],
)
def test_clients_without_the_right_credentials_get_nothing(
    secure: tuple[KafkaBroker, BrokerSecurity], tmp_path: Path, change: str
) -> None:
    broker, sec = secure
    conf: dict[str, Any] = {"bootstrap.servers": broker.bootstrap, **sec.client("harness")}
    if change == "wrong password":
        conf["sasl.password"] = "not-the-password"
    elif change == "plaintext":
        conf = {"bootstrap.servers": broker.bootstrap}
    else:
        other = BrokerSecurity.create(tmp_path, "127.0.0.1", {})  # another CA
        conf["ssl.ca.location"] = str(other.tls.ca)
    seen = errors_of(conf)
    admin = AdminClient(conf)
    with pytest.raises(KafkaException):
        admin.list_topics(timeout=8)
    admin.poll(1)  # serves error_cb
    if change == "wrong password":
        assert any(e.code() == KafkaError._AUTHENTICATION for e in seen), seen
    elif change == "untrusted CA":
        assert any(e.code() == KafkaError._SSL for e in seen), seen


def test_the_processor_runs_over_sasl_ssl(
    secure: tuple[KafkaBroker, BrokerSecurity], tmp_path: Path
) -> None:
    """``rollstream process`` (faust / aiokafka) with the service's credential, fed by the SDK
    with the harness credential: a group of two rollouts becomes two samples."""
    broker, sec = secure
    admin = settings_of(broker, sec, "admin")
    ensure_topics(admin)
    grant_harness(admin, "harness")
    env = {f"ROLLSTREAM_{k.upper()}": str(v) for k, v in sec.client_settings("admin").items()}
    worker = Worker(admin, tmp_path, **{})
    worker.env.update(env)
    worker.start()
    try:
        worker.wait_ready(90)
        harness = settings_of(broker, sec, "harness", RecorderSettings, spool_dir=None)
        with reading(admin, admin.topics().samples) as reader, Recorder(harness) as recorder:
            for reward in (0.0, 1.0):
                with recorder.rollout(task_id="t", group_id="g-sec", group_size=2) as r:
                    r.llm_call([1, 2, 3], [4, 5], np.zeros(2, np.float32))
                    r.reward(reward)
            assert recorder.flush(30)
            reader.wait(lambda recs: len(recs) >= 2, 60, worker)
            assert len(sample_ids(reader.records)) == 2
    finally:
        worker.stop()
