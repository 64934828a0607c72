"""Row mapping (rollstream.consumers.store.rows): every record type, round trips, bad records."""

from __future__ import annotations

import datetime as dt
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from rollstream.consumers.store.derived_rows import (
    rows_for_policy_version,
    rows_for_sample,
    rows_for_trajectory,
    sample_digest,
)
from rollstream.consumers.store.rows import (
    RowBatch,
    RowError,
    StoreError,
    event_from_row,
    rows_for_event,
    rows_for_record,
)
from rollstream.consumers.store.tables import COLUMNS, MAX_TS_US, TABLES
from rollstream.schemas import (
    Branch,
    Event,
    LlmCall,
    PolicyVersion,
    Reward,
    RewardRecord,
    RolloutError,
    RolloutFinished,
    RolloutStarted,
    Sample,
    ToolCall,
    Trajectory,
    TrajectoryNode,
    Usage,
)

TS = 1_735_689_600_000_000  # 2025-01-01 UTC


def llm_call(**kw: object) -> LlmCall:
    args: dict[str, object] = dict(
        call_id="c2",
        parent_call_id="c1",
        prefix_len=7,
        prompt_delta=np.array([5, 6, 7], np.uint32),
        completion_ids=np.array([8, 9], np.uint32),
        completion_logprobs=np.array([-0.5, -0.25], np.float32),
        finish_reason="length",
        model="tiny",
        backend="b1",
        policy_version=4,
        latency_ms=12.5,
        usage=Usage(10, 2, 7),
        drift_tokens=1,
    )
    args.update(kw)
    return LlmCall(**args)  # type: ignore[arg-type]


BODIES = {
    "RolloutStarted": RolloutStarted(
        "task-1", "g-1", attempt=2, harness="swe", policy_version=3, group_size=8, run_id="run",
        sampling={"temperature": 0.7}, metadata={"repo": "x"},
    ),
    "LlmCall": llm_call(),
    "ToolCall": ToolCall(
        "t1", "bash", '{"cmd": "ls"}', "a\nb", result_truncated=True, is_error=True,
        duration_ms=3.5, sandbox="bwrap", at_call_id="c2",
    ),
    "Reward": Reward(0.75, "milestone", "tests", "c2", "pytest"),
    "Branch": Branch("br1", "rewind", "c1", "edited"),
    "RolloutError": RolloutError("proxy", "backend down", 503, "c2", "b1"),
    "RolloutFinished": RolloutFinished("timeout", "wall clock"),
}  # fmt: skip

TYPED_TABLE = {
    "RolloutStarted": "rollouts",
    "LlmCall": "llm_calls",
    "ToolCall": "tool_calls",
    "Reward": "rewards",
    "RolloutFinished": "rollouts",
}


def event(body: object, seq: int = 3, **kw: object) -> Event:
    args: dict[str, object] = dict(
        event_id=f"e{seq}", rollout_id="r1", seq=seq, ts=TS + seq, body=body, producer="sdk"
    )
    args.update(kw)
    return Event(**args)  # type: ignore[arg-type]


def as_dict(table: str, row: tuple[object, ...]) -> dict[str, object]:
    assert len(row) == len(COLUMNS[table])
    return dict(zip(COLUMNS[table], row, strict=True))


@pytest.mark.parametrize("kind", list(BODIES))
def test_every_body_maps_to_events_and_its_table(kind: str) -> None:
    ev = event(BODIES[kind])
    rows = rows_for_event(ev, "rollout.events", 2, 41)
    expected = {"events"} | ({TYPED_TABLE[kind]} if kind in TYPED_TABLE else set())
    assert set(rows) == expected
    for table, table_rows in rows.items():
        assert len(table_rows) == 1
        row = as_dict(table, table_rows[0])
        assert row["rollout_id"] == "r1"
        assert (row["kafka_topic"], row["kafka_partition"], row["kafka_offset"]) == (
            "rollout.events",
            2,
            41,
        )
    head = as_dict("events", rows["events"][0])
    assert head["event_id"] == "e3"
    assert head["seq"] == 3
    assert head["ts"] == TS + 3
    assert head["type"] == kind
    assert head["producer"] == "sdk"
    assert isinstance(head["body_json"], bytes)


@pytest.mark.parametrize("kind", list(BODIES))
def test_events_row_round_trips_every_body(kind: str) -> None:
    ev = event(BODIES[kind])
    rows = rows_for_event(ev, "t", 0, 0)
    llm = as_dict("llm_calls", rows["llm_calls"][0]) if "llm_calls" in rows else None
    assert event_from_row(as_dict("events", rows["events"][0]), llm) == ev


def test_round_trip_with_datetime_ts_and_non_finite_floats() -> None:
    for body in (
        Reward(float("nan")),
        llm_call(latency_ms=float("inf")),
        RolloutStarted("t", "g", sampling={"temperature": float("-inf")}),
    ):
        ev = event(body)
        rows = rows_for_event(ev, "t", 0, 0)
        row = as_dict("events", rows["events"][0])
        row["ts"] = dt.datetime(2025, 1, 1, 0, 0, 0, 3)  # as chDB returns it: naive UTC
        llm = as_dict("llm_calls", rows["llm_calls"][0]) if "llm_calls" in rows else None
        back = event_from_row(row, llm)
        # NaN != NaN, so compare the JSON texts (the standard library writes NaN/Infinity)
        assert json.dumps(back.to_json()) == json.dumps(ev.to_json())


def test_llm_call_row() -> None:
    ev = event(llm_call(parent_call_id=None))
    row = as_dict("llm_calls", rows_for_event(ev, "t", 0, 0)["llm_calls"][0])
    assert row["call_id"] == "c2"
    assert row["parent_call_id"] == ""
    assert row["prefix_len"] == 7
    assert row["prompt_len"] == 10
    assert row["prompt_delta"] is ev.body.prompt_delta  # no copy until the insert
    assert row["completion_ids"].tolist() == [8, 9]  # type: ignore[attr-defined]
    assert row["completion_logprobs"].dtype == np.float32  # type: ignore[attr-defined]
    assert (row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"]) == (10, 2, 7)
    assert (row["model"], row["backend"], row["policy_version"]) == ("tiny", "b1", 4)
    assert (row["latency_ms"], row["drift_tokens"], row["finish_reason"]) == (12.5, 1, "length")


def test_tool_reward_and_rollout_rows() -> None:
    tool = as_dict(
        "tool_calls", rows_for_event(event(BODIES["ToolCall"]), "t", 0, 0)["tool_calls"][0]
    )
    assert (tool["name"], tool["is_error"], tool["duration_ms"]) == ("bash", True, 3.5)
    assert (tool["sandbox"], tool["at_call_id"], tool["result_truncated"]) == ("bwrap", "c2", True)
    bare = as_dict(
        "tool_calls", rows_for_event(event(ToolCall("t", "x")), "t", 0, 0)["tool_calls"][0]
    )
    assert (bare["sandbox"], bare["at_call_id"]) == ("", "")

    reward = as_dict("rewards", rows_for_event(event(BODIES["Reward"]), "t", 0, 0)["rewards"][0])
    assert (reward["value"], reward["kind"], reward["name"]) == (0.75, "milestone", "tests")
    assert type(reward["kind"]) is str

    started = as_dict(
        "rollouts", rows_for_event(event(BODIES["RolloutStarted"], 0), "t", 0, 0)["rollouts"][0]
    )
    assert (started["source"], started["status"], started["version"]) == ("started", "running", 0)
    assert (started["task_id"], started["group_id"], started["policy_version"]) == (
        "task-1",
        "g-1",
        3,
    )
    assert (started["attempt"], started["group_size"], started["started_ts"]) == (2, 8, TS)
    finished = as_dict(
        "rollouts", rows_for_event(event(BODIES["RolloutFinished"], 9), "t", 0, 0)["rollouts"][0]
    )
    assert (finished["source"], finished["status"], finished["error"]) == (
        "finished",
        "timeout",
        "wall clock",
    )
    assert (finished["version"], finished["finished_ts"], finished["task_id"]) == (37, TS + 9, "")
    assert math.isnan(finished["score"])  # type: ignore[arg-type]


def trajectory(**kw: object) -> Trajectory:
    nodes = [
        TrajectoryNode("c1", None, 0, np.arange(4, dtype=np.uint32), np.arange(3, dtype=np.uint32),
                       np.zeros(3, np.float32), policy_version=2),
        TrajectoryNode("c2", "c1", 7, np.arange(9, dtype=np.uint32), np.arange(5, dtype=np.uint32),
                       np.zeros(5, np.float32), policy_version=3, finish_reason="length"),
    ]  # fmt: skip
    args: dict[str, object] = dict(
        rollout_id="r1", task_id="task-1", group_id="g-1", status="completed", score=0.5,
        nodes=nodes, attempt=1, group_size=4, run_id="run", score_source="partial",
        rewards=[RewardRecord(0.5, "partial", "tests", "c2")], num_events=9, last_seq=8,
        started_ts=TS, finished_ts=TS + 100, metadata={"k": "v"},
    )  # fmt: skip
    args.update(kw)
    return Trajectory(**args)  # type: ignore[arg-type]


def test_trajectory_rows() -> None:
    rows = rows_for_trajectory(trajectory(), "trajectories", 1, 5)
    t = as_dict("trajectories", rows["trajectories"][0])
    assert (t["ts"], t["num_nodes"], t["num_completion_tokens"]) == (TS, 2, 8)
    assert t["node_call_ids"] == ["c1", "c2"]
    assert t["node_parent_ids"] == ["", "c1"]
    assert t["node_prefix_lens"].tolist() == [0, 7]  # type: ignore[attr-defined]
    assert t["node_prompt_lens"].tolist() == [4, 9]  # type: ignore[attr-defined]
    assert t["node_completion_lens"].tolist() == [3, 5]  # type: ignore[attr-defined]
    assert t["node_policy_versions"].tolist() == [2, 3]  # type: ignore[attr-defined]
    assert t["node_finish_reasons"] == ["stop", "length"]
    assert t["reward_values"].tolist() == [0.5]  # type: ignore[attr-defined]
    assert (t["reward_kinds"], t["reward_at_call_ids"]) == (["partial"], ["c2"])
    assert (t["metadata"], t["score_source"], t["group_size"]) == ({"k": "v"}, "partial", 4)
    r = as_dict("rollouts", rows["rollouts"][0])
    assert (r["source"], r["version"], r["status"], r["score"]) == (
        "trajectory",
        8 * 4 + 2,  # last_seq * 4 + the trajectory's rank
        "completed",
        0.5,
    )
    assert (r["num_llm_calls"], r["num_completion_tokens"], r["policy_version"]) == (2, 8, 2)
    # no start time: the finish, else the Kafka time, partitions the row
    no_start = rows_for_trajectory(trajectory(started_ts=0), "t", 0, 0)
    assert as_dict("trajectories", no_start["trajectories"][0])["ts"] == TS + 100
    neither = rows_for_trajectory(
        trajectory(started_ts=0, finished_ts=0, nodes=[]), "t", 0, 0, timestamp_us=TS + 7
    )
    row = as_dict("trajectories", neither["trajectories"][0])
    assert (row["ts"], row["num_nodes"], row["node_prefix_lens"].tolist()) == (TS + 7, 0, [])  # type: ignore[attr-defined]


def sample(**kw: object) -> Sample:
    args: dict[str, object] = dict(
        sample_id="s1", rollout_id="r1", group_id="g-1", task_id="task-1",
        input_ids=np.arange(6, dtype=np.uint32), loss_mask=np.array([0, 0, 1, 1, 1, 0], np.uint8),
        behaviour_logprobs=np.zeros(6, np.float32), advantage=-0.5, reward=0.25,
        policy_version=5, policy_versions=[3, 5], leaf_id="c2", num_tokens=6,
    )  # fmt: skip
    args.update(kw)
    return Sample(**args)  # type: ignore[arg-type]


def test_sample_rows_and_digest() -> None:
    s = as_dict(
        "samples", rows_for_sample(sample(), "samples", 3, 9, timestamp_us=TS)["samples"][0]
    )
    assert (s["ts"], s["mode"], s["advantage"], s["reward"]) == (TS, "path", -0.5, 0.25)
    assert (s["policy_version"], s["min_policy_version"], s["policy_versions"]) == (5, 3, [3, 5])
    assert (s["input_len"], s["num_loss_tokens"], s["num_tokens"]) == (6, 3, 6)
    assert s["digest"] == sample_digest(sample()) and len(s["digest"]) == 32  # type: ignore[arg-type]
    assert sample_digest(sample(advantage=9.0)) == s["digest"]  # content only
    other = sample(loss_mask=np.array([0, 0, 1, 1, 1, 1], np.uint8))
    assert sample_digest(other) != s["digest"]
    single = rows_for_sample(sample(policy_versions=[]), "s", 0, 0, timestamp_us=TS)
    assert as_dict("samples", single["samples"][0])["min_policy_version"] == 5


def test_policy_version_rows_and_dispatch() -> None:
    pv = PolicyVersion(7, "file:///ckpt/7", 70, TS, samples_trained=512, metrics={"loss": 0.1})
    row = as_dict(
        "policy_versions",
        rows_for_policy_version(pv, "policy.versions", 0, 3)["policy_versions"][0],
    )
    assert (row["version"], row["ts"], row["trainer_step"], row["metrics"]) == (
        7,
        TS,
        70,
        {"loss": 0.1},
    )
    assert set(rows_for_record(pv, "p", 0, 0)) == {"policy_versions"}
    assert set(rows_for_record(trajectory(), "p", 0, 0)) == {"trajectories", "rollouts"}
    assert set(rows_for_record(sample(), "p", 0, 0, timestamp_us=TS)) == {"samples"}
    assert set(rows_for_record(event(BODIES["Reward"]), "p", 0, 0)) == {"events", "rewards"}


class NotABody:
    pass


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (event(BODIES["Reward"], seq=-1), "negative seq"),
        (event(BODIES["Reward"], event_id=""), "empty event_id"),
        (event(BODIES["Reward"], rollout_id=""), "empty rollout_id"),
        (event(BODIES["Reward"], ts=-5), "outside"),
        (event(BODIES["Reward"], ts=MAX_TS_US + 1), "outside"),
        (event(llm_call(prefix_len=-1)), "negative prefix_len"),
        (event(NotABody()), "unknown body type"),
        (event(RolloutStarted("t", "g", metadata={"k": b"\xff"})), "JSON"),  # type: ignore[dict-item]
        (trajectory(rollout_id=""), "empty rollout_id"),
        (trajectory(started_ts=-1), "outside"),
        (sample(sample_id=""), "empty sample_id"),
        (sample(), "timestamp_us"),  # a sample needs the Kafka time
        (PolicyVersion(1, "u", 1, -3), "outside"),
        (trajectory(nodes=[object()]), "AttributeError"),
        (Usage(), "not a storable record"),
    ],
)
def test_bad_records_raise_row_error(record: object, reason: str) -> None:
    with pytest.raises(RowError) as info:
        rows_for_record(record, "t", 0, 0)  # type: ignore[arg-type]
    assert reason in info.value.reason
    assert isinstance(info.value, StoreError)
    assert info.value.kind


def test_row_batch_accumulates_and_names_its_offset_range() -> None:
    batch = RowBatch("rollout.events", 4)
    batch.add(event(BODIES["RolloutStarted"], 0), 100)
    batch.skip(101)  # an undecodable message: consumed, no rows
    with pytest.raises(RowError):
        batch.add(event(BODIES["Reward"], seq=-1), 102)
    batch.add(event(BODIES["LlmCall"], 2), 103)
    batch.add(trajectory(), 104)
    assert batch.token == "rollout.events:4:100:104"
    assert len(batch) == 5
    assert {t: len(r) for t, r in batch.tables.items()} == {
        "events": 2,
        "rollouts": 2,
        "llm_calls": 1,
        "trajectories": 1,
    }
    assert batch.num_rows == 6
    with pytest.raises(ValueError, match="not after"):
        batch.add(event(BODIES["Reward"]), 104)


def test_columns_use_known_kinds() -> None:
    kinds = {c.kind for cols in TABLES.values() for c in cols}
    assert kinds <= {
        "str", "bytes", "bool", "i32", "i64", "u32", "u64", "f64", "ts",
        "u32[]", "f32[]", "i32[]", "i64[]", "f64[]", "str[]", "map:str", "map:f64",
    }  # fmt: skip
    for table, cols in COLUMNS.items():
        assert len(set(cols)) == len(cols), table
        assert "kafka_offset" in cols


def test_rows_module_is_pure() -> None:
    code = (
        "import sys, rollstream.consumers.store.rows, rollstream.consumers.store.derived_rows\n"
        "import rollstream.consumers.store.tables\n"
        "bad = {'clickhouse_connect', 'chdb', 'pyarrow', 'confluent_kafka', 'faust', 'httpx'}\n"
        "print(sorted(bad & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
