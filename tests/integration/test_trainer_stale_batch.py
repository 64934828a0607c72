"""Records no step trains, at the end of the input, on the real broker: a batch whose samples are
all stale (``max_staleness`` 0, the last samples a version behind) is committed without a new
step, a drop-only commit over the latest step, whether the idle flush or the idle exit finds
it: the committed checkpoint's manifest lists them as stale, ``counters.stale_dropped`` counts
them, the checkpoint's and the group's offsets are past them, the ledger lists them under that
step, no PolicyVersion is published for it; a restart reads none of them again and the next
step goes on from there. A crash inside a drop-only commit is recovered by the store. A SIGTERM
while a step's PolicyVersion cannot be published stops the trainer within seconds (exit 0,
logged), and the next start publishes that version."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from _kafka_read import read_topic
from confluent_kafka import Consumer, Producer, TopicPartition
from test_trainer import make_sample

from rollstream.adapters.topics import admin_client, ensure_topics
from rollstream.consumers.training.checkpoint import CheckpointMeta, CheckpointStore, Manifest
from rollstream.consumers.training.ledger import StepLedger
from rollstream.consumers.training.trainer import TRAINER_GROUP, TrainerSettings, TrainResult, run
from rollstream.inference.tinymodel import ensure_tiny_model
from rollstream.schemas import Codec, CommonSettings, PolicyVersion, Sample, decode_step

pytestmark = pytest.mark.integration

codec = Codec()
ROOT = Path(__file__).resolve().parents[2]


def produce(settings: CommonSettings, samples: list[Sample]) -> list[tuple[int, int]]:
    """Produce to partition 0 in order; the (partition, offset) of each."""
    producer = Producer({**settings.kafka_config(), "acks": "all", "enable.idempotence": True})
    coords: list[tuple[int, int]] = []

    def delivered(err: object, msg: object) -> None:
        assert err is None, err
        coords.append((msg.partition(), msg.offset()))  # type: ignore[attr-defined]

    for x in samples:
        producer.produce(
            settings.topics().samples, codec.encode(x), b"g", partition=0, on_delivery=delivered
        )
    assert producer.flush(30) == 0
    return coords


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny", hidden=64, layers=2)


def trainer_settings(
    s: CommonSettings, model: Path, ckpt: Path, flush_idle_s: float | None
) -> TrainerSettings:
    return TrainerSettings(
        kafka_bootstrap=s.kafka_bootstrap,
        namespace=s.namespace,
        home=s.home,
        model_path=model,
        model_create=False,
        checkpoint_dir=ckpt,
        checkpoint_fsync=False,
        train_lr=1e-3,
        train_token_budget=4096,
        train_batch_samples=4,
        train_max_staleness=0,
        train_flush_idle_s=flush_idle_s,
        train_exit_idle_s=2.0,
        train_poll_timeout_s=0.2,
        train_torch_threads=1,
    )


def committed(s: CommonSettings, want: dict[int, int]) -> dict[int, int]:
    """The trainer group's committed offsets of the samples topic, once they reach ``want``
    (the commit after a checkpoint is asynchronous) or after 10 s."""
    topic, group = s.topics().samples, s.topics().name(TRAINER_GROUP)
    consumer = Consumer({**s.kafka_config(), "group.id": group, "enable.auto.commit": False})
    try:
        deadline = time.monotonic() + 10
        while True:
            tps = consumer.committed([TopicPartition(topic, p) for p in want], timeout=10)
            got = {tp.partition: tp.offset for tp in tps}
            if got == want or time.monotonic() > deadline:
                return got
            time.sleep(0.2)
    finally:
        consumer.close()


def policy_versions(s: CommonSettings) -> list[int]:
    records = read_topic(s, s.topics().policy)
    return [codec.decode(m.value(), expect=PolicyVersion).version for m in records]


@pytest.mark.parametrize("flush_idle_s", [1.0, None], ids=["idle-flush", "idle-exit"])
def test_an_all_stale_batch_at_the_end_is_committed_as_dropped(
    kafka_settings: CommonSettings, model_path: Path, tmp_path: Path, flush_idle_s: float | None
) -> None:
    s, topics = kafka_settings, kafka_settings.topics()
    # s0..s3 (version 0) are step 1; s4, s5 (version 0) come last, stale at version 1
    coords = produce(s, [make_sample(i) for i in range(6)])
    ckpt = tmp_path / "ckpt"
    settings = trainer_settings(s, model_path, ckpt, flush_idle_s)
    result = run(settings)
    assert (result.step, result.samples_trained, result.stale_dropped) == (1, 4, 2)

    store = CheckpointStore(ckpt)
    assert not store.recovered
    latest = store.latest()
    assert latest is not None and latest.step == 1 and latest.meta.policy_version == 1
    assert latest.meta.drop_commits == 1
    assert latest.meta.counters["stale_dropped"] == 2 and latest.meta.counters["stale_tokens"] == 48
    assert latest.meta.offsets[topics.samples] == {0: coords[-1][1] + 1}
    manifests = dict(store.manifests())
    assert list(manifests) == [1]
    assert manifests[1].trained == coords[:4] and manifests[1].stale == coords[4:]
    assert manifests[1].trained_ids == ["s0", "s1", "s2", "s3"]
    assert latest.meta.manifest == manifests[1]  # meta.json and the manifest file agree
    assert committed(s, {0: coords[-1][1] + 1}) == {0: coords[-1][1] + 1}

    # no version for the drop-only commit: the weights did not change
    assert policy_versions(s) == [1]
    ledger = [decode_step(m.value()) for m in read_topic(s, topics.trainer_steps)]
    assert [(r.step, r.policy_version) for r in ledger] == [(1, 1), (1, 1)]
    verdicts = sorted((e.offset, e.verdict, e.sample_id) for r in ledger for e in r.samples)
    assert verdicts == [(o, "trained", f"s{o}") for _, o in coords[:4]] + [
        (o, "stale", f"s{o}") for _, o in coords[4:]
    ]
    assert list((ckpt / "train-steps").iterdir()) == []  # every record acknowledged

    # a restart reads none of them again; the next step goes on from the drop-only commit
    again = run(settings)
    assert (again.resumed_from, again.steps_run, again.stale_dropped) == (1, 0, 2)
    more = produce(s, [make_sample(i, version=1) for i in range(6, 10)])
    last = run(settings)
    assert (last.step, last.samples_trained, last.stale_dropped) == (2, 8, 2)
    manifests = dict(CheckpointStore(ckpt).manifests())
    assert manifests[2].trained == more and manifests[2].stale == []
    records = [c for m in manifests.values() for c in (*m.trained, *m.stale, *m.dlq)]
    assert sorted(records) == coords + more  # each record in exactly one committed manifest
    assert policy_versions(s) == [1, 2]


def test_a_crash_inside_a_drop_only_commit_is_recovered(
    kafka_settings: CommonSettings, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path / "ckpt", fsync=False)
    manifest = Manifest("ns.samples", [(0, 0)], trained_ids=["s0"])
    meta = CheckpointMeta(1, 1, offsets={"ns.samples": {0: 1}}, manifest=manifest)
    step = store.save(meta, torch.nn.Linear(2, 2))
    weights = (step.model_dir / "model.safetensors").read_bytes()
    dropped = CheckpointMeta(
        step=1,
        policy_version=1,
        offsets={"ns.samples": {0: 3}},
        counters={"stale_dropped": 2.0},
        manifest=Manifest("ns.samples", [(0, 0)], [(0, 1), (0, 2)], trained_ids=["s0"]),
        drop_commits=1,
    )
    assert store.commit_drops(dropped).meta == dropped
    # a crash after the commit point (meta.json) and before the manifest file, with a temp
    # file of the meta write left over
    manifest_file = tmp_path / "ckpt" / "manifests" / "step-00000001.json"
    manifest_file.write_text(json.dumps(manifest.to_json()))
    (step.path / ".tmp-meta.json.x").write_text("{")
    reopened = CheckpointStore(tmp_path / "ckpt", fsync=False)
    assert reopened.recovered == [
        "step-00000001/.tmp-meta.json.x",
        "manifests/step-00000001.json (rewritten from step-00000001)",
    ]
    assert dict(reopened.manifests()) == {1: dropped.manifest}
    latest = reopened.latest()
    assert latest is not None and latest.meta == dropped
    assert (latest.model_dir / "model.safetensors").read_bytes() == weights  # untouched
    with pytest.raises(Exception, match="needs it to be the latest"):
        reopened.commit_drops(CheckpointMeta(step=2, policy_version=2))

    # the ledger's spool: a start forgets the files past the committed (step, drop-only commit)
    kafka = kafka_settings.kafka_config()
    ledger = StepLedger(tmp_path / "ckpt", "ns.trainer.steps", kafka, fsync=False)
    for step_, drop in [(1, 0), (1, 1), (1, 2), (2, 0)]:
        ledger.spool(step_, [], drop)
    ledger.forget_after(1, 1)
    assert ledger.pending() == ["step 1", "step 1 (drop-only commit 1)"]
    spooled = sorted(p.name for p in (tmp_path / "ckpt" / "train-steps").iterdir())
    assert spooled == ["step-00000001-drop-1.jsonl", "step-00000001.jsonl"]
    ledger.producer.purge()
    ledger.producer.close()


def test_sigterm_while_a_version_cannot_be_published_stops_within_seconds(
    kafka_settings: CommonSettings, model_path: Path, tmp_path: Path
) -> None:
    s, topics = kafka_settings, kafka_settings.topics()
    admin = admin_client(s)  # kept while the deletion runs
    for future in admin.delete_topics([topics.policy]).values():
        future.result(30)  # the broker does not create topics: the publish waits
    produce(s, [make_sample(i) for i in range(4)])  # one step
    ckpt = tmp_path / "ckpt"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")},
        "ROLLSTREAM_KAFKA_BOOTSTRAP": s.kafka_bootstrap,
        "ROLLSTREAM_NAMESPACE": s.namespace,
        "ROLLSTREAM_HOME": str(s.home),
        "ROLLSTREAM_MODEL_PATH": str(model_path),
        "ROLLSTREAM_MODEL_CREATE": "false",
        "ROLLSTREAM_CHECKPOINT_DIR": str(ckpt),
        "ROLLSTREAM_TRAIN_BATCH_SAMPLES": "4",
        "ROLLSTREAM_TRAIN_TORCH_THREADS": "1",
        "ROLLSTREAM_TRAIN_INSTANCE_ID": f"t-{uuid.uuid4().hex[:8]}",
    }
    log = tmp_path / "trainer.log"
    with log.open("wb") as out:
        cli = [sys.executable, "-m", "rollstream.infra.cli", "train"]
        proc = subprocess.Popen(cli, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "latest").exists():  # step 1 committed: its publish waits 30 s
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    text = log.read_text()
    print(f"trainer stopped {took:.2f} s after SIGTERM")
    assert code == 0, text[-3000:]
    assert took < 12, text[-3000:]  # 3 s for the publish + 3 s in close (it was 30 s + 30 s)
    assert "stopping: PolicyVersion 1 not published" in text, text[-3000:]
    assert json.loads(text.strip().splitlines()[-1])["step"] == 1

    ensure_topics(s)
    result: TrainResult = run(trainer_settings(s, model_path, ckpt, 1.0))
    assert (result.resumed_from, result.steps_run) == (1, 0)
    assert policy_versions(s) == [1]  # published by the next start
