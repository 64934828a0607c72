"""``rollstream demo`` (``make demo``): the whole RL loop on one machine, nothing else running.

1. the local Kafka broker (KRaft) and the demo namespace's topics;
2. the tiny local model (random-init Qwen2, BPE tokenizer trained on a local corpus);
3. services, each a ``rollstream`` subprocess with a log under ``<home>/logs``: the reference
   model server, the recording proxy (following ``policy.versions``; a random admin key per
   demo run), the rollout service's stage workers (``rollstream workers --stage all``, with
   that key), the stream processors, the ClickHouse sink (chDB) with its analytics server, and
   the trainer;
4. each round is one job of the rollout service (infra/demo/service.py): a group of rollouts
   per task, INIT -> RUN (the demo's agent, infra/demo/agent.py) -> EVAL (its evaluator,
   infra/demo/evaluator.py) in ``local`` sandboxes; the demo submits the job to the job queue
   and reads the rollouts' events back (LlmCalls, rewards, RolloutFinished) while the trainer
   trains on the samples the processors emit (async RL with bounded staleness); the proxy
   reloads each new policy;
5. the reward per policy version, as a table and a PNG plot, once ``demo_steps`` policy
   versions exist, ``demo_solved_rounds`` rounds in a row scored the top reward on every
   rollout (nothing left to train), or ``demo_max_minutes`` pass.
"""

from __future__ import annotations

import json
import secrets
import statistics
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Literal

import httpx
from pydantic import Field
from rich.console import Console
from rich.live import Live
from rich.table import Table

from rollstream.infra import stack
from rollstream.infra.demo import loops
from rollstream.infra.demo.agent import AgentResult, demo_tasks
from rollstream.infra.demo.service import EventReader, ResultFold, job_prefix
from rollstream.infra.kafka import free_port
from rollstream.infra.logs import log_to_file
from rollstream.infra.services import Service, Supervisor
from rollstream.producers.rollouts.jobqueue import submit_job
from rollstream.schemas.settings import NONE_FROM_ENV

__all__ = ["DemoSettings", "plot_rewards", "reward_table", "run"]


class DemoSettings(stack.StackSettings):
    """Settings of ``rollstream demo`` (ROLLSTREAM_DEMO_*); an optional one is unset with the
    value ``none`` (ROLLSTREAM_DEMO_FLUSH_IDLE_S=none)."""

    model_config = NONE_FROM_ENV
    demo_steps: int = 30  # policy versions to train
    demo_max_minutes: float = 10.0  # stop the loop after this long even if steps remain
    demo_tasks: int = 4  # tasks per round (one GRPO group each)
    demo_group_size: int = 8  # rollouts per group
    demo_turns: int = 2  # model turns per rollout (each followed by a tool call)
    demo_max_tokens: int = 12  # tokens per model turn
    demo_workers: int = 8  # concurrent rollouts
    demo_lr: float = 1e-2  # trainer learning rate
    demo_token_budget: int = 6144  # padded tokens per training step
    demo_max_staleness: int = 2  # samples older than this many versions are dropped
    demo_sink: bool = True  # also run the ClickHouse sink and show its report
    demo_plot: Path | None = None  # default <home>/demo-reward.png
    demo_seed: int = 0  # model init and task seed
    demo_sync: bool = False  # strictly alternate: each round waits for the next policy version
    demo_stream: bool = False  # submit rollouts continuously instead of round by round
    demo_controller: bool = False  # run the elastic controller (staleness-aware admission)
    demo_env_median_s: float = Field(default=0.0, ge=0, le=600)  # tool calls' environment time
    demo_env_sigma: float = Field(default=1.0, ge=0, le=5)  # its lognormal shape (long tail)
    demo_env_max_s: float = Field(default=60.0, ge=0, le=3600)  # its cap
    demo_batch_samples: int | None = Field(default=None, ge=1, le=100_000)  # samples per step
    demo_flush_idle_s: float | None = 3.0  # the trainer trains a partial batch after this idle
    demo_sample_mode: Literal["path", "tree"] = "path"  # path: per leaf path; tree: per tree
    demo_drop_zero_variance: bool = True  # DAPO: groups whose rewards are all equal
    demo_stop_at_trained: bool = False  # end once policy demo_steps is served (no last round)
    # end once this many rounds in a row scored the top reward on every rollout (no group has
    # spread left, so no step is left to train); 0: run on to demo_steps or demo_max_minutes
    demo_solved_rounds: int = Field(default=2, ge=0, le=1000)


def rewards_by_version(results: list[AgentResult]) -> dict[int, list[float]]:
    """Final reward of each rollout under the policy version that produced its first call."""
    out: dict[int, list[float]] = defaultdict(list)
    for r in results:
        if r.policy_versions and r.error is None:
            out[min(r.policy_versions)].append(r.final)
    return dict(sorted(out.items()))


def reward_table(results: list[AgentResult], title: str = "reward per policy version") -> Table:
    table = Table("policy version", "rollouts", "mean reward", "min", "max", title=title)
    for version, values in rewards_by_version(results).items():
        table.add_row(
            str(version),
            str(len(values)),
            f"{statistics.fmean(values):.3f}",
            f"{min(values):.2f}",
            f"{max(values):.2f}",
        )
    return table


def plot_rewards(results: list[AgentResult], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = rewards_by_version(results)
    versions = list(data)
    means = [statistics.fmean(v) for v in data.values()]
    fig, ax = plt.subplots(figsize=(7, 4))
    for v, values in data.items():
        ax.scatter([v] * len(values), values, s=6, alpha=0.25, color="tab:blue")
    ax.plot(versions, means, marker="o", color="tab:red", label="mean reward")
    ax.set_xlabel("policy version (trainer step)")
    ax.set_ylabel("final reward (digit fraction)")
    ax.set_title("rollstream demo: reward per policy version")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mode(settings: DemoSettings) -> str:
    mode = "stream" if settings.demo_stream else "sync" if settings.demo_sync else "async"
    return f"{mode}+controller" if settings.demo_controller else mode


def _write_summary(
    path: Path,
    settings: DemoSettings,
    results: list[AgentResult],
    loop_s: float,
    version_s: dict[int, float],
) -> None:
    data = rewards_by_version(results)
    path.write_text(
        json.dumps(
            {
                "mode": _mode(settings),
                "version_s": {str(k): v for k, v in sorted(version_s.items())},
                "namespace": settings.namespace,
                "steps": loops.latest_version(results),
                "loop_s": round(loop_s, 2),
                "rollouts": len(results),
                "failed": sum(r.error is not None for r in results),
                "mean_reward_by_version": {str(k): statistics.fmean(v) for k, v in data.items()},
            },
            indent=1,
        )
    )


def _show_sink_report(settings: DemoSettings, url: str, console: Console) -> None:
    """The same numbers, as the ClickHouse sink stored them (rollstream report)."""
    from rollstream.consumers.analytics.report_cli import ReportSettings
    from rollstream.consumers.analytics.report_cli import run as report

    time.sleep(3)  # let the sink flush its last batch
    try:
        report(
            ReportSettings(namespace=settings.namespace, home=settings.home),
            view="reward_by_policy",
            url=url,
            console=console,
        )
    except Exception as exc:  # the demo's own table stands; say why this one is missing
        console.print(f"[yellow]sink report unavailable:[/] {type(exc).__name__}: {exc}")


def run(settings: DemoSettings) -> int:
    """Run the demo; the console shows progress and results, its own log (the agent's HTTP
    requests, library chatter) goes to ``<home>/<namespace>/logs/demo.log`` beside the
    services' logs."""
    namespace = settings.namespace or f"demo{uuid.uuid4().hex[:6]}"
    settings = settings.model_copy(update={"namespace": namespace})
    home = Path(settings.home).resolve()
    with log_to_file(home / namespace / "logs" / "demo.log"):
        return _run(settings, home, Console())


def _run(settings: DemoSettings, home: Path, console: Console) -> int:
    t0 = time.monotonic()
    namespace = settings.namespace
    with console.status("starting the local Kafka broker ..."):
        stack.up(settings)
    console.print(
        f"[green]kafka ready[/] at {settings.kafka_bootstrap}, namespace "
        f"[bold]{namespace}[/] ({time.monotonic() - t0:.0f}s)"
    )

    from rollstream.inference.tinymodel import ensure_tiny_model

    model_dir = home / "models" / "tiny"
    with console.status("making the tiny model ..."):
        ensure_tiny_model(model_dir, seed=settings.demo_seed)

    model_port, proxy_port, analytics_port = free_port(), free_port(), free_port()
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    run_id = f"{namespace}-run"
    admin_key = secrets.token_urlsafe(32)  # the proxy's admin key, this demo run only
    model_key = secrets.token_urlsafe(32)  # the model server's key: only the proxy holds it
    model_admin_key = secrets.token_urlsafe(32)  # ... and of its weight routes: the proxy's too
    env = {
        "ROLLSTREAM_HOME": str(home),
        "ROLLSTREAM_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "ROLLSTREAM_NAMESPACE": namespace,
        "ROLLSTREAM_MODEL_PATH": str(model_dir),
        "ROLLSTREAM_PROXY_MODEL_PATH": str(model_dir),
        "ROLLSTREAM_SPOOL_DIR": str(home / "spool" / namespace),
        "ROLLSTREAM_CLICKHOUSE_URL": f"chdb://{home / 'clickhouse'}",
        "ROLLSTREAM_CHECKPOINT_DIR": str(home / namespace / "checkpoints"),
    }
    sup = Supervisor(home / namespace, env)
    results: list[AgentResult] = []
    try:
        with console.status(
            "starting services (model server, proxy, rollout workers, processors, sink, trainer)"
        ):
            sup.start(
                Service(
                    "model-server",
                    ["serve-model", "--port", str(model_port)],
                    env={
                        "ROLLSTREAM_MODEL_API_KEY": model_key,
                        "ROLLSTREAM_MODEL_ADMIN_KEY": model_admin_key,
                    },
                    health_url=f"http://127.0.0.1:{model_port}/health",
                )
            )
            sup.start(
                Service(
                    "proxy",
                    [
                        "proxy",
                        "--port",
                        str(proxy_port),
                        "--backend",
                        f"http://127.0.0.1:{model_port}",
                    ],
                    env={
                        "ROLLSTREAM_PROXY_FOLLOW_POLICY": "true",
                        "ROLLSTREAM_PROXY_API_KEYS": admin_key,
                        "ROLLSTREAM_PROXY_BACKEND_API_KEY": model_key,
                        "ROLLSTREAM_PROXY_BACKEND_ADMIN_KEY": model_admin_key,
                    },
                    health_url=f"{proxy_url}/health",
                )
            )
            sup.start(
                Service(
                    "workers",
                    ["workers", "--stage", "all", "--concurrency", str(settings.demo_workers)],
                    env={
                        "ROLLSTREAM_ROLLOUTS_PROXY_URL": proxy_url,
                        "ROLLSTREAM_ROLLOUTS_ADMIN_KEY": admin_key,
                        "ROLLSTREAM_ROLLOUTS_SANDBOX_ROOT": str(home / namespace / "sandboxes"),
                    },
                )
            )
            sup.start(
                Service(
                    "processor",
                    ["process"],
                    env={
                        "ROLLSTREAM_PROC_GROUP_SIZE": str(settings.demo_group_size),
                        "ROLLSTREAM_PROC_GROUP_TIMEOUT_S": "60",
                        "ROLLSTREAM_PROC_SAMPLE_MODE": settings.demo_sample_mode,
                        "ROLLSTREAM_PROC_DROP_ZERO_VARIANCE": str(settings.demo_drop_zero_variance),
                    },
                )
            )
            if settings.demo_sink:
                sup.start(
                    Service(
                        "sink",
                        ["sink", "--port", str(analytics_port)],
                        health_url=f"http://127.0.0.1:{analytics_port}/health",
                    )
                )
            sup.start(
                Service(
                    "trainer",
                    ["train"],
                    env={
                        "ROLLSTREAM_TRAIN_LR": str(settings.demo_lr),
                        "ROLLSTREAM_TRAIN_TOKEN_BUDGET": str(settings.demo_token_budget),
                        "ROLLSTREAM_TRAIN_MAX_STALENESS": str(settings.demo_max_staleness),
                        "ROLLSTREAM_TRAIN_MAX_STEPS": str(settings.demo_steps),
                        "ROLLSTREAM_TRAIN_FLUSH_IDLE_S": str(settings.demo_flush_idle_s).lower(),
                        "ROLLSTREAM_TRAIN_BATCH_SAMPLES": str(settings.demo_batch_samples).lower(),
                        "ROLLSTREAM_TRAIN_TORCH_THREADS": "1",
                    },
                )
            )
            if settings.demo_controller:
                sup.start(
                    Service(
                        "controller",
                        ["controller"],
                        env={
                            "ROLLSTREAM_CONTROL_MAX_STALENESS": str(settings.demo_max_staleness),
                            "ROLLSTREAM_CONTROL_PERIOD_S": "1",
                            "ROLLSTREAM_CONTROL_PROXY_URL": proxy_url,
                            "ROLLSTREAM_CONTROL_PROXY_ADMIN_KEY": admin_key,
                            "ROLLSTREAM_CONTROL_SAMPLES_PER_STEP": str(
                                settings.demo_batch_samples
                                or settings.demo_tasks * settings.demo_group_size
                            ),
                        },
                    )
                )
        console.print(f"services up ({time.monotonic() - t0:.0f}s); logs in {sup.log_dir}")

        admin = httpx.Client(
            base_url=proxy_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30
        )
        reader = EventReader(settings)  # from the events topic's end, before the first job
        tasks = demo_tasks(settings.demo_tasks, settings.demo_seed)
        per_round = len(tasks) * settings.demo_group_size
        prefix = job_prefix(namespace)
        loop_t0 = time.monotonic()
        env = {
            "env_median_s": settings.demo_env_median_s,
            "env_sigma": settings.demo_env_sigma,
            "env_max_s": settings.demo_env_max_s,
        }
        try:
            with Live(reward_table(results), console=console, refresh_per_second=2) as live:

                def progress(now: list[AgentResult], rounds_submitted: int) -> None:
                    failed = sum(r.error is not None for r in now)
                    live.update(
                        reward_table(
                            now,
                            title=f"reward per policy version — round {rounds_submitted}, "
                            f"{len(now)} rollouts ({failed} failed), "
                            f"{time.monotonic() - t0:.0f}s",
                        )
                    )

                feed = loops.Feed(
                    reader=reader,
                    fold=ResultFold(),
                    clock=loops.VersionClock(admin, loop_t0),
                    prefix=prefix,
                    tasks=tasks,
                    make_job=loops.job_maker(
                        prefix,
                        tasks,
                        group_size=settings.demo_group_size,
                        turns=settings.demo_turns,
                        max_tokens=settings.demo_max_tokens,
                        run_id=run_id,
                        env=env,
                        one_task=settings.demo_stream,
                    ),
                    submit=lambda job: submit_job(settings, job),
                    steps=settings.demo_steps,
                    deadline=t0 + settings.demo_max_minutes * 60,
                    check=sup.check,
                    progress=progress,
                )
                if settings.demo_stream:
                    results = loops.stream(feed, settings.demo_group_size, settings.demo_workers)
                else:
                    results = loops.rounds(
                        feed,
                        per_round,
                        settings.demo_sync,
                        settings.demo_stop_at_trained,
                        settings.demo_solved_rounds,
                        settings.demo_drop_zero_variance,
                    )
                progress(results, 0)
        finally:
            reader.close()
            admin.close()
        loop_s = time.monotonic() - loop_t0
        _write_summary(
            home / namespace / "demo-summary.json", settings, results, loop_s, feed.clock.seen
        )
        if settings.demo_sink:
            _show_sink_report(settings, f"http://127.0.0.1:{analytics_port}", console)
    finally:
        sup.stop_all()

    data = rewards_by_version(results)
    plot = plot_rewards(results, settings.demo_plot or home / "demo-reward.png")
    if data:
        first, last = next(iter(data.values())), list(data.values())[-1]
        console.print(
            f"mean reward: policy v{next(iter(data))} {statistics.fmean(first):.3f} "
            f"-> v{list(data)[-1]} {statistics.fmean(last):.3f}; plot: {plot}"
        )
    if feed.solved:
        console.print(
            f"solved: every rollout of the last {settings.demo_solved_rounds} rounds scored "
            f"the top reward (policy v{max(feed.clock.seen, default=0)})"
        )
    console.print(
        f"{len(results)} rollouts in {time.monotonic() - t0:.0f}s; the broker keeps "
        f"running (`rollstream down` stops it); explore: `rollstream tail events "
        f"--namespace {namespace} --from-beginning`"
    )
    trained = max(feed.clock.seen, default=0) >= settings.demo_steps
    return 0 if results and (len(data) > 1 or trained) else 1
