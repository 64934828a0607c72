"""The whole loop, short: `rollstream demo` with a few steps against the session's broker.
Asserts that it closed: samples trained, new policy versions published and served, and LlmCalls
recorded under a new policy version; that its rollouts ran through the rollout service (jobs
on the queue, INIT / RUN / EVAL by the stage workers, the demo's agent and evaluator); and that
its console stayed quiet (library chatter in the log files)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from _kafka_read import read_topic

from rollstream.infra.kafka import KafkaBroker
from rollstream.schemas import (
    Codec,
    CommonSettings,
    LlmCall,
    PolicyVersion,
    Reward,
    RewardKind,
    RolloutFinished,
    RolloutStarted,
    StageEvent,
)

pytestmark = pytest.mark.e2e


def _read_all(bootstrap: str, topic: str) -> list[bytes]:
    return [m.value() for m in read_topic({"bootstrap.servers": bootstrap}, topic)]


def test_short_demo_closes_the_loop(kafka: KafkaBroker, tmp_path: Path) -> None:
    namespace = f"e2e{uuid.uuid4().hex[:6]}"
    env = {
        **os.environ,
        "ROLLSTREAM_HOME": str(tmp_path / "home"),
        "ROLLSTREAM_KAFKA_BOOTSTRAP": kafka.bootstrap,
        "ROLLSTREAM_NAMESPACE": namespace,
        "ROLLSTREAM_DEMO_STEPS": "2",
        "ROLLSTREAM_DEMO_TASKS": "2",
        "ROLLSTREAM_DEMO_GROUP_SIZE": "4",
        "ROLLSTREAM_DEMO_TOKEN_BUDGET": "1024",
        "ROLLSTREAM_DEMO_MAX_MINUTES": "6",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "rollstream.infra.cli", "demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    console = proc.stdout + proc.stderr  # progress, tables, warnings: no library chatter
    assert "HTTP Request" not in console and len(console.splitlines()) < 100, console[-3000:]
    logs = tmp_path / "home" / namespace / "logs"
    assert "HTTP Request" in (logs / "demo.log").read_text()  # library chatter: the log file
    assert "/chat/completions" in (logs / "workers.log").read_text()  # the agent: the workers
    assert (tmp_path / "home" / "demo-reward.png").stat().st_size > 1000

    topics = CommonSettings(namespace=namespace).topics()
    codec = Codec()
    versions = [
        codec.decode(v, expect=PolicyVersion) for v in _read_all(kafka.bootstrap, topics.policy)
    ]
    assert [v.version for v in versions][:2] == [1, 2]
    assert all(v.samples_trained > 0 for v in versions)
    events = [codec.decode(v) for v in _read_all(kafka.bootstrap, topics.events)]
    calls = [ev.body for ev in events if isinstance(ev.body, LlmCall)]
    assert calls and max(c.policy_version for c in calls) >= 1  # a new policy was served
    started = [ev.body for ev in events if isinstance(ev.body, RolloutStarted)]
    assert started and all(
        s.harness == "python:rollstream.infra.demo.agent:run_agent"
        and s.metadata["job_id"].startswith(namespace)
        and s.metadata["sandbox"] == "local"
        for s in started
    )
    done = {
        (ev.body.stage, ev.body.status)
        for ev in events
        if isinstance(ev.body, StageEvent) and ev.body.phase == "finished"
    }
    assert {("init", "ok"), ("run", "ok"), ("eval", "ok")} <= done
    finals = [
        ev.body for ev in events if isinstance(ev.body, Reward) and ev.body.kind == RewardKind.FINAL
    ]
    assert finals and {f.evaluator for f in finals} == {
        "python:rollstream.infra.demo.evaluator:score_answers"
    }
    finished = [ev.body for ev in events if isinstance(ev.body, RolloutFinished)]
    assert len(finished) == len(started)  # every rollout of every round ended
    assert len(_read_all(kafka.bootstrap, topics.samples)) > 0
