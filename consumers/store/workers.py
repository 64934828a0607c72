"""Decode and map the sink's batches: in the consume loop, or in a pool of worker processes.

    MapJob                      one batch's raw messages (offsets, values, Kafka times): picklable
    MapResult                   its columns (in process) or Arrow tables (workers), and the
                                records that could not be decoded or mapped (index, code, reason,
                                kind)
    map_batch(job, codec)       decode + map to row tuples (pure: Codec and rows.RowBatch)
    map_columns(job, codec)     decode + map to columns (columnar.ColumnBatch): the sink's path
    mapping_gc()                a context: the cyclic GC's young generation sized for batches
    MapPool(workers, settings)  ``submit(job) -> Future[MapResult]``: decode + map + Arrow tables
                                in ``workers`` processes (``python -m`` this module: they open no
                                Kafka client and no ClickHouse; they build their Codec from the
                                sink's settings (``build_codec``); they exit when the sink's end
                                of their pipe closes, so they do not outlive a SIGKILLed sink)

Batch boundaries are cut before decoding (batches.py), so where a batch is decoded does not
change its offsets or its dedup token: the writer thread takes the results in the order the loop
cut the batches and inserts them in that order.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from rollstream.adapters.codecs import build_codec
from rollstream.consumers.errors import RowError
from rollstream.consumers.store.rows import RowBatch
from rollstream.consumers.store.tables import TableRows
from rollstream.schemas import (
    Codec,
    CommonSettings,
    DecodeError,
    Event,
    PolicyVersion,
    Sample,
    Trajectory,
)
from rollstream.schemas.dlq import CODE_UNDECODABLE

__all__ = [
    "CODE_UNMAPPABLE",
    "EXPECT",
    "MapJob",
    "MapPool",
    "MapResult",
    "map_batch",
    "map_columns",
    "map_to_arrow",
    "mapping_gc",
    "worker_main",
]

CODE_UNMAPPABLE = "unmappable"  # decoded, but the row mapper refused it (a RowError)

# contract topic name -> the record type its messages hold
EXPECT: dict[str, type[Any]] = {
    "events": Event,
    "trajectories": Trajectory,
    "samples": Sample,
    "policy": PolicyVersion,
}


@dataclass(slots=True)
class MapJob:
    """One batch of one topic partition, as consumed. ``timestamps_us`` (Kafka time in
    microseconds) only for the record types that use it (samples, trajectories)."""

    topic: str
    partition: int
    kind: str  # contract topic name (EXPECT)
    token: str  # the batch's dedup token (topic:partition:first:last)
    offsets: list[int]
    values: list[bytes | None]
    timestamps_us: list[int] | None = None


@dataclass(slots=True)
class MapResult:
    """A batch's rows (``rows``: map_batch), columns (``columns``: map_columns, in process) or
    Arrow tables (``arrow``: from a worker); the records that could not be stored as ``(index
    in the batch, code, reason, kind)`` with code ``undecodable`` (CODE_UNDECODABLE) or
    ``unmappable`` (CODE_UNMAPPABLE);
    ``arrow_error``: the rows did not fit their columns (the writer treats it as a rejected
    batch)."""

    token: str
    counts: dict[str, int]
    bad: list[tuple[int, str, str, str]] = field(default_factory=list)
    rows: TableRows | None = None
    arrow: dict[str, Any] | None = None  # table -> pyarrow.Table
    columns: Any = None  # a columnar.ColumnBatch (in process): ``arrow()`` builds the tables
    arrow_error: str | None = None

    @property
    def num_rows(self) -> int:
        return sum(self.counts.values())


def _map_into(job: MapJob, codec: Codec, rows: Any) -> list[tuple[int, str, str, str]]:
    """Decode every message of the job into ``rows`` (a RowBatch or a ColumnBatch); returns
    the records that failed (their offsets stay in the batch's range)."""
    expect = EXPECT[job.kind]
    bad: list[tuple[int, str, str, str]] = []
    decode, add = codec.decode, rows.add
    stamps = job.timestamps_us
    for i, (offset, value) in enumerate(zip(job.offsets, job.values, strict=True)):
        try:
            record = decode(value, expect)
        except DecodeError as exc:
            rows.skip(offset)
            bad.append((i, CODE_UNDECODABLE, exc.reason, ""))
            continue
        try:
            add(record, offset, timestamp_us=stamps[i] if stamps is not None else 0)
        except RowError as exc:
            bad.append((i, CODE_UNMAPPABLE, exc.reason, exc.kind))
    if job.offsets and rows.token != job.token:  # cannot happen: every offset is counted
        raise ValueError(f"mapped token {rows.token} != batch token {job.token}")
    return bad


def map_batch(job: MapJob, codec: Codec) -> MapResult:
    """Decode and map every message of the batch to row tuples (``rows.RowBatch``); the ones
    that fail are listed in ``bad`` (their offsets stay in the batch's range, so the token is
    the batch's)."""
    rows = RowBatch(job.topic, job.partition)
    bad = _map_into(job, codec, rows)
    counts = {table: len(table_rows) for table, table_rows in rows.tables.items()}
    return MapResult(job.token, counts, bad, rows=rows.tables)


def map_columns(job: MapJob, codec: Codec) -> MapResult:
    """``map_batch`` into a ``columnar.ColumnBatch`` (``columns``): the same records fail,
    the Arrow tables it builds are those of the rows (the sink's path)."""
    from rollstream.consumers.store.columnar import ColumnBatch  # pyarrow; no client is opened

    batch = ColumnBatch(job.topic, job.partition)
    bad = _map_into(job, codec, batch)
    return MapResult(job.token, batch.counts, bad, columns=batch)


def map_to_arrow(job: MapJob, codec: Codec) -> MapResult:
    """``map_columns`` plus the Arrow tables (what a worker sends back: one buffer per column
    instead of a Python object per value)."""
    from rollstream.consumers.store import chstore

    result = map_columns(job, codec)
    batch, result.columns = result.columns, None
    assert batch is not None
    try:
        result.arrow = batch.arrow()
    except chstore.InsertError as exc:
        result.arrow_error = str(exc)
    return result


# --- the cyclic GC while mapping -----------------------------------------------------------
#
# Decoding allocates ~4 GC-tracked objects per message (the Kafka message, the Event, its body,
# lists), and a batch keeps 20k messages alive until its insert. With the default young
# threshold (700) the collector runs every ~175 messages and scans those survivors again and
# again: 10-15% of the sink's threads' CPU in a py-spy profile, ~10% of its CPU per small event
# in bench_sink. The mapping allocates no reference cycles, so collecting less often frees no
# later; the thresholds of the older generations are left alone.

MAPPING_GC_THRESHOLD = 50_000
_gc_lock = threading.Lock()
_gc_users = 0
_gc_saved: tuple[int, int, int] | None = None


@contextlib.contextmanager
def mapping_gc(threshold: int = MAPPING_GC_THRESHOLD) -> Iterator[None]:
    """While any sink loop of the process is inside, the young generation's threshold is at
    least ``threshold``; the last one out restores what was set before (the GC's settings are
    the process's, so nested and concurrent sinks share them)."""
    global _gc_users, _gc_saved
    with _gc_lock:
        if _gc_users == 0:
            _gc_saved = gc.get_threshold()
            gc.set_threshold(max(threshold, _gc_saved[0]), *_gc_saved[1:])
        _gc_users += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_users -= 1
            if _gc_users == 0 and _gc_saved is not None:
                gc.set_threshold(*_gc_saved)
                _gc_saved = None


# --- the pool ------------------------------------------------------------------------------
#
# Workers are ``python -m rollstream.consumers.store.workers`` subprocesses that read the
# sink's settings (a CommonSettings: what build_codec needs), then pickled MapJobs, from stdin
# and write pickled MapResults to stdout (each frame an 8-byte length, then the pickle).
# Not multiprocessing: its spawned children re-import the parent's __main__, which is any
# script that happens to build a Sink.

_LEN = struct.Struct("<Q")


def _write_frame(out: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_LEN.pack(len(data)))
    out.write(data)
    out.flush()


def _read_frame(inp: BinaryIO) -> Any:
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the other end closed the pipe")
    (size,) = _LEN.unpack(head)
    data = inp.read(size)
    if len(data) < size:
        raise EOFError("the other end closed the pipe mid-frame")
    return pickle.loads(data)


def worker_main() -> None:
    """A worker: the settings, then MapJobs, in on stdin; MapResults (or the exception) out on
    stdout. It ends at EOF: when the sink closes the pipe or dies (even by SIGKILL: the kernel
    closes its end)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the sink decides when to stop
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the result pipe
    gc.set_threshold(MAPPING_GC_THRESHOLD, *gc.get_threshold()[1:])  # a worker only maps
    try:
        settings: CommonSettings = _read_frame(inp)
    except (EOFError, OSError):
        os._exit(0)
    codec = build_codec(settings)
    while True:
        try:
            job = _read_frame(inp)
        except (EOFError, OSError):
            os._exit(0)  # the sink is gone: no interpreter teardown, nothing to flush
        try:
            result: Any = map_to_arrow(job, codec)
        except Exception as exc:
            result = RuntimeError(f"worker failed on {job.token}: {type(exc).__name__}: {exc}")
        try:
            _write_frame(out, result)
        except OSError:  # the sink is gone
            os._exit(0)


class _Worker:
    """One worker process and the thread that feeds it jobs and resolves their futures."""

    def __init__(self, index: int, settings: CommonSettings) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.settings = settings  # the first frame the worker reads
        self.jobs: queue.SimpleQueue[tuple[MapJob, Future[MapResult]] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"sink-map-{index}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        broken: BaseException | None = None
        try:
            _write_frame(self.proc.stdin, self.settings)  # type: ignore[arg-type]
        except OSError as exc:
            broken = RuntimeError(f"map worker {self.proc.pid} died: {exc}")
        while True:
            item = self.jobs.get()
            if item is None:
                return
            job, future = item
            if broken is None:
                try:
                    _write_frame(self.proc.stdin, job)  # type: ignore[arg-type]
                    result = _read_frame(self.proc.stdout)  # type: ignore[arg-type]
                except (OSError, EOFError, pickle.PickleError) as exc:
                    broken = RuntimeError(f"map worker {self.proc.pid} died: {exc}")
                    result = broken
            else:
                result = broken
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    def close(self, timeout: float) -> None:
        self.jobs.put(None)
        self.thread.join(timeout)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class MapPool:
    """``workers`` processes that decode and map batches (``map_to_arrow``); jobs go to them in
    turn. Each builds its Codec from ``settings`` (``build_codec``: the common settings are
    sent, not the sink's own). A worker that dies fails its jobs (the sink stops; a restart
    re-reads the batches)."""

    def __init__(self, workers: int, settings: CommonSettings) -> None:
        if workers < 1:
            raise ValueError("a MapPool needs at least one worker")
        common = CommonSettings.model_construct(
            **{name: getattr(settings, name) for name in CommonSettings.model_fields}
        )  # picklable without the sink's modules, and read from no environment
        self._workers = [_Worker(i, common) for i in range(workers)]
        self._next = 0

    def warm_up(self, timeout: float = 60.0) -> None:
        """Wait until every worker answers (they import numpy and pyarrow: about a second)."""
        futures = []
        for worker in self._workers:
            future: Future[MapResult] = Future()
            worker.jobs.put((MapJob("", 0, "events", "", [], []), future))
            futures.append(future)
        for future in futures:
            future.result(timeout)

    def submit(self, job: MapJob) -> Future[MapResult]:
        future: Future[MapResult] = Future()
        self._workers[self._next].jobs.put((job, future))
        self._next = (self._next + 1) % len(self._workers)
        return future

    def close(self, timeout: float = 30.0) -> None:
        for worker in self._workers:
            worker.close(timeout)


if __name__ == "__main__":
    # run the package's copy of this module, so results pickle as its classes, not __main__'s
    import importlib

    importlib.import_module(__spec__.name).worker_main()
