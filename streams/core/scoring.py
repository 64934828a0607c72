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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from rollstream.schemas.events import RewardKind, Trajectory

from .errors import ScoringError

__all__ = [
    "SCORERS",
    "Score",
    "ScoreFn",
    "ScoreSource",
    "default_score",
    "final_only_score",
    "score_trajectories",
]


class ScoreSource:
    FINAL = "final"
    PARTIAL = "partial"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Score:
    value: float
    source: str  # ScoreSource: final | partial | none


ScoreFn = Callable[[Sequence[Trajectory]], list[Score]]


def _last_final(trajectory: Trajectory) -> float | None:
    value = None
    for reward in trajectory.rewards:
        if reward.kind == RewardKind.FINAL:
            value = reward.value
    return value


def default_score(trajectories: Sequence[Trajectory]) -> list[Score]:
    """Final reward when there is one, else partial progress (penalties subtract), else 0."""
    scores = []
    for trajectory in trajectories:
        final = _last_final(trajectory)
        if final is not None:
            scores.append(Score(final, ScoreSource.FINAL))
            continue
        progress, seen = 0.0, False
        for reward in trajectory.rewards:
            if reward.kind in (RewardKind.MILESTONE, RewardKind.PARTIAL):
                progress += reward.value
                seen = True
            elif reward.kind == RewardKind.PENALTY:
                progress -= abs(reward.value)
                seen = True
        scores.append(
            Score(progress, ScoreSource.PARTIAL) if seen else Score(0.0, ScoreSource.NONE)
        )
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
    """Set ``score`` and ``score_source`` of each trajectory in place from ``fn``."""
    try:
        scores = fn(trajectories)
    except Exception as exc:
        raise ScoringError(f"scoring function {fn!r} raised: {exc}") from exc
    if len(scores) != len(trajectories):
        raise ScoringError(f"{fn!r} returned {len(scores)} scores for {len(trajectories)}")
    for trajectory, score in zip(trajectories, scores, strict=True):
        if not math.isfinite(score.value):
            raise ScoringError(f"{fn!r} returned a non-finite score {score.value}")
        trajectory.score = float(score.value)
        trajectory.score_source = score.source
