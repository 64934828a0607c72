"""SDK throughput against a bare confluent-kafka producer, same broker, same run.

Each rollout makes ``--calls`` LlmCall events with a ``--delta``-token prompt delta (the full
prompt grows by delta + completion each turn, so the SDK's context trie does real work) plus
RolloutStarted/RolloutFinished. The SDK run times ``recorder.rollout(...)`` + ``r.llm_call(...)``
(trie, envelope, Avro encode, queue, background delivery) up to ``flush()``. The bare run sends
the same bytes (the SDK's own encoded events, captured beforehand) with a plain Producer of the
same settings (idempotent, acks=all, linger, batch size, compression), counting delivery reports.
Runs alternate SDK / bare; medians and the ratio are reported. Token ids follow a Zipf law
(like text), so compression sees realistic redundancy.

    .venv/bin/python bench/bench_sdk.py [--quick] [--bootstrap HOST:PORT] [--compression none,lz4]
"""

from __future__ import annotations

import argparse
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

from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port, resolve_classpath
from rollstream.infra.topics import ensure_topics
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


def run_sdk(work: Workload, settings: RecorderSettings) -> float:
    recorder = Recorder(settings)
    t0 = time.perf_counter()
    work.record(recorder)
    ok = recorder.flush(300)
    elapsed = time.perf_counter() - t0
    stats = recorder.close()
    if not ok or stats.sent != work.events or stats.spooled:
        raise RuntimeError(f"SDK run incomplete: {stats}")
    return elapsed


def run_bare(records: list[tuple[bytes, bytes]], settings: RecorderSettings) -> float:
    conf = {**settings.kafka_config(), **kafka_producer_options(settings)}
    producer = Producer(conf)
    topic = settings.topics().events
    acked = [0]

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is None:
            acked[0] += 1

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
    if acked[0] != len(records):
        raise RuntimeError(f"bare run: {acked[0]} of {len(records)} acked")
    return elapsed


def compare(
    work: Workload, common: CommonSettings, compression: str, rounds: int, tmp: Path
) -> dict[str, Any]:
    settings = sdk_settings(common, compression, tmp / f"spool-{compression}")
    records = capture(work, settings)
    n_bytes = sum(len(k) + len(v) for k, v in records)
    run_sdk(work, settings)  # warm-up: broker, page cache, JIT of the JVM
    sdk, bare = [], []
    for _ in range(rounds):
        sdk.append(run_sdk(work, settings))
        bare.append(run_bare(records, settings))
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
    ap.add_argument("--compression", default="none", help="comma list: none,lz4,zstd")
    args = ap.parse_args(argv)
    if args.quick:
        args.rollouts, args.rounds = 50, 3
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
                res = compare(work, common, compression, args.rounds, tmp)
                print(
                    f"{compression:>5}: SDK {res['sdk_events_per_s']} ev/s "
                    f"{res['sdk_mb_per_s']} MB/s | bare {res['bare_events_per_s']} ev/s "
                    f"{res['bare_mb_per_s']} MB/s | ratio {res['ratio']}",
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
        "load_avg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        **{k: v for k, v in results[0].items()},
    }
    if len(results) > 1:
        summary["by_compression"] = results
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
