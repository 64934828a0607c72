"""``rollstream retrain`` on the real broker over a short run: 16 SDK rollouts of one run (groups
of 4), their samples made by the batch path and written to the source namespace *shuffled*, a
trainer run of several steps over them. A retrain with unchanged settings from version 1
replays the events, rebuilds the samples (they arrive in another order), trains by the source's
step manifests and writes checkpoints equal tensor for tensor to the source's versions 2..N;
the source's topics (high watermarks) and checkpoint files are unchanged. A dry run with a
changed advantage setting writes nothing and reports the changed advantages; a refused key is
refused with its reason."""

from __future__ import annotations

import hashlib
import random
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from _kafka_read import read_topic
from _sink_process import ends_of
from confluent_kafka import Producer
from safetensors.torch import load_file

from rollstream.adapters.topics import admin_client
from rollstream.consumers.training.checkpoint import read_manifests
from rollstream.consumers.training.retrain_plan import RetrainError
from rollstream.consumers.training.settings import TrainerSettings
from rollstream.consumers.training.trainer import run as train
from rollstream.inference.tinymodel import ensure_tiny_model
from rollstream.infra.retrain import RetrainSettings, run, show
from rollstream.producers.sdk.recorder import Recorder, RecorderSettings
from rollstream.schemas import Codec, CommonSettings, Sample
from rollstream.streams.batch import BatchConfig, SourceRecord, process_batch
from rollstream.streams.settings import ProcessorSettings

pytestmark = pytest.mark.integration

codec = Codec()
RUN = "run-1"


def record_run(settings: CommonSettings, spool: Path, n: int, seed: int) -> None:
    """n rollouts of run RUN through the SDK (8 events each), groups of 4, rewards 0 and 1,
    token ids the tiny model knows (< 512)."""
    rng = np.random.default_rng(seed)
    rec = Recorder(
        RecorderSettings(
            kafka_bootstrap=settings.kafka_bootstrap,
            namespace=settings.namespace,
            spool_dir=spool,
        )
    )
    try:
        for i in range(n):
            with rec.rollout(
                task_id=f"task-{i // 4}", group_id=f"g{seed}-{i // 4}", group_size=4, run_id=RUN
            ) as r:
                prompt = rng.integers(0, 500, 24)
                c1 = r.llm_call(prompt, rng.integers(0, 500, 8), -rng.random(8), model="m")
                r.tool_call("bash", {"cmd": "ls"}, "ok", at_call_id=c1, duration_ms=3.0)
                prompt2 = np.concatenate([prompt, rng.integers(0, 500, 16)])
                r.llm_call(prompt2, rng.integers(0, 500, 8), -rng.random(8), model="m")
                r.branch("retry", source_call_id=c1)
                r.error("tool", "timeout", code=124)
                r.reward(float(i % 2))
        assert rec.flush(60)
    finally:
        stats = rec.close()
    assert stats.dropped == 0 and stats.failed == 0, stats


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _source_topics(settings: CommonSettings) -> list[str]:
    t = settings.topics()
    return [t.events, t.samples, t.trajectories, t.dlq, t.policy]


def _weights(step_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(step_dir / "model" / "model.safetensors"))


@pytest.fixture
def source_run(
    kafka_settings: CommonSettings, tmp_path: Path
) -> tuple[CommonSettings, Path, list[str]]:
    """The source run: events, shuffled samples, a trainer run; returns its settings, its
    checkpoint root and its samples' ids in the order they lie in its samples topic."""
    a = kafka_settings
    record_run(a, tmp_path / "spool", 16, seed=5)
    events = read_topic(a, a.topics().events)
    records = [SourceRecord(m.partition(), m.offset(), m.key(), m.value()) for m in events]
    out = process_batch(records, BatchConfig.from_settings(ProcessorSettings(), route=None), codec)
    samples = list(out.samples)
    random.Random(7).shuffle(samples)
    producer = Producer({**a.kafka_config(), "enable.idempotence": True, "acks": "all"})
    for o in samples:
        producer.produce(a.topics().samples, o.value, o.key, partition=0)  # one order
    assert producer.flush(30) == 0
    model = ensure_tiny_model(tmp_path / "models" / "tiny", hidden=64, layers=2)
    ckpt = tmp_path / "ckpt-a"
    trainer = TrainerSettings(
        kafka_bootstrap=a.kafka_bootstrap,
        namespace=a.namespace,
        home=a.home,
        model_path=model,
        checkpoint_dir=ckpt,
        checkpoint_keep=50,
        checkpoint_fsync=False,
        train_batch_samples=4,
        train_lr=1e-3,
        train_max_staleness=100,  # every sample trained
        train_torch_threads=1,
        train_flush_idle_s=1.0,
        train_exit_idle_s=1.5,
        train_poll_timeout_s=0.2,
    )
    result = train(trainer)
    assert result.step >= 4, result
    order = [codec.decode(o.value, expect=Sample).sample_id for o in samples]
    return a, ckpt, order


def test_an_unchanged_retrain_reproduces_the_checkpoints_bit_for_bit(
    source_run: tuple[CommonSettings, Path, list[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, ckpt, source_order = source_run
    monkeypatch.setenv("ROLLSTREAM_CHECKPOINT_KEEP", "50")  # the retrain keeps every step dir
    watermarks = ends_of(a, _source_topics(a))
    files = _tree_digest(ckpt)
    last = int((ckpt / "latest").read_text().strip().removeprefix("step-"))
    target = f"r{uuid.uuid4().hex[:8]}"
    settings = RetrainSettings(
        kafka_bootstrap=a.kafka_bootstrap,
        namespace=a.namespace,
        home=a.home,
        replay_to=target,
        replay_progress=False,
        retrain_run=RUN,
        retrain_from_version=1,
        retrain_source_checkpoints=ckpt,
        retrain_rebuild=True,  # samples rebuilt from the replayed events, not copied
        retrain_idle_s=1.0,
        retrain_plot=tmp_path / "retrain.png",
    )
    result = run(settings)
    show(result)
    assert result.follow and result.steps_trained == last - 1, result
    assert result.samples_path.startswith("batch path")
    assert result.diff is not None and result.diff.identical  # the same samples, rebuilt
    assert result.events_replayed == 16 * 8
    target_root = a.home / target / "checkpoints"
    b = CommonSettings(kafka_bootstrap=a.kafka_bootstrap, namespace=target)
    arrived = [
        codec.decode(m.value(), expect=Sample).sample_id for m in read_topic(b, b.topics().samples)
    ]
    assert sorted(arrived) == sorted(source_order) and arrived != source_order
    for k in range(2, last + 1):
        mine, theirs = _weights(target_root / f"step-{k:08d}"), _weights(ckpt / f"step-{k:08d}")
        assert mine.keys() == theirs.keys()
        for name, tensor in theirs.items():
            assert torch.equal(mine[name], tensor), (k, name)
    assert not torch.equal(  # the steps did change the weights
        _weights(ckpt / "step-00000001")["model.embed_tokens.weight"],
        _weights(target_root / f"step-{last:08d}")["model.embed_tokens.weight"],
    )
    ours = dict(read_manifests(target_root))
    for k, manifest in read_manifests(ckpt):
        if k >= 2:
            assert ours[k].trained_ids == manifest.trained_ids != []
    assert result.original is not None and result.retrained is not None
    assert [x for _, x in result.retrained.losses] == [x for _, x in result.original.losses]
    assert (tmp_path / "retrain.png").stat().st_size > 1000
    # the source was never written
    assert ends_of(a, _source_topics(a)) == watermarks
    assert _tree_digest(ckpt) == files


def test_a_dry_run_reports_changed_samples_and_writes_nothing(
    source_run: tuple[CommonSettings, Path, list[str]],
) -> None:
    a, ckpt, _ = source_run
    watermarks = ends_of(a, _source_topics(a))
    target = f"r{uuid.uuid4().hex[:8]}"
    base = {
        "kafka_bootstrap": a.kafka_bootstrap,
        "namespace": a.namespace,
        "home": a.home,
        "replay_to": target,
        "replay_progress": False,
        "retrain_run": RUN,
        "retrain_source_checkpoints": ckpt,
    }
    same = run(RetrainSettings(**base, retrain_dry_run=True))
    assert same.diff is not None and same.diff.identical and same.diff.common > 0
    changed = run(
        RetrainSettings(**base, retrain_dry_run=True, retrain_sets=["adv_normalize_std=false"])
    )
    assert changed.diff is not None and not changed.diff.identical
    assert changed.diff.advantage_changed > 0 and changed.diff.common == same.diff.common
    assert changed.wall_s < 30
    parallel = run(  # the batch path over two processes: the same comparison
        RetrainSettings(
            **base,
            retrain_dry_run=True,
            retrain_sets=["adv_normalize_std=false"],
            retrain_workers=2,
        )
    )
    assert parallel.diff == changed.diff and parallel.samples_built == changed.samples_built
    other = run(RetrainSettings(**{**base, "retrain_run": "no-such-run"}, retrain_dry_run=True))
    assert other.diff is not None and other.diff.after.samples == 0
    with pytest.raises(RetrainError, match="new rollouts"):
        run(RetrainSettings(**base, retrain_sets=["temperature=0.7"]))
    listed = admin_client(a).list_topics(timeout=10).topics
    assert not [t for t in listed if t.startswith(f"{target}.")]  # no target topic made
    assert ends_of(a, _source_topics(a)) == watermarks
    assert not (a.home / target).exists()


def test_a_trainer_only_change_copies_the_samples_and_follows_the_manifests(
    source_run: tuple[CommonSettings, Path, list[str]],
) -> None:
    a, ckpt, _ = source_run
    target = f"r{uuid.uuid4().hex[:8]}"
    result = run(
        RetrainSettings(
            kafka_bootstrap=a.kafka_bootstrap,
            namespace=a.namespace,
            home=a.home,
            replay_to=target,
            replay_progress=False,
            retrain_run=RUN,
            retrain_source_checkpoints=ckpt,
            retrain_sets=["lr=3e-3"],
            retrain_max_steps=2,
            retrain_idle_s=1.0,
        )
    )
    assert result.samples_path.startswith("copied from")
    assert result.follow and result.steps_trained == 2
    assert result.diff is not None and result.diff.identical
    assert result.retrained is not None and result.original is not None
    assert result.retrained.losses[0] == result.original.losses[0]  # same weights at step 1
    mine = _weights(a.home / target / "checkpoints" / "step-00000001")
    theirs = _weights(ckpt / "step-00000001")
    assert any(not torch.equal(mine[k], theirs[k]) for k in theirs)  # another learning rate
