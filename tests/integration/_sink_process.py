"""Helpers of the sink, replay and report integration tests: the sink (``rollstream sink``) as a
subprocess (so it can be SIGKILLed and so the chDB path is held by another process, as in
production), SDK rollouts, and Kafka reads of topics and of the sink group's commits."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from _logged_process import LoggedProcess
from confluent_kafka import Consumer, Producer, TopicPartition

from rollstream.consumers.analytics.client import AnalyticsClient
from rollstream.infra.kafka import free_port
from rollstream.producers.sdk.recorder import Recorder, RecorderSettings
from rollstream.schemas import CommonSettings


class SinkProcess(LoggedProcess):
    """``rollstream sink -v`` on its own chDB path and analytics port, configured by the
    environment only."""

    def __init__(self, settings: CommonSettings, tmp_path: Path, **env: str) -> None:
        self.port = free_port()
        self.chdb_path = tmp_path / "chdb"
        super().__init__(
            ["sink", "-v"], settings, tmp_path, "sink.log",  # -v: every insert and commit
            {
                "ROLLSTREAM_CLICKHOUSE_URL": f"chdb://{self.chdb_path}",
                "ROLLSTREAM_ANALYTICS_PORT": str(self.port),
                "ROLLSTREAM_SINK_INSTANCE_ID": f"it-sink-{settings.namespace}",
                "ROLLSTREAM_SINK_LOG_LEVEL": "debug",
                "ROLLSTREAM_SINK_STATS_INTERVAL_S": "5",
                **{f"ROLLSTREAM_{k.upper()}": v for k, v in env.items()},
            },
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> AnalyticsClient:
        return AnalyticsClient(self.url)

    def wait_ready(self, timeout: float = 90.0, *, assigned: bool = True) -> None:
        """Until the sink started last serves analytics and (``assigned``) owns partitions."""
        deadline = time.monotonic() + timeout
        want = "assigned [" if assigned else "sink ready"
        while want not in self.current_log():
            assert self.proc is not None and self.proc.poll() is None, self.log_tail()
            assert time.monotonic() < deadline, self.log_tail()
            time.sleep(0.05)

    def killed_mid_batch(self) -> int:
        """Runs (all but the current one) killed with a batch in flight: its last insert not
        followed by a commit, or its last commit an intent whose batch was not committed."""
        runs = re.split(r"===== start \d+ =====", self.log_path.read_text(errors="replace"))
        count = 0
        for run in runs[1:-1]:
            inserted = run.rfind(" inserted ")
            committed = run.rfind(" committed ")
            intent = committed >= 0 and "rollstream-sink:end=" in run[committed:].split("\n")[0]
            count += inserted > committed or intent
        return count


def record_rollouts(
    settings: CommonSettings,
    tmp_path: Path,
    n: int,
    *,
    seed: int = 0,
    pace_s: float = 0.0,
    run_id: str = "",
    policy_version: int = 0,
) -> None:
    """n rollouts through the SDK (8 events each: start, two LLM calls, a tool call, a branch,
    an error, a reward, finish) in groups of 4, over tasks task-0..task-4."""
    rng = np.random.default_rng(seed)
    rec = Recorder(
        RecorderSettings(
            kafka_bootstrap=settings.kafka_bootstrap,
            namespace=settings.namespace,
            spool_dir=tmp_path / f"spool-{seed}",
        )
    )
    try:
        for i in range(n):
            with rec.rollout(
                task_id=f"task-{i // 4 % 5}", group_id=f"g{seed}-{i // 4}", group_size=4,
                run_id=run_id, policy_version=policy_version,
            ) as r:  # fmt: skip
                prompt = rng.integers(0, 1000, 24)
                c1 = r.llm_call(prompt, rng.integers(0, 1000, 8), -rng.random(8), model="m")
                r.tool_call("bash", {"cmd": "ls"}, "ok", at_call_id=c1, duration_ms=3.0)
                prompt2 = np.concatenate([prompt, rng.integers(0, 1000, 16)])
                r.llm_call(prompt2, rng.integers(0, 1000, 8), -rng.random(8), model="m")
                r.branch("retry", source_call_id=c1)
                r.error("tool", "timeout", code=124)
                r.reward(float(i % 2))
            if pace_s:
                time.sleep(pace_s)
        assert rec.flush(60)
    finally:
        stats = rec.close()
    assert stats.dropped == 0 and stats.failed == 0, stats


def ends_of(settings: CommonSettings, topics: list[str]) -> dict[tuple[str, int], int]:
    consumer = Consumer({**settings.kafka_config(), "group.id": "it-ends"})
    try:
        out = {}
        for topic in topics:
            for p in consumer.list_topics(topic, timeout=10).topics[topic].partitions:
                tp = TopicPartition(topic, p)
                out[(topic, p)] = consumer.get_watermark_offsets(tp, timeout=10)[1]
        return out
    finally:
        consumer.close()


class Committed:
    """Reads the sink group's committed offsets (without joining the group)."""

    def __init__(self, settings: CommonSettings) -> None:
        self.consumer = Consumer(
            {
                **settings.kafka_config(),
                "group.id": settings.topics().name("rollstream-sink-v1"),
                "enable.auto.commit": False,
            }
        )

    def __call__(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        tps = self.consumer.committed([TopicPartition(t, p) for t, p in keys], timeout=10)
        return {(tp.topic, tp.partition): max(tp.offset, 0) for tp in tps}

    def close(self) -> None:
        self.consumer.close()


def wait_committed(
    committed: Committed, ends: dict[tuple[str, int], int], sink: SinkProcess, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        now = committed(list(ends))
        if all(now[k] >= end for k, end in ends.items()):
            return
        assert sink.proc is not None and sink.proc.poll() is None, sink.log_tail()
        assert time.monotonic() < deadline, f"committed {now} != ends {ends}\n{sink.log_tail()}"
        time.sleep(0.2)


def produce(
    settings: CommonSettings, topic: str, records: Sequence[tuple[bytes | None, bytes]]
) -> None:
    producer = Producer({**settings.kafka_config(), "enable.idempotence": True})
    for key, value in records:
        producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0
