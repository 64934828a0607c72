"""Schema Registry framing against a real Confluent-compatible registry: Apicurio Registry (its
ccompat API), built from Maven Central by tests/registry/pom.xml once and started on a free
port for the session. build_codec(settings) frames records with ids from the registry,
confluent-kafka's own Avro serializer and deserializer agree with our bytes, and a Recorder
writes registry-framed events through the real broker."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from _kafka_read import read_topic
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from rollstream.adapters.codecs import build_codec
from rollstream.infra.kafka import free_port
from rollstream.producers import Recorder, RecorderSettings
from rollstream.schemas import (
    RECORD_TYPES,
    Codec,
    CommonSettings,
    Event,
    LlmCall,
    PolicyVersion,
    Reward,
    RewardRecord,
    RolloutFinished,
    RolloutStatus,
    Sample,
    Trajectory,
    TrajectoryNode,
    UnknownSchemaError,
    Usage,
    load_schema,
    registry_subject,
)

pytestmark = pytest.mark.integration

REGISTRY_POM = Path(__file__).parents[1] / "registry" / "pom.xml"
CCOMPAT = "/apis/ccompat/v7"  # Apicurio's Confluent-compatible API
_JAVA = ("java", "-Xmx384m", "-Dquarkus.http.host=127.0.0.1")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollstream"


def build_registry() -> Path:
    """The registry's runner jar, built once per version of tests/registry (pom + config)."""
    inputs = sorted(
        p for p in REGISTRY_POM.parent.rglob("*") if p.is_file() and "target" not in p.parts
    )
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in inputs)).hexdigest()[:16]
    out = _cache_dir() / f"registry-{digest}"
    jar = out / "rollstream-test-registry-1-runner.jar"
    if jar.exists():
        return jar
    mvn = shutil.which("mvn")
    assert mvn is not None, "Maven (mvn) is needed to build the test registry"
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [mvn, "-q", "-B", "-f", str(REGISTRY_POM), "package", f"-Dregistry.build.dir={tmp}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return jar


@pytest.fixture(scope="session")
def registry_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A running registry's Confluent-compatible base URL, for the whole session."""
    jar = build_registry()
    port = free_port()
    log_path = tmp_path_factory.mktemp("registry") / "registry.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*_JAVA, f"-Dquarkus.http.port={port}", "-jar", str(jar)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}{CCOMPAT}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"registry exited:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"registry not up:\n{log_path.read_text()[-4000:]}"
            try:
                if httpx.get(f"{url}/subjects", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _records() -> dict[str, Any]:
    """One record of every top-level type, with arrays, unions, maps and nested records."""
    rng = np.random.default_rng(7)
    call = LlmCall(
        "c1",
        None,
        0,
        rng.integers(0, 50_000, 40, dtype="<u4"),
        rng.integers(0, 50_000, 8, dtype="<u4"),
        rng.random(8).astype("<f4"),
        model="m",
        usage=Usage(40, 8, 0),
    )
    node = TrajectoryNode(
        "c1",
        None,
        0,
        call.prompt_delta,
        call.completion_ids,
        call.completion_logprobs,
        policy_version=2,
    )
    n = 48
    return {
        "rollstream.Event": Event("e1", "r1", 1, 2**50, call, "it"),
        "rollstream.PolicyVersion": PolicyVersion(2, "file:///ckpt/2", 10, 2**50, 64, {"kl": 0.1}),
        "rollstream.Trajectory": Trajectory(
            "r1", "t1", "g1", "completed", 1.0, [node], rewards=[RewardRecord(1.0, "final")]
        ),
        "rollstream.Sample": Sample(
            "s1",
            "r1",
            "g1",
            "t1",
            rng.integers(0, 50_000, n, dtype="<u4"),
            np.ones(n, "u1"),
            rng.random(n).astype("<f4"),
            0.5,
            1.0,
            2,
        ),
    }


def _registered(url: str, subject: str) -> dict[int, dict[str, Any]]:
    """Every version of ``subject`` by schema id, straight from the registry's REST API."""
    versions = httpx.get(f"{url}/subjects/{subject}/versions", timeout=10)
    versions.raise_for_status()
    out: dict[int, dict[str, Any]] = {}
    for version in versions.json():
        resp = httpx.get(f"{url}/subjects/{subject}/versions/{version}", timeout=10)
        resp.raise_for_status()
        out[resp.json()["id"]] = json.loads(resp.json()["schema"])
    return out


def test_build_codec_frames_records_with_ids_from_the_registry(registry_url: str) -> None:
    settings = CommonSettings(schema_registry_url=registry_url)
    writer = build_codec(settings)
    records = _records()
    assert set(records) == set(RECORD_TYPES)
    encoded = {name: writer.encode(record) for name, record in records.items()}
    subjects = httpx.get(f"{registry_url}/subjects", timeout=10).json()
    for name, data in encoded.items():
        assert data[:1] == b"\x00"
        (schema_id,) = struct.unpack(">I", data[1:5])
        assert registry_subject(name) in subjects
        assert _registered(registry_url, registry_subject(name))[schema_id] == load_schema(name)
        by_id = httpx.get(f"{registry_url}/schemas/ids/{schema_id}", timeout=10).json()
        assert json.loads(by_id["schema"]) == load_schema(name)
        assert data[5:] == Codec().encode(records[name])[10:]  # the body is the same Avro
    reader = build_codec(settings)  # a fresh codec: learns every writer schema by id
    for name, data in encoded.items():
        assert reader.decode(data, expect=RECORD_TYPES[name]) == records[name]
        with pytest.raises(UnknownSchemaError):
            Codec().decode(data)  # single-object codec: registry framing is not for it
    # a second writer gets the same ids (registering an existing schema is idempotent)
    again = build_codec(settings)
    assert {n: again.encode(r)[:5] for n, r in records.items()} == {
        n: d[:5] for n, d in encoded.items()
    }
    with pytest.raises(UnknownSchemaError):
        reader.decode(b"\x00\x00\x0f\x42\x40" + encoded["rollstream.Event"][5:])  # id 1000000


def test_confluent_serializers_read_and_write_our_framing(registry_url: str) -> None:
    """confluent-kafka's own AvroDeserializer reads what build_codec writes, and our codec
    reads what its AvroSerializer writes: the same framing, the same bodies."""
    codec = build_codec(CommonSettings(schema_registry_url=registry_url))
    client = SchemaRegistryClient({"url": registry_url})
    ctx = SerializationContext("rollout.events", MessageField.VALUE)
    deserialize = AvroDeserializer(client, return_record_name=True)
    for name, record in _records().items():
        data = codec.encode(record)
        assert deserialize(data, ctx) == codec.decode_dict(data)[1]
        serialize = AvroSerializer(
            client,
            json.dumps(load_schema(name)),
            conf={"subject.name.strategy": lambda _ctx, record_name: f"{record_name}-value"},
        )
        theirs = serialize(record.to_avro(), ctx)
        assert theirs is not None and theirs[:1] == b"\x00"
        assert codec.decode(theirs) == record
    client.close()


def test_recorder_writes_registry_framed_events_through_kafka(
    kafka_settings: CommonSettings, registry_url: str, tmp_path: Path
) -> None:
    settings = RecorderSettings(
        **{**kafka_settings.model_dump(), "schema_registry_url": registry_url},
        spool_dir=tmp_path / "spool",
        producer="it",
    )
    recorder = Recorder(settings, codec=build_codec(settings))
    rng = np.random.default_rng(1)
    for i in range(5):
        with recorder.rollout(task_id=f"t{i}", group_id="g") as r:
            prompt = rng.integers(0, 50_000, 30, dtype=np.uint32)
            for _ in range(3):
                completion = rng.integers(0, 50_000, 6, dtype=np.uint32)
                r.llm_call(prompt, completion, np.full(6, -0.25, np.float32))
                prompt = np.concatenate((prompt, completion))
            r.reward(1.0)
    assert recorder.flush(60)
    stats = recorder.close()
    # 5 rollouts x (start, 3 calls, reward, finish)
    assert (stats.sent, stats.dropped, stats.failed) == (30, 0, 0)

    event_ids = _registered(registry_url, registry_subject("rollstream.Event"))
    reader = build_codec(settings)
    events: list[Event] = []
    for msg in read_topic(settings, settings.topics().events):
        value = msg.value()
        assert value[:1] == b"\x00"
        (schema_id,) = struct.unpack(">I", value[1:5])
        assert event_ids[schema_id] == load_schema("rollstream.Event")
        event = reader.decode(value, expect=Event)
        assert msg.key() == event.rollout_id.encode()
        events.append(event)
        with pytest.raises(UnknownSchemaError):
            Codec().decode(value)
    assert len(events) == 30
    one_rollout = ["RolloutStarted", "LlmCall", "LlmCall", "LlmCall", "Reward", "RolloutFinished"]
    kinds = [type(e.body).__name__ for e in sorted(events, key=lambda e: (e.rollout_id, e.seq))]
    assert kinds == one_rollout * 5
    finished = [e.body for e in events if isinstance(e.body, RolloutFinished)]
    assert all(f.status == RolloutStatus.COMPLETED for f in finished)
    assert all(e.body.value == 1.0 for e in events if isinstance(e.body, Reward))
