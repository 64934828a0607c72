"""The rollout service's stage workers on an environment-bound workload: RUN scaling, a slow
EVAL, and the service's own overhead per rollout, side by side in one run.

Parts, all real: a Kafka broker (rollstream.infra.kafka, started here unless ``--bootstrap``),
one recording proxy (``rollstream proxy`` with the tiny model's tokenizer and no backend: no
LLM call is made) and ``rollstream workers --stage init|run|eval`` processes. Every
configuration has its own namespace (fresh stage topics and consumer groups, its own worker
home and sandbox root); the proxy's events topic is shared and told apart by job id. Stage
topics get ``--partitions`` partitions (default 24, the contract's: 3 per worker at 8 RUN
workers); the full run adds 8 RUN workers on 6 partitions, ``run8-p6``, to show what too few
partitions cost: a worker without a partition does nothing).

Workload: each rollout's agent is a ``command`` agent, ``python3 -S -c``, doing K=5 tool-like
steps, each a sleep drawn from a lognormal (median 0.2 s, sigma 0.866: p90 0.61 s, p99 1.5 s,
mean 0.29 s; a rollout's agent ~1.46 s on average) seeded by the task id. Tasks are synthetic
and inline, one sample each, with the same ids in every configuration, so every configuration
runs the same draws. Sandboxes are ``local`` (the cheapest kind: a temp dir, no isolation);
sandbox create / destroy cost per kind is bench_sandbox.py's. The evaluator is ``true``.

1. Scaling: 1, 2, 4, 8 RUN worker processes (``--concurrency 1`` each); INIT and EVAL one
   process each at ``--concurrency 8`` (never the limit). Jobs are queued (jobqueue.submit_job)
   once every stage's consumer group is stable with all its members assigned, so group joins
   are not in the figures. Rates come from the log, the RUN-finished StageEvents' timestamps:
   ``busy`` sums each RUN worker's own rate (finishes - 1) / (last - first finish), the rate
   while it has work (a batch ends with workers idle whose partitions ran dry: murmur2 of the
   rollout ids spreads them unevenly); ``batch`` is the whole pool's, trimming the first and last
   W finishes (warm-up, drain). efficiency_8 = rate(8) / (8 * rate(1)).
2. Slow EVAL: 4 RUN workers, EVAL one process at ``--concurrency 2`` running ``sleep 0.15``
   then ``sleep 1.5`` (10x): EVAL falls behind, RUN must not; ratio of RUN busy rates.
3. Overhead: rollouts queued one by one every 0.25 s (no queueing), agent and evaluator
   ``true``; queue -> RUN started (the INIT message's enqueued_at to the run StageEvent started:
   INIT, sandbox create, two hand-offs) and agent exit -> RolloutFinished (RUN finished to
   RolloutFinished: hand-off to EVAL, the evaluator, rewards, destroy, finish), p50 / p99.

    .venv/bin/python bench/bench_rollout_service.py [--quick] [--rollouts 64]
        [--partitions 24] [--bootstrap HOST:PORT]

``--quick`` (``make bench``) is a smoke run: 12 rollouts, 1 and 8 RUN workers, no run8-p6;
its rates are too few to read. A readable table on stderr; one JSON object on the last line of
stdout. ``busy_cpu`` is the box's CPU use (all cores, anyone's) while rollouts ran;
``run_between_ms`` a RUN worker's time from one agent's end to the next one's start;
``agent_mean_s`` - ``sleep_mean_s`` what a command agent costs beyond its sleeps (process start,
workdir copies).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, ConsumerGroupState, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from rollstream.adapters.topics import ensure_topics
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port
from rollstream.producers.rollouts.jobqueue import submit_job
from rollstream.producers.rollouts.jobs import JobSpec, parse_job
from rollstream.producers.rollouts.stages import first_messages
from rollstream.producers.rollouts.tasks import Task
from rollstream.schemas import (
    Codec,
    CommonSettings,
    Event,
    RolloutFinished,
    RolloutStarted,
    StageEvent,
    Topics,
)

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "integration"), str(REPO / "tests")]
from _logged_process import LoggedProcess  # noqa: E402
from _rollout_stack import tokenizer_proxy  # noqa: E402

ADMIN = "admin-key-for-bench-rollout-service"
STEPS, MEDIAN_S, SIGMA = 5, 0.2, 0.866  # lognormal per step: p99 = 0.2 * e^(2.326 * 0.866) = 1.5
AGENT = (  # argv[1]: steps, [2]: median, [3]: sigma; seeded by the task id (one sample a task)
    "import math, os, random, sys, time\n"
    "r = random.Random(os.environ['ROLLSTREAM_TASK_ID'])\n"
    "for _ in range(int(sys.argv[1])):\n"
    "    time.sleep(r.lognormvariate(math.log(float(sys.argv[2])), float(sys.argv[3])))\n"
)
AGENT_ARGV = ("python3", "-S", "-c", AGENT, str(STEPS), str(MEDIAN_S), str(SIGMA))
EVAL_S = 0.15  # the slow-EVAL comparison's normal evaluator; the slow one sleeps 10x


@dataclass
class Config:
    name: str
    run: int  # RUN worker processes
    n: int  # rollouts
    run_conc: int = 1
    init: tuple[int, int] = (1, 8)  # processes, concurrency
    eval: tuple[int, int] = (1, 8)
    eval_argv: list[str] = field(default_factory=lambda: ["true"])
    agent_argv: list[str] = field(default_factory=lambda: list(AGENT_ARGV))
    partitions: int = 24
    paced_s: float = 0.0  # > 0: queue rollouts one by one this far apart (overhead)
    wait_eval: bool = True  # wait for every RolloutFinished (not with a slow EVAL)


def _task(i: int) -> Task:
    return Task(
        task_id=f"bench-{i:03d}",
        title="bench task",
        difficulty="easy",
        prompt="Nothing to do: a synthetic task for the rollout service's bench.",
        files={"main.py": "x = 1\n"},
        hidden_tests={"test_main.py": "def test_x():\n    assert True\n"},
    )


def _job(cfg: Config, job_id: str) -> JobSpec:
    return parse_job(
        {
            "job_id": job_id,
            "tasks": {"inline": [_task(i).model_dump() for i in range(cfg.n)]},
            "agent": {"kind": "command", "argv": cfg.agent_argv},
            "evaluator": {"kind": "command", "argv": cfg.eval_argv},
            "sandbox": {"kind": "local", "limits": {"timeout": 120}},
            "timeouts": {"init": 120, "run": 120, "eval": 120},
            "run_id": "bench-rollout-service",
        }
    )


# --------------------------------------------------------------------------- measures


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def busy_rate(finishes: dict[str, list[float]], concurrency: int) -> float | None:
    """The RUN pool's rate while its workers have work: the workers that ran rollouts (times
    ``concurrency``) over the time one takes per rollout, pooled (the sum of their first-to-last
    finish spans over the sum of their finishes - 1). A worker whose partitions ran dry early
    costs nothing; a worker that got no partition (more workers than partitions) adds nothing."""
    spans, count, active = 0.0, 0, 0
    for ts in finishes.values():
        if len(ts) >= 2:
            spans += max(ts) - min(ts)
            count += len(ts) - 1
            active += 1
    return active * concurrency * count / spans if spans > 0 else None


def sleeps(task_id: str) -> float:
    """The agent's total sleep for a task (the workload; AGENT's draws)."""
    r = random.Random(task_id)
    return sum(r.lognormvariate(math.log(MEDIAN_S), SIGMA) for _ in range(STEPS))


def batch_rate(ts: list[float], trim: int) -> float | None:
    """The pool's rate between the ``trim``-th finish and the ``trim``-th from last."""
    ts = sorted(ts)
    lo, hi = trim, len(ts) - 1 - trim
    if hi - lo < 2:
        return None
    return (hi - lo) / (ts[hi] - ts[lo])


def cpu_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    return sum(vals), vals[3] + vals[4]  # total, idle + iowait


# --------------------------------------------------------------------------- parts


class EventLog:
    """The proxy's events topic, read as it grows; events bucketed by job id."""

    def __init__(self, settings: CommonSettings) -> None:
        self.codec = Codec()
        self.by_job: dict[str, list[Event]] = defaultdict(list)
        self.consumer = Consumer(
            {**settings.kafka_config(), "group.id": uuid.uuid4().hex, "enable.auto.commit": False}
        )
        topic = settings.topics().events
        md = self.consumer.list_topics(topic, timeout=30)
        self.consumer.assign(
            [TopicPartition(topic, p, 0) for p in md.topics[topic].partitions]  # from the start
        )

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for m in self.consumer.consume(500, 0.1):
                if m.error() is None:
                    e = self.codec.decode(m.value())
                    self.by_job[e.rollout_id.rsplit("-", 1)[0]].append(e)

    def close(self) -> None:
        self.consumer.close()


def wait_groups(
    settings: CommonSettings, want: dict[str, int], partitions: int, timeout: float = 120
) -> None:
    """Until each consumer group is stable with ``want[group]`` members, all assigned (as many
    as the topic has partitions for)."""
    admin = AdminClient(settings.kafka_config())
    deadline = time.monotonic() + timeout
    while True:
        ready = True
        for group, f in admin.describe_consumer_groups(list(want)).items():
            try:
                d = f.result()
            except KafkaException:  # not there yet
                ready = False
                continue
            assigned = sum(1 for m in d.members if m.assignment.topic_partitions)
            full = len(d.members) == want[group] and assigned >= min(want[group], partitions)
            ready = ready and d.state == ConsumerGroupState.STABLE and full
        if ready:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"consumer groups not stable in {timeout} s: {want}")
        time.sleep(0.2)


# --------------------------------------------------------------------------- one configuration


def run_config(
    cfg: Config, bootstrap: str, proxy_url: str, events: EventLog, tmp: Path
) -> dict[str, Any]:
    ns = f"brs{cfg.name.replace('-', '')}{uuid.uuid4().hex[:6]}"
    settings = CommonSettings(kafka_bootstrap=bootstrap, namespace=ns, home=tmp / ns / "home")
    ensure_topics(settings, Topics(ns, partitions=cfg.partitions).specs())
    root = tmp / ns / "sandboxes"
    (tmp / ns).mkdir(parents=True)
    pools = {"init": cfg.init, "run": (cfg.run, cfg.run_conc), "eval": cfg.eval}
    procs = []
    for stage, (count, conc) in pools.items():
        for i in range(count):
            procs.append(
                LoggedProcess(
                    ["workers", "--stage", stage, "--concurrency", str(conc)],
                    settings,
                    tmp / ns,
                    f"{stage}-{i}.log",
                    env={
                        "ROLLSTREAM_ROLLOUTS_PROXY_URL": proxy_url,
                        "ROLLSTREAM_ROLLOUTS_ADMIN_KEY": ADMIN,
                        "ROLLSTREAM_ROLLOUTS_SANDBOX_ROOT": str(root),
                        "ROLLSTREAM_ROLLOUTS_WORKER_ID": f"{stage}-{i}",
                    },
                )
            )
    t0 = time.monotonic()
    for p in procs:
        p.start()
    try:
        groups = {f"{ns}.rollstream.rollouts.{s}": c for s, (c, _) in pools.items()}
        wait_groups(settings, groups, cfg.partitions)
        startup_s = time.monotonic() - t0
        job_id = f"bench-{cfg.name}"
        job = _job(cfg, job_id)
        cpu0, submitted_at = cpu_jiffies(), time.time()
        enqueued: dict[str, float] = {}
        if cfg.paced_s > 0:
            producer = Producer({**settings.kafka_config(), "acks": "all"})
            for msg in first_messages(job, [_task(i) for i in range(cfg.n)], now=0.0):
                msg = msg.model_copy(update={"enqueued_at": time.time()})
                enqueued[msg.rollout_id] = msg.enqueued_at
                producer.produce(settings.topics().task("init"), msg.encode(), msg.rollout_id)
                producer.flush(10)
                events.pump(cfg.paced_s)
        else:
            submit_job(settings, job, now=submitted_at)
        deadline = time.monotonic() + 60 + cfg.n * 10
        while True:
            evs = events.by_job[job_id]
            run_done = [e for e in evs if _is(e, "run", "finished")]
            ended = [e for e in evs if isinstance(e.body, RolloutFinished)]
            if len(run_done) >= cfg.n and (len(ended) >= cfg.n or not cfg.wait_eval):
                break
            if time.monotonic() > deadline or any(p.proc and p.proc.poll() for p in procs):
                tails = "\n".join(p.log_tail(15) for p in procs)
                raise RuntimeError(f"{cfg.name}: {len(run_done)}/{cfg.n} runs done\n{tails}")
            events.pump(0.5)
        cpu1 = cpu_jiffies()
    finally:
        for p in procs:  # SIGTERM to all, then wait for each
            if p.proc is not None and p.proc.poll() is None:
                p.proc.terminate()
        for p in procs:
            p.stop()
    busy_cpu = 1 - (cpu1[1] - cpu0[1]) / max(1, cpu1[0] - cpu0[0])
    return measure(cfg, evs, enqueued, submitted_at, startup_s, busy_cpu)


def _is(e: Event, stage: str, phase: str) -> bool:
    b = e.body
    return isinstance(b, StageEvent) and b.stage == stage and b.phase == phase


def measure(
    cfg: Config,
    evs: list[Event],
    enqueued: dict[str, float],
    submitted_at: float,
    startup_s: float,
    busy_cpu: float,
) -> dict[str, Any]:
    by_rid: dict[str, list[Event]] = defaultdict(list)
    for e in evs:
        by_rid[e.rollout_id].append(e)
    first: dict[str, dict[str, float]] = defaultdict(dict)  # rollout -> "run started" -> ts
    for rid, mine in by_rid.items():
        for e in mine:
            b = e.body
            if isinstance(b, StageEvent):
                first[rid].setdefault(f"{b.stage} {b.phase}", e.ts / 1e6)
            elif isinstance(b, RolloutFinished):
                first[rid].setdefault("finished", e.ts / 1e6)
    run_done = [e for e in evs if _is(e, "run", "finished")]
    by_worker: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for e in run_done:
        assert isinstance(e.body, StageEvent)
        by_worker[e.body.worker].append((e.ts / 1e6, e.rollout_id))
    between = []  # a RUN worker's time from one agent's end to the next one's start
    for done in by_worker.values():
        done.sort()
        for (_, prev), (_, nxt) in itertools.pairwise(done):
            between.append(first[nxt]["run started"] - first[prev]["run finished"])
    ts = [e.ts / 1e6 for e in run_done]
    agent_s = [e.body.duration_ms / 1000 for e in run_done if isinstance(e.body, StageEvent)]
    task_of = {e.rollout_id: e.body.task_id for e in evs if isinstance(e.body, RolloutStarted)}
    slots = cfg.run * cfg.run_conc
    busy = busy_rate({w: [t for t, _ in d] for w, d in by_worker.items()}, cfg.run_conc)
    workload = (
        statistics.fmean(sleeps(task_of[e.rollout_id]) for e in run_done)
        if tuple(cfg.agent_argv) == AGENT_ARGV
        else None
    )
    out: dict[str, Any] = {
        "run_workers": cfg.run,
        "rollouts": len(run_done),
        "not_ok": sum(1 for e in run_done if getattr(e.body, "status", "") != "ok"),
        "rate_busy": _r(busy),
        "rate_batch": _r(batch_rate(ts, slots)),
        "rate_makespan": round(len(ts) / (max(ts) - submitted_at), 3),
        "rate_ideal": _r(slots / workload if workload else None),  # the sleeps, no overhead
        "sleep_mean_s": _r(workload),
        "agent_mean_s": round(statistics.fmean(agent_s), 3),
        "run_between_ms": _ms(between) if between else None,
        "per_worker": sorted(len(v) for v in by_worker.values()),
        "startup_s": round(startup_s, 1),
        "busy_cpu": round(busy_cpu, 2),
        "partitions": cfg.partitions,
    }
    if enqueued:  # the paced configuration: overhead per rollout
        marks = [first[rid] for rid in enqueued]
        to_run = [m["run started"] - enqueued[rid] for rid, m in zip(enqueued, marks, strict=True)]
        to_end = [m["finished"] - m["run finished"] for m in marks]
        out["queue_to_run_ms"] = _ms(to_run)
        out["agent_exit_to_finished_ms"] = _ms(to_end)
        out["queue_to_run_ms_each"] = [round(1000 * x) for x in to_run]
    return out


HEADER = (
    "      config    n  busy/s batch/s  make/s ideal/s sleep_s agent_s betw_ms  cpu start"
    "  RUN finishes per worker"
)


def _f(x: float | None) -> str:
    return f"{x:7.3f}" if x is not None else "      -"


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _ms(xs: list[float]) -> dict[str, float]:
    return {
        "p50": round(1000 * statistics.median(xs), 1),
        "p99": round(1000 * _pct(xs, 0.99), 1),
        "n": len(xs),
    }


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run under 3 minutes: 12 rollouts, 1 and 8"
    )
    ap.add_argument("--rollouts", type=int, help="per scaling configuration (max 64)")
    ap.add_argument("--partitions", type=int, default=24, help="of each stage topic")
    ap.add_argument("--bootstrap", help="use this broker instead of starting one")
    args = ap.parse_args(argv)
    n = min(64, args.rollouts or (12 if args.quick else 64))
    paced_n = 12 if args.quick else 60
    p = args.partitions
    counts = (1, 8) if args.quick else (1, 2, 4, 8)  # RUN worker processes
    configs = [Config(f"run{w}", run=w, n=n) for w in counts]
    if not args.quick:  # the contract's default partition count
        configs.append(Config("run8-p6", run=8, n=n, partitions=6))
    configs += [  # the same RUN pool; EVAL one process, 2 at once
        Config("eval-normal", run=4, n=n, eval=(1, 2), eval_argv=["sleep", f"{EVAL_S}"]),
        Config(
            "eval-slow",
            run=4,
            n=n,
            eval=(1, 2),
            eval_argv=["sleep", f"{10 * EVAL_S:g}"],
            wait_eval=False,
        ),
        Config(
            "overhead",
            run=1,
            run_conc=4,
            n=paced_n,
            init=(1, 4),
            eval=(1, 4),
            paced_s=0.25,
            agent_argv=["true"],
        ),
    ]
    for c in configs:
        c.partitions = c.partitions if c.name == "run8-p6" else p
    load_start = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="bench-rollout-service-"))
    broker = events = None
    stack = contextlib.ExitStack()
    results: dict[str, dict[str, Any]] = {}
    t_all = time.monotonic()
    try:
        bootstrap = args.bootstrap
        if bootstrap is None:
            broker = KafkaBroker(
                BrokerConfig(data_dir=tmp / "kafka", port=free_port(), controller_port=free_port())
            ).start()
            bootstrap = broker.bootstrap
        common = CommonSettings(
            kafka_bootstrap=bootstrap, namespace=f"brsproxy{uuid.uuid4().hex[:6]}", home=tmp
        )
        ensure_topics(common)
        url = stack.enter_context(
            tokenizer_proxy(
                common,
                tmp,
                admin_key=ADMIN,
                producer="proxy-bench-rollout-service",
                model_dir=REPO / ".rollstream" / "models" / "tiny",
            )
        )
        events = EventLog(common)
        print(f"broker and proxy up in {time.monotonic() - t_all:.0f} s", file=sys.stderr)
        print(HEADER, file=sys.stderr)
        for cfg in configs:
            t0 = time.monotonic()
            r = results[cfg.name] = run_config(cfg, bootstrap, url, events, tmp)
            between = (r["run_between_ms"] or {}).get("p50")
            print(
                f"{cfg.name:>12} {r['rollouts']:>4} {_f(r['rate_busy'])} {_f(r['rate_batch'])} "
                f"{_f(r['rate_makespan'])} {_f(r['rate_ideal'])} {_f(r['sleep_mean_s'])} "
                f"{_f(r['agent_mean_s'])} {between:>7} {r['busy_cpu']:4.0%} "
                f"{r['startup_s']:5.1f}  {r['per_worker']} ({time.monotonic() - t0:.0f} s)",
                file=sys.stderr,
            )
    finally:
        if events is not None:
            events.close()
        stack.close()
        if broker is not None:
            broker.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    rate = {w: results[f"run{w}"]["rate_busy"] for w in counts}
    batch = {w: results[f"run{w}"]["rate_batch"] for w in counts}
    over = results["overhead"]
    slow, normal = results["eval-slow"]["rate_busy"], results["eval-normal"]["rate_busy"]
    summary: dict[str, Any] = {
        "bench": "rollout_service",
        "quick": args.quick,
        "rollouts_per_config": n,
        "workload": {"steps": STEPS, "median_s": MEDIAN_S, "sigma": SIGMA, "sandbox": "local"},
        "rate_busy": rate,
        "efficiency_8": _r(rate[8] / (8 * rate[1]) if rate[8] and rate[1] else None),
        "efficiency_8_batch": _r(batch[8] / (8 * batch[1]) if batch[8] and batch[1] else None),
        "slow_eval_run_ratio": _r(slow / normal if slow and normal else None),
        "queue_to_run_ms": over["queue_to_run_ms"],
        "agent_exit_to_finished_ms": over["agent_exit_to_finished_ms"],
        "configs": results,
        "load_start": round(load_start, 2),
        "wall_s": round(time.monotonic() - t_all, 1),
    }
    if "run8-p6" in results:
        p6 = results["run8-p6"]["rate_busy"]
        summary["efficiency_8_p6"] = _r(p6 / (8 * rate[1]) if p6 and rate[1] else None)
    print(
        f"efficiency at 8: {summary['efficiency_8']} (batch {summary['efficiency_8_batch']})  "
        f"slow EVAL / normal RUN rate: {summary['slow_eval_run_ratio']}  "
        f"queue->RUN {over['queue_to_run_ms']}  agent exit->finished "
        f"{over['agent_exit_to_finished_ms']} ms",
        file=sys.stderr,
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
