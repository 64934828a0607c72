"""The batch path in two phases (streams/batch_phases.py) and over processes
(streams/batch_parallel.py, real forked children): the same trajectories, samples, dead letters
and counts as ``process_batch`` in one process, whatever the split of the partitions; a worker
that fails or dies is an error naming why, and leaves no file behind."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from test_streams_batch import (
    EVENTS_ROUTE,
    ROUTE,
    S,
    config,
    dead_letters,
    finished_run,
    interleave,
    records,
    samples,
    trajectories,
)

from rollstream.schemas import Codec
from rollstream.streams import batch_parallel
from rollstream.streams.app import group_route
from rollstream.streams.batch import BatchConfig, BatchOutput, process_batch
from rollstream.streams.batch_parallel import BatchWorkerError, process_batch_parallel
from rollstream.streams.batch_phases import (
    aggregate_lanes,
    build_partitions,
    merge_counts,
    order_made,
    split_evenly,
)

codec = Codec()


TIMEOUTS = [(3, 4), (3, 600), (30, 600), (900, 4)]  # (group, inactivity) seconds


def jittered(seed: int, timeouts: tuple[int, int] | None = None) -> tuple[list[Any], BatchConfig]:
    """A run whose timeouts fire mid-run and at the end, with ties across partitions; a third
    of its rollouts never finish (closed by the inactivity timeout, many only after the end of
    the input)."""
    rng = random.Random(seed)
    rollouts = [r if rng.random() < 0.67 else r[:-1] for r in finished_run(seed, groups=5)]
    group, idle = timeouts or rng.choice(TIMEOUTS)
    cfg = config(timeout_us=group * S, inactivity_us=idle * S)
    for r in rollouts:
        for e in r:
            e.ts += rng.randint(0, 20) * S
    return records(interleave(rollouts, rng)), cfg


def assert_equal(got: BatchOutput, want: BatchOutput) -> None:
    assert samples(got) == samples(want)
    assert trajectories(got) == trajectories(want)
    assert dead_letters(got) == dead_letters(want)
    assert got.counts == want.counts
    assert sorted(o.value or b"" for o in got.samples) == sorted(
        o.value or b"" for o in want.samples
    )


def random_split(keys: set[int], rng: random.Random) -> list[set[int]]:
    shares: list[set[int]] = [set() for _ in range(rng.randint(1, len(keys)))]
    for key in keys:
        rng.choice(shares).add(key)
    return [s for s in shares if s]


@pytest.mark.parametrize("timeouts", TIMEOUTS)
@pytest.mark.parametrize("seed", range(4))
def test_the_phases_over_any_split_give_what_process_batch_gives(
    seed: int, timeouts: tuple[int, int]
) -> None:
    rng = random.Random(1000 + seed)
    recs, cfg = jittered(seed, timeouts)
    want = process_batch(recs, cfg)
    builts = [
        build_partitions(recs, cfg, codec, share, keep=rng.random() < 0.5)
        for share in random_split({r.partition for r in recs}, rng)
    ]
    made = order_made(builts)
    parts = [aggregate_lanes(made, cfg, codec, share) for share in random_split(set(range(6)), rng)]
    got = BatchOutput()
    got.trajectories = [m.out for m in made]
    for part in [*builts, *parts]:
        got.add(part.outs)
    got.counts = merge_counts([p.counts for p in [*builts, *parts]])
    assert_equal(got, want)


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_worker_processes_give_what_one_process_gives(workers: int, seed: int) -> None:
    recs, cfg = jittered(seed)
    assert_equal(process_batch_parallel(recs, cfg, workers=workers), process_batch(recs, cfg))


def test_events_in_and_more_partitions_than_workers() -> None:
    """Events (keyed and placed as a producer would) over 6 source partitions, 2 workers; the
    golden logs' invalid rollouts and the loose timeouts included."""
    rollouts = finished_run(3, groups=8)
    events = interleave(rollouts, random.Random(3))
    cfg = BatchConfig(
        builder=config().builder,
        groups=config().groups,
        route=ROUTE,
        event_partition=group_route(6),
    )
    got = process_batch_parallel(events, cfg, workers=2)
    want = process_batch(events, cfg)
    assert_equal(got, want)
    assert got.dlq and len(samples(got)) >= 32


def test_one_worker_or_one_partition_runs_here() -> None:
    recs, cfg = jittered(4)
    assert_equal(process_batch_parallel(recs, cfg, workers=1), process_batch(recs, cfg))
    single = [r._replace(partition=0) for r in recs if r.partition == 0]
    assert_equal(process_batch_parallel(single, cfg, workers=4), process_batch(single, cfg))
    with pytest.raises(ValueError, match="workers"):
        process_batch_parallel(recs, cfg, workers=0)


def _leftovers() -> set[str]:
    folders = {Path("/dev/shm"), Path(os.environ.get("TMPDIR", "/tmp"))}
    return {str(p) for f in folders if f.is_dir() for p in f.glob("rollstream-batch-*.pickle")}


def in_child_only(effect: Any) -> Any:
    """A group route that does ``effect()`` when called in a forked worker."""
    parent = os.getpid()

    def route(group_id: str) -> int:
        if os.getpid() != parent:
            effect()
        return EVENTS_ROUTE(group_id)

    return route


def test_a_failing_worker_raises_its_error_and_leaves_no_file() -> None:
    recs, cfg = jittered(5)
    before = _leftovers()
    bad = BatchConfig(builder=cfg.builder, groups=cfg.groups, route=in_child_only(lambda: 1 / 0))
    with pytest.raises(BatchWorkerError, match="ZeroDivisionError"):
        process_batch_parallel(recs, bad, workers=2)
    assert _leftovers() <= before


def test_a_failure_here_stops_the_workers_at_once() -> None:
    """This process's own share fails while the workers still run: they are killed, not
    waited for."""
    recs, cfg = jittered(9)
    parent = os.getpid()

    def route(group_id: str) -> int:
        if os.getpid() == parent:
            raise RuntimeError("this process's share failed")
        time.sleep(2)  # the workers would take ~30 s
        return EVENTS_ROUTE(group_id)

    slow = BatchConfig(builder=cfg.builder, groups=cfg.groups, route=route)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="share failed"):
        process_batch_parallel(recs, slow, workers=3)
    assert time.monotonic() - started < 5


def test_a_dead_worker_is_an_error_with_its_exit_code() -> None:
    recs, cfg = jittered(6)
    before = _leftovers()
    dead = BatchConfig(
        builder=cfg.builder, groups=cfg.groups, route=in_child_only(lambda: os._exit(7))
    )
    with pytest.raises(BatchWorkerError, match="exit code 7"):
        process_batch_parallel(recs, dead, workers=2)
    assert _leftovers() <= before


def test_a_folder_that_cannot_take_the_result_falls_back_to_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a container's small /dev/shm: the worker writes its result to the temp folder."""
    folders = [str(tmp_path / "not-there"), str(tmp_path)]
    monkeypatch.setattr(batch_parallel, "_folders", lambda: folders)
    recs, cfg = jittered(7)
    assert_equal(process_batch_parallel(recs, cfg, workers=2), process_batch(recs, cfg))
    assert not list(tmp_path.iterdir())  # read, then removed


def test_what_this_process_had_not_written_yet_is_written_once(tmp_path: Path) -> None:
    """Buffered output of the caller is not written again by the workers when they exit
    (multiprocessing flushes it before each fork)."""
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        from test_streams_batch_parallel import jittered
        from rollstream.streams.batch_parallel import process_batch_parallel
        recs, cfg = jittered(8)
        print("before the workers", end="")  # stdout is a pipe: buffered
        process_batch_parallel(recs, cfg, workers=3)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent)],
        capture_output=True,
        timeout=120,
        check=True,
        cwd=tmp_path,
    )
    assert out.stdout.decode() == "before the workers"


def test_split_evenly_balances_and_leaves_nothing_out() -> None:
    weights = {0: 50, 1: 10, 2: 30, 3: 30, 4: 5}
    shares = split_evenly(weights, 2)
    assert sorted(k for s in shares for k in s) == sorted(weights)
    loads = sorted(sum(weights[k] for k in s) for s in shares)
    assert loads == [60, 65]
    assert split_evenly({0: 1}, 3) == [{0}]
    assert split_evenly({}, 2) == []
