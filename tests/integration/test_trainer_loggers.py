"""The trainer's optional experiment loggers (consumers/training/loggers.py) against the real
broker: a trainer run with TensorBoard and W&B (offline) on logs one point per committed step,
equal to the step's checkpoint metrics; a restarted trainer goes on in the same W&B run."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_trainer import make_sample, model_path, produce, settings_from, trainer_env
from wandb.proto import wandb_internal_pb2

from rollstream.consumers.training.checkpoint import read_checkpoint
from rollstream.consumers.training.trainer import run
from rollstream.schemas import Codec, CommonSettings

pytestmark = pytest.mark.integration
__all__ = ["model_path"]  # the module fixture, shared with test_trainer

codec = Codec()
BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of framed chunks


def wandb_records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    """The records of an offline W&B run file (header ':W&B' + magic + version, then LevelDB
    log chunks: crc32 u32, length u16, type u8 = full 1 / first 2 / middle 3 / last 4)."""
    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", data[:8]
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending + chunk)
            pending = b""
            yield rec
        elif kind in (2, 3):
            pending += chunk


def wandb_history(run_dir: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for file in sorted(run_dir.glob("offline-run-*/run-*.wandb")):
        for rec in wandb_records(file):
            if rec.WhichOneof("record_type") == "history":
                items = rec.history.item
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                out[int(row["_step"])] = row
    return out


def test_tensorboard_and_wandb_log_each_committed_step(
    kafka_settings: CommonSettings, model_path: Path, tmp_path: Path
) -> None:
    ckpt, tb, wb = tmp_path / "ckpt", tmp_path / "tb", tmp_path / "wb"
    produce(kafka_settings, [(0, codec.encode(make_sample(i))) for i in range(10)])
    env = trainer_env(
        kafka_settings, model_path, ckpt, train_batch_samples=4, train_token_budget=4096,
        checkpoint_keep=10, train_tensorboard_dir=tb, train_wandb_project="rollstream-test",
        train_wandb_dir=wb,
    )  # fmt: skip
    first = run(settings_from(env))
    assert first.step == 3  # 4 + 4 + 2 (the partial batch after the idle flush)
    # a restart with more samples goes on: steps 4 and 5, same W&B run, same TensorBoard dir
    produce(kafka_settings, [(0, codec.encode(make_sample(i))) for i in range(10, 18)])
    second = run(settings_from(env))
    assert second.step == 5

    metas = {c.meta.step: c.meta for c in map(read_checkpoint, ckpt.glob("step-*"))}
    assert sorted(metas) == [1, 2, 3, 4, 5]
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0}).Reload()
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(loss) == [1, 2, 3, 4, 5]
    for step, meta in metas.items():
        assert loss[step] == pytest.approx(meta.metrics["loss"], rel=1e-6)
    trained = {e.step: e.value for e in acc.Scalars("totals/samples_trained")}
    assert trained == {1: 4, 2: 8, 3: 10, 4: 14, 5: 18}

    runs = sorted(wb.glob("wandb/offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1  # one run id
    history = wandb_history(wb / "wandb")
    assert sorted(history) == [1, 2, 3, 4, 5]
    for step, meta in metas.items():
        assert history[step]["train/loss"] == pytest.approx(meta.metrics["loss"], rel=1e-6)
        assert history[step]["totals/policy_version"] == meta.policy_version
