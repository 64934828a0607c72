"""The elastic controller's staleness-aware admission on real parts: the session's Kafka broker,
the recording proxy (rollout routes only), a `rollstream workers` process (all stages, six RUN
slots, ``local`` sandboxes, an agent that waits 1.5 s) and the controller (`run`, in a thread).

The trainer's side of the log is written by the test: policy versions saying a step trains 2
samples, samples on the samples topic, and the trainer group's committed offsets. With
max_staleness 0 a rollout can start only while the next step can still train it: two at a time;
no more start until the processors closed them and their samples are consumed; then two more."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _kafka_read import read_topic
from _logged_process import LoggedProcess
from _rollout_stack import fresh_settings, tokenizer_proxy
from confluent_kafka import Consumer, Producer, TopicPartition

from rollstream.adapters.topics import high_watermarks
from rollstream.consumers.control.controller import TRAINER_GROUP, ControlSettings
from rollstream.consumers.control.controller import run as run_controller
from rollstream.producers.rollouts.jobqueue import submit_job
from rollstream.producers.rollouts.jobs import parse_job
from rollstream.schemas import Codec, CommonSettings, PolicyVersion
from rollstream.schemas.control import decode_decision, decode_report

pytestmark = pytest.mark.integration

ADMIN = "admin-key-for-controller-tests"


@pytest.fixture(scope="module")
def settings(kafka: Any, tmp_path_factory: pytest.TempPathFactory) -> CommonSettings:
    return fresh_settings(kafka.bootstrap, tmp_path_factory.mktemp("controller-home"))


@pytest.fixture(scope="module")
def proxy_url(settings: CommonSettings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("controller-proxy")
    with tokenizer_proxy(
        settings, tmp, admin_key=ADMIN, producer="it-controller", model_dir=tmp / "tiny"
    ) as url:
        yield url


def _produce(settings: CommonSettings, topic: str, values: list[bytes]) -> None:
    producer = Producer({**settings.kafka_config(), "acks": "all"})
    for v in values:
        producer.produce(topic, key=b"k", value=v)
    assert producer.flush(30) == 0


def _processed(settings: CommonSettings, n: int) -> None:
    """What the processors write for ``n`` closed rollouts: a trajectory and a sample each
    (the controller counts records; their contents are the processors' business)."""
    _produce(settings, settings.topics().trajectories, [b"t"] * n)
    _produce(settings, settings.topics().samples, [b"s"] * n)


def _train_all(settings: CommonSettings) -> None:
    """The trainer group commits at the samples topic's end: every sample consumed."""
    topic = settings.topics().samples
    consumer = Consumer(
        {**settings.kafka_config(), "group.id": settings.topics().name(TRAINER_GROUP)}
    )
    highs = high_watermarks(consumer, topic)
    consumer.commit(
        offsets=[TopicPartition(topic, p, h) for p, h in highs.items()], asynchronous=False
    )
    consumer.close()


def _run_load(settings: CommonSettings) -> tuple[int, int, int]:
    """(RUN started, RUN held at most in one report, EVAL done) over the reports so far."""
    started = held = done = 0
    for m in read_topic(settings, settings.topics().control_workers, 10):
        rep = decode_report(m.value())
        if "run" in rep.stages:
            started = max(started, rep.stages["run"].started)
            held = max(held, rep.stages["run"].in_flight)
        if "eval" in rep.stages:
            done = max(done, rep.stages["eval"].done)
    return started, held, done


def _decided(settings: CommonSettings) -> bool:
    return bool(read_topic(settings, settings.topics().control_decisions, 10))


def _reported(settings: CommonSettings) -> bool:
    return bool(read_topic(settings, settings.topics().control_workers, 10))


def _until(cond: Any, timeout: float, what: Any) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.3)


def _history(settings: CommonSettings) -> str:
    out = []
    for m in read_topic(settings, settings.topics().control_decisions, 10):
        d = decode_decision(m.value())
        out.append(f"{d.ts:.1f} slots={d.run_slots} admit={d.admit} {d.per_worker} {d.reason}")
    for m in read_topic(settings, settings.topics().control_workers, 10):
        r = decode_report(m.value())
        out.append(f"{r.ts:.1f} {r.stages.get('run')}")
    return "\n".join(sorted(out))


def _said(settings: CommonSettings, workers: LoggedProcess) -> str:
    decisions = read_topic(settings, settings.topics().control_decisions, 10)
    last = decode_decision(decisions[-1].value()) if decisions else None
    return f"load {_run_load(settings)}; last decision {last}\n{workers.log_tail()}"


def test_admission_starts_only_rollouts_the_trainer_can_still_train(
    settings: CommonSettings, proxy_url: str, tmp_path: Path
) -> None:
    codec = Codec()
    _produce(
        settings,
        settings.topics().policy,
        [
            codec.encode(PolicyVersion(v, f"file:///ckpt/{v}", v, int(time.time() * 1e6), 2 * v))
            for v in (1, 2)
        ],
    )
    stop = threading.Event()
    control = ControlSettings(
        **{**settings.model_dump(), "control_max_staleness": 0, "control_period_s": 0.3}
    )
    controller = threading.Thread(target=run_controller, args=(control,), kwargs={"stop": stop})
    controller.start()
    workers = LoggedProcess(
        ["workers", "--stage", "all", "--concurrency", "6"],
        settings,
        tmp_path,
        "workers.log",
        env={
            "ROLLSTREAM_ROLLOUTS_PROXY_URL": proxy_url,
            "ROLLSTREAM_ROLLOUTS_ADMIN_KEY": ADMIN,
            "ROLLSTREAM_ROLLOUTS_SANDBOX_ROOT": str(tmp_path / "sandboxes"),
            "ROLLSTREAM_ROLLOUTS_REPORT_S": "0.3",
        },
    )
    workers.start()
    try:
        # the worker follows the controller once it has read a decision (until then it is
        # fail-open, at its concurrency): queue the job once a decision is on the log and the
        # worker reports (it reads the newest decision at start and polls every 0.2 s)
        _until(lambda: _decided(settings) and _reported(settings), 90,
               lambda: _said(settings, workers))  # fmt: skip
        time.sleep(1.0)
        job = parse_job(
            {
                "job_id": "admit-1",
                "tasks": {
                    "inline": [
                        {
                            "task_id": "t0",
                            "title": "wait",
                            "difficulty": "easy",
                            "prompt": "wait",
                            "files": {"a.txt": "a"},
                            "hidden_tests": {"test_a.py": "def test_a():\n    pass\n"},
                        }
                    ]
                },
                "samples_per_task": 6,
                "agent": {"kind": "command", "argv": ["sh", "-c", "sleep 1.5"]},
                "evaluator": {"kind": "command", "argv": ["true"]},
                "sandbox": {"kind": "local"},
            }
        )
        submit_job(settings, job)
        _until(lambda: _run_load(settings)[2] >= 2, 90, lambda: _said(settings, workers))
        time.sleep(2.0)  # decisions keep coming; nothing else may start
        started, held, _ = _run_load(settings)
        assert (started, held) == (2, 2), _history(settings)

        _processed(settings, 2)  # the processors close them, their samples are trained
        _train_all(settings)
        _until(lambda: _run_load(settings)[2] >= 4, 60, lambda: _said(settings, workers))
        time.sleep(2.0)
        started, held, _ = _run_load(settings)
        assert (started, held) == (4, 2), workers.log_tail()

        _processed(settings, 2)
        _train_all(settings)
        _until(lambda: _run_load(settings)[2] >= 6, 60, lambda: _said(settings, workers))
    finally:
        stop.set()
        controller.join(timeout=30)
        workers.stop()
    decisions = [
        decode_decision(m.value())
        for m in read_topic(settings, settings.topics().control_decisions, 10)
    ]
    assert any(d.admit == 0 and d.run_slots == 2 for d in decisions)  # full: 2 held, none more
    assert decisions[-1].signals["samples_per_step"] == 2.0  # from the policy versions
