"""The trainer's experiment loggers (consumers/training/loggers.py): what a step logs, a failing
logger switched off, a missing extra refused at start."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rollstream.consumers.errors import TrainerError
from rollstream.consumers.training.checkpoint import CheckpointMeta
from rollstream.consumers.training.loggers import (
    WandbLogger,
    build_loggers,
    log_all,
    step_scalars,
    wandb_run_id,
)
from rollstream.consumers.training.settings import TrainerSettings


def meta(step: int = 3) -> CheckpointMeta:
    return CheckpointMeta(
        step=step,
        policy_version=step,
        samples_trained=40,
        tokens_trained=960,
        counters={"stale_dropped": 2.0, "dlq": 1.0},
        metrics={"loss": 0.25, "clip_frac": 0.1, "entropy": float("nan"), "lr": 1e-5},
    )


def test_step_scalars_are_the_steps_metrics_and_totals_finite_only() -> None:
    assert step_scalars(meta()) == {
        "totals/dlq": 1.0,
        "totals/policy_version": 3.0,
        "totals/samples_trained": 40.0,
        "totals/stale_dropped": 2.0,
        "totals/tokens_trained": 960.0,
        "train/clip_frac": 0.1,
        "train/loss": 0.25,
        "train/lr": 1e-5,
    }  # entropy (NaN: not computed) left out


class Recording:
    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail, self.steps = name, fail, []  # type: ignore[var-annotated]

    def log_step(self, m: CheckpointMeta) -> None:
        if self.fail:
            raise OSError("disk full")
        self.steps.append(m.step)

    def close(self) -> None:
        pass


def test_a_failing_logger_is_switched_off_and_the_others_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    good, bad = Recording("good"), Recording("bad", fail=True)
    loggers = log_all([bad, good], meta(1))
    assert loggers == [good] and good.steps == [1]
    assert log_all(loggers, meta(2)) == [good] and good.steps == [1, 2]
    assert "bad logger failed at step 1; switched off" in caplog.text


def test_no_loggers_by_default(tmp_path: Path) -> None:
    assert build_loggers(TrainerSettings(home=tmp_path)) == []


def test_a_missing_extra_stops_the_trainer_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if `rollstream[wandb]` were not installed
    with pytest.raises(TrainerError, match=r"pip install 'rollstream\[wandb\]'"):
        WandbLogger("p", mode="offline", directory=tmp_path, run_id="x", run_name=None, config={})


def test_the_wandb_run_id_is_stable_per_checkpoint_dir(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert wandb_run_id(a) == wandb_run_id(tmp_path / "x" / ".." / "a") != wandb_run_id(b)


def test_the_wandb_settings_are_bounded(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train_wandb_project"):
        TrainerSettings(home=tmp_path, train_wandb_project="")
    with pytest.raises(ValueError, match="train_wandb_mode"):
        TrainerSettings(home=tmp_path, train_wandb_mode="cloud")  # type: ignore[arg-type]
