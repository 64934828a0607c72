"""ClickHouse schema migrations: versioned DDL files applied idempotently at start.

``consumers/store/ddl/NNNN_name.sql`` files hold the DDL, with ``{db}`` standing for the
namespace's database. ``apply_migrations(client, database)`` creates the database and its
``schema_migrations`` table, then runs, in version order, every file whose version is not
recorded there, and records it (version, name, sha256 of the text). Applying twice changes
nothing. A recorded migration whose file has changed since is an error (``MigrationError``):
write a new migration instead of editing an applied one.

Every statement is itself idempotent (``IF NOT EXISTS``), so two processes racing at start, or
a start that died half-way through a file, are safe: the next run completes it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError

from rollstream.consumers.store.chstore import DEFAULT_DATABASE, MigrationError, check_identifier

__all__ = [
    "MIGRATIONS_DIR",
    "Migration",
    "MigrationError",
    "applied_migrations",
    "apply_migrations",
    "load_migrations",
    "split_statements",
]

MIGRATIONS_DIR = Path(__file__).parent / "ddl"
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    def statements(self, database: str) -> list[str]:
        return [s.replace("{db}", database) for s in split_statements(self.sql)]


def split_statements(sql: str) -> list[str]:
    """Split a file on ``;`` outside quotes, dropping ``--`` comments and empty statements."""
    out: list[str] = []
    buf: list[str] = []
    quote: str | None = None
    i = 0
    while i < len(sql):
        ch = sql[i]
        if quote:
            buf.append(ch)
            if ch == "\\" and i + 1 < len(sql):
                buf.append(sql[i + 1])
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'`\"":
            quote = ch
            buf.append(ch)
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = len(sql) if end < 0 else end
            continue
        elif ch == ";":
            out.append("".join(buf).strip())
            buf = []
        else:
            buf.append(ch)
        i += 1
    out.append("".join(buf).strip())
    return [s for s in out if s]


def load_migrations(directory: Path = MIGRATIONS_DIR) -> list[Migration]:
    found: dict[int, Migration] = {}
    for path in sorted(directory.glob("*.sql")):
        match = _FILE.match(path.name)
        if not match:
            raise MigrationError(f"migration file name is not NNNN_name.sql: {path.name}")
        version = int(match.group(1))
        if version in found:
            raise MigrationError(f"two migrations with version {version}")
        found[version] = Migration(version, match.group(2), path.read_text())
    return [found[v] for v in sorted(found)]


def _run(client: Client, sql: str) -> None:
    try:
        client.command(sql)
    except ClickHouseError as exc:
        raise MigrationError(f"migration statement failed: {exc}\n{sql}") from exc


def applied_migrations(client: Client, database: str = DEFAULT_DATABASE) -> dict[int, str]:
    """Recorded versions and their checksums (empty before the first run)."""
    check_identifier(database)
    try:
        exists = client.command(
            "SELECT count() FROM system.tables WHERE database = {db:String} "
            "AND name = 'schema_migrations'",
            parameters={"db": database},
        )
        if not int(exists):  # type: ignore[arg-type]
            return {}
        result = client.query(
            f"SELECT version, argMax(checksum, applied_at) FROM {database}.schema_migrations "
            "GROUP BY version"
        )
    except ClickHouseError as exc:
        raise MigrationError(f"cannot read {database}.schema_migrations: {exc}") from exc
    return {int(v): str(c) for v, c in result.result_rows}


def apply_migrations(
    client: Client,
    database: str = DEFAULT_DATABASE,
    *,
    directory: Path = MIGRATIONS_DIR,
) -> list[str]:
    """Apply the migrations not yet recorded in ``database``; returns their ids
    (``"0001_events"``), empty when the schema is current."""
    check_identifier(database)
    migrations = load_migrations(directory)
    _run(client, f"CREATE DATABASE IF NOT EXISTS {database}")
    _run(
        client,
        f"CREATE TABLE IF NOT EXISTS {database}.schema_migrations "
        "(version UInt32, name String, checksum String, "
        "applied_at DateTime64(3, 'UTC') DEFAULT now64(3)) "
        "ENGINE = ReplacingMergeTree(applied_at) ORDER BY version",
    )
    done = applied_migrations(client, database)
    applied: list[str] = []
    for m in migrations:
        recorded = done.get(m.version)
        if recorded is not None:
            if recorded != m.checksum:
                raise MigrationError(
                    f"migration {m.version:04d}_{m.name} was applied to {database} and has "
                    "changed since; add a new migration instead of editing an applied one"
                )
            continue
        for statement in m.statements(database):
            _run(client, statement)
        try:
            client.insert(
                "schema_migrations",
                [(m.version, m.name, m.checksum)],
                column_names=["version", "name", "checksum"],
                database=database,
            )
        except ClickHouseError as exc:
            raise MigrationError(f"cannot record migration {m.version}: {exc}") from exc
        applied.append(f"{m.version:04d}_{m.name}")
    return applied
