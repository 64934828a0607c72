"""What a retrain needs of checkpoints: manifests carry the trained sample ids in order (and
old manifests without them still read), the recorded trainer settings, read-only access to
another run's root, and ``trainer.pt`` loaded with ``weights_only=True`` (issue 16), the RNG
states included, also from a file written in the older format."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollstream.consumers.training.checkpoint import (
    CheckpointMeta,
    CheckpointStore,
    Manifest,
    load_trainer_state,
    read_checkpoint,
    read_manifests,
    rng_state,
    set_rng_state,
)
from rollstream.consumers.training.settings import TRAIN_CONFIG_FIELDS, TrainerSettings


def tiny() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def test_manifest_round_trip_keeps_ids_in_order_and_reads_old_ones() -> None:
    m = Manifest("ns.samples", [(0, 3), (1, 0)], [(0, 1)], [], [], ["z", "a"], [(2, 9)])
    back = Manifest.from_json(json.loads(json.dumps(m.to_json())))
    assert back == m and back.trained_ids == ["z", "a"] and back.skipped == [(2, 9)]
    old = Manifest.from_json({"topic": "t", "trained": [[0, 1]], "stale": [], "dlq": []})
    assert old.trained_ids == [] and old.trained == [(0, 1)]


def test_trainer_state_loads_weights_only_with_every_rng(tmp_path: Path) -> None:
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(8).unsqueeze(0), labels=torch.arange(8).unsqueeze(0)).loss.backward()
    opt.step()
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    settings = TrainerSettings(train_lr=3e-4, train_max_staleness=2)
    meta = CheckpointMeta(step=1, policy_version=1, train_config=settings.train_config())
    store = CheckpointStore(tmp_path / "ckpt", fsync=False)
    ckpt = store.save(meta, model, opt)
    expected = (random.random(), np.random.random(), torch.rand(3))
    random.random(), np.random.random(), torch.rand(3)  # move every RNG on
    state = load_trainer_state(ckpt.path / "trainer.pt")  # weights_only=True inside
    assert state["optimizer"]["state"]
    set_rng_state(state["rng"])
    assert (random.random(), np.random.random()) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])
    again = read_checkpoint(ckpt.path).meta.train_config
    assert set(again) == set(TRAIN_CONFIG_FIELDS) and again["train_lr"] == 3e-4


def test_a_trainer_state_of_the_older_format_still_loads(tmp_path: Path) -> None:
    np.random.seed(9)
    old = {
        "optimizer": None,
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),  # a numpy array inside, as before
            "torch": torch.get_rng_state(),
        },
    }
    torch.save(old, tmp_path / "trainer.pt")
    expected = np.random.random()
    state = load_trainer_state(tmp_path / "trainer.pt")
    set_rng_state(state["rng"])
    assert np.random.random() == expected
    assert isinstance(rng_state()["numpy"][1], torch.Tensor)


def test_reading_another_root_changes_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", fsync=False)
    model = tiny()
    for step in (1, 2):
        manifest = Manifest("t", [(0, step)], trained_ids=[f"s{step}"])
        store.save(CheckpointMeta(step=step, policy_version=step, manifest=manifest), model)
    leftover = tmp_path / "ckpt" / ".tmp-step-00000003-x"  # what a crash mid-save leaves
    leftover.mkdir()
    before = sorted(p.name for p in (tmp_path / "ckpt").rglob("*"))
    assert [(k, m.trained_ids) for k, m in read_manifests(tmp_path / "ckpt")] == [
        (1, ["s1"]),
        (2, ["s2"]),
    ]
    assert read_checkpoint(tmp_path / "ckpt" / "step-00000002").meta.step == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").rglob("*")) == before  # nothing removed
