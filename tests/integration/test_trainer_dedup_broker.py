"""The trainer on the real broker drops samples re-emitted after a processor crash (same
sample_id, new offset): within one run, across a restart (the window is in the checkpoint),
and only within ``train_dedup_window`` ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _kafka_read import read_topic
from confluent_kafka import Producer

from rollstream.consumers.training.checkpoint import CheckpointStore
from rollstream.consumers.training.trainer import TrainerSettings, TrainResult, run
from rollstream.inference.tinymodel import ensure_tiny_model
from rollstream.schemas import Codec, CommonSettings, PolicyVersion, Sample, SampleMode

pytestmark = pytest.mark.integration

codec = Codec()


def make_sample(i: int) -> Sample:
    """Sample ``s{i}``: the same bytes every time it is made (a processor's re-emission)."""
    rng = np.random.default_rng(i)
    mask = np.array([0] * 8 + [1] * 16, dtype=np.uint8)
    return Sample(
        sample_id=f"s{i}",
        rollout_id=f"r{i}",
        group_id=f"g{i // 4}",
        task_id="t",
        input_ids=rng.integers(3, 500, 24).astype(np.uint32),
        loss_mask=mask,
        behaviour_logprobs=(-rng.uniform(5.5, 7.0, 24) * mask).astype(np.float32),
        advantage=float(rng.normal()),
        reward=1.0,
        policy_version=0,
        mode=SampleMode.PATH,
        parent_indices=np.zeros(0, np.int32),
        loss_weight=0.5,
    )


def produce(settings: CommonSettings, ids: list[int], partitions: int = 2) -> list[tuple[int, int]]:
    """Samples ``s{i}`` for i in ``ids``, in order, spread over ``partitions``; their coords."""
    producer = Producer({**settings.kafka_config(), "acks": "all", "enable.idempotence": True})
    coords: list[tuple[int, int]] = []

    def delivered(err: object, msg: Any) -> None:
        assert err is None, err
        coords.append((msg.partition(), msg.offset()))

    for n, i in enumerate(ids):
        producer.produce(
            settings.topics().samples,
            value=codec.encode(make_sample(i)),
            partition=n % partitions,
            on_delivery=delivered,
        )
        producer.flush(30)  # one at a time: coords come back in produce order
    assert len(coords) == len(ids)
    return coords


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny", hidden=64, layers=2)


def train(settings: CommonSettings, model: Path, ckpt: Path, **extra: Any) -> TrainResult:
    """``rollstream train`` in this process until idle."""
    return run(
        TrainerSettings(
            kafka_bootstrap=settings.kafka_bootstrap,
            namespace=settings.namespace,
            home=settings.home,
            model_path=model,
            model_create=False,
            checkpoint_dir=ckpt,
            checkpoint_fsync=False,
            train_lr=1e-3,
            train_token_budget=128,  # 5 samples of 24 tokens per step
            train_max_staleness=1000,
            train_flush_idle_s=1.0,
            train_exit_idle_s=2.0,
            train_poll_timeout_s=0.2,
            train_torch_threads=1,
            **extra,
        )
    )


def test_re_emitted_samples_are_trained_once_across_a_restart(
    kafka_settings: CommonSettings, model_path: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    # s0..s9, then s2, s3 again (a processor re-sent them) with s10, s11 and s10 once more
    first_ids = [*range(10), 2, 3, 10, 11, 10]
    first = produce(kafka_settings, first_ids)
    result = train(kafka_settings, model_path, ckpt)
    assert (result.samples_trained, result.duplicates_dropped) == (12, 3)

    store = CheckpointStore(ckpt)
    manifests = [m for _, m in store.manifests()]
    trained = [c for m in manifests for c in m.trained]
    duplicate = [c for m in manifests for c in m.duplicate]
    assert sorted(trained) == sorted(first[:10] + first[12:14])  # each sample's first copy
    assert sorted(duplicate) == sorted([first[10], first[11], first[14]])
    latest = store.latest()
    assert latest is not None and latest.meta.counters["duplicates_dropped"] == 3

    # a restart: s0 and s5 re-sent once more, and one new sample
    second = produce(kafka_settings, [0, 5, 12])
    again = train(kafka_settings, model_path, ckpt)
    assert again.resumed_from == result.step
    assert (again.samples_trained, again.duplicates_dropped) == (13, 5)
    manifests = [m for _, m in CheckpointStore(ckpt).manifests()]
    assert [c for m in manifests for c in m.trained].count(second[2]) == 1
    assert {second[0], second[1]} <= {c for m in manifests for c in m.duplicate}

    versions = [
        codec.decode(m.value(), expect=PolicyVersion)
        for m in read_topic(kafka_settings, kafka_settings.topics().policy)
    ]
    assert versions[-1].metrics["duplicates_dropped"] == 5.0
    assert sum(v.metrics["duplicates_step"] for v in versions) == 5.0


def test_the_window_is_bounded(
    kafka_settings: CommonSettings, model_path: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    produce(kafka_settings, list(range(6)), partitions=1)  # trained in this order
    first = train(kafka_settings, model_path, ckpt, train_dedup_window=2)
    assert first.samples_trained == 6
    # s0 left the window of the last 2 trained ids; s5 is still in it
    produce(kafka_settings, [0, 5], partitions=1)
    second = train(kafka_settings, model_path, ckpt, train_dedup_window=2)
    assert (second.samples_trained, second.duplicates_dropped) == (7, 1)
