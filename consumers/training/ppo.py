"""PPO-clip loss with clip-higher and rollout-level normalization, as small pure torch functions.

Alignment (the one thing to get right). A sample's arrays are indexed by token:
    input_ids[t]            the token
    loss_mask[t]            1 if the policy generated it
    behaviour_logprobs[t]   log p_behaviour(input_ids[t] | input_ids[:t])
so the logprob the trainer needs at t comes from the logits at t - 1 (path mode) or at
parent_indices[t] (tree mode, see treepack). ``token_logprobs`` returns the trainer's logprobs in
that same token indexing, (B, T) with 0 at t = 0, so logp, old_logp and mask line up directly.

Loss. ratio = exp(logp - old_logp) per token; with the sample's advantage A broadcast over its
tokens, the per-token loss is -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
(clip_high > clip_low is DAPO's clip-higher). It is reduced as sum(coef * loss) / denominator:
    "rollout"  (default) each sample's token-mean loss times its loss_weight, summed, divided by
               the sum of loss weights; loss weights are 1 / (samples of the rollout), so the sum
               is the number of rollouts in the batch and each rollout counts once.
    "token"    sum over all masked tokens / number of masked tokens (DAPO token level; loss
               weights unused).
    "sequence" mean over samples of each sample's token-mean (GRPO; loss weights unused).
Tree samples reduce through the same formulas with PathCounts (see treepack): a tree sample
counts as its L leaf paths with loss weight W/L each, so tree and path mode give one objective.
Stats (clip fractions, approx KL, mean ratio) are weighted like the loss, so they too are the
same in both modes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rollstream.consumers.training.treepack import PathCounts, gather_logprobs, sequence_path_counts

__all__ = [
    "LossConfig",
    "Normalization",
    "PathCounts",
    "batch_loss",
    "loss_coefficients",
    "ppo_clip_loss",
    "token_logprobs",
]

Normalization = Literal["rollout", "token", "sequence"]
NORMALIZATIONS: tuple[str, ...] = ("rollout", "token", "sequence")


@dataclass(frozen=True)
class LossConfig:
    """PPO-clip settings. clip_high > clip_low is DAPO's clip-higher."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    normalization: Normalization = "rollout"

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}")


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """Causal LM logprobs in token indexing. logits (B, T, V), targets (B, T) -> (B, T) float32.

    out[:, t] = log softmax(logits[:, t - 1])[targets[:, t]]: logits at t predict token t + 1,
    so position t's logprob comes from t - 1. out[:, 0] = 0 (nothing predicts the first token)."""
    idx = torch.arange(targets.shape[1], device=targets.device)
    sources = (idx - 1).expand_as(targets)  # (B, T)
    return gather_logprobs(logits, targets, sources)


def loss_coefficients(
    mask: Tensor,
    weights: Tensor | None = None,
    normalization: Normalization = "rollout",
    counts: PathCounts | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token coefficients and the denominator: loss = sum(coef * token_loss) / denominator.

    mask (B, T), weights (B,) loss weights (default 1), counts: PathCounts (default: one path per
    sample). Returns coef (B, T) and a 0-d denominator (clamped away from 0; an empty batch gives
    a zero loss)."""
    mask = mask.float()
    counts = sequence_path_counts(mask) if counts is None else counts
    if normalization == "rollout":
        w = torch.ones(mask.shape[0], device=mask.device) if weights is None else weights.float()
        per_path = (w / counts.num_paths.clamp(min=1.0)).unsqueeze(1)  # (B, 1), W / L
        coef = mask * counts.inv_path_len * per_path  # (B, T)
        denom = w.sum()
    elif normalization == "token":
        coef = mask * counts.paths_through  # (B, T)
        denom = coef.sum()
    elif normalization == "sequence":
        coef = mask * counts.inv_path_len  # (B, T)
        denom = counts.num_paths.sum()
    else:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    return coef, denom.clamp(min=1e-12)


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    weights: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    normalization: Normalization = "rollout",
    counts: PathCounts | None = None,
    denominator: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip loss. logp, old_logp, mask (B, T); advantages, weights (B,).

    counts: tree PathCounts (default: one path per sample). denominator: for gradient
    accumulation, the whole step's denominator (the sum of ``loss_coefficients`` denominators
    over its micro-batches), so the micro-batch losses add up to the full-batch loss.

    Returns the 0-d loss and detached stats: clip_frac (share of tokens whose gradient the clip
    removed), clip_frac_low / clip_frac_high (ratio below 1 - clip_low with A < 0 / above
    1 + clip_high with A > 0), approx_kl (k3 estimate of KL(behaviour || current)), ratio_mean,
    all weighted like the loss, and tokens (masked tokens in the batch)."""
    log_ratio = (logp - old_logp) * mask  # (B, T), 0 off the mask so exp stays finite
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = advantages.float().unsqueeze(1)  # (B, 1) -> broadcast over tokens
    unclipped = ratio * adv  # (B, T)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv  # (B, T)
    token_loss = -torch.minimum(unclipped, clipped)  # (B, T)

    coef, denom = loss_coefficients(mask, weights, normalization, counts)  # (B, T), ()
    if denominator is not None:
        denom = torch.as_tensor(denominator, dtype=coef.dtype, device=coef.device)
    loss = (coef * token_loss).sum() / denom

    with torch.no_grad():
        share = coef / coef.sum().clamp(min=1e-12)  # (B, T), sums to 1 over masked tokens
        low = (ratio < 1.0 - clip_low) & (adv < 0)  # (B, T)
        high = (ratio > 1.0 + clip_high) & (adv > 0)  # (B, T)
        stats = {
            "clip_frac": (share * (low | high)).sum(),
            "clip_frac_low": (share * low).sum(),
            "clip_frac_high": (share * high).sum(),
            "approx_kl": (share * (ratio - 1.0 - log_ratio)).sum(),
            "ratio_mean": (share * ratio).sum(),
            "tokens": mask.float().sum(),
        }
    return loss, stats


def batch_loss(
    logp: Tensor, batch: Mapping[str, Tensor], config: LossConfig | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """ppo_clip_loss over a batch from ``batching.collate``. logp (B, T)."""
    config = LossConfig() if config is None else config
    counts = PathCounts(batch["paths_through"], batch["inv_path_len"], batch["num_paths"])
    return ppo_clip_loss(
        logp,
        batch["old_logprobs"],
        batch["advantages"],
        batch["loss_mask"],
        weights=batch["weights"],
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        normalization=config.normalization,
        counts=counts,
    )
