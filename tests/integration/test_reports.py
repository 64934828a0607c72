"""Canned reports on real chDB over a small hand-built dataset with hand-computed answers.

The whole dataset is inserted twice under different offsets (a re-batched replay), so every
view must also ignore raw duplicates.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollstream.consumers.analytics import reports
from rollstream.consumers.store.chstore import (
    Table,
    connect,
    database_for,
    insert_batch,
    query,
)
from rollstream.consumers.store.migrations import apply_migrations
from rollstream.consumers.store.rows import RowBatch
from rollstream.schemas import (
    EvaluatorOutput,
    Event,
    LlmCall,
    PolicyVersion,
    Reward,
    RolloutFinished,
    RolloutStarted,
    Sample,
    SandboxEvent,
    StageEvent,
    ToolCall,
)

pytestmark = pytest.mark.integration

T0 = 1_735_689_600_000_000  # 2025-01-01 UTC
S = 1_000_000

# rollout: (task, policy version, final rewards, status or None while running)
ROLLOUTS = {
    "r1": ("A", 0, [1.0], "completed"),
    "r2": ("A", 0, [0.0], "failed"),
    "r3": ("A", 1, [1.0], "completed"),
    "r4": ("B", 1, [0.25], "completed"),
    "r5": ("B", 1, [], "timeout"),
    "r6": ("C", 1, [0.5, 0.5], "completed"),
    "r7": ("C", 0, [1.0], None),
    "r8": ("D", 0, [1.0], "completed"),
    "r9": ("D", 0, [0.0], "completed"),
    "r10": ("D", 0, [0.0], "completed"),
    "r11": ("D", 0, [0.0], "completed"),
}
# rollout -> llm calls (completion tokens, prompt delta tokens, backend, latency ms)
LLM_CALLS = {
    "r1": [(3, 10, "b0", 100.0), (5, 4, "b0", 200.0)],
    "r2": [(2, 8, "b0", 300.0)],
    "r3": [(7, 6, "b0", 400.0)],
    "r6": [(1, 2, "b0", 500.0)],
    "r7": [(9, 9, "b1", 50.0)],
}
# rollout -> tool calls (name, duration ms, is_error)
TOOL_CALLS = {
    "r1": [("bash", 10.0, False), ("bash", 20.0, True)],
    "r2": [("bash", 30.0, False), ("python", 5.0, True)],
    "r3": [("bash", 40.0, False), ("python", 15.0, True)],
}
# rollout -> (job, stage lifecycle: (stage, status or None while it runs, duration ms))
STAGES = {
    "r1": ("j1", [("init", "ok", 100.0), ("run", "ok", 1000.0), ("eval", "ok", 50.0)]),
    "r2": ("j1", [("init", "ok", 200.0), ("run", "failed", 3000.0)]),
    "r3": ("j1", [("init", "ok", 300.0), ("run", "ok", 2000.0), ("eval", "timeout", 500.0)]),
    "r4": ("j2", [("init", "failed", 10.0)]),
    "r5": ("j2", [("init", "ok", 400.0), ("run", "timeout", 5000.0)]),
    "r7": ("j2", [("init", "ok", 150.0), ("run", None, 0.0)]),
}
# policy versions 1..3 published at T0 + 100/200/300 s (version 0 is implicit, at time 0)
POLICY = [(1, 100), (2, 200), (3, 300)]
# samples: (min policy version via policy_versions, Kafka time in s) -> staleness
SAMPLES = [(0, 50), (0, 150), (1, 150), (1, 350), (0, 250)]


def rollout_events(rid: str, index: int) -> list[Event]:
    task, version, rewards, status = ROLLOUTS[rid]
    bodies: list[Any] = [RolloutStarted(task, f"g{task}", policy_version=version)]
    job, stages = STAGES.get(rid, ("", []))
    for stage, outcome, duration in stages:
        bodies.append(StageEvent(stage, "started", job_id=job, worker="w1"))
        if stage == "init":
            bodies.append(SandboxEvent(f"{rid}sb", "ready", "bwrap", duration / 2, job))
        if outcome is not None:
            bodies.append(StageEvent(stage, "finished", outcome, duration, job, "w1"))
        if stage == "eval":
            bodies.append(EvaluatorOutput("suite", outcome or "ok", 1, 2, "1 passed", job_id=job))
    for i, (completion, delta, backend, latency) in enumerate(LLM_CALLS.get(rid, [])):
        bodies.append(
            LlmCall(f"{rid}c{i}", None, 0, np.arange(delta, dtype=np.uint32),
                    np.arange(completion, dtype=np.uint32), np.zeros(completion, np.float32),
                    backend=backend, policy_version=version, latency_ms=latency)
        )  # fmt: skip
    for i, (name, duration, error) in enumerate(TOOL_CALLS.get(rid, [])):
        bodies.append(ToolCall(f"{rid}t{i}", name, duration_ms=duration, is_error=error))
    bodies += [Reward(v) for v in rewards]
    bodies.append(Reward(0.5, "partial"))  # partial rewards never count as the reward
    if status:
        bodies.append(RolloutFinished(status))
    start = T0 + index * 10 * S
    return [
        Event(f"{rid}e{seq}", rid, seq, start + seq * S, body) for seq, body in enumerate(bodies)
    ]


def batches(first: int) -> list[RowBatch]:
    events = RowBatch("rollout.events", 0)
    for i, rid in enumerate(ROLLOUTS):
        for ev in rollout_events(rid, i):
            events.add(ev, first + len(events))
    policy = RowBatch("policy.versions", 0)
    for i, (version, at) in enumerate(POLICY):
        policy.add(PolicyVersion(version, f"ckpt/{version}", version, T0 + at * S), first + i)
    samples = RowBatch("samples", 0)
    for i, (version, at) in enumerate(SAMPLES):
        sample = Sample(
            f"s{i}", "r1", "gA", "A", np.arange(4, dtype=np.uint32), np.ones(4, np.uint8),
            np.zeros(4, np.float32), 0.0, 1.0, policy_version=version + 1,
            policy_versions=[version, version + 1],
        )  # fmt: skip
        samples.add(sample, first + i, timestamp_us=T0 + at * S)
    return [events, policy, samples]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    client = connect(f"chdb://{tmp_path_factory.mktemp('chdb')}")
    db = database_for(f"rep{uuid.uuid4().hex[:8]}")
    apply_migrations(client, db)
    for first in (0, 1000):  # the same data twice, as a re-batched replay would write it
        for b in batches(first):
            insert_batch(client, b.tables, b.token, database=db)
    assert int(client.command(f"SELECT count() FROM {db}.events")) == 2 * int(
        client.command(f"SELECT count() FROM {db}.events FINAL")
    )
    yield client, db
    client.close()


def rows(table: Table) -> list[tuple[Any, ...]]:
    return [tuple(round(v, 6) if isinstance(v, float) else v for v in r) for r in table.rows]


def test_reward_and_pass_rate_per_policy_version(store: tuple[Any, str]) -> None:
    client, db = store
    table = reports.run_report(client, "reward_by_policy", database=db)
    assert table.columns == ("policy_version", "rollouts", "mean_reward", "pass_rate")
    # v0: r1 1, r2 0, r8 1, r9-r11 0 (r7 runs); v1: r3 1, r4 .25, r5 0 (no reward), r6 .5+.5
    assert rows(table) == [(0, 6, round(2 / 6, 6), round(2 / 6, 6)), (1, 4, 0.5625, 0.5)]
    lenient = reports.run_report(client, "reward_by_policy", database=db, pass_threshold=0.25)
    assert rows(lenient)[1] == (1, 4, 0.5625, 0.75)


def test_pass_at_k_per_task(store: tuple[Any, str]) -> None:
    client, db = store
    table = reports.run_report(client, "pass_at_k", database=db, k=2)
    got = {r[0]: r[1:] for r in rows(table)}
    assert got["A"] == (3, 2, round(2 / 3, 6), 1.0)  # n - c = 1 < k
    assert got["B"] == (2, 0, 0.0, 0.0)
    assert got["C"][:3] == (1, 1, 1.0) and math.isnan(got["C"][3])  # n < k
    assert got["D"] == (4, 1, 0.25, 0.5)  # 1 - C(3,2)/C(4,2)
    k1 = reports.run_report(client, "pass_at_k", database=db, k=1)
    assert [r[3] for r in rows(k1)] == [r[4] for r in rows(k1)]  # pass@1 == pass_at_k at k=1


def test_tool_stats(store: tuple[Any, str]) -> None:
    client, db = store
    table = reports.run_report(client, "tool_stats", database=db)
    assert table.columns[:4] == ("tool", "calls", "errors", "error_rate")
    # bash 10 20(err) 30 40: p50 25, p95 38.5; python 5(err) 15(err): p50 10, p95 14.5
    assert rows(table) == [
        ("bash", 4, 1, 0.25, 25.0, 25.0, 38.5),
        ("python", 2, 2, 1.0, 10.0, 10.0, 14.5),
    ]


def test_stage_outcomes_and_latency_percentiles_per_job(store: tuple[Any, str]) -> None:
    client, db = store
    table = reports.run_report(client, "stages", database=db)
    assert table.columns == (
        "job_id", "stage", "started", "finished", "failed", "timed_out", "mean_ms", "p50_ms",
        "p90_ms", "p99_ms", "max_ms",
    )  # fmt: skip
    # quantileExactInclusive: h = (n - 1) * p between the sorted values; j1 init 100 200 300:
    # p90 280, p99 298; j1 eval 50 500: p50 275, p90 455, p99 495.5; j2 init 10 150 400: p90
    # 350, p99 395; j2 run: r5's 5000 finished, r7's still running (started, no duration)
    assert rows(table) == [
        ("j1", "init", 3, 3, 0, 0, 200.0, 200.0, 280.0, 298.0, 300.0),
        ("j1", "run", 3, 3, 1, 0, 2000.0, 2000.0, 2800.0, 2980.0, 3000.0),
        ("j1", "eval", 2, 2, 0, 1, 275.0, 275.0, 455.0, 495.5, 500.0),
        ("j2", "init", 3, 3, 1, 0, 186.666667, 150.0, 350.0, 395.0, 400.0),
        ("j2", "run", 2, 1, 0, 1, 5000.0, 5000.0, 5000.0, 5000.0, 5000.0),
    ]
    # the other lifecycle tables got their rows, each once under FINAL
    sandboxes = query(client, f"SELECT count() FROM {db}.sandboxes FINAL").rows
    outputs = query(client, f"SELECT sum(passed), sum(total) FROM {db}.evaluator_outputs FINAL")
    assert sandboxes == [(len(STAGES),)] and outputs.rows == [(2, 4)]


def test_tokens_per_rollout(store: tuple[Any, str]) -> None:
    client, db = store
    table = reports.run_report(client, "tokens_per_rollout", database=db)
    # v0 finished: r1 (2 calls, 8 + 14), r2 (1, 2 + 8), r8-r11 (none); r7 runs
    # v1 finished: r3 (1, 7 + 6), r6 (1, 1 + 2), r4 and r5 (none)
    assert rows(table) == [
        (0, 6, 0.5, round(10 / 6, 6), 0.0, 5.0, round(22 / 6, 6), round(32 / 6, 6)),
        (1, 4, 0.5, 2.0, 0.5, 5.2, 2.0, 4.0),
    ]


def test_llm_latency_per_backend(store: tuple[Any, str]) -> None:
    client, db = store
    table = reports.run_report(client, "llm_latency", database=db)
    assert table.columns == ("backend", "calls", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms")
    assert rows(table) == [
        ("b0", 5, 300.0, 300.0, 460.0, 496.0, 500.0),
        ("b1", 1, 50.0, 50.0, 50.0, 50.0, 50.0),
    ]


def test_staleness_distribution(store: tuple[Any, str]) -> None:
    client, db = store
    table = reports.run_report(client, "staleness", database=db)
    # s0 @50 s: v0 (implicit) - 0; s1 @150: v1 - 0; s2 @150: v1 - 1; s3 @350: v3 - 1;
    # s4 @250: v2 - 0
    assert rows(table) == [(0, 2, 0.4), (1, 1, 0.2), (2, 2, 0.4)]


def test_rollouts_by_status_and_top_failing_tasks(store: tuple[Any, str]) -> None:
    client, db = store
    status = reports.run_report(client, "rollouts_by_status", database=db)
    assert rows(status) == [
        ("completed", 8, round(8 / 11, 6)),
        ("failed", 1, round(1 / 11, 6)),
        ("running", 1, round(1 / 11, 6)),
        ("timeout", 1, round(1 / 11, 6)),
    ]
    failing = reports.run_report(client, "top_failing_tasks", database=db)
    assert failing.columns == ("task_id", "rollouts", "failures", "fail_rate", "mean_reward")
    assert rows(failing) == [
        ("D", 4, 3, 0.75, 0.25),
        ("B", 2, 2, 1.0, 0.125),
        ("A", 3, 1, round(1 / 3, 6), round(2 / 3, 6)),
    ]
    top1 = reports.run_report(client, "top_failing_tasks", database=db, limit=1)
    assert [r[0] for r in top1.rows] == ["D"]


def test_run_all_and_plots(store: tuple[Any, str], tmp_path: Path) -> None:
    client, db = store
    tables = reports.run_reports(client, database=db, k=2)
    assert set(tables) == set(reports.VIEWS)
    assert all(len(t) > 0 for t in tables.values())
    for name, view in reports.VIEWS.items():
        if view.chart:
            path = reports.plot(name, tables[name], tmp_path / f"{name}.png")
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no chart"):
        reports.plot("pass_at_k", tables["pass_at_k"], tmp_path / "x.png")
    with pytest.raises(ValueError, match="takes"):
        reports.run_report(client, "tool_stats", database=db, k=3)


def test_view_sql_declares_its_parameters() -> None:
    for name, view in reports.VIEWS.items():
        sql = reports.render_sql(name, "some_db")
        assert "{db}" not in sql and "some_db." in sql
        used = {m.group(1): m.group(2) for m in re.finditer(r"\{(\w+):(\w+)\}", sql)}
        assert used == {k: p.type for k, p in view.params.items()}, name
