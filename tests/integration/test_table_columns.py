"""One source of truth for table columns: the DDL (store/ddl/*.sql, applied to a real chDB)
against the mappers' column lists (store/tables.py, which the row mapper, the column mapper and
the Arrow conversion build from). A column added to the DDL alone, or to the mappers alone,
fails here with the difference spelled out."""

from __future__ import annotations

import difflib
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from rollstream.consumers.store import chstore
from rollstream.consumers.store.chstore import connect, database_for, query
from rollstream.consumers.store.columnar import ColumnBatch
from rollstream.consumers.store.migrations import MIGRATIONS_DIR, apply_migrations
from rollstream.consumers.store.tables import TABLES, fits
from rollstream.schemas import (
    Branch,
    EvaluatorOutput,
    Event,
    LlmCall,
    Reward,
    RolloutFinished,
    RolloutStarted,
    SandboxEvent,
    StageEvent,
    ToolCall,
    Usage,
)

pytestmark = pytest.mark.integration

TS = 1_735_689_600_000_000  # 2025-01-01 UTC

# Tables of the DDL that no mapper writes, and why.
NOT_MAPPED = {
    "schema_migrations": "the migrations' own record (migrations.py)",
    "rollout_tokens": "filled by materialized views from rollouts and llm_calls (0004)",
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    c = connect(f"chdb://{tmp_path_factory.mktemp('chdb')}")
    yield c
    c.close()  # chDB hosts one data path per process: free it for the next module


def ddl_columns(client: Any, database: str) -> dict[str, list[tuple[str, str]]]:
    """Every table (not view) of ``database``: its (name, type) columns in DDL order."""
    tables = query(
        client,
        "SELECT name FROM system.tables WHERE database = {db:String} "
        "AND engine NOT IN ('View', 'MaterializedView')",
        {"db": database},
    ).column("name")
    columns = query(
        client,
        "SELECT table, name, type FROM system.columns WHERE database = {db:String} "
        "ORDER BY table, position",
        {"db": database},
    )
    out: dict[str, list[tuple[str, str]]] = {name: [] for name in tables}
    for table, name, type_ in columns.rows:
        if table in out:
            out[table].append((name, type_))
    return out


def column_diff(ddl: dict[str, list[tuple[str, str]]]) -> list[str]:
    """What differs between the DDL's tables and ``tables.TABLES``, one line per problem (a
    unified diff of the column names where they differ)."""
    problems: list[str] = []
    mapped = {name: cols for name, cols in ddl.items() if name not in NOT_MAPPED}
    for name in sorted(set(mapped) - set(TABLES)):
        problems.append(f"table {name} is in the DDL but not in tables.TABLES")
    for name in sorted(set(TABLES) - set(mapped)):
        problems.append(f"table {name} is in tables.TABLES but not in the DDL")
    for name in sorted(set(TABLES) & set(mapped)):
        have = [c for c, _ in mapped[name]]
        want = [c.name for c in TABLES[name]]
        if have != want:
            diff = difflib.unified_diff(
                want, have, f"tables.TABLES[{name!r}]", f"DDL {name}", lineterm="", n=1
            )
            problems.append(f"columns of {name} differ:\n" + "\n".join(diff))
            continue
        for column, (_, type_) in zip(TABLES[name], mapped[name], strict=True):
            if not fits(column.kind, type_):
                problems.append(
                    f"{name}.{column.name}: the mappers write {column.kind!r}, the DDL has {type_}"
                )
    return problems


def test_the_mappers_columns_are_the_ddl_columns(client: Any) -> None:
    database = database_for(f"t{uuid.uuid4().hex[:10]}")
    apply_migrations(client, database)
    problems = column_diff(ddl_columns(client, database))
    assert not problems, "\n".join(problems)


def test_a_column_added_to_the_ddl_only_fails_the_check(client: Any, tmp_path: Path) -> None:
    directory = tmp_path / "ddl"
    shutil.copytree(MIGRATIONS_DIR, directory)
    last = max(int(p.name[:4]) for p in directory.glob("*.sql"))
    (directory / f"{last + 1:04d}_extra.sql").write_text(
        "ALTER TABLE {db}.tool_calls ADD COLUMN IF NOT EXISTS exit_code Int32 AFTER is_error;\n"
        "ALTER TABLE {db}.rewards MODIFY COLUMN value Float32;\n"
        "CREATE TABLE IF NOT EXISTS {db}.leases (id String) ENGINE = MergeTree ORDER BY id;\n"
    )
    database = database_for(f"t{uuid.uuid4().hex[:10]}")
    apply_migrations(client, database, directory=directory)
    problems = column_diff(ddl_columns(client, database))
    text = "\n".join(problems)
    assert len(problems) == 3, text
    assert "columns of tool_calls differ" in text and "+exit_code" in text
    assert "rewards.value: the mappers write 'f64', the DDL has Float32" in text
    assert "table leases is in the DDL but not in tables.TABLES" in text


def _events() -> list[Event]:
    bodies = [
        RolloutStarted("task-1", "g-1", policy_version=2, group_size=4),
        LlmCall("c1", None, 0, np.arange(8, dtype=np.uint32), np.arange(4, dtype=np.uint32),
                np.zeros(4, np.float32), usage=Usage(8, 4, 0)),
        ToolCall("t1", "bash", "{}", "ok", sandbox=None, at_call_id="c1"),
        Reward(1.0, "final", "tests"),
        Branch("b1", "retry", "c1"),
        StageEvent("run", "finished", "ok", 950.5, "job-1", "w1", ""),
        SandboxEvent("sb-1", "released", "bwrap", 3.5, "job-1"),
        EvaluatorOutput("suite", "ok", 3, 4, "3 passed", False, "job-1"),
        RolloutFinished("completed"),
    ]  # fmt: skip
    return [Event(f"e{i}", "r1", i, TS + i, b, "sdk") for i, b in enumerate(bodies)]


def test_the_column_mapper_builds_the_ddl_columns(client: Any) -> None:
    """The column mapper's Arrow tables: the DDL's column names in order, the Arrow types
    ``chstore.to_arrow`` gives the kinds of tables.TABLES, and ClickHouse takes them."""
    database = database_for(f"t{uuid.uuid4().hex[:10]}")
    apply_migrations(client, database)
    ddl = ddl_columns(client, database)
    batch = ColumnBatch("events", 0)
    for offset, event in enumerate(_events()):
        batch.add(event, offset)
    tables = batch.arrow()
    assert set(tables) == {
        "events", "llm_calls", "tool_calls", "rewards", "rollouts", "stages", "sandboxes",
        "evaluator_outputs",
    }  # fmt: skip
    for name, table in tables.items():
        assert table.column_names == [c for c, _ in ddl[name]], name
        expected: pa.Schema = chstore.to_arrow(name, []).schema
        assert table.schema.types == expected.types, name
    chstore.insert_arrow_tables(client, tables, "events:0:0:5", database=database)
    stored = {
        name: query(client, f"SELECT count() FROM {database}.{name}").rows[0][0] for name in tables
    }
    assert stored == {name: t.num_rows for name, t in tables.items()}
