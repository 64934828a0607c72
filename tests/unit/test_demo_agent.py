"""The demo's pure parts: reward functions, tasks, the reward-per-version table; and the
configuration doc is current."""

from __future__ import annotations

from pathlib import Path

from rollstream.infra import configdoc
from rollstream.infra.demo import rewards_by_version
from rollstream.infra.demo.agent import (
    AgentResult,
    count_digits,
    demo_tasks,
    digit_fraction,
    digit_rewards,
)


def test_digit_fraction() -> None:
    assert digit_fraction("") == 0.0
    assert digit_fraction("   ") == 0.0
    assert digit_fraction("42") == 1.0
    assert digit_fraction("a1 b2") == 0.5
    assert digit_rewards(["1x", "xx", "99"]) == [0.5, 0.0, 1.0]
    assert count_digits("a1b22") == "3"


def test_tasks_are_deterministic() -> None:
    assert demo_tasks(3, seed=1) == demo_tasks(3, seed=1)
    assert len({t.task_id for t in demo_tasks(4)}) == 4


def test_rewards_by_version_uses_first_call_version_and_skips_failures() -> None:
    results = [
        AgentResult("r1", "t", "g", 2, 0, [0.0, 1.0], 0.5, [0, 1]),
        AgentResult("r2", "t", "g", 2, 0, [1.0, 1.0], 1.0, [1, 1]),
        AgentResult("r3", "t", "g", 0, 0, [], 0.0, [2], error="boom"),
    ]
    assert rewards_by_version(results) == {0: [0.5], 1: [1.0]}


def test_configuration_doc_is_current() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert doc.read_text() == configdoc.render(), (
        "docs/configuration.md is stale: python -m rollstream.infra.configdoc > "
        "docs/configuration.md"
    )
