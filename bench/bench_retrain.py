"""``rollstream retrain``: its wall time against the original run's training time, and the replay
-> samples throughput of the batch path it takes against the faust processor's.

1. A run: --rollouts rollouts of one run id (groups of 4, rewards 0 / 1, two LlmCalls of 48 + 16
   and 16 + 16 tokens the tiny model knows, then a Reward and RolloutFinished), produced into a
   namespace; its samples made by the batch path there; the trainer over them (the tiny Qwen2,
   hidden 64, 2 layers; --batch-samples per step, one torch thread): ``original_train_s``
   (``TrainResult.wall_s``: group join, the steps, the idle wait that ends it) and
   ``original_step_s`` (the sum of the steps' ``step_time_s``).
2. ``retrain`` of that run with unchanged settings from version 0, samples rebuilt (--rebuild):
   the wall time and each stage's (events replayed, samples built by the batch path, training
   by manifest); ``bit_equal``: the last checkpoint equal tensor for tensor to the original's.
3. Unless --quick (or with --faust): the run's events replayed into a fresh namespace and
   ``rollstream process`` (the faust worker) over them: samples/s from its first sample to its
   last, and from its start to its last sample, beside the batch stage's events/s.

4. --demo-steps N instead: a recorded run of the demo (``rollstream demo`` with
   ROLLSTREAM_DEMO_STEPS=N and no sink, in a home and on a broker of its own: the rollout
   service, the model server, the processors and the trainer together, 32 rollouts a round),
   then ``retrain`` of it from version 0 with unchanged settings: the retrain's wall time
   against the demo's loop time (``loop_s``: from the first job to the last policy version;
   the log removes the rollouts' time) and ``bit_equal`` of the last checkpoint; then the same
   with ``--rebuild`` (samples rebuilt by the batch path): replay -> samples events/s.
5. --demo-rollouts N instead: the same, the demo sized in rollouts: it runs with no step limit
   until N rollouts of its run have a RolloutFinished on the events topic, then is stopped
   (SIGINT: its ``finally`` stops the services; the trainer ends after the step in flight and
   publishes it); ``loop_s`` runs from the first job to the last PolicyVersion, the retrains
   train exactly the published versions (``--max-steps``) and compare the newest checkpoint
   both hold.

    .venv/bin/python bench/bench_retrain.py [--quick] [--faust] [--bootstrap HOST:PORT]
    .venv/bin/python bench/bench_retrain.py --demo-steps 3
    .venv/bin/python bench/bench_retrain.py --demo-rollouts 3000

Starts its own Kafka broker unless --bootstrap. Progress on stderr; the last stdout line is one
JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition
from safetensors.torch import load_file

from rollstream.adapters.topics import ensure_topics
from rollstream.consumers.analytics.replay import ReplaySettings
from rollstream.consumers.analytics.replay import run as replay
from rollstream.consumers.training.settings import TrainerSettings
from rollstream.consumers.training.trainer import run as train
from rollstream.inference.tinymodel import ensure_tiny_model
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port, resolve_classpath
from rollstream.infra.retrain import RetrainSettings
from rollstream.infra.retrain import run as retrain
from rollstream.producers.rollouts.jobqueue import read_jobs
from rollstream.schemas import (
    Codec,
    CommonSettings,
    Event,
    LlmCall,
    PolicyVersion,
    Reward,
    RolloutFinished,
    RolloutStarted,
)
from rollstream.streams.app import group_route
from rollstream.streams.batch import BatchConfig, SourceRecord
from rollstream.streams.batch_job import run_batch
from rollstream.streams.settings import ProcessorSettings

sys.path.insert(0, str(Path(__file__).parent))  # bench_batch_process, for demo runs

RUN = "bench-run"
DEMO_STEPS_UNBOUNDED = 100_000  # --demo-rollouts: the rollout count stops the demo


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_events(n: int, now_us: int) -> list[Event]:
    rng = np.random.default_rng(0)
    events: list[Event] = []
    for i in range(n):
        rid = f"r{i:06d}"
        p1, c1 = rng.integers(0, 500, 48), rng.integers(0, 500, 16)
        p2, c2 = rng.integers(0, 500, 16), rng.integers(0, 500, 16)
        bodies: list[Any] = [
            RolloutStarted(task_id=f"task-{i // 4}", group_id=f"g{i // 4}", group_size=4,
                           run_id=RUN),
            LlmCall(f"{rid}-c0", None, 0, p1, c1, -rng.random(16, dtype=np.float32)),
            LlmCall(f"{rid}-c1", f"{rid}-c0", 64, p2, c2, -rng.random(16, dtype=np.float32)),
            Reward(float(i % 2)),
            RolloutFinished(),
        ]  # fmt: skip
        ts = now_us + i * 1000
        events += [Event(f"{rid}-{s}", rid, s, ts + s, b, "bench") for s, b in enumerate(bodies)]
    return events


def produce(settings: CommonSettings, events: list[Event]) -> None:
    codec = Codec()
    producer = Producer({**settings.kafka_config(), "enable.idempotence": True, "acks": "all"})
    for e in events:
        producer.produce(settings.topics().events, codec.encode(e), e.rollout_id.encode())
        producer.poll(0)
    assert producer.flush(60) == 0


def count(settings: CommonSettings, topic: str) -> int:
    consumer = Consumer({**settings.kafka_config(), "group.id": "bench-count"})
    try:
        md = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if md is None:
            return 0
        return sum(
            hi - lo
            for p in md.partitions
            for lo, hi in [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)]
        )
    finally:
        consumer.close()


def faust_samples(settings: CommonSettings, work: Path, expected: int) -> dict[str, Any]:
    """``rollstream process`` over ``settings.namespace`` until ``expected`` samples (or 10 s
    without a new one)."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")},
        "ROLLSTREAM_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "ROLLSTREAM_NAMESPACE": settings.namespace,
        "ROLLSTREAM_HOME": str(work / "proc-home"),
    }
    started = time.monotonic()
    with open(work / "processor.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollstream.infra.cli", "process"], env=env, stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        first = last = None
        seen = 0
        try:
            while time.monotonic() - started < 600 and proc.poll() is None and seen < expected:
                n = count(settings, settings.topics().samples)
                now = time.monotonic()
                if n and first is None:
                    first = now
                if n > seen:
                    seen, last = n, now
                elif first is not None and now - (last or now) > 10:
                    break
                time.sleep(0.2)
        finally:
            proc.terminate()
            proc.wait(30)
    out: dict[str, Any] = {"samples": seen}
    if first is not None and last is not None and last > first:
        out["samples_per_s_first_to_last"] = round(seen / (last - first))
    if last is not None:
        out["start_to_last_sample_s"] = round(last - started, 2)
    return out


def last_checkpoints_equal(a_dir: Path, b_dir: Path) -> bool:
    a = load_file(str(a_dir / "model" / "model.safetensors"))
    b = load_file(str(b_dir / "model" / "model.safetensors"))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _read_all(settings: CommonSettings, topic: str, timeout: float = 30.0) -> list[Any]:
    """Every record of ``topic`` now on the log (all partitions, from the beginning)."""
    consumer = Consumer(
        {
            **settings.kafka_config(),
            "group.id": f"bench-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
        }
    )
    try:
        md = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        if md is None:
            return []
        ends = {}
        for p in md.partitions:
            lo, hi = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)
            if hi > lo:
                ends[p] = hi
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        out, deadline = [], time.monotonic() + timeout
        while ends and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            out.append(msg)
            if (msg.offset() or 0) + 1 >= ends.get(msg.partition() or 0, 0):
                ends.pop(msg.partition(), None)
        assert not ends, f"{topic}: not read to its end in {timeout:.0f} s"
        return out
    finally:
        consumer.close()


class FinishedCounter:
    """Rollouts with a RolloutFinished on the events topic, counted once each (by rollout id),
    read as the demo writes them."""

    def __init__(self, settings: CommonSettings) -> None:
        self.settings, self.codec = settings, Codec()
        self.finished: set[str] = set()
        self.consumer: Consumer | None = None

    def _attach(self) -> bool:
        topic = self.settings.topics().events
        c = Consumer(
            {
                **self.settings.kafka_config(),
                "group.id": f"bench-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
            }
        )
        md = c.list_topics(topic, timeout=5).topics.get(topic)
        if md is None or md.error is not None or not md.partitions:
            c.close()
            return False
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.partitions])
        self.consumer = c
        return True

    def poll(self, seconds: float) -> int:
        if self.consumer is None:
            try:
                attached = self._attach()
            except KafkaException:  # the demo's broker is not up yet
                attached = False
            if not attached:
                time.sleep(seconds)
                return 0
        assert self.consumer is not None
        for msg in self.consumer.consume(10_000, seconds):
            if msg.error() is None and msg.value():
                event = self.codec.decode(msg.value())
                if isinstance(event.body, RolloutFinished):
                    self.finished.add(event.rollout_id)
        return len(self.finished)

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()


def demo_run(steps: int | None, rollouts: int | None, workers: int = 2) -> dict[str, Any]:
    """A demo run of ``steps`` policy versions, or stopped once ``rollouts`` rollouts finished,
    retrained from version 0 (see the docstring)."""
    work = Path(tempfile.mkdtemp(prefix="bench-retrain-demo-"))
    home, ns = work / "home", f"rd{uuid.uuid4().hex[:6]}"
    bootstrap = f"127.0.0.1:{free_port()}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")},
        "ROLLSTREAM_HOME": str(home),
        "ROLLSTREAM_NAMESPACE": ns,
        "ROLLSTREAM_KAFKA_BOOTSTRAP": bootstrap,
        "ROLLSTREAM_DEMO_STEPS": str(steps or DEMO_STEPS_UNBOUNDED),
        "ROLLSTREAM_DEMO_SINK": "false",
        "ROLLSTREAM_DEMO_MAX_MINUTES": "90",
        # the demo stops once solved; sized in rollouts, it runs to the count instead
        **({"ROLLSTREAM_DEMO_SOLVED_ROUNDS": "0"} if rollouts else {}),
    }
    out: dict[str, Any] = {
        "bench": "retrain-demo",
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg()[0],
    }
    out.update({"demo_steps": steps} if steps else {"demo_rollouts": rollouts})
    cli = [sys.executable, "-m", "rollstream.infra.cli"]
    source = CommonSettings(kafka_bootstrap=bootstrap, namespace=ns, home=home)
    try:
        t0 = time.monotonic()
        with open(work / "demo.out", "wb") as log:
            if steps:
                say(f"demo: {steps} policy versions in {home} ...")
                rc = subprocess.run([*cli, "demo"], env=env, stdout=log, stderr=subprocess.STDOUT)
                assert rc.returncode == 0, (work / "demo.out").read_text()[-3000:]
                summary = json.loads((home / ns / "demo-summary.json").read_text())
                loop_s = summary["loop_s"]
                out["demo"] = {
                    "wall_s": round(time.monotonic() - t0, 1),
                    "loop_s": loop_s,
                    "rollouts": summary["rollouts"],
                    "steps": summary["steps"],
                }
            else:
                assert rollouts is not None
                out["demo"] = demo_until(cli, env, source, rollouts, log, work)
                loop_s = out["demo"]["loop_s"]
        out["load_after_demo"] = os.getloadavg()[0]
        say(f"demo: {out['demo']}")
        ckpt = home / ns / "checkpoints"
        last_step = max(int(p.name.removeprefix("step-")) for p in ckpt.glob("step-*"))
        # the versions the demo published: a step committed after the stop whose PolicyVersion
        # was not delivered (the trainer's 3 s stop budget) is not retrained
        published = out["demo"].get("last_version", last_step)
        if published < last_step:
            say(f"step {last_step} committed but not published: retraining 1..{published}")
        modes = [("copy", False, 1), ("rebuild", True, 1)]
        if workers > 1:
            modes.append((f"rebuild_{workers}_workers", True, workers))
        for mode, rebuild, n_workers in modes:
            target = f"{ns}{mode[0]}{n_workers}"
            t0 = time.monotonic()
            r = retrain(
                RetrainSettings(
                    kafka_bootstrap=bootstrap,
                    namespace=ns,
                    home=home,
                    replay_to=target,
                    replay_progress=False,
                    retrain_run=f"{ns}-run",
                    retrain_rebuild=rebuild,
                    retrain_idle_s=1.0,
                    retrain_max_steps=published,
                    retrain_workers=n_workers,
                )
            )
            wall = time.monotonic() - t0
            common = last_common_step(ckpt, home / target / "checkpoints")
            out[f"retrain_{mode}"] = {
                "wall_s": round(wall, 2),
                "over_demo_loop": round(wall / loop_s, 3),
                "stages_s": {k: round(v, 2) for k, v in r.seconds.items()},
                "events": r.events_replayed,
                "samples": r.samples_built,
                "steps": r.steps_trained,
                "follow": r.follow,
                "compared_step": common,
                "bit_equal": common == published
                and last_checkpoints_equal(
                    ckpt / f"step-{common:08d}",
                    home / target / "checkpoints" / f"step-{common:08d}",
                ),
            }
            if rebuild:
                s = r.seconds["samples"]
                out[f"retrain_{mode}"]["batch_events_per_s"] = round(r.events_replayed / s)
                out[f"retrain_{mode}"]["batch_samples_per_s"] = round(r.samples_built / s)
            say(f"retrain ({mode}): {out[f'retrain_{mode}']}")
        out["batch_in_memory"] = demo_in_memory(source, workers)
        say(f"batch path in memory on the demo's events: {out['batch_in_memory']}")
        out["load_after"] = os.getloadavg()[0]
    finally:
        subprocess.run([*cli, "down"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(work, ignore_errors=True)
    return out


def demo_in_memory(source: CommonSettings, workers: int, repeats: int = 5) -> dict[str, Any]:
    """The batch path in memory over the demo's own raw events, as they lie on its events
    topic (partition, offset, key): ``process_batch`` in one process against
    ``process_batch_parallel`` over ``workers``, in turns (bench_batch_process.side_by_side)."""
    import bench_batch_process

    msgs = _read_all(source, source.topics().events)
    recs = sorted(
        (
            SourceRecord(m.partition() or 0, m.offset() or 0, m.key(), m.value())
            for m in msgs
            if m.value()
        ),
        key=lambda r: (r.partition, r.offset),
    )
    config = BatchConfig(route=group_route(bench_batch_process.PARTITIONS))
    out = bench_batch_process.side_by_side(recs, config, workers, repeats)
    return {
        "events": len(recs),
        "bytes_per_event": round(sum(len(r.value or b"") for r in recs) / max(1, len(recs))),
        **out,
    }


def last_common_step(a: Path, b: Path) -> int:
    """The newest step directory both checkpoint dirs hold (-1: none)."""

    def steps(d: Path) -> set[int]:
        return {int(p.name.removeprefix("step-")) for p in d.glob("step-*") if p.is_dir()}

    return max(steps(a) & steps(b), default=-1)


def demo_until(
    cli: list[str],
    env: dict[str, str],
    source: CommonSettings,
    rollouts: int,
    log: Any,
    work: Path,
) -> dict[str, Any]:
    """``rollstream demo`` until ``rollouts`` rollouts of its run have a RolloutFinished on the
    events topic, then SIGINT to its process group (the demo alone: each service and the broker
    run in sessions of their own). The demo's ``finally`` stops its services (SIGTERM): the
    trainer returns after the step in flight, commits its checkpoint (written to a temp dir and
    renamed, so a checkpoint is whole or absent) and publishes its PolicyVersion. SIGTERM would
    end the demo's Python process without its ``finally`` and leave the services running.

    The loop time is the original's time to train what the retrain trains: from the first job
    (its record's ``at``) to the last PolicyVersion's timestamp on the policy topic."""
    say(f"demo: until {rollouts} rollouts finished, in {source.home} ...")
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # started in the background by a shell without job control: an ignored SIGINT is
        # inherited through exec, and the demo would never see the one that stops it
        signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [*cli, "demo"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    counter = FinishedCounter(source)
    out_path = work / "demo.out"
    finished, shown = 0, 0.0
    try:
        while finished < rollouts:
            assert proc.poll() is None, (
                f"demo exited ({proc.returncode}) at {finished} rollouts:\n"
                + out_path.read_text(errors="replace")[-3000:]
            )
            if counter.consumer is None and b"kafka ready" not in out_path.read_bytes():
                time.sleep(0.5)  # the demo's broker is not up yet
                continue
            finished = counter.poll(0.5)
            if time.monotonic() - shown > 30:
                shown = time.monotonic()
                say(f"demo: {finished} rollouts finished, {shown - t0:.0f} s")
        stop_wall = time.time()
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:  # the bench failed or was interrupted: stop the demo all the same
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        counter.close()
    jobs = [j for j in read_jobs(source) if j.type == "submitted"]
    first_job = min(j.at for j in jobs)
    codec = Codec()
    versions = [
        (codec.decode(m.value(), expect=PolicyVersion).version, m.timestamp()[1] / 1000)
        for m in _read_all(source, source.topics().policy)
    ]
    last_version, last_ts = max(versions)
    events = _read_all(source, source.topics().events)
    done = {
        e.rollout_id
        for e in map(codec.decode, (m.value() for m in events))
        if isinstance(e.body, RolloutFinished)
    }
    return {
        "wall_s": round(time.monotonic() - t0, 1),
        "exit": rc,
        "finished_at_stop": finished,
        "finished_on_log": len(done),
        "events": len(events),
        "jobs": len(jobs),
        "stop_s": round(stop_wall - first_job, 2),
        "loop_s": round(last_ts - first_job, 2),
        "last_version": last_version,
        "versions_after_stop": sum(ts > stop_wall for _, ts in versions),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--faust", action="store_true", help="also run the faust worker (--quick)")
    ap.add_argument("--bootstrap", help="use this Kafka instead of starting one")
    ap.add_argument("--rollouts", type=int)
    ap.add_argument("--batch-samples", type=int, default=8)
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        help="demo runs: also retrain with the batch path over this many processes, and time "
        "it in memory on the demo's events against one process (1: neither)",
    )
    demo = ap.add_mutually_exclusive_group()
    demo.add_argument("--demo-steps", type=int, help="retrain a recorded demo run of N versions")
    demo.add_argument(
        "--demo-rollouts", type=int, help="retrain a demo run stopped at N finished rollouts"
    )
    args = ap.parse_args()
    if args.demo_steps or args.demo_rollouts:
        print(json.dumps(demo_run(args.demo_steps, args.demo_rollouts, args.workers)))
        return
    n = args.rollouts or (32 if args.quick else 512)
    work = Path(tempfile.mkdtemp(prefix="bench-retrain-"))
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
        "bench": "retrain", "quick": args.quick, "machine": platform.machine(),
        "cpus": os.cpu_count(), "rollouts": n, "batch_samples": args.batch_samples,
    }  # fmt: skip
    try:
        ns = f"rt{uuid.uuid4().hex[:6]}"
        home = work / "home"
        source = CommonSettings(kafka_bootstrap=bootstrap, namespace=ns, home=home)
        ensure_topics(source)
        events = make_events(n, time.time_ns() // 1000)
        produce(source, events)
        out["events"] = len(events)
        proc = ProcessorSettings(kafka_bootstrap=bootstrap, namespace=ns, home=home)
        made = run_batch(source, proc, in_place=True)
        out["samples"] = made["written"]["samples"]
        say(f"run: {len(events)} events, {out['samples']} samples")
        model = ensure_tiny_model(work / "models" / "tiny", hidden=64, layers=2)
        ckpt = home / ns / "checkpoints"
        result = train(
            TrainerSettings(
                kafka_bootstrap=bootstrap, namespace=ns, home=home, model_path=model,
                checkpoint_dir=ckpt, checkpoint_keep=1, checkpoint_fsync=False,
                train_batch_samples=args.batch_samples, train_max_staleness=1_000_000,
                train_torch_threads=1, train_lr=1e-3, train_flush_idle_s=1.0,
                train_exit_idle_s=1.5, train_poll_timeout_s=0.2,
            )
        )  # fmt: skip
        step_s = 0.0
        from rollstream.consumers.training.checkpoint import read_checkpoint

        last = read_checkpoint(ckpt / f"step-{result.step:08d}")
        step_s = float(last.meta.metrics.get("step_time_s", 0.0))
        out["original"] = {
            "steps": result.step,
            "train_s": round(result.wall_s, 2),
            "last_step_s": round(step_s, 3),
        }
        say(f"original: {out['original']}")

        target = f"{ns}r"
        t0 = time.monotonic()
        r = retrain(
            RetrainSettings(
                kafka_bootstrap=bootstrap, namespace=ns, home=home, replay_to=target,
                replay_progress=False, retrain_run=RUN, retrain_rebuild=True,
                retrain_idle_s=1.0,
            )
        )  # fmt: skip
        wall = time.monotonic() - t0
        a = load_file(str(ckpt / f"step-{result.step:08d}" / "model" / "model.safetensors"))
        b_dir = home / target / "checkpoints" / f"step-{result.step:08d}" / "model"
        b = load_file(str(b_dir / "model.safetensors"))
        out["retrain"] = {
            "wall_s": round(wall, 2),
            "stages_s": {k: round(v, 2) for k, v in r.seconds.items()},
            "steps": r.steps_trained,
            "follow": r.follow,
            "bit_equal": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
            "batch_events_per_s": round(r.events_replayed / r.seconds["samples"]),
            "batch_samples_per_s": round(r.samples_built / r.seconds["samples"]),
        }
        out["retrain_over_original_train"] = round(wall / result.wall_s, 2)
        say(f"retrain: {out['retrain']}")
        if args.faust or not args.quick:
            fns = f"{ns}f"
            replay(
                ReplaySettings(kafka_bootstrap=bootstrap, namespace=ns, replay_to=fns,
                               replay_progress=False)
            )  # fmt: skip
            target_settings = CommonSettings(kafka_bootstrap=bootstrap, namespace=fns)
            out["faust"] = faust_samples(target_settings, work, out["samples"])
            say(f"faust: {out['faust']}")
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
