"""The trainer against the real broker: exactly once across SIGKILLs, staleness, DLQ, policy
versions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _kafka_read import read_topic
from confluent_kafka import Producer

from rollstream.adapters.topics import ensure_topics
from rollstream.consumers.training.checkpoint import CheckpointStore
from rollstream.consumers.training.trainer import TRAINER_GROUP, TrainerSettings, run
from rollstream.inference.tinymodel import (
    apply_state_dict,
    ensure_tiny_model,
    load_model,
    load_state_dict,
)
from rollstream.schemas import (
    Codec,
    CommonSettings,
    Event,
    PolicyVersion,
    RolloutStarted,
    Sample,
    SampleMode,
)
from rollstream.schemas.dlq import CODE_INVALID, CODE_UNDECODABLE, HEADER_NAMES, read_headers

pytestmark = pytest.mark.integration

codec = Codec()
ROOT = Path(__file__).resolve().parents[2]


def make_sample(i: int, *, version: int = 0, tree: bool = False, n: int = 24) -> Sample:
    rng = np.random.default_rng(i)
    if tree:  # an 8-token prompt, then two 8-token branches, in DFS pre-order
        parents = np.array([-1, *range(7), 7, *range(8, 15), 7, *range(16, 23)], dtype=np.int32)
        mask = np.array([0] * 8 + [1] * 16, dtype=np.uint8)
    else:
        parents = np.zeros(0, np.int32)
        mask = np.array([0] * 8 + [1] * (n - 8), dtype=np.uint8)
    size = len(mask)
    return Sample(
        sample_id=f"s{i}",
        rollout_id=f"r{i}",
        group_id=f"g{i // 4}",
        task_id="t",
        input_ids=rng.integers(3, 500, size).astype(np.uint32),
        loss_mask=mask,
        behaviour_logprobs=(-rng.uniform(5.5, 7.0, size) * mask).astype(np.float32),
        advantage=float(rng.normal()),
        reward=1.0,
        policy_version=version,
        mode=SampleMode.TREE if tree else SampleMode.PATH,
        parent_indices=parents,
        loss_weight=0.5,
    )


def produce(settings: CommonSettings, records: list[tuple[int, bytes]]) -> list[tuple[int, int]]:
    """Produce (partition, value) records in order; return their (partition, offset)."""
    producer = Producer({**settings.kafka_config(), "acks": "all", "enable.idempotence": True})
    coords: list[tuple[int, int]] = []

    def delivered(err: object, msg: object) -> None:
        assert err is None, err
        coords.append((msg.partition(), msg.offset()))  # type: ignore[attr-defined]

    for partition, value in records:
        producer.produce(
            settings.topics().samples, value=value, partition=partition, on_delivery=delivered
        )
        producer.flush(30)  # one at a time: coords come back in produce order
    return coords


def policy_versions(settings: CommonSettings) -> list[PolicyVersion]:
    msgs = read_topic(settings, settings.topics().policy)
    return [codec.decode(m.value(), expect=PolicyVersion) for m in msgs]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny", hidden=64, layers=2)


def trainer_env(settings: CommonSettings, model: Path, ckpt: Path, **extra: object) -> dict:
    env = {
        "ROLLSTREAM_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "ROLLSTREAM_NAMESPACE": settings.namespace,
        "ROLLSTREAM_HOME": str(settings.home),
        "ROLLSTREAM_MODEL_PATH": str(model),
        "ROLLSTREAM_MODEL_CREATE": "false",
        "ROLLSTREAM_CHECKPOINT_DIR": str(ckpt),
        "ROLLSTREAM_CHECKPOINT_KEEP": "2",
        "ROLLSTREAM_TRAIN_LR": "1e-3",
        "ROLLSTREAM_TRAIN_TOKEN_BUDGET": "128",  # 5 samples of 24 tokens per step
        "ROLLSTREAM_TRAIN_MAX_STALENESS": "1000",
        "ROLLSTREAM_TRAIN_FLUSH_IDLE_S": "1.0",
        "ROLLSTREAM_TRAIN_EXIT_IDLE_S": "2.0",
        "ROLLSTREAM_TRAIN_POLL_TIMEOUT_S": "0.2",
        "ROLLSTREAM_TRAIN_TORCH_THREADS": "1",
    }
    env.update({f"ROLLSTREAM_{k.upper()}": str(v) for k, v in extra.items()})
    return env


def settings_from(env: dict) -> TrainerSettings:
    """The settings the subprocess would build from ``env``, built in this process."""
    return TrainerSettings(**{k.removeprefix("ROLLSTREAM_").lower(): v for k, v in env.items()})


def start_trainer(env: dict, log: Path) -> subprocess.Popen[bytes]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")} | env
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rollstream.infra.cli", "train"],  # rollstream train
            env=full,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )


def kill_at_pause(proc: subprocess.Popen[bytes], ckpt: Path, stage: str, step: int, log: Path):
    """Wait until the trainer pauses at (stage, step), then SIGKILL it."""
    marker = ckpt / "debug-paused.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if marker.exists() and json.loads(marker.read_text()) == {
            "stage": stage,
            "step": step,
            "pid": proc.pid,
        }:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            marker.unlink()
            return
        assert proc.poll() is None, f"trainer exited early:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no pause at {stage}:{step}:\n{log.read_text()[-3000:]}")


def sample_records(count: int, partitions: int = 3) -> list[tuple[int, bytes]]:
    records = [
        (i % partitions, codec.encode(make_sample(i, tree=i % 7 == 3))) for i in range(count)
    ]
    records.insert(5, (1, b"not an avro record"))  # undecodable: to the DLQ, never a crash
    records.insert(17, (2, codec.encode(make_sample(999, n=200))))  # over the token budget
    return records


def test_sigkill_between_and_mid_step_trains_each_sample_exactly_once(
    kafka_settings: CommonSettings, model_path: Path, tmp_path: Path
) -> None:
    records = sample_records(36)
    coords = produce(kafka_settings, records)
    bad = {coords[5], coords[17]}
    good = set(coords) - bad

    # The reference: an uninterrupted run over the same records in another namespace.
    ref_settings = kafka_settings.model_copy(update={"namespace": kafka_settings.namespace + "r"})
    ensure_topics(ref_settings)
    assert produce(ref_settings, records) == coords
    ref_env = trainer_env(ref_settings, model_path, tmp_path / "ref-ckpt")
    ref = run(settings_from(ref_env))
    assert ref.samples_trained == len(good) and ref.dlq == 2 and ref.stale_dropped == 0
    codes = {
        (int(h["original_partition"]), int(h["original_offset"])): (h["code"], h["kind"])
        for h in (
            read_headers(m.headers()) for m in read_topic(ref_settings, ref_settings.topics().dlq)
        )
    }
    assert codes == {
        coords[5]: (CODE_UNDECODABLE, "Sample"),  # not a Sample at all
        coords[17]: (CODE_INVALID, "Sample"),  # a Sample over the token budget
    }
    ref_store = CheckpointStore(tmp_path / "ref-ckpt")
    ref_trained = [c for _, m in ref_store.manifests() for c in m.trained]
    assert sorted(ref_trained) == sorted(good)

    # The same with SIGKILLs at every stage of a step.
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "trainer.log"
    for stage, step in [("optimizer", 2), ("checkpoint", 3), ("committed", 5), ("published", 6)]:
        proc = start_trainer(
            trainer_env(kafka_settings, model_path, ckpt, train_debug_pause=f"{stage}:{step}"),
            log,
        )
        kill_at_pause(proc, ckpt, stage, step, log)
    proc = start_trainer(trainer_env(kafka_settings, model_path, ckpt), log)
    assert proc.wait(180) == 0, log.read_text()[-3000:]
    result = json.loads(log.read_text().strip().splitlines()[-1])
    assert result["resumed_from"] == 6
    assert result["samples_trained"] == len(good) and result["dlq"] == 2

    store = CheckpointStore(ckpt)
    assert not store.recovered  # the last run exited cleanly
    manifests = store.manifests()
    assert [s for s, _ in manifests] == list(range(1, result["step"] + 1))
    trained = [c for _, m in manifests for c in m.trained]
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert set(trained) == set(ref_trained) == good
    assert {c for _, m in manifests for c in m.dlq} == bad
    latest = store.latest()
    assert latest is not None and latest.step == result["step"] and len(store.steps()) == 2
    assert latest.meta.offsets[kafka_settings.topics().samples] == {
        p: max(o for q, o in coords if q == p) + 1 for p in range(3)
    }

    # Policy versions: one per step, in order, none twice (step 5 was committed but not
    # published when killed: the restart published it).
    versions = policy_versions(kafka_settings)
    assert [v.version for v in versions] == list(range(1, result["step"] + 1))
    assert all(v.trainer_step == v.version for v in versions)
    last = versions[-1]
    assert last.samples_trained == len(good) and last.metrics["dlq"] == 2.0
    assert Path(last.checkpoint_uri) == latest.model_dir.resolve()
    model, _ = load_model(model_path)
    apply_state_dict(model, load_state_dict(last.checkpoint_uri))  # what the server reloads


def test_a_stale_sample_takes_no_room_in_the_batch(
    kafka_settings: CommonSettings, model_path: Path, tmp_path: Path
) -> None:
    # 4 fresh samples make step 1; then 2 of version 0 (stale at version 1) and 4 of version 1:
    # step 2 trains the 4 fresh ones, the stale pair is dropped, not a quarter of the batch each
    records = [(0, codec.encode(make_sample(i, version=0))) for i in range(6)]
    records += [(0, codec.encode(make_sample(i, version=1))) for i in range(6, 10)]
    coords = produce(kafka_settings, records)
    env = trainer_env(
        kafka_settings,
        model_path,
        tmp_path / "ckpt",
        train_max_staleness=0,
        train_batch_samples=4,
        train_token_budget=4096,
    )
    result = run(settings_from(env))
    assert (result.step, result.samples_trained, result.stale_dropped) == (2, 8, 2)
    manifests = dict(CheckpointStore(tmp_path / "ckpt").manifests())
    assert sorted(manifests[2].trained) == coords[6:] and sorted(manifests[2].stale) == coords[4:6]


def test_staleness_filter_drops_counts_and_dead_letters(
    kafka_settings: CommonSettings, model_path: Path, tmp_path: Path
) -> None:
    wrong_type = Event(
        event_id="e1", rollout_id="r", seq=0, ts=1, body=RolloutStarted(task_id="t", group_id="g")
    )
    records = [(0, codec.encode(make_sample(i, version=0))) for i in range(8)]
    records += [(0, codec.encode(make_sample(i, version=1))) for i in range(8, 12)]
    records.insert(2, (0, codec.encode(wrong_type)))
    coords = produce(kafka_settings, records)
    env = trainer_env(
        kafka_settings,
        model_path,
        tmp_path / "ckpt",
        train_max_staleness=0,
        train_batch_samples=4,
        train_token_budget=4096,
    )
    result = run(settings_from(env))
    # step 1 trains samples 0-3 at version 0; samples 4-7 (version 0) reach the step at
    # version 1: stale, no step; samples 8-11 (version 1) are step 2.
    assert (result.step, result.samples_trained, result.stale_dropped, result.dlq) == (2, 8, 4, 1)
    store = CheckpointStore(tmp_path / "ckpt")
    manifests = dict(store.manifests())
    sample_coords = [c for i, c in enumerate(coords) if i != 2]
    assert sorted(manifests[1].trained) == sample_coords[:4]
    assert manifests[1].dlq == [coords[2]]
    assert sorted(manifests[2].stale) == sample_coords[4:8]
    assert sorted(manifests[2].trained) == sample_coords[8:]
    latest = store.latest()
    assert latest is not None
    assert latest.meta.counters["stale_dropped"] == 4 and latest.meta.counters["dlq"] == 1

    versions = policy_versions(kafka_settings)
    assert [v.version for v in versions] == [1, 2]
    assert versions[0].metrics["stale_dropped"] == 0 and versions[1].metrics["stale_dropped"] == 4
    assert versions[1].metrics["stale_dropped_step"] == 4 and versions[1].ts > versions[0].ts

    dead = read_topic(kafka_settings, kafka_settings.topics().dlq)
    assert len(dead) == 1
    assert [k for k, _ in dead[0].headers()] == list(HEADER_NAMES)  # the one DLQ contract
    headers = read_headers(dead[0].headers())
    assert dead[0].value() == records[2][1]
    assert "expected Sample" in headers["reason"]
    assert (headers["code"], headers["kind"], headers["stage"]) == (
        CODE_UNDECODABLE,
        "Sample",
        "trainer",
    )
    assert headers["processor"] == kafka_settings.topics().name(TRAINER_GROUP)
    assert headers["original_topic"] == kafka_settings.topics().samples
    assert (int(headers["original_partition"]), int(headers["original_offset"])) == coords[2]
