"""tokens_per_rollout reads pre-aggregated per-rollout states (rollout_tokens, migration 0004).
It must give exactly what the join it replaced gives (llm_calls FINAL joined to rollout_status,
kept below as the reference), over a random dataset, after duplicate batches, after the
migration's backfill runs over existing data (and runs again), and after merges.
"""

from __future__ import annotations

import random
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollstream.consumers.analytics import reports
from rollstream.consumers.store.chstore import connect, database_for, insert_batch
from rollstream.consumers.store.migrations import MIGRATIONS_DIR, apply_migrations, load_migrations
from rollstream.consumers.store.rows import RowBatch
from rollstream.consumers.store.tables import COLUMNS
from rollstream.schemas import Event, LlmCall, RolloutFinished, RolloutStarted, ToolCall

pytestmark = pytest.mark.integration

T0 = 1_735_689_600_000_000  # 2025-01-01 UTC
DAY = 86_400_000_000

# The query tokens_per_rollout ran before migration 0004: the reference.
REFERENCE = """WITH done AS (
    SELECT rollout_id, policy_version FROM {db}.rollout_status WHERE status != 'running'
),
per_rollout AS (
    SELECT rollout_id, count() AS calls, sum(completion_ids.size0) AS completion,
           sum(prompt_delta.size0) AS prompt_delta
    FROM {db}.llm_calls FINAL
    GROUP BY rollout_id
)
SELECT r.policy_version AS policy_version, count() AS rollouts,
       avg(t.calls) AS mean_llm_calls, avg(t.completion) AS mean_completion_tokens,
       quantileExactInclusive(0.5)(t.completion) AS p50_completion_tokens,
       quantileExactInclusive(0.9)(t.completion) AS p90_completion_tokens,
       avg(t.prompt_delta) AS mean_prompt_delta_tokens,
       avg(t.completion + t.prompt_delta) AS mean_unique_tokens
FROM done AS r
LEFT JOIN per_rollout AS t ON t.rollout_id = r.rollout_id
GROUP BY policy_version
ORDER BY policy_version"""


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    c = connect(f"chdb://{tmp_path_factory.mktemp('chdb')}")
    yield c
    c.close()  # chDB hosts one data path per process: free it for the next module


def dataset(seed: int, rollouts: int = 200) -> list[Event]:
    """Rollouts of 0-5 LLM calls and a tool call, over a few days (several partitions): some
    still running, some with only a finish (no start), some with a second finish, and LLM
    calls of rollouts that have no start or finish at all (not in rollout_status)."""
    rng = random.Random(seed)
    out: list[Event] = []
    for r in range(rollouts):
        rid = f"r{seed}-{r:04d}"
        ts = T0 + r * (DAY // 97)
        version = rng.randrange(6)
        shape = rng.random()
        bodies: list[Any] = []
        if shape > 0.08:
            bodies.append(RolloutStarted(f"task{r % 7}", f"g{r // 8}", policy_version=version))
        for c in range(rng.randrange(6)):
            n, d = rng.randrange(0, 40), rng.randrange(0, 60)
            bodies.append(
                LlmCall(f"{rid}c{c}", f"{rid}c{c - 1}" if c else None, 0,
                        np.arange(d, dtype=np.uint32), np.arange(n, dtype=np.uint32),
                        np.zeros(n, np.float32), policy_version=version)
            )  # fmt: skip
        bodies.append(ToolCall(f"{rid}t", "bash", "{}", "ok"))
        if 0.04 < shape < 0.8 or shape <= 0.04:  # running when 0.8 <= shape
            bodies.append(RolloutFinished(rng.choice(["completed", "failed", "timeout"])))
        if 0.7 < shape < 0.75:  # a late second finish: the higher seq wins
            bodies.append(RolloutFinished("aborted"))
        if shape <= 0.04:  # LLM calls of a rollout that has no rollouts row
            bodies = [b for b in bodies if isinstance(b, LlmCall | ToolCall)]
        for seq, body in enumerate(bodies):
            out.append(Event(f"{rid}e{seq}", rid, seq, ts + seq * 1000, body, "test"))
    return out


def insert(client: Any, db: str, events: list[Event], batch: int, first_offset: int) -> None:
    """The sink's mapping and insert, ``batch`` events per insert, offsets from
    ``first_offset`` (another offset range: another dedup token, so raw duplicates land)."""
    for start in range(0, len(events), batch):
        b = RowBatch("rollout.events", 0)
        for offset, event in enumerate(events[start : start + batch], first_offset + start):
            b.add(event, offset)
        insert_batch(client, b.tables, b.token, database=db)


def trajectory_rows(events: list[Event], rng: random.Random) -> list[tuple[Any, ...]]:
    """``rollouts`` rows of source "trajectory" for some started rollouts: a status and a
    policy version of their own, at a version above (or below) the finish."""
    started = {e.rollout_id: e for e in events if isinstance(e.body, RolloutStarted)}
    cols = COLUMNS["rollouts"]
    rows = []
    for rid in sorted(started)[::5]:
        row = dict.fromkeys(cols, 0)
        row.update(
            rollout_id=rid, source="trajectory", version=rng.choice([3, 400]) * 4 + 2,
            ts=started[rid].ts, task_id="", group_id="", run_id="", harness="",
            policy_version=rng.randrange(6), status=rng.choice(["running", "truncated"]),
            error="", score=0.5, kafka_topic="trajectories",
        )  # fmt: skip
        rows.append(tuple(row[c] for c in cols))
    return rows


def both(client: Any, db: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    new = reports.run_report(client, "tokens_per_rollout", database=db).rows
    old = [tuple(r) for r in client.query(REFERENCE.replace("{db}", db)).result_rows]
    return new, old


def test_same_result_as_the_join_with_duplicates_and_merges(client: Any) -> None:
    db = database_for(f"d{uuid.uuid4().hex[:8]}")
    apply_migrations(client, db)
    events = dataset(1)
    rng = random.Random(7)
    insert(client, db, events, 600, 0)
    insert_batch(client, {"rollouts": trajectory_rows(events, rng)}, "traj:0:0:0", database=db)
    new, old = both(client, db)
    assert new == old
    assert len(new) == 6 and sum(r[1] for r in new) > 120  # every policy version, most rollouts

    # the sink re-inserts batches after a crash; a replay re-batches them (other tokens);
    # merges stopped, so the duplicates are still there when the reports run
    for table in ("llm_calls", "rollouts", "rollout_tokens"):
        client.command(f"SYSTEM STOP MERGES {db}.{table}")
    insert(client, db, events[50:400], 175, 10_000)
    insert(client, db, events, 1000, 20_000)
    insert(client, db, events[::3], 300, 30_000)
    raw = int(client.command(f"SELECT count() FROM {db}.llm_calls"))
    final = int(client.command(f"SELECT count() FROM {db}.llm_calls FINAL"))
    assert raw > 2 * final
    again, old_again = both(client, db)
    assert again == old_again == new

    for table in ("llm_calls", "rollouts", "rollout_tokens"):
        client.command(f"SYSTEM START MERGES {db}.{table}")
    client.command(f"OPTIMIZE TABLE {db}.rollout_tokens FINAL")
    client.command(f"OPTIMIZE TABLE {db}.llm_calls FINAL")
    assert both(client, db) == (new, new)


def test_backfill_of_existing_data_is_exact_and_idempotent(client: Any, tmp_path: Path) -> None:
    """A database made before 0004 gets its rows backfilled when 0004 is applied; running the
    file again (a start that died half-way through it) changes no result."""
    before = tmp_path / "migrations"
    before.mkdir()
    for path in sorted(MIGRATIONS_DIR.glob("000[123]_*.sql")):
        shutil.copy(path, before / path.name)
    db = database_for(f"b{uuid.uuid4().hex[:8]}")
    apply_migrations(client, db, directory=before)
    events = dataset(2)
    insert(client, db, events, 800, 0)
    insert(client, db, events[100:], 600, 5_000)  # duplicates before the views exist
    old = [tuple(r) for r in client.query(REFERENCE.replace("{db}", db)).result_rows]

    assert apply_migrations(client, db) == [
        "0004_rollout_tokens", "0005_rollout_stages", "0006_train_steps",
    ]  # fmt: skip
    new, old_after = both(client, db)
    assert new == old == old_after

    insert(client, db, events[:900], 450, 9_000)  # live duplicates through the views
    (m,) = [m for m in load_migrations() if m.name == "rollout_tokens"]
    for statement in m.statements(db):  # the whole file again
        client.command(statement)
    assert both(client, db) == (old, old)
