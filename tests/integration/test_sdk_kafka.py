"""The harness SDK against the real Kafka broker: concurrency, a SIGKILLed broker, the spool."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _kafka_read import read_topic

from rollstream.adapters.topics import ensure_topics
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port
from rollstream.producers import Recorder, RecorderSettings
from rollstream.schemas import Codec, CommonSettings, Event

pytestmark = pytest.mark.integration

codec = Codec()


def sdk_settings(common: CommonSettings, tmp_path: Path, **kw: object) -> RecorderSettings:
    return RecorderSettings(
        **common.model_dump(),
        spool_dir=tmp_path / "spool",
        producer="it",
        **kw,
    )


def consume_all(settings: CommonSettings, timeout: float = 120.0) -> list[Event]:
    """Every record of the events topic, up to the high watermarks at call time."""
    out: list[Event] = []
    for msg in read_topic(settings, settings.topics().events, timeout):
        event = codec.decode(msg.value())
        assert msg.key() == event.rollout_id.encode()
        out.append(event)
    return out


def assert_exactly_once_in_order(events: list[Event], expected: int) -> None:
    ids = [e.event_id for e in events]
    dupes = len(ids) - len(set(ids))
    assert dupes == 0, f"{dupes} duplicates"
    assert len(events) == expected, f"{len(events)} events, expected {expected}"
    seqs: dict[str, list[int]] = defaultdict(list)
    for e in events:  # consumed partition by partition in offset order
        seqs[e.rollout_id].append(e.seq)
    for rollout_id, got in seqs.items():
        assert got == list(range(len(got))), f"{rollout_id} out of order: {got[:30]}"


def run_rollouts(
    recorder: Recorder, n_rollouts: int, events_each: int, *, pace: float = 0.0, threads: int = 10
) -> None:
    """``n_rollouts`` rollouts of ``events_each`` events (start, calls, rewards, finish)."""
    rng = np.random.default_rng(0)

    def one(i: int) -> None:
        with recorder.rollout(task_id=f"task{i}", group_id=f"g{i % 10}") as r:
            convo = rng.integers(0, 50_000, 200, dtype=np.uint32)
            for j in range(events_each - 2):
                if j % 4 == 0:
                    completion = rng.integers(0, 50_000, 20, dtype=np.uint32)
                    r.llm_call(convo, completion, np.full(20, -0.5, np.float32))
                    convo = np.concatenate((convo, completion, convo[:10]))
                else:
                    r.reward(float(j), "partial")
                if pace:
                    time.sleep(pace)

    def worker(ids: list[int]) -> None:
        for i in ids:
            one(i)

    chunks = [list(range(n_rollouts))[k::threads] for k in range(threads)]
    pool = [threading.Thread(target=worker, args=(c,)) for c in chunks if c]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def test_10k_events_from_100_concurrent_rollouts(
    kafka_settings: CommonSettings, tmp_path: Path
) -> None:
    recorder = Recorder(sdk_settings(kafka_settings, tmp_path, degrade_after_s=120))
    run_rollouts(recorder, 100, 100, threads=100)
    assert recorder.flush(60)
    stats = recorder.close()
    assert (stats.sent, stats.spooled, stats.dropped, stats.failed) == (10_000, 0, 0, 0)
    assert_exactly_once_in_order(consume_all(kafka_settings), 10_000)


def test_events_to_topics_created_a_moment_ago_all_arrive(
    kafka: KafkaBroker, namespace: str, tmp_path: Path
) -> None:
    """The recorder starts the instant CreateTopics returns, before the new partitions have
    settled (leaders moving in, NOT_LEADER / UNKNOWN_TOPIC answers): every event still arrives
    exactly once and in order, and flush() means it."""
    from confluent_kafka.admin import AdminClient, NewTopic

    for trial in range(3):
        common = CommonSettings(kafka_bootstrap=kafka.bootstrap, namespace=f"{namespace}n{trial}")
        admin = AdminClient(common.kafka_config())
        for future in admin.create_topics([NewTopic(common.topics().events, 6, 1)]).values():
            future.result(30)
        recorder = Recorder(sdk_settings(common, tmp_path / str(trial), degrade_after_s=120))
        run_rollouts(recorder, 20, 5, threads=4)
        assert recorder.flush(60)
        stats = recorder.close()
        assert (stats.sent, stats.spooled, stats.dropped, stats.failed) == (100, 0, 0, 0)
        assert_exactly_once_in_order(consume_all(common), 100)


@pytest.fixture
def own_broker(tmp_path: Path, kafka_classpath: str) -> Iterator[KafkaBroker]:
    """A broker of this test's own (killing it leaves the session broker alone)."""
    broker = KafkaBroker(
        BrokerConfig(data_dir=tmp_path / "kafka", port=free_port(), controller_port=free_port()),
        classpath=kafka_classpath,
    )
    broker.start(timeout=120)
    yield broker
    broker.stop()


def test_broker_sigkill_mid_run_every_event_arrives_once(
    own_broker: KafkaBroker, tmp_path: Path
) -> None:
    """20,000 events; the broker is SIGKILLed mid-run and restarted: librdkafka's idempotent
    retries (plus the spool if the restart is slow) deliver each event exactly once."""
    common = CommonSettings(kafka_bootstrap=own_broker.bootstrap, namespace="kill")
    ensure_topics(common)
    recorder = Recorder(sdk_settings(common, tmp_path, degrade_after_s=60))
    writer = threading.Thread(target=run_rollouts, args=(recorder, 50, 400), kwargs={"pace": 0.002})
    writer.start()
    while recorder.stats.submitted < 8_000:
        time.sleep(0.05)
    own_broker.kill()
    time.sleep(2.0)
    own_broker.start(timeout=120)
    writer.join()
    assert recorder.flush(180), recorder.stats
    stats = recorder.close()
    print(stats)
    assert stats.submitted == 20_000 and stats.dropped == 0 and stats.failed == 0
    assert_exactly_once_in_order(consume_all(common), 20_000)


def test_long_outage_spools_and_a_new_recorder_drains_it(
    own_broker: KafkaBroker, tmp_path: Path
) -> None:
    """The broker dies mid-run and stays down: events spool; the recorder is closed (what the
    client still held is purged into the spool, flagged uncertain); the broker comes back and a
    NEW recorder drains the spool file: every event exactly once, in order."""
    common = CommonSettings(kafka_bootstrap=own_broker.bootstrap, namespace="down")
    ensure_topics(common)
    settings = sdk_settings(common, tmp_path, degrade_after_s=1.0, probe_interval_s=0.5)
    first = Recorder(settings)
    writer = threading.Thread(target=run_rollouts, args=(first, 50, 400), kwargs={"pace": 0.002})
    writer.start()
    while first.stats.submitted < 8_000:
        time.sleep(0.05)
    own_broker.kill()
    writer.join()
    deadline = time.monotonic() + 60
    while first.stats.state != "degraded":  # nothing acknowledged for degrade_after_s
        assert time.monotonic() < deadline, first.stats
        time.sleep(0.1)
    stats = first.close(timeout=2.0)
    assert stats.spooled > 0 and stats.dropped == 0 and stats.failed == 0
    assert stats.sent < 20_000
    own_broker.start(timeout=120)
    second = Recorder(settings)
    assert second.flush(180), second.stats
    again = second.close()
    print(stats, again)
    assert again.sent + again.deduplicated + stats.sent == 20_000
    assert_exactly_once_in_order(consume_all(common), 20_000)
