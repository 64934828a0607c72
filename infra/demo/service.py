"""The demo's rounds as jobs of the rollout service, and their results read back from the log.

A round is one job (``demo_job``): the demo's tasks inline, ``samples_per_task`` = the group
size, the demo's agent (``python``: agent.run_agent) and evaluator (``python``:
evaluator.score_answers), in ``local`` sandboxes. The job id is the namespace, a nonce of the
demo run and the round number, so a namespace used again never meets the rollout ids of an
earlier run; the service's ``group_id(job, task)`` makes one GRPO group per task per round.

``ResultFold`` (pure) folds the rollouts' events into the rows the table and plot use
(``AgentResult``): the policy version of every LlmCall, the milestones and the final reward
the evaluator posted, and RolloutFinished's status. ``EventReader`` reads
``<ns>.rollout.events`` from where it ended when the reader was made.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from confluent_kafka import Consumer, KafkaException, TopicPartition

from rollstream.adapters.codecs import build_codec
from rollstream.adapters.topics import watermarks
from rollstream.infra.demo.agent import AgentResult, DemoTask, to_task
from rollstream.producers.rollouts.jobs import (
    JobSpec,
    PythonAgentSpec,
    PythonEvaluatorSpec,
    SandboxConfig,
    StageTimeouts,
    TaskSource,
)
from rollstream.schemas import (
    CommonSettings,
    DecodeError,
    Event,
    LlmCall,
    Reward,
    RewardKind,
    RolloutFinished,
    RolloutStarted,
    RolloutStatus,
)

__all__ = ["AGENT", "EVALUATOR", "EventReader", "ResultFold", "demo_job", "job_prefix"]

AGENT: Final = "rollstream.infra.demo.agent:run_agent"
EVALUATOR: Final = "rollstream.infra.demo.evaluator:score_answers"
TIMEOUTS: Final = StageTimeouts(init=60, run=300, eval=60)


def job_prefix(namespace: str, nonce: str | None = None) -> str:
    """``<namespace>-<nonce>``, cut and cleaned to fit a job id with a round number."""
    ns = re.sub(r"[^A-Za-z0-9_-]+", "-", namespace).strip("-_")[:24] or "demo"
    return f"{ns}-{nonce or uuid.uuid4().hex[:6]}"


def demo_job(
    prefix: str,
    round_no: int,
    tasks: Sequence[DemoTask],
    *,
    group_size: int,
    turns: int,
    max_tokens: int,
    run_id: str,
    env: dict[str, float] | None = None,
) -> JobSpec:
    """The job of one round (module docstring); ``env``: the agent's environment-time options
    (``env_median_s``, ``env_sigma``, ``env_max_s``: agent.env_seconds)."""
    return JobSpec(
        job_id=f"{prefix}-r{round_no}",
        tasks=TaskSource(inline=[to_task(t) for t in tasks]),
        samples_per_task=group_size,
        agent=PythonAgentSpec(
            kind="python",
            function=AGENT,
            options={"turns": turns, "max_tokens": max_tokens, **(env or {})},
        ),
        # local: the sandbox only holds the answers file of the demo's own, trusted agent; no
        # model-written code ever runs in it
        sandbox=SandboxConfig(kind="local", limits={"timeout": 60}),
        evaluator=PythonEvaluatorSpec(kind="python", function=EVALUATOR),
        timeouts=TIMEOUTS,
        run_id=run_id,
    )


@dataclass
class _Rollout:
    task_id: str = ""
    group_id: str = ""
    calls: int = 0
    versions: list[int] = field(default_factory=list)
    milestones: list[float] = field(default_factory=list)
    final: float | None = None
    status: str | None = None
    error: str | None = None


class ResultFold:
    """Per rollout, what its events say (module docstring); events of other rollouts are
    kept too (a round's rollouts are picked by id prefix)."""

    def __init__(self) -> None:
        self._rollouts: dict[str, _Rollout] = {}

    def feed(self, events: Iterable[Event]) -> None:
        for event in events:
            ro = self._rollouts.setdefault(event.rollout_id, _Rollout())
            body = event.body
            if isinstance(body, RolloutStarted):
                ro.task_id, ro.group_id = body.task_id, body.group_id
            elif isinstance(body, LlmCall):
                ro.calls += 1
                ro.versions.append(body.policy_version)
            elif isinstance(body, Reward):
                if body.kind == RewardKind.MILESTONE:
                    ro.milestones.append(body.value)
                elif body.kind == RewardKind.FINAL:
                    ro.final = body.value
            elif isinstance(body, RolloutFinished) and ro.status is None:
                ro.status, ro.error = str(body.status), body.error

    def finished(self, prefix: str) -> list[str]:
        """Ids of the finished rollouts whose id starts with ``prefix``."""
        return [
            rid
            for rid, ro in self._rollouts.items()
            if ro.status is not None and rid.startswith(prefix)
        ]

    def result(self, rollout_id: str) -> AgentResult:
        """The row of one rollout; one not finished, or finished otherwise than completed
        with a final reward, carries an error."""
        ro = self._rollouts.get(rollout_id, _Rollout())
        error = None
        if ro.status is None:
            error = "not finished"
        elif ro.status != RolloutStatus.COMPLETED.value:
            error = f"{ro.status}: {ro.error or ''}".rstrip(": ")
        elif ro.final is None:
            error = "no final reward"
        turns = len(ro.milestones)
        return AgentResult(
            rollout_id=rollout_id,
            task_id=ro.task_id,
            group_id=ro.group_id,
            turns=turns,
            retries=max(ro.calls - turns, 0),
            milestones=list(ro.milestones),
            final=ro.final or 0.0,
            policy_versions=list(ro.versions),
            error=error,
        )

    def round_results(self, prefix: str, expected: int) -> list[AgentResult]:
        """The rows of a round: its finished rollouts, and one failed row per rollout that
        did not finish (``expected`` in all)."""
        done = sorted(self.finished(prefix))
        rows = [self.result(rid) for rid in done]
        rows += [
            AgentResult(f"{prefix}?{i}", "", "", 0, 0, error="not finished")
            for i in range(max(expected - len(done), 0))
        ]
        return rows


class EventReader:
    """Reads ``<ns>.rollout.events`` from its end at construction (every partition)."""

    def __init__(self, settings: CommonSettings, timeout: float = 30.0) -> None:
        self.topic = settings.topics().events
        self.codec = build_codec(settings)
        self.consumer = Consumer(
            {
                **settings.kafka_config(),
                "group.id": f"rollstream-demo-{uuid.uuid4().hex[:12]}",  # assigned, never joined
                "enable.auto.commit": False,
            }
        )
        meta = self.consumer.list_topics(self.topic, timeout=timeout).topics.get(self.topic)
        if meta is None or meta.error is not None:
            raise KafkaException(f"topic {self.topic} does not exist")
        ends = [
            TopicPartition(
                self.topic, p, watermarks(self.consumer, TopicPartition(self.topic, p), timeout)[1]
            )
            for p in meta.partitions
        ]
        self.consumer.assign(ends)

    def poll(self, timeout: float) -> list[Event]:
        out = []
        for msg in self.consumer.consume(1000, timeout):
            if msg.error() is not None:
                continue
            try:
                event = self.codec.decode(msg.value() or b"")
            except DecodeError:
                continue
            if isinstance(event, Event):
                out.append(event)
        return out

    def close(self) -> None:
        self.consumer.close()


def wait_round(
    reader: EventReader,
    fold: ResultFold,
    prefix: str,
    expected: int,
    deadline: float,
    check: Callable[[], Any],
) -> list[AgentResult]:
    """Read events until ``expected`` rollouts whose id starts with ``prefix`` finished, or
    ``deadline`` (``time.monotonic()``); ``check`` is called between reads (the supervisor's:
    it raises when a service died)."""
    while len(fold.finished(prefix)) < expected and time.monotonic() < deadline:
        check()
        fold.feed(reader.poll(0.5))
    return fold.round_results(prefix, expected)
