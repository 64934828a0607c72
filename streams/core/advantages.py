"""Rollout-level advantages of one group (GRPO family), as plain numpy functions.

    A_i = (r_i - b_i) / (std(r) + eps)      b_i = mean(r), or mean of the others (leave-one-out)

without the division when ``normalize_std`` is off. A group whose rewards all agree carries no
learning signal (every A_i is 0): ``is_zero_variance`` tells the aggregator to drop it (DAPO).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .config import AdvantageConfig

__all__ = ["advantages", "is_zero_variance"]

_DEFAULT = AdvantageConfig()


def is_zero_variance(rewards: Sequence[float], config: AdvantageConfig = _DEFAULT) -> bool:
    r = np.asarray(rewards, dtype=np.float64)
    return len(r) < 2 or float(r.max() - r.min()) <= config.zero_variance_tol


def advantages(
    rewards: Sequence[float], config: AdvantageConfig = _DEFAULT
) -> np.ndarray[Any, np.dtype[np.float64]]:
    """(n,) rewards -> (n,) float64 advantages, in the same order."""
    r = np.asarray(rewards, dtype=np.float64)
    n = len(r)
    if n < 2:
        return np.zeros(n, np.float64)
    baseline = (r.sum() - r) / (n - 1) if config.leave_one_out else r.mean()
    centred = r - baseline
    if not config.normalize_std:
        return centred
    std = float(r.std(ddof=config.std_ddof))
    return centred / (std + config.eps)
