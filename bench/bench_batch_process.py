"""The stream processors' batch path (streams/batch.py): events/s in memory and end to end
(Kafka in, Kafka out: streams/batch_job.py), beside the faust worker's figure.

Workloads (the events of two other benchmarks, so the figures line up with theirs):
- ``processor``: bench_processor.py's rollouts (10 LlmCalls of 200 prompt-delta + 100
  completion tokens, a Reward, RolloutFinished; groups of 4 with a group_size), ~1.3 KB a
  LlmCall event: the faust worker's events-per-CPU-second figure is on these;
- ``replay``: bench_replay.py's events (bench_chstore's report dataset: 2-6 turns of LlmCall of
  64 + 32 tokens and a ToolCall, a reward, a finish; groups of 8 without a size, which close on
  the group timeout): replay's 119k events/s figure is on these.

1. In memory, one core: ``process_batch`` over the encoded records (keyed and partitioned as a
   producer writes them, 6 partitions), best of --repeat by CPU time; and the split of that time
   (``us_per_event``, each part timed alone, best of --repeat): decode the events, the
   trajectory builder (``apply``), encode the trajectories, the group aggregator (advantages,
   samples) over the trajectories the builder made (the batch path hands them over; the faust
   path decodes them: ``decode_trajectories_us``, not part of the sum), encode the samples,
   and the rest by difference (the books, the batch path's timers and ordering; on a busy
   machine the parts' noise lands here too). ``core_only_events_per_s``: the same pipeline
   straight on the pure core, without the books (no timers, no bookkeeping).
   ``parallel``: the batch path over --workers processes (streams/batch_parallel.py,
   ``process_batch_parallel``) beside ``process_batch`` in one, side by side in turns, wall
   time (the children's CPU is not this process's): medians and best of --repeat, the ratio
   of the medians, and the same outputs checked (samples and trajectories as multisets).
2. End to end: each workload produced into a namespace, then ``run_batch`` into
   another (idempotent producer, acks=all): events/s over the whole job, wall and CPU; with
   --workers > 1 also ``run_batch(workers=N)`` into a third.
3. Unless --quick (or with --faust): bench_processor.py's run on the same broker (a short
   steady phase, then a backlog of the same rollouts): the faust worker's events/s and events
   per worker CPU-second.

    .venv/bin/python bench/bench_batch_process.py [--quick] [--faust] [--workers N]
        [--bootstrap HOST:PORT]

The target (>= 100k events/s) is met when every workload's ``parallel`` median is.

Starts its own Kafka broker unless --bootstrap. Progress on stderr; the last stdout line is one
JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import bench_processor
import bench_replay
from bench_chstore import report_dataset

from rollstream.adapters.topics import ensure_topics
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port, resolve_classpath
from rollstream.schemas import Codec, CommonSettings, Event, LlmCall, Trajectory
from rollstream.streams.app import group_route
from rollstream.streams.batch import BatchConfig, SourceRecord, process_batch
from rollstream.streams.batch_job import run_batch
from rollstream.streams.batch_parallel import process_batch_parallel
from rollstream.streams.core import GroupClosed, GroupConfig, add_to_group, apply, expire_group
from rollstream.streams.settings import ProcessorSettings

TARGET = 100_000  # events/s
PARTITIONS = 6  # the contract's events and trajectories topics
codec = Codec()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def processor_events(rollouts: int) -> list[Event]:
    work = bench_processor.Workload(10, 200, 100, 4)
    ts = 1_767_225_600_000_000
    return [e for g in range(rollouts // 4) for e in work.group_events(f"g{g}", ts)]


def replay_events(n: int) -> list[Event]:
    data = report_dataset(n, np.random.default_rng(0))
    return [record for topic, record, _ in data if topic == "rollout.events"]


def tokens(events: list[Event]) -> int:
    return sum(
        len(e.body.prompt_delta) + len(e.body.completion_ids)
        for e in events
        if isinstance(e.body, LlmCall)
    )


def as_records(events: list[Event]) -> list[SourceRecord]:
    route, offsets = group_route(PARTITIONS), [0] * PARTITIONS
    out = []
    for e in events:
        p = route(e.rollout_id)
        out.append(SourceRecord(p, offsets[p], e.rollout_id.encode(), codec.encode(e)))
        offsets[p] += 1
    return out


def best_cpu(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        cpu = time.process_time()
        result = fn()
        best = min(best, time.process_time() - cpu)
    return best, result


def in_memory(name: str, events: list[Event], repeats: int, workers: int) -> dict[str, Any]:
    """process_batch's events/s, and where its time goes."""
    recs = as_records(events)
    values = [r.value for r in recs]
    config = BatchConfig(route=group_route(PARTITIONS))
    n = len(recs)
    process_batch(recs[:200], config, codec)  # the codec compiles its readers and writers here
    whole, out = best_cpu(lambda: process_batch(recs, config, codec), repeats)
    decode, decoded = best_cpu(lambda: [codec.decode(v, expect=Event) for v in values], repeats)

    def build() -> list[Trajectory]:
        states: dict[str, Any] = {}
        made: list[Trajectory] = []
        for v in values:
            event = codec.decode(v, expect=Event)
            states[event.rollout_id], outs = apply(states.get(event.rollout_id), event)
            made += [o for o in outs if isinstance(o, Trajectory)]
        return made

    built_s, trajectories = best_cpu(build, repeats)
    encode_t, encoded = best_cpu(lambda: [codec.encode(t) for t in trajectories], repeats)
    decode_t, back = best_cpu(
        lambda: [codec.decode(b, expect=Trajectory) for b in encoded], repeats
    )

    def aggregate() -> list[Any]:
        groups: dict[str, Any] = {}
        samples: list[Any] = []
        grouping = GroupConfig()
        for t in trajectories:
            groups[t.group_id], outs = add_to_group(groups.get(t.group_id), t, grouping)
            samples += [s for o in outs if isinstance(o, GroupClosed) for s in o.samples]
        for state in groups.values():  # the groups without a size: closed on their timeout
            outs = expire_group(state, 1 << 62, grouping)[1]
            samples += [s for o in outs if isinstance(o, GroupClosed) for s in o.samples]
        return samples

    aggregate_s, samples = best_cpu(aggregate, repeats)

    def core_only() -> int:
        """The same pipeline on the pure core without the books (no timers, no tables)."""
        states: dict[str, Any] = {}
        groups: dict[str, Any] = {}
        grouping, n_samples = GroupConfig(), 0
        for v in values:
            event = codec.decode(v, expect=Event)
            states[event.rollout_id], outs = apply(states.get(event.rollout_id), event)
            for t in outs:
                if isinstance(t, Trajectory):
                    codec.encode(t)
                    groups[t.group_id], closed = add_to_group(groups.get(t.group_id), t, grouping)
                    for c in closed:
                        n_samples += len([codec.encode(s) for s in getattr(c, "samples", [])])
        for state in groups.values():  # the groups without a size: closed on their timeout
            for c in expire_group(state, 1 << 62, grouping)[1]:
                n_samples += len([codec.encode(s) for s in getattr(c, "samples", [])])
        return n_samples

    core_s, _ = best_cpu(core_only, repeats)
    parallel = side_by_side(recs, config, workers, repeats)
    encode_s, _ = best_cpu(lambda: [codec.encode(s) for s in samples], repeats)
    us = 1e6 / n
    split = {
        "decode_events": decode * us,
        "trajectory_builder": (built_s - decode) * us,
        "encode_trajectories": encode_t * us,
        "aggregator_and_samples": aggregate_s * us,
        "encode_samples": encode_s * us,
    }
    split["books_and_batch"] = whole * us - sum(split.values())
    figures = {
        "events": n,
        "tokens": tokens(decoded),
        "bytes_per_event": round(sum(map(len, values)) / n),
        "trajectories": len(out.trajectories),
        "samples": len(out.samples),
        "dlq": len(out.dlq),
        "cpu_s": round(whole, 3),
        "events_per_s": round(n / whole),
        "tokens_per_s": round(tokens(decoded) / whole),
        "core_only_events_per_s": round(n / core_s),
        "decode_only_events_per_s": round(n / decode),
        "us_per_event": {k: round(v, 2) for k, v in split.items()},
        "decode_trajectories_us": round(decode_t * us, 2),
        "parallel": parallel,
    }
    assert len(back) == len(trajectories)
    log(f"{name}: {figures['events_per_s']:,} events/s in memory ({figures['us_per_event']})")
    log(f"{name}: {workers} processes {parallel}")
    return figures


def side_by_side(
    recs: list[SourceRecord], config: BatchConfig, workers: int, repeats: int
) -> dict[str, Any]:
    """Wall events/s of process_batch (one process) and process_batch_parallel (``workers``),
    in turns; and whether they gave the same outputs."""
    n, one, many = len(recs), [], []
    same = True
    for _ in range(repeats):
        t0 = time.perf_counter()
        a = process_batch(recs, config, codec)
        t1 = time.perf_counter()
        b = process_batch_parallel(recs, config, codec, workers=workers)
        t2 = time.perf_counter()
        one.append(n / (t1 - t0))
        many.append(n / (t2 - t1))
        same = same and all(
            sorted(o.value or b"" for o in getattr(a, sink))
            == sorted(o.value or b"" for o in getattr(b, sink))
            for sink in ("samples", "trajectories", "dlq")
        )
        same = same and a.counts == b.counts
    med_one, med_many = float(np.median(one)), float(np.median(many))
    return {
        "workers": workers,
        "one_process_events_per_s_median": round(med_one),
        "one_process_events_per_s_best": round(max(one)),
        "events_per_s_median": round(med_many),
        "events_per_s_best": round(max(many)),
        "events_per_s_all": [round(x) for x in many],
        "speedup_of_medians": round(med_many / med_one, 2),
        "same_outputs": same,
    }


def end_to_end(bootstrap: str, events: list[Event], tmp: Path, workers: int) -> dict[str, Any]:
    source = CommonSettings(kafka_bootstrap=bootstrap, namespace=f"bs{uuid.uuid4().hex[:8]}")
    target = ProcessorSettings(
        kafka_bootstrap=bootstrap, namespace=f"bt{uuid.uuid4().hex[:8]}", home=tmp / "home"
    )
    ensure_topics(source)
    bench_replay.produce(source, events)  # a full local queue waits for the broker
    result = run_batch(source, target)
    parallel: dict[str, Any] = {}
    if workers > 1:
        other = target.model_copy(
            update={"namespace": f"bp{uuid.uuid4().hex[:8]}", "home": tmp / "home-parallel"}
        )
        got = run_batch(source, other, workers=workers)
        assert got["counts"] == result["counts"] and got["written"] == result["written"]
        parallel = {
            "workers": workers,
            "events_per_s": got["events_per_s"],
            "read_and_process_s": got["read_and_process_s"],
            "flush_s": got["flush_s"],
            "elapsed_s": got["elapsed_s"],
        }
    figures = {
        "events": result["events"],
        "written": result["written"],
        "elapsed_s": result["elapsed_s"],
        "setup_s": result["setup_s"],
        "read_and_process_s": result["read_and_process_s"],
        "flush_s": result["flush_s"],
        "cpu_s": result["cpu_s"],
        "events_per_s": result["events_per_s"],
        "read_and_process_events_per_s": round(result["events"] / result["read_and_process_s"]),
        "events_per_cpu_s": round(result["events"] / result["cpu_s"]),
        "parallel": parallel,
    }
    log(f"end to end: {figures}")
    return figures


def faust(bootstrap: str, rollouts: int, tmp: Path) -> dict[str, Any]:
    args = argparse.Namespace(
        rate=500.0,
        seconds=3.0,
        backlog=rollouts,
        turns=10,
        delta=200,
        completion=100,
        group=4,
        trace=None,
        worker_env=[],
    )
    figures = bench_processor.run(args, bootstrap, tmp)
    keep = ("backlog_events", "backlog_complete", "events_per_s", "worker_cpu_s")
    out = {k: figures[k] for k in keep}
    out["events_per_cpu_s"] = figures["events_per_cpu_s"]
    log(f"faust worker: {out}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--faust", action="store_true", help="the faust worker's figure (full: on)")
    p.add_argument("--bootstrap", default=None)
    p.add_argument("--rollouts", type=int, default=None, help="processor workload rollouts")
    p.add_argument("--replay-events", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument(
        "--workers", type=int, default=os.cpu_count() or 2, help="processes (default: the CPUs)"
    )
    args = p.parse_args()
    rollouts = args.rollouts or (100 if args.quick else 2000)
    n_replay = args.replay_events or (5_000 if args.quick else 100_000)
    repeats = args.repeat or (1 if args.quick else 5)
    with_faust = args.faust or not args.quick
    workloads = {"processor": processor_events(rollouts), "replay": replay_events(n_replay)}
    summary: dict[str, Any] = {
        "bench": "batch_process",
        "quick": args.quick,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "python": platform.python_version(),
        "target_events_per_s": TARGET,
        "in_memory": {
            name: in_memory(name, ev, repeats, args.workers) for name, ev in workloads.items()
        },
    }
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp_name:
        tmp = Path(tmp_name)
        broker, bootstrap = None, args.bootstrap
        if bootstrap is None:
            t0 = time.monotonic()
            broker = KafkaBroker(
                BrokerConfig(data_dir=tmp / "kafka", port=free_port(), controller_port=free_port()),
                classpath=resolve_classpath(),
            )
            broker.start(timeout=120)
            bootstrap = broker.bootstrap
            log(f"broker up in {time.monotonic() - t0:.1f}s")
        try:
            summary["end_to_end"] = {
                name: end_to_end(bootstrap, events, tmp, args.workers)
                for name, events in workloads.items()
            }
            if with_faust:
                summary["faust"] = faust(bootstrap, rollouts, tmp)
        finally:
            if broker is not None:
                broker.kill()
    if "faust" in summary:
        summary["batch_vs_faust_per_cpu_s"] = round(
            summary["in_memory"]["processor"]["events_per_s"]
            / summary["faust"]["events_per_cpu_s"],
            1,
        )
    summary["meets_target"] = all(
        w["parallel"]["events_per_s_median"] >= TARGET and w["parallel"]["same_outputs"]
        for w in summary["in_memory"].values()
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
