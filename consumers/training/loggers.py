"""Optional experiment loggers of the trainer: TensorBoard and Weights & Biases.

    loggers = build_loggers(settings)      # [] unless train_tensorboard_dir / train_wandb_project
    for lg in loggers: lg.log_step(meta)   # each committed step's CheckpointMeta
    for lg in loggers: lg.close()

Each committed step is logged once, after its checkpoint is on disk and its policy version
published, with the step number as the x axis: the step's own metrics (loss, clip_frac,
approx_kl, entropy, grad_norm, lr, step_time_s, batch sizes, ...) under ``train/``, the
cumulative counters (stale_dropped, dlq, duplicates_dropped, ...) and the totals (samples and
tokens trained, policy version) under ``totals/``. Non-finite values are left out. A trainer
resumed from a checkpoint goes on at the next step; a step committed just before a crash and not
yet logged is not logged again (the checkpoints and the ``train_steps`` table hold every step).

The loggers are side channels: one that fails is logged once and switched off, and training goes
on. TensorBoard needs ``pip install 'rollstream[tensorboard]'`` and writes event files under
``train_tensorboard_dir``; W&B needs ``pip install 'rollstream[wandb]'`` and runs offline by
default (``train_wandb_mode``), writing under ``train_wandb_dir`` (``wandb sync`` uploads later).
The W&B run id is derived from the checkpoint directory, so a restarted trainer resumes its run.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from rollstream.consumers.errors import TrainerError
from rollstream.consumers.training.checkpoint import CheckpointMeta
from rollstream.consumers.training.settings import TrainerSettings

__all__ = [
    "StepLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "build_loggers",
    "log_all",
    "step_scalars",
]

log = logging.getLogger("rollstream.trainer")


def step_scalars(meta: CheckpointMeta) -> dict[str, float]:
    """The scalars one step logs: ``train/<metric>``, ``totals/<counter>`` (finite only)."""
    out: dict[str, float] = {}
    for key, value in meta.metrics.items():
        out[f"train/{key}"] = float(value)
    for key, value in meta.counters.items():
        out[f"totals/{key}"] = float(value)
    out["totals/samples_trained"] = float(meta.samples_trained)
    out["totals/tokens_trained"] = float(meta.tokens_trained)
    out["totals/policy_version"] = float(meta.policy_version)
    return {k: v for k, v in sorted(out.items()) if math.isfinite(v)}


class StepLogger(Protocol):
    name: str

    def log_step(self, meta: CheckpointMeta) -> None: ...

    def close(self) -> None: ...


def _missing(extra: str, err: ImportError) -> TrainerError:
    return TrainerError(f"{extra} logging needs `pip install 'rollstream[{extra}]'` ({err})")


class TensorBoardLogger:
    """Scalars of each step as TensorBoard event files (torch's SummaryWriter)."""

    name = "tensorboard"

    def __init__(self, logdir: Path, *, flush_secs: int = 10) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise _missing("tensorboard", err) from err
        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        self._writer = SummaryWriter(log_dir=str(logdir), flush_secs=flush_secs)

    def log_step(self, meta: CheckpointMeta) -> None:
        for tag, value in step_scalars(meta).items():
            self._writer.add_scalar(tag, value, global_step=meta.step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def wandb_run_id(checkpoint_dir: Path) -> str:
    """A stable run id per checkpoint directory: a restarted trainer resumes its W&B run."""
    digest = hashlib.sha256(str(checkpoint_dir.resolve()).encode()).hexdigest()
    return f"rs-{digest[:16]}"


class WandbLogger:
    """Scalars of each step to a Weights & Biases run (offline unless train_wandb_mode says)."""

    name = "wandb"

    def __init__(
        self,
        project: str,
        *,
        mode: str,
        directory: Path,
        run_id: str,
        run_name: str | None,
        config: Mapping[str, Any],
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise _missing("wandb", err) from err
        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project,
            mode=mode,  # type: ignore[arg-type]  # validated by TrainerSettings
            dir=str(directory),
            id=run_id,
            name=run_name,
            resume="allow",
            config=dict(config),
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )

    def log_step(self, meta: CheckpointMeta) -> None:
        self._run.log(step_scalars(meta), step=meta.step)

    def close(self) -> None:
        self._run.finish()


def build_loggers(settings: TrainerSettings) -> list[StepLogger]:
    """The loggers the settings ask for (none by default). A missing extra raises TrainerError
    at start, before any step, rather than training without the log that was asked for."""
    out: list[StepLogger] = []
    if settings.train_tensorboard_dir is not None:
        out.append(TensorBoardLogger(settings.train_tensorboard_dir))
    if settings.train_wandb_project is not None:
        ckpt = settings.resolved_checkpoint_dir()
        out.append(
            WandbLogger(
                settings.train_wandb_project,
                mode=settings.train_wandb_mode,
                directory=settings.train_wandb_dir or settings.home / "wandb",
                run_id=wandb_run_id(ckpt),
                run_name=settings.train_wandb_run_name,
                config={"namespace": settings.namespace, **settings.train_config()},
            )
        )
    return out


def log_all(loggers: list[StepLogger], meta: CheckpointMeta) -> list[StepLogger]:
    """Log one step to every logger; returns the loggers still on (a failing one is dropped,
    with one warning: the checkpoint and the train_steps table hold the step anyway)."""
    kept = []
    for lg in loggers:
        try:
            lg.log_step(meta)
        except Exception:  # a side channel: training goes on without it
            log.warning("%s logger failed at step %d; switched off", lg.name, meta.step,
                        exc_info=True)  # fmt: skip
            continue
        kept.append(lg)
    return kept
