"""The lifecycle facts the rollout service posts about a rollout
(``POST /v1/rollouts/{rollout_id}/events``, admin key only), checked and turned into event
bodies. Pure: no HTTP framework, no recorder.

Each item is an object with a ``type`` and that type's fields (absent fields take the defaults;
an unknown field, a wrong type, an unknown enum value or a string past its bound is a 400 that
names the field as ``events[i].field``):

    stage             stage (init | run | eval), phase (started | finished), status ("" when
                      started; ok | failed | timeout when finished), duration_ms (>= 0),
                      job_id, worker, reason
    sandbox           phase (ready | released), sandbox_id (required), kind, duration_ms,
                      job_id
    evaluator_output  evaluator (required), status (ok | failed | timeout), passed, total
                      (0 <= passed <= total when total > 0), output (cut to ``MAX_OUTPUT``
                      characters, ``output_truncated`` set), output_truncated, job_id
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from rollstream.producers.errors import ApiError
from rollstream.schemas import (
    EvaluatorOutput,
    Lifecycle,
    SandboxEvent,
    SandboxPhase,
    StageEvent,
    StageName,
    StagePhase,
)

__all__ = ["MAX_EVENTS", "MAX_OUTPUT", "MAX_REASON", "parse_lifecycle"]

MAX_EVENTS: Final = 100  # items per request
MAX_ID: Final = 256  # job_id, worker, sandbox_id, kind, evaluator
MAX_REASON: Final = 2_000
MAX_OUTPUT: Final = 8_192
STAGE_STATUSES: Final = ("ok", "failed", "timeout")

MAX_DURATION_MS: Final = 7 * 24 * 3600 * 1000  # a duration over a week is a client bug


class _Item:
    """One item's fields, read with the checks; ``param`` names them in errors."""

    def __init__(self, data: dict[str, Any], param: str, known: set[str]) -> None:
        unknown = sorted(set(data) - known - {"type"})
        if unknown:
            raise ApiError(400, f"unknown field `{unknown[0]}`", param=f"{param}.{unknown[0]}")
        self.data, self.param = data, param

    def fail(self, key: str, message: str) -> ApiError:
        return ApiError(400, f"`{key}` {message}", param=f"{self.param}.{key}")

    def text(self, key: str, limit: int, *, required: bool = False, default: str = "") -> str:
        value = self.data.get(key, default)
        if not isinstance(value, str):
            raise self.fail(key, "must be a string")
        if required and not value:
            raise self.fail(key, "is required (a non-empty string)")
        if len(value) > limit:
            raise self.fail(key, f"is longer than {limit} characters")
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        value = self.data.get(key, default)
        if value not in choices:
            raise self.fail(key, f"must be one of {', '.join(repr(c) for c in choices)}")
        return str(value)

    def duration(self, key: str = "duration_ms") -> float:
        value = self.data.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, "must be a number")
        if not 0 <= value <= MAX_DURATION_MS:  # NaN and inf fail too; a huge int cannot overflow
            raise self.fail(key, f"must be a finite number in 0..{MAX_DURATION_MS}")
        return float(value)

    def count(self, key: str) -> int:
        value = self.data.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
            raise self.fail(key, "must be an integer in 0..2^31-1")
        return value

    def flag(self, key: str) -> bool:
        value = self.data.get(key, False)
        if not isinstance(value, bool):
            raise self.fail(key, "must be a boolean")
        return value


def _stage(item: _Item) -> StageEvent:
    phase = item.choice("phase", tuple(p.value for p in StagePhase), "started")
    started = phase == StagePhase.STARTED
    status = item.choice("status", ("",) if started else STAGE_STATUSES, "" if started else "ok")
    return StageEvent(
        stage=StageName(item.choice("stage", tuple(s.value for s in StageName), "")),
        phase=StagePhase(phase),
        status=status,
        duration_ms=item.duration(),
        job_id=item.text("job_id", MAX_ID),
        worker=item.text("worker", MAX_ID),
        reason=item.text("reason", MAX_REASON),
    )


def _sandbox(item: _Item) -> SandboxEvent:
    return SandboxEvent(
        sandbox_id=item.text("sandbox_id", MAX_ID, required=True),
        phase=SandboxPhase(item.choice("phase", tuple(p.value for p in SandboxPhase), "")),
        kind=item.text("kind", MAX_ID),
        duration_ms=item.duration(),
        job_id=item.text("job_id", MAX_ID),
    )


def _evaluator_output(item: _Item) -> EvaluatorOutput:
    passed, total = item.count("passed"), item.count("total")
    if total and passed > total:
        raise item.fail("passed", f"must be at most `total` ({total})")
    output = item.data.get("output", "")
    if not isinstance(output, str):
        raise item.fail("output", "must be a string")
    cut = len(output) > MAX_OUTPUT
    return EvaluatorOutput(
        evaluator=item.text("evaluator", MAX_ID, required=True),
        status=item.choice("status", STAGE_STATUSES, "ok"),
        passed=passed,
        total=total,
        output=output[:MAX_OUTPUT] if cut else output,
        output_truncated=item.flag("output_truncated") or cut,
        job_id=item.text("job_id", MAX_ID),
    )


_PARSERS: dict[str, tuple[set[str], Callable[[_Item], Lifecycle]]] = {
    "stage": ({"stage", "phase", "status", "duration_ms", "job_id", "worker", "reason"}, _stage),
    "sandbox": ({"phase", "sandbox_id", "kind", "duration_ms", "job_id"}, _sandbox),
    "evaluator_output": (
        {"evaluator", "status", "passed", "total", "output", "output_truncated", "job_id"},
        _evaluator_output,
    ),
}


def parse_lifecycle(body: dict[str, Any]) -> list[Lifecycle]:
    """The bodies of a request ``{"events": [...]}`` (module docstring), in order; ApiError 400
    naming the first bad field."""
    items = body.get("events")
    if not isinstance(items, list) or not items:
        raise ApiError(400, "`events` must be a non-empty list", param="events")
    if len(items) > MAX_EVENTS:
        raise ApiError(400, f"at most {MAX_EVENTS} events per request", param="events")
    out: list[Lifecycle] = []
    for i, data in enumerate(items):
        param = f"events[{i}]"
        if not isinstance(data, dict):
            raise ApiError(400, f"`{param}` must be an object", param=param)
        kind = data.get("type")
        found = _PARSERS.get(kind) if isinstance(kind, str) else None
        if found is None:
            types = ", ".join(repr(t) for t in _PARSERS)
            raise ApiError(400, f"`type` must be one of {types}", param=f"{param}.type")
        known, parse = found
        out.append(parse(_Item(data, param, known)))
    return out
