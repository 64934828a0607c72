"""The batch job (streams/batch_job.py) against the faust processor on the real broker: one
recorded run (SDK rollouts, the golden logs, a group without a size, a poison record) in
namespace A; ``rollstream process`` makes A's samples, the batch job makes B's from A's events;
the encoded samples are equal as multisets keyed by sample_id (and land on the same
partitions), and so are the trajectories and the builder's dead letters."""

from __future__ import annotations

import json
import multiprocessing
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _kafka_read import read_topic
from _processor_process import Worker
from _sink_process import record_rollouts
from confluent_kafka import Producer

from rollstream.schemas import (
    Codec,
    CommonSettings,
    Event,
    LlmCall,
    Reward,
    RolloutFinished,
    RolloutStarted,
    Sample,
    Trajectory,
)
from rollstream.schemas.dlq import read_headers
from rollstream.streams.batch_job import BatchJobError, run_batch
from rollstream.streams.errors import ProcessorError
from rollstream.streams.settings import ProcessorSettings

pytestmark = pytest.mark.integration

codec = Codec()
# long enough that the faust worker gathers the whole group without a size even when the
# machine is slow to hand it the records of some partitions (its group clock gains wall time)
GROUP_TIMEOUT_S = 15.0
GOLDEN = Path(__file__).parent.parent / "fixtures" / "golden"


def golden_events(now_us: int) -> list[Event]:
    """Every golden log, stamped as if recorded now (one event a millisecond)."""
    events = []
    for path in sorted(GOLDEN.glob("*.events.jsonl")):
        events += [Event.from_json(json.loads(line)) for line in path.read_text().splitlines()]
    for i, event in enumerate(events):
        event.ts = now_us + i * 1000
    return events


def loose_group(now_us: int) -> list[Event]:
    """Three rollouts of a group without a size: it closes on the group timeout."""
    rng = np.random.default_rng(11)
    events = []
    for r in range(3):
        rid = f"loose-{r}"
        ids = rng.integers(0, 1000, 12, dtype=np.uint32)
        bodies: list[Any] = [
            RolloutStarted(task_id="loose", group_id="loose", group_size=None),
            LlmCall(f"{rid}-c0", None, 0, ids, ids[:4].copy(), -rng.random(4, dtype=np.float32)),
            Reward(float(r)),
            RolloutFinished(),
        ]
        events += [Event(f"{rid}-{s}", rid, s, now_us + s, b, "it") for s, b in enumerate(bodies)]
    return events


def produce(settings: CommonSettings, records: list[tuple[bytes, bytes]]) -> None:
    producer = Producer({**settings.kafka_config(), "enable.idempotence": True, "acks": "all"})
    for key, value in records:
        producer.produce(settings.topics().events, key=key, value=value)
    assert producer.flush(30) == 0


def by_id(messages: list[Any], kind: type[Any], field: str) -> dict[str, tuple[int, bytes]]:
    """id -> (partition, bytes); every copy of an id (at-least-once) must be the same."""
    found: dict[str, tuple[int, bytes]] = {}
    for m in messages:
        ident = getattr(codec.decode(m.value(), expect=kind), field)
        assert found.setdefault(ident, (m.partition(), m.value())) == (m.partition(), m.value())
    return found


def _sample(item: tuple[int, bytes]) -> Sample:
    sample: Sample = codec.decode(item[1], expect=Sample)
    return sample


def builder_dead_letters(messages: list[Any]) -> list[tuple[Any, ...]]:
    rows = []
    for m in messages:
        h = read_headers(m.headers())
        where = (h["original_topic"], h["original_partition"], h["original_offset"])
        rows.append((m.key(), m.value(), h["code"], h["reason"], h["stage"], *where))
    return sorted(rows)


def test_the_batch_job_writes_what_the_faust_processor_writes(
    kafka_settings: CommonSettings, tmp_path: Path
) -> None:
    a = kafka_settings
    record_rollouts(a, tmp_path, 16, seed=9)  # through the SDK: groups of 4
    now = time.time_ns() // 1000
    extra = golden_events(now) + loose_group(now + 100_000)
    produce(a, [(b"junk", b"\x00not a record")])
    produce(a, [(e.rollout_id.encode(), codec.encode(e)) for e in extra])
    events = read_topic(a, a.topics().events)

    b = ProcessorSettings(
        kafka_bootstrap=a.kafka_bootstrap,
        namespace=f"b{uuid.uuid4().hex[:8]}",
        home=tmp_path / "home-b",
        proc_group_timeout_s=GROUP_TIMEOUT_S,  # as the faust worker below
    )
    result = run_batch(a, b)
    batch_samples = by_id(read_topic(b, b.topics().samples), Sample, "sample_id")
    batch_trajectories = by_id(read_topic(b, b.topics().trajectories), Trajectory, "rollout_id")
    batch_dlq = builder_dead_letters(read_topic(b, b.topics().dlq))
    assert result["events"] == len(events) == 16 * 8 + len(extra) + 1
    assert result["written"]["samples"] == len(batch_samples) > 16
    assert len(batch_trajectories) == 16 + len({e.rollout_id for e in extra})
    assert {s.rollout_id for s in map(_sample, batch_samples.values())} >= {
        f"loose-{r}" for r in range(3)
    }
    assert result["counts"]["groups_expired_at_end"] == 1  # the group without a size

    # two worker processes (each reads and writes its share): the same records and counts
    c = b.model_copy(update={"namespace": f"c{uuid.uuid4().hex[:8]}", "home": tmp_path / "c"})
    parallel = run_batch(a, c, workers=2)
    assert parallel["counts"] == result["counts"] and parallel["written"] == result["written"]
    assert by_id(read_topic(c, c.topics().samples), Sample, "sample_id") == batch_samples
    assert by_id(read_topic(c, c.topics().trajectories), Trajectory, "rollout_id") == (
        batch_trajectories
    )
    assert builder_dead_letters(read_topic(c, c.topics().dlq)) == batch_dlq

    worker = Worker(a, tmp_path, group_timeout_s=str(GROUP_TIMEOUT_S))
    worker.start()
    try:
        deadline = time.monotonic() + 180
        while True:
            faust_samples = by_id(read_topic(a, a.topics().samples), Sample, "sample_id")
            if set(faust_samples) >= set(batch_samples):
                break
            assert time.monotonic() < deadline, worker.log_tail()
            assert worker.proc is not None and worker.proc.poll() is None, worker.log_tail()
            time.sleep(0.5)
        time.sleep(3.0)  # nothing more comes
        faust_samples = by_id(read_topic(a, a.topics().samples), Sample, "sample_id")
        faust_trajectories = by_id(read_topic(a, a.topics().trajectories), Trajectory, "rollout_id")
        faust_dlq = builder_dead_letters(read_topic(a, a.topics().dlq))
    finally:
        worker.stop()
    assert faust_samples == batch_samples  # same bytes, same partitions
    assert faust_trajectories == batch_trajectories
    assert len(faust_dlq) == len(batch_dlq) == 6  # the poison record, the invalid golden log
    assert faust_dlq == batch_dlq  # same record, reason, stage (builder) and source offset


@pytest.mark.parametrize("workers", [1, 2])
def test_a_record_the_target_refuses_fails_the_job_and_its_workers(
    kafka_settings: CommonSettings, tmp_path: Path, workers: int
) -> None:
    now = time.time_ns() // 1000
    events = []
    for r in range(8):  # rollouts on several partitions, each trajectory over 1,000 bytes
        rid, ids = f"big-{r}", np.arange(400, dtype=np.uint32)
        bodies: list[Any] = [
            RolloutStarted(task_id="big", group_id=f"big-{r}", group_size=1),
            LlmCall(f"{rid}-c0", None, 0, ids, ids[:8].copy(), np.zeros(8, np.float32)),
            Reward(1.0),
            RolloutFinished(),
        ]
        events += [Event(f"{rid}-{s}", rid, s, now + s, b, "it") for s, b in enumerate(bodies)]
    produce(kafka_settings, [(e.rollout_id.encode(), codec.encode(e)) for e in events])
    small = ProcessorSettings(
        kafka_bootstrap=kafka_settings.kafka_bootstrap,
        namespace=f"s{uuid.uuid4().hex[:8]}",
        home=tmp_path / "home",
        proc_max_message_bytes=1000,  # librdkafka's least message.max.bytes
    )
    with pytest.raises(ProcessorError, match=r"cannot write a record to .*too large"):
        run_batch(kafka_settings, small, workers=workers)
    assert multiprocessing.active_children() == []  # no worker left behind


def test_the_target_must_be_another_namespace(kafka_settings: CommonSettings) -> None:
    same = ProcessorSettings(
        kafka_bootstrap=kafka_settings.kafka_bootstrap, namespace=kafka_settings.namespace
    )
    with pytest.raises(BatchJobError, match="differ"):
        run_batch(kafka_settings, same)
