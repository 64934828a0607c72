"""The trainer's ledger records (schemas/steps.py): a round trip, every bound refused with the
field named, a worst-case step split into records within MAX_STEP_BYTES and MAX_PART_SAMPLES in
order, entries made from samples (ids out of bounds left empty, dead letters with coordinates
only), and the Verdicts fold the same however its records are ordered or repeated."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from rollstream.schemas import (
    Sample,
    SchemaError,
    StepFact,
    StepSample,
    Topics,
    TrainStep,
    Verdicts,
    decode_step,
    step_records,
)
from rollstream.schemas.steps import (
    _EMPTY_BYTES,
    MAX_ID_CHARS,
    MAX_PART_SAMPLES,
    MAX_PARTS,
    MAX_STEP_BYTES,
)

TOPIC = "ns.samples"


def sample(sid: str = "s1", rid: str = "r1", version: int = 3, tokens: int = 24) -> Sample:
    return Sample(
        sample_id=sid,
        rollout_id=rid,
        group_id="g1",
        task_id="t",
        input_ids=np.arange(tokens, dtype=np.uint32),
        loss_mask=np.ones(tokens, np.uint8),
        behaviour_logprobs=np.zeros(tokens, np.float32),
        advantage=0.5,
        reward=1.0,
        policy_version=version,
    )


def record(step: int, *entries: StepSample, topic: str = TOPIC) -> TrainStep:
    return TrainStep(step=step, policy_version=step, ts=1.0, topic=topic, samples=list(entries))


def test_a_record_round_trips_and_its_topic_is_kept_forever() -> None:
    rec = record(
        7,
        StepSample.of("trained", 0, 12, sample()),
        StepSample.of("stale", 1, 3, sample("s2", "r2", version=0)),
        StepSample.of("dlq", 1, 4, None),
    )
    again = decode_step(rec.encode())
    assert again == rec and rec.key == b"7"
    assert [(e.verdict, e.sample_id, e.rollout_id) for e in again.samples] == [
        ("trained", "s1", "r1"), ("stale", "s2", "r2"), ("dlq", "", ""),
    ]  # fmt: skip
    assert (again.samples[1].policy_version, again.samples[1].tokens) == (0, 24)
    assert again.samples[2].policy_version is None
    (spec,) = [s for s in Topics("ns").specs() if s.name == "ns.trainer.steps"]
    assert Topics("ns").trainer_steps == "ns.trainer.steps"
    assert (spec.partitions, spec.cleanup_policy, spec.retention_ms) == (1, "delete", -1)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"step": 0}, "step"),
        ({"step": 2**53}, "step"),
        ({"ts": 1e12}, "ts"),
        ({"topic": "a b"}, "topic"),
        ({"topic": "x" * 250}, "topic"),
        ({"part": 2, "parts": 2}, "(record)"),
        ({"parts": MAX_PARTS + 1}, "parts"),
        ({"extra": 1}, "extra"),
        ({"samples": [{"verdict": "lost", "partition": 0, "offset": 0}]}, "samples.0.verdict"),
        ({"samples": [{"verdict": "stale", "partition": -1, "offset": 0}]}, "samples.0.partition"),
        (
            {"samples": [{"verdict": "stale", "partition": 0, "offset": 0, "sample_id": "a\nb"}]},
            "samples.0.sample_id",
        ),
        (
            {
                "samples": [
                    {
                        "verdict": "stale",
                        "partition": 0,
                        "offset": 0,
                        "rollout_id": "r" * (MAX_ID_CHARS + 1),
                    }
                ]
            },
            "samples.0.rollout_id",
        ),
        (
            {
                "samples": [
                    {"verdict": "dlq", "partition": 0, "offset": i}
                    for i in range(MAX_PART_SAMPLES + 1)
                ]
            },
            "samples",
        ),
    ],
)
def test_a_record_out_of_bounds_is_refused_naming_the_field(
    change: dict[str, object], field: str
) -> None:
    data = {"step": 1, "policy_version": 1, "ts": 1.0, "topic": TOPIC, **change}
    with pytest.raises(SchemaError, match=re.escape(f"TrainStep.{field}:")):
        decode_step(json.dumps(data).encode())


def test_a_record_past_max_bytes_is_refused_before_parsing() -> None:
    with pytest.raises(SchemaError, match="bytes"):
        decode_step(b" " * (MAX_STEP_BYTES + 1))


def test_ids_out_of_bounds_are_left_empty_never_cut() -> None:
    long = StepSample.of("stale", 0, 1, sample("s" * (MAX_ID_CHARS + 1), "r\x00x"))
    assert (long.sample_id, long.rollout_id, long.group_id) == ("", "", "g1")
    fits = StepSample.of("trained", 0, 2, sample("s" * MAX_ID_CHARS, "r-ü"))
    assert (fits.sample_id, fits.rollout_id) == ("s" * MAX_ID_CHARS, "r-ü")


def test_the_worst_case_step_is_split_within_the_bounds_in_order() -> None:
    widest = "\U0001f600" * MAX_ID_CHARS  # 4 bytes a character in UTF-8
    quoted = '"' * MAX_ID_CHARS  # escaped: 2 bytes a character
    entries = [
        StepSample(
            verdict="duplicate", partition=2**31 - 1, offset=2**63 - 1 - i,
            sample_id=widest, rollout_id=quoted, group_id=widest,
            policy_version=2**53 - 1, tokens=2**32,
        )
        for i in range(2500)
    ]  # fmt: skip
    records = step_records(
        2**53 - 1, policy_version=2**53 - 1, ts=99_999_999_999.123, topic="t" * 249, samples=entries
    )
    assert len(records) > 2
    for i, rec in enumerate(records):
        data = rec.encode()
        assert len(data) <= MAX_STEP_BYTES
        assert (rec.part, rec.parts) == (i, len(records))
        assert decode_step(data) == rec
    assert [e for r in records for e in r.samples] == entries
    empty = record(2**53 - 1, topic="t" * 249).model_copy(
        update={
            "policy_version": 2**53 - 1,
            "ts": 99_999_999_999.123,
            "part": MAX_PARTS - 2,
            "parts": MAX_PARTS - 1,
        }
    )
    assert len(empty.encode()) <= _EMPTY_BYTES


def test_a_step_of_small_samples_is_cut_by_count_and_an_empty_step_is_one_record() -> None:
    entries = [StepSample.of("trained", 0, i, sample(f"s{i}", f"r{i}")) for i in range(2500)]
    records = step_records(3, policy_version=3, ts=1.0, topic=TOPIC, samples=entries)
    assert [len(r.samples) for r in records] == [MAX_PART_SAMPLES, MAX_PART_SAMPLES, 500]
    [only] = step_records(4, policy_version=4, ts=1.0, topic=TOPIC, samples=[])
    assert (only.part, only.parts, only.samples) == (0, 1, [])


def test_verdicts_are_order_free_and_idempotent_and_the_later_step_wins() -> None:
    records = [
        record(1, StepSample.of("trained", 0, 0, sample("a", "r1")),
               StepSample.of("dlq", 0, 1, None)),
        record(2, StepSample.of("stale", 0, 2, sample("b", "r1")),
               StepSample.of("stale", 0, 3, sample("c", "r2"))),
        record(3, StepSample.of("duplicate", 0, 4, sample("a", "r1"))),
        # the same record of the samples topic decided again by a later run's step 5
        record(5, StepSample.of("trained", 0, 3, sample("c", "r2"))),
        # another samples topic: other coordinates
        record(1, StepSample.of("stale", 0, 0, sample("z", "r1")), topic="other.samples"),
    ]  # fmt: skip
    expected = {
        "r1": [StepFact(1, "trained", "a", 24), StepFact(2, "stale", "b", 24),
               StepFact(3, "duplicate", "a", 24), StepFact(1, "stale", "z", 24)],
        "r2": [StepFact(5, "trained", "c", 24)],
    }  # fmt: skip
    rng = random.Random(7)
    for _ in range(20):
        items = records + rng.sample(records, 3)
        rng.shuffle(items)
        v = Verdicts()
        for rec in items:
            v.add(rec)
        assert {rid: v.of(rid) for rid in v.facts} == expected
    assert Verdicts().of("r1") == []
