"""The stream processor (faust worker, ``rollstream process``) on the real broker:
events in, samples out with the ids the pure core computes; SIGKILL mid-stream loses nothing;
poison records go to the DLQ with the reason in headers and the stream keeps going."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _processor_process import GROUP_TIMEOUT_S, Worker, reading, sample_ids
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
from rollstream.streams.app import group_route
from rollstream.streams.core import (
    GroupClosed,
    GroupConfig,
    GroupState,
    add_to_group,
    expire_group,
    replay,
)

pytestmark = pytest.mark.integration

codec = Codec()


# --- events and what the pure core makes of them ----------------------------------------------


def make_rollout(
    rng: np.random.Generator,
    rollout_id: str,
    group_id: str,
    *,
    group_size: int | None,
    turns: int = 3,
    reward: float | None = None,
) -> list[Event]:
    events: list[Event] = []
    ts0 = time.time_ns() // 1000

    def add(body: Any) -> None:
        seq = len(events)
        events.append(Event(f"{rollout_id}-{seq:04d}", rollout_id, seq, ts0 + seq, body, "it"))

    add(RolloutStarted(task_id=f"task-{group_id}", group_id=group_id, group_size=group_size))
    parent, prefix = None, 0
    for turn in range(turns):
        call = f"{rollout_id}-c{turn}"
        delta = rng.integers(0, 1000, 40, dtype=np.uint32)
        completion = rng.integers(0, 1000, 16, dtype=np.uint32)
        logprobs = -rng.random(16, dtype=np.float32)
        add(LlmCall(call, parent, prefix, delta, completion, logprobs))
        parent, prefix = call, prefix + 56
    add(Reward(float(rng.random()) if reward is None else reward))
    add(RolloutFinished())
    return events


def make_groups(
    rng: np.random.Generator, tag: str, groups: int, size: int, **kw: Any
) -> list[list[Event]]:
    return [
        make_rollout(rng, f"{tag}-g{g}-r{r}", f"{tag}-g{g}", group_size=size, **kw)
        for g in range(groups)
        for r in range(size)
    ]


def interleave(rollouts: list[list[Event]]) -> list[Event]:
    """Round-robin over the rollouts (in order within each), so many are open at once."""
    out: list[Event] = []
    for i in range(max(len(r) for r in rollouts)):
        out += [r[i] for r in rollouts if i < len(r)]
    return out


def expected_samples(events: list[Event]) -> dict[str, Sample]:
    """What an uninterrupted run makes: core replay + group aggregation (timeout groups closed
    with what they have)."""
    _, outputs = replay(events)
    config = GroupConfig(timeout_us=int(GROUP_TIMEOUT_S * 1e6))
    groups: dict[str, GroupState] = {}
    samples: dict[str, Sample] = {}
    for trajectory in outputs:
        if not isinstance(trajectory, Trajectory):
            continue  # an Invalid: the DLQ's
        state, closed = add_to_group(groups.get(trajectory.group_id), trajectory, config)
        groups[trajectory.group_id] = state
        for out in closed:
            assert isinstance(out, GroupClosed)
            samples.update((s.sample_id, s) for s in out.samples)
    for state in groups.values():
        for out in expire_group(state, 1 << 62, config)[1]:
            assert isinstance(out, GroupClosed)
            samples.update((s.sample_id, s) for s in out.samples)
    return samples


# --- Kafka edges ----------------------------------------------------------------------------


@pytest.fixture
def worker(kafka_settings: CommonSettings, tmp_path: Path) -> Iterator[Worker]:
    w = Worker(kafka_settings, tmp_path)
    yield w
    w.stop()


def produce(settings: CommonSettings, records: list[tuple[bytes | None, bytes]]) -> list[int]:
    """Produce (key, value) records to the events topic; returns their offsets."""
    producer = Producer({**settings.kafka_config(), "linger.ms": 5})
    offsets: list[int] = [-1] * len(records)

    def delivered(i: int) -> Any:
        def cb(err: Any, msg: Any) -> None:
            assert err is None, err
            offsets[i] = msg.offset()

        return cb

    for i, (key, value) in enumerate(records):
        producer.produce(settings.topics().events, key=key, value=value, on_delivery=delivered(i))
        producer.poll(0)
    assert producer.flush(30) == 0
    return offsets


def event_records(events: list[Event]) -> list[tuple[bytes | None, bytes]]:
    return [(e.rollout_id.encode(), codec.encode(e)) for e in events]


# --- tests ----------------------------------------------------------------------------------


def test_events_become_the_samples_the_core_computes(
    kafka_settings: CommonSettings, worker: Worker
) -> None:
    rng = np.random.default_rng(1)
    rollouts = make_groups(rng, "full", groups=4, size=3)
    rollouts += make_groups(rng, "flat", groups=1, size=3, reward=1.0)  # zero variance: dropped
    rollouts += make_groups(rng, "tout", groups=1, size=2)
    for events in rollouts[-2:]:  # no group_size: the group closes on its timeout
        assert isinstance(events[0].body, RolloutStarted)
        events[0].body.group_size = None
    events = interleave(rollouts)
    expected = expected_samples(events)
    assert len(expected) == 4 * 3 + 2  # one path sample per rollout; the flat group has none
    duplicates = events[5:40:7]  # re-sent events are ignored

    topics = kafka_settings.topics()
    with (
        reading(kafka_settings, topics.samples) as samples,
        reading(kafka_settings, topics.trajectories) as trajectories,
    ):
        produce(kafka_settings, event_records(events + duplicates))
        worker.start()
        samples.wait(lambda rs: len(rs) > 0, 15, worker)  # first output within 15 s of start
        samples.wait(lambda rs: sample_ids(rs) >= set(expected), 60, worker)
        time.sleep(1.0)  # nothing more comes
        got = [codec.decode(m.value(), expect=Sample) for m in samples.records]
        built = [(m, codec.decode(m.value(), expect=Trajectory)) for m in trajectories.records]
    assert sorted(s.sample_id for s in got) == sorted(expected)  # each once: no duplicates
    for sample in got:
        want = expected[sample.sample_id]
        assert sample == want
    assert {m.key() for m in samples.records} == {s.group_id.encode() for s in got}
    # trajectories: key rollout_id, on their group's partition (where the aggregator reads
    # them), which is where the group's samples went too
    assert len(built) == len(rollouts)
    route = group_route(6)  # the contract's trajectories topic: 6 partitions
    assert {m.key() for m, _ in built} == {t.rollout_id.encode() for _, t in built}
    assert {(m.partition(), t.group_id) for m, t in built} == {
        (route(t.group_id), t.group_id) for _, t in built
    }
    assert len({m.partition() for m, _ in built}) > 1
    for m in samples.records:
        assert m.partition() == route(m.key().decode())


def test_sigkill_mid_stream_loses_no_sample(kafka_settings: CommonSettings, tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    rollouts = make_groups(rng, "k", groups=24, size=4, turns=4)
    # waves of 4 groups: groups keep closing while 16 rollouts are open at any time
    events = [e for i in range(0, len(rollouts), 16) for e in interleave(rollouts[i : i + 16])]
    expected = set(expected_samples(events))
    records = event_records(events)
    batches = [records[i : i + 24] for i in range(0, len(records), 24)]
    topics = kafka_settings.topics()
    worker = Worker(kafka_settings, tmp_path, group_timeout_s="300")  # no timeout in this test

    def feed() -> None:
        for batch in batches:
            produce(kafka_settings, batch)
            time.sleep(0.2)

    worker.start()
    feeder = threading.Thread(target=feed, daemon=True)
    try:
        with (
            reading(kafka_settings, topics.samples) as samples,
            reading(kafka_settings, topics.dlq) as dlq,
        ):
            worker.wait_ready()
            feeder.start()
            samples.wait(lambda rs: len(rs) >= 8, 60, worker)  # some groups closed, not all
            worker.kill()
            assert feeder.is_alive(), "the events were all produced before the kill"
            worker.start()
            feeder.join(60)
            samples.wait(lambda rs: sample_ids(rs) >= expected, 90, worker)
            worker.kill()  # a second crash, after recovery: nothing lost or invented either
            worker.start()
            time.sleep(2.0)
            assert sample_ids(samples.records) == expected
            assert dlq.records == []
    finally:
        worker.stop()


def test_poison_records_go_to_the_dlq_and_the_stream_keeps_going(
    kafka_settings: CommonSettings, worker: Worker
) -> None:
    rng = np.random.default_rng(3)
    topics = kafka_settings.topics()
    garbage = b"\x00not an avro record"
    nan_reward = make_rollout(rng, "bad-r0", "bad-g0", group_size=2, reward=float("nan"))
    bad_reward = nan_reward[-2]
    assert isinstance(bad_reward.body, Reward)
    partner = make_rollout(rng, "bad-r1", "bad-g0", group_size=2, reward=1.0)
    call = LlmCall(
        "c0",
        None,
        0,
        np.arange(4, dtype=np.uint32),
        np.arange(2, dtype=np.uint32),
        np.zeros(2, np.float32),
    )
    headless = Event("hl-0", "bad-hl", 0, time.time_ns() // 1000, call, "it")  # seq 0 not a start
    good = interleave(make_groups(rng, "good", groups=2, size=2))
    poison = [*nan_reward, headless, *partner]
    expected = expected_samples(poison + good)
    assert any(s.rollout_id == "bad-r0" for s in expected.values())

    worker.start()
    with (
        reading(kafka_settings, topics.samples) as samples,
        reading(kafka_settings, topics.dlq) as dlq,
    ):
        offsets = produce(kafka_settings, [(b"junk", garbage), *event_records(poison)])
        produce(kafka_settings, event_records(good))  # later rollouts still make samples
        samples.wait(lambda rs: sample_ids(rs) >= set(expected), 60, worker)
        dlq.wait(lambda rs: len(rs) >= 3, 30, worker)
        time.sleep(0.5)
        headers = [read_headers(m.headers()) for m in dlq.records]
        assert sample_ids(samples.records) == set(expected)
    by_code = {h["code"]: (h, m) for h, m in zip(headers, dlq.records, strict=True)}
    assert len(headers) == 3 and set(by_code) == {"undecodable", "bad_reward", "not_started"}
    h, m = by_code["undecodable"]
    assert (m.key(), m.value()) == (b"junk", garbage)
    assert (h["original_topic"], int(h["original_offset"])) == (topics.events, offsets[0])
    assert h["stage"] == "builder" and h["reason"]
    assert h["processor"] == f"{kafka_settings.namespace}.rollstream-processor-v1"
    h, m = by_code["bad_reward"]
    assert (m.key(), m.value()) == (b"bad-r0", codec.encode(bad_reward))
    assert "reward value nan" in h["reason"]
    assert int(h["original_offset"]) == offsets[1 + nan_reward.index(bad_reward)]
    h, m = by_code["not_started"]
    assert m.value() == codec.encode(headless) and "not RolloutStarted" in h["reason"]
