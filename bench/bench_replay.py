"""Replay throughput: events read and re-published into another namespace (target >= 100k/s).

1. From Kafka, everything (values copied, nothing decoded).
2. From Kafka with a task filter (the first message of each rollout decoded; ~half selected).
3. From ClickHouse (chDB in this process, the events inserted through rows/chstore first):
   pages of whole rollouts, rebuilt (event_from_row) and re-encoded.
4. Unless --quick (or with --samples): the first --processor-events events (whole rollouts)
   replayed into a namespace, and the stream processor (``rollstream process``) over
   it: samples/s rebuilt, from its first sample to its last.

Events: bench_chstore's report dataset (rollouts of 2-6 turns of LlmCall + ToolCall with
64 + 32 tokens per call, a reward, a finish; groups of 8). Starts its own Kafka broker unless
--bootstrap. Prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Consumer, Producer, TopicPartition

sys.path.insert(0, str(Path(__file__).parent))
from bench_chstore import report_dataset

from rollstream.adapters.topics import ensure_topics
from rollstream.consumers.analytics.replay import ReplaySettings, run
from rollstream.consumers.store import chstore
from rollstream.consumers.store.migrations import apply_migrations
from rollstream.consumers.store.rows import RowBatch
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port, resolve_classpath
from rollstream.schemas import Codec, CommonSettings, Event, RolloutFinished, RolloutStarted


def make_events(n: int) -> list[Event]:
    rng = np.random.default_rng(0)
    return [r for topic, r, _ in report_dataset(n, rng) if topic == "rollout.events"][:n]


def produce(settings: CommonSettings, events: list[Event]) -> None:
    codec = Codec()
    producer = Producer(
        {
            **settings.kafka_config(), "linger.ms": 20, "batch.size": 4_000_000,
            "queue.buffering.max.messages": 1_000_000, "queue.buffering.max.kbytes": 2_097_151,
        }
    )  # fmt: skip
    topic = settings.topics().events
    for event in events:
        value = codec.encode(event)
        while True:
            try:
                producer.produce(topic, key=event.rollout_id.encode(), value=value)
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(120) == 0


def count(settings: CommonSettings, topic: str) -> int:
    consumer = Consumer({**settings.kafka_config(), "group.id": "bench-count"})
    try:
        md = consumer.list_topics(topic, timeout=10)
        return sum(
            hi - lo
            for p in md.topics[topic].partitions
            for lo, hi in [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)]
        )
    finally:
        consumer.close()


def replay(source: CommonSettings, target: str, **kw: Any) -> dict[str, Any]:
    settings = ReplaySettings(
        kafka_bootstrap=source.kafka_bootstrap, namespace=source.namespace, replay_to=target,
        replay_progress=False, **kw,
    )  # fmt: skip
    result = run(settings)
    return {
        "read": result.read, "published": result.published, "seconds": round(result.elapsed_s, 3),
        "events_per_s": round(result.read / result.elapsed_s),
    }  # fmt: skip


def processor_samples(settings: CommonSettings, work: Path, timeout: float) -> dict[str, Any]:
    """Run the processor over ``settings.namespace`` until its samples stop coming."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")},
        "ROLLSTREAM_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "ROLLSTREAM_NAMESPACE": settings.namespace,
        "ROLLSTREAM_HOME": str(work / "proc-home"),
        "ROLLSTREAM_PROC_GROUP_SIZE": "8",
    }
    log = open(work / "processor.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollstream.infra.cli", "process"], env=env, stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    topic = settings.topics().samples
    first = last = None
    seen = 0
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            n = count(settings, topic)
            now = time.monotonic()
            if n and first is None:
                first = now
            if n > seen:
                seen, last = n, now
            elif first is not None and now - (last or now) > 10:
                break
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    if first is None or last is None or last <= first:
        return {"samples": seen, "samples_per_s": None}
    return {"samples": seen, "samples_per_s": round(seen / (last - first))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bootstrap", help="use this Kafka instead of starting one")
    ap.add_argument("--events", type=int)
    ap.add_argument("--samples", action="store_true", help="also run the processor (--quick)")
    ap.add_argument("--processor-events", type=int, default=30_000)
    args = ap.parse_args()
    n = args.events or (60_000 if args.quick else 500_000)

    work = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    broker = None
    if args.bootstrap:
        bootstrap = args.bootstrap
    else:
        broker = KafkaBroker(
            BrokerConfig(data_dir=work / "kafka", port=free_port(), controller_port=free_port()),
            classpath=resolve_classpath(),
        )
        broker.start(timeout=120)
        bootstrap = broker.bootstrap
    out: dict[str, Any] = {
        "bench": "replay", "quick": args.quick, "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }  # fmt: skip
    try:
        events = make_events(n)
        out["events"] = len(events)
        ns = f"rp{uuid.uuid4().hex[:6]}"
        source = CommonSettings(kafka_bootstrap=bootstrap, namespace=ns)
        ensure_topics(source)
        t = time.perf_counter()
        produce(source, events)
        print(f"produced {len(events)} events in {time.perf_counter() - t:.1f}s", flush=True)

        out["kafka_all"] = replay(source, f"{ns}a")
        print(f"kafka, all: {out['kafka_all']}", flush=True)
        tasks = sorted({e.body.task_id for e in events if isinstance(e.body, RolloutStarted)})
        half = tasks[: len(tasks) // 2]
        out["kafka_task_filter"] = replay(source, f"{ns}f", replay_task_ids=half)
        print(f"kafka, half the tasks: {out['kafka_task_filter']}", flush=True)

        url = f"chdb://{work / 'chdb'}"
        client = chstore.connect(url)
        try:
            db = chstore.database_for(ns)
            apply_migrations(client, db)
            for start in range(0, len(events), 20_000):
                batch = RowBatch("rollout.events", 0)
                for i, event in enumerate(events[start : start + 20_000], start):
                    batch.add(event, i)
                chstore.insert_batch(client, batch.tables, batch.token, database=db)
        finally:
            client.close()
        out["clickhouse_all"] = replay(
            source, f"{ns}c", replay_source="clickhouse", clickhouse_url=url
        )
        print(f"clickhouse, all: {out['clickhouse_all']}", flush=True)

        if args.samples or not args.quick:
            # a smaller log of whole rollouts, replayed, then the processor over the replay
            sub = events[: args.processor_events]
            while sub and not isinstance(sub[-1].body, RolloutFinished):
                sub.pop()
            small = CommonSettings(kafka_bootstrap=bootstrap, namespace=f"{ns}s")
            ensure_topics(small)
            produce(small, sub)
            replay(small, f"{ns}sr")
            target = small.model_copy(update={"namespace": f"{ns}sr"})
            out["processor"] = {"events": len(sub), **processor_samples(target, work, 600)}
            print(f"processor over a replay: {out['processor']}", flush=True)
        out["targets_met"] = {
            "kafka_events_per_s_ge_100k": out["kafka_all"]["events_per_s"] >= 100_000
        }
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
