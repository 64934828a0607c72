"""The local stack through the real CLI: up, status, topics, tail, down, up again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import Producer

from rollstream.infra.kafka import free_port
from rollstream.schemas import Codec, Event, RolloutStarted

pytestmark = pytest.mark.integration


def _cli(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollstream.infra.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_up_status_topics_tail_down_up_keeps_data(tmp_path: Path, kafka_classpath: str) -> None:
    port = free_port()
    env = {
        **os.environ,
        "ROLLSTREAM_HOME": str(tmp_path / "home"),
        "ROLLSTREAM_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}",
        "ROLLSTREAM_KAFKA_CONTROLLER_PORT": str(free_port()),
    }
    try:
        up = _cli(env, "up")
        assert up.returncode == 0, up.stderr
        assert "rollout.events" in up.stderr

        st = _cli(env, "status")
        assert st.returncode == 0, st.stderr
        assert "ready" in st.stderr and "rollout.events" in st.stdout

        codec = Codec()
        producer = Producer({"bootstrap.servers": f"127.0.0.1:{port}", "acks": "all"})
        for seq in range(3):
            ev = Event(
                event_id=f"e{seq}",
                rollout_id="r1",
                seq=seq,
                ts=seq,
                body=RolloutStarted(task_id="t", group_id="g"),
            )
            producer.produce("rollout.events", key=b"r1", value=codec.encode(ev))
        producer.produce("rollout.events", key=b"r1", value=b"not avro")
        assert producer.flush(30) == 0

        tail = _cli(env, "tail", "events", "--from-beginning", "--limit", "4", "--format", "json")
        assert tail.returncode == 0, tail.stderr
        lines = [json.loads(line) for line in tail.stdout.splitlines()]
        assert [rec.get("seq") for rec in lines[:3]] == [0, 1, 2]
        assert lines[0]["type"] == "RolloutStarted" and lines[0]["body"]["task_id"] == "t"
        assert "error" in lines[3] and lines[3]["raw_hex"] == b"not avro".hex()

        topics = _cli(env, "topics")
        assert topics.returncode == 0 and "rollout.events" in topics.stdout

        assert _cli(env, "down").returncode == 0
        assert _cli(env, "status").returncode == 1  # down: non-zero, says so
        assert _cli(env, "up").returncode == 0

        again = _cli(env, "tail", "events", "--from-beginning", "--limit", "3", "--format", "json")
        assert [json.loads(line)["event_id"] for line in again.stdout.splitlines()] == [
            "e0",
            "e1",
            "e2",
        ]
    finally:
        _cli(env, "down")
