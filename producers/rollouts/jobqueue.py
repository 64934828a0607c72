"""The rollout service's job queue on Kafka: submit a job, list jobs, cancel one, and ask where
one stands. The I/O shell around stages.py (what a job puts on the topics) and jobstatus.py
(the fold of its records and events)::

    submit_job(settings, job)      -> JobRecord   its INIT messages on <ns>.rollout.tasks.init
                                                  (key: rollout id), then its record on
                                                  <ns>.rollout.jobs (key: job id)
    list_jobs(settings)            -> [JobRecord] every record of <ns>.rollout.jobs, in order
    cancel_job(settings, id, why)  -> JobRecord   a cancelled record on <ns>.rollout.jobs
    job_status(settings, id)       -> JobStatus   its records, and the events of its rollouts
                                                  on <ns>.rollout.events and the trainer's
                                                  ledger on <ns>.trainer.steps, both from
                                                  its submit time

Nothing acknowledged is lost: every write waits for the broker's acknowledgement of every
record (``acks=all``, idempotent producer) and raises ``JobQueueError`` when one is refused or
not acknowledged in time. The INIT messages are written before the job's record, so a job that
is on the log has all its rollouts queued; a submit that fails half-way can be repeated (its
rollout ids are deterministic: a message delivered twice makes no second rollout). A job id
that is on the log already is refused (``JobExists``); two submits of one id at the same moment
can both pass that check, which makes them one job for the same reason.

Every read is bounded: it reads each partition up to the end it had when the read began and
gives up after ``timeout`` seconds (``JobQueueError``). Undecodable records are skipped and
counted in the log, never fatal; so is a missing ``trainer.steps`` topic (no training shown).

Errors::

    ProducerError                  (rollstream.producers.errors)
    ├── JobSpecError               the job's tasks cannot be resolved, or a value is out of
    │                              bounds (a cancel reason too long); .field
    └── JobQueueError              the topics cannot be read or written in time
        ├── JobExists              the job id was submitted already
        └── JobNotFound            no job with this id was submitted
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Final

from confluent_kafka import Consumer, KafkaException, Message, Producer, TopicPartition

from rollstream.adapters.codecs import build_codec
from rollstream.adapters.topics import TopicError, watermarks
from rollstream.producers.errors import JobExists, JobNotFound, JobQueueError, JobSpecError
from rollstream.producers.rollouts.jobs import JobSpec, resolve_tasks
from rollstream.producers.rollouts.jobstatus import JobFold, JobStatus, rollout_pattern
from rollstream.producers.rollouts.stages import (
    MAX_REASON,
    JobRecord,
    first_messages,
    job_record,
)
from rollstream.schemas import (
    CommonSettings,
    DecodeError,
    Event,
    RolloutStarted,
    SchemaError,
    StageEvent,
    decode_step,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "JobExists",
    "JobNotFound",
    "JobQueueError",
    "build_producer",
    "cancel_job",
    "job_status",
    "list_jobs",
    "read_jobs",
    "submit_job",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT: Final = 30.0  # seconds: one read of a topic, or the acknowledgement of a write
CLOCK_SKEW_S: Final = 300.0  # events are read from this long before the job's submit time


def build_producer(settings: CommonSettings) -> Producer:
    """A producer for the job queue: every record acknowledged by every in-sync replica, no
    duplicates from its own retries."""
    return Producer(
        {**settings.kafka_config(), "acks": "all", "enable.idempotence": True, "linger.ms": 5}
    )


def _consumer(settings: CommonSettings) -> Consumer:
    return Consumer(
        {
            **settings.kafka_config(),
            "group.id": f"rollstream-jobs-{uuid.uuid4().hex[:12]}",  # assigned, never joined
            "enable.auto.commit": False,
        }
    )


# --------------------------------------------------------------------------- writing


def _write(producer: Producer, records: list[tuple[str, bytes, bytes]], timeout: float) -> None:
    """Produce ``(topic, key, value)`` records and wait until the broker acknowledged each."""
    failed: list[str] = []

    def delivered(err: Any, msg: Any) -> None:
        if err is not None:
            failed.append(str(err))

    deadline = time.monotonic() + timeout
    for topic, key, value in records:
        while True:
            try:
                producer.produce(topic, value, key, on_delivery=delivered)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                if time.monotonic() > deadline:
                    raise JobQueueError(
                        f"the producer's queue stayed full for {timeout:g} s"
                    ) from None
                producer.poll(0.1)
            except KafkaException as exc:
                raise JobQueueError(f"producing to {topic}: {exc}") from exc
    left = producer.flush(max(0.0, deadline - time.monotonic()))
    if left:
        raise JobQueueError(f"{left} of {len(records)} records not acknowledged in {timeout:g} s")
    if failed:
        raise JobQueueError(f"{len(failed)} of {len(records)} records refused: {failed[0]}")


def submit_job(
    settings: CommonSettings,
    job: JobSpec,
    *,
    producer: Producer | None = None,
    now: float | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> JobRecord:
    """Queue ``job``: its tasks resolved (``JobSpecError`` naming the field when they cannot
    be), one INIT message per task x sample, then its record. ``JobExists`` when the job id is
    on the log already. ``producer``: the caller's (flushed, not closed), else one built here."""
    tasks = resolve_tasks(job)
    now = time.time() if now is None else now
    messages = first_messages(job, tasks, now=now)
    record = job_record(job, tasks, now=now)
    if any(r.type == "submitted" and r.job_id == job.id for r in read_jobs(settings, timeout)):
        raise JobExists(job.id)
    topics = settings.topics()
    out = producer if producer is not None else build_producer(settings)
    init = topics.task("init")
    _write(out, [(init, m.rollout_id.encode(), m.encode()) for m in messages], timeout)
    _write(out, [(topics.jobs, job.id.encode(), record.encode())], timeout)
    log.info("job %s: %d rollouts queued on %s", job.id, len(messages), init)
    return record


def cancel_job(
    settings: CommonSettings,
    job_id: str,
    reason: str = "",
    *,
    producer: Producer | None = None,
    now: float | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> JobRecord:
    """Write the job's cancelled record (the workers stop taking its messages). A job cancelled
    already keeps its first record, which is returned; ``JobNotFound`` for an unknown id."""
    if len(reason) > MAX_REASON:
        raise JobSpecError(f"longer than {MAX_REASON} characters", field="reason")
    records = [r for r in read_jobs(settings, timeout) if r.job_id == job_id]
    if not any(r.type == "submitted" for r in records):
        raise JobNotFound(job_id)
    earlier = [r for r in records if r.type == "cancelled"]
    if earlier:
        return earlier[0]
    record = JobRecord(
        type="cancelled", job_id=job_id, at=time.time() if now is None else now, reason=reason
    )
    out = producer if producer is not None else build_producer(settings)
    _write(out, [(settings.topics().jobs, job_id.encode(), record.encode())], timeout)
    return record


# --------------------------------------------------------------------------- reading


def _read(
    consumer: Consumer,
    topic: str,
    deadline: float,
    *,
    since_ms: int | None = None,
    missing_ok: bool = False,
) -> Iterator[Message]:
    """Every message of ``topic`` (from ``since_ms``, a timestamp, else the beginning) up to
    the end each partition had when the read began; none when ``topic`` does not exist and
    ``missing_ok``."""

    def left() -> float:
        return max(0.1, deadline - time.monotonic())

    try:
        md = consumer.list_topics(topic, timeout=left())
    except KafkaException as exc:
        raise JobQueueError(f"cannot list {topic}: {exc}") from exc
    meta = md.topics.get(topic)
    if meta is None or meta.error is not None:
        if missing_ok:
            log.warning("topic %s does not exist: nothing read from it", topic)
            return
        raise JobQueueError(f"topic {topic} does not exist (`rollstream topics` creates it)")
    try:
        ends = {p: watermarks(consumer, TopicPartition(topic, p), left()) for p in meta.partitions}
        starts = {p: lo for p, (lo, _) in ends.items()}
        if since_ms is not None and ends:
            asked = [TopicPartition(topic, p, since_ms) for p in ends]
            for tp in consumer.offsets_for_times(asked, timeout=left()):
                # -1: no message at or after that time: nothing to read there
                starts[tp.partition] = tp.offset if tp.offset >= 0 else ends[tp.partition][1]
    except (KafkaException, TopicError) as exc:
        raise JobQueueError(f"cannot find the offsets of {topic}: {exc}") from exc
    todo = {p: hi for p, (_, hi) in ends.items() if starts[p] < hi}
    if not todo:
        return
    consumer.assign([TopicPartition(topic, p, starts[p]) for p in todo])
    try:
        while todo:
            if time.monotonic() > deadline:
                raise JobQueueError(f"could not read {topic} to its end in time: {todo}")
            for msg in consumer.consume(1000, 0.5):
                p, offset = msg.partition(), msg.offset()
                if msg.error() is not None or p is None or offset is None or p not in todo:
                    continue
                if offset < todo[p]:
                    yield msg
                if offset >= todo[p] - 1:
                    del todo[p]
    finally:
        consumer.unassign()


def _reading(settings: CommonSettings, use: Callable[[Consumer], Any]) -> Any:
    consumer = _consumer(settings)
    try:
        return use(consumer)
    finally:
        consumer.close()


def read_jobs(settings: CommonSettings, timeout: float = DEFAULT_TIMEOUT) -> list[JobRecord]:
    """Every record of ``<ns>.rollout.jobs``, in log order (undecodable ones skipped)."""
    deadline = time.monotonic() + timeout
    topic = settings.topics().jobs

    def use(consumer: Consumer) -> list[JobRecord]:
        out, bad = [], 0
        for msg in _read(consumer, topic, deadline):
            try:
                out.append(JobRecord.decode(msg.value() or b""))
            except ValueError:
                bad += 1
        if bad:
            log.warning("%s: %d undecodable records skipped", topic, bad)
        return out

    records: list[JobRecord] = _reading(settings, use)
    return records


def list_jobs(settings: CommonSettings, timeout: float = DEFAULT_TIMEOUT) -> list[JobRecord]:
    """Every job record (submitted and cancelled), in log order; jobstatus.job_rows makes one
    row per job of them."""
    return read_jobs(settings, timeout)


def job_status(
    settings: CommonSettings, job_id: str, *, timeout: float = DEFAULT_TIMEOUT
) -> JobStatus:
    """Where ``job_id`` stands: its records and the events of its rollouts, from its submit
    time (less ``CLOCK_SKEW_S``) to the end of ``<ns>.rollout.events`` as it was when the read
    began, then the trainer's ledger over the same time (entries of the rollouts read), folded
    (jobstatus.py). ``JobNotFound`` for an unknown id."""
    deadline = time.monotonic() + timeout
    records = [r for r in read_jobs(settings, timeout) if r.job_id == job_id]
    submitted = [r for r in records if r.type == "submitted"]
    if not submitted:
        raise JobNotFound(job_id)
    fold = JobFold(job_id).feed(records)
    since_ms = int((min(r.at for r in submitted) - CLOCK_SKEW_S) * 1000)
    codec = build_codec(settings)
    ours = rollout_pattern(job_id)
    topic = settings.topics().events

    def use(consumer: Consumer) -> None:
        members: set[str] = set()  # rollouts of the job whose ids are not the plan's
        others: set[str] = set()  # rollouts seen to be another's: not decoded again
        bad = 0
        for msg in _read(consumer, topic, deadline, since_ms=since_ms):
            key = (msg.key() or b"").decode(errors="replace")
            if key in others:
                continue
            try:
                event = codec.decode(msg.value() or b"")
            except DecodeError:
                bad += 1
                continue
            if not isinstance(event, Event):
                continue
            rid = event.rollout_id
            if ours.fullmatch(rid) is None and rid not in members:
                if not _names_job(event, job_id):
                    if isinstance(event.body, RolloutStarted):
                        others.add(rid)  # its first event says it is another job's
                    continue
                members.add(rid)
            fold.feed([event])
        if bad:
            log.warning("%s: %d undecodable records skipped", topic, bad)

    _reading(settings, use)
    _reading(settings, lambda c: _feed_ledger(c, settings, fold, since_ms, deadline))
    return fold.status()


def _feed_ledger(
    consumer: Consumer, settings: CommonSettings, fold: JobFold, since_ms: int, deadline: float
) -> None:
    """Fold the ledger records of ``<ns>.trainer.steps`` from ``since_ms``, each cut to the
    entries of rollouts the fold holds (the others cannot be the job's)."""
    topic, rollouts, bad = settings.topics().trainer_steps, fold.state.rollouts, 0
    for msg in _read(consumer, topic, deadline, since_ms=since_ms, missing_ok=True):
        try:
            record = decode_step(msg.value() or b"")
        except SchemaError:
            bad += 1
            continue
        ours = [e for e in record.samples if e.rollout_id in rollouts]
        if ours:
            fold.feed([record.model_copy(update={"samples": ours})])
    if bad:
        log.warning("%s: %d undecodable records skipped", topic, bad)


def _names_job(event: Event, job_id: str) -> bool:
    body = event.body
    if isinstance(body, RolloutStarted):
        return body.metadata.get("job_id") == job_id
    return isinstance(body, StageEvent) and body.job_id == job_id
