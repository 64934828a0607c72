"""The replay's rollout selection (store.queries.RolloutFilter): pure, no Kafka, no ClickHouse."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from rollstream.consumers.analytics.replay import ReplaySettings
from rollstream.consumers.store.queries import RolloutFilter
from rollstream.schemas import Event, Reward, RolloutStarted

TS = 1_735_689_600_000_000  # 2025-01-01 UTC


def started(
    rid: str = "r1", ts: int = TS, task: str = "t1", group: str = "g1", policy: int = 0,
    run: str = "",
) -> Event:  # fmt: skip
    body = RolloutStarted(task_id=task, group_id=group, policy_version=policy, run_id=run)
    return Event(f"{rid}-0", rid, 0, ts, body, "test")


def test_an_empty_filter_takes_every_started_rollout() -> None:
    f = RolloutFilter()
    assert not f.active
    assert f.matches(started())
    # the first event of a rollout in range must be its RolloutStarted
    assert not f.matches(Event("e", "r1", 3, TS, Reward(1.0), "test"))


@pytest.mark.parametrize(
    ("flt", "hit", "miss"),
    [
        (RolloutFilter(task_ids=("t1", "t2")), {"task": "t2"}, {"task": "t3"}),
        (RolloutFilter(group_ids=("g1",)), {"group": "g1"}, {"group": "g2"}),
        (RolloutFilter(run_ids=("run-a",)), {"run": "run-a"}, {"run": "run-b"}),
        (RolloutFilter(policy_versions=(2, 3)), {"policy": 3}, {"policy": 1}),
        (RolloutFilter(since_us=TS, until_us=TS + 10), {"ts": TS + 9}, {"ts": TS + 10}),
        (RolloutFilter(since_us=TS), {"ts": TS}, {"ts": TS - 1}),
        (RolloutFilter(rollout_ids=("r9",)), {"rid": "r9"}, {"rid": "r8"}),
    ],
)
def test_each_field_filters(flt: RolloutFilter, hit: dict[str, Any], miss: dict[str, Any]) -> None:
    assert flt.active
    assert flt.matches(started(**hit))
    assert not flt.matches(started(**miss))


def test_all_fields_must_match() -> None:
    f = RolloutFilter(task_ids=("t1",), policy_versions=(1,))
    assert f.matches(started(task="t1", policy=1))
    assert not f.matches(started(task="t1", policy=2))


def test_json_round_trip_and_unknown_fields() -> None:
    f = RolloutFilter(TS, TS + 5, ("t",), ("g",), ("r",), (1, 2), ("x",))
    assert RolloutFilter.from_json(f.to_json()) == f
    assert RolloutFilter.from_json(None) == RolloutFilter()
    with pytest.raises(ValueError):
        RolloutFilter.from_json({"tasks": ["t"]})


def test_sql_selects_started_rollouts_with_parameters() -> None:
    sql, params = RolloutFilter().sql("rollstream_x")
    assert sql == "SELECT rollout_id FROM rollstream_x.events" and params == {}
    sql, params = RolloutFilter(since_us=TS, task_ids=("t1",), policy_versions=(4,)).sql("db")
    assert "FROM db.rollouts WHERE source = 'started'" in sql
    assert "{f_since:Int64}" in sql and "{f_task_ids:Array(String)}" in sql
    assert "{f_policy_versions:Array(Int64)}" in sql
    assert params == {"f_since": TS, "f_task_ids": ["t1"], "f_policy_versions": [4]}
    with pytest.raises(Exception, match="identifier"):
        RolloutFilter().sql("bad-name; DROP")


def test_settings_build_the_filter_with_utc_times() -> None:
    s = ReplaySettings(
        replay_to="x", replay_since=dt.datetime(2025, 1, 1), replay_task_ids=["t1"],
        replay_until="2025-01-01T00:00:01+00:00",
    )  # fmt: skip
    f = s.rollout_filter()
    assert (f.since_us, f.until_us, f.task_ids) == (TS, TS + 1_000_000, ("t1",))
