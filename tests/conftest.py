"""Session fixtures: the real Apache Kafka broker (KRaft), started once per test session on free
ports in a temporary data dir, and per-test settings with their own topic namespace."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollstream.adapters.topics import ensure_topics
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port, resolve_classpath
from rollstream.schemas import CommonSettings


@pytest.fixture(scope="session")
def kafka_classpath() -> str:
    return resolve_classpath()


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory, kafka_classpath: str) -> Iterator[KafkaBroker]:
    data_dir: Path = tmp_path_factory.mktemp("kafka")
    broker = KafkaBroker(
        BrokerConfig(data_dir=data_dir, port=free_port(), controller_port=free_port()),
        classpath=kafka_classpath,
    )
    broker.start(timeout=120)
    yield broker
    broker.stop()


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def kafka_settings(kafka: KafkaBroker, namespace: str, tmp_path: Path) -> CommonSettings:
    """Settings pointing at the session broker, with a fresh namespace whose topics exist."""
    settings = CommonSettings(
        kafka_bootstrap=kafka.bootstrap, namespace=namespace, home=tmp_path / "home"
    )
    ensure_topics(settings)
    return settings
