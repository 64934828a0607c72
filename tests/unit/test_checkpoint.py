"""Checkpoint store: round trip, atomic commit, recovery from an interrupted save, pruning."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollstream.consumers.training.checkpoint import (
    LATEST,
    CheckpointError,
    CheckpointMeta,
    CheckpointStore,
    Manifest,
)
from rollstream.inference.tinymodel import apply_state_dict, load_state_dict


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return Qwen2ForCausalLM(config)


def trained(seed: int = 0) -> tuple[Qwen2ForCausalLM, torch.optim.AdamW]:
    """A model and an optimizer with state (one step taken)."""
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model, opt


def meta(step: int, offsets: dict[int, int] | None = None) -> CheckpointMeta:
    offs = offsets if offsets is not None else {0: step * 3, 1: step}
    return CheckpointMeta(
        step=step,
        policy_version=step,
        offsets={"ns.samples": offs},
        samples_trained=step * 4,
        counters={"stale_dropped": 1.0},
        metrics={"loss": 0.5},
        manifest=Manifest("ns.samples", trained=[(0, step * 3 - 1)], stale=[(1, step - 1)]),
    )


def state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_restore_round_trip(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck", fsync=False)
    assert store.latest() is None
    model, opt = trained()
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    ckpt = store.save(meta(1), model, opt)
    expected_draws = (random.random(), np.random.rand(), torch.rand(3))

    latest = store.latest()
    assert latest is not None and latest.path == ckpt.path and latest.step == 1
    assert (tmp_path / "ck" / LATEST).read_text().strip() == "step-00000001"
    assert latest.meta.offsets == {"ns.samples": {0: 3, 1: 1}}
    assert latest.meta.manifest == Manifest("ns.samples", [(0, 2)], [(1, 0)], [])

    fresh = tiny_model(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    assert not state_equal(fresh, model)
    restored = CheckpointStore(tmp_path / "ck", fsync=False).restore(latest, fresh, fresh_opt)
    assert restored.step == 1 and restored.counters == {"stale_dropped": 1.0}
    assert state_equal(fresh, model)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    for (k, a), b in zip(
        fresh_opt.state_dict()["state"].items(), opt.state_dict()["state"].values(), strict=True
    ):
        assert torch.equal(a["exp_avg"], b["exp_avg"]), k
    draws = (random.random(), np.random.rand(), torch.rand(3))  # RNG states came back too
    assert draws[0] == expected_draws[0] and draws[1] == expected_draws[1]
    assert torch.equal(draws[2], expected_draws[2])


def test_model_dir_is_what_the_model_server_reloads(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck", fsync=False)
    model, opt = trained()
    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"not copied")
    ckpt = store.save(meta(1), model, opt, copy_from=base)
    files = {p.name for p in ckpt.model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "rollstream.json"} <= files
    other = tiny_model(seed=3)
    apply_state_dict(other, load_state_dict(ckpt.model_dir))  # the server's /v1/load_weights
    assert state_equal(other, model)


def test_crash_mid_write_leaves_latest_on_a_complete_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    store = CheckpointStore(root, fsync=False)
    model, opt = trained()
    store.save(meta(1), model, opt)
    store.save(meta(2), model, opt)

    # A crash while writing step 3: a partial temp dir (half a model, no meta.json).
    partial = root / ".tmp-step-00000003-x1y2"
    (partial / "model").mkdir(parents=True)
    (partial / "model" / "model.safetensors").write_bytes(b"\x00" * 100)
    # A crash after the rename of step 4's dir but before `latest` moved: not committed.
    renamed = root / "step-00000004"
    (renamed / "model").mkdir(parents=True)
    (renamed / "meta.json").write_text("{}")
    (root / "manifests" / "step-00000004.json").write_text('{"topic": "t"}')
    assert (root / LATEST).read_text().strip() == "step-00000002"

    reopened = CheckpointStore(root, fsync=False)
    assert sorted(reopened.recovered) == sorted(
        [partial.name, renamed.name, "manifests/step-00000004.json"]
    )
    latest = reopened.latest()
    assert latest is not None and latest.step == 2
    assert latest.meta.offsets == meta(2).offsets
    assert reopened.steps() == [1, 2]
    assert [s for s, _ in reopened.manifests()] == [1, 2]
    restored = tiny_model(seed=5)
    reopened.restore(latest, restored)
    assert state_equal(restored, model)
    # the next save of step 3 goes through
    assert reopened.save(meta(3), model, opt).step == 3


def test_a_save_that_fails_before_commit_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    store = CheckpointStore(root, fsync=False)
    model, opt = trained()
    store.save(meta(1), model, opt)

    def crash(tmp: Path) -> None:
        assert (tmp / "meta.json").is_file() and (tmp / "model" / "config.json").is_file()
        raise KeyboardInterrupt  # stands in for a kill during the write

    with pytest.raises(KeyboardInterrupt):
        store.save(meta(2), model, opt, before_commit=crash)
    assert (root / LATEST).read_text().strip() == "step-00000001"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert store.steps() == [1] and [s for s, _ in store.manifests()] == [1]


def test_keep_prunes_old_checkpoints_but_keeps_every_manifest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck", keep=2, fsync=True)
    model, opt = trained()
    for step in range(1, 5):
        store.save(meta(step), model, opt)
    assert store.steps() == [3, 4]
    assert [s for s, _ in store.manifests()] == [1, 2, 3, 4]
    with pytest.raises(CheckpointError, match="was committed"):
        store.save(meta(4), model, opt)


def test_latest_pointing_nowhere_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    (root / LATEST).write_text("step-00000009\n")
    with pytest.raises(CheckpointError, match="missing checkpoint"):
        CheckpointStore(root)
    (root / LATEST).write_text("../elsewhere\n")
    with pytest.raises(CheckpointError, match="not a step dir"):
        CheckpointStore(root)


def test_weights_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck", fsync=False)
    model, opt = trained()
    ckpt = store.save(meta(1), model, opt)
    config = model.config
    config.hidden_size, config.intermediate_size = 32, 64
    with pytest.raises(CheckpointError, match="do not fit"):
        store.restore(ckpt, Qwen2ForCausalLM(config))
