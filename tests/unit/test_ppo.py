"""PPO-clip loss against values computed by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from rollstream.consumers.training.ppo import (
    LossConfig,
    loss_coefficients,
    ppo_clip_loss,
    token_logprobs,
)
from rollstream.consumers.training.treepack import tree_path_counts


def _logp_for_ratios(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, old_logp) whose exp-difference is exactly ``ratios``."""
    old = torch.full((len(ratios), len(ratios[0])), -2.0)
    logp = (old + torch.tensor(ratios).log()).requires_grad_()
    return logp, old


def test_token_logprobs_shift() -> None:
    # logits[t] predicts token t + 1. Probabilities per position:
    #   t=0: [0.25, 0.75]   t=1: [0.6, 0.4]   t=2: (unused, nothing follows)
    probs = torch.tensor([[[0.25, 0.75], [0.6, 0.4], [0.5, 0.5]]])
    targets = torch.tensor([[0, 1, 0]])
    logp = token_logprobs(probs.log() - 7.0, targets)
    # out[0] = 0 (first token unpredicted), out[1] = log p_0(1), out[2] = log p_1(0)
    expected = torch.tensor([[0.0, math.log(0.75), math.log(0.6)]])
    torch.testing.assert_close(logp, expected)


def test_clip_both_sides_positive_advantage() -> None:
    # ratios 1.5, 0.5, 1.1, 1.0 with A = +1; clip range [0.8, 1.28]:
    #   -min(1.5, 1.28) = -1.28   (clipped high: no gradient)
    #   -min(0.5, 0.8)  = -0.5    (below the range but A > 0: the min keeps the ratio)
    #   -min(1.1, 1.1)  = -1.1
    #   -min(1.0, 1.0)  = -1.0
    # token mean = -3.88 / 4 = -0.97
    logp, old = _logp_for_ratios([[1.5, 0.5, 1.1, 1.0]])
    loss, stats = ppo_clip_loss(
        logp, old, torch.tensor([1.0]), torch.ones(1, 4), normalization="token"
    )
    assert loss.item() == pytest.approx(-0.97, abs=1e-6)
    loss.backward()
    # d/dlogp of -r*A/4 is -r/4 where unclipped, 0 where clipped.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.125, -0.275, -0.25]]))
    assert stats["clip_frac_high"].item() == pytest.approx(0.25)
    assert stats["clip_frac_low"].item() == 0.0
    assert stats["clip_frac"].item() == pytest.approx(0.25)
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1 + 1.0) / 4)
    k3 = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 1.0)]
    assert stats["approx_kl"].item() == pytest.approx(sum(k3) / 4, rel=1e-5)


def test_clip_both_sides_negative_advantage() -> None:
    # A = -1: loss = -min(-r, -clip(r)) = max(r, clip(r)):
    #   max(1.5, 1.28) = 1.5 (A < 0: no clip above), max(0.5, 0.8) = 0.8 (clipped low),
    #   1.1, 1.0  -> mean 4.4 / 4 = 1.1
    logp, old = _logp_for_ratios([[1.5, 0.5, 1.1, 1.0]])
    loss, stats = ppo_clip_loss(
        logp, old, torch.tensor([-1.0]), torch.ones(1, 4), normalization="token"
    )
    assert loss.item() == pytest.approx(1.1, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.375, 0.0, 0.275, 0.25]]))
    assert stats["clip_frac_low"].item() == pytest.approx(0.25)
    assert stats["clip_frac_high"].item() == 0.0


def test_clip_higher_is_asymmetric() -> None:
    # ratio 1.25, A = +1: inside DAPO's [0.8, 1.28] -> -1.25; symmetric 0.2 clips -> -1.2.
    logp, old = _logp_for_ratios([[1.25]])
    adv, mask = torch.tensor([1.0]), torch.ones(1, 1)
    dapo, _ = ppo_clip_loss(logp, old, adv, mask)
    symmetric, _ = ppo_clip_loss(logp, old, adv, mask, clip_high=0.2)
    assert dapo.item() == pytest.approx(-1.25)
    assert symmetric.item() == pytest.approx(-1.2)
    # ratio 0.75, A = -1: the low side still clips at 0.8 -> max(0.75, 0.8) = 0.8.
    logp, old = _logp_for_ratios([[0.75]])
    low, _ = ppo_clip_loss(logp, old, torch.tensor([-1.0]), mask)
    assert low.item() == pytest.approx(0.8)


# Three samples at ratio 1, so each masked token's loss is -A:
#   sample 0: A =  1.0, mask [0, 1, 1] -> losses -1, -1   mean -1    weight 0.5 (rollout R1)
#   sample 1: A = -2.0, mask [0, 1, 0] -> loss   +2       mean  2    weight 0.5 (rollout R1)
#   sample 2: A =  1.5, mask [0, 1, 1] -> losses -1.5,-1.5 mean -1.5 weight 1.0 (rollout R2)
NORM_CASES = [
    # rollout: (0.5 * -1 + 0.5 * 2 + 1 * -1.5) / (0.5 + 0.5 + 1) = -1 / 2
    ("rollout", -0.5),
    # token: (-1 - 1 + 2 - 1.5 - 1.5) / 5 = -3 / 5
    ("token", -0.6),
    # sequence: (-1 + 2 - 1.5) / 3 = -1 / 6
    ("sequence", -1 / 6),
]


@pytest.mark.parametrize(("normalization", "expected"), NORM_CASES)
def test_normalizations(normalization: str, expected: float) -> None:
    logp = torch.full((3, 3), -1.0)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 1]])
    loss, stats = ppo_clip_loss(
        logp,
        logp.clone(),
        torch.tensor([1.0, -2.0, 1.5]),
        mask,
        weights=torch.tensor([0.5, 0.5, 1.0]),
        normalization=normalization,
    )
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["ratio_mean"].item() == pytest.approx(1.0)
    assert stats["tokens"].item() == 5


def test_rollout_normalization_counts_each_rollout_once() -> None:
    # One rollout split into 4 samples with weight 1/4 weighs as much as one with 1 sample.
    logp = torch.zeros(5, 2)
    mask = torch.ones(5, 2)
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0])
    weights = torch.tensor([0.25, 0.25, 0.25, 0.25, 1.0])
    loss, _ = ppo_clip_loss(logp, logp, adv, mask, weights=weights)
    assert loss.item() == pytest.approx(0.0)  # (-1 + 1) / 2
    token_loss, _ = ppo_clip_loss(logp, logp, adv, mask, normalization="token")
    assert token_loss.item() == pytest.approx(-0.6)  # (-8 + 2) / 10


@pytest.mark.parametrize("normalization", ["rollout", "token", "sequence"])
def test_micro_batches_with_the_step_denominator_add_up(normalization: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 5, generator=gen)
    old = logp + 0.3 * torch.randn(4, 5, generator=gen)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0])
    mask = (torch.rand(4, 5, generator=gen) > 0.3).float()
    weights = torch.tensor([0.5, 0.5, 1.0, 0.25])
    full, _ = ppo_clip_loss(logp, old, adv, mask, weights=weights, normalization=normalization)
    halves = [slice(0, 2), slice(2, 4)]
    step_denom = sum(loss_coefficients(mask[h], weights[h], normalization)[1] for h in halves)
    parts = [
        ppo_clip_loss(
            logp[h],
            old[h],
            adv[h],
            mask[h],
            weights=weights[h],
            denominator=step_denom,
            normalization=normalization,
        )[0]
        for h in halves
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-5)


def test_tree_coefficients_on_hand_drawn_tree() -> None:
    # Tree 0 -> 1 -> {2 -> 3, 4}, 0 -> 5 -> 6 with token 0 unmasked: paths 0-1-2-3 (3 masked),
    # 0-1-4 (2 masked), 0-5-6 (2 masked); in path mode each path has weight 1/3.
    parents = torch.tensor([[-1, 0, 1, 2, 1, 0, 5]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1]])
    counts = tree_path_counts(parents, mask)
    coef, denom = loss_coefficients(mask, torch.tensor([1.0]), "rollout", counts)
    # token 1 lies on the first two paths: 1/3 * (1/3 + 1/2) = 5/18; token 3: 1/3 * 1/3.
    expected = [0, 5 / 18, 1 / 9, 1 / 9, 1 / 6, 1 / 6, 1 / 6]
    torch.testing.assert_close(coef[0], torch.tensor(expected))
    assert denom.item() == 1.0
    coef, denom = loss_coefficients(mask, None, "token", counts)
    assert coef[0].tolist() == [0, 2, 1, 1, 1, 1, 1] and denom.item() == 7  # 3 + 2 + 2 tokens
    coef, denom = loss_coefficients(mask, None, "sequence", counts)
    assert denom.item() == 3  # three paths


def test_empty_mask_gives_zero_loss_not_nan() -> None:
    logp = torch.zeros(2, 3, requires_grad=True)
    for normalization in ("rollout", "token", "sequence"):
        loss, stats = ppo_clip_loss(
            logp,
            torch.full((2, 3), 50.0),  # huge log-ratio off the mask must not overflow
            torch.ones(2),
            torch.zeros(2, 3),
            normalization=normalization,
        )
        loss.backward()
        assert logp.grad is not None and torch.isfinite(logp.grad).all()
        assert loss.item() == 0.0
        assert stats["clip_frac"].item() == 0.0


def test_loss_config_validation() -> None:
    assert LossConfig() == LossConfig(clip_low=0.2, clip_high=0.28, normalization="rollout")
    with pytest.raises(ValueError):
        LossConfig(clip_low=1.0)
    with pytest.raises(ValueError):
        LossConfig(normalization="mean")


def test_dual_clip_bounds_an_off_policy_token_with_negative_advantage() -> None:
    # ratios 10, 2, 0.5 with A = -1; clip range [0.8, 1.28]; dual clip c = 3:
    #   -min(-10, -1.28) = 10  -> bounded to c * |A| = 3 (no gradient)
    #   -min(-2, -1.28)  = 2   (under the bound: kept, gradient r / 3)
    #   -min(-0.5, -0.8) = 0.8 (clipped low: no gradient)
    # token mean = (3 + 2 + 0.8) / 3
    logp, old = _logp_for_ratios([[10.0, 2.0, 0.5]])
    loss, stats = ppo_clip_loss(
        logp, old, torch.tensor([-1.0]), torch.ones(1, 3), normalization="token", dual_clip=3.0
    )
    assert loss.item() == pytest.approx(5.8 / 3, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]]))
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 3)
    off, _ = ppo_clip_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 3), normalization="token")
    assert off.item() == pytest.approx(12.8 / 3, rel=1e-6)  # unbounded without it
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.5)


def test_decoupled_objective_trains_stale_tokens_the_clip_would_drop() -> None:
    # behaviour ratios 1.5, 1.0, 0.5, 9.0 with A = +1 and the sequence normalized over 4 tokens.
    # PPO: the 1.5 token is clipped high (no gradient); 1.0 and 0.5 get ratio / 4; 9.0 clipped.
    # Decoupled: u = 1, so every token's gradient is its behaviour weight w / 4 (w = the ratio),
    # except 9.0 > behaviour_cap 5: left out (weight 0).
    ratios = [[1.5, 1.0, 0.5, 9.0]]
    mask, adv = torch.ones(1, 4), torch.tensor([1.0])
    grads = {}
    for objective in ("ppo", "decoupled"):
        logp, old = _logp_for_ratios(ratios)
        loss, stats = ppo_clip_loss(
            logp,
            old,
            adv,
            mask,
            normalization="token",
            objective=objective,  # type: ignore[arg-type]
        )
        loss.backward()
        assert logp.grad is not None
        grads[objective] = logp.grad
        if objective == "decoupled":
            assert float(stats["behaviour_capped_frac"]) == pytest.approx(0.25)
            assert float(stats["clip_frac"]) == 0.0  # nothing clipped against the proximal
            assert float(loss.detach()) == pytest.approx(-(1.5 + 1.0 + 0.5) / 4)
    torch.testing.assert_close(grads["ppo"], torch.tensor([[0.0, -0.25, -0.125, 0.0]]))
    torch.testing.assert_close(grads["decoupled"], torch.tensor([[-0.375, -0.25, -0.125, 0.0]]))


def test_decoupled_equals_ppo_on_fresh_samples() -> None:
    # old_logp = logp (a sample of the weights being trained): the same loss and gradient
    torch.manual_seed(0)
    base = torch.randn(3, 5)
    mask = (torch.rand(3, 5) > 0.3).float()
    adv = torch.tensor([0.7, -1.2, 0.1])
    out = {}
    for objective in ("ppo", "decoupled"):
        logp = base.clone().requires_grad_()
        loss, _ = ppo_clip_loss(logp, base.clone(), adv, mask, objective=objective)  # type: ignore[arg-type]
        loss.backward()
        out[objective] = (loss.detach(), logp.grad)
    torch.testing.assert_close(out["ppo"][0], out["decoupled"][0])
    torch.testing.assert_close(out["ppo"][1], out["decoupled"][1])
    with pytest.raises(ValueError, match="objective"):
        LossConfig(objective="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="behaviour_cap"):
        LossConfig(behaviour_cap=1.0)
