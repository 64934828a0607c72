"""SDK throughput against a bare confluent-kafka producer, same broker, same run.

Each rollout makes ``--calls`` LlmCall events with a ``--delta``-token prompt delta (the full
prompt grows by delta + completion each turn, so the SDK's context trie does real work) plus
RolloutStarted/RolloutFinished. The SDK run times ``recorder.rollout(...)`` + ``r.llm_call(...)``
(trie, envelope, Avro encode, queue, background delivery) up to ``flush()``. The bare run sends
the same bytes (the SDK's own encoded events, captured beforehand) with a plain Producer of the
same settings (idempotent, acks=all, linger, batch size, compression), counting delivery reports.
Each client sends one untimed warm-up message first: a new idempotent producer waits ~500 ms for
its producer id at random (librdkafka's PID timer when the connection is not up yet), which
used to land in either side's figure.
Runs alternate SDK / bare; medians and the ratio are reported. Token ids follow a Zipf law
(like text), so compression sees realistic redundancy.

    .venv/bin/python bench/bench_sdk.py [--quick] [--bootstrap HOST:PORT] [--compression none,lz4]
        [--rounds 5] [--warmup-s 30]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Producer

from rollstream.adapters.topics import ensure_topics
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port, resolve_classpath
from rollstream.producers import MemoryTransport, Recorder, RecorderSettings, kafka_producer_options
from rollstream.schemas import CommonSettings


def token_pool(n: int, vocab: int = 150_000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.zipf(1.2, n) % vocab).astype(np.uint32)


class Workload:
    def __init__(self, rollouts: int, calls: int, delta: int, completion: int) -> None:
        self.rollouts, self.calls, self.delta, self.completion = rollouts, calls, delta, completion
        self.span = calls * (delta + completion)
        self.pool = token_pool(self.span + 1_000_000)
        self.logprobs = np.full(completion, -0.7, np.float32)

    @property
    def events(self) -> int:
        return self.rollouts * (self.calls + 2)

    def record(self, recorder: Recorder) -> None:
        step = self.delta + self.completion
        for i in range(self.rollouts):
            off = (i * 7919) % (len(self.pool) - self.span)
            convo = self.pool[off : off + self.span]
            with recorder.rollout(task_id=f"task{i}", group_id=f"g{i // 8}") as r:
                for c in range(self.calls):
                    end = c * step + self.delta
                    r.llm_call(convo[:end], convo[end : end + self.completion], self.logprobs)


def sdk_settings(common: CommonSettings, compression: str, spool: Path) -> RecorderSettings:
    return RecorderSettings(
        **common.model_dump(),
        compression=compression,
        spool_dir=spool,
        producer="bench",
        queue_size=20_000,
    )


def capture(work: Workload, settings: RecorderSettings) -> list[tuple[bytes, bytes]]:
    """The SDK's encoded events (key, value), recorded through the in-memory transport."""
    transport = MemoryTransport(capacity=10**9)
    with Recorder(settings.model_copy(update={"spool_dir": None}), transport=transport) as rec:
        work.record(rec)
        rec.flush(60)
    return [(m.key, m.value) for m in transport.messages(settings.topics().events)]


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_s(stat_path: str) -> float:
    """user + system CPU seconds of a process or thread from /proc (0 where unreadable)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def thread_cpu(delivery_tid: int | None) -> dict[str, float]:
    """CPU seconds of this process's threads: ``main`` (this thread: the harness or the bare
    producer loop), ``delivery`` (the SDK's thread) and each librdkafka thread (``rdk:<tid>``)."""
    out = {"main": time.thread_time(), "delivery": 0.0}
    if delivery_tid is not None:
        out["delivery"] = _cpu_s(f"/proc/self/task/{delivery_tid}/stat")
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith("rdk:"):
            out[f"rdk:{tid}"] = _cpu_s(f"/proc/self/task/{tid}/stat")
    return out


class CpuMeter:
    """CPU per event by thread role (and of the broker, when its pid is known) over one run;
    read before the client is closed (its threads' counters go with them). ``gc_pauses``: wall
    time in the cyclic GC's collections during the run, whichever thread they paused."""

    def __init__(self, broker_pid: int | None) -> None:
        self.broker_pid = broker_pid
        self.totals: dict[str, list[float]] = {}
        self.gc_runs: list[list[int]] = []  # collections of generation 0, 1, 2 per run
        self.gc_ms: list[list[float]] = []  # their pauses (ms) by generation, per run

    def start(self, delivery_tid: int | None = None) -> None:
        self._tid = delivery_tid
        self._gc_ns = 0
        self._gc_runs = [0, 0, 0]
        self._gc_gen_ns = [0, 0, 0]
        gc.callbacks.append(self._on_gc)
        self._t0 = thread_cpu(delivery_tid)
        self._b0 = _cpu_s(f"/proc/{self.broker_pid}/stat") if self.broker_pid else 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # the cyclic GC pauses whichever thread triggers it: wall time, counted by generation
        if phase == "start":
            self._gc_t0 = time.perf_counter_ns()
        else:
            took = time.perf_counter_ns() - self._gc_t0
            self._gc_ns += took
            self._gc_runs[info["generation"]] += 1
            self._gc_gen_ns[info["generation"]] += took

    def stop(self, events: int) -> None:
        gc.callbacks.remove(self._on_gc)
        t1 = thread_cpu(self._tid)
        used = {"main": t1["main"] - self._t0["main"]}
        used["delivery"] = t1["delivery"] - self._t0["delivery"]
        # librdkafka threads started during the run count from zero
        used["librdkafka"] = sum(
            v - self._t0.get(k, 0.0) for k, v in t1.items() if k.startswith("rdk:")
        )
        if self.broker_pid:
            used["broker"] = _cpu_s(f"/proc/{self.broker_pid}/stat") - self._b0
        used["gc_pauses"] = self._gc_ns / 1e9
        for k, v in used.items():
            self.totals.setdefault(k, []).append(1e6 * v / events)
        self.gc_runs.append(self._gc_runs)
        self.gc_ms.append([round(ns / 1e6, 1) for ns in self._gc_gen_ns])

    def medians(self) -> dict[str, float]:
        return {k: round(statistics.median(v), 1) for k, v in self.totals.items() if any(v)}


def run_sdk(work: Workload, settings: RecorderSettings, meter: CpuMeter | None = None) -> float:
    recorder = Recorder(settings)
    # untimed warm-up: a new idempotent librdkafka producer that starts before its broker
    # connection is up waits ~500 ms for its producer id (a fixed timer), at random; one event
    # through each client before the clock starts keeps that out of both sides' figures
    recorder.delivery.submit(recorder.topic, b"warm-up", b"warm-up")
    recorder.flush(60)
    if meter is not None:
        meter.start(recorder.delivery._thread.native_id)
    t0 = time.perf_counter()
    work.record(recorder)
    ok = recorder.flush(300)
    elapsed = time.perf_counter() - t0
    if meter is not None:
        meter.stop(work.events)
    stats = recorder.close()
    if not ok or stats.sent != work.events + 1 or stats.spooled:
        raise RuntimeError(f"SDK run incomplete: {stats}")
    return elapsed


def run_bare(
    records: list[tuple[bytes, bytes]], settings: RecorderSettings, meter: CpuMeter | None = None
) -> float:
    conf = {**settings.kafka_config(), **kafka_producer_options(settings)}
    producer = Producer(conf)
    topic = settings.topics().events
    acked = [0]

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is None:
            acked[0] += 1

    producer.produce(topic, b"warm-up", b"warm-up")  # untimed, as in run_sdk
    producer.flush(60)
    if meter is not None:
        meter.start()
    t0 = time.perf_counter()
    for key, value in records:
        while True:
            try:
                producer.produce(topic, value, key, on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.005)
        producer.poll(0)
    producer.flush(300)
    elapsed = time.perf_counter() - t0
    if meter is not None:
        meter.stop(len(records))
    if acked[0] != len(records):
        raise RuntimeError(f"bare run: {acked[0]} of {len(records)} acked")
    return elapsed


def compare(
    work: Workload,
    common: CommonSettings,
    compression: str,
    rounds: int,
    tmp: Path,
    broker_pid: int | None = None,
    warmup_s: float = 0.0,
) -> dict[str, Any]:
    settings = sdk_settings(common, compression, tmp / f"spool-{compression}")
    records = capture(work, settings)
    n_bytes = sum(len(k) + len(v) for k, v in records)
    # warm-up, untimed: broker, page cache, the JVM's JIT. The broker keeps compiling for
    # minutes after it starts, and the bare side (broker-bound) speeds up with it: both sides
    # run for ``warmup_s`` before the measured rounds, so neither gets a colder broker
    warm_until = time.monotonic() + warmup_s
    run_sdk(work, settings)
    while time.monotonic() < warm_until:
        run_bare(records, settings)
        run_sdk(work, settings)
    sdk, bare = [], []
    sdk_cpu, bare_cpu = CpuMeter(broker_pid), CpuMeter(broker_pid)
    for _ in range(rounds):
        sdk.append(run_sdk(work, settings, sdk_cpu))
        bare.append(run_bare(records, settings, bare_cpu))
    sdk_t, bare_t = statistics.median(sdk), statistics.median(bare)
    return {
        "compression": compression,
        "events": work.events,
        "mb": round(n_bytes / 1e6, 2),
        "bytes_per_event": round(n_bytes / work.events),
        "sdk_events_per_s": round(work.events / sdk_t),
        "sdk_mb_per_s": round(n_bytes / sdk_t / 1e6, 1),
        "bare_events_per_s": round(work.events / bare_t),
        "bare_mb_per_s": round(n_bytes / bare_t / 1e6, 1),
        "ratio": round(bare_t / sdk_t, 3),
        "sdk_runs_s": [round(t, 3) for t in sdk],
        "bare_runs_s": [round(t, 3) for t in bare],
        # CPU us per event by thread role (medians over rounds): where the time goes
        "sdk_cpu_us_per_event": sdk_cpu.medians(),
        "bare_cpu_us_per_event": bare_cpu.medians(),
        "sdk_gc_runs_by_generation": sdk_cpu.gc_runs,
        "sdk_gc_pause_ms_by_generation": sdk_cpu.gc_ms,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, under 30 s")
    ap.add_argument("--bootstrap", help="use this broker instead of starting one")
    ap.add_argument("--rollouts", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--delta", type=int, default=2000)
    ap.add_argument("--completion", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup-s", type=float, default=30.0, help="untimed, both sides, per codec")
    ap.add_argument(
        "--compression",
        default=RecorderSettings.model_fields["compression"].default,
        help="comma list: none,lz4,zstd (default: the SDK's default)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.rollouts, args.rounds, args.warmup_s = 50, 3, min(args.warmup_s, 3.0)
    work = Workload(args.rollouts, args.calls, args.delta, args.completion)
    load_start = os.getloadavg()[0]  # the box is shared: say how busy it was
    broker = None
    with tempfile.TemporaryDirectory(prefix="bench-sdk-") as tmp_name:
        tmp = Path(tmp_name)
        bootstrap = args.bootstrap
        if bootstrap is None:
            broker = KafkaBroker(
                BrokerConfig(data_dir=tmp / "kafka", port=free_port(), controller_port=free_port()),
                classpath=resolve_classpath(),
            )
            t0 = time.perf_counter()
            broker.start(timeout=120)
            bootstrap = broker.bootstrap
            print(f"broker up in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        try:
            results = []
            for compression in args.compression.split(","):
                common = CommonSettings(
                    kafka_bootstrap=bootstrap, namespace=f"bench{uuid.uuid4().hex[:8]}"
                )
                ensure_topics(common)
                pid = broker._proc.pid if broker is not None and broker._proc else None
                res = compare(work, common, compression, args.rounds, tmp, pid, args.warmup_s)
                print(
                    f"{compression:>5}: SDK {res['sdk_events_per_s']} ev/s "
                    f"{res['sdk_mb_per_s']} MB/s | bare {res['bare_events_per_s']} ev/s "
                    f"{res['bare_mb_per_s']} MB/s | ratio {res['ratio']} | CPU us/event "
                    f"SDK {res['sdk_cpu_us_per_event']} bare {res['bare_cpu_us_per_event']}",
                    file=sys.stderr,
                )
                results.append(res)
        finally:
            if broker is not None:
                broker.kill()  # its data dir is deleted with the temp dir: no need to wait
    summary: dict[str, Any] = {
        "bench": "sdk",
        "quick": args.quick,
        "delta_tokens": args.delta,
        "completion_tokens": args.completion,
        "calls_per_rollout": args.calls,
        "rounds": args.rounds,
        "warmup_s": args.warmup_s,
        "load_avg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        **{k: v for k, v in results[0].items()},
    }
    if len(results) > 1:
        summary["by_compression"] = results
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
