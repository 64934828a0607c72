"""Topics of the event contract: names, keys and how the broker keeps them.

Names are settings: a namespace prefix (``replay1.rollout.events``) lets a replay run beside
live data. The topic manager in rollstream.adapters creates exactly these specs, idempotently.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

__all__ = [
    "CONTROL_DECISIONS",
    "CONTROL_WORKERS",
    "DLQ",
    "EVENTS",
    "JOBS",
    "POLICY",
    "SAMPLES",
    "TASKS",
    "TRAINER_STEPS",
    "TRAJECTORIES",
    "TopicSpec",
    "Topics",
]

EVENTS = "rollout.events"
DLQ = "rollout.events.dlq"
TRAJECTORIES = "trajectories"
SAMPLES = "samples"
POLICY = "policy.versions"
TASKS = ("rollout.tasks.init", "rollout.tasks.run", "rollout.tasks.eval")
JOBS = "rollout.jobs"
CONTROL_WORKERS = "control.workers"
CONTROL_DECISIONS = "control.decisions"
TRAINER_STEPS = "trainer.steps"
_DAY_MS = 24 * 3600 * 1000

_FOREVER = -1
_WEEK_MS = 7 * 24 * 3600 * 1000


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int
    key: str
    content: str
    retention_ms: int = _FOREVER
    cleanup_policy: str = "delete"
    replication: int = 1
    config: dict[str, str] = field(default_factory=dict)

    def broker_config(self) -> dict[str, str]:
        return {
            "retention.ms": str(self.retention_ms),
            "cleanup.policy": self.cleanup_policy,
            **self.config,
        }


_BASE: tuple[TopicSpec, ...] = (
    TopicSpec(
        EVENTS,
        6,
        "rollout_id",
        "every event of every rollout, in order per rollout",
        config={"max.message.bytes": "16777216"},
    ),
    TopicSpec(
        DLQ,
        1,
        "original key",
        "undecodable or invalid records, reason in headers",
        config={"max.message.bytes": "16777216"},
    ),
    TopicSpec(
        TRAJECTORIES,
        6,
        "rollout_id",
        "rebuilt trajectory trees with scores; partitioned by group_id (murmur2, as the samples)",
        retention_ms=_WEEK_MS,
        config={"max.message.bytes": "16777216"},
    ),
    TopicSpec(
        SAMPLES,
        6,
        "group_id",
        "training samples with rollout-level advantages",
        retention_ms=_WEEK_MS,
        config={"max.message.bytes": "16777216"},
    ),
    TopicSpec(POLICY, 1, "-", "new weights: version, checkpoint URI, trainer step"),
    *(
        TopicSpec(
            t,
            24,  # a stage's workers: at most one per partition; 24 splits evenly in 1-4, 6, 8, 12
            "rollout_id",
            "rollout-service stage queue",
            retention_ms=_WEEK_MS,
        )
        for t in TASKS
    ),
    TopicSpec(JOBS, 1, "job_id", "rollout-service jobs: submitted (the plan), cancelled"),
    TopicSpec(
        CONTROL_WORKERS,
        1,
        "worker id",
        "rollout-service workers' load reports (schemas/control.py)",
        retention_ms=_DAY_MS,
    ),
    TopicSpec(
        CONTROL_DECISIONS,
        1,
        "capacity",
        "the elastic controller's decisions: RUN slots, admission, inference share",
    ),
    TopicSpec(
        TRAINER_STEPS,
        1,
        "step",
        "the trainer's ledger: per committed step, each sample record's verdict "
        "(trained, stale, duplicate, dlq, skipped) with its ids (schemas/steps.py)",
    ),
)


class Topics:
    """Actual topic names under a namespace. ``Topics("r1").events == "r1.rollout.events"``."""

    def __init__(self, namespace: str = "", *, replication: int = 1, partitions: int | None = None):
        self.namespace = namespace.strip(".")
        self.replication = replication
        self.partitions = partitions

    def name(self, base: str) -> str:
        return f"{self.namespace}.{base}" if self.namespace else base

    @property
    def events(self) -> str:
        return self.name(EVENTS)

    @property
    def dlq(self) -> str:
        return self.name(DLQ)

    @property
    def trajectories(self) -> str:
        return self.name(TRAJECTORIES)

    @property
    def samples(self) -> str:
        return self.name(SAMPLES)

    @property
    def policy(self) -> str:
        return self.name(POLICY)

    @property
    def jobs(self) -> str:
        return self.name(JOBS)

    @property
    def control_workers(self) -> str:
        return self.name(CONTROL_WORKERS)

    @property
    def control_decisions(self) -> str:
        return self.name(CONTROL_DECISIONS)

    @property
    def trainer_steps(self) -> str:
        return self.name(TRAINER_STEPS)

    def task(self, stage: str) -> str:
        return self.name(f"rollout.tasks.{stage}")

    def specs(self) -> list[TopicSpec]:
        return [
            replace(
                spec,
                name=self.name(spec.name),
                replication=self.replication,
                partitions=self.partitions or spec.partitions
                if spec.partitions > 1
                else spec.partitions,
            )
            for spec in _BASE
        ]
