"""The trainer's ledger: which sample records each committed step decided on, and how.

    <ns>.trainer.steps   TrainStep   key: the step number; one record (or several parts) per step

After step N is committed (its checkpoint written) the trainer publishes, for every record of
the samples topic that step covered, a ``StepSample``: its coordinates (``partition``,
``offset`` on ``topic``), the sample's ``sample_id``, ``rollout_id``, ``group_id``,
``policy_version`` and token count, and the ``verdict``:

    trained     in the step's gradient
    stale       dropped: older than the trainer's max_staleness at that step
    duplicate   dropped: its sample_id was trained before (a processor re-sent it)
    dlq         sent to the dead-letter topic (undecodable or invalid: no ids, coordinates only)
    skipped     following another run's manifests: in no step to come

The coordinates are the same as the step's manifest (``checkpoint.Manifest``), so every record
of the samples topic appears in exactly one committed step. A Sample carries no job id: readers
join ``rollout_id`` with the rollout's ``RolloutStarted.metadata["job_id"]``
(producers/rollouts/jobstatus.py does).

Bounds. A record is at most ``MAX_STEP_BYTES`` encoded (the broker's default message limit is
1 MiB) and lists at most ``MAX_PART_SAMPLES`` samples; ``step_records`` splits a larger step
into parts (``part`` of ``parts``, same ``step``), by encoded size. Ids are at most
``MAX_ID_CHARS`` characters without control characters; a sample whose id is longer (or has
one) is listed with that id empty (its coordinates still name it).

``Verdicts`` folds ledger records by rollout (order-free, idempotent) for readers that join
them with rollouts. Records are JSON, validated (a bad record raises ``SchemaError`` naming
the field). Pure: no Kafka, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Final, Literal, NamedTuple, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from .errors import SchemaError
from .events import Sample

__all__ = [
    "MAX_ID_CHARS",
    "MAX_PARTS",
    "MAX_PART_SAMPLES",
    "MAX_STEP_BYTES",
    "VERDICTS",
    "StepFact",
    "StepSample",
    "TrainStep",
    "Verdict",
    "Verdicts",
    "decode_step",
    "step_records",
]

MAX_STEP_BYTES: Final = 1_000_000  # one encoded record (part)
MAX_PART_SAMPLES: Final = 1000  # samples listed by one record
MAX_PARTS: Final = 100_000  # parts of one step (1e8 samples)
MAX_ID_CHARS: Final = 256
_ID_PATTERN: Final = r"^[^\x00-\x1f\x7f]*$"  # no control characters (JSON escapes them x6)
_SAFE: Final = 2**53 - 1  # integers exact in every JSON reader

Verdict = Literal["trained", "stale", "duplicate", "dlq", "skipped"]
VERDICTS: Final[tuple[Verdict, ...]] = ("trained", "stale", "duplicate", "dlq", "skipped")

Id = Annotated[str, StringConstraints(max_length=MAX_ID_CHARS, pattern=_ID_PATTERN)]
Version = Annotated[int, Field(ge=0, le=_SAFE)]


def _usable(text: str) -> str:
    """``text`` if it fits the ``Id`` bounds, else "" (unknown: never a cut id that joins wrong)."""
    if len(text) > MAX_ID_CHARS or any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        return ""
    return text


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def encode(self) -> bytes:
        return self.model_dump_json().encode()


class StepSample(_Record):
    """One record of the samples topic and what the step did with it."""

    verdict: Verdict
    partition: Annotated[int, Field(ge=0, le=2**31 - 1)]
    offset: Annotated[int, Field(ge=0, le=2**63 - 1)]
    sample_id: Id = ""  # "" for dlq
    rollout_id: Id = ""
    group_id: Id = ""
    policy_version: Version | None = None  # the sample's (its oldest token's)
    tokens: Annotated[int, Field(ge=0, le=2**32)] = 0

    @classmethod
    def of(cls, verdict: Verdict, partition: int, offset: int, sample: Sample | None) -> Self:
        """The entry of a polled record (``sample`` None: it went to the DLQ)."""
        if sample is None:
            return cls(verdict=verdict, partition=partition, offset=offset)
        return cls(
            verdict=verdict,
            partition=partition,
            offset=offset,
            sample_id=_usable(sample.sample_id),
            rollout_id=_usable(sample.rollout_id),
            group_id=_usable(sample.group_id),
            policy_version=min(max(int(sample.policy_version), 0), _SAFE),
            tokens=min(len(sample.input_ids), 2**32),
        )


class TrainStep(_Record):
    """Part ``part`` of ``parts`` of committed step ``step``'s ledger."""

    step: Annotated[int, Field(ge=1, le=_SAFE)]
    policy_version: Version  # of the weights the step produced (= step)
    ts: Annotated[float, Field(ge=0, le=10**11, allow_inf_nan=False)]  # wall-clock seconds
    topic: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._-]{1,249}$")]  # samples topic
    part: Annotated[int, Field(ge=0, lt=MAX_PARTS)] = 0
    parts: Annotated[int, Field(ge=1, le=MAX_PARTS)] = 1
    samples: list[StepSample] = Field(default_factory=list, max_length=MAX_PART_SAMPLES)

    @model_validator(mode="after")
    def _part_in_parts(self) -> Self:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} of {self.parts}")
        return self

    @property
    def key(self) -> bytes:
        return str(self.step).encode()


class StepFact(NamedTuple):
    """What one step decided for one sample record."""

    step: int
    verdict: str
    sample_id: str
    tokens: int


_EMPTY_BYTES: Final = 600  # an encoded TrainStep with no samples, bounded above (checked in tests)


def step_records(
    step: int, *, policy_version: int, ts: float, topic: str, samples: Sequence[StepSample]
) -> list[TrainStep]:
    """The step's ledger as records of at most ``MAX_STEP_BYTES`` and ``MAX_PART_SAMPLES``
    samples each, in the given order; one record (with no samples) for an empty step."""
    chunks: list[list[StepSample]] = [[]]
    size = _EMPTY_BYTES
    for entry in samples:
        n = len(entry.encode()) + 1  # the comma
        if chunks[-1] and (size + n > MAX_STEP_BYTES or len(chunks[-1]) >= MAX_PART_SAMPLES):
            chunks.append([])
            size = _EMPTY_BYTES
        chunks[-1].append(entry)
        size += n
    if len(chunks) > MAX_PARTS:
        raise SchemaError(f"TrainStep: step {step} needs {len(chunks)} parts (max {MAX_PARTS})")
    return [
        TrainStep(
            step=step,
            policy_version=policy_version,
            ts=ts,
            topic=topic,
            part=i,
            parts=len(chunks),
            samples=chunk,
        )
        for i, chunk in enumerate(chunks)
    ]


@dataclass(slots=True)
class Verdicts:
    """The fold of ledger records, by rollout: ``add(record)`` in any order and any number of
    times gives the same facts. One fact per sample record, keyed by its coordinates (topic,
    partition, offset); of two facts for one record (a trainer started again from scratch in
    the same namespace) the later step's wins. Entries without a rollout id (dead letters,
    ids out of bounds) are not kept."""

    facts: dict[str, dict[tuple[str, int, int], StepFact]] = field(default_factory=dict)

    def add(self, record: TrainStep) -> Verdicts:
        for e in record.samples:
            if e.rollout_id:
                facts = self.facts.setdefault(e.rollout_id, {})
                where = (record.topic, e.partition, e.offset)
                fact = StepFact(record.step, e.verdict, e.sample_id, e.tokens)
                old = facts.get(where)
                facts[where] = fact if old is None else max(old, fact)
        return self

    def of(self, rollout_id: str) -> list[StepFact]:
        """The facts of one rollout's sample records, in coordinate order."""
        facts = self.facts.get(rollout_id, {})
        return [facts[k] for k in sorted(facts)]


def decode_step(data: bytes) -> TrainStep:
    """A ``TrainStep`` from its JSON; ``SchemaError`` naming the field when it is not one."""
    if len(data) > MAX_STEP_BYTES:
        raise SchemaError(f"TrainStep of {len(data)} bytes (max {MAX_STEP_BYTES})")
    try:
        return TrainStep.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(record)"
        raise SchemaError(f"TrainStep.{where}: {first['msg']}") from exc
