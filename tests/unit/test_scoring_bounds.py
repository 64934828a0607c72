"""Scores are finite by construction: the poison pill of two finite partial rewards near
1.7e308 (whose sum is inf) is refused at the event boundary as a bad_reward dead letter, the
built-in scorers never overflow whatever finite values they are given, and any function's score
is clamped into [-SCORE_BOUND, SCORE_BOUND]."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollstream.schemas import Codec, Event, Reward, RolloutFinished, RolloutStarted, Trajectory
from rollstream.schemas.dlq import read_headers
from rollstream.schemas.events import RewardRecord
from rollstream.streams.books import RolloutBook, Sink
from rollstream.streams.core import BuilderConfig, Invalid, Score, ScoringError, replay
from rollstream.streams.core.scoring import (
    REWARD_BOUND,
    SCORE_BOUND,
    default_score,
    final_only_score,
    reward_in_bounds,
    score_trajectories,
)

T0 = 1_700_000_000_000_000
ATTACK = [1.7e308, 1.7e308]  # finite, each; their sum is inf
KINDS = ["final", "partial", "milestone", "penalty"]
codec = Codec()


def rollout(rewards: list[tuple[float, str]], rid: str = "r1") -> list[Event]:
    bodies: list[Any] = [RolloutStarted(task_id="t", group_id="g", group_size=2)]
    bodies += [Reward(value, kind) for value, kind in rewards]
    bodies.append(RolloutFinished("failed"))
    return [Event(f"{rid}-{i}", rid, i, T0 + i, body) for i, body in enumerate(bodies)]


def trajectory(rewards: list[tuple[float, str]]) -> Trajectory:
    return Trajectory(
        "r1", "t", "g", "failed", 0.0, [], rewards=[RewardRecord(v, k) for v, k in rewards]
    )


def test_the_attack_is_refused_at_the_event_boundary_and_the_rollout_still_closes() -> None:
    events = rollout([(v, "partial") for v in ATTACK])
    _, outputs = replay(events)  # before the bound: ScoringError at the close, every time
    invalid = [o for o in outputs if isinstance(o, Invalid)]
    assert [(o.event.seq, str(o.code)) for o in invalid] == [(1, "bad_reward"), (2, "bad_reward")]
    assert "not a number in [-1e+06, 1e+06]" in invalid[0].reason
    (closed,) = [o for o in outputs if isinstance(o, Trajectory)]
    assert (closed.score, closed.score_source) == (0.0, "none") and closed.rewards == []


def test_the_attack_through_the_processor_shell_goes_to_the_dlq_and_the_rollout_closes() -> None:
    """The faust agent's book (streams/books.py) over the encoded records, as the worker sees
    them: no exception reaches the worker, so a restart does not meet the same record again."""
    book = RolloutBook(BuilderConfig(), codec, source_topic="ns.rollout.events", processor="p")
    steps = [
        book.on_record(0, i, e.rollout_id.encode(), codec.encode(e), T0)
        for i, e in enumerate(rollout([(v, "partial") for v in ATTACK]))
    ]
    dead = [o for s in steps for o in s.sends if o.sink is Sink.DLQ]
    assert [read_headers(o.headers)["code"] for o in dead] == ["bad_reward", "bad_reward"]
    (sent,) = [o for o in steps[-1].sends if o.sink is Sink.TRAJECTORIES]
    assert math.isfinite(codec.decode(sent.value, expect=Trajectory).score)


def test_the_attack_given_straight_to_the_scorers_stays_finite() -> None:
    """A trajectory built before the bound existed (a restored state, an old record)."""
    for kinds in (["partial", "partial"], ["milestone", "partial"], ["penalty", "penalty"]):
        rewards = list(zip(ATTACK, kinds, strict=True))
        (score,) = default_score([trajectory(rewards)])
        assert math.isfinite(score.value) and abs(score.value) <= SCORE_BOUND
        assert score.source == "partial" and abs(score.value) == 2 * REWARD_BOUND
    t = trajectory([(v, "partial") for v in ATTACK])
    score_trajectories([t], default_score)
    assert t.score == 2 * REWARD_BOUND


@pytest.mark.parametrize(
    "value, accepted",
    [
        (REWARD_BOUND, True),
        (-REWARD_BOUND, True),
        (0.0, True),
        (math.nextafter(REWARD_BOUND, math.inf), False),
        (-1.7e308, False),
        (math.inf, False),
        (-math.inf, False),
        (math.nan, False),
    ],
)
def test_reward_values_are_bounded_at_the_event_boundary(value: float, accepted: bool) -> None:
    assert reward_in_bounds(value) is accepted
    _, outputs = replay(rollout([(value, "final")]))
    (closed,) = [o for o in outputs if isinstance(o, Trajectory)]
    refused = [o for o in outputs if isinstance(o, Invalid)]
    assert (not refused) is accepted
    assert closed.score == (value if accepted else 0.0)


_FINITE = st.floats(allow_nan=False, allow_infinity=False)
_REWARDS = st.lists(st.tuples(_FINITE, st.sampled_from(KINDS)), max_size=40)


@given(_REWARDS)
def test_scorers_never_raise_and_stay_finite_over_any_finite_rewards(
    rewards: list[tuple[float, str]],
) -> None:
    for fn in (default_score, final_only_score):
        (score,) = fn([trajectory(rewards)])
        assert math.isfinite(score.value) and abs(score.value) <= SCORE_BOUND
        t = trajectory(rewards)
        score_trajectories([t], fn)
        assert math.isfinite(t.score)


@given(_REWARDS)
def test_the_builder_never_raises_and_scores_stay_finite(rewards: list[tuple[float, str]]) -> None:
    _, outputs = replay(rollout(rewards))
    (closed,) = [o for o in outputs if isinstance(o, Trajectory)]
    assert math.isfinite(closed.score) and abs(closed.score) <= SCORE_BOUND
    refused = {o.event.seq for o in outputs if isinstance(o, Invalid)}
    assert refused == {i + 1 for i, (v, _) in enumerate(rewards) if abs(v) > REWARD_BOUND}


_BOUNDED = st.floats(-REWARD_BOUND, REWARD_BOUND)


@given(st.lists(st.tuples(_BOUNDED, st.sampled_from(KINDS[1:])), min_size=1, max_size=40))
def test_bounded_partial_progress_is_the_exact_sum(rewards: list[tuple[float, str]]) -> None:
    """Within the bound nothing changes: milestones and partials add, penalties subtract."""
    terms = [-abs(v) if k == "penalty" else v for v, k in rewards]
    (score,) = default_score([trajectory(rewards)])
    assert (score.value, score.source) == (math.fsum(terms), "partial")


def test_any_functions_score_is_clamped_and_nan_is_a_bug() -> None:
    for returned, want in (
        (math.inf, SCORE_BOUND),
        (-math.inf, -SCORE_BOUND),
        (1e300, SCORE_BOUND),
    ):
        t = trajectory([])
        score_trajectories([t], lambda ts, r=returned: [Score(r, "partial") for _ in ts])
        assert t.score == want
    with pytest.raises(ScoringError, match="NaN"):
        score_trajectories([trajectory([])], lambda ts: [Score(math.nan, "partial") for _ in ts])
