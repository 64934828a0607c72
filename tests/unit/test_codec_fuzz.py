"""Hypothesis over the codec with random and mutated bytes, beside test_codec.py's mangled
bodies (cut, overwrite, insert after the header): any bytes at all, any body behind a real
header, mutations anywhere (the header too) and stacked, two records spliced, registry framing
with an in-memory registry (the I/O edge). Every record decodes or raises the codec's
DecodeError, never another exception; and what the stream processors do with such a record is
a dead-letter record naming the reason (the trajectory builder and the group aggregator), the
stage never raises."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollstream.schemas import (
    RECORD_TYPES,
    Codec,
    DecodeError,
    Event,
    LlmCall,
    RegistryError,
    Reward,
    RolloutFinished,
    RolloutStarted,
    ToolCall,
    Trajectory,
    TrajectoryNode,
    Usage,
)
from rollstream.schemas.dlq import CODE_UNDECODABLE, CODE_WRONG_KEY, read_headers
from rollstream.streams.aggregation import GroupBook
from rollstream.streams.books import RolloutBook, Sink
from rollstream.streams.core import BuilderConfig, GroupConfig

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
CODEC = Codec()
TYPES = tuple(RECORD_TYPES.values())


def _ids(*values: int) -> np.ndarray:
    return np.array(values, "<u4")


SEEDS: list[Any] = [
    Event("e0", "r", 0, 1, RolloutStarted("task", "g", metadata={"k": "v"})),
    Event(
        "e1",
        "r",
        1,
        2,
        LlmCall(
            call_id="c1",
            parent_call_id=None,
            prefix_len=0,
            prompt_delta=_ids(1, 2, 3),
            completion_ids=_ids(4, 5),
            completion_logprobs=np.array([-0.5, -1.0], "<f4"),
            usage=Usage(3, 2, 5),
        ),
    ),
    Event("e2", "r", 2, 3, ToolCall("t1", "ls", "{}", "out")),
    Event("e3", "r", 3, 4, Reward(1.0)),
    Event("e4", "r", 4, 5, RolloutFinished("completed")),
    Trajectory(
        rollout_id="r",
        task_id="task",
        group_id="g",
        status="completed",
        score=1.0,
        nodes=[
            TrajectoryNode(
                call_id="c1",
                parent_call_id=None,
                prefix_len=0,
                prompt_tokens=_ids(1, 2),
                completion_ids=_ids(3),
                completion_logprobs=np.array([-0.1], "<f4"),
            )
        ],
    ),
]
ENCODED = [CODEC.encode(r) for r in SEEDS]
HEADERS = sorted({e[:10] for e in ENCODED})


def _decodes_or_refuses(codec: Codec, raw: bytes) -> Any:
    """The codec's answer: a record of a known type, or None after a DecodeError carrying the
    bytes and a reason. Any other exception fails the test."""
    try:
        record = codec.decode(raw)
    except DecodeError as exc:
        assert exc.reason
        assert exc.raw in (raw, b"")
        return None
    assert isinstance(record, TYPES)
    return record


@FUZZ
@given(st.binary(max_size=256))
def test_any_bytes_decode_or_are_a_decode_error(raw: bytes) -> None:
    _decodes_or_refuses(CODEC, raw)
    with contextlib.suppress(DecodeError):
        CODEC.decode_dict(raw)


@FUZZ
@given(st.sampled_from(HEADERS), st.binary(max_size=200))
def test_any_body_behind_a_real_header_decodes_or_is_a_decode_error(
    header: bytes, body: bytes
) -> None:
    _decodes_or_refuses(CODEC, header + body)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """One of the seed records with 1 to 6 mutations anywhere, header included: bit flips,
    bytes set, ranges deleted, duplicated or inserted, a cut."""
    data = bytearray(draw(st.sampled_from(ENCODED)))
    for _ in range(draw(st.integers(1, 6))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        how = draw(st.sampled_from(["flip", "set", "delete", "duplicate", "insert", "cut"]))
        if how == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif how == "set":
            data[at] = draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF]))
        elif how == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif how == "duplicate":
            data[at:at] = data[at : at + draw(st.integers(1, 8))]
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at:]
    return bytes(data)


@FUZZ
@given(mutated())
def test_mutated_records_decode_or_are_a_decode_error(raw: bytes) -> None:
    _decodes_or_refuses(CODEC, raw)


@FUZZ
@given(st.sampled_from(ENCODED), st.sampled_from(ENCODED), st.data())
def test_two_records_spliced_decode_or_are_a_decode_error(
    a: bytes, b: bytes, data: st.DataObject
) -> None:
    cut_a = data.draw(st.integers(0, len(a)))
    cut_b = data.draw(st.integers(0, len(b)))
    _decodes_or_refuses(CODEC, a[:cut_a] + b[cut_b:])


class _MemoryRegistry:
    """A schema registry in memory (the I/O edge): ids by schema; ids 97 and 99 answer
    schemas that are no Avro record, id 98 fails as a registry does."""

    def __init__(self) -> None:
        self.schemas: dict[int, dict[str, Any]] = {99: {"type": "string"}, 97: {"type": "record"}}

    def register(self, subject: str, schema_json: dict[str, Any]) -> int:
        for schema_id, known in self.schemas.items():
            if known == schema_json:
                return schema_id
        self.schemas[len(self.schemas) + 1] = schema_json
        return len(self.schemas)

    def get(self, schema_id: int) -> dict[str, Any]:
        if schema_id == 98:
            raise RegistryError("the registry is down")
        if schema_id not in self.schemas:
            raise RegistryError(f"schema {schema_id} not found")
        return self.schemas[schema_id]


REGISTRY_CODEC = Codec(registry=_MemoryRegistry())
FRAMED = [REGISTRY_CODEC.encode(r) for r in SEEDS]


def test_registry_framed_seeds_decode() -> None:
    assert [REGISTRY_CODEC.decode(f) for f in FRAMED] == SEEDS


@FUZZ
@given(st.sampled_from(FRAMED), st.integers(0, 2**32 - 1), st.binary(max_size=64), st.data())
def test_registry_framed_bytes_decode_or_are_a_decode_error(
    framed: bytes, schema_id: int, body: bytes, data: st.DataObject
) -> None:
    """Any schema id (unknown, not a record schema, the registry failing), any body, a cut."""
    _decodes_or_refuses(REGISTRY_CODEC, b"\x00" + schema_id.to_bytes(4, "big") + body)
    _decodes_or_refuses(REGISTRY_CODEC, framed[:5] + body)
    _decodes_or_refuses(REGISTRY_CODEC, framed[: data.draw(st.integers(0, len(framed)))])


@FUZZ
@given(mutated() | st.binary(max_size=128))
def test_the_builder_sends_what_does_not_decode_to_the_dlq(raw: bytes) -> None:
    book = RolloutBook(BuilderConfig(), CODEC, source_topic="events", processor="fuzz")
    step = book.on_record(0, 7, b"r", raw, 1_000_000)
    record = _decodes_or_refuses(CODEC, raw)
    if isinstance(record, Event) and record.rollout_id == "r":
        assert all(o.sink != Sink.DLQ or o.value == raw for o in step.sends)
        return
    assert len(step.sends) == 1 and step.writes == []
    out = step.sends[0]
    assert (out.sink, out.key, out.value) == (Sink.DLQ, b"r", raw)
    headers = read_headers(out.headers)
    assert headers["reason"] and headers["code"] in (CODE_UNDECODABLE, CODE_WRONG_KEY)
    assert (headers["original_offset"], headers["original_topic"]) == ("7", "events")


@FUZZ
@given(mutated() | st.binary(max_size=128))
def test_the_group_aggregator_sends_what_does_not_decode_to_the_dlq(raw: bytes) -> None:
    book = GroupBook(GroupConfig(), CODEC, source_topic="by-group", processor="fuzz")
    step = book.on_record(0, 3, b"g", raw, 1_000_000)
    if isinstance(_decodes_or_refuses(CODEC, raw), Trajectory):
        return
    assert len(step.sends) == 1
    out = step.sends[0]
    assert (out.sink, out.value) == (Sink.DLQ, raw)
    assert read_headers(out.headers)["code"] == CODE_UNDECODABLE
