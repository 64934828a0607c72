"""The lifecycle items of ``POST /v1/rollouts/{id}/events`` (producers/proxy/lifecycle.py):
what each type becomes, and the 400 that names the first bad field."""

from __future__ import annotations

from typing import Any

import pytest

from rollstream.producers.errors import ApiError
from rollstream.producers.proxy.lifecycle import MAX_OUTPUT, parse_lifecycle
from rollstream.schemas import EvaluatorOutput, SandboxEvent, StageEvent


def test_each_type_becomes_its_body_in_order() -> None:
    bodies = parse_lifecycle({"events": [
        {"type": "stage", "stage": "run", "phase": "started", "job_id": "j", "worker": "w"},
        {"type": "sandbox", "phase": "released", "sandbox_id": "sb", "duration_ms": 4},
        {"type": "stage", "stage": "run", "phase": "finished", "status": "timeout",
         "duration_ms": 1.5, "reason": "deadline"},
        {"type": "evaluator_output", "evaluator": "suite", "status": "failed", "passed": 1,
         "total": 2, "output": "y" * (MAX_OUTPUT + 1)},
    ]})  # fmt: skip
    assert [type(b) for b in bodies] == [StageEvent, SandboxEvent, StageEvent, EvaluatorOutput]
    started, released, finished, output = bodies
    assert isinstance(started, StageEvent) and isinstance(finished, StageEvent)
    assert (started.stage, started.phase, started.status, started.duration_ms) == (
        "run",
        "started",
        "",
        0.0,
    )
    assert (finished.status, finished.duration_ms, finished.reason) == ("timeout", 1.5, "deadline")
    assert isinstance(released, SandboxEvent) and released.duration_ms == 4.0
    assert isinstance(output, EvaluatorOutput)
    assert len(output.output) == MAX_OUTPUT and output.output_truncated


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "stage", "stage": "deploy", "phase": "started"}, "stage"),
        ({"type": "stage", "stage": "init"}, None),
        ({"type": "stage", "stage": "init", "phase": "done"}, "phase"),
        ({"type": "stage", "stage": "init", "phase": "started", "status": "ok"}, "status"),
        ({"type": "stage", "stage": "init", "phase": "finished", "status": ""}, "status"),
        ({"type": "stage", "stage": "init", "duration_ms": -1}, "duration_ms"),
        ({"type": "stage", "stage": "init", "duration_ms": True}, "duration_ms"),
        ({"type": "stage", "stage": "init", "reason": "r" * 2001}, "reason"),
        ({"type": "stage", "stage": "init", "colour": "red"}, "colour"),
        ({"type": "sandbox", "phase": "ready"}, "sandbox_id"),
        ({"type": "sandbox", "phase": "gone", "sandbox_id": "s"}, "phase"),
        ({"type": "sandbox", "phase": "ready", "sandbox_id": "s", "kind": 3}, "kind"),
        ({"type": "evaluator_output", "status": "ok"}, "evaluator"),
        ({"type": "evaluator_output", "evaluator": "e", "passed": 3, "total": 2}, "passed"),
        ({"type": "evaluator_output", "evaluator": "e", "total": -1}, "total"),
        ({"type": "evaluator_output", "evaluator": "e", "status": "meh"}, "status"),
        ({"type": "evaluator_output", "evaluator": "e", "output": 5}, "output"),
        ({"type": "log"}, "type"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(item: dict[str, Any], param: str | None) -> None:
    good = {"type": "stage", "stage": "eval", "phase": "started"}
    if param is None:  # a valid item: no error
        assert len(parse_lifecycle({"events": [good, item]})) == 2
        return
    with pytest.raises(ApiError) as info:
        parse_lifecycle({"events": [good, item]})
    assert info.value.status == 400 and info.value.param == f"events[1].{param}"
    assert param in info.value.message


@pytest.mark.parametrize("body", [{}, {"events": []}, {"events": "x"}, {"events": [1]}])
def test_the_list_itself_is_checked(body: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as info:
        parse_lifecycle(body)
    assert info.value.status == 400 and info.value.param in ("events", "events[0]")
