"""Settings of the trainer (``rollstream train``): ``ROLLSTREAM_TRAIN_*``, the model and
checkpoint paths, plus the common ones. The debug pause (``train_debug_pause``) is described in
trainer.py; so is ``train_follow`` (training by another run's step manifests, as a retrain does).
``train_config()`` is what a checkpoint records of these: the settings that decide what a step
computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from rollstream.consumers.errors import TrainerError
from rollstream.consumers.training.ppo import LossConfig, Normalization, Objective
from rollstream.schemas.settings import NONE_FROM_ENV, CommonSettings

__all__ = ["DEBUG_STAGES", "TRAINER_GROUP", "TRAIN_CONFIG_FIELDS", "TrainerSettings"]

TRAINER_GROUP = "rollstream-trainer-v1"
DEBUG_STAGES = ("optimizer", "checkpoint", "committed", "published")
# the settings that decide what a step computes: recorded in every checkpoint (train_config)
TRAIN_CONFIG_FIELDS = (
    "train_lr",
    "train_weight_decay",
    "train_max_grad_norm",
    "train_token_budget",
    "train_batch_samples",
    "train_max_staleness",
    "train_dedup_window",
    "train_clip_low",
    "train_clip_high",
    "train_dual_clip",
    "train_normalization",
    "train_objective",
    "train_behaviour_cap",
    "train_seed",
    "train_torch_threads",
    "train_attn_implementation",
    "train_device",
)


class TrainerSettings(CommonSettings):
    """Settings of the trainer (ROLLSTREAM_*; trainer-only ones are ROLLSTREAM_TRAIN_*).
    An optional setting is unset with the value ``none`` (ROLLSTREAM_TRAIN_MAX_GRAD_NORM=none)."""

    model_config = NONE_FROM_ENV

    model_path: Path | None = None  # initial weights; default <home>/models/tiny (as the server)
    model_create: bool = True  # create the tiny model at model_path when none is there
    checkpoint_dir: Path | None = None  # default <home>/checkpoints
    checkpoint_keep: int = 3  # newest checkpoints kept
    checkpoint_fsync: bool = True  # fsync checkpoint files and folders (crash safety)
    train_group_id: str = TRAINER_GROUP  # the trainer's consumer group
    train_instance_id: str | None = "trainer-0"  # static group membership: fast restarts
    train_lr: float = 1e-5  # AdamW learning rate
    train_weight_decay: float = 0.0  # AdamW weight decay
    train_max_grad_norm: float | None = 1.0  # gradient clipping (none: off)
    train_token_budget: int = 16384  # padded tokens (B * T_max) per step
    train_batch_samples: int | None = None  # cap on samples per step
    train_max_staleness: int = 4  # samples more versions old are dropped
    # sample ids of the last N trained samples, kept (and checkpointed) to drop re-emitted ones
    train_dedup_window: int = Field(1_000_000, ge=0, le=100_000_000)
    train_clip_low: float = 0.2  # PPO clip below 1
    train_clip_high: float = 0.28  # clip-higher above 1 (DAPO)
    train_dual_clip: float | None = 3.0  # an A < 0 token loses at most this x |A| (none: off)
    train_normalization: Normalization = "rollout"  # loss over rollouts, tokens or sequences
    # ppo: the clip against the behaviour policy; decoupled: AReaL's decoupled PPO, the clip
    # against the weights being trained and a per-token behaviour weight (docs/trainer.md)
    train_objective: Objective = "decoupled"
    train_behaviour_cap: float = Field(5.0, gt=1.0, le=1000.0)  # decoupled: tokens past it left out
    train_max_steps: int | None = None  # total steps (a restart continues towards it)
    train_device: str = "cpu"  # torch device
    train_attn_implementation: str | None = None  # default: the model's (sdpa)
    train_torch_threads: int | None = None  # default: torch's
    train_seed: int = 0  # torch seed
    train_start: Literal["earliest", "latest"] = "earliest"  # partitions with no checkpoint
    train_poll_timeout_s: float = 0.5  # longest wait of one poll
    train_poll_records: int = 500  # records taken per poll
    train_flush_idle_s: float | None = 5.0  # train a partial batch after this long idle
    train_exit_idle_s: float | None = None  # return after this long idle with nothing pending
    train_session_timeout_ms: int = 6000  # consumer group session
    train_max_poll_interval_ms: int = 1_800_000  # Kafka max.poll.interval.ms
    train_commit_offsets: bool = True  # commit to the group after each checkpoint (lag)
    train_publish_timeout_s: float = 30.0  # longest wait to deliver a policy version
    train_debug_pause: str | None = None  # "STAGE:STEP", see the module docstring
    train_debug_pause_s: float = 3600.0  # how long a debug pause lasts
    # step k trains exactly the samples step k of another run trained, in order (retrain)
    train_follow: Path | None = None  # that run's checkpoint root, whose manifests are followed
    # experiment loggers (loggers.py; extras rollstream[tensorboard], rollstream[wandb]): off
    train_tensorboard_dir: Path | None = None  # TensorBoard event files of each step
    train_wandb_project: str | None = Field(None, min_length=1, max_length=128)  # set: log to W&B
    train_wandb_mode: Literal["offline", "online", "disabled"] = "offline"  # offline: no network
    train_wandb_dir: Path | None = None  # default <home>/wandb
    train_wandb_run_name: str | None = Field(None, max_length=128)  # W&B run name

    def resolved_model_path(self) -> Path:
        return self.model_path if self.model_path is not None else self.home / "models" / "tiny"

    def resolved_checkpoint_dir(self) -> Path:
        return self.checkpoint_dir if self.checkpoint_dir is not None else self.home / "checkpoints"

    def loss_config(self) -> LossConfig:
        return LossConfig(
            self.train_clip_low,
            self.train_clip_high,
            self.train_normalization,
            self.train_dual_clip,
            self.train_objective,
            self.train_behaviour_cap,
        )

    def train_config(self) -> dict[str, Any]:
        """The settings that decide what a step computes (recorded in each checkpoint)."""
        return {name: getattr(self, name) for name in TRAIN_CONFIG_FIELDS}

    def debug_pause(self) -> tuple[str, int] | None:
        if not self.train_debug_pause:
            return None
        stage, _, step = self.train_debug_pause.partition(":")
        if stage not in DEBUG_STAGES or not step.isdigit():
            raise TrainerError(
                f"train_debug_pause must be STAGE:STEP with STAGE in {DEBUG_STAGES}, "
                f"got {self.train_debug_pause!r}"
            )
        return stage, int(step)
