"""``rollstream tail``: print decoded records of a topic, one per line, following until a limit.

Undecodable records are printed as an error object (reason + raw bytes in hex), never fatal.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, TopicPartition
from pydantic import BaseModel

from rollstream.adapters.codecs import build_codec
from rollstream.schemas import Codec, CommonSettings, DecodeError, Event
from rollstream.schemas.control import decode_decision, decode_report
from rollstream.schemas.errors import SchemaError
from rollstream.schemas.steps import decode_step
from rollstream.schemas.topics import (
    CONTROL_DECISIONS,
    CONTROL_WORKERS,
    DLQ,
    EVENTS,
    POLICY,
    SAMPLES,
    TRAINER_STEPS,
    TRAJECTORIES,
)

__all__ = ["TailOptions", "format_record", "records", "resolve_topic", "run"]

_ALIASES = {
    "events": EVENTS,
    "dlq": DLQ,
    "trajectories": TRAJECTORIES,
    "samples": SAMPLES,
    "policy": POLICY,
    "policy.versions": POLICY,
    "decisions": CONTROL_DECISIONS,
    "workers": CONTROL_WORKERS,
    "steps": TRAINER_STEPS,
    TRAINER_STEPS: TRAINER_STEPS,
    CONTROL_DECISIONS: CONTROL_DECISIONS,
    CONTROL_WORKERS: CONTROL_WORKERS,
    EVENTS: EVENTS,
    DLQ: DLQ,
    TRAJECTORIES: TRAJECTORIES,
    SAMPLES: SAMPLES,
}


def resolve_topic(settings: CommonSettings, topic: str) -> str:
    """Short names (``events``, ``samples``) and contract names get the namespace prefix;
    anything else is taken literally."""
    base = _ALIASES.get(topic)
    return settings.topics().name(base) if base else topic


@dataclass
class TailOptions:
    topic: str
    from_beginning: bool = False
    limit: int | None = None
    fmt: str = "json"
    idle_timeout: float | None = None  # stop after this many seconds without a record


def records(settings: CommonSettings, opts: TailOptions) -> Iterator[dict[str, Any]]:
    """Yield decoded records as JSON-able dicts (with kafka coordinates under ``_kafka``)."""
    topic = resolve_topic(settings, opts.topic)
    codec = build_codec(settings)
    consumer = Consumer(
        {
            **settings.kafka_config(),
            "group.id": f"rollstream-tail-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest" if opts.from_beginning else "latest",
            "session.timeout.ms": 6000,
        }
    )
    start = OFFSET_BEGINNING if opts.from_beginning else OFFSET_END
    md = consumer.list_topics(topic, timeout=10)
    if topic not in md.topics or md.topics[topic].error is not None:
        consumer.close()
        raise SystemExit(f"topic {topic!r} does not exist (try `rollstream topics`)")
    consumer.assign([TopicPartition(topic, p, start) for p in md.topics[topic].partitions])
    seen = 0
    last = time.monotonic()
    try:
        while opts.limit is None or seen < opts.limit:
            msg = consumer.poll(0.5)
            if msg is None:
                if opts.idle_timeout is not None and time.monotonic() - last > opts.idle_timeout:
                    return
                continue
            if msg.error():
                continue
            last = time.monotonic()
            seen += 1
            yield decode_message(codec, msg)
    finally:
        consumer.close()


def decode_message(codec: Codec, msg: Any) -> dict[str, Any]:
    coords = {
        "topic": msg.topic(),
        "partition": msg.partition(),
        "offset": msg.offset(),
        "key": msg.key().decode(errors="replace") if msg.key() else None,
    }
    headers = {k: (v.decode(errors="replace") if v else None) for k, v in (msg.headers() or [])}
    if headers:
        coords["headers"] = headers
    topic = msg.topic() or ""
    json_topics: tuple[tuple[str, Callable[[bytes], BaseModel]], ...] = (
        (CONTROL_DECISIONS, decode_decision),
        (CONTROL_WORKERS, decode_report),
        (TRAINER_STEPS, decode_step),
    )
    for base, decode in json_topics:
        if topic.endswith(base):  # JSON records (schemas/control.py, schemas/steps.py)
            try:
                control = decode(msg.value() or b"")
            except SchemaError as exc:
                return {"_kafka": coords, "error": str(exc), "raw_hex": msg.value()[:256].hex()}
            return {"type": type(control).__name__, **control.model_dump(), "_kafka": coords}
    try:
        record = codec.decode(msg.value())
    except DecodeError as exc:
        return {"_kafka": coords, "error": exc.reason, "raw_hex": exc.raw[:256].hex()}
    out = record.to_json()
    if not isinstance(record, Event):
        out = {"type": type(record).__name__, **out}
    out["_kafka"] = coords
    return out


def format_record(rec: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rec, separators=(",", ":"))
    k = rec.get("_kafka", {})
    if "error" in rec:
        return f"{k.get('partition')}:{k.get('offset')} UNDECODABLE {rec['error']}"
    if "body" in rec:
        body = rec["body"]
        detail = ", ".join(
            f"{key}={len(v)} tokens" if isinstance(v, list) else f"{key}={v}"
            for key, v in body.items()
            if v not in (None, "", {}, [])
        )
        return f"{rec['rollout_id']} #{rec['seq']:<4} {rec['type']:<16} {detail}"[:240]
    return json.dumps({key: v for key, v in rec.items() if not isinstance(v, list)})[:240]


def run(settings: CommonSettings, opts: TailOptions, out: TextIO = sys.stdout) -> int:
    n = 0
    for rec in records(settings, opts):
        out.write(format_record(rec, opts.fmt) + "\n")
        out.flush()
        n += 1
    return n
