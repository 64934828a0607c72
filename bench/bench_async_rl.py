"""Synchronous vs asynchronous RL on the rollout service, with environment time.

Each run is ``rollstream demo`` (model server, proxy, stage workers, processors, trainer; no
sink) on one broker, in a namespace of its own, trained to the same number of policy versions
with the same samples per step, so every mode trains the same number of samples. The demo's
agent waits in each tool call for an environment time drawn from a lognormal distribution
(``--env-median`` seconds, shape ``--env-sigma``, capped at ``--env-max``): long-tailed, as
sandbox commands and test runs are. Samples are one per rollout (tree mode, no DAPO filter), a
step is one round (``tasks x group`` samples).

Modes:
- ``sync``: strictly on-policy. A round of rollouts, then the step trained on it, then the next
  round under the new policy (trainer max staleness 0: a sample of an older policy would be
  dropped and counted).
- ``async``: rollouts submitted continuously, RUN at full concurrency, the trainer drops samples
  staler than ``--max-staleness`` (wasted rollouts).
- ``async+controller``: the same with the elastic controller: a rollout starts only while the
  trainer can still train it (staleness-aware admission).

Figures per mode (median over ``--runs``): seconds to the last policy version and its
speed-up over sync (what a user waits for ``--steps`` versions, the pipeline's filling
included), seconds per step after the first version and its speed-up (steady state, what
a long run converges to), staleness of the trained samples and the samples dropped as stale
(from the trainer's checkpoint manifests), rollouts finished, the mean reward of the rollouts
generated under the last two versions, and the reward at equal trainer steps measured on fixed
draws: the last version's weights answer the demo's first turn for each task ``--eval-samples``
times with the same prompts and seeds in every mode (``eval_policy``), so only the weights
differ between modes, not the sampling luck of the rollouts the run happened to make.

    python bench/bench_async_rl.py [--quick] [--runs N] [--steps N] [--lr LR] [--modes M,...]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from rollstream.consumers.training.checkpoint import CheckpointStore
from rollstream.consumers.training.settings import TrainerSettings
from rollstream.inference.tinymodel import SamplingParams, generate, load_model, stop_token_ids
from rollstream.infra.demo import DemoSettings
from rollstream.infra.demo.agent import SYSTEM, demo_tasks, digit_rewards
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port
from rollstream.schemas import Codec, CommonSettings, Sample

MODES = ("sync", "async", "async+controller")


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


def eval_policy(model_dir: Path, tasks: int, samples: int, max_tokens: int = 12) -> float:
    """Mean reward (the demo's digit share) of the policy at ``model_dir`` answering the first
    turn of each demo task ``samples`` times at temperature 1: prompts and seeds are fixed, so
    two policies are compared on the same draws."""
    import torch

    model, tok = load_model(model_dir)
    eos = stop_token_ids(tok)
    prompts = []
    for task in demo_tasks(tasks, 0):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        prompts.append(tok.encode(text, add_special_tokens=False))
    jobs = [(p, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 * t + i))
            for t, p in enumerate(prompts) for i in range(samples)]  # fmt: skip
    rewards: list[float] = []
    with torch.no_grad():
        for i in range(0, len(jobs), 64):
            chunk = jobs[i : i + 64]
            results = generate(model, [p for p, _ in chunk], [sp for _, sp in chunk],
                               eos_token_ids=eos, pad_token_id=tok.pad_token_id or 0)  # fmt: skip
            texts = tok.batch_decode([r.token_ids for r in results], skip_special_tokens=True)
            rewards += digit_rewards(texts)
    return statistics.fmean(rewards)


def run_mode(mode: str, bootstrap: str, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    namespace = f"bench{mode.replace('+', '')}{uuid.uuid4().hex[:4]}"
    per_round = args.tasks * args.group
    env = {
        **os.environ,
        "ROLLSTREAM_HOME": str(home),
        "ROLLSTREAM_KAFKA_BOOTSTRAP": bootstrap,
        "ROLLSTREAM_NAMESPACE": namespace,
        "ROLLSTREAM_DEMO_STEPS": str(args.steps),
        "ROLLSTREAM_DEMO_TASKS": str(args.tasks),
        "ROLLSTREAM_DEMO_GROUP_SIZE": str(args.group),
        "ROLLSTREAM_DEMO_WORKERS": str(args.workers),
        "ROLLSTREAM_DEMO_SYNC": str(mode == "sync").lower(),
        "ROLLSTREAM_DEMO_STREAM": str(mode != "sync").lower(),
        "ROLLSTREAM_DEMO_CONTROLLER": str(mode == "async+controller").lower(),
        "ROLLSTREAM_DEMO_MAX_STALENESS": "0" if mode == "sync" else str(args.max_staleness),
        "ROLLSTREAM_DEMO_ENV_MEDIAN_S": str(args.env_median),
        "ROLLSTREAM_DEMO_ENV_SIGMA": str(args.env_sigma),
        "ROLLSTREAM_DEMO_ENV_MAX_S": str(args.env_max),
        "ROLLSTREAM_DEMO_BATCH_SAMPLES": str(per_round),
        "ROLLSTREAM_DEMO_TOKEN_BUDGET": str(per_round * 256),
        "ROLLSTREAM_DEMO_FLUSH_IDLE_S": "none",
        "ROLLSTREAM_DEMO_SAMPLE_MODE": "tree",
        "ROLLSTREAM_DEMO_DROP_ZERO_VARIANCE": "false",
        "ROLLSTREAM_DEMO_STOP_AT_TRAINED": "true",
        "ROLLSTREAM_DEMO_SINK": "false",
        "ROLLSTREAM_DEMO_MAX_MINUTES": str(args.max_minutes),
    }
    if args.objective is not None:
        env["ROLLSTREAM_TRAIN_OBJECTIVE"] = args.objective
    if args.lr is not None:
        env["ROLLSTREAM_DEMO_LR"] = str(args.lr)
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rollstream.infra.cli", "demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=args.max_minutes * 60 + 600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{mode} demo failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((home / namespace / "demo-summary.json").read_text())
    if args.keep is not None:  # the services' logs, for a look at what each mode did
        shutil.copytree(home / namespace / "logs", args.keep / namespace, dirs_exist_ok=True)
    versions = sample_versions(bootstrap, CommonSettings(namespace=namespace).topics().samples)
    staleness: collections.Counter[int] = collections.Counter()
    stale_dropped = trained = 0
    for step, manifest in CheckpointStore(home / namespace / "checkpoints").manifests():
        stale_dropped += len(manifest.stale)
        trained += len(manifest.trained)
        for po in manifest.trained:
            if po in versions:
                staleness[step - 1 - versions[po]] += 1
    version_s = {int(k): v for k, v in summary["version_s"].items()}
    if max(version_s, default=0) < args.steps:
        raise SystemExit(f"{mode}: policy {args.steps} not reached in {args.max_minutes} min")
    latest = CheckpointStore(home / namespace / "checkpoints").latest()
    if latest is None or latest.step != args.steps:
        raise SystemExit(f"{mode}: the last checkpoint is not version {args.steps}")
    eval_reward = eval_policy(latest.model_dir, args.tasks, args.eval_samples)
    rewards = {int(k): v for k, v in summary["mean_reward_by_version"].items()}
    last = sorted(v for v in rewards if v < args.steps)[-2:]
    first = min(v for v in version_s if v >= 1)
    steady = (version_s[args.steps] - version_s[first]) / max(args.steps - first, 1)
    return {
        "wall_s": round(time.monotonic() - t, 1),
        "to_last_version_s": version_s[args.steps],
        "to_first_version_s": version_s[first],
        "steady_s_per_step": round(steady, 2),
        "samples_trained": trained,
        "stale_dropped": stale_dropped,
        "rollouts": summary["rollouts"],
        "failed": summary["failed"],
        "staleness": {str(k): v for k, v in sorted(staleness.items())},
        "reward_last_versions": round(statistics.fmean(rewards[v] for v in last), 3)
        if last
        else None,
        "eval_reward": round(eval_reward, 4),
        # k3 KL(behaviour || weights trained) of the last step's samples: how far a step moves
        "approx_kl_last_step": round(latest.meta.metrics.get("approx_kl", float("nan")), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 run of 3 versions per mode")
    ap.add_argument("--runs", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--workers", type=int, default=16, help="RUN slots (rollouts at once)")
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--env-median", type=float, default=1.0)
    ap.add_argument("--env-sigma", type=float, default=1.0)
    ap.add_argument("--env-max", type=float, default=20.0)
    ap.add_argument("--max-minutes", type=float, default=15.0)
    ap.add_argument(
        "--eval-samples",
        type=int,
        default=64,
        help="fixed draws per task of the last version's policy (eval_reward)",
    )
    ap.add_argument(
        "--objective",
        choices=("ppo", "decoupled"),
        help="the trainer's loss objective (default: the trainer's default)",
    )
    ap.add_argument(
        "--lr", type=float, help="the trainer's learning rate (default: the demo's demo_lr)"
    )
    ap.add_argument("--bootstrap")
    ap.add_argument("--keep", type=Path, help="copy each run's service logs here")
    args = ap.parse_args()
    args.runs = args.runs or (1 if args.quick else 3)
    args.steps = args.steps or (3 if args.quick else 6)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)} (known: {', '.join(MODES)})")
    tmp = Path(tempfile.mkdtemp(prefix="bench-async-"))
    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        broker = KafkaBroker(
            BrokerConfig(data_dir=tmp / "kafka", port=free_port(), controller_port=free_port())
        ).start()
        bootstrap = broker.bootstrap
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        for i in range(args.runs):  # modes interleaved, so drift of the machine hits all alike
            for mode in modes:
                r = run_mode(mode, bootstrap, tmp / "home", args)
                runs[mode].append(r)
                print(f"run {i + 1} {mode}: {json.dumps(r)}", flush=True)
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    result: dict[str, Any] = {
        "bench": "async_rl",
        "steps": args.steps,
        "samples_per_step": args.tasks * args.group,
        "runs": args.runs,
        "workers": args.workers,
        "env": {"median_s": args.env_median, "sigma": args.env_sigma, "max_s": args.env_max},
        "max_staleness": args.max_staleness,
        "objective": args.objective or TrainerSettings().train_objective,
        "lr": args.lr if args.lr is not None else DemoSettings().demo_lr,
        "modes": {},
    }
    base = None
    for mode in modes:
        rs = runs[mode]
        median = statistics.median(r["to_last_version_s"] for r in rs)
        base = median if mode == "sync" else base
        result["modes"][mode] = {
            "to_last_version_s_median": round(median, 1),
            "to_last_version_s": [r["to_last_version_s"] for r in rs],
            "steady_s_per_step_median": statistics.median(r["steady_s_per_step"] for r in rs),
            "to_first_version_s_median": statistics.median(r["to_first_version_s"] for r in rs),
            "stale_dropped_median": statistics.median(r["stale_dropped"] for r in rs),
            "samples_trained_median": statistics.median(r["samples_trained"] for r in rs),
            "rollouts_median": statistics.median(r["rollouts"] for r in rs),
            "staleness": rs[-1]["staleness"],
            "reward_last_versions": [r["reward_last_versions"] for r in rs],
            "eval_reward": [r["eval_reward"] for r in rs],
            "eval_reward_median": statistics.median(r["eval_reward"] for r in rs),
            "approx_kl_last_step": [r["approx_kl_last_step"] for r in rs],
        }
    if base:
        for mode in modes:
            m = result["modes"][mode]
            m["speedup_vs_sync"] = round(base / m["to_last_version_s_median"], 2)
            m["steady_speedup_vs_sync"] = round(
                result["modes"]["sync"]["steady_s_per_step_median"] / m["steady_s_per_step_median"],
                2,
            )
    for mode, m in result["modes"].items():
        print(
            f"{mode:18s} {m['to_last_version_s_median']:7.1f} s to v{args.steps}  "
            f"x{m.get('speedup_vs_sync', '-')}  stale dropped {m['stale_dropped_median']}  "
            f"eval reward {m['eval_reward_median']:.3f}  "
            f"staleness {m['staleness']}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
