"""The control records: how the rollout service's workers report, and what the elastic
controller decides, on the log.

    <ns>.control.workers     WorkerReport      key: worker id; every few seconds per worker
    <ns>.control.decisions   CapacityDecision  key: "capacity"; each controller tick

A worker reports, per stage it serves, how many rollouts it holds (``in_flight``), the most it
may hold now (``limit``), its configured ``concurrency`` and counters since it started. The
controller (``rollstream controller``) folds the reports with the trainer's signals into a
``CapacityDecision``: how many rollouts may be admitted (``run_slots``: admitted and not yet on
the samples topic; ``admit``: of which may start now), how the new starts are split between the
live RUN workers, and the share of accelerators serving inference. A worker's share is a
*budget* on its own cumulative RUN-started counter (``per_worker``): it may take a RUN message
while its counter is below it, so a decision never admits more than it says, however late the
worker's reports are. Decisions are kept on the log (auditable, replayable); a worker follows
the newest one younger than its ``ttl_s`` and, with none, runs at its own concurrency.

Records are JSON, bounded and validated (a bad record raises ``SchemaError`` naming the field).
Pure: no Kafka, no I/O.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from .errors import SchemaError

__all__ = [
    "DECISION_KEY",
    "MAX_CONTROL_BYTES",
    "CapacityDecision",
    "StageLoad",
    "WorkerReport",
    "decode_decision",
    "decode_report",
]

MAX_CONTROL_BYTES: Final = 256_000
DECISION_KEY: Final = "capacity"
MAX_WORKERS: Final = 4096
MAX_SLOTS: Final = 1_000_000

WorkerId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:@-]{1,200}$")]
Count = Annotated[int, Field(ge=0, le=10**12)]
Slots = Annotated[int, Field(ge=0, le=MAX_SLOTS)]
Seconds = Annotated[float, Field(ge=0, le=10**7, allow_inf_nan=False)]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def encode(self) -> bytes:
        return self.model_dump_json().encode()


class StageLoad(_Record):
    """One stage of one worker."""

    in_flight: Slots  # messages taken and not done
    limit: Slots  # the most it may hold now (its concurrency, or the controller's share)
    concurrency: Slots  # its configured concurrency
    started: Count = 0  # messages taken since the worker started
    done: Count = 0  # messages done since the worker started
    busy_s: Seconds = 0.0  # summed seconds of the done messages (their stage's wall time)


class WorkerReport(_Record):
    worker: WorkerId
    ts: Annotated[float, Field(ge=0, le=10**11, allow_inf_nan=False)]  # wall-clock seconds
    period_s: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)]
    stages: dict[Literal["init", "run", "eval"], StageLoad]
    stopping: bool = False  # the last report of a worker that stops


class CapacityDecision(_Record):
    ts: Annotated[float, Field(ge=0, le=10**11, allow_inf_nan=False)]  # wall-clock seconds
    ttl_s: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)]  # ignored when older
    run_slots: Slots  # rollouts admitted and not yet on the samples topic, over all workers
    admit: Slots  # of which may start now (staleness headroom)
    limited: bool = True  # False: admission off, every RUN slot open (per_worker unused)
    # RUN-started budget per worker (its own cumulative counter); a worker not named: none
    per_worker: dict[WorkerId, Count] = Field(default_factory=dict, max_length=MAX_WORKERS)
    inference_share: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 1.0
    reason: Annotated[str, StringConstraints(max_length=200)] = ""
    signals: dict[
        Annotated[str, StringConstraints(max_length=64)],
        Annotated[float, Field(allow_inf_nan=False)],
    ] = Field(default_factory=dict, max_length=64)

    def stale(self, now: float) -> bool:
        return now - self.ts > self.ttl_s

    def may_start(self, worker: str, started: int, now: float) -> bool:
        """Whether ``worker``, having started ``started`` RUN messages, may start one more at
        wall-clock ``now``: within its budget; always when the decision is stale (a controller
        that stopped never stops the service: it can waste rollouts, never lose one)."""
        if not self.limited or self.stale(now):
            return True
        return started < self.per_worker.get(worker, 0)


def _decode(model: type[_Record], data: bytes) -> _Record:
    if len(data) > MAX_CONTROL_BYTES:
        raise SchemaError(f"control record of {len(data)} bytes (max {MAX_CONTROL_BYTES})")
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(record)"
        raise SchemaError(f"{model.__name__}.{where}: {first['msg']}") from exc


def decode_report(data: bytes) -> WorkerReport:
    out = _decode(WorkerReport, data)
    assert isinstance(out, WorkerReport)
    return out


def decode_decision(data: bytes) -> CapacityDecision:
    out = _decode(CapacityDecision, data)
    assert isinstance(out, CapacityDecision)
    return out
