"""The chaos run's fixtures: a Kafka broker of its own (free ports, its own data dir), so
SIGKILLing and restarting it hurts no other test; the run's length from the environment.

The integration tests' helpers (``_logged_process``, ``_kafka_read``) are shared: tests/ is on
sys.path through the root conftest, tests/integration is put there for this directory."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port

ROUNDS_ENV = "ROLLSTREAM_CHAOS_ROUNDS"
MAX_ROUNDS = 50


@pytest.fixture
def chaos_rounds() -> int:
    """Rounds of kills: each round SIGKILLs every component once (1: the short form)."""
    raw = os.environ.get(ROUNDS_ENV, "1")
    rounds = int(raw)
    if not 1 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"{ROUNDS_ENV}={raw}: expected 1..{MAX_ROUNDS}")
    return rounds


@pytest.fixture
def private_broker(tmp_path: Path, kafka_classpath: str) -> Iterator[KafkaBroker]:
    """A single-node KRaft broker for this run only, on fixed free ports so it can be
    SIGKILLed and started again on the same data dir and address."""
    broker = KafkaBroker(
        BrokerConfig(data_dir=tmp_path / "kafka", port=free_port(), controller_port=free_port()),
        classpath=kafka_classpath,
    )
    broker.start(timeout=120)
    try:
        yield broker
    finally:
        broker.stop()
