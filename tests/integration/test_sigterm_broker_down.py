"""Every service stops cleanly on SIGTERM, with the broker up and with the broker gone.

Each case runs one service (``rollstream process``, ``sink``, ``workers``, ``controller``,
``proxy``, ``train``) as a subprocess against a private Kafka broker of this module (never the
session's), waits until it is up, and sends SIGTERM:

- broker up: the service exits 0 within ``UP_BOUND_S``; the processor and the sink have
  committed the offsets of the records they handled (three undecodable ones, dead-lettered);
- broker down (SIGKILLed ``BROKER_GONE_S`` before the SIGTERM): the service exits 0 within
  ``DOWN_BOUND_S`` and its log says what it could not commit.

The broker is restarted (same data dir and ports) before each case that needs it; the cases
with the broker up run first, so it is restarted once per broker-down case only.

One more case stops the trainer in the middle of a step with the broker gone: its checkpoint is
committed and its PolicyVersion cannot be published; it exits 0 within ``DOWN_BOUND_S`` (the
flushes of a stopping trainer are capped at 3 s each) and its log says what was not published.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from _logged_process import LoggedProcess
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from test_trainer import make_sample

from rollstream.adapters.topics import ensure_topics
from rollstream.inference.tinymodel import ensure_tiny_model
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port
from rollstream.schemas import Codec, CommonSettings

pytestmark = pytest.mark.integration

UP_BOUND_S = 10.0  # SIGTERM -> exit, broker up
DOWN_BOUND_S = 15.0  # SIGTERM -> exit, broker SIGKILLed
BROKER_GONE_S = 2.0  # between the broker's SIGKILL and the service's SIGTERM
START_S = 120.0  # a service's start-up (the trainer imports torch and transformers)
JUNK = 3  # undecodable records the processor and the sink dead-letter before the stop


@dataclass(frozen=True)
class Service:
    """How to run one service and see that it is up."""

    args: list[str]
    env: Callable[[Path, Path], dict[str, str]]  # (tmp_path, model dir) -> ROLLSTREAM_ vars
    ready: str  # "readyz", "livez" or "group:<consumer group without the namespace>"
    down_log: str  # a regex its log matches after a stop with the broker gone
    group: str | None = None  # consumer group whose commits over the events topic are checked
    down_env: dict[str, str] = field(default_factory=dict)  # more ROLLSTREAM_ vars, broker down


def _metrics(tmp: Path, model: Path) -> dict[str, str]:
    return {"ROLLSTREAM_METRICS_PORT": str(free_port())}


SERVICES: dict[str, Service] = {
    "process": Service(
        ["process"],
        lambda tmp, model: {
            **_metrics(tmp, model),
            "ROLLSTREAM_PROC_TIMER_INTERVAL_S": "0.5",
            # no commit on the timer: the records' offsets are committed by the stop, or not
            "ROLLSTREAM_PROC_COMMIT_INTERVAL_S": "600",
        },
        "readyz",
        r"offsets not committed \(read again at restart\): \{.*rollout\.events\[",
        group="rollstream-processor-v1",
    ),
    "sink": Service(
        ["sink", "-v"],
        lambda tmp, model: {
            **_metrics(tmp, model),
            "ROLLSTREAM_CLICKHOUSE_URL": f"chdb://{tmp / 'chdb'}",
            "ROLLSTREAM_ANALYTICS_PORT": str(free_port()),
            "ROLLSTREAM_SINK_FLUSH_INTERVAL_S": "0.5",
        },
        "readyz",
        r"not committed: \S+rollout\.events\[\d\]@\d",
        group="rollstream-sink-v1",
        # the inserted batches' commit waits: the broker is gone when it is tried
        down_env={"ROLLSTREAM_SINK_DEBUG_COMMIT_DELAY_S": "5"},
    ),
    "workers": Service(
        ["workers"],
        lambda tmp, model: {
            **_metrics(tmp, model),
            "ROLLSTREAM_ROLLOUTS_PROXY_URL": f"http://127.0.0.1:{free_port()}",
            "ROLLSTREAM_ROLLOUTS_REPORT_S": "0.5",  # load reports in flight when it stops
        },
        "readyz",
        r"stopping: [1-9]\d* records not acknowledged",
    ),
    "controller": Service(
        ["controller"],
        lambda tmp, model: {**_metrics(tmp, model), "ROLLSTREAM_CONTROL_PERIOD_S": "0.5"},
        "readyz",
        r"not published|no decision this period",  # it commits nothing
    ),
    "proxy": Service(
        ["proxy"],
        lambda tmp, model: {
            "ROLLSTREAM_PROXY_PORT": str(free_port()),
            "ROLLSTREAM_PROXY_MODEL_PATH": str(model),
            "ROLLSTREAM_PROXY_BACKENDS": f"http://127.0.0.1:{free_port()}",
            "ROLLSTREAM_SPOOL_DIR": str(tmp / "spool"),
        },
        "livez",
        r"stopped: events 0 sent, [1-9]\d* spooled",  # the RolloutStarted made after the kill
    ),
    "train": Service(
        ["train"],
        lambda tmp, model: {
            "ROLLSTREAM_MODEL_PATH": str(model),
            "ROLLSTREAM_MODEL_CREATE": "false",
            "ROLLSTREAM_CHECKPOINT_DIR": str(tmp / "checkpoints"),
        },
        "group:rollstream-trainer-v1",
        r'"steps_run": 0,',  # its result: no step, so nothing to commit (offsets go with steps)
    ),
}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory, kafka_classpath: str) -> Iterator[KafkaBroker]:
    """This module's own broker: the cases kill it."""
    data_dir: Path = tmp_path_factory.mktemp("kafka-sigterm")
    b = KafkaBroker(
        BrokerConfig(data_dir=data_dir, port=free_port(), controller_port=free_port()),
        classpath=kafka_classpath,
    )
    b.start(timeout=120)
    yield b
    b.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


# --------------------------------------------------------------------------- helpers


def _probe(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _group_stable(settings: CommonSettings, group: str) -> bool:
    admin = AdminClient(settings.kafka_config())
    try:
        found = admin.describe_consumer_groups([group], request_timeout=5)[group].result(10)
    except Exception:
        return False
    return bool(found.members) and str(found.state).endswith("STABLE")


def _wait_up(proc: LoggedProcess, service: Service, settings: CommonSettings) -> None:
    if service.ready.startswith("group:"):
        group = settings.topics().name(service.ready.removeprefix("group:"))

        def up() -> bool:
            return _group_stable(settings, group)
    else:
        port = proc.env.get("ROLLSTREAM_METRICS_PORT") or proc.env["ROLLSTREAM_PROXY_PORT"]
        url = f"http://127.0.0.1:{port}/{service.ready}"

        def up() -> bool:
            return _probe(url)

    deadline = time.monotonic() + START_S
    while not up():
        assert proc.proc is not None and proc.proc.poll() is None, proc.log_tail()
        assert time.monotonic() < deadline, f"not up in {START_S} s\n{proc.log_tail()}"
        time.sleep(0.2)


def _ends(settings: CommonSettings, topic: str) -> dict[int, int]:
    consumer = Consumer({**settings.kafka_config(), "group.id": f"it-{uuid.uuid4().hex}"})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in parts
        }
    finally:
        consumer.close()


def _committed(
    settings: CommonSettings, group: str, topic: str, parts: list[int]
) -> dict[int, int]:
    consumer = Consumer({**settings.kafka_config(), "group.id": group, "enable.auto.commit": False})
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in parts], timeout=10)
        return {tp.partition: max(tp.offset, 0) for tp in tps}
    finally:
        consumer.close()


def _produce_junk(settings: CommonSettings, topic: str) -> None:
    producer = Producer(settings.kafka_config())  # freed on return: no reconnects later
    for i in range(JUNK):
        producer.produce(topic, key=f"junk-{i}".encode(), value=b"\x00 not a record")
    assert producer.flush(30) == 0


def _dead_lettered(settings: CommonSettings, at_least: int, proc: LoggedProcess) -> None:
    """Until the dead-letter topic holds ``at_least`` records."""
    topic = settings.topics().dlq
    deadline = time.monotonic() + 60
    while sum(_ends(settings, topic).values()) < at_least:
        assert proc.proc is not None and proc.proc.poll() is None, proc.log_tail()
        assert time.monotonic() < deadline, f"nothing dead-lettered\n{proc.log_tail()}"
        time.sleep(0.2)


def _sigterm(proc: LoggedProcess, bound: float) -> tuple[int | None, float]:
    """SIGTERM; the exit code (None: still running after ``bound`` s, then SIGKILLed) and the
    seconds it took."""
    assert proc.proc is not None
    started = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    try:
        code: int | None = proc.proc.wait(bound)
    except subprocess.TimeoutExpired:
        code = None
        proc.kill()
    return code, time.monotonic() - started


# --------------------------------------------------------------------------- cases

CASES = [(name, up) for up in (True, False) for name in SERVICES]  # broker-up cases first


@pytest.mark.parametrize(
    ("name", "broker_up"), CASES, ids=[f"{n}-{'up' if u else 'down'}" for n, u in CASES]
)
def test_sigterm_stops_the_service(
    name: str, broker_up: bool, broker: KafkaBroker, model_dir: Path, tmp_path: Path
) -> None:
    service = SERVICES[name]
    broker.start(timeout=120)  # a restart after the previous case killed it
    settings = CommonSettings(
        kafka_bootstrap=broker.bootstrap, namespace=f"t{uuid.uuid4().hex[:10]}", home=tmp_path
    )
    ensure_topics(settings)
    env = service.env(tmp_path, model_dir) | ({} if broker_up else service.down_env)
    proc = LoggedProcess(service.args, settings, tmp_path, f"{name}.log", env)
    proc.start()
    try:
        _wait_up(proc, service, settings)
        events = settings.topics().events
        if service.group is not None:  # records to handle and commit: dead letters
            _produce_junk(settings, events)
            _dead_lettered(settings, JUNK, proc)
        if not broker_up:
            broker.kill()
            time.sleep(BROKER_GONE_S)
            if name == "proxy":  # an event to spool: the proxy answers without the broker
                port = proc.env["ROLLSTREAM_PROXY_PORT"]
                created = httpx.post(
                    f"http://127.0.0.1:{port}/v1/rollouts",
                    json={"task_id": "t", "group_id": "g"},
                    timeout=10,
                )
                assert created.status_code == 201, created.text
        bound = UP_BOUND_S if broker_up else DOWN_BOUND_S
        code, took = _sigterm(proc, bound)
    finally:
        proc.stop()
    log = proc.current_log()
    print(f"{name} broker {'up' if broker_up else 'down'}: exit {code} in {took:.2f} s")
    tail = _readable(log)
    assert code is not None, f"{name} still running {bound} s after SIGTERM\n{tail}"
    assert code == 0, f"{name} exited {code} after {took:.1f} s\n{tail}"
    if broker_up:
        if service.group is not None:
            ends = _ends(settings, events)
            group = settings.topics().name(service.group)
            assert _committed(settings, group, events, list(ends)) == ends, tail
    else:
        assert re.search(service.down_log, log), f"{name}: {service.down_log!r} not in\n{tail}"


def _readable(log: str, n: int = 40) -> str:
    """The log's last lines without librdkafka's and aiokafka's reconnect lines."""
    noise = ("%3|", "%4|", "%6|", "Group Coordinator Request failed", "Unable connect")
    return "\n".join([ln for ln in log.splitlines() if not any(x in ln for x in noise)][-n:])


def _produce_samples(settings: CommonSettings, n: int) -> None:
    producer = Producer(settings.kafka_config())  # freed on return: no reconnects later
    for i in range(n):
        producer.produce(settings.topics().samples, Codec().encode(make_sample(i)), partition=0)
    assert producer.flush(30) == 0


def test_sigterm_in_a_step_with_the_broker_down_stops_the_trainer(
    broker: KafkaBroker, model_dir: Path, tmp_path: Path
) -> None:
    broker.start(timeout=120)
    settings = CommonSettings(
        kafka_bootstrap=broker.bootstrap, namespace=f"t{uuid.uuid4().hex[:10]}", home=tmp_path
    )
    ensure_topics(settings)
    _produce_samples(settings, 4)  # one step
    ckpt = tmp_path / "checkpoints"
    env = SERVICES["train"].env(tmp_path, model_dir) | {
        "ROLLSTREAM_TRAIN_BATCH_SAMPLES": "4",
        "ROLLSTREAM_TRAIN_DEBUG_PAUSE": "committed:1",  # committed, not yet published
        "ROLLSTREAM_TRAIN_DEBUG_PAUSE_S": "1",
    }
    proc = LoggedProcess(["train"], settings, tmp_path, "train-step.log", env)
    proc.start()
    try:
        deadline = time.monotonic() + START_S
        while not (ckpt / "debug-paused.json").exists():
            assert proc.proc is not None and proc.proc.poll() is None, proc.log_tail()
            assert time.monotonic() < deadline, f"no step in {START_S} s\n{proc.log_tail()}"
            time.sleep(0.05)
        broker.kill()  # the step's PolicyVersion and ledger cannot be delivered
        code, took = _sigterm(proc, DOWN_BOUND_S)
    finally:
        proc.stop()
    log = proc.current_log()
    print(f"train in a step, broker down: exit {code} in {took:.2f} s")
    tail = _readable(log)
    assert code == 0, f"train exited {code} after {took:.1f} s\n{tail}"
    assert "stopping: PolicyVersion 1 not published" in log, tail
    assert '"step": 1,' in log, tail  # its result: the committed step
