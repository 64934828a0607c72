"""One training step and what it needs: the policy model, its optimizer, and ``train_step``
(forward, PPO loss, backward, clip, AdamW) on a collated batch. The trainer's loop (trainer.py)
calls these; so can any other loop (bench/bench_intake.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from rollstream.consumers.training.ppo import LossConfig, batch_loss
from rollstream.consumers.training.settings import TrainerSettings
from rollstream.consumers.training.treepack import batch_token_logprobs

__all__ = ["build_optimizer", "load_policy", "train_step"]


def load_policy(settings: TrainerSettings) -> nn.Module:
    """The model to train, from ``model_path`` (created as the tiny model when allowed)."""
    from transformers import AutoModelForCausalLM

    path = settings.resolved_model_path()
    if settings.model_create:
        from rollstream.inference.tinymodel import ensure_tiny_model

        ensure_tiny_model(path, seed=settings.train_seed)
    kwargs: dict[str, Any] = {"dtype": torch.float32, "local_files_only": True}
    if settings.train_attn_implementation:
        kwargs["attn_implementation"] = settings.train_attn_implementation
    model: nn.Module = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.to(torch.device(settings.train_device)).train()


def build_optimizer(model: nn.Module, settings: TrainerSettings) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=settings.train_lr, weight_decay=settings.train_weight_decay)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, Tensor],
    config: LossConfig,
    max_grad_norm: float | None = 1.0,
) -> dict[str, float]:
    """One PPO step on a collated batch (already on the model's device): forward, loss,
    backward, clip, AdamW. Returns the loss stats as floats; ``skipped`` is 1 when the gradient
    was not finite and the weights were left unchanged."""
    model.train()
    logp = batch_token_logprobs(model, batch)  # (B, T), token-indexed like old_logprobs
    loss, stats = batch_loss(logp, batch, config)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf))
    finite = math.isfinite(norm)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": float(loss.detach()), "grad_norm": norm, "skipped": float(not finite)} | {
        k: float(v) for k, v in stats.items()
    }
