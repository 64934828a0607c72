"""The demo's round loop ends once the policy has nothing left to learn (infra/demo/loops.py);
the events topic it reads rounds from is the I/O edge, replaced by the rounds' results."""

from __future__ import annotations

import time
from typing import Any

import pytest

from rollstream.infra.demo import loops
from rollstream.infra.demo.agent import AgentResult, demo_tasks


def result(i: int, final: float, version: int = 3, error: str | None = None) -> AgentResult:
    return AgentResult(f"r{i}", "t0", "g0", 2, 0, final=final, policy_versions=[version],
                       error=error)  # fmt: skip


def test_a_round_has_spread_when_some_group_has_different_final_rewards() -> None:
    def of(group: str, final: float, error: str | None = None) -> AgentResult:
        return AgentResult("r", "t", group, 2, 0, final=final, error=error)

    assert loops.round_has_spread([of("a", 0.0), of("a", 0.0), of("b", 0.3), of("b", 0.5)])
    assert not loops.round_has_spread([of("a", 0.0), of("a", 0.0), of("b", 0.5), of("b", 0.5)])
    assert not loops.round_has_spread([of("a", 0.0), of("b", 0.5)])  # spread across groups only
    assert not loops.round_has_spread([of("a", 0.0), of("a", 0.7, error="timeout")])
    assert not loops.round_has_spread([])


def test_a_round_is_solved_only_when_every_rollout_finished_at_the_top_reward() -> None:
    assert loops.round_solved([result(i, 1.0) for i in range(4)], 4)
    assert not loops.round_solved([result(i, 1.0) for i in range(3)], 4)  # one never finished
    assert not loops.round_solved([*(result(i, 1.0) for i in range(3)), result(3, 0.96)], 4)
    assert not loops.round_solved(
        [*(result(i, 1.0) for i in range(3)), result(3, 1.0, error="x")], 4
    )
    assert not loops.round_solved([], 0)


class Clock:
    """VersionClock's interface; the served version never moves (nothing is trained)."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {3: 1.0}
        self.waited: list[int] = []

    def poll(self, every_s: float = 0.25) -> int:
        return 3

    def wait_for(self, version: int, deadline: float, check: Any) -> None:
        self.waited.append(version)


def feed(clock: Clock, seconds: float = 60) -> loops.Feed:
    tasks = demo_tasks(1, 0)
    make = loops.job_maker("p", tasks, group_size=4, turns=2, max_tokens=8, run_id="run", env={})
    return loops.Feed(
        reader=None,
        fold=None,
        clock=clock,
        prefix="p",
        tasks=tasks,
        make_job=make,
        submit=lambda job: None,
        steps=30,
        deadline=time.monotonic() + seconds,
        check=lambda: None,
        progress=lambda results, n: None,
    )


@pytest.mark.parametrize("sync", [False, True])
def test_rounds_end_after_the_solved_streak_without_waiting_for_a_policy(
    monkeypatch: pytest.MonkeyPatch, sync: bool
) -> None:
    scripted = [
        [result(i, 0.2 * i) for i in range(4)],
        [result(i, 1.0) for i in range(4)],
        [*(result(i, 1.0) for i in range(3)), result(3, 0.9)],  # the streak starts again
        [result(i, 1.0) for i in range(4)],
        [result(i, 1.0) for i in range(4)],
        [result(i, 0.1) for i in range(4)],  # never reached
    ]
    calls = iter(scripted)
    monkeypatch.setattr(loops, "wait_round", lambda *a, **k: next(calls))
    clock = Clock()
    f = feed(clock)
    results = loops.rounds(f, 4, sync, solved_rounds=2)
    assert len(results) == 20 and f.solved
    # sync waits for the policy trained on a round with spread only
    assert clock.waited == ([4, 4] if sync else [])


def test_without_a_solved_streak_rounds_run_on_to_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loops, "wait_round", lambda *a, **k: [result(i, 1.0) for i in range(4)])
    f = feed(Clock(), seconds=0.3)
    results = loops.rounds(f, 4, False, solved_rounds=0)
    assert len(results) >= 8 and not f.solved


@pytest.mark.parametrize("dapo", [True, False])
def test_sync_waits_for_no_policy_after_a_round_without_spread(
    monkeypatch: pytest.MonkeyPatch, dapo: bool
) -> None:
    # every rollout scored 0: with the DAPO filter no sample comes, so no policy would
    monkeypatch.setattr(loops, "wait_round", lambda *a, **k: [result(i, 0.0) for i in range(4)])
    clock = Clock()
    f = feed(clock, seconds=0.3)
    loops.rounds(f, 4, True, solved_rounds=2, drop_zero_variance=dapo)
    assert (clock.waited == []) is dapo and not f.solved
