"""The batch path on several cores (the process shell of streams/batch_phases.py):

    process_batch_parallel(items, config, codec, workers=N) -> BatchOutput

Phase 1 runs the trajectory builders of ``workers`` shares of the source partitions (balanced
by record count) to the end of the input: one share in this process, each other one in a
forked child. This process orders the trajectories they made as ``BatchProcessor`` hands them
over; phase 2 runs the group aggregators of shares of the trajectories partitions the same way.
The children inherit their input by ``fork`` (nothing is pickled on the way in), so this runs
where ``fork`` does (Linux); each sends its result back pickled in a file, on tmpfs
(``/dev/shm``) or, where that is missing or full, in the temp folder, removed once read. The
output is the one ``process_batch`` gives, as multisets of records
(``BatchOutput.trajectories`` in hand-over order, dead letters then samples by share), with
the same counts.

What it costs: the whole input in memory (as ``process_batch``), plus the trajectories between
the phases; each child's first write to a page it shares with this process is a page fault.
It pays where there are cores to spare and the outputs are small beside the work
(bench_batch_process.py); with one worker, or one partition, it runs ``process_batch`` here.

    StreamsError
    └── ProcessorError
        └── BatchWorkerError    a worker process failed or died (its error and traceback)
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import multiprocessing
import os
import pickle
import tempfile
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

from rollstream.schemas import Codec, Event

from .batch import BatchConfig, BatchOutput, SourceRecord, _records, process_batch
from .batch_phases import (
    Built,
    Made,
    aggregate_lanes,
    build_partitions,
    lane_of,
    merge_counts,
    order_made,
    split_evenly,
)
from .books import Out
from .errors import ProcessorError

__all__ = ["BatchWorkerError", "Phases", "process_batch_parallel", "two_phases"]

T = TypeVar("T")
R = TypeVar("R")
X = TypeVar("X")
Y = TypeVar("Y")
_JOIN_S = 10.0  # how long a worker that has sent its result may take to exit
_SHM = "/dev/shm"


class BatchWorkerError(ProcessorError):
    """A worker process of the parallel batch path failed (its error) or died."""


def process_batch_parallel(
    items: Iterable[SourceRecord | Event],
    config: BatchConfig | None = None,
    codec: Codec | None = None,
    *,
    workers: int = 2,
) -> BatchOutput:
    """``process_batch`` over ``workers`` processes (see the module docstring)."""
    config = config or BatchConfig()
    codec = codec or Codec()
    records = list(_records(items, config, codec))
    per_partition = Counter(r.partition for r in records)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1 or len(per_partition) < 2:
        return process_batch(records, config, codec)

    def aggregate(made: list[Made], share: set[int]) -> tuple[dict[str, int], list[Out]]:
        part = aggregate_lanes(made, config, codec, share)
        return part.counts, part.outs

    phases = two_phases(
        per_partition,
        workers,
        lambda share, local: (build_partitions(records, config, codec, share, keep=local), None),
        aggregate,
    )
    result = BatchOutput()
    result.trajectories = [m.out for m in phases.made]
    for built, _ in phases.built:
        result.add(built.outs)
    for _, outs in phases.aggregated:
        result.add(outs)
    result.counts = phases.counts
    return result


@dataclass(slots=True)
class Phases(Generic[X, Y]):
    """What ``two_phases`` ran: phase 1's results per share, the trajectories in hand-over
    order, phase 2's results per share, and the counts of both phases summed."""

    built: list[tuple[Built, X]]
    made: list[Made]
    aggregated: list[tuple[dict[str, int], Y]]
    counts: dict[str, int]


def two_phases(
    sizes: Mapping[int, int],
    workers: int,
    build: Callable[[set[int], bool], tuple[Built, X]],
    aggregate: Callable[[list[Made], set[int]], tuple[dict[str, int], Y]],
) -> Phases[X, Y]:
    """The two phases over ``workers`` processes (``_fork_map``): ``build(share, local)`` for
    shares of the source partitions (balanced by ``sizes``: records per partition), then
    ``aggregate(made, share)`` for shares of the trajectories partitions over every
    trajectory in hand-over order. Each returns its counts and what else its caller needs."""
    built = _fork_map(build, split_evenly(sizes, workers))
    made = order_made(b for b, _ in built)
    lanes = split_evenly(Counter(lane_of(m) for m in made), workers) or [set()]
    aggregated = _fork_map(lambda share, _: aggregate(made, share), lanes)
    counts = merge_counts([b.counts for b, _ in built] + [c for c, _ in aggregated])
    return Phases(built, made, aggregated, counts)


def _folders() -> list[str]:
    """Where a worker writes its result: tmpfs first (memory speed), then the temp folder
    (a tmpfs too small for it, as a container's 64 MiB /dev/shm may be)."""
    temp = tempfile.gettempdir()
    return [_SHM, temp] if os.path.isdir(_SHM) and temp != _SHM else [temp]


def _fork_map(fn: Callable[[T, bool], R], shares: list[T]) -> list[R]:
    """``[fn(share, local) for share in shares]``: the first in this process (``local``
    True), each other one in a forked child process, whose result comes back pickled in a
    file (a pipe moves large results at a fraction of memory speed) named on its pipe."""
    context = multiprocessing.get_context("fork")
    children: list[tuple[Any, Connection, str]] = []  # (process, pipe, file name)
    folders = _folders()
    run = f"rollstream-batch-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    # the collectors of the children, and of this process while it runs its share, leave the
    # objects there are now alone: in the children, their pages stay shared; here, a full
    # collection does not walk the input again and again (unless the freezing is someone
    # else's: then it stays as it is)
    freeze = gc.get_freeze_count() == 0
    results: list[R] = []
    done = False
    try:
        if freeze:
            gc.freeze()
        try:
            for i, share in enumerate(shares[1:]):
                name = f"{run}-{i}.pickle"
                receive, send = context.Pipe(duplex=False)
                child = context.Process(
                    target=_child, args=(send, fn, share, folders, name), daemon=True
                )
                children.append((child, receive, name))
                child.start()
                send.close()
            results.append(fn(shares[0], True))
        finally:
            if freeze:
                gc.unfreeze()
        for child, receive, _ in children:
            try:
                ok, said = receive.recv()
            except EOFError:
                child.join(_JOIN_S)
                raise BatchWorkerError(
                    f"a batch worker died (exit code {child.exitcode})"
                ) from None
            if not ok:
                raise BatchWorkerError(f"a batch worker failed: {said}")
            with open(said, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                results.append(pickle.loads(m))  # one copy: the file's pages are read in place
        done = True
    finally:
        for child, receive, name in children:
            receive.close()
            if child.pid is not None:
                if done:  # each has sent its result: it exits now
                    child.join(_JOIN_S)
                if child.is_alive():  # a failure here or in another worker: no need for it
                    child.kill()
                    child.join()
            for folder in folders:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, name))
    return results


def _child(
    send: Connection,
    fn: Callable[[Any, bool], Any],
    share: Any,
    folders: list[str],
    name: str,
) -> None:
    """Run ``fn`` on ``share``; say on ``send`` (True, the file with the pickled result) or
    (False, the error and its traceback)."""
    reply: tuple[bool, str]
    try:
        result = fn(share, False)
        for n, folder in enumerate(folders):
            path = os.path.join(folder, name)
            try:
                with open(path, "wb") as f:
                    pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
                reply = (True, path)
                break
            except OSError:  # full: the next folder
                with contextlib.suppress(OSError):
                    os.unlink(path)
                if n == len(folders) - 1:
                    raise
    except BaseException as exc:  # the parent raises it, with the child's traceback
        reply = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    send.send(reply)
    send.close()
