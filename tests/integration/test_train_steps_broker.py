"""The trainer's ledger on the real broker: a job's rollouts and their samples, a trainer run
with ``max_staleness`` 0 so a rollout's samples come too late and are dropped stale, one
re-sent sample dropped as a duplicate; ``<ns>.trainer.steps`` then holds each committed step's
records with their verdicts (the manifests' coordinates), the spool is empty, and the job's
status (``jobqueue.job_status``, behind ``rollstream jobs status``; the CLI prints it) reports
the samples trained and dropped and the wasted rollout. Without the topic, training goes on and
the ledger waits in the spool; a later start sends it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _kafka_read import read_topic
from confluent_kafka import Producer

from rollstream.adapters.topics import admin_client, ensure_topics
from rollstream.consumers.training.checkpoint import CheckpointStore
from rollstream.consumers.training.trainer import TrainerSettings, TrainResult, run
from rollstream.inference.tinymodel import ensure_tiny_model
from rollstream.producers.rollouts import jobqueue
from rollstream.producers.rollouts.jobs import parse_job, rollout_id
from rollstream.schemas import (
    Codec,
    CommonSettings,
    Event,
    RolloutFinished,
    RolloutStarted,
    RolloutStatus,
    Sample,
    SampleMode,
    decode_step,
)

pytestmark = pytest.mark.integration

codec = Codec()
JOB_ID = "ledger-job"
A, B = "balanced-brackets", "caesar-shift"


def make_sample(i: int, rid: str, version: int) -> Sample:
    rng = np.random.default_rng(i)
    mask = np.array([0] * 8 + [1] * 16, dtype=np.uint8)
    return Sample(
        sample_id=f"s{i}",
        rollout_id=rid,
        group_id="g",
        task_id="t",
        input_ids=rng.integers(3, 500, 24).astype(np.uint32),
        loss_mask=mask,
        behaviour_logprobs=(-rng.uniform(5.5, 7.0, 24) * mask).astype(np.float32),
        advantage=float(rng.normal()),
        reward=1.0,
        policy_version=version,
        mode=SampleMode.PATH,
        parent_indices=np.zeros(0, np.int32),
    )


def produce(settings: CommonSettings, records: list[tuple[str, bytes, bytes]]) -> None:
    producer = Producer({**settings.kafka_config(), "acks": "all", "enable.idempotence": True})
    errors: list[Any] = []
    for topic, key, value in records:
        producer.produce(topic, value, key, partition=0, on_delivery=lambda e, _m: errors.append(e))
    assert producer.flush(30) == 0
    assert errors and not any(errors), errors


def train(s: CommonSettings, tmp_path: Path, ckpt: Path) -> TrainResult:
    return run(
        TrainerSettings(
            kafka_bootstrap=s.kafka_bootstrap, namespace=s.namespace, home=s.home,
            model_path=ensure_tiny_model(tmp_path / "tiny", hidden=64, layers=2),
            model_create=False, checkpoint_dir=ckpt, checkpoint_fsync=False,
            train_token_budget=128, train_max_staleness=0, train_flush_idle_s=1.0,
            train_exit_idle_s=2.0, train_poll_timeout_s=0.2, train_torch_threads=1,
        )
    )  # fmt: skip


def test_a_stale_rollout_is_reported_wasted_for_its_job(
    kafka_settings: CommonSettings, tmp_path: Path
) -> None:
    s, topics = kafka_settings, kafka_settings.topics()
    job = parse_job(
        {
            "job_id": JOB_ID,
            "tasks": {"suite": "pycoding", "ids": [A, B]},
            "samples_per_task": 1,
            "agent": {"kind": "tool"},
        }
    )
    jobqueue.submit_job(s, job)
    ra, rb = rollout_id(JOB_ID, A, 0, 0), rollout_id(JOB_ID, B, 0, 0)
    rw = rollout_id(JOB_ID, A, 1, 0)  # a rollout the job's events name, beyond its plan
    events = []
    for n, (rid, task, sample) in enumerate([(ra, A, 0), (rb, B, 0), (rw, A, 1)]):
        meta = {"job_id": JOB_ID, "sample": str(sample)}
        started = Event(f"e{n}a", rid, 0, 1, RolloutStarted(task, "g", metadata=meta))
        done = Event(f"e{n}b", rid, 1, 2, RolloutFinished(RolloutStatus.COMPLETED))
        events += [(topics.events, rid.encode(), codec.encode(e)) for e in (started, done)]
    produce(s, events)
    # ra: s0..s4 fill step 1 (5 x 24 tokens of a 128 budget); rw: s5 closes that batch and
    # waits for step 2 with s6, both of version 0: stale at version 1 with max_staleness 0;
    # rb: s7, s8 of version 1, trained by step 2 with the re-sent s0 dropped as a duplicate
    samples = [make_sample(i, ra, 0) for i in range(5)]
    samples += [make_sample(5, rw, 0), make_sample(6, rw, 0)]
    samples += [make_sample(7, rb, 1), make_sample(8, rb, 1), make_sample(0, ra, 0)]
    produce(s, [(topics.samples, b"g", codec.encode(x)) for x in samples])

    ckpt = tmp_path / "ckpt"
    result = train(s, tmp_path, ckpt)
    assert (result.step, result.samples_trained) == (2, 7)
    assert (result.stale_dropped, result.duplicates_dropped) == (2, 1)

    # the ledger: one record per step, the manifests' coordinates with their verdicts
    ledger = [decode_step(m.value()) for m in read_topic(s, topics.trainer_steps)]
    assert [(r.step, r.part, r.parts, r.topic) for r in ledger] == [
        (1, 0, 1, topics.samples), (2, 0, 1, topics.samples),
    ]  # fmt: skip
    for rec, (_, manifest) in zip(ledger, CheckpointStore(ckpt).manifests(), strict=True):
        by_verdict = {
            v: sorted((e.partition, e.offset) for e in rec.samples if e.verdict == v)
            for v in ("trained", "stale", "duplicate", "dlq")
        }
        assert by_verdict == {
            "trained": sorted(manifest.trained), "stale": sorted(manifest.stale),
            "duplicate": sorted(manifest.duplicate), "dlq": sorted(manifest.dlq),
        }  # fmt: skip
    verdicts = sorted((e.sample_id, e.verdict, e.rollout_id) for r in ledger for e in r.samples)
    assert [v for v in verdicts if v[1] != "trained"] == [
        ("s0", "duplicate", ra), ("s5", "stale", rw), ("s6", "stale", rw),
    ]  # fmt: skip
    assert list((ckpt / "train-steps").iterdir()) == []  # every step acknowledged

    training = jobqueue.job_status(s, JOB_ID).training
    assert (training.samples_trained, training.samples_dropped) == (
        7, {"stale": 2, "duplicate": 1, "skipped": 0},
    )  # fmt: skip
    assert (training.rollouts_trained, training.rollouts_wasted, training.wasted) == (2, 1, [rw])
    assert (training.tokens_stale, training.first_step, training.last_step) == (48, 1, 2)

    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")},
        "ROLLSTREAM_KAFKA_BOOTSTRAP": s.kafka_bootstrap,
        "ROLLSTREAM_NAMESPACE": s.namespace,
        "ROLLSTREAM_HOME": str(s.home),
        "COLUMNS": "300",
    }
    cli = [sys.executable, "-m", "rollstream.infra.cli", "jobs", "status", JOB_ID]
    text = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120, check=True)
    assert "training: 7 samples trained (168 tokens) in steps 1-2" in text.stdout
    assert "2 stale, 1 duplicate, 0 skipped (48 stale tokens)" in text.stdout
    assert f"1 wasted (every sample dropped stale)\nwasted: {rw}" in text.stdout
    as_json = subprocess.run(
        [*cli, "--json"], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(as_json.stdout)["training"]["wasted"] == [rw]


def test_without_the_topic_training_goes_on_and_a_later_start_sends_the_ledger(
    kafka_settings: CommonSettings, tmp_path: Path
) -> None:
    s, topics = kafka_settings, kafka_settings.topics()
    admin = admin_client(s)  # kept while the deletion runs
    for future in admin.delete_topics([topics.trainer_steps]).values():
        future.result(30)
    samples = [make_sample(i, "r", i // 5) for i in range(7)]  # versions 0 x 5, then 1 x 2
    produce(s, [(topics.samples, b"g", codec.encode(x)) for x in samples])
    ckpt = tmp_path / "ckpt"
    result = train(s, tmp_path, ckpt)
    assert (result.step, result.samples_trained) == (2, 7)  # 5, then the idle flush of 2
    spooled = sorted(p.name for p in (ckpt / "train-steps").iterdir())
    assert spooled == ["step-00000001.jsonl", "step-00000002.jsonl"]

    ensure_topics(s)
    again = train(s, tmp_path, ckpt)
    assert (again.resumed_from, again.steps_run) == (2, 0)
    assert list((ckpt / "train-steps").iterdir()) == []
    ledger = [decode_step(m.value()) for m in read_topic(s, topics.trainer_steps)]
    assert sorted(r.step for r in ledger) == [1, 2]
    assert sorted(e.sample_id for r in ledger for e in r.samples) == [f"s{i}" for i in range(7)]
