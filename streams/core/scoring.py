"""Scores for every trajectory, finished or not.

A scoring function is a plain callable with TRL's list-in, list-out contract: it takes a list of
trajectories (their rewards, status and nodes are set; their score is not) and returns one
``Score`` per trajectory, in order. Functions are chosen by a setting through a registry
(name -> callable); ``SCORERS`` holds the built-in ones and a deployment may pass its own
mapping in ``BuilderConfig.scorers``.

Built-in:
- ``default``: the last ``final`` reward when there is one (source "final"); otherwise the
  partial progress ``sum(milestone) + sum(partial) - sum(|penalty|)`` when there is any such
  reward (source "partial"); otherwise 0.0 (source "none").
- ``final_only``: the last ``final`` reward, else 0.0 (source "none").

Scores are finite by construction. A reward value must lie in [-REWARD_BOUND, REWARD_BOUND]
(1e6): the trajectory builder refuses any other (NaN, infinities, 1e308) as a ``bad_reward``
contract violation, bound for the dead-letter topic. The built-in functions clamp each value to
that range anyway (a state or record written before the bound existed) and add with
``math.fsum``, and ``score_trajectories`` clamps whatever a function returns into
[-SCORE_BOUND, SCORE_BOUND] (1e9; an infinity becomes the bound of its sign). So two finite
partial rewards near 1.7e308 can no longer sum to inf and stop the worker on the same record at
every restart. A NaN score is a bug of the function: ``ScoringError``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from rollstream.schemas.events import REWARD_BOUND, RewardKind, Trajectory

from .errors import ScoringError

__all__ = [
    "REWARD_BOUND",
    "SCORERS",
    "SCORE_BOUND",
    "Score",
    "ScoreFn",
    "ScoreSource",
    "default_score",
    "final_only_score",
    "reward_in_bounds",
    "score_trajectories",
]

SCORE_BOUND = 1e9  # |Trajectory.score| <= SCORE_BOUND (clamped)


def reward_in_bounds(value: float) -> bool:
    """True for a finite reward value within [-REWARD_BOUND, REWARD_BOUND]."""
    return -REWARD_BOUND <= value <= REWARD_BOUND  # False for NaN


def _clamp(value: float, bound: float) -> float:
    return min(max(value, -bound), bound)


class ScoreSource:
    FINAL = "final"
    PARTIAL = "partial"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Score:
    value: float
    source: str  # ScoreSource: final | partial | none


ScoreFn = Callable[[Sequence[Trajectory]], list[Score]]


def _bounded(value: float) -> float:
    """A reward value inside [-REWARD_BOUND, REWARD_BOUND] (NaN counts as 0)."""
    return 0.0 if math.isnan(value) else _clamp(value, REWARD_BOUND)


def _last_final(trajectory: Trajectory) -> float | None:
    value = None
    for reward in trajectory.rewards:
        if reward.kind == RewardKind.FINAL:
            value = _bounded(reward.value)
    return value


def default_score(trajectories: Sequence[Trajectory]) -> list[Score]:
    """Final reward when there is one, else partial progress (penalties subtract), else 0."""
    scores = []
    for trajectory in trajectories:
        final = _last_final(trajectory)
        if final is not None:
            scores.append(Score(final, ScoreSource.FINAL))
            continue
        terms = []
        for reward in trajectory.rewards:
            if reward.kind in (RewardKind.MILESTONE, RewardKind.PARTIAL):
                terms.append(_bounded(reward.value))
            elif reward.kind == RewardKind.PENALTY:
                terms.append(-abs(_bounded(reward.value)))
        if not terms:
            scores.append(Score(0.0, ScoreSource.NONE))
            continue
        # fsum of bounded terms is exact and finite; the clamp keeps it within the score bound
        progress = _clamp(math.fsum(terms), SCORE_BOUND)
        scores.append(Score(progress, ScoreSource.PARTIAL))
    return scores


def final_only_score(trajectories: Sequence[Trajectory]) -> list[Score]:
    """The final reward, else 0.0 with source "none" (partial progress ignored)."""
    scores = []
    for trajectory in trajectories:
        final = _last_final(trajectory)
        scores.append(Score(0.0, ScoreSource.NONE) if final is None else Score(final, "final"))
    return scores


SCORERS: Mapping[str, ScoreFn] = MappingProxyType(
    {"default": default_score, "final_only": final_only_score}
)


def score_trajectories(trajectories: Sequence[Trajectory], fn: ScoreFn) -> None:
    """Set ``score`` and ``score_source`` of each trajectory in place from ``fn``; each score
    is clamped into [-SCORE_BOUND, SCORE_BOUND]; a NaN one is ScoringError."""
    try:
        scores = fn(trajectories)
    except Exception as exc:
        raise ScoringError(f"scoring function {fn!r} raised: {exc}") from exc
    if len(scores) != len(trajectories):
        raise ScoringError(f"{fn!r} returned {len(scores)} scores for {len(trajectories)}")
    for trajectory, score in zip(trajectories, scores, strict=True):
        value = float(score.value)
        if math.isnan(value):
            raise ScoringError(f"{fn!r} returned a NaN score")
        trajectory.score = _clamp(value, SCORE_BOUND)
        trajectory.score_source = score.source
