"""The stream processor (one faust worker, ``rollstream process``) on the real broker.

Workload: agent rollouts of ``--turns`` LlmCalls (an append-only conversation: each call adds a
``--delta``-token prompt delta and a ``--completion``-token completion), then a Reward and
RolloutFinished; groups of ``--group`` rollouts (RolloutStarted.group_size), path-mode samples.
Events are encoded with the schemas' Codec and produced with confluent-kafka (idempotent,
acks=all), key rollout_id.

Phases, in one worker:
1. start-up: spawn -> first sample of a warm-up group on the samples topic (the worker's
   start-up, not the producer's);
2. latency: a steady ``--rate`` LlmCall/s for ``--seconds``, the rollouts of a group
   interleaved; per group, from the produce time of its last RolloutFinished (the event that
   closes it) to the arrival of its first sample on the samples topic (a polling consumer in
   this process), p50 / p99 / max; split at that sample's CreateTime into ``worker_ms_*`` (to
   the worker's send call) and ``delivery_ms_*`` (from there to the consumer); ``--trace``
   writes each group's times;
3. throughput: a backlog of ``--backlog`` rollouts produced as fast as possible; events/s and
   tokens/s (prompt delta + completion tokens carried by the events) from the first produce to
   the last sample, and per CPU-second of the worker process (the machine is shared).

    .venv/bin/python bench/bench_processor.py [--quick] [--bootstrap HOST:PORT]
        [--worker-env ROLLSTREAM_PROC_...=VALUE ...] [--trace FILE]

Starts its own KafkaBroker unless --bootstrap. Progress on stderr; the last stdout line is one
JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Consumer, Producer

from rollstream.adapters.topics import ensure_topics
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port, resolve_classpath
from rollstream.schemas import (
    Codec,
    CommonSettings,
    Event,
    LlmCall,
    Reward,
    RolloutFinished,
    RolloutStarted,
)

codec = Codec()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Workload:
    """Encoded events of groups of rollouts, interleaved within a group."""

    def __init__(self, turns: int, delta: int, completion: int, group: int, seed: int = 0):
        self.turns, self.delta, self.completion, self.group = turns, delta, completion, group
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(0, 150_000, 1 << 20, dtype=np.uint32)
        self.logprobs = np.full(completion, -0.7, np.float32)
        self.rng = rng

    @property
    def events_per_rollout(self) -> int:
        return self.turns + 3

    @property
    def tokens_per_rollout(self) -> int:
        return self.turns * (self.delta + self.completion)

    def group_events(self, tag: str, ts: int) -> list[Event]:
        """One group; the rollouts' events interleaved (turn by turn)."""
        rollouts = []
        for r in range(self.group):
            rid = f"{tag}-r{r}"
            bodies: list[Any] = [RolloutStarted(task_id=tag, group_id=tag, group_size=self.group)]
            parent, prefix = None, 0
            off = int(self.rng.integers(0, len(self.tokens) - 2 * self.tokens_per_rollout))
            for turn in range(self.turns):
                delta = self.tokens[off : off + self.delta]
                completion = self.tokens[off + self.delta : off + self.delta + self.completion]
                off += self.delta + self.completion
                call = f"{rid}-c{turn}"
                bodies.append(LlmCall(call, parent, prefix, delta, completion, self.logprobs))
                parent, prefix = call, prefix + self.delta + self.completion
            bodies += [Reward(float(self.rng.random())), RolloutFinished()]
            rollouts.append([Event(f"{rid}-{i}", rid, i, ts, b) for i, b in enumerate(bodies)])
        return [r[i] for i in range(self.events_per_rollout) for r in rollouts]


class SampleReader:
    """Arrival time of the first sample of each group (a background consumer).

    ``poll`` returns as soon as a record is there (``consume(n, timeout)`` waits for n records
    or the whole timeout, which added 0-50 ms to every arrival); the group comes from the
    record key (samples are keyed by group_id), so nothing is decoded on the measuring thread.
    ``created`` keeps the first sample's CreateTime (the worker's send call, ms) to split the
    latency into the worker's part and the delivery to this consumer."""

    def __init__(self, settings: CommonSettings) -> None:
        self.first: dict[str, float] = {}
        self.created: dict[str, float] = {}  # group -> first sample's CreateTime (wall s)
        self.first_wall: dict[str, float] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._consumer = Consumer(
            {
                **settings.kafka_config(),
                "group.id": f"bench-{uuid.uuid4().hex}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 10,
                "session.timeout.ms": 6000,
            }
        )
        self._consumer.subscribe([settings.topics().samples])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poll = self._consumer.poll
        while not self._stop.is_set():
            msg = poll(0.05)
            if msg is None or msg.error():
                continue
            now, wall = time.monotonic(), time.time()
            group = (msg.key() or b"").decode()
            if group not in self.first:
                self.first[group] = now
                self.first_wall[group] = wall
                self.created[group] = msg.timestamp()[1] / 1000
            self.samples += 1

    def wait(self, groups: list[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(g in self.first for g in groups):
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args: argparse.Namespace, bootstrap: str, tmp: Path) -> dict[str, Any]:
    settings = CommonSettings(kafka_bootstrap=bootstrap, namespace=f"bp{uuid.uuid4().hex[:8]}")
    ensure_topics(settings)
    topic = settings.topics().events
    producer = Producer(
        {
            **settings.kafka_config(),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 2,
            "message.max.bytes": 16_000_000,
        }
    )
    work = Workload(args.turns, args.delta, args.completion, args.group)
    reader = SampleReader(settings)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")},
        "ROLLSTREAM_KAFKA_BOOTSTRAP": bootstrap,
        "ROLLSTREAM_NAMESPACE": settings.namespace,
        "ROLLSTREAM_HOME": str(tmp / "home"),
        "ROLLSTREAM_PROC_LOG_LEVEL": "warning",
        "ROLLSTREAM_PROC_STATS_INTERVAL_S": "0",
        **dict(kv.split("=", 1) for kv in args.worker_env),
    }
    log_file = open(tmp / "worker.log", "wb")  # noqa: SIM115 - the worker's, closed below
    t_spawn = time.monotonic()
    worker = subprocess.Popen(
        [sys.executable, "-m", "rollstream.infra.cli", "process"],
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out: dict[str, Any] = {}
    try:
        # 1. start-up: a warm-up group, produced at once
        for e in work.group_events("warmup", time.time_ns() // 1000):
            producer.produce(topic, key=e.rollout_id.encode(), value=codec.encode(e))
        producer.flush(30)
        if not reader.wait(["warmup"], 120):
            raise RuntimeError(
                f"no output; worker log:\n{(tmp / 'worker.log').read_text()[-3000:]}"
            )
        out["startup_first_output_s"] = round(reader.first["warmup"] - t_spawn, 2)
        log(f"first sample {out['startup_first_output_s']}s after the worker was spawned")

        # 2. steady rate: LlmCall events paced at args.rate/s (others ride along)
        groups = max(1, int(args.rate * args.seconds / (args.turns * args.group)))
        plan = [work.group_events(f"lat{g}", 0) for g in range(groups)]
        per_call = 1.0 / args.rate
        finish_at: dict[str, float] = {}
        finish_wall: dict[str, float] = {}
        left: dict[str, int] = {f"lat{g}": args.group for g in range(groups)}
        cpu0, t0 = cpu_seconds(worker.pid), time.monotonic()
        due = t0
        # two groups in flight at a time, so groups overlap like a real rollout service
        stream = [
            e for a, b in zip(plan[0::2], [*plan[1::2], []], strict=False) for e in _mix(a, b)
        ]
        for e in stream:
            if isinstance(e.body, LlmCall):
                due += per_call
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
            e.ts = time.time_ns() // 1000
            value = codec.encode(e)
            if isinstance(e.body, RolloutFinished):
                gid = e.rollout_id.rsplit("-r", 1)[0]
                left[gid] -= 1
                if left[gid] == 0:  # the event that closes the group: its produce time
                    finish_at[gid] = time.monotonic()
                    finish_wall[gid] = time.time()
            producer.produce(topic, key=e.rollout_id.encode(), value=value)
            producer.poll(0)
        producer.flush(30)
        sent_s = time.monotonic() - t0
        ok = reader.wait(list(finish_at), 60)
        arrived = [g for g in finish_at if g in reader.first]
        latencies = sorted((reader.first[g] - finish_at[g]) * 1000 for g in arrived)
        # the split, on the wall clock (one machine): to the worker's send of the first sample
        # (its CreateTime, ms), and from there to this consumer
        worker_ms = [(reader.created[g] - finish_wall[g]) * 1000 for g in arrived]
        delivery_ms = [(reader.first_wall[g] - reader.created[g]) * 1000 for g in arrived]
        if args.trace:
            with open(args.trace, "w") as f:
                for g in arrived:
                    row = {
                        "group": g,
                        "finish": finish_wall[g],
                        "created": reader.created[g],
                        "arrived": reader.first_wall[g],
                    }
                    f.write(json.dumps(row) + "\n")
        out.update(
            latency_groups=len(latencies),
            latency_missing=len(finish_at) - len(latencies),
            llm_calls_per_s_offered=round(groups * args.group * args.turns / sent_s, 1),
            latency_ms_p50=round(float(np.percentile(latencies, 50)), 1),
            latency_ms_p99=round(float(np.percentile(latencies, 99)), 1),
            latency_ms_max=round(latencies[-1], 1),
            worker_ms_p50=round(float(np.percentile(worker_ms, 50)), 1),
            worker_ms_p99=round(float(np.percentile(worker_ms, 99)), 1),
            delivery_ms_p50=round(float(np.percentile(delivery_ms, 50)), 1),
            delivery_ms_p99=round(float(np.percentile(delivery_ms, 99)), 1),
            steady_worker_cpu_frac=round((cpu_seconds(worker.pid) - cpu0) / sent_s, 3),
        )
        log(f"steady: {out}")
        if not ok:
            log("some groups had no samples after 60 s")

        # 3. throughput: a backlog produced as fast as possible
        n_groups = max(1, args.backlog // args.group)
        batch = [work.group_events(f"tp{g}", time.time_ns() // 1000) for g in range(n_groups)]
        encoded = [(e.rollout_id.encode(), codec.encode(e)) for g in batch for e in g]
        cpu0, t0 = cpu_seconds(worker.pid), time.monotonic()
        for key, value in encoded:
            producer.produce(topic, key=key, value=value)
            producer.poll(0)
        producer.flush(60)
        produced_s = time.monotonic() - t0
        done = reader.wait([f"tp{g}" for g in range(n_groups)], 300)
        elapsed = max(reader.first.get(f"tp{g}", t0) for g in range(n_groups)) - t0
        cpu = cpu_seconds(worker.pid) - cpu0
        events = len(encoded)
        tokens = n_groups * args.group * work.tokens_per_rollout
        out.update(
            backlog_events=events,
            backlog_complete=done,
            backlog_produce_s=round(produced_s, 2),
            events_per_s=round(events / elapsed),
            tokens_per_s=round(tokens / elapsed),
            worker_cpu_s=round(cpu, 2),
            events_per_cpu_s=round(events / cpu),
            tokens_per_cpu_s=round(tokens / cpu),
        )
        log(f"throughput: {events} events in {elapsed:.2f}s ({out['events_per_s']} ev/s)")
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
        log_file.close()
        reader.close()
    return out


def _mix(a: list[Event], b: list[Event]) -> list[Event]:
    """Two groups' events, alternating (so two groups are open at once)."""
    out: list[Event] = []
    for i in range(max(len(a), len(b))):
        out += [x[i] for x in (a, b) if i < len(x)]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--bootstrap", default=None)
    p.add_argument("--rate", type=float, default=500.0, help="LlmCall events per second")
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--backlog", type=int, default=None, help="rollouts in the throughput phase")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--delta", type=int, default=200)
    p.add_argument("--completion", type=int, default=100)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--trace", default=None, help="write per-group times (JSON lines) here")
    p.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for the worker, e.g. ROLLSTREAM_PROC_PRODUCER_LINGER_MS=10 (repeatable)",
    )
    args = p.parse_args()
    args.seconds = args.seconds or (5.0 if args.quick else 30.0)
    args.backlog = args.backlog or (200 if args.quick else 2000)
    with tempfile.TemporaryDirectory(prefix="bench-processor-") as tmp_name:
        tmp = Path(tmp_name)
        broker = None
        bootstrap = args.bootstrap
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
            figures = run(args, bootstrap, tmp)
        finally:
            if broker is not None:
                broker.kill()
    summary = {
        "bench": "processor",
        "quick": args.quick,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "rate_llm_calls_per_s": args.rate,
        "seconds": args.seconds,
        "turns": args.turns,
        "delta_tokens": args.delta,
        "completion_tokens": args.completion,
        "group_size": args.group,
        "worker_env": args.worker_env,
        **figures,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
