"""SamplesDataset against the real broker: each sample once per consumer group, collated
batches, DataLoader workers splitting partitions, the external-trainer example."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from _kafka_read import read_topic
from confluent_kafka import Producer
from torch.utils.data import DataLoader

from rollstream.consumers.training.dataset import SamplesDataset
from rollstream.inference.tinymodel import ensure_tiny_model
from rollstream.schemas import Codec, CommonSettings, Sample
from rollstream.schemas.dlq import CODE_UNDECODABLE, read_headers

pytestmark = pytest.mark.integration

codec = Codec()
ROOT = Path(__file__).resolve().parents[2]


def make_sample(i: int) -> Sample:
    rng = np.random.default_rng(i)
    n = 12 + i % 9  # 12..20 tokens
    mask = np.array([0] * 4 + [1] * (n - 4), dtype=np.uint8)
    return Sample(
        sample_id=f"s{i}",
        rollout_id=f"r{i}",
        group_id=f"g{i // 4}",
        task_id="t",
        input_ids=rng.integers(3, 500, n).astype(np.uint32),
        loss_mask=mask,
        behaviour_logprobs=(-6.0 * mask).astype(np.float32),
        advantage=float(rng.normal()),
        reward=0.0,
        policy_version=0,
        loss_weight=0.25,
    )


def produce_samples(settings: CommonSettings, count: int, partitions: int = 3) -> set[str]:
    producer = Producer({**settings.kafka_config(), "acks": "all"})
    for i in range(count):
        producer.produce(
            settings.topics().samples, codec.encode(make_sample(i)), partition=i % partitions
        )
        if i == 7:
            producer.produce(settings.topics().samples, b"\x00garbage", partition=1)
    assert producer.flush(30) == 0
    return {f"s{i}" for i in range(count)}


def test_each_sample_once_per_consumer_group(kafka_settings: CommonSettings) -> None:
    expected = produce_samples(kafka_settings, 30)
    first = SamplesDataset(kafka_settings, group_id="g-a", max_samples=12, idle_timeout=5)
    got_first = [s.sample_id for s in first]
    assert len(got_first) == 12
    second = SamplesDataset(kafka_settings, group_id="g-a", idle_timeout=2)
    got_second = [s.sample_id for s in second]
    both = got_first + got_second
    assert len(both) == len(set(both)) == 30 and set(both) == expected
    assert first.dlq_sent + second.dlq_sent == 1  # the garbage record, once
    (dead,) = read_topic(kafka_settings, kafka_settings.topics().dlq)
    headers = read_headers(dead.headers())
    assert dead.value() == b"\x00garbage"
    assert (headers["code"], headers["kind"], headers["stage"]) == (
        CODE_UNDECODABLE,
        "Sample",
        "dataset",
    )
    assert headers["processor"] == kafka_settings.topics().name("g-a")
    assert headers["original_topic"] == kafka_settings.topics().samples

    # Another group reads everything again; manual commit leaves the group where it was.
    manual = SamplesDataset(kafka_settings, group_id="g-b", commit="manual", idle_timeout=2)
    assert {s.sample_id for s in manual} == expected
    again = SamplesDataset(kafka_settings, group_id="g-b", idle_timeout=2, max_samples=3)
    assert len(list(again)) == 3  # nothing was committed: starts over
    resumed = SamplesDataset(
        kafka_settings,
        group_id="g-c",
        commit="manual",
        start_offsets={0: 10, 1: 11, 2: 10},  # everything consumed (11 on p1: the garbage)
        idle_timeout=2,
    )
    assert list(resumed) == []


def test_collated_batches_through_a_dataloader(kafka_settings: CommonSettings) -> None:
    expected = produce_samples(kafka_settings, 30)
    ds = SamplesDataset(
        kafka_settings, group_id="g-batches", collate=True, batch_tokens=128, idle_timeout=2
    )
    seen = 0
    for batch in DataLoader(ds, batch_size=None):
        b, t = batch["input_ids"].shape
        assert b * t <= 128 and batch["loss_mask"].shape == (b, t)
        assert batch["advantages"].shape == (b,) and batch["input_ids"].dtype == torch.long
        seen += b
    assert seen == len(expected)
    rest = SamplesDataset(kafka_settings, group_id="g-batches", collate=True, idle_timeout=2)
    assert list(rest) == []  # every batch was committed


def test_dataloader_workers_split_the_partitions(kafka_settings: CommonSettings) -> None:
    expected = produce_samples(kafka_settings, 60, partitions=6)
    ds = SamplesDataset(kafka_settings, group_id="g-workers", idle_timeout=4)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    counts = Counter(s.sample_id for s in loader)
    assert set(counts) == expected and max(counts.values()) == 1


def test_external_trainer_example_runs(kafka_settings: CommonSettings, tmp_path: Path) -> None:
    produce_samples(kafka_settings, 24)
    model = ensure_tiny_model(tmp_path / "tiny", hidden=64, layers=2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")} | {
        "ROLLSTREAM_KAFKA_BOOTSTRAP": kafka_settings.kafka_bootstrap,
        "ROLLSTREAM_NAMESPACE": kafka_settings.namespace,
    }
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "external_trainer.py"),
            "--model",
            str(model),
            "--out",
            str(tmp_path / "out"),
            "--batch-tokens",
            "160",
            "--idle-timeout",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 24 and summary["steps"] >= 3
    assert (tmp_path / "out" / "position.json").is_file()
