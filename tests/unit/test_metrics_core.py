"""adapters/metrics.py and the JSON log format: registries kept apart, values read at scrape
time, the key on /metrics (probes open), readiness and liveness states, one JSON object a line."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr, ValidationError
from starlette.applications import Starlette
from starlette.testclient import TestClient

from rollstream.adapters.metrics import (
    Health,
    MetricsServer,
    ServiceMetrics,
    metrics_routes,
    serve_metrics,
)
from rollstream.infra.logs import setup_logging
from rollstream.schemas import CommonSettings


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_two_services_of_one_name_keep_their_own_registries() -> None:
    a, b = ServiceMetrics("proxy", process=False), ServiceMetrics("proxy", process=False)
    ca = a.counter("requests", "requests", ("route", "code"))
    cb = b.counter("requests", "requests", ("route", "code"))  # no "duplicated timeseries"
    ca.labels("/x", "200").inc(3)
    cb.labels("/x", "500").inc()
    got_a, got_b = samples(a.exposition().decode()), samples(b.exposition().decode())
    key = "rollstream_proxy_requests_total"
    assert got_a[(key, (("code", "200"), ("route", "/x")))] == 3
    assert (key, (("code", "500"), ("route", "/x"))) not in got_a
    assert got_b[(key, (("code", "500"), ("route", "/x")))] == 1
    with pytest.raises(ValueError):  # within one registry a name is still unique
        a.counter("requests", "again")


def test_callback_families_read_their_values_at_scrape_time() -> None:
    m = ServiceMetrics("sink", process=False)
    rows = {"events": 5}
    m.counter_fn("rows", "rows by table", lambda: {(t,): n for t, n in rows.items()}, ("table",))
    m.gauge_fn("open", "open things", lambda: len(rows))
    m.gauge_fn("broken", "a reader that fails", lambda: 1 / 0)
    first = samples(m.exposition().decode())
    rows["samples"] = 7
    rows["events"] += 1
    second = samples(m.exposition().decode())
    assert first[("rollstream_sink_rows_total", (("table", "events"),))] == 5
    assert second[("rollstream_sink_rows_total", (("table", "events"),))] == 6
    assert second[("rollstream_sink_rows_total", (("table", "samples"),))] == 7
    assert (first[("rollstream_sink_open", ())], second[("rollstream_sink_open", ())]) == (1, 2)
    assert not any(name == "rollstream_sink_broken" for name, _ in second)  # no samples, no 500
    with pytest.raises(ValueError):
        m.gauge_fn("open", "twice", lambda: 0)


def test_process_metrics_are_in_each_registry() -> None:
    text = ServiceMetrics("workers").exposition().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "python_info" in names


def test_readiness_from_set_and_watched_checks() -> None:
    h = Health()
    assert h.ready() == (True, {})  # nothing to wait for
    h.set("consumer", False, "starting")
    state = {"ok": True}
    h.watch("backends", lambda: (state["ok"], "1 of 1 healthy" if state["ok"] else "0 of 1"))
    ok, checks = h.ready()
    assert not ok and checks["consumer"] == {"ok": False, "detail": "starting"}
    h.set("consumer", True)
    assert h.ready()[0]
    state["ok"] = False
    ok, checks = h.ready()
    assert not ok and checks["backends"] == {"ok": False, "detail": "0 of 1"}

    def broken() -> tuple[bool, str]:
        raise RuntimeError("closed")

    h.watch("backends", broken)
    ok, checks = h.ready()
    assert not ok and checks["backends"]["detail"] == "RuntimeError: closed"


def test_liveness_follows_the_heartbeat_once_there_is_one() -> None:
    now = [100.0]
    h = Health(stale_s=10.0, clock=lambda: now[0])
    assert h.live() == (True, None)  # no heartbeat kept: alive while it answers
    h.beat()
    now[0] += 10.0
    assert h.live() == (True, 10.0)
    now[0] += 0.5
    assert h.live() == (False, 10.5)
    h.beat()
    assert h.live()[0]


@pytest.fixture
def served() -> Iterator[tuple[MetricsServer, ServiceMetrics]]:
    m = ServiceMetrics("processor", process=False)
    m.counter("records", "records").inc(4)
    m.health.set("tables", False, "recovering rollouts")
    settings = CommonSettings(metrics_port=0, metrics_key=SecretStr("k3y"))
    found = serve_metrics(settings, m)
    assert found is not None
    yield found, m
    found.stop()


def test_served_metrics_need_the_key_and_the_probes_do_not(
    served: tuple[MetricsServer, ServiceMetrics],
) -> None:
    server, metrics = served
    url = server.url
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    ok = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer k3y"})
    assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/plain")
    assert samples(ok.text)[("rollstream_processor_records_total", ())] == 4
    live = httpx.get(f"{url}/livez")
    assert (live.status_code, live.json()) == (200, {"status": "ok"})
    ready = httpx.get(f"{url}/readyz")
    assert ready.status_code == 503
    assert ready.json() == {
        "status": "not ready",
        "checks": {"tables": {"ok": False, "detail": "recovering rollouts"}},
    }
    metrics.health.set("tables", True, "recovered")
    assert httpx.get(f"{url}/readyz").status_code == 200
    assert httpx.get(f"{url}/nothing").status_code == 404


def test_no_port_no_server() -> None:
    assert serve_metrics(CommonSettings(), ServiceMetrics("trainer", process=False)) is None
    with pytest.raises(ValidationError):
        CommonSettings(metrics_port=70000)
    with pytest.raises(ValidationError):
        CommonSettings(log_format="xml")


def test_starlette_routes_answer_as_the_thread_server() -> None:
    m = ServiceMetrics("model", process=False)
    m.gauge("policy_version", "version").set(3)
    now = [0.0]
    m.health = Health(stale_s=5.0, clock=lambda: now[0])
    app = Starlette(routes=metrics_routes(m, None))
    with TestClient(app) as client:
        got = client.get("/metrics")
        assert got.status_code == 200
        assert samples(got.text)[("rollstream_model_policy_version", ())] == 3
        m.health.beat()
        now[0] = 6.0
        stalled = client.get("/livez")
        assert stalled.status_code == 503 and stalled.json()["status"] == "stalled"
        assert client.get("/readyz").json() == {"status": "ready", "checks": {}}


def _log_lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_log_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    before = list(root.handlers), root.level
    try:
        monkeypatch.setenv("ROLLSTREAM_LOG_FORMAT", "json")
        stream = io.StringIO()
        setup_logging(0, service=True, stream=stream)  # the format from the settings
        log = logging.getLogger("rollstream.test")
        log.info('a "quoted" message\nover two lines: %d', 7)
        try:
            raise KeyError("k")
        except KeyError:
            log.exception("failed")
        logging.getLogger("rollstream.test").debug("below the threshold")
        first, second = _log_lines(stream)
        assert first["level"] == "INFO" and first["logger"] == "rollstream.test"
        assert first["message"] == 'a "quoted" message\nover two lines: 7'
        assert str(first["ts"]).endswith("Z") and "exc" not in first
        assert second["level"] == "ERROR" and "KeyError: 'k'" in str(second["exc"])

        monkeypatch.setenv("ROLLSTREAM_LOG_FORMAT", "text")
        text = io.StringIO()
        setup_logging(0, service=True, stream=text)
        log.info("plain")
        assert text.getvalue().rstrip().endswith("INFO rollstream.test: plain")
    finally:
        for h in list(root.handlers):
            if h not in before[0]:
                root.removeHandler(h)
        root.setLevel(before[1])


def test_trainer_metrics_follow_the_committed_checkpoints() -> None:
    from rollstream.consumers.training.checkpoint import CheckpointMeta
    from rollstream.consumers.training.metrics import TrainerMetrics

    def meta(step: int, stale: float, loss: float) -> CheckpointMeta:
        return CheckpointMeta(
            step=step,
            policy_version=step,
            samples_trained=10 * step,
            tokens_trained=100 * step,
            counters={"stale_dropped": stale, "dlq": 1.0, "duplicates_dropped": 0.0},
            metrics={"loss": loss, "clip_frac": 0.25, "approx_kl": 0.01, "grad_norm": 2.0,
                     "step_time_s": 0.3, "policy_version_min": float(step - 3)},
        )  # fmt: skip

    t = TrainerMetrics()
    assert not t.service.health.ready()[0]
    t.resume(meta(4, 2.0, 0.5))  # restored: totals from the checkpoint, no step timed
    t.observe_step(meta(5, 3.0, float("nan")))
    got = samples(t.service.exposition().decode())
    assert got[("rollstream_trainer_steps_total", ())] == 5
    assert got[("rollstream_trainer_samples_trained_total", ())] == 50
    assert got[("rollstream_trainer_dropped_samples_total", (("reason", "stale"),))] == 3
    assert got[("rollstream_trainer_dropped_samples_total", (("reason", "dlq"),))] == 1
    assert got[("rollstream_trainer_step_seconds_count", ())] == 1
    assert got[("rollstream_trainer_staleness_sum", ())] == 2  # version 4 trained, oldest 2
    assert got[("rollstream_trainer_clip_fraction", ())] == 0.25
    assert ("rollstream_trainer_loss", ()) not in got  # a NaN loss is left out
    assert t.service.health.ready() == (True, {"trainer": {"ok": True, "detail": "step 5"}})
