"""Re-inserting a batch after a crash without trusting its dedup token blindly.

ClickHouse's non-replicated deduplication log (``non_replicated_deduplication_window``) records
a block's token *before* the new part is renamed into the table. A process killed between the
two leaves the token in the log and no rows in the table, and every retry with that token is
then dropped as a duplicate: the batch is lost although its insert "succeeded". Measured with
chDB: 1 batch in 163 lost over 60 SIGKILLs of a process inserting token-tagged batches in a
loop (docs/sink-and-replay.md, "Crash safety").

So after every partition assignment the sink *verifies* the batches it re-reads, in order,
until the first one of which nothing is stored: it asks each table which of the batch's Kafka
offsets it holds, then sends the batch under its own token, as any retry (ClickHouse drops the
blocks it holds, and the materialized views that feed ``rollout_tokens`` see every row), asks
again, and sends the rows still missing — a poisoned token's — under a fresh one. Never a
fresh token first: per table, the own token is either stored with its rows or poisoned, so a
later re-send under it adds nothing; rows stored under a fresh token that a later attempt does
not know would be stored again by that attempt's re-send (a first version did that: the
100-kill loop found whole batches twice in llm_calls). From the first batch with nothing stored
on, every later batch of the partition was never attempted, so their tokens are trusted again.
Only one insert is in flight at a time (the writer thread), so at most one token can be
poisoned per crash.

    present_count(client, database, table, topic, partition, lo, hi) -> int
    present_offsets(client, database, table, topic, partition, lo, hi) -> set[int]
    missing_rows(tables, present) -> dict[str, pa.Table]     (pure)
    fresh_token(token) -> str
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rollstream.consumers.store import chstore

__all__ = ["fresh_token", "missing_rows", "present_count", "present_offsets"]

_WHERE = (
    "WHERE kafka_topic = {t:String} AND kafka_partition = {p:Int32} "
    "AND kafka_offset BETWEEN {lo:Int64} AND {hi:Int64}"
)


def _ask(
    client: Any, what: str, database: str, table: str, topic: str, partition: int, lo: int, hi: int
) -> Any:
    """``SELECT what FROM table`` over the rows of ``topic[partition]`` offsets ``[lo, hi]``."""
    chstore.check_identifier(database)
    chstore.check_identifier(table)
    return chstore.query(
        client,
        f"SELECT {what} FROM {database}.{table} {_WHERE}",
        {"t": topic, "p": partition, "lo": lo, "hi": hi},
    )


def present_count(
    client: Any, database: str, table: str, topic: str, partition: int, lo: int, hi: int
) -> int:
    """How many Kafka offsets of ``topic[partition]`` in ``[lo, hi]`` have a row in ``table``
    (one number back instead of every offset: the usual answer is "none" or "all")."""
    result = _ask(client, "uniqExact(kafka_offset)", database, table, topic, partition, lo, hi)
    return int(result.rows[0][0])


def present_offsets(
    client: Any, database: str, table: str, topic: str, partition: int, lo: int, hi: int
) -> set[int]:
    """Kafka offsets of ``topic[partition]`` in ``[lo, hi]`` that have a row in ``table``."""
    result = _ask(client, "DISTINCT kafka_offset", database, table, topic, partition, lo, hi)
    return {int(row[0]) for row in result.rows}


def missing_rows(
    tables: Mapping[str, pa.Table], present: Mapping[str, set[int]]
) -> dict[str, pa.Table]:
    """Each table's rows whose ``kafka_offset`` is not in ``present[table]`` (tables with none
    left are omitted). A record gives at most one row per table, so the offset names the row."""
    out: dict[str, pa.Table] = {}
    for name, table in tables.items():
        have = present.get(name) or set()
        if have:
            keep = pc.invert(pc.is_in(table.column("kafka_offset"), pa.array(sorted(have))))
            table = table.filter(keep)
        if table.num_rows:
            out[name] = table
    return out


def fresh_token(token: str) -> str:
    """A token no earlier attempt used (a verified insert must not meet a poisoned one)."""
    return f"{token}:v{uuid.uuid4().hex[:12]}"
