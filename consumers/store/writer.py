"""The sink's writer thread and what it does with each batch: dead-letter its bad records,
then insert its rows into ClickHouse (the I/O half of the sink; the loop is sink.py).

    Mapped                  a batch handed to the writer: mapped in the loop, or by a worker
    WriterThread(store)     inserts the handed-over batches in order, beside the consume loop
    BatchStore(...)         ``store(mapped)``: dead letters, then the insert (retried with
                            backoff on a transport failure; verified against the tables after
                            an assignment; one record at a time when the server rejects it)

ClickHouse releases the GIL while it inserts, so the loop decodes the next batches meanwhile.
Offsets are committed by the loop (the thread that polls), for the batches ``done()`` returns.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from confluent_kafka import Message

from rollstream.consumers.errors import InsertError, InsertRetryError, QueryError, SinkError
from rollstream.consumers.store import chstore
from rollstream.consumers.store import verify as sink_verify
from rollstream.consumers.store.batches import RawBatch
from rollstream.consumers.store.dead_letters import CODE_REJECTED, DeadLetters
from rollstream.consumers.store.rows import RowBatch
from rollstream.consumers.store.settings import SinkSettings
from rollstream.consumers.store.stats import SinkStats
from rollstream.consumers.store.workers import EXPECT, MapResult
from rollstream.schemas import Codec

__all__ = ["BatchStore", "Mapped", "WriterThread", "message_offset"]

T = TypeVar("T")
log = logging.getLogger(__name__)


def message_offset(msg: Message) -> int:
    """A consumed message's offset (the client's type says it may be None; it is not)."""
    offset = msg.offset()
    if offset is None:
        raise SinkError(f"message of {msg.topic()}[{msg.partition()}] without an offset")
    return offset


@dataclass
class Mapped:
    """A batch handed to the writer: mapped in the loop (``result``) or being mapped by a worker
    (``future``). Its bad records are dead-lettered by the writer, before the insert."""

    batch: RawBatch
    result: MapResult | None = None
    future: Future[MapResult] | None = None

    def wait(self) -> MapResult:
        if self.result is None:
            assert self.future is not None
            self.result, self.future = self.future.result(), None
        return self.result


class WriterThread:
    """The thread that inserts, in order, the batches the consume loop has mapped, so ClickHouse
    (which releases the GIL) works while the loop decodes the next ones. The loop commits what
    ``done()`` returns: offsets are committed by the thread that polls (a synchronous commit
    from another thread waits on the poller and can hang). ``drain()`` waits until everything
    handed over is inserted; a failure is raised in the loop by ``check``/``submit``/``drain``."""

    def __init__(self, store: Callable[[Mapped], None], depth: int) -> None:
        self._store = store
        self._jobs: queue.Queue[Mapped | None] = queue.Queue(maxsize=max(1, depth))
        self._done: queue.SimpleQueue[Mapped] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sink-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self.error is None:
                    self._store(job)
                    self._done.put(job)
            except BaseException as exc:  # handed to the loop, which raises it
                self.error = exc
            finally:
                self._jobs.task_done()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, job: Mapped, timeout: float) -> bool:
        """Hand a batch over; False if the queue stayed full for ``timeout`` seconds."""
        self.check()
        try:
            self._jobs.put(job, timeout=timeout)
        except queue.Full:
            return False
        return True

    def done(self) -> list[Mapped]:
        """The batches inserted since the last call, in order."""
        out: list[Mapped] = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self._done.get_nowait())
        return out

    def drain(self) -> None:
        self._jobs.join()
        self.check()

    def close(self, timeout: float = 60.0) -> None:
        with contextlib.suppress(queue.Full):
            self._jobs.put(None, timeout=timeout)
        self._thread.join(timeout)


class BatchStore:
    """Stores the sink's batches (the writer thread's ``store``). ``verifying``: the partitions
    whose re-read batches are checked against the tables before their insert (verify.py); the
    loop adds a partition at each assignment, and ``store`` removes it at the first batch of
    which nothing was stored."""

    def __init__(
        self,
        settings: SinkSettings,
        client: Any,
        *,
        codec: Codec,
        dead_letters: DeadLetters,
        stats: SinkStats,
        verifying: set[tuple[str, int]],
    ) -> None:
        self.settings = settings
        self.database = settings.database
        self.client = client
        self.codec = codec  # decodes the records of a rejected batch, one by one
        self.dead_letters = dead_letters
        self.stats = stats
        self.verifying = verifying
        self._topics = settings.topic_names()

    def store(self, mapped: Mapped) -> None:
        """Dead-letter the batch's bad records, then insert its rows."""
        batch, result = mapped.batch, mapped.wait()
        if result.token != batch.token:  # cannot happen: map_columns counts every offset
            raise SinkError(f"batch token {result.token} != {batch.token}")
        for index, code, reason, kind in result.bad:
            self._dead_letter(batch.items[index], reason, code, kind)
        key = (batch.topic, batch.partition)
        verify = key in self.verifying
        try:
            if result.arrow_error is not None:
                raise InsertError(result.arrow_error, table="", token=batch.token, retryable=False)
            if result.arrow is not None:
                tables = result.arrow
            elif result.columns is not None:
                tables = result.columns.arrow()
            elif result.rows:
                tables = chstore.arrow_tables(result.rows, batch.token)
            else:
                tables = {}
            if not verify:
                self._insert_arrow(tables, batch.token)
            elif tables and not self._insert_verified(batch, batch.first, batch.last, tables):
                self.verifying.discard(key)  # nothing of it was stored: never attempted after
        except InsertError as exc:
            if exc.retryable:
                raise
            log.warning(
                "batch %s rejected (%s): inserting its records one by one", batch.token, exc
            )
            self.stats.split_batches += 1
            self._store_one_by_one(batch, {index for index, *_ in result.bad}, verify)
        self.stats.batches += 1
        self.stats.last_insert_at = time.monotonic()
        for table, n in result.counts.items():
            self.stats.rows[table] = self.stats.rows.get(table, 0) + n
        log.debug(
            "inserted %s (%d messages, %d rows)", batch.token, len(batch.items), result.num_rows
        )

    def _dead_letter(self, msg: Message, reason: str, code: str, kind: str) -> None:
        self.dead_letters.send(msg, reason=reason, code=code, kind=kind)
        self.stats.dead_letters += 1

    def _store_one_by_one(self, batch: RawBatch, bad: set[int], verify: bool = False) -> None:
        """A rejected batch: each record that mapped is inserted alone (token
        ``topic:partition:o:o``; checked against the tables first when ``verify``); the ones the
        server rejects go to the DLQ (``rejected``)."""
        expect = EXPECT[self._topics[batch.topic]]
        for index, msg in enumerate(batch.items):
            if index in bad:
                continue
            record = self.codec.decode(msg.value(), expect=expect)
            offset = message_offset(msg)
            one = RowBatch(batch.topic, batch.partition)
            one.add(record, offset, timestamp_us=max(msg.timestamp()[1], 0) * 1000)
            try:
                if not verify:
                    self._insert(one)
                elif one.tables:
                    tables = chstore.arrow_tables(one.tables, one.token)
                    self._insert_verified(batch, offset, offset, tables, one.token)
            except InsertError as err:
                if err.retryable:
                    raise
                self._dead_letter(msg, str(err), CODE_REJECTED, type(record).__name__)

    def _insert(self, rows: RowBatch) -> None:
        if rows.tables:
            self._insert_arrow(chstore.arrow_tables(rows.tables, rows.token), rows.token)

    def _insert_verified(
        self, batch: RawBatch, first: int, last: int, tables: dict[str, Any], token: str = ""
    ) -> bool:
        """Store the rows of offsets ``first..last`` of the batch's partition (``token``: their
        dedup token, the batch's by default) without trusting the token: the rows go in under
        their own token (ClickHouse drops what it holds under it, and the materialized views
        see every row, as on any retry), then what is still missing — the rows of a poisoned
        token — under a fresh one. Never a fresh token first: rows stored under a token no
        later attempt knows would be stored again by that attempt's re-send (the own token, by
        contrast, is for each table either stored with its rows or poisoned, and a re-send
        under it adds nothing either way). Returns whether any row was stored already."""
        token = token or batch.token
        self.stats.verified_batches += 1
        stored = sum(self._present(batch, first, last, tables, sink_verify.present_count).values())
        self.stats.verified_rows_present += stored
        self._insert_arrow(tables, token)
        # a record gives at most one row per table: a table holding as many of the batch's
        # offsets as it has rows is complete; the offsets are fetched only for the others
        counts = self._present(batch, first, last, tables, sink_verify.present_count)
        short = {name: t for name, t in tables.items() if counts[name] < t.num_rows}
        offsets = self._present(batch, first, last, short, sink_verify.present_offsets)
        tables = sink_verify.missing_rows(short, offsets)
        if tables:
            self._insert_arrow(tables, sink_verify.fresh_token(token))
        log.debug("verified %s[%d..%d]: %d rows stored already", token, first, last, stored)
        return stored > 0

    def _present(
        self, batch: RawBatch, first: int, last: int, tables: dict[str, Any], ask: Callable[..., T]
    ) -> dict[str, T]:
        """``ask`` (verify.present_count or present_offsets) for each table."""
        return {
            name: self._retrying(
                f"verify of {batch.token}",
                functools.partial(
                    ask, self.client, self.database, name, batch.topic, batch.partition, first,
                    last,
                ),
            )
            for name in tables
        }  # fmt: skip

    def _retrying(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, retried with backoff for ``sink_insert_retry_s`` on a transport failure (a
        QueryError, or a retryable InsertError); a rejected insert is raised at once."""
        deadline = time.monotonic() + self.settings.sink_insert_retry_s
        delay = 0.2
        while True:
            try:
                return fn()
            except (QueryError, InsertError) as exc:
                if isinstance(exc, InsertError) and not exc.retryable:
                    raise
                if time.monotonic() + delay > deadline:
                    raise InsertRetryError(f"{what} kept failing: {exc}") from exc
                self.stats.insert_retries += 1
                log.warning("%s failed (%s); retrying in %.1fs", what, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _insert_arrow(self, tables: dict[str, Any], token: str) -> None:
        """Insert with the batch's token; a retryable failure is retried with backoff."""
        if tables:
            self._retrying(
                f"insert of {token}",
                lambda: chstore.insert_arrow_tables(
                    self.client, tables, token, database=self.database
                ),
            )
