"""Metrics and probes of the real services: the proxy in front of the reference model server
(both over HTTP, in this process) and the stream processor (``rollstream process`` with
ROLLSTREAM_METRICS_PORT), scraped and parsed with prometheus_client's parser after real work."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from _processor_process import Worker, reading
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families

from rollstream.inference.server import create_app as create_model_app
from rollstream.inference.settings import ModelServerSettings
from rollstream.inference.tinymodel import ensure_tiny_model
from rollstream.producers import Recorder
from rollstream.producers.proxy.app import create_app as create_proxy_app
from rollstream.producers.proxy.settings import ProxySettings
from rollstream.schemas import (
    Codec,
    CommonSettings,
    Event,
    LlmCall,
    Reward,
    RolloutFinished,
    RolloutStarted,
)

pytestmark = pytest.mark.integration

ADMIN = "admin-key-for-metrics-tests"
METRICS_KEY = "scrape-key"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """An ASGI app under uvicorn in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def scrape(url: str, key: str | None = None) -> Samples:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# --------------------------------------------------------------------------- proxy + model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def test_proxy_and_model_server_count_the_same_calls(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path
) -> None:
    model = ModelServerSettings(
        model_path=model_dir, model_create=False, metrics_key=METRICS_KEY, model_max_batch=4
    )
    with serve(create_model_app(model)) as model_url:
        settings = ProxySettings(
            **{**kafka_settings.model_dump(), "metrics_key": METRICS_KEY},
            spool_dir=tmp_path / "spool", producer="metrics-it",
            proxy_backends=[model_url], proxy_model_path=model_dir, proxy_api_keys=[ADMIN],
            proxy_token_secret="secret-for-metrics-tests", proxy_health_interval_s=0.5,
        )  # fmt: skip
        recorder = Recorder(settings)
        try:
            with serve(create_proxy_app(settings, recorder=recorder)) as url:
                _proxy_and_model(url, model_url, recorder)
        finally:
            recorder.close(30)


def _proxy_and_model(url: str, model_url: str, recorder: Recorder) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    # the probes are open, /metrics needs the key
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{model_url}/metrics").status_code == 401
    assert httpx.get(f"{url}/livez").json() == {"status": "ok"}
    ready = httpx.get(f"{url}/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {
        "backends": {"ok": True, "detail": "1 of 1 healthy"},
        "events": {"ok": True, "detail": "healthy"},
    }
    assert httpx.get(f"{model_url}/readyz").status_code == 200
    before = scrape(url, METRICS_KEY)
    model_before = scrape(model_url, METRICS_KEY)

    created = httpx.post(
        f"{url}/v1/rollouts", json={"task_id": "t", "group_id": "g"}, headers=admin
    )
    assert created.status_code == 201, created.text
    ro = created.json()
    auth = {"Authorization": f"Bearer {ro['token']}"}
    calls, messages = 3, [{"role": "user", "content": "count to three"}]
    for i in range(calls):
        resp = httpx.post(
            f"{ro['base_url']}/chat/completions",
            json={"model": "rollstream-tiny", "messages": messages, "max_tokens": 6, "seed": i},
            headers=auth,
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
    refused = httpx.post(
        f"{ro['base_url']}/chat/completions",
        json={"model": "rollstream-tiny", "messages": messages},
        headers={"Authorization": "Bearer not-a-token"},
    )
    assert refused.status_code == 401
    assert recorder.flush(30)

    after = scrape(url, METRICS_KEY)
    chat = "/rollouts/{rollout_id}/v1/chat/completions"
    assert value(after, "rollstream_proxy_requests_total", route=chat, code="200") == calls
    assert value(after, "rollstream_proxy_requests_total", route=chat, code="401") == 1
    assert value(after, "rollstream_proxy_requests_total", route="/v1/rollouts", code="201") == 1
    assert value(after, "rollstream_proxy_request_seconds_count", route=chat) == calls + 1
    assert value(after, "rollstream_proxy_rollouts_open") == 1
    assert value(after, "rollstream_proxy_rollouts_created_total") == 1
    assert value(after, "rollstream_proxy_backend_up", backend=model_url) == 1
    assert value(after, "rollstream_proxy_pool_events_total", event="completed") == calls
    # RolloutStarted + one LlmCall per call, all acknowledged by the broker
    sent = value(after, "rollstream_proxy_events_total", outcome="sent")
    assert sent - value(before, "rollstream_proxy_events_total", outcome="sent") == 1 + calls
    tokens = {
        kind: value(after, "rollstream_proxy_tokens_total", kind=kind)
        - value(before, "rollstream_proxy_tokens_total", kind=kind)
        for kind in ("prompt", "completion")
    }
    assert tokens["prompt"] > 0 and 0 < tokens["completion"] <= 6 * calls

    # the model server generated exactly what the proxy counted
    model = scrape(model_url, METRICS_KEY)
    for kind in ("prompt", "completion"):
        grown = value(model, "rollstream_model_tokens_total", kind=kind) - value(
            model_before, "rollstream_model_tokens_total", kind=kind
        )
        assert grown == tokens[kind], kind
    completions = ("rollstream_model_requests_total", {"route": "/v1/completions", "code": "200"})
    assert value(model, completions[0], **completions[1]) == calls
    assert value(model, "rollstream_model_generate_seconds_count") == calls
    assert value(model, "rollstream_model_policy_version") == 0

    # paused for a weight update: the model server is not ready, then is again
    assert httpx.post(f"{model_url}/pause?mode=wait").status_code == 200
    paused = httpx.get(f"{model_url}/readyz")
    assert paused.status_code == 503
    assert paused.json()["checks"]["serving"] == {"ok": False, "detail": "paused"}
    assert value(scrape(model_url, METRICS_KEY), "rollstream_model_paused") == 1
    assert httpx.post(f"{model_url}/resume").status_code == 200
    assert httpx.get(f"{model_url}/readyz").status_code == 200


# --------------------------------------------------------------------------- processor

codec = Codec()


def rollout(rng: np.random.Generator, rid: str, gid: str, reward: float) -> list[Event]:
    ts0 = time.time_ns() // 1000
    bodies: list[Any] = [RolloutStarted(task_id="t", group_id=gid, group_size=2)]
    bodies.append(
        LlmCall(
            f"{rid}-c0",
            None,
            0,
            rng.integers(0, 1000, 12, dtype=np.uint32),
            rng.integers(0, 1000, 6, dtype=np.uint32),
            -rng.random(6, dtype=np.float32),
        )
    )
    bodies += [Reward(reward), RolloutFinished()]
    return [Event(f"{rid}-{i:04d}", rid, i, ts0 + i, b, "it") for i, b in enumerate(bodies)]


def test_processor_metrics_follow_the_stream(
    kafka_settings: CommonSettings, tmp_path: Path
) -> None:
    port = free_port()
    worker = Worker(kafka_settings, tmp_path)
    worker.env["ROLLSTREAM_METRICS_PORT"] = str(port)
    worker.env["ROLLSTREAM_LOG_FORMAT"] = "json"
    url = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(5)
    events = rollout(rng, "m-r0", "m-g0", 0.0) + rollout(rng, "m-r1", "m-g0", 1.0)
    records = [(e.rollout_id.encode(), codec.encode(e)) for e in events]
    records.append((b"junk", b"\x00 not a record"))
    worker.start()
    try:

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 90, f"the processor's /readyz\n{worker.log_tail()}")
        assert httpx.get(f"{url}/livez").json() == {"status": "ok"}
        start = scrape(url)
        assert value(start, "rollstream_processor_rollouts_closed_total") == 0
        with reading(kafka_settings, kafka_settings.topics().samples) as samples:
            producer = Producer(kafka_settings.kafka_config())
            for key, value_ in records:
                producer.produce(kafka_settings.topics().events, key=key, value=value_)
            assert producer.flush(30) == 0
            samples.wait(lambda rs: len(rs) >= 2, 60, worker)

        def counted() -> bool:
            got = scrape(url)
            return value(got, "rollstream_processor_samples_total") >= 2

        wait_for(counted, 30, "the processor's counters")
        got = scrape(url)
        assert value(got, "rollstream_processor_records_total", stage="builder") == len(records)
        assert value(got, "rollstream_processor_rollouts_closed_total") == 2
        assert value(got, "rollstream_processor_rollouts_open") == 0
        assert value(got, "rollstream_processor_groups_closed_total") == 1
        assert value(got, "rollstream_processor_samples_total") == len(samples.records)
        dead = ("rollstream_processor_dead_letters_total", "builder", "undecodable")
        assert value(got, dead[0], stage=dead[1], code=dead[2]) == 1
        assert value(got, "process_resident_memory_bytes") > 0
    finally:
        worker.stop()
    # its log, faust's lines included, is one JSON object a line
    lines = [json.loads(line) for line in worker.current_log().splitlines() if line.strip()]
    loggers = {line["logger"] for line in lines}
    assert "rollstream.adapters.metrics" in loggers
    assert any(name.startswith("faust") for name in loggers), sorted(loggers)
