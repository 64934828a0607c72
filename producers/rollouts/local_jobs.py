"""A whole job in one process: every planned rollout through ``run_rollout`` (INIT -> RUN ->
EVAL), ``rollouts_concurrency`` at a time, each retried as a new attempt (its own rollout id,
recorded as such) while its sandbox could not start and attempts are left.

This is ``rollstream run-job JOB.yaml``: the same functions the Kafka stage workers call
(workers.py), without the stage queues, so a job runs on one machine with nothing but the proxy
and Kafka.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rollstream.producers.errors import RolloutExists
from rollstream.producers.rollouts.agents import build_agent
from rollstream.producers.rollouts.evaluators import build_evaluator
from rollstream.producers.rollouts.jobs import (
    JobSpec,
    RolloutPlan,
    expand,
    next_attempt,
    resolve_tasks,
)
from rollstream.producers.rollouts.reaper import reap
from rollstream.producers.rollouts.runner import RolloutResult, run_rollout
from rollstream.producers.rollouts.sandbox import SandboxProvider, open_provider
from rollstream.producers.rollouts.settings import RolloutSettings

__all__ = ["provider_for", "run_job"]

log = logging.getLogger(__name__)


def provider_for(job: JobSpec, settings: RolloutSettings) -> SandboxProvider:
    """The sandbox provider of the job's kind, rooted where the settings say."""
    kind = job.sandbox.kind
    if kind == "docker":
        options: dict[str, Any] = {"image_cache": settings.home / "images"}
        if settings.rollouts_docker_url:
            options["base_url"] = settings.rollouts_docker_url
        return open_provider(kind, **options)
    root = settings.sandbox_root()
    root.mkdir(parents=True, exist_ok=True)
    return open_provider(kind, root=root)


def run_job(
    job: JobSpec,
    settings: RolloutSettings,
    *,
    environ: Mapping[str, str] | None = None,
    on_result: Callable[[RolloutResult], None] | None = None,
) -> list[RolloutResult]:
    """Run every rollout of ``job``; returns the last attempt's result of each plan, in plan
    order. A plan whose id the proxy already has (``RolloutExists``: the job ran before) is
    skipped and logged, not run twice."""
    tasks = {t.task_id: t for t in resolve_tasks(job)}
    plans = expand(job, list(tasks.values()))
    provider = provider_for(job, settings)
    reap([provider], stage="init")  # what a killed worker left behind
    worker = settings.rollouts_worker_id or f"{socket.gethostname()}-{os.getpid()}"
    evaluator = build_evaluator(job.evaluator)
    env = dict(os.environ if environ is None else environ)

    def one(plan: RolloutPlan) -> RolloutResult | None:
        current: RolloutPlan | None = plan
        result: RolloutResult | None = None
        while current is not None:
            try:
                result = run_rollout(
                    current,
                    job,
                    tasks[current.task_id],
                    proxy_url=settings.rollouts_proxy_url,
                    admin_key=settings.rollouts_admin_key,
                    sandbox_provider=provider,
                    agent=build_agent(job.agent, environ=env),
                    evaluator=evaluator,
                    worker_id=worker,
                )
            except RolloutExists:
                log.warning("rollout %s exists at the proxy: skipped", current.rollout_id)
                return result
            if on_result is not None:
                on_result(result)
            # only a rollout that never got a sandbox is tried again: anything later was run
            current = next_attempt(current, job) if result.stage == "init" else None
        return result

    with ThreadPoolExecutor(max_workers=settings.rollouts_concurrency) as pool:
        results = list(pool.map(one, plans))
    return [r for r in results if r is not None]
