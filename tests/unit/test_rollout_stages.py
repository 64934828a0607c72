"""The rollout service's pure rules (producers/rollouts/stages.py): stage messages round-trip
and refuse what is not theirs, a claim's verdict for every (claim, stage) case, offsets
committed in order per partition, retries as new attempts in the same group."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollstream.producers.errors import JobSpecError
from rollstream.producers.rollouts.jobs import parse_job, resolve_tasks
from rollstream.producers.rollouts.stages import (
    MAX_MESSAGE_BYTES,
    AgentSummary,
    Claim,
    Endpoint,
    OffsetBook,
    StageMessage,
    first_messages,
    job_record,
    judge,
    next_stage,
    retry,
)

JOB = parse_job(
    {
        "job_id": "unit-stages",
        "tasks": {"suite": "pycoding", "ids": ["balanced-brackets", "anagram-groups"]},
        "samples_per_task": 2,
        "agent": {"kind": "tool"},
        "attempts": 2,
    }
)
TASKS = resolve_tasks(JOB)
EP = Endpoint(base_url="http://p/rollouts/x/v1", token="t", api_url="http://p")


def test_first_messages_plan_every_task_and_sample_with_their_own_task_inline() -> None:
    msgs = first_messages(JOB, TASKS, now=1.0)
    assert [(m.task_id, m.sample_index) for m in msgs] == [
        ("balanced-brackets", 0), ("balanced-brackets", 1),
        ("anagram-groups", 0), ("anagram-groups", 1),
    ]  # fmt: skip
    for m in msgs:
        assert m.stage == "init" and m.attempt == 0 and m.job.id == JOB.id
        assert m.task.task_id == m.task_id and m.plan.rollout_id == m.rollout_id
        assert StageMessage.decode(m.encode()) == m
    assert len({m.rollout_id for m in msgs}) == 4
    record = job_record(JOB, TASKS, now=1.0)
    assert (record.rollouts, record.task_ids) == (4, ["balanced-brackets", "anagram-groups"])


def test_a_message_is_handed_on_and_retried_as_a_new_attempt() -> None:
    m = first_messages(JOB, TASKS, now=1.0)[0]
    run = next_stage(m, now=2.0, sandbox_id="sbx-0123456789abcdef", endpoint=EP)
    assert (run.stage, run.rollout_id, run.enqueued_at) == ("run", m.rollout_id, 2.0)
    ev = next_stage(run, now=3.0, agent=AgentSummary(status="ok", stop="submit"))
    assert ev.stage == "eval" and StageMessage.decode(ev.encode()) == ev
    with pytest.raises(ValueError):
        next_stage(ev, now=4.0)
    again = retry(ev, now=5.0)
    assert again is not None and again.stage == "init" and again.attempt == 1
    assert again.rollout_id != m.rollout_id and again.plan.group_id == m.plan.group_id
    assert retry(again, now=6.0) is None  # attempts: 2


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda d: d.update(rollout_id="unit-stages-00000000000000000000"), "rollout_id"),
        (lambda d: d.update(stage="run"), "sandbox"),
        (lambda d: d.update(task_id="anagram-groups"), "own task"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d["job"].update(samples_per_task=0), "samples_per_task"),
    ],
)
def test_decode_refuses_a_message_that_is_not_its_rollouts(change, why) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(first_messages(JOB, TASKS, now=1.0)[0].encode())
    change(data)
    with pytest.raises(ValueError, match=why):
        StageMessage.decode(json.dumps(data).encode())


def test_decode_refuses_an_oversized_message() -> None:
    with pytest.raises(ValueError, match="bytes"):
        StageMessage.decode(b" " * (MAX_MESSAGE_BYTES + 1))


def test_a_task_too_large_for_a_message_names_it() -> None:
    # a task is bounded in characters; three-byte characters make it too many bytes
    files = {f"f{i}.py": "\u20ac" * 60_000 for i in range(6)}
    big = TASKS[1].model_copy(update={"files": files})
    with pytest.raises(JobSpecError) as err:
        first_messages(JOB, [TASKS[0], big], now=1.0)
    assert err.value.field == "tasks[1]"


ME = "host:1:2:boot"


@pytest.mark.parametrize(
    ("claim", "stage", "verdict"),
    [
        (None, "run", "gone"),
        (Claim("init", "", True, False), "run", "take"),  # handed on by INIT
        (Claim("run", "", True, False), "eval", "take"),
        (Claim("init", "", True, False), "init", "resend"),  # INIT done, offset not committed
        (Claim("run", "", True, False), "run", "resend"),
        (Claim("run", "other", False, True), "run", "busy"),  # a live worker has it
        (Claim("run", "other", False, False), "run", "dead"),  # its worker died
        (Claim("run", ME, False, True), "run", "take"),  # this process's leftover
        (Claim("eval", "other", False, True), "run", "skip"),  # stale: a later stage has it
        (Claim("eval", "", True, False), "init", "skip"),
        (Claim("init", "", True, False), "eval", "gone"),  # a message was lost
        (Claim("init", "other", False, True), "run", "busy"),
    ],
)
def test_judge(claim: Claim | None, stage: str, verdict: str) -> None:
    assert judge(claim, stage, me=ME) == verdict  # type: ignore[arg-type]


@given(st.permutations(list(range(20))))
def test_offsets_are_committed_in_order_whatever_order_work_ends(order: list[int]) -> None:
    book = OffsetBook()
    for offset in range(20):
        book.take(0, offset)
    done: set[int] = set()
    for offset in order:
        done.add(offset)
        upto = book.done(0, offset)
        first_missing = next((o for o in range(20) if o not in done), 20)
        assert upto == first_missing  # never past a message still in flight
    assert book.count() == 0


def test_a_revoked_partition_commits_nothing() -> None:
    book = OffsetBook()
    book.take(3, 7)
    book.take(3, 8)
    book.revoke([3])
    assert book.done(3, 7) is None and book.count() == 0
