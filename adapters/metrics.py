"""Prometheus metrics and the liveness / readiness probes of every rollstream service.

    ServiceMetrics(service)        one service's CollectorRegistry (never the process-wide
                                   default: several services may share a test process), names
                                   prefixed ``rollstream_<service>_``, and its ``Health``
    Health                         named readiness checks (``set`` pushed, ``watch`` read at
                                   probe time) and the main loop's liveness heartbeat (``beat``)
    metrics_routes(metrics, key)   GET /metrics, /livez, /readyz as Starlette routes (the proxy,
                                   the model server)
    serve_metrics(settings, m)     the same three routes on ``metrics_host:metrics_port`` in a
                                   daemon thread (stdlib HTTP server) for the services that serve
                                   no HTTP; None when ``metrics_port`` is None

    GET /metrics   Prometheus text format; with a key, only for ``Authorization: Bearer KEY``
                   (else 401)
    GET /livez     200 {"status": "ok"} while the heartbeat is fresh (or none is kept), else 503
    GET /readyz    200 / 503 {"status": "ready" | "not ready", "checks": {name: {ok, detail}}}
                   The probes are open: they show check names and words, never numbers or keys.

Counters a service keeps already (a stats dataclass, a dict of tallies) are exported as they
are, read at scrape time (``counter_fn``, ``gauge_fn``): the hot paths gain nothing to do.
Starlette is imported only by ``metrics_routes`` (the processors and the stage workers do not
install it); prometheus_client is an extra (``cli``), never imported by the SDK.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import SecretStr

from rollstream.schemas.settings import CommonSettings

__all__ = [
    "LATENCY_BUCKETS",
    "Health",
    "MetricsServer",
    "ProbeAnswer",
    "ServiceMetrics",
    "answer_probe",
    "metrics_routes",
    "serve_metrics",
]

log = logging.getLogger("rollstream.adapters.metrics")

# seconds: a proxied model call takes milliseconds to minutes, a stage of a rollout up to hours
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip
Values = float | int | Mapping[tuple[str, ...], float | int]
Check = Callable[[], tuple[bool, str]]


class Health:
    """Readiness checks by name and a liveness heartbeat. Thread-safe.

    Ready: every check is ok (``set`` keeps the last verdict; a ``watch`` function is called at
    each probe, and one that raises is not ok); a service with no checks is ready once it
    answers. Live: no heartbeat was ever given (an HTTP service answering is alive), or the
    last ``beat()`` is at most ``stale_s`` old."""

    def __init__(self, stale_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_s, self._clock = stale_s, clock
        self._lock = threading.Lock()
        self._set: dict[str, tuple[bool, str]] = {}
        self._watched: dict[str, Check] = {}
        self._beat: float | None = None

    def set(self, check: str, ok: bool, detail: str = "") -> None:
        with self._lock:
            self._set[check] = (bool(ok), detail[:200])

    def watch(self, check: str, fn: Check) -> None:
        """``fn() -> (ok, detail)`` decides ``check`` at every probe."""
        with self._lock:
            self._watched[check] = fn

    def beat(self) -> None:
        """The main loop went round once (liveness)."""
        self._beat = self._clock()

    def live(self) -> tuple[bool, float | None]:
        """(alive?, seconds since the last beat or None)."""
        last = self._beat
        if last is None:
            return True, None
        age = self._clock() - last
        return age <= self.stale_s, age

    def ready(self) -> tuple[bool, dict[str, dict[str, Any]]]:
        with self._lock:
            verdicts = dict(self._set)
            watched = dict(self._watched)
        for name, fn in watched.items():
            try:
                ok, detail = fn()
            except Exception as exc:  # a probe never raises: the check is not ok, with why
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            verdicts[name] = (bool(ok), str(detail)[:200])
        checks = {name: {"ok": ok, "detail": detail} for name, (ok, detail) in verdicts.items()}
        return all(ok for ok, _ in verdicts.values()), checks


@dataclass(frozen=True, slots=True)
class _Fn:
    kind: Literal["counter", "gauge"]
    name: str
    doc: str
    labels: tuple[str, ...]
    fn: Callable[[], Values]


class _Callbacks:
    """A collector of families whose values are read at scrape time."""

    def __init__(self) -> None:
        self.fns: list[_Fn] = []

    def _family(self, f: _Fn) -> CounterMetricFamily | GaugeMetricFamily:
        kind = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
        return kind(f.name, f.doc, labels=f.labels)

    def describe(self) -> Iterator[Metric]:
        for f in self.fns:
            yield self._family(f)

    def collect(self) -> Iterator[Metric]:
        for f in self.fns:
            family = self._family(f)
            try:
                values = f.fn()
            except Exception:  # the state went away (a stopping service): no samples
                log.debug("metric %s not read", f.name, exc_info=True)
                values = {}
            if isinstance(values, Mapping):
                for key, value in values.items():
                    family.add_metric(list(key), float(value))
            else:
                family.add_metric([], float(values))
            yield family


class ServiceMetrics:
    """One service's metrics (``rollstream_<service>_<name>``) and its Health. Counters are
    named without ``_total`` (the exposition adds it), histograms with their unit."""

    def __init__(self, service: str, *, process: bool = True, stale_s: float = 60.0) -> None:
        if not service.isidentifier():
            raise ValueError(f"service name {service!r} is not an identifier")
        self.service = service
        self.prefix = f"rollstream_{service}_"
        self.registry = CollectorRegistry()
        self.health = Health(stale_s)
        self._callbacks = _Callbacks()
        if process:  # process_cpu_seconds_total, process_resident_memory_bytes, python_info
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self.prefix + name, doc, list(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self.prefix + name, doc, list(labels), registry=self.registry)

    def histogram(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        return Histogram(
            self.prefix + name, doc, list(labels), registry=self.registry, buckets=buckets
        )

    def counter_fn(
        self, name: str, doc: str, fn: Callable[[], Values], labels: Sequence[str] = ()
    ) -> None:
        """A counter whose value(s) ``fn`` returns at scrape time: a number, or
        ``{label values: number}`` for ``labels``."""
        self._add(_Fn("counter", self.prefix + name, doc, tuple(labels), fn))

    def gauge_fn(
        self, name: str, doc: str, fn: Callable[[], Values], labels: Sequence[str] = ()
    ) -> None:
        """A gauge read from ``fn`` at scrape time (as ``counter_fn``)."""
        self._add(_Fn("gauge", self.prefix + name, doc, tuple(labels), fn))

    def _add(self, f: _Fn) -> None:
        if not self._callbacks.fns:
            self.registry.register(self._callbacks)
        if f.name in {g.name for g in self._callbacks.fns}:
            raise ValueError(f"duplicate metric {f.name}")
        self._callbacks.fns.append(f)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)


# --------------------------------------------------------------------------- the three routes


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    status: int
    content_type: str
    body: bytes


_JSON = "application/json"


def _json(status: int, body: Mapping[str, Any]) -> ProbeAnswer:
    return ProbeAnswer(status, _JSON, json.dumps(body).encode())


def answer_probe(
    metrics: ServiceMetrics, key: SecretStr | None, path: str, authorization: str | None
) -> ProbeAnswer | None:
    """The answer to GET ``path`` (``/metrics``, ``/livez``, ``/readyz``), None for others."""
    if path == "/metrics":
        if key is not None:
            want = f"Bearer {key.get_secret_value()}".encode()
            if not hmac.compare_digest((authorization or "").encode(), want):
                return _json(401, {"error": "metrics need Authorization: Bearer <metrics key>"})
        return ProbeAnswer(200, CONTENT_TYPE_LATEST, metrics.exposition())
    if path == "/livez":
        alive, age = metrics.health.live()
        if alive:
            return _json(200, {"status": "ok"})
        return _json(503, {"status": "stalled", "since_beat_s": round(age or 0.0, 1)})
    if path == "/readyz":
        ok, checks = metrics.health.ready()
        return _json(
            200 if ok else 503, {"status": "ready" if ok else "not ready", "checks": checks}
        )
    return None


def metrics_routes(metrics: ServiceMetrics, key: SecretStr | None) -> list[Any]:
    """GET /metrics, /livez and /readyz as Starlette routes (see ``answer_probe``)."""
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def endpoint(request: Request) -> Response:
        found = answer_probe(metrics, key, request.url.path, request.headers.get("authorization"))
        assert found is not None
        return Response(found.body, found.status, media_type=found.content_type)

    return [Route(path, endpoint, methods=["GET"]) for path in ("/metrics", "/livez", "/readyz")]


class MetricsServer:
    """The three routes on their own port, in a daemon thread. ``stop()`` closes it."""

    def __init__(self, metrics: ServiceMetrics, host: str, port: int, key: SecretStr | None):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                found = answer_probe(metrics, key, path, self.headers.get("Authorization"))
                if found is None:
                    found = _json(404, {"error": f"no route {path}"})
                self.send_response(found.status)
                self.send_header("Content-Type", found.content_type)
                self.send_header("Content-Length", str(len(found.body)))
                self.end_headers()
                self.wfile.write(found.body)

            def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
                return None

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self.host, self.port = host, int(self._http.server_address[1])
        self._thread = threading.Thread(
            target=self._http.serve_forever,
            kwargs={"poll_interval": 0.2},
            name=f"metrics-{metrics.service}",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)


def serve_metrics(settings: CommonSettings, metrics: ServiceMetrics) -> MetricsServer | None:
    """Serve ``metrics`` on ``metrics_host:metrics_port`` (0: a free port, ``.port`` says
    which); None when ``metrics_port`` is None (several services share a host by default)."""
    if settings.metrics_port is None:
        return None
    server = MetricsServer(
        metrics, settings.metrics_host, settings.metrics_port, settings.metrics_key
    )
    log.info("%s metrics at %s/metrics", metrics.service, server.url)
    return server
