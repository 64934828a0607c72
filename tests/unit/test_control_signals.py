"""The control records (schemas/control.py) and the controller's arithmetic (signals.py):
what a decision lets a worker start, how reports and offsets become Signals, how new starts
are split between workers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollstream.consumers.control.controller import TRAINER_GROUP as CONTROL_TRAINER_GROUP
from rollstream.consumers.control.policy import PolicyConfig, decide
from rollstream.consumers.control.signals import SignalBook, split, to_capacity
from rollstream.schemas import PolicyVersion
from rollstream.schemas.control import (
    CapacityDecision,
    StageLoad,
    WorkerReport,
    decode_decision,
    decode_report,
)
from rollstream.schemas.errors import SchemaError


def _report(
    worker: str, ts: float, *, run: tuple[int, int, int] = (0, 0, 4), **kw: object
) -> WorkerReport:
    held, started, concurrency = run
    return WorkerReport(
        worker=worker,
        ts=ts,
        period_s=1.0,
        stages={
            "run": StageLoad(
                in_flight=held, limit=concurrency, concurrency=concurrency, started=started
            )
        },
        **kw,  # type: ignore[arg-type]
    )


def test_the_trainer_group_is_the_trainers() -> None:
    from rollstream.consumers.training.settings import TRAINER_GROUP

    assert CONTROL_TRAINER_GROUP == TRAINER_GROUP


def test_decision_round_trip_and_budget() -> None:
    d = CapacityDecision(ts=100.0, ttl_s=10.0, run_slots=3, admit=1, per_worker={"w1": 5})
    assert decode_decision(d.encode()) == d
    assert d.may_start("w1", 4, now=101.0)
    assert not d.may_start("w1", 5, now=101.0)  # budget spent
    assert not d.may_start("w2", 0, now=101.0)  # not named: no budget
    assert d.may_start("w2", 99, now=111.5)  # stale: the worker runs at its own concurrency
    open_ = d.model_copy(update={"limited": False})
    assert open_.may_start("w2", 10**6, now=101.0)


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        (b'"run_slots": -1', "run_slots"),
        (b'"ttl_s": 0', "ttl_s"),
        (b'"per_worker": {"bad id!": 1}', "per_worker"),
        (b'"inference_share": 1.5', "inference_share"),
        (b'"extra": 1', "extra"),
    ],
)
def test_a_bad_decision_names_its_field(patch: bytes, field: str) -> None:
    base = b'{"ts": 1.0, "ttl_s": 5, "run_slots": 1, "admit": 1, ' + patch + b"}"
    with pytest.raises(SchemaError, match=field):
        decode_decision(base)


def test_a_report_round_trips_and_refuses_oversize() -> None:
    rep = _report("host-1", 5.0, run=(1, 3, 4))
    assert decode_report(rep.encode()) == rep
    with pytest.raises(SchemaError, match="bytes"):
        decode_report(b" " * 300_000)


def test_in_flight_counts_rollouts_not_closed_and_workers_die() -> None:
    book = SignalBook(max_staleness=1)
    book.offsets(samples_total=10, closed_total=10, samples_waiting=0, run_lag=5)
    book.report(_report("a", 100.0, run=(0, 2, 4)))  # first sight: its counters are the base
    book.report(_report("a", 101.0, run=(2, 6, 4)))  # 4 more started since
    book.report(_report("b", 101.0, run=(1, 1, 2)))
    book.offsets(samples_total=13, closed_total=11, samples_waiting=3, run_lag=5)
    s = book.signals(now=101.5, inference_share=1.0)
    assert s.rollouts_in_flight == 4 - 1  # 4 started by a since first sight, 1 closed since
    assert s.samples_per_rollout == 3.0  # 3 samples from 1 closed rollout
    assert s.run_slots_max == 6 and s.rollouts_queued == 5 - 3
    assert s.samples_waiting == 3
    # b stops reporting: dead after 3 periods, its slots no longer count
    book.report(_report("a", 110.0, run=(2, 6, 4)))
    assert book.signals(now=110.0, inference_share=1.0).run_slots_max == 4


def test_a_restarted_worker_keeps_what_it_started_before() -> None:
    book = SignalBook(max_staleness=1)
    book.offsets(0, 0, 0, 0)
    book.report(_report("a", 1.0, run=(0, 0, 4)))
    book.report(_report("a", 2.0, run=(3, 5, 4)))
    book.report(_report("a", 3.0, run=(1, 1, 4)))  # counters went down: a restart
    assert book.signals(now=3.0, inference_share=1.0).rollouts_in_flight == 6


def test_samples_per_step_and_step_time_come_from_the_versions() -> None:
    book = SignalBook(max_staleness=2)
    book.offsets(0, 0, 0, 0)
    for v in (1, 2, 3):
        book.version(PolicyVersion(v, f"file:///{v}", v, v * 4_000_000, 8 * v))
    s = book.signals(now=1.0, inference_share=1.0)
    assert (s.trained_version, s.samples_per_step, s.step_time_s) == (3, 8.0, 4.0)


@given(
    admit=st.integers(0, 50),
    loads=st.lists(
        st.tuples(st.integers(0, 8), st.integers(0, 100), st.integers(1, 8)), max_size=6
    ),
)
def test_split_never_grants_more_than_admit_nor_past_free_slots(
    admit: int, loads: list[tuple[int, int, int]]
) -> None:
    live = [
        _report(f"w{i}", 1.0, run=(min(held, conc), started, conc))
        for i, (held, started, conc) in enumerate(loads)
    ]
    budgets = split(admit, live)
    grants = {r.worker: budgets[r.worker] - r.stages["run"].started for r in live}
    free = {r.worker: r.stages["run"].concurrency - r.stages["run"].in_flight for r in live}
    assert all(0 <= grants[w] <= free[w] for w in grants)
    assert sum(grants.values()) == min(admit, sum(free.values()))


def test_a_decision_on_the_log_carries_budgets_and_signals() -> None:
    book = SignalBook(max_staleness=0)
    book.offsets(0, 0, 0, 0)
    book.version(PolicyVersion(1, "file:///1", 1, 0, 4))
    book.version(PolicyVersion(2, "file:///2", 2, 1_000_000, 8))
    live = [_report("a", 1.0, run=(1, 1, 4))]
    for r in live:
        book.report(r)
    signals = book.signals(now=1.0, inference_share=0.5)
    decision = decide(signals, PolicyConfig(max_staleness=0), None)
    record = to_capacity(decision, signals, live, now=1.0, ttl_s=5.0)
    assert record.admit == 3  # a step trains 4, 1 in flight
    assert record.per_worker == {"a": 1 + 3}
    assert record.signals["samples_per_step"] == 4.0
    unlimited = to_capacity(decision, signals, live, now=1.0, ttl_s=5.0, limited=False)
    assert not unlimited.limited and unlimited.per_worker == {}


class _Msg:
    """A consumed message as `rollstream tail` sees it (the I/O edge)."""

    def __init__(self, topic: str, value: bytes) -> None:
        self._topic, self._value = topic, value

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 7

    def key(self) -> bytes:
        return b"capacity"

    def value(self) -> bytes:
        return self._value

    def headers(self) -> None:
        return None


def test_tail_shows_control_records_as_json() -> None:
    from rollstream.infra.tail import decode_message, resolve_topic
    from rollstream.schemas import Codec, CommonSettings

    d = CapacityDecision(ts=1.0, ttl_s=5.0, run_slots=2, admit=1, reason="staleness")
    out = decode_message(Codec(), _Msg("ns.control.decisions", d.encode()))
    assert out["type"] == "CapacityDecision" and out["run_slots"] == 2
    assert out["_kafka"]["offset"] == 7
    bad = decode_message(Codec(), _Msg("ns.control.decisions", b'{"ts": -1}'))
    assert "CapacityDecision" in bad["error"]
    assert resolve_topic(CommonSettings(namespace="ns"), "decisions") == "ns.control.decisions"


def test_tail_shows_the_trainer_ledger_as_json() -> None:
    from rollstream.infra.tail import decode_message, resolve_topic
    from rollstream.schemas import Codec, CommonSettings
    from rollstream.schemas.steps import StepSample, step_records

    entry = StepSample(verdict="stale", partition=0, offset=3, sample_id="s", rollout_id="r")
    (record,) = step_records(3, policy_version=3, ts=1.0, topic="ns.samples", samples=[entry])
    out = decode_message(Codec(), _Msg("ns.trainer.steps", record.encode()))
    assert out["type"] == "TrainStep" and out["samples"][0]["verdict"] == "stale"
    bad = decode_message(Codec(), _Msg("ns.trainer.steps", b"{}"))
    assert "error" in bad
    assert resolve_topic(CommonSettings(namespace="ns"), "steps") == "ns.trainer.steps"
