"""Replay on the real broker and chDB: events re-published from Kafka and from ClickHouse (through
the analytics server of a running sink) into another namespace are the same events, byte for
byte and in order per rollout; filters select whole rollouts; and the stream processors
(``rollstream process``) rebuild byte-identical samples from a replay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _kafka_read import read_topic
from _sink_process import (
    Committed,
    SinkProcess,
    ends_of,
    record_rollouts,
    wait_committed,
)

from rollstream.adapters.topics import ensure_topics
from rollstream.consumers.analytics.replay import ReplayError, ReplaySettings, run
from rollstream.schemas import Codec, CommonSettings, Event, RolloutStarted, Sample, Trajectory
from rollstream.streams.core import GroupClosed, add_to_group, replay

pytestmark = pytest.mark.integration

codec = Codec()


def by_rollout(messages: list[Any]) -> dict[bytes, list[bytes]]:
    """Values per key (rollout id), in the order they are in the topic."""
    out: dict[bytes, list[bytes]] = defaultdict(list)
    for msg in sorted(messages, key=lambda m: (m.partition(), m.offset())):
        out[msg.key()].append(msg.value())
    return dict(out)


def replay_into(source: CommonSettings, target: str, **kw: Any) -> Any:
    settings = ReplaySettings(
        kafka_bootstrap=source.kafka_bootstrap,
        namespace=source.namespace,
        replay_to=target,
        replay_progress=False,
        **kw,
    )
    return run(settings)


def in_namespace(settings: CommonSettings, namespace: str) -> CommonSettings:
    return settings.model_copy(update={"namespace": namespace})


@pytest.fixture
def sink(kafka_settings: CommonSettings, tmp_path: Path) -> Iterator[SinkProcess]:
    s = SinkProcess(kafka_settings, tmp_path, sink_topics='["events"]')
    s.start()
    yield s
    s.stop()


def stored(settings: CommonSettings, sink: SinkProcess) -> None:
    """Wait until the sink has stored and committed everything in the events topic."""
    committed = Committed(settings)
    try:
        wait_committed(committed, ends_of(settings, [settings.topics().events]), sink, 90)
    finally:
        committed.close()


def test_replay_from_kafka_and_clickhouse_gives_the_same_events(
    kafka_settings: CommonSettings, tmp_path: Path, sink: SinkProcess
) -> None:
    t0 = time.time_ns() // 1000
    record_rollouts(kafka_settings, tmp_path, 12, seed=1, run_id="run-a", policy_version=1)
    t1 = time.time_ns() // 1000
    time.sleep(0.05)
    record_rollouts(kafka_settings, tmp_path, 8, seed=2, run_id="run-b", policy_version=2)
    original = by_rollout(read_topic(kafka_settings, kafka_settings.topics().events))
    assert len(original) == 20 and sum(map(len, original.values())) == 160
    sink.wait_ready()
    stored(kafka_settings, sink)

    ns = f"r{uuid.uuid4().hex[:8]}"
    result = replay_into(kafka_settings, f"{ns}k")
    assert (result.read, result.published) == (160, 160)
    from_kafka = by_rollout(
        read_topic(in_namespace(kafka_settings, f"{ns}k"), f"{ns}k.rollout.events")
    )
    assert from_kafka == original  # same bytes, same order per rollout, key = rollout_id

    result = replay_into(
        kafka_settings, f"{ns}c", replay_source="clickhouse", analytics_url=sink.url,
        replay_page_rollouts=7,
    )  # fmt: skip
    assert (result.published, result.rollouts_selected) == (160, 20)
    from_store = by_rollout(
        read_topic(in_namespace(kafka_settings, f"{ns}c"), f"{ns}c.rollout.events")
    )
    assert from_store == original  # re-encoded from the tables: the very same bytes

    starts = {key: codec.decode(values[0], expect=Event) for key, values in original.items()}
    assert all(isinstance(e.body, RolloutStarted) for e in starts.values())

    def expect(pred: Any) -> dict[bytes, list[bytes]]:
        return {k: v for k, v in original.items() if pred(starts[k])}

    cases: list[tuple[dict[str, Any], Any]] = [
        (
            {"replay_task_ids": ["task-1", "task-2"]},
            lambda e: e.body.task_id in ("task-1", "task-2"),
        ),
        ({"replay_run_ids": ["run-b"]}, lambda e: e.body.run_id == "run-b"),
        ({"replay_policy_versions": [1]}, lambda e: e.body.policy_version == 1),
        ({"replay_group_ids": ["g1-0", "g2-1"]}, lambda e: e.body.group_id in ("g1-0", "g2-1")),
        (
            {"replay_since": _utc(t0), "replay_until": _utc(t1)},
            lambda e: t0 <= e.ts < t1,
        ),
    ]
    for i, (filters, pred) in enumerate(cases):
        want = expect(pred)
        assert 0 < len(want) < len(original), filters
        for source in ("kafka", "clickhouse"):
            target = f"{ns}f{i}{source[0]}"
            extra = {"analytics_url": sink.url} if source == "clickhouse" else {}
            result = replay_into(kafka_settings, target, replay_source=source, **filters, **extra)
            got = by_rollout(
                read_topic(in_namespace(kafka_settings, target), f"{target}.rollout.events")
            )
            assert got == want, (source, filters)
            assert result.rollouts_selected == len(want)

    # a Kafka replay from given offsets only takes rollouts that start in range
    mid = {
        p: end // 2 + 1
        for (_, p), end in ends_of(kafka_settings, [kafka_settings.topics().events]).items()
    }
    result = replay_into(kafka_settings, f"{ns}o", replay_from_offsets=mid)
    got = by_rollout(read_topic(in_namespace(kafka_settings, f"{ns}o"), f"{ns}o.rollout.events"))
    assert got and all(original[k] == v for k, v in got.items())
    assert result.rollouts_skipped > 0

    with pytest.raises(ReplayError, match="differ"):
        replay_into(kafka_settings, kafka_settings.namespace)


def _utc(us: int) -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(us // 1_000_000)) + f".{us % 1_000_000:06d}Z"
    )


# --- byte-identical samples through the real stream processors ---------------------------------


class Processor:
    """``rollstream process`` for one namespace."""

    def __init__(self, settings: CommonSettings, tmp_path: Path) -> None:
        self.log_path = tmp_path / f"processor-{settings.namespace}.log"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")},
            "ROLLSTREAM_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "ROLLSTREAM_NAMESPACE": settings.namespace,
            "ROLLSTREAM_HOME": str(tmp_path / f"home-{settings.namespace}"),
            "ROLLSTREAM_PROC_TIMER_INTERVAL_S": "0.5",
        }
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollstream.infra.cli", "process"],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def samples_of(
    settings: CommonSettings, n: int, proc: Processor, timeout: float = 180
) -> dict[str, bytes]:
    """sample_id -> the sample's bytes, once the namespace's samples topic holds ``n``."""
    deadline = time.monotonic() + timeout
    while True:
        messages = read_topic(settings, settings.topics().samples)
        out = {codec.decode(m.value(), expect=Sample).sample_id: m.value() for m in messages}
        if len(out) >= n:
            return out
        assert proc.proc.poll() is None, proc.tail()
        assert time.monotonic() < deadline, f"{len(out)} of {n} samples\n{proc.tail()}"
        time.sleep(0.5)


def test_replayed_events_rebuild_byte_identical_samples(
    kafka_settings: CommonSettings, tmp_path: Path, sink: SinkProcess
) -> None:
    record_rollouts(kafka_settings, tmp_path, 16, seed=5)
    messages = read_topic(kafka_settings, kafka_settings.topics().events)
    events = sorted((codec.decode(m.value(), expect=Event) for m in messages),
                    key=lambda e: (e.rollout_id, e.seq))  # fmt: skip
    # what the pure core makes of them (the processors must agree, byte for byte)
    expected: dict[str, bytes] = {}
    groups: dict[str, Any] = {}
    for t in replay(events)[1]:
        assert isinstance(t, Trajectory)
        groups[t.group_id], outs = add_to_group(groups.get(t.group_id), t)
        for out in outs:
            assert isinstance(out, GroupClosed)
            expected.update((s.sample_id, codec.encode(s)) for s in out.samples)
    assert expected

    sink.wait_ready()
    stored(kafka_settings, sink)
    ns = f"r{uuid.uuid4().hex[:8]}"
    replay_into(kafka_settings, f"{ns}k")
    replay_into(kafka_settings, f"{ns}c", replay_source="clickhouse", analytics_url=sink.url)
    spaces = [kafka_settings, *(in_namespace(kafka_settings, f"{ns}{x}") for x in "kc")]
    for space in spaces[1:]:
        ensure_topics(space)
    processors = [Processor(space, tmp_path) for space in spaces]
    try:
        live, from_kafka, from_store = (
            samples_of(space, len(expected), proc)
            for space, proc in zip(spaces, processors, strict=True)
        )
    finally:
        for proc in processors:
            proc.stop()
    assert live == expected
    assert from_kafka == live
    assert from_store == live
