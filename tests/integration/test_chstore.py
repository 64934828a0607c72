"""The ClickHouse store on real chDB: migrations, idempotent inserts, round trips, errors."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollstream.consumers.store import chstore
from rollstream.consumers.store.chstore import (
    ConnectError,
    InsertError,
    MigrationError,
    QueryError,
    StoreError,
    connect,
    database_for,
    fetch_events,
    insert_batch,
    query,
)
from rollstream.consumers.store.migrations import MIGRATIONS_DIR, apply_migrations, split_statements
from rollstream.consumers.store.rows import RowBatch
from rollstream.consumers.store.tables import COLUMNS
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

pytestmark = pytest.mark.integration

TS = 1_735_689_600_000_000  # 2025-01-01 UTC
DAY = 86_400_000_000


@pytest.fixture(scope="module")
def chdb_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chdb")


@pytest.fixture(scope="module")
def client(chdb_path: Path) -> Iterator[Any]:
    c = connect(f"chdb://{chdb_path}")
    yield c
    c.close()  # chDB hosts one data path per process: free it for the next module


@pytest.fixture
def db(client: Any) -> str:
    name = database_for(f"t{uuid.uuid4().hex[:10]}")
    apply_migrations(client, name)
    return name


def count(client: Any, sql: str) -> int:
    return int(client.command(sql))


def all_events() -> list[Event]:
    bodies = [
        RolloutStarted("task-1", "g-1", policy_version=2, sampling={"temperature": 1.0}),
        LlmCall("c1", None, 0, np.arange(2000, dtype=np.uint32),
                np.arange(50, dtype=np.uint32) * 7, np.linspace(-3, 0, 50, dtype=np.float32),
                model="tiny", backend="b0", policy_version=2, latency_ms=12.25,
                usage=Usage(2000, 50, 0)),
        ToolCall("t1", "bash", '{"cmd":"ls"}', "ok", is_error=True, duration_ms=5.0),
        LlmCall("c2", "c1", 2050, np.array([1, 2], np.uint32), np.array([3], np.uint32),
                np.array([-0.5], np.float32)),
        Reward(1.0, "final", "tests"),
        Branch("b1", "retry", "c1"),
        RolloutError("sandbox", "oom", 137),
        RolloutFinished("completed"),
    ]  # fmt: skip
    # the last two events fall on the next day: two partitions in one insert
    return [
        Event(f"e{i}", "r1", i, TS + i * 1000 + (DAY if i >= 6 else 0), b, "sdk")
        for i, b in enumerate(bodies)
    ]


def derived_batches() -> list[RowBatch]:
    node = TrajectoryNode("c1", None, 0, np.arange(3, dtype=np.uint32),
                          np.arange(2, dtype=np.uint32), np.zeros(2, np.float32))  # fmt: skip
    traj = Trajectory("r1", "task-1", "g-1", "completed", 1.0, [node],
                      rewards=[RewardRecord(1.0, "final")], num_events=8, last_seq=7,
                      started_ts=TS, finished_ts=TS + DAY)  # fmt: skip
    sample = Sample("s1", "r1", "g-1", "task-1", np.arange(5, dtype=np.uint32),
                    np.ones(5, np.uint8), np.zeros(5, np.float32), 0.5, 1.0, 2)  # fmt: skip
    out = []
    for topic, record in (
        ("trajectories", traj),
        ("samples", sample),
        ("policy.versions", PolicyVersion(3, "file:///c/3", 30, TS + 5, metrics={"loss": 0.5})),
    ):
        b = RowBatch(topic, 0)
        b.add(record, 0, timestamp_us=TS + 10)
        out.append(b)
    return out


def events_batch(events: list[Event], topic: str = "rollout.events", first: int = 0) -> RowBatch:
    b = RowBatch(topic, 1)
    for offset, ev in enumerate(events, first):
        b.add(ev, offset)
    return b


# --- migrations -------------------------------------------------------------------------------


def schema(client: Any, db: str) -> list[tuple[Any, ...]]:
    return client.query(
        "SELECT name, engine, create_table_query FROM system.tables "
        "WHERE database = {db:String} ORDER BY name",
        parameters={"db": db},
    ).result_rows


def test_migrations_apply_once_and_twice_changes_nothing(client: Any) -> None:
    db = database_for(f"m{uuid.uuid4().hex[:8]}")
    applied = apply_migrations(client, db)
    assert applied == [
        "0001_events", "0002_rollouts", "0003_training", "0004_rollout_tokens",
        "0005_rollout_stages", "0006_train_steps",
    ]  # fmt: skip
    before = schema(client, db)
    assert {r[0] for r in before} == {
        "events", "llm_calls", "tool_calls", "rewards", "rollouts", "rollout_status",
        "trajectories", "samples", "policy_versions", "schema_migrations", "rollout_tokens",
        "rollout_tokens_from_rollouts", "rollout_tokens_from_llm_calls",
        "stages", "sandboxes", "evaluator_outputs", "train_steps",
    }  # fmt: skip
    assert apply_migrations(client, db) == []
    assert schema(client, db) == before
    assert count(client, f"SELECT count() FROM {db}.schema_migrations") == 6


def test_ddl_columns_match_the_row_mapping(client: Any, db: str) -> None:
    for table, columns in COLUMNS.items():
        names = client.query(
            "SELECT name FROM system.columns WHERE database = {db:String} AND table = {t:String} "
            "ORDER BY position",
            parameters={"db": db, "t": table},
        ).result_rows
        assert tuple(n for (n,) in names) == columns, table
    engines = dict(
        client.query(
            "SELECT name, engine_full FROM system.tables WHERE database = {db:String}",
            parameters={"db": db},
        ).result_rows
    )
    for table in COLUMNS:
        assert engines[table].startswith("ReplacingMergeTree"), table
        assert "non_replicated_deduplication_window = 10000" in engines[table], table
        assert "PARTITION BY toYYYYMMDD(ts)" in engines[table], table


def test_edited_or_new_migrations(client: Any, tmp_path: Path) -> None:
    directory = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS_DIR, directory)
    db = database_for(f"m{uuid.uuid4().hex[:8]}")
    assert len(apply_migrations(client, db, directory=directory)) == 6
    (directory / "0099_extra.sql").write_text(
        "-- a later migration; semicolons in 'strings; like this' stay\n"
        "CREATE TABLE IF NOT EXISTS {db}.extra (x String DEFAULT 'a;b') "
        "ENGINE = MergeTree ORDER BY x;\n"
    )
    assert apply_migrations(client, db, directory=directory) == ["0099_extra"]
    assert count(client, f"SELECT count() FROM system.tables WHERE database = '{db}' "
                         "AND name = 'extra'") == 1  # fmt: skip
    path = directory / "0001_events.sql"
    path.write_text(path.read_text() + "\n-- edited after it was applied\n")
    with pytest.raises(MigrationError, match=r"0001_events .*changed"):
        apply_migrations(client, db, directory=directory)
    (directory / "0098_broken.sql").write_text("CREATE TABLE {db}.nope (x Nonsense)")
    path.write_text((MIGRATIONS_DIR / "0001_events.sql").read_text())
    with pytest.raises(MigrationError, match="failed"):
        apply_migrations(client, db, directory=directory)
    assert split_statements("SELECT 'a;b'; -- c;\nSELECT 2;") == ["SELECT 'a;b'", "SELECT 2"]


# --- inserts ----------------------------------------------------------------------------------


def test_same_token_twice_is_stored_once_raw(client: Any, db: str) -> None:
    batch = events_batch(all_events())
    tables = batch.tables
    assert set(tables) == {"events", "llm_calls", "tool_calls", "rewards", "rollouts"}
    first = insert_batch(client, tables, batch.token, database=db)
    assert first == {t: len(r) for t, r in tables.items()}
    insert_batch(client, tables, batch.token, database=db)  # a retry after a crash
    for table, rows in tables.items():
        # raw count, no FINAL: the second insert was dropped by the deduplication token
        assert count(client, f"SELECT count() FROM {db}.{table}") == len(rows), table
    parts = count(client, f"SELECT uniqExact(partition) FROM system.parts "
                          f"WHERE database = '{db}' AND table = 'events' AND active")  # fmt: skip
    assert parts == 2

    # a re-batched replay (new token) duplicates raw rows; FINAL and merges collapse them
    again = events_batch(all_events(), first=100)
    insert_batch(client, again.tables, again.token, database=db)
    assert count(client, f"SELECT count() FROM {db}.events") == 16
    assert count(client, f"SELECT count() FROM {db}.events FINAL") == 8
    client.command(f"OPTIMIZE TABLE {db}.llm_calls FINAL")
    assert count(client, f"SELECT count() FROM {db}.llm_calls") == 2


def test_round_trip_events_and_derived_records(client: Any, db: str) -> None:
    events = all_events()
    batch = events_batch(events)
    insert_batch(client, batch.tables, batch.token, database=db)
    assert fetch_events(client, database=db) == events
    one = fetch_events(
        client, database=db, where="e.type = {t:String}", parameters={"t": "LlmCall"}
    )
    assert [e.event_id for e in one] == ["e1", "e3"]
    assert one[0].body.prompt_delta.tolist() == list(range(2000))

    for b in derived_batches():
        insert_batch(client, b.tables, b.token, database=db)
    traj = query(client, f"SELECT rollout_id, num_nodes, node_completion_lens, reward_values, "
                         f"toUnixTimestamp64Micro(finished_ts) FROM {db}.trajectories")  # fmt: skip
    assert traj.rows == [("r1", 1, [2], [1.0], TS + DAY)]
    sample = query(client, f"SELECT sample_id, input_len, num_loss_tokens, length(digest), "
                           f"toUnixTimestamp64Micro(ts) FROM {db}.samples").rows  # fmt: skip
    assert sample == [("s1", 5, 5, 32, TS + 10)]
    pv = query(client, f"SELECT version, metrics FROM {db}.policy_versions").rows
    assert pv == [(3, {"loss": 0.5})]
    status = query(client, f"SELECT * FROM {db}.rollout_status").as_dicts()
    assert len(status) == 1
    s = status[0]
    assert (s["task_id"], s["policy_version"], s["status"], s["score"]) == (
        "task-1",
        2,
        "completed",
        1.0,
    )
    assert (s["num_llm_calls"], s["num_completion_tokens"], s["last_seq"]) == (1, 2, 7)


def test_namespaces_have_their_own_tables(client: Any) -> None:
    live, replay = database_for(f"a{uuid.uuid4().hex[:6]}"), database_for("replay.1-x")
    assert replay == "rollstream_replay_1_x"
    assert database_for() == "rollstream"
    assert database_for("r2", base="analytics") == "analytics_r2"
    for name in (live, replay):
        client.command(f"DROP DATABASE IF EXISTS {name} SYNC")
        apply_migrations(client, name)
    batch = events_batch(all_events()[:3])
    insert_batch(client, batch.tables, batch.token, database=live)
    assert count(client, f"SELECT count() FROM {live}.events") == 3
    assert count(client, f"SELECT count() FROM {replay}.events") == 0
    insert_batch(client, batch.tables, batch.token, database=replay)  # same token, other db
    assert count(client, f"SELECT count() FROM {replay}.events") == 3


def test_store_errors(client: Any, db: str, tmp_path: Path) -> None:
    batch = events_batch(all_events()[:2])
    with pytest.raises(InsertError) as info:
        insert_batch(client, {"events": [("too", "short")]}, "x", database=db)
    assert (info.value.table, info.value.token, info.value.retryable) == (
        "events",
        "x:events",
        False,
    )
    with pytest.raises(InsertError) as info:
        insert_batch(client, batch.tables, batch.token, database="no_such_db")
    assert not info.value.retryable
    with pytest.raises(QueryError) as qinfo:
        query(client, f"SELECT nope FROM {db}.events")
    assert "nope" in qinfo.value.sql
    with pytest.raises(StoreError, match="identifier"):
        insert_batch(client, batch.tables, batch.token, database="x; DROP TABLE y")
    with pytest.raises(ConnectError, match=r"unsupported .*://u:\*\*\*@h"):
        connect("mysql://u:secret@h/db")
    with pytest.raises(ConnectError) as cinfo:  # nothing listens on loopback port 9
        connect("http://user:s3cret@127.0.0.1:9/db")
    assert "s3cret" not in str(cinfo.value) and "user:***@" in str(cinfo.value)
    empty = query(client, f"SELECT event_id, seq FROM {db}.events WHERE 0")
    assert empty.columns == ("event_id", "seq") and empty.rows == []


def test_chdb_path_is_owned_by_one_process(client: Any, chdb_path: Path) -> None:
    code = (
        "import sys\n"
        "from rollstream.consumers.store.chstore import ConnectError, connect\n"
        "try:\n"
        f"    connect('chdb://{chdb_path}')\n"
        "except ConnectError as exc:\n"
        "    print('ConnectError', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("ConnectError"), out.stdout + out.stderr[-2000:]


def test_relative_chdb_path_resolves_against_base_dir(tmp_path: Path) -> None:
    code = (
        "from pathlib import Path\n"
        "from rollstream.consumers.store.chstore import connect\n"
        f"c = connect('chdb://.rollstream/clickhouse', base_dir=Path({str(tmp_path)!r}))\n"
        "print(c.command('SELECT 1'))\n"
    )
    # a fresh process: this one's chDB engine is bound to the module's path
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "1", out.stderr[-2000:]
    assert (tmp_path / ".rollstream" / "clickhouse").is_dir()


def test_arrow_conversion_of_every_kind() -> None:
    arrow = chstore.to_arrow("trajectories", derived_batches()[0].tables["trajectories"])
    assert arrow.num_rows == 1
    assert arrow.column_names == list(COLUMNS["trajectories"])
    assert chstore.to_arrow("events", []).num_rows == 0
