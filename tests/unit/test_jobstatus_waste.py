"""A job's training from the trainer's ledger (jobstatus.py folding TrainStep records): samples
trained and dropped by verdict, tokens, rollouts trained and wasted (finished, none trained,
one at least dropped stale); other jobs' samples and dead letters count for none; the same
status from the same records, events and ledger shuffled and duplicated; and the JSON the CLI
and the jobs API print."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

from rollstream.producers.rollouts.jobs import parse_job, resolve_tasks, rollout_id
from rollstream.producers.rollouts.jobstatus import MAX_WASTED_LISTED, JobTraining, fold
from rollstream.producers.rollouts.stages import JobRecord, job_record
from rollstream.schemas import (
    Event,
    RolloutFinished,
    RolloutStarted,
    RolloutStatus,
    Sample,
    StepSample,
    TrainStep,
    Verdict,
)

T0 = 1_800_000_000.0
JOB_ID = "waste-job"
A, B = "balanced-brackets", "caesar-shift"
JOB = parse_job(
    {
        "job_id": JOB_ID,
        "tasks": {"suite": "pycoding", "ids": [A, B]},
        "samples_per_task": 2,
        "agent": {"kind": "tool"},
    }
)
SUBMITTED = job_record(JOB, resolve_tasks(JOB), now=T0)


def started(rid: str, task: str, sample: int, job: str = JOB_ID) -> Event:
    meta = {"job_id": job, "sample": str(sample)}
    return Event(f"{rid}:0", rid, 0, int(T0 * 1e6), RolloutStarted(task, "g", metadata=meta))


def finished(rid: str) -> Event:
    return Event(f"{rid}:1", rid, 1, int(T0 * 1e6) + 1, RolloutFinished(RolloutStatus.COMPLETED))


def entry(verdict: Verdict, offset: int, rid: str, sid: str, tokens: int = 10) -> StepSample:
    s = Sample(
        sample_id=sid, rollout_id=rid, group_id="g", task_id="t",
        input_ids=np.zeros(tokens, np.uint32), loss_mask=np.ones(tokens, np.uint8),
        behaviour_logprobs=np.zeros(tokens, np.float32), advantage=0.0, reward=0.0,
        policy_version=0,
    )  # fmt: skip
    return StepSample.of(verdict, 0, offset, s)


def step(n: int, *entries: StepSample) -> TrainStep:
    return TrainStep(step=n, policy_version=n, ts=T0, topic="ns.samples", samples=list(entries))


A0, A1 = rollout_id(JOB_ID, A, 0, 0), rollout_id(JOB_ID, A, 1, 0)
B0, B1 = rollout_id(JOB_ID, B, 0, 0), rollout_id(JOB_ID, B, 1, 0)
OTHER = rollout_id("another-job", A, 0, 0)


def items() -> list[Any]:
    """A0: both samples trained (one re-sent: a duplicate); A1: every sample stale, finished
    (wasted); B0: one trained, one stale (not wasted); B1: stale but not finished (not wasted
    yet); another job's wasted rollout; a dead letter."""
    events = [started(A0, A, 0), started(A1, A, 1), started(B0, B, 0), started(B1, B, 1)]
    events += [started(OTHER, A, 0, job="another-job"), finished(OTHER)]
    events += [finished(A0), finished(A1), finished(B0)]
    ledger = [
        step(1, entry("trained", 0, A0, "a0-x", 12), entry("trained", 1, B0, "b0-x", 7),
             entry("dlq", 2, "", "")),
        step(2, entry("stale", 3, A1, "a1-x", 30), entry("stale", 4, A1, "a1-y", 20),
             entry("trained", 5, A0, "a0-y", 8), entry("duplicate", 6, A0, "a0-x", 12),
             entry("stale", 7, B0, "b0-y", 5), entry("stale", 8, OTHER, "o-x")),
        step(3, entry("stale", 9, B1, "b1-x", 4)),
    ]  # fmt: skip
    return [SUBMITTED, *events, *ledger]


EXPECTED = JobTraining(
    samples_trained=3,
    samples_dropped={"stale": 4, "duplicate": 1, "skipped": 0},
    tokens_trained=12 + 7 + 8,
    tokens_stale=30 + 20 + 5 + 4,
    rollouts_trained=2,
    rollouts_wasted=1,
    wasted=[A1],
    first_step=1,
    last_step=2,
)


def test_trained_dropped_and_wasted_per_job() -> None:
    assert fold(JOB_ID, items()).training == EXPECTED


@pytest.mark.parametrize("seed", range(8))
def test_shuffled_and_duplicated_ledger_and_events_give_the_same_status(seed: int) -> None:
    rng = random.Random(seed)
    base = items()
    mixed = base + rng.sample(base, len(base) // 2)
    rng.shuffle(mixed)
    assert fold(JOB_ID, mixed) == fold(JOB_ID, base)
    assert fold(JOB_ID, mixed).training == EXPECTED


def test_a_rollout_is_wasted_only_once_finished_and_its_ledger_may_come_first() -> None:
    base = [i for i in items() if not (isinstance(i, Event) and i.rollout_id == A1 and i.seq)]
    status = fold(JOB_ID, base)
    assert (status.training.rollouts_wasted, status.training.wasted) == (0, [])
    later = fold(JOB_ID, [*reversed(base), finished(A1)])  # the ledger before the events
    assert later.training == EXPECTED


def test_without_a_ledger_nothing_is_trained_or_dropped() -> None:
    plain = [i for i in items() if not isinstance(i, TrainStep)]
    assert fold(JOB_ID, plain).training == JobTraining()


def test_the_wasted_ids_listed_are_bounded_and_all_are_counted() -> None:
    n = MAX_WASTED_LISTED + 5
    rids = [f"{JOB_ID}-w{i:04d}" for i in range(n)]
    records: list[JobRecord | Event | TrainStep] = [SUBMITTED]
    for i, rid in enumerate(rids):
        records += [started(rid, A, 0), finished(rid)]
        records.append(step(1 + i // 50, entry("stale", i, rid, f"s{i}")))
    training = fold(JOB_ID, records).training
    assert training.rollouts_wasted == n
    assert training.wasted == sorted(rids)[:MAX_WASTED_LISTED]


def test_the_status_json_carries_the_training() -> None:
    data = json.loads(json.dumps(fold(JOB_ID, items()).to_json()))
    assert data["training"] == {
        "samples_trained": 3,
        "samples_dropped": {"stale": 4, "duplicate": 1, "skipped": 0},
        "tokens_trained": 27,
        "tokens_stale": 59,
        "rollouts_trained": 2,
        "rollouts_wasted": 1,
        "wasted": [A1],
        "first_step": 1,
        "last_step": 2,
    }
