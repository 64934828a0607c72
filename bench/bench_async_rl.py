"""Async vs sync RL on the demo workload: wall time for N policy versions with rollouts
overlapping training (bounded staleness) against strictly alternating (each round of rollouts
waits for the policy trained on the previous one), and the staleness distribution of what was
trained (trainer version - 1 - the sample's policy version, from the checkpoint manifests).

Both runs use the same broker, model and settings in one session, one after the other
(``--order`` picks which goes first). The loop time excludes service start-up.
``--quick`` runs 3 steps each; it cannot finish in 30 s: each run starts five services.

    python bench/bench_async_rl.py [--quick] [--steps N] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from rollstream.consumers.training.checkpoint import CheckpointStore
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port
from rollstream.schemas import Codec, CommonSettings, Sample


def sample_versions(bootstrap: str, topic: str) -> dict[tuple[int, int], int]:
    codec = Codec()
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex, "enable.auto.commit": False}
    )
    out: dict[tuple[int, int], int] = {}
    md = consumer.list_topics(topic, timeout=10)
    for p in md.topics[topic].partitions:
        lo, hi = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
        if hi <= lo:
            continue
        consumer.assign([TopicPartition(topic, p, lo)])
        while True:
            msg = consumer.poll(5)
            if msg is None:
                break
            if not msg.error():
                out[(p, msg.offset())] = codec.decode(msg.value(), expect=Sample).policy_version
                if msg.offset() >= hi - 1:
                    break
    consumer.close()
    return out


def run_mode(mode: str, bootstrap: str, home: Path, steps: int) -> dict[str, Any]:
    namespace = f"bench{mode}{uuid.uuid4().hex[:4]}"
    env = {
        **os.environ,
        "ROLLSTREAM_HOME": str(home),
        "ROLLSTREAM_KAFKA_BOOTSTRAP": bootstrap,
        "ROLLSTREAM_NAMESPACE": namespace,
        "ROLLSTREAM_DEMO_STEPS": str(steps),
        "ROLLSTREAM_DEMO_SYNC": "true" if mode == "sync" else "false",
        "ROLLSTREAM_DEMO_SINK": "false",
        "ROLLSTREAM_DEMO_MAX_MINUTES": "20",
    }
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rollstream.infra.cli", "demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{mode} demo failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((home / namespace / "demo-summary.json").read_text())
    versions = sample_versions(bootstrap, CommonSettings(namespace=namespace).topics().samples)
    staleness: collections.Counter[int] = collections.Counter()
    for step, manifest in CheckpointStore(home / namespace / "checkpoints").manifests():
        for po in manifest.trained:
            if po in versions:
                staleness[step - 1 - versions[po]] += 1
    summary["wall_s"] = round(time.monotonic() - t, 1)
    summary["s_per_step"] = round(summary["loop_s"] / max(summary["steps"], 1), 2)
    summary["staleness"] = {str(k): v for k, v in sorted(staleness.items())}
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--bootstrap")
    ap.add_argument("--order", default="sync,async")
    args = ap.parse_args()
    steps = args.steps or (3 if args.quick else 12)
    tmp = Path(tempfile.mkdtemp(prefix="bench-async-"))
    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        broker = KafkaBroker(
            BrokerConfig(data_dir=tmp / "kafka", port=free_port(), controller_port=free_port())
        ).start()
        bootstrap = broker.bootstrap
    try:
        runs = {
            mode: run_mode(mode, bootstrap, tmp / "home", steps) for mode in args.order.split(",")
        }
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    sync, async_ = runs["sync"], runs["async"]
    result = {
        "bench": "async_rl",
        "steps": steps,
        "sync_s_per_step": sync["s_per_step"],
        "async_s_per_step": async_["s_per_step"],
        "speedup_async_vs_sync": round(sync["s_per_step"] / async_["s_per_step"], 2),
        "sync_staleness": sync["staleness"],
        "async_staleness": async_["staleness"],
        "sync_rollouts": sync["rollouts"],
        "async_rollouts": async_["rollouts"],
        "sync_reward_by_version": sync["mean_reward_by_version"],
        "async_reward_by_version": async_["mean_reward_by_version"],
    }
    print(
        f"sync {sync['s_per_step']} s/step, async {async_['s_per_step']} s/step: "
        f"{result['speedup_async_vs_sync']}x"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
