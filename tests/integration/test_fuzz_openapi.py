"""Schemathesis over the OpenAPI document every HTTP service serves at ``GET /openapi.json``,
against the real servers: the recording proxy (model calls, rollout API, jobs, OTLP, admin) in
front of the reference model server, both started through the CLI on the session broker; the
model server on its own; the analytics server on a chDB store.

Each operation gets its schema examples and a few generated requests (positive and negative)
with valid credentials (the admin key, a fresh rollout's token, the analyst key), so the fuzz
reaches the handlers: no answer is a 5xx other than a 502/503 the operation documents (a
backend or queue that is not there), and every answer is HTTP (no dropped connection). A second
pass sends no credentials, then a wrong key: every operation that requires one answers 401.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from _logged_process import LoggedProcess
from _rollout_stack import TOKEN_SECRET, fresh_settings, wait_healthy
from hypothesis import HealthCheck, settings

from rollstream.consumers.analytics.openapi import openapi as analytics_openapi
from rollstream.consumers.analytics.reports import VIEWS
from rollstream.consumers.analytics.server import AnalyticsServer, serve
from rollstream.consumers.analytics.settings import AnalyticsSettings
from rollstream.consumers.store.chstore import connect, insert_batch
from rollstream.consumers.store.migrations import apply_migrations
from rollstream.consumers.store.rows import RowBatch
from rollstream.inference import wire
from rollstream.inference.openapi import MAX_TOP_LOGPROBS
from rollstream.inference.openapi import OPENAPI as MODEL_OPENAPI
from rollstream.inference.tinymodel import ensure_tiny_model
from rollstream.infra.kafka import KafkaBroker, free_port
from rollstream.producers.proxy.openapi import OPENAPI as PROXY_OPENAPI
from rollstream.schemas import Event, RolloutFinished, RolloutStarted

pytestmark = pytest.mark.integration

ADMIN, ANALYST, MODEL_KEY = "fuzz-admin-key", "fuzz-analyst-key", "fuzz-model-key"
MODEL_ADMIN = "fuzz-model-admin-key"  # the model server's weight routes (the proxy sends it)
EXAMPLES = 6  # generated requests per operation, beside its schema examples
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
AUTH_PASS = settings(
    max_examples=2, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def _schema(document: dict[str, Any]) -> Any:
    """A service's document (the test below checks it is the one served), for schemathesis:
    its examples and a few generated cases per operation."""
    schema = schemathesis.openapi.from_dict(document)
    schema.config.phases.update(phases=["examples", "fuzzing"])
    schema.config.generation.update(max_examples=EXAMPLES)
    return schema


def _security(case: Any) -> list[dict[str, Any]]:
    return list(case.operation.definition.raw.get("security") or [])


def _requires_key(case: Any) -> bool:
    """The operation names a scheme and no empty alternative (``{}``: the key is optional)."""
    security = _security(case)
    return bool(security) and all(security)


def _documented(case: Any) -> set[int]:
    return {int(c) for c in case.operation.definition.raw["responses"] if c.isdigit()}


def _check(case: Any, response: Any) -> None:
    """No 5xx but a documented 502/503 (a backend or the job queue unreachable)."""
    status = response.status_code
    allowed = {502, 503} & _documented(case)
    assert status < 500 or status in allowed, (
        f"{case.method} {case.formatted_path} -> {status}: {response.text[:500]}\n"
        f"body={case.body!r} query={case.query!r}"
    )


# --- the services -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(kafka: KafkaBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The model server and the proxy in front of it, through the CLI as _rollout_stack starts
    them (one model server: the proxy's fuzz runs before the model server's own, which pauses
    it and sets its version); yields their URLs."""
    tmp = tmp_path_factory.mktemp("fuzz-stack")
    settings = fresh_settings(kafka.bootstrap, tmp / "home")
    model_dir = ensure_tiny_model(tmp / "models" / "tiny")
    model_port, proxy_port = free_port(), free_port()
    model_env = {
        "ROLLSTREAM_MODEL_PATH": str(model_dir),
        "ROLLSTREAM_MODEL_PORT": str(model_port),
        "ROLLSTREAM_MODEL_CREATE": "false",
        "ROLLSTREAM_MODEL_API_KEY": MODEL_KEY,
        "ROLLSTREAM_MODEL_ADMIN_KEY": MODEL_ADMIN,
    }
    proxy_env = {
        "ROLLSTREAM_PROXY_PORT": str(proxy_port),
        "ROLLSTREAM_PROXY_BACKENDS": f"http://127.0.0.1:{model_port}",
        "ROLLSTREAM_PROXY_MODEL_PATH": str(model_dir),
        "ROLLSTREAM_PROXY_API_KEYS": ADMIN,
        "ROLLSTREAM_PROXY_TOKEN_SECRET": TOKEN_SECRET,
        "ROLLSTREAM_PROXY_BACKEND_API_KEY": MODEL_KEY,
        "ROLLSTREAM_PROXY_BACKEND_ADMIN_KEY": MODEL_ADMIN,
        "ROLLSTREAM_PROXY_HEALTH_INTERVAL_S": "0.5",
        "ROLLSTREAM_SPOOL_DIR": str(tmp / "spool"),
        "ROLLSTREAM_PRODUCER": "proxy-fuzz-it",
    }
    model = LoggedProcess(["serve-model"], settings, tmp, "model.log", env=model_env)
    proxy = LoggedProcess(["proxy"], settings, tmp, "proxy.log", env=proxy_env)
    model.start()
    proxy.start()
    try:
        urls = {
            "model": f"http://127.0.0.1:{model_port}",
            "proxy": f"http://127.0.0.1:{proxy_port}",
        }
        wait_healthy(urls["model"], model)
        wait_healthy(urls["proxy"], proxy)
        yield urls
    finally:
        proxy.stop()
        model.stop()


@pytest.fixture(scope="module")
def proxy_url(stack: dict[str, str]) -> str:
    return stack["proxy"]


@pytest.fixture(scope="module")
def model_url(stack: dict[str, str]) -> str:
    return stack["model"]


@pytest.fixture(scope="module")
def analytics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AnalyticsServer]:
    path = tmp_path_factory.mktemp("fuzz-chdb")
    writer = connect(f"chdb://{path}")
    apply_migrations(writer, "rollstream_fz")
    batch = RowBatch("rollout.events", 0)
    for i in range(3):
        rid = f"fz-r{i}"
        for seq, body in enumerate([RolloutStarted("task", "g"), RolloutFinished("completed")]):
            batch.add(Event(f"{rid}e{seq}", rid, seq, 1_735_689_600_000_000 + i, body), len(batch))
    insert_batch(writer, batch.tables, batch.token, database="rollstream_fz")
    server = serve(
        AnalyticsSettings(
            clickhouse_url=f"chdb://{path}",
            namespace="fz",
            analytics_port=0,
            analytics_api_keys=ANALYST,
            analytics_max_execution_time_s=2.0,
            analytics_max_result_rows=10_000,
            analytics_max_result_bytes=1024 * 1024,
            analytics_max_memory_bytes=64 * 1024 * 1024,
            analytics_max_body_bytes=64 * 1024,
        )
    )
    try:
        yield server
    finally:
        server.stop()
        writer.close()


VIEW_TYPES = {v.name: {k: p.type for k, p in v.params.items()} for v in VIEWS.values()}
proxy = _schema(PROXY_OPENAPI)
model = _schema(MODEL_OPENAPI)
analytics_api = _schema(analytics_openapi(VIEW_TYPES))


# --- the served documents ---------------------------------------------------------------------


def test_each_service_serves_its_document(
    proxy_url: str, model_url: str, analytics: AnalyticsServer
) -> None:
    for url, document in [
        (proxy_url, PROXY_OPENAPI),
        (model_url, MODEL_OPENAPI),
        (analytics.url, analytics_openapi(VIEW_TYPES)),
    ]:
        r = httpx.get(f"{url}/openapi.json", timeout=30)
        assert r.status_code == 200 and r.json() == document, url
        schemathesis.openapi.from_dict(r.json()).validate()
    assert MAX_TOP_LOGPROBS == wire.MAX_TOP_LOGPROBS
    for document in (PROXY_OPENAPI, MODEL_OPENAPI, analytics_openapi(VIEW_TYPES)):
        for path, ops in document["paths"].items():  # the proxy's named none before
            templated = set(re.findall(r"{(\w+)}", path))
            for op in ops.values():
                declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
                assert declared == templated, path


# --- the proxy --------------------------------------------------------------------------------


def _new_rollout(url: str) -> tuple[str, str]:
    r = httpx.post(
        f"{url}/v1/rollouts",
        json={"task_id": "fuzz", "group_id": "g"},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    assert r.is_success, r.text
    return r.json()["rollout_id"], r.json()["token"]


def _proxy_credentials(case: Any, url: str) -> None:
    """The admin key, or a fresh rollout's token with its id in the path."""
    schemes = {name for alt in _security(case) for name in alt}
    if "adminKey" in schemes:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {ADMIN}"}
    elif "rolloutToken" in schemes:
        rid, token = _new_rollout(url)
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}
        if "rollout_id" in (case.path_parameters or {}):
            case.path_parameters["rollout_id"] = rid


@proxy.parametrize()
@FUZZ
def test_proxy_fuzz_has_no_server_errors(case: Any, proxy_url: str) -> None:
    _proxy_credentials(case, proxy_url)
    response = case.call(base_url=proxy_url, timeout=60)
    if case.formatted_path == "/v1/admin/pause":  # the next operations want the pool serving
        httpx.post(f"{proxy_url}/v1/admin/resume", headers={"Authorization": f"Bearer {ADMIN}"})
    _check(case, response)


@proxy.parametrize()
@AUTH_PASS
def test_proxy_wants_credentials_where_it_says(case: Any, proxy_url: str) -> None:
    if not _requires_key(case):
        return
    for auth in (None, "Bearer wrong-key", f"Bearer rs1.{'x' * 26}.forged"):
        headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        headers.pop("x-api-key", None)
        if auth is not None:
            headers["Authorization"] = auth
        case.headers = headers
        response = case.call(base_url=proxy_url, timeout=60)
        assert response.status_code == 401, (case.formatted_path, auth, response.text[:300])


# --- the model server -------------------------------------------------------------------------


MODEL_AUTH = {"Authorization": f"Bearer {MODEL_KEY}"}
MODEL_ADMIN_AUTH = {"Authorization": f"Bearer {MODEL_ADMIN}"}


def _model_auth(case: Any) -> dict[str, str]:
    """The model key where the operation takes it, else the admin key (the weight routes)."""
    schemes = {name for alt in _security(case) for name in alt}
    return MODEL_AUTH if "modelKey" in schemes else MODEL_ADMIN_AUTH


@model.parametrize()
@FUZZ
def test_model_server_fuzz_has_no_server_errors(case: Any, model_url: str) -> None:
    case.headers = {**(case.headers or {}), **_model_auth(case)}
    response = case.call(base_url=model_url, timeout=60)
    if case.formatted_path == "/pause":  # paused, completions would queue until resumed
        httpx.post(f"{model_url}/resume", headers=MODEL_ADMIN_AUTH)
    _check(case, response)


@model.parametrize()
@AUTH_PASS
def test_model_server_wants_its_key_where_it_says(case: Any, model_url: str) -> None:
    if not _requires_key(case) or case.formatted_path == "/metrics":  # no metrics_key set here
        return
    wrong = [None, "Bearer wrong-key", MODEL_KEY]
    if _security(case) == [{"adminKey": []}]:  # a weight route: the model key does not open it
        wrong.append(f"Bearer {MODEL_KEY}")
    for auth in wrong:
        headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        if auth is not None:
            headers["Authorization"] = auth
        case.headers = headers
        response = case.call(base_url=model_url, timeout=60)
        assert response.status_code == 401, (case.formatted_path, auth, response.text[:300])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # found by the fuzz: each was a 500 before
        ("/v1/completions", b"\x00\x00\x00\x00\x00", None),  # json.loads guessed UTF-32
        ("/update_weight_version", b'{"new_version": "\\u00b2"}', "new_version"),  # isdigit
        ("/update_weight_version", b'{"new_version": "' + b"9" * 5000 + b'"}', "new_version"),
        ("/collective_rpc", b'{"method": "reload_weights", "kwargs": "x"}', "kwargs"),
    ],
)
def test_model_server_inputs_the_fuzz_found_are_400s(
    model_url: str, path: str, body: bytes, param: str | None
) -> None:
    headers = MODEL_AUTH if path == "/v1/completions" else MODEL_ADMIN_AUTH
    r = httpx.post(f"{model_url}{path}", content=body, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# --- the analytics server ---------------------------------------------------------------------


@analytics_api.parametrize()
@FUZZ
def test_analytics_fuzz_has_no_server_errors(case: Any, analytics: AnalyticsServer) -> None:
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {ANALYST}"}
    _check(case, case.call(base_url=analytics.url, timeout=60))


@analytics_api.parametrize()
@AUTH_PASS
def test_analytics_wants_the_key_where_it_says(case: Any, analytics: AnalyticsServer) -> None:
    if not _requires_key(case):
        return
    for auth in (None, "Bearer wrong-key", ANALYST):
        headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        if auth is not None:
            headers["Authorization"] = auth
        case.headers = headers
        response = case.call(base_url=analytics.url, timeout=60)
        assert response.status_code == 401, (case.formatted_path, auth, response.text[:300])
