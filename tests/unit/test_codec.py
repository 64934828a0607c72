"""The codec: round trips for every schema, evolution both ways, bad bytes, registry framing
(through confluent-kafka's registry client, against a minimal HTTP registry), the fastavro
fallbacks of a schema the compiled writer or reader does not support."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import struct
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import fastavro
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollstream.adapters.registry import ConfluentRegistry
from rollstream.schemas import (
    RECORD_TYPES,
    Branch,
    BranchKind,
    Codec,
    DecodeError,
    EncodeError,
    EvaluatorOutput,
    Event,
    LlmCall,
    PolicyVersion,
    RegistryError,
    Reward,
    RewardKind,
    RewardRecord,
    RolloutError,
    RolloutFinished,
    RolloutStarted,
    RolloutStatus,
    Sample,
    SampleMode,
    SandboxEvent,
    SandboxPhase,
    SchemaSet,
    StageEvent,
    StageName,
    StagePhase,
    ToolCall,
    Trajectory,
    TrajectoryNode,
    UnknownSchemaError,
    Usage,
    load_schema,
    previous_schemas,
    registry_subject,
)
from rollstream.schemas.codec import _RECORD_CLASSES
from rollstream.schemas.fastread import ReadError, compile_reader
from rollstream.schemas.fastwrite import compile_flat_writer, compile_writer

text = st.text(max_size=20)
opt_text = st.none() | text
ids = st.lists(st.integers(0, 2**32 - 1), max_size=50).map(lambda x: np.array(x, "<u4"))
i64 = st.integers(-(2**63), 2**63 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
finite = st.floats(allow_nan=False, allow_infinity=True, width=64)


def f32s(n: int) -> st.SearchStrategy[np.ndarray]:
    return st.lists(st.floats(-100, 0, width=32), min_size=n, max_size=n).map(
        lambda x: np.array(x, "<f4")
    )


@st.composite
def llm_calls(draw: st.DrawFn) -> LlmCall:
    completion = draw(ids)
    return LlmCall(
        call_id=draw(text),
        parent_call_id=draw(opt_text),
        prefix_len=draw(i32),
        prompt_delta=draw(ids),
        completion_ids=completion,
        completion_logprobs=draw(f32s(len(completion))),
        finish_reason=draw(text),
        model=draw(text),
        backend=draw(text),
        policy_version=draw(i64),
        latency_ms=draw(finite),
        usage=Usage(draw(i32), draw(i32), draw(i32)),
        drift_tokens=draw(i32),
    )


bodies = st.one_of(
    st.builds(
        RolloutStarted,
        task_id=text,
        group_id=text,
        attempt=i32,
        harness=text,
        policy_version=i64,
        group_size=st.none() | i32,
        run_id=text,
        sampling=st.dictionaries(text, finite, max_size=3),
        metadata=st.dictionaries(text, text, max_size=3),
    ),
    llm_calls(),
    st.builds(
        ToolCall,
        tool_call_id=text,
        name=text,
        arguments=text,
        result=text,
        result_truncated=st.booleans(),
        is_error=st.booleans(),
        duration_ms=finite,
        sandbox=opt_text,
        at_call_id=opt_text,
    ),
    st.builds(
        Reward,
        value=finite,
        kind=st.sampled_from(RewardKind),
        name=text,
        at_call_id=opt_text,
        evaluator=text,
    ),
    st.builds(
        Branch,
        branch_id=text,
        kind=st.sampled_from(BranchKind),
        source_call_id=opt_text,
        reason=text,
    ),
    st.builds(RolloutError, source=text, message=text, code=i32, call_id=opt_text, backend=text),
    st.builds(RolloutFinished, status=st.sampled_from(RolloutStatus), error=opt_text),
    st.builds(
        StageEvent,
        stage=st.sampled_from(StageName),
        phase=st.sampled_from(StagePhase),
        status=text,
        duration_ms=finite,
        job_id=text,
        worker=text,
        reason=text,
    ),
    st.builds(
        SandboxEvent,
        sandbox_id=text,
        phase=st.sampled_from(SandboxPhase),
        kind=text,
        duration_ms=finite,
        job_id=text,
    ),
    st.builds(
        EvaluatorOutput,
        evaluator=text,
        status=text,
        passed=i32,
        total=i32,
        output=text,
        output_truncated=st.booleans(),
        job_id=text,
    ),
)
events = st.builds(
    Event,
    event_id=text,
    rollout_id=text,
    seq=i64,
    ts=i64,
    body=bodies,
    producer=text,
    schema_version=i32,
)


@st.composite
def nodes(draw: st.DrawFn) -> TrajectoryNode:
    completion = draw(ids)
    return TrajectoryNode(
        call_id=draw(text),
        parent_call_id=draw(opt_text),
        prefix_len=draw(i32),
        prompt_tokens=draw(ids),
        completion_ids=completion,
        completion_logprobs=draw(f32s(len(completion))),
        policy_version=draw(i64),
        finish_reason=draw(text),
    )


trajectories = st.builds(
    Trajectory,
    rollout_id=text,
    task_id=text,
    group_id=text,
    status=text,
    score=finite,
    nodes=st.lists(nodes(), max_size=3),
    attempt=i32,
    group_size=st.none() | i32,
    run_id=text,
    error=opt_text,
    score_source=text,
    rewards=st.lists(
        st.builds(RewardRecord, value=finite, kind=text, name=text, at_call_id=opt_text), max_size=3
    ),
    num_events=i32,
    last_seq=i64,
    started_ts=i64,
    finished_ts=i64,
    metadata=st.dictionaries(text, text, max_size=2),
)


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    tokens = draw(ids)
    n = len(tokens)
    return Sample(
        sample_id=draw(text),
        rollout_id=draw(text),
        group_id=draw(text),
        task_id=draw(text),
        input_ids=tokens,
        loss_mask=np.array(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), "u1"),
        behaviour_logprobs=draw(f32s(n)),
        advantage=draw(finite),
        reward=draw(finite),
        policy_version=draw(i64),
        mode=draw(st.sampled_from(SampleMode)),
        parent_indices=np.arange(-1, n - 1, dtype="<i4"),
        token_policy_versions=np.zeros(n, "<i8"),
        loss_weight=draw(finite),
        policy_versions=draw(st.lists(i64, max_size=3)),
        leaf_id=draw(text),
        num_tokens=n,
    )


policy_versions = st.builds(
    PolicyVersion,
    version=i64,
    checkpoint_uri=text,
    trainer_step=i64,
    ts=i64,
    samples_trained=i64,
    metrics=st.dictionaries(text, finite, max_size=3),
)

CODEC = Codec()


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(events, trajectories, samples(), policy_versions))
def test_round_trip_every_schema(record: Any) -> None:
    data = CODEC.encode(record)
    assert data[:2] == b"\xc3\x01"
    back = CODEC.decode(data, expect=type(record))
    assert back == record
    assert json.loads(json.dumps(back.to_json())) == json.loads(json.dumps(record.to_json()))


def test_token_arrays_decode_as_numpy_views() -> None:
    ev = Event(
        event_id="e",
        rollout_id="r",
        seq=0,
        ts=0,
        body=LlmCall(
            call_id="c",
            parent_call_id=None,
            prefix_len=0,
            prompt_delta=list(range(2000)),
            completion_ids=[7, 8],
            completion_logprobs=[-0.5, -1.5],
        ),
    )
    back = CODEC.decode(CODEC.encode(ev))
    assert back.body.prompt_delta.dtype == np.dtype("<u4")
    assert back.body.prompt_delta[1999] == 1999
    assert back.body.completion_logprobs.tolist() == [-0.5, -1.5]


def _llm_event() -> Event:
    return Event(
        event_id="e1",
        rollout_id="r1",
        seq=3,
        ts=42,
        body=LlmCall(
            call_id="c",
            parent_call_id="p",
            prefix_len=5,
            prompt_delta=[1, 2, 3],
            completion_ids=[4],
            completion_logprobs=[-1],
        ),
    )


def _with_extra_field() -> dict[str, Any]:
    """The next schema version: LlmCall gains a field with a default."""
    schema = copy.deepcopy(load_schema("rollstream.Event"))
    body = next(f for f in schema["fields"] if f["name"] == "body")
    llm = next(t for t in body["type"] if isinstance(t, dict) and t["name"] == "LlmCall")
    llm["fields"].append({"name": "temperature", "type": "double", "default": 1.0})
    return schema


def test_new_reader_decodes_old_records() -> None:
    old_bytes = CODEC.encode(_llm_event())
    new_schemas = SchemaSet(
        [
            _with_extra_field(),
            *(
                load_schema(n)
                for n in ("rollstream.Sample", "rollstream.Trajectory", "rollstream.PolicyVersion")
            ),
        ]
    )
    new_schemas.add_writer(load_schema("rollstream.Event"))  # the previous version is known
    name, raw = Codec(new_schemas).decode_dict(old_bytes)
    assert name == "rollstream.Event"
    kind, body = raw["body"]
    assert kind == "rollstream.LlmCall" and body["temperature"] == 1.0
    assert body["prompt_delta"] == np.array([1, 2, 3], "<u4").tobytes()


# The fingerprint of the Event schema before the lifecycle bodies (StageEvent, SandboxEvent,
# EvaluatorOutput) were appended to its body union: what records on the log carry today.
_EVENT_V1_FINGERPRINT = "20a2573efabfa6b5"


def test_records_of_the_previous_event_schema_decode_with_the_default_codec() -> None:
    (v1,) = [s for s in previous_schemas() if s["name"] == "Event"]
    old_writer = Codec(writer_overrides={"rollstream.Event": v1})
    bodies = [RolloutStarted("t", "g"), _llm_event().body, Reward(1.0), RolloutFinished()]
    for seq, body in enumerate(bodies):
        event = Event("e", "r", seq, 7, body, producer="old")
        old_bytes = old_writer.encode(event)
        assert old_bytes[2:10].hex() == _EVENT_V1_FINGERPRINT  # as the previous release wrote
        assert old_bytes[2:10] != CODEC.encode(event)[2:10]
        assert Codec().decode(old_bytes) == event  # no schema told: the history is built in
    # a new body type cannot be written with the old union: old records never carry one
    new_event = Event("e", "r", 1, 7, StageEvent(StageName.INIT, StagePhase.STARTED))
    with pytest.raises(EncodeError, match="StageEvent not found"):
        old_writer.encode(new_event)
    assert CODEC.decode(CODEC.encode(new_event)) == new_event


def test_old_reader_decodes_new_records() -> None:
    new = _with_extra_field()
    writer = Codec(writer_overrides={"rollstream.Event": new})
    data = _llm_event().to_avro()
    data["body"][1]["temperature"] = 0.7
    new_bytes = writer.encode_dict("rollstream.Event", data)
    assert new_bytes[2:10] != CODEC.encode(_llm_event())[2:10]  # another fingerprint
    with pytest.raises(UnknownSchemaError):
        CODEC.decode(new_bytes)  # unknown writer: a clear error, not garbage
    reader = Codec()
    reader.schemas.add_writer(new)  # learnt from the schema history / registry
    assert reader.decode(new_bytes) == _llm_event()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", "no Avro single-object"),
        (b"garbage!", "no Avro single-object"),
        (b"\xc3\x01" + b"\x00" * 8 + b"\x02", "unknown schema fingerprint"),
        (None, "trailing bytes"),
        (None, "truncated"),
    ],
)
def test_bad_bytes_raise_typed_error_with_raw(raw: bytes | None, reason: str) -> None:
    good = CODEC.encode(_llm_event())
    if raw is None:
        raw = good + b"\x00" if reason == "trailing bytes" else good[:-3]
    with pytest.raises(DecodeError) as info:
        CODEC.decode(raw)
    assert info.value.raw == raw
    if reason != "truncated":
        assert reason in info.value.reason
    assert info.value.reason


def test_expect_type_mismatch_is_a_decode_error() -> None:
    with pytest.raises(DecodeError, match="expected Sample"):
        CODEC.decode(CODEC.encode(_llm_event()), expect=Sample)


class _Registry(BaseHTTPRequestHandler):
    """A minimal Confluent-compatible registry (the I/O edge; tests/integration/test_registry.py
    runs a real one): ids by schema text, subjects remembered."""

    schemas: dict[int, str] = {}
    subjects: dict[str, list[int]] = {}

    def do_POST(self) -> None:
        subject = self.path.split("?")[0].split("/")[2]  # /subjects/<subject>/versions?...
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body.get("schemaType", "AVRO") == "AVRO"
        ids = {v: k for k, v in self.schemas.items()}
        schema_id = ids.get(body["schema"]) or len(self.schemas) + 1
        self.schemas[schema_id] = body["schema"]
        self.subjects.setdefault(subject, []).append(schema_id)
        self._send({"id": schema_id})

    def do_GET(self) -> None:
        schema_id = int(self.path.split("?")[0].rsplit("/", 1)[1])  # /schemas/ids/<id>
        if schema_id in self.schemas:
            self._send({"schema": self.schemas[schema_id]})
        else:
            self._send({"error_code": 40403, "message": "Schema not found"}, 404)

    def _send(self, obj: dict[str, Any], status: int = 200) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        return None


@pytest.fixture
def registry_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_registry_framing_round_trip(registry_url: str) -> None:
    writer = Codec(registry=ConfluentRegistry(registry_url))
    data = writer.encode(_llm_event())
    assert data[:1] == b"\x00" and len(data) > 5
    (schema_id,) = struct.unpack(">I", data[1:5])
    assert schema_id in _Registry.subjects[registry_subject("rollstream.Event")]
    assert registry_subject("rollstream.Event") == "rollstream.Event-value"
    assert data[5:] == CODEC.encode(_llm_event())[10:]  # the same body behind either header
    reader = Codec(registry=ConfluentRegistry(registry_url))  # learns the schema by id
    assert reader.decode(data) == _llm_event()
    assert reader.decode_dict(data) == CODEC.decode_dict(CODEC.encode(_llm_event()))
    assert writer.encode_dict("rollstream.Event", _llm_event().to_avro()) == data
    with pytest.raises(UnknownSchemaError):
        reader.decode(b"\x00\x00\x00\x03\xe7" + data[5:])  # id 999 is not registered
    with pytest.raises(UnknownSchemaError):
        CODEC.decode(data)  # no registry configured


def test_registry_errors_are_registry_errors_from_the_client_error() -> None:
    """Nothing listens on port 9: registering raises RegistryError (from confluent-kafka's
    error) out of encode; reading a registry-framed record is an UnknownSchemaError."""
    down = ConfluentRegistry("http://127.0.0.1:9", {"max.retries": 0})
    with pytest.raises(RegistryError) as info:
        down.register("rollstream.Event-value", load_schema("rollstream.Event"))
    assert info.value.__cause__ is not None
    with pytest.raises(RegistryError) as info:
        down.get(1)
    assert info.value.__cause__ is not None
    codec = Codec(registry=down)
    with pytest.raises(RegistryError):
        codec.encode(_llm_event())
    with pytest.raises(UnknownSchemaError):
        codec.decode(b"\x00\x00\x00\x00\x01" + CODEC.encode(_llm_event())[10:])


class _Answers:
    """A SchemaRegistry (the codec's protocol) that answers ``get`` with whatever it holds."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer

    def register(self, subject: str, schema_json: dict[str, Any]) -> int:
        return 7

    def get(self, schema_id: int) -> dict[str, Any]:
        return self.answer


@pytest.mark.parametrize("answer", [{"type": "string"}, {"nonsense": 1}, {"type": "record"}])
def test_a_registry_answer_that_is_no_record_schema_is_an_unknown_schema(
    answer: dict[str, Any],
) -> None:
    codec = Codec(registry=_Answers(answer))
    raw = b"\x00\x00\x00\x00\x07" + CODEC.encode(_llm_event())[10:]
    with pytest.raises(UnknownSchemaError):
        codec.decode(raw)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(events, trajectories, samples(), policy_versions))
def test_compiled_writer_matches_fastavro_byte_for_byte(record: Any) -> None:
    name = next(n for n, cls in RECORD_TYPES.items() if cls is type(record))
    assert CODEC.encode(record) == CODEC.encode_dict(name, record.to_avro())


# --- the compiled reader (schemas/fastread.py) -------------------------------------------------


def _fastavro_decode(data: bytes) -> Any:
    """What the codec decoded before the compiled reader: fastavro's dict, then from_avro."""
    name, raw = CODEC.decode_dict(data)
    return RECORD_TYPES[name].from_avro(raw)


def _identical(a: Any, b: Any) -> None:
    """Equal field for field, with the same types (enum members, array dtypes, None)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _identical(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _identical(a[key], b[key])
    elif hasattr(type(a), "__dataclass_fields__"):
        for name in type(a).__dataclass_fields__:
            _identical(getattr(a, name), getattr(b, name))
    elif isinstance(a, float):
        assert a == b or (a != a and b != b)
    else:
        assert a == b


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.one_of(events, trajectories, samples(), policy_versions))
def test_compiled_reader_matches_fastavro(record: Any) -> None:
    name = next(n for n, cls in RECORD_TYPES.items() if cls is type(record))
    read = compile_reader(CODEC.schemas.reader(name).json, _RECORD_CLASSES)
    data = CODEC.encode(record)
    direct, end = read(data, 10)
    assert end == len(data)
    expected = _fastavro_decode(data)
    _identical(direct, expected)
    _identical(CODEC.decode(data), expected)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(events, trajectories, samples(), policy_versions), st.data())
def test_compiled_reader_on_garbage_agrees_with_fastavro_or_refuses(
    record: Any, data: st.DataObject
) -> None:
    """Mangled bodies (cut, bytes overwritten, bytes inserted): the codec raises DecodeError
    and nothing else; whatever it does decode, fastavro decodes to the same record."""
    good = bytearray(CODEC.encode(record))
    how = data.draw(st.sampled_from(["cut", "overwrite", "insert"]))
    at = data.draw(st.integers(10, len(good) - 1))
    if how == "cut":
        bad = bytes(good[:at])
    elif how == "overwrite":
        chunk = data.draw(st.binary(min_size=1, max_size=4))
        bad = bytes(good[:at] + chunk + good[at + len(chunk) :])
    else:
        bad = bytes(good[:at] + data.draw(st.binary(min_size=1, max_size=4)) + good[at:])
    try:
        decoded = CODEC.decode(bad)
    except DecodeError as exc:
        assert exc.raw == bad and exc.reason
        if how == "cut":
            assert "truncated" in exc.reason
        return
    _identical(decoded, _fastavro_decode(bad))


def test_every_cut_of_an_event_is_a_truncation() -> None:
    data = CODEC.encode(_llm_event())
    for cut in range(10, len(data)):
        with pytest.raises(DecodeError, match="truncated") as info:
            CODEC.decode(data[:cut])
        assert info.value.raw == data[:cut]


def _minimal_event(body: Any) -> bytes:
    """An event whose envelope takes 8 bytes: the union index is at byte 18, the body after."""
    data = CODEC.encode(Event(event_id="e", rollout_id="r", seq=0, ts=0, body=body))
    assert data[10:18] == b"\x02e\x02r\x00\x00\x00\x02"
    return data


@pytest.mark.parametrize(
    ("offset", "value", "reason"),
    [
        (18, b"\x14", "bad union index 10"),  # the body union has 10 branches
        (18, b"\x01", "bad union index -1"),
        (27, b"\x08", "bad enum index 4"),  # Reward.kind has 4 symbols
        (27, b"\x01", "bad enum index -1"),  # fastavro would read the last symbol
        (10, b"\x03", "negative string length"),
        (10, b"\xff" * 10 + b"\x01", "varint longer than 10 bytes"),
        (10, b"\x7e", "truncated: string of 63 bytes"),
    ],
)
def test_bad_bytes_in_the_body_are_decode_errors(offset: int, value: bytes, reason: str) -> None:
    good = _minimal_event(Reward(value=1.0))
    assert good[18:20] == b"\x06" + struct.pack("<d", 1.0)[:1]  # Reward is branch 3
    bad = good[:offset] + value + good[offset + 1 :]
    with pytest.raises(DecodeError, match=reason) as info:
        CODEC.decode(bad)
    assert info.value.raw == bad


def test_packed_array_of_a_partial_item_is_a_decode_error() -> None:
    event = _llm_event()
    data = CODEC.encode(event)
    body = event.body
    assert isinstance(body, LlmCall)
    packed = b"\x18" + body.prompt_delta.tobytes()  # 12 bytes: the prompt_delta field
    at = data.index(packed)
    bad = data[:at] + b"\x16" + data[at + 1 : at + 12] + data[at + 13 :]  # 11 bytes
    with pytest.raises(DecodeError, match="buffer size must be a multiple"):
        CODEC.decode(bad)


def test_decode_accepts_bytearray_and_memoryview_and_refuses_other_types() -> None:
    data = CODEC.encode(_llm_event())
    assert CODEC.decode(bytearray(data)) == _llm_event()
    assert CODEC.decode(memoryview(data)) == _llm_event()
    with pytest.raises(DecodeError, match="expected bytes"):
        CODEC.decode("text")  # type: ignore[arg-type]


def test_decoded_arrays_are_read_only_and_aligned() -> None:
    body = CODEC.decode(CODEC.encode(_llm_event())).body
    for array in (body.prompt_delta, body.completion_ids, body.completion_logprobs):
        assert not array.flags.writeable and array.flags.aligned


@dataclasses.dataclass
class _Point:
    x: int
    tags: list[str]
    scale: float | None = None


def test_compile_reader_on_a_plain_dataclass_and_what_it_refuses() -> None:
    schema = {
        "type": "record",
        "name": "Point",
        "namespace": "t",
        "fields": [
            {"name": "x", "type": "long"},
            {"name": "skipped", "type": {"type": "map", "values": "boolean"}},
            {"name": "tags", "type": {"type": "array", "items": "string"}},
            {"name": "scale", "type": ["null", "float"]},
        ],
    }
    read = compile_reader(schema, {"t.Point": _Point})
    data = b"\x03" + b"\x02\x02k\x01\x00" + b"\x04\x02a\x00\x00" + b"\x02" + struct.pack("<f", 2)
    assert read(data, 0) == (_Point(-2, ["a", ""], 2.0), len(data))
    with pytest.raises(ReadError, match="truncated"):
        read(data[:-1], 0)
    with pytest.raises(ReadError, match="block of 63 items at byte 3, 2 bytes left"):
        read(b"\x03\x00\x7e\x02a", 0)  # an array block of 63 items in 2 bytes
    with pytest.raises(TypeError, match=r"not in t\.Point"):
        compile_reader({**schema, "fields": schema["fields"][:2]}, {"t.Point": _Point})
    with pytest.raises(TypeError, match="no record class"):
        compile_reader(schema, {})
    bad_name = {"name": "x; import os", "type": "long"}
    with pytest.raises(TypeError, match="not a Python identifier"):
        compile_reader({**schema, "fields": [*schema["fields"], bad_name]}, {"t.Point": _Point})
    with pytest.raises(TypeError, match="logical types"):
        compile_reader({"type": "long", "logicalType": "timestamp-millis"}, {})


def test_compiled_writer_takes_any_array_layout_and_bytes_like_values() -> None:
    """Packed arrays go in from their own buffer when C-contiguous, else through a copy; either
    way the bytes are fastavro's (which gets ``tobytes()``)."""
    wide = np.arange(40, dtype="<u4")
    cases = [
        (wide[::2], wide[1::2], np.linspace(-1, 0, 20, dtype="<f4")),  # strided views
        (wide[5:25], wide[:0], np.zeros(0, "<f4")),  # a slice, empty arrays
        (wide.reshape(4, 10)[:, 2], wide[:3], np.full(3, -0.5, "<f4")),  # a column
    ]
    for prompt, completion, logprobs in cases:
        call = LlmCall("c", None, 3, prompt, completion, logprobs, usage=Usage(1, 2, 3))
        ev = Event("e", "r", 1, 2**50 + 3, call, producer="p")
        assert CODEC.encode(ev) == CODEC.encode_dict("rollstream.Event", ev.to_avro())
        assert CODEC.decode(CODEC.encode(ev)) == ev

    @dataclasses.dataclass
    class Blob:
        data: Any
        more: Any

    schema = {
        "type": "record", "name": "Blob", "namespace": "t",
        "fields": [{"name": "data", "type": "bytes"}, {"name": "more", "type": "bytes"}],
    }  # fmt: skip
    write = compile_writer(schema, {"t.Blob": Blob}, prefix=b"HD")
    parsed = fastavro.parse_schema(schema)
    for data, more in [
        (b"abc", bytearray(b"\x00" * 300)),
        (memoryview(b"xyz" * 7000), np.arange(6, dtype=">u4")),  # big-endian: its raw bytes
        (np.arange(12, dtype="<i8").reshape(3, 4), np.arange(12, dtype="<u4").reshape(3, 4).T),
    ]:
        expect = io.BytesIO()
        fastavro.schemaless_writer(expect, parsed, {"data": _raw(data), "more": _raw(more)})
        assert write(Blob(data, more)) == b"HD" + expect.getvalue()


def test_compiled_writer_joins_arrays_in_place() -> None:
    """Arrays go into the output as views of their buffers, at their place: empty, small and
    large ones, several between small fields, nested in a union, strided (copied) ones; the
    bytes are fastavro's and decode back."""
    rng = np.random.default_rng(3)
    edge = 512
    for n_prompt, n_completion in [(edge - 1, edge), (edge, edge - 1), (edge, edge), (3000, 0),
                                   (0, 2 * edge), (edge + 1, 5 * edge), (1, 1)]:  # fmt: skip
        prompt = rng.integers(0, 2**32, n_prompt, dtype="<u4")
        completion = rng.integers(0, 2**32, 2 * n_completion, dtype="<u4")[::2]  # strided
        logprobs = rng.random(n_completion).astype("<f4")
        call = LlmCall("c", "p", 7, prompt, completion, logprobs, model="m", usage=Usage(1, 2, 3))
        ev = Event("e", "r", 1, 2**50 + 3, call, producer="p")
        data = CODEC.encode(ev)
        assert data == CODEC.encode_dict("rollstream.Event", ev.to_avro())
        assert CODEC.decode(data) == ev
    n = 3 * edge
    sample = Sample(
        "s", "r", "g", "t", rng.integers(0, 2**32, n, dtype="<u4"), np.ones(n, "u1"),
        rng.random(n).astype("<f4"), 0.5, 1.0, 3,
        token_policy_versions=np.arange(n, dtype="<i8"),
    )  # fmt: skip
    assert CODEC.encode(sample) == CODEC.encode_dict("rollstream.Sample", sample.to_avro())


def _raw(value: Any) -> bytes:
    return value.tobytes() if isinstance(value, np.ndarray) else bytes(value)


@pytest.mark.parametrize(
    "value",
    [0, 1, -1, 63, -64, 64, 8191, -8192, 8192, 16383, 16384, -16385, 2**31 - 1, -(2**31),
     2**42 + 12345, 1_764_448_000_123_456, 2**63 - 1, -(2**63)],
)  # fmt: skip
def test_compiled_writer_longs_match_fastavro(value: int) -> None:
    ev = Event("e", "r", value, value, RolloutFinished(RolloutStatus.COMPLETED), schema_version=7)
    assert CODEC.encode(ev) == CODEC.encode_dict("rollstream.Event", ev.to_avro())


_FLAT_LLM = (
    "event_id", "rollout_id", "seq", "ts", "producer", "schema_version", "call_id",
    "parent_call_id", "prefix_len", "prompt_delta", "completion_ids", "completion_logprobs",
    "finish_reason", "model", "backend", "policy_version", "latency_ms", "usage_prompt_tokens",
    "usage_completion_tokens", "usage_cached_tokens", "drift_tokens",
)  # fmt: skip


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(llm_calls(), text, text, i64, i64, text, i32)
def test_flat_writer_writes_the_bytes_encode_writes(
    call: LlmCall, event_id: str, rollout_id: str, seq: int, ts: int, producer: str, version: int
) -> None:
    """An LlmCall event written from its leaf fields (the SDK's hot path) is byte for byte
    what encoding the records makes, whatever order the caller names the fields in."""
    ev = Event(event_id, rollout_id, seq, ts, call, producer, version)
    values = {
        **{f: getattr(ev, f) for f in ("event_id", "rollout_id", "seq", "ts", "producer")},
        "schema_version": version,
        **{f.name: getattr(call, f.name) for f in dataclasses.fields(call) if f.name != "usage"},
        **{f"usage_{f.name}": getattr(call.usage, f.name) for f in dataclasses.fields(Usage)},
    }
    write = CODEC.flat_writer("rollstream.Event", "rollstream.LlmCall", _FLAT_LLM)
    assert write is not None
    assert write(*(values[f] for f in _FLAT_LLM)) == CODEC.encode(ev)
    backwards = CODEC.flat_writer("rollstream.Event", "rollstream.LlmCall", _FLAT_LLM[::-1])
    assert backwards is not None
    assert backwards(*(values[f] for f in _FLAT_LLM[::-1])) == CODEC.encode(ev)


def test_flat_writer_needs_every_field_once_and_falls_back_for_another_version() -> None:
    """A field left out, an unknown one or a field named twice fails where the writer is made;
    a codec that writes the record with another schema version has no flat writer (the caller
    encodes records)."""
    with pytest.raises(TypeError, match=r"missing \['drift_tokens'\]"):
        CODEC.flat_writer("rollstream.Event", "rollstream.LlmCall", _FLAT_LLM[:-1])
    with pytest.raises(TypeError, match=r"unknown \['nope'\]"):
        CODEC.flat_writer("rollstream.Event", "rollstream.LlmCall", (*_FLAT_LLM, "nope"))
    with pytest.raises(TypeError, match="missing"):
        CODEC.flat_writer("rollstream.Event", "rollstream.LlmCall", (*_FLAT_LLM[:-1], "seq"))
    schema = CODEC.schemas.reader("rollstream.Event").json
    with pytest.raises(TypeError, match=r"has no branch 'rollstream\.Nope'"):
        compile_flat_writer(schema, _RECORD_CLASSES, body="rollstream.Nope", params=_FLAT_LLM)
    old = Codec(writer_overrides={"rollstream.Event": load_schema("rollstream.Event")})
    assert old.flat_writer("rollstream.Event", "rollstream.LlmCall", _FLAT_LLM) is None


def test_flat_writer_and_compiled_writer_frame_for_a_registry(registry_url: str) -> None:
    """With a registry the compiled writers (the SDK's hot path included) write the registry
    header: the bytes fastavro's path writes, and they decode."""
    codec = Codec(registry=ConfluentRegistry(registry_url))
    call = _llm_event().body
    assert isinstance(call, LlmCall)
    ev = Event("e", "r", 3, 2**40, call, "p")
    values = {
        **{f: getattr(ev, f) for f in ("event_id", "rollout_id", "seq", "ts", "producer")},
        "schema_version": ev.schema_version,
        **{f.name: getattr(call, f.name) for f in dataclasses.fields(call) if f.name != "usage"},
        **{f"usage_{f.name}": getattr(call.usage, f.name) for f in dataclasses.fields(Usage)},
    }
    write = codec.flat_writer("rollstream.Event", "rollstream.LlmCall", _FLAT_LLM)
    assert write is not None
    data = write(*(values[f] for f in _FLAT_LLM))
    assert data[:1] == b"\x00"
    assert data == codec.encode(ev) == codec.encode_dict("rollstream.Event", ev.to_avro())
    assert Codec(registry=ConfluentRegistry(registry_url)).decode(data) == ev


# --- a schema the compiled writer does not support: fastavro writes it ----------------------


def _policy_version_with_a_scalar_union() -> dict[str, Any]:
    """PolicyVersion whose checkpoint_uri is ``["long", "string"]``: valid Avro that fastavro
    writes and reads, but a union of scalars, which the compiled writer and reader refuse."""
    schema = load_schema("rollstream.PolicyVersion")
    for f in schema["fields"]:
        if f["name"] == "checkpoint_uri":
            f["type"] = ["long", "string"]
    return schema


def test_encode_falls_back_to_fastavro_when_the_schema_does_not_compile() -> None:
    schema = _policy_version_with_a_scalar_union()
    with pytest.raises(TypeError, match="has no record class"):
        compile_writer(schema, _RECORD_CLASSES)  # what the codec meets, and survives
    others = [load_schema(n) for n in RECORD_TYPES if n != "rollstream.PolicyVersion"]
    codec = Codec(SchemaSet([*others, schema]))
    pv = PolicyVersion(3, "s3://ckpt/3", 120, 2**45, samples_trained=9, metrics={"loss": 0.25})
    expect = io.BytesIO()
    fastavro.schemaless_writer(expect, fastavro.parse_schema(copy.deepcopy(schema)), pv.to_avro())
    fp = codec.schemas.reader("rollstream.PolicyVersion").fingerprint
    for _ in range(2):  # the failed compile is remembered: the second record takes the same path
        data = codec.encode(pv)
        assert data == b"\xc3\x01" + fp + expect.getvalue()
        assert data == codec.encode_dict("rollstream.PolicyVersion", pv.to_avro())
        assert data != CODEC.encode(pv)  # the union's branch index: another schema indeed
        assert codec.decode(data, expect=PolicyVersion) == pv
    assert codec.decode(codec.encode(_llm_event())) == _llm_event()  # other types still compile
