"""The chaos run: the whole loop (model server, recording proxy, stage workers running a real
job whose python agent calls the proxy from a local sandbox, stream processor, ClickHouse sink,
trainer) on a broker of the run's own, with every part SIGKILLed in turn while jobs run, each
started again. Then, end to end: every event on Kafka once (event_id; (rollout_id, seq) gap
free), every event in ClickHouse once after the sink caught up (``events FINAL``), every rollout
closed (a trajectory with a closed status and its reason), every sample record in exactly one
committed step's manifest and no sample_id trained twice, no sandbox or claim left, and the
model server serving the trainer's last policy version. Prints the table component | kills
survived | events lost | duplicated; any finding fails the test.

``ROLLSTREAM_CHAOS_ROUNDS=N``: N rounds, each killing every part once (default 1: the short
form of ``make test``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from _chaos_audit import (
    Audit,
    audit_events,
    audit_samples,
    audit_trajectories,
    table,
    window_of,
)
from _chaos_stack import ADMIN, COMPONENTS, ChaosStack
from _kafka_read import read_topic
from _sink_process import Committed, ends_of
from confluent_kafka import Producer

from rollstream.adapters.topics import ensure_topics
from rollstream.consumers.analytics.client import AnalyticsClient
from rollstream.consumers.training.checkpoint import read_manifests
from rollstream.infra.demo.agent import demo_tasks
from rollstream.infra.demo.service import demo_job, job_prefix
from rollstream.infra.kafka import KafkaBroker
from rollstream.producers.rollouts.jobs import JobSpec, resolve_tasks
from rollstream.producers.rollouts.stages import first_messages
from rollstream.schemas import (
    Codec,
    CommonSettings,
    Event,
    PolicyVersion,
    RolloutFinished,
    RolloutStarted,
    Sample,
    Trajectory,
)

pytestmark = pytest.mark.e2e

GROUP_SIZE = 4
WORK_S = 4.0  # after a job is queued, before the kill: its rollouts are in flight
codec = Codec()


def _job(prefix: str, n: int) -> JobSpec:
    job = demo_job(
        prefix,
        n,
        demo_tasks(2, seed=n),
        group_size=GROUP_SIZE,
        turns=2,
        max_tokens=12,
        run_id=f"{prefix}-run",
    )
    return job.model_copy(update={"attempts": 3})


def _submit(settings: CommonSettings, job: JobSpec) -> set[tuple[str, str, int]]:
    messages = first_messages(job, resolve_tasks(job), now=time.time())
    producer = Producer({**settings.kafka_config(), "acks": "all", "enable.idempotence": True})
    for msg in messages:
        producer.produce(settings.topics().task("init"), key=msg.rollout_id, value=msg.encode())
    assert producer.flush(60) == 0
    return {(job.id, m.task_id, m.sample_index) for m in messages}


def _events(settings: CommonSettings) -> list[tuple[tuple[int, int], Event]]:
    out = []
    for m in read_topic(settings, settings.topics().events, 60):
        out.append(((m.partition(), m.offset()), codec.decode(m.value())))
    return out


def _ended(events: list[tuple[tuple[int, int], Event]]) -> set[tuple[str, str, int]]:
    """(job, task, sample) whose rollout finished not aborted (an aborted one is retried)."""
    started = {
        e.rollout_id: (
            e.body.metadata.get("job_id", ""),
            e.body.task_id,
            int(e.body.metadata.get("sample", "-1")),
        )
        for _, e in events
        if isinstance(e.body, RolloutStarted)
    }
    return {
        started[e.rollout_id]
        for _, e in events
        if isinstance(e.body, RolloutFinished)
        and e.body.status != "aborted"
        and e.rollout_id in started
    }


def _wait(what: str, done: Callable[[], bool], timeout: float, audit: Audit) -> bool:
    """Until ``done()``; on timeout the wait is a finding (the checks still run)."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            audit.findings.append(f"timed out after {timeout:.0f}s waiting for {what}")
            return False
        time.sleep(1.0)
    return True


def _plans_left(
    audit: Audit,
    stack: ChaosStack,
    planned: set[tuple[str, str, int]],
    events: list[tuple[tuple[int, int], Event]],
) -> None:
    """A finding per plan that did not end: its attempts and the last event of each."""
    left = planned - _ended(events)
    last: dict[str, Event] = {}
    for _, e in sorted(events, key=lambda x: x[1].seq):
        last[e.rollout_id] = e
    for job_id, task_id, sample in sorted(left):
        tries = [
            f"{rid[-8:]}: seq {e.seq} {e.kind} {getattr(e.body, 'stage', '')}"
            f"{getattr(e.body, 'phase', '')}".strip()
            for rid, e in last.items()
            if rid.startswith(job_id + "-") and _plan_of(events, rid) == (task_id, sample)
        ]
        at = min((e.ts for rid, e in last.items() if rid.startswith(job_id + "-")), default=0)
        who = window_of(stack.kills, at / 1e6)
        audit.findings.append(
            f"plan not ended [{who}]: {job_id} {task_id} #{sample}: {tries or 'never started'}"
        )
    audit.figures["plans not ended"] = len(left)


def _plan_of(events: list[tuple[tuple[int, int], Event]], rid: str) -> tuple[str, int]:
    for _, e in events:
        if e.rollout_id == rid and isinstance(e.body, RolloutStarted):
            return e.body.task_id, int(e.body.metadata.get("sample", "-1"))
    return "", -1


def test_the_loop_survives_sigkills_of_every_part(
    private_broker: KafkaBroker, chaos_rounds: int, tmp_path: Path
) -> None:
    settings = CommonSettings(
        kafka_bootstrap=private_broker.bootstrap,
        namespace=f"chaos{uuid.uuid4().hex[:6]}",
        home=tmp_path / "home",
    )
    ensure_topics(settings)
    topics = settings.topics()
    stack = ChaosStack(private_broker, settings, tmp_path)
    audit = Audit()
    prefix = job_prefix(settings.namespace)
    t0 = time.monotonic()
    stack.start_all()
    started_s = time.monotonic() - t0
    try:
        planned: set[tuple[str, str, int]] = set()
        n = 0
        for _ in range(chaos_rounds):
            for component in COMPONENTS:
                planned |= _submit(settings, _job(prefix, n))
                n += 1
                time.sleep(WORK_S)
                stack.kill(component)
        planned |= _submit(settings, _job(prefix, n))  # one more on the restarted parts
        chaos_s = time.monotonic() - t0

        _wait(
            "every planned rollout to finish",
            lambda: planned <= _ended(_events(settings)),
            240,
            audit,
        )
        _plans_left(audit, stack, planned, _events(settings))

        def delivered() -> bool:
            status = httpx.get(
                f"{stack.proxy_url}/v1/admin/status",
                headers={"Authorization": f"Bearer {ADMIN}"},
                timeout=10,
            )
            d = status.json()["delivery"]
            return bool(d["sent"] == d["submitted"] and d["queued"] == d["in_flight"] == 0)

        _wait("the proxy's deliveries", delivered, 60, audit)
        events = _events(settings)
        rollouts = {e.rollout_id for _, e in events if isinstance(e.body, RolloutStarted)}

        def trajectories() -> list[Trajectory]:
            recs = read_topic(settings, topics.trajectories, 60)
            return [codec.decode(m.value(), expect=Trajectory) for m in recs]

        _wait(
            "a trajectory of every rollout",
            lambda: rollouts <= {t.rollout_id for t in trajectories()},
            120,
            audit,
        )

        committed = Committed(settings)
        try:
            ends = ends_of(settings, [topics.events])
            _wait(
                "the sink to commit the events topic's end",
                lambda: all(committed(list(ends))[k] >= v for k, v in ends.items()),
                120,
                audit,
            )
        finally:
            committed.close()

        def samples() -> list[tuple[tuple[int, int], Sample]]:
            recs = read_topic(settings, topics.samples, 60)
            return [
                ((m.partition(), m.offset()), codec.decode(m.value(), expect=Sample)) for m in recs
            ]

        def trained_all() -> bool:
            covered = {
                loc
                for _, m in read_manifests(stack.checkpoint_dir)
                for kind in (m.trained, m.stale, m.dlq, m.duplicate, m.skipped)
                for loc in kind
            }
            return {loc for loc, _ in samples()} <= covered

        _wait("the trainer to account for every sample record", trained_all, 120, audit)

        versions = [
            codec.decode(m.value(), expect=PolicyVersion).version
            for m in read_topic(settings, topics.policy, 30)
        ]

        def served_latest() -> bool:
            got = httpx.get(f"{stack.model_url}/v1/policy_version", timeout=10).json()
            return not versions or int(got["policy_version"]) == max(versions)

        _wait("the model server to serve the last policy version", served_latest, 30, audit)
        stack.assert_alive()

        with AnalyticsClient(stack.sink_url) as ch:
            stored = [
                (str(a), str(b), int(c))
                for a, b, c in ch.query("SELECT event_id, rollout_id, seq FROM events FINAL").rows
            ]
            stored_rows = int(ch.query("SELECT count() FROM events").rows[0][0])
        audit_events(audit, stack.kills, events, stored, stored_rows)
        audit_trajectories(audit, events, trajectories())
        audit_samples(audit, samples(), [m for _, m in read_manifests(stack.checkpoint_dir)])
        for m in read_topic(settings, topics.dlq, 30):
            code = dict(m.headers() or []).get("code", b"?").decode()
            key = f"events dead-lettered ({code})"
            audit.figures[key] = audit.figures.get(key, 0) + 1
        leaked = sorted(str(p) for p in stack.sandbox_root.rglob("sbx-*"))
        claims = sorted(str(p) for p in stack.claims_dir.glob("*.json"))
        audit.findings += [f"sandbox left: {p}" for p in leaked]
        audit.findings += [f"claim left: {p}" for p in claims]
        audit.figures.update(
            {
                "rounds": chaos_rounds,
                "jobs": n + 1,
                "planned rollouts": len(planned),
                "policy versions": len(versions),
                "startup s": round(started_s),
                "kills s": round(chaos_s - started_s),
                "total s": round(time.monotonic() - t0),
            }
        )
    finally:
        stack.stop_all()

    report = table(audit, stack.kills, COMPONENTS)
    figures = "\n".join(f"  {k}: {v}" for k, v in audit.figures.items())
    findings = "\n".join(audit.findings[:60]) or "(none)"
    print(f"\n{report}\n\nfigures:\n{figures}\n\nfindings:\n{findings}\nlogs: {tmp_path}")
    assert not audit.findings, f"{report}\n{findings}\n{stack.log_tails()}"
