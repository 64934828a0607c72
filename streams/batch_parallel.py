"""The batch path on several cores (the process shell of streams/batch_phases.py):

    process_batch_parallel(items, config, codec, workers=N) -> BatchOutput

Phase 1 forks ``workers`` processes, each running the trajectory builders of a share of the
source partitions (shares balanced by record count) to the end of the input; the parent orders
the trajectories they made as ``BatchProcessor`` hands them over; phase 2 forks again, each
process running the group aggregators of a share of the trajectories partitions. The children
inherit the input by ``fork`` (nothing is pickled on the way in; their results come back
pickled through a pipe), so this runs where ``fork`` does (Linux). The output is the one
``process_batch`` gives, as multisets of records (``BatchOutput.trajectories`` in hand-over
order, dead letters then samples by share), with the same counts.

What it costs: the whole input in memory (as ``process_batch``), plus the trajectories between
the phases. It pays where there are cores to spare and enough input (bench_batch_process.py);
with one worker, or one partition, it runs ``process_batch`` in this process.

    StreamsError
    └── ProcessorError
        └── BatchWorkerError    a worker process failed or died (its error and traceback)
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import pickle
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from rollstream.schemas import Codec, Event

from .batch import BatchConfig, BatchOutput, SourceRecord, _records, process_batch
from .batch_phases import (
    aggregate_lanes,
    build_partitions,
    lane_of,
    merge_counts,
    order_made,
    split_evenly,
)
from .errors import ProcessorError

__all__ = ["BatchWorkerError", "process_batch_parallel"]

T = TypeVar("T")
R = TypeVar("R")
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
    builts = _fork_map(
        lambda share, local: build_partitions(records, config, codec, share, keep=local),
        split_evenly(per_partition, workers),
    )
    made = order_made(builts)
    per_lane = Counter(lane_of(m) for m in made)
    shares = split_evenly(per_lane, workers)
    if len(shares) > 1:
        aggregated = _fork_map(lambda share, _: aggregate_lanes(made, config, codec, share), shares)
    else:
        aggregated = [aggregate_lanes(made, config, codec, set(per_lane))]
    result = BatchOutput()
    result.trajectories = [m.out for m in made]
    for built in builts:
        result.add(built.outs)
    for part in aggregated:
        result.add(part.outs)
    result.counts = merge_counts([b.counts for b in builts] + [a.counts for a in aggregated])
    return result


def _fork_map(fn: Callable[[T, bool], R], shares: list[T]) -> list[R]:
    """``[fn(share, local) for share in shares]``: the first in this process (``local``
    True), each other one in a forked child process, whose result comes back pickled in a
    file (on tmpfs where there is one: a pipe moves large results at a fraction of memory
    speed) once its pipe says it is there."""
    context = multiprocessing.get_context("fork")
    children: list[tuple[Any, Connection, str]] = []
    folder = _SHM if os.path.isdir(_SHM) else tempfile.gettempdir()
    # the collectors of the children, and of this process while it runs its share, leave the
    # objects there are now alone: in the children, their pages stay shared; here, a full
    # collection does not walk the input again and again (unless the freezing is someone
    # else's: then it stays as it is)
    freeze = gc.get_freeze_count() == 0
    results: list[R] = []
    try:
        if freeze:
            gc.freeze()
        try:
            for share in shares[1:]:
                fd, path = tempfile.mkstemp(
                    prefix="rollstream-batch-", suffix=".pickle", dir=folder
                )
                os.close(fd)
                receive, send = context.Pipe(duplex=False)
                child = context.Process(target=_child, args=(send, fn, share, path), daemon=True)
                children.append((child, receive, path))
                child.start()
                send.close()
            results.append(fn(shares[0], True))
        finally:
            if freeze:
                gc.unfreeze()
        for child, receive, path in children:
            try:
                ok, error = receive.recv()
            except EOFError:
                child.join(_JOIN_S)
                raise BatchWorkerError(
                    f"a batch worker died (exit code {child.exitcode})"
                ) from None
            if not ok:
                raise BatchWorkerError(f"a batch worker failed: {error}")
            with open(path, "rb") as f:
                results.append(pickle.loads(f.read()))
    finally:
        for child, receive, path in children:
            receive.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            if child.pid is not None:
                child.join(_JOIN_S)
                if child.is_alive():
                    child.kill()
                    child.join()
    return results


def _child(send: Connection, fn: Callable[[Any, bool], Any], share: Any, path: str) -> None:
    try:
        result = fn(share, False)
        with open(path, "wb") as f:
            pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
        reply: tuple[bool, str] = (True, "")
    except BaseException as exc:  # the parent raises it, with the child's traceback
        reply = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    send.send(reply)
    send.close()
