"""The parts a rollout needs, for integration tests: the reference model server (the tiny model)
and the recording proxy, each started through the CLI (`rollstream serve-model`,
`rollstream proxy`) on the session's Kafka broker (or a proxy alone, with the model's tokenizer
and no backend), settings with a namespace of their own, and the rollout's events read back from
the events topic once its RolloutFinished is there."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from _kafka_read import read_topic
from _logged_process import LoggedProcess

from rollstream.adapters.topics import ensure_topics
from rollstream.inference.tinymodel import ensure_tiny_model
from rollstream.infra.kafka import free_port
from rollstream.schemas import Codec, CommonSettings, Event, RolloutFinished

TOKEN_SECRET = "secret-for-rollout-integration-tests"


def wait_healthy(url: str, proc: LoggedProcess, timeout: float = 180.0) -> None:
    """Until ``url``/health answers 200; fails with the process's log when it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.proc is not None and proc.proc.poll() is None, proc.log_tail()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not come up:\n{proc.log_tail()}")


@contextmanager
def rollout_stack(
    settings: CommonSettings, tmp: Path, *, admin_key: str, producer: str
) -> Iterator[str]:
    """The model server and the proxy (admin key ``admin_key``, Kafka producer id
    ``producer``), logging under ``tmp``; yields the proxy's URL and stops both on exit."""
    model_dir = ensure_tiny_model(tmp / "models" / "tiny")
    model_port, proxy_port = free_port(), free_port()
    model = LoggedProcess(
        ["serve-model"],
        settings,
        tmp,
        "model.log",
        env={
            "ROLLSTREAM_MODEL_PATH": str(model_dir),
            "ROLLSTREAM_MODEL_PORT": str(model_port),
            "ROLLSTREAM_MODEL_CREATE": "false",
        },
    )
    proxy = LoggedProcess(
        ["proxy"],
        settings,
        tmp,
        "proxy.log",
        env={
            "ROLLSTREAM_PROXY_PORT": str(proxy_port),
            "ROLLSTREAM_PROXY_BACKENDS": f"http://127.0.0.1:{model_port}",
            "ROLLSTREAM_PROXY_MODEL_PATH": str(model_dir),
            "ROLLSTREAM_PROXY_API_KEYS": admin_key,
            "ROLLSTREAM_PROXY_TOKEN_SECRET": TOKEN_SECRET,
            "ROLLSTREAM_PROXY_HEALTH_INTERVAL_S": "0.5",
            "ROLLSTREAM_SPOOL_DIR": str(tmp / "spool"),
            "ROLLSTREAM_PRODUCER": producer,
        },
    )
    model.start()
    proxy.start()  # both load at once; the proxy waits for its backend
    try:
        wait_healthy(f"http://127.0.0.1:{model_port}", model)
        url = f"http://127.0.0.1:{proxy_port}"
        wait_healthy(url, proxy)
        yield url
    finally:
        proxy.stop()
        model.stop()


def tokenizer_proxy_process(
    settings: CommonSettings, tmp: Path, *, admin_key: str, producer: str, model_dir: Path,
    port: int,
) -> LoggedProcess:  # fmt: skip
    """A proxy with the tiny model's tokenizer and no backend (not started)."""
    return LoggedProcess(
        ["proxy"],
        settings,
        tmp,
        "proxy.log",
        env={
            "ROLLSTREAM_PROXY_PORT": str(port),
            "ROLLSTREAM_PROXY_BACKENDS": f"http://127.0.0.1:{free_port()}",  # never called
            "ROLLSTREAM_PROXY_MODEL_PATH": str(ensure_tiny_model(model_dir)),
            "ROLLSTREAM_PROXY_API_KEYS": admin_key,
            "ROLLSTREAM_PROXY_TOKEN_SECRET": TOKEN_SECRET,
            "ROLLSTREAM_SPOOL_DIR": str(tmp / "spool"),
            "ROLLSTREAM_PRODUCER": producer,
        },
    )


def wait_routes(url: str, proxy: LoggedProcess, timeout: float = 120.0) -> None:
    """Until the proxy's routes answer (its /health is 503 without a backend)."""
    deadline = time.monotonic() + timeout
    while True:
        if proxy.proc is None or proxy.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the proxy did not come up:\n{proxy.log_tail()}")
        try:
            if httpx.get(f"{url}/openapi.json", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)  # not listening yet: nothing to wait on but the port


@contextmanager
def tokenizer_proxy(
    settings: CommonSettings, tmp: Path, *, admin_key: str, producer: str, model_dir: Path
) -> Iterator[str]:
    """A proxy with the tiny model's tokenizer and no backend (for the rollout and job routes:
    no model call is made); yields its URL once its routes answer, stops it on exit."""
    port = free_port()
    proxy = tokenizer_proxy_process(
        settings, tmp, admin_key=admin_key, producer=producer, model_dir=model_dir, port=port
    )
    proxy.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_routes(url, proxy)
        yield url
    finally:
        proxy.stop()


def fresh_settings(bootstrap: str, home: Path) -> CommonSettings:
    """Settings on the session broker with a namespace of their own, its topics created."""
    s = CommonSettings(kafka_bootstrap=bootstrap, namespace=f"t{uuid.uuid4().hex[:10]}", home=home)
    ensure_topics(s)
    return s


def events_of(settings: CommonSettings, rollout_id: str, timeout: float = 30.0) -> list[Event]:
    """The rollout's events in seq order, once its RolloutFinished is on the topic."""
    codec = Codec()
    deadline = time.monotonic() + timeout
    while True:
        messages = read_topic(settings, settings.topics().events, timeout)
        events = [codec.decode(m.value()) for m in messages]
        mine = sorted((e for e in events if e.rollout_id == rollout_id), key=lambda e: e.seq)
        if any(isinstance(e.body, RolloutFinished) for e in mine):
            assert [e.seq for e in mine] == list(range(len(mine)))
            return mine
        assert time.monotonic() < deadline, f"no RolloutFinished for {rollout_id}: {mine}"
        time.sleep(0.3)
