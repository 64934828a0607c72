"""Secure by default, through the real CLI: ``rollstream up`` makes ``<home>/keys.json`` (mode
0600, its path shown, never a key) once; the model server, the proxy and the sink's analytics
server, started with nothing but that home (and their broker, namespace, ports and model), then
answer 401 without a key and 200 with the one ``rollstream keys show ROLE`` prints -- the proxy
reaches the model server with the file's model key (and its weight routes, which the model key
does not open, with the admin key), ``rollstream report`` sends the analyst key.
``rollstream up --insecure`` makes no keys, says so loudly, and the services of its home are
open (and say so in their logs)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from _logged_process import LoggedProcess
from _rollout_stack import wait_healthy
from _sink_process import SinkProcess

from rollstream.inference.tinymodel import ensure_tiny_model
from rollstream.infra.kafka import free_port
from rollstream.schemas import CommonSettings
from rollstream.schemas.keys import ROLES

pytestmark = pytest.mark.integration


@dataclass
class Up:
    """A home that `rollstream up` was run on: its environment and what up printed."""

    root: Path  # the services' tmp dir: the home is root / "home" (LoggedProcess)
    env: dict[str, str]
    out: subprocess.CompletedProcess[str]

    @property
    def home(self) -> Path:
        return self.root / "home"

    def settings(self) -> CommonSettings:
        return CommonSettings(
            kafka_bootstrap=self.env["ROLLSTREAM_KAFKA_BOOTSTRAP"],
            namespace=self.env["ROLLSTREAM_NAMESPACE"],
            home=self.home,
            insecure=True,  # only where the services find the broker: they read the file
        )


def _cli(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollstream.infra.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _up(root: Path, bootstrap: str, *flags: str) -> Up:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")},
        "COLUMNS": "400",  # one line per message
        "ROLLSTREAM_HOME": str(root / "home"),
        "ROLLSTREAM_KAFKA_BOOTSTRAP": bootstrap,
        "ROLLSTREAM_KAFKA_CONTROLLER_PORT": str(free_port()),
        "ROLLSTREAM_NAMESPACE": f"k{uuid.uuid4().hex[:8]}",
    }
    out = _cli(env, "up", *flags)
    assert out.returncode == 0, out.stderr
    return Up(root, env, out)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory, kafka_classpath: str) -> Iterator[Up]:
    """`rollstream up` on a fresh home and port: the broker of this module."""
    up = _up(tmp_path_factory.mktemp("secure"), f"127.0.0.1:{free_port()}")
    try:
        yield up
    finally:
        _cli(up.env, "down")


def _model(up: Up, model_dir: Path) -> tuple[LoggedProcess, str]:
    port = free_port()
    env = {
        "ROLLSTREAM_MODEL_PATH": str(model_dir),
        "ROLLSTREAM_MODEL_PORT": str(port),
        "ROLLSTREAM_MODEL_CREATE": "false",
    }
    return LoggedProcess(["serve-model"], up.settings(), up.root, "model.log", env), (
        f"http://127.0.0.1:{port}"
    )


def _proxy(up: Up, model_dir: Path, backend: str) -> tuple[LoggedProcess, str]:
    port = free_port()
    env = {
        "ROLLSTREAM_PROXY_PORT": str(port),
        "ROLLSTREAM_PROXY_BACKENDS": backend,
        "ROLLSTREAM_PROXY_MODEL_PATH": str(model_dir),
        "ROLLSTREAM_PROXY_HEALTH_INTERVAL_S": "0.5",
        "ROLLSTREAM_SPOOL_DIR": str(up.root / "spool"),
    }
    return LoggedProcess(["proxy"], up.settings(), up.root, "proxy.log", env), (
        f"http://127.0.0.1:{port}"
    )


def _serving(url: str, proc: LoggedProcess, timeout: float = 120) -> None:
    """Until the proxy answers (its /health is 503 while no backend is up)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.proc is not None and proc.proc.poll() is None, proc.log_tail()
        assert time.monotonic() < deadline, proc.log_tail()
        try:
            if httpx.get(f"{url}/openapi.json", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)


def _status(method: str, url: str, key: str | None = None, **kw: object) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, url, headers=headers, timeout=60, **kw).status_code  # type: ignore[arg-type]


def test_up_makes_the_keys_and_every_service_requires_them(secure: Up, model_dir: Path) -> None:
    path = secure.home / "keys.json"
    assert f"keys: created {path}" in secure.out.stderr, secure.out.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    keys = {}
    for role in ROLES:
        shown = _cli(secure.env, "keys", "show", role)
        assert shown.returncode == 0, shown.stderr
        keys[role] = shown.stdout.strip()
        assert keys[role].startswith(f"rs_{role}_")
        assert keys[role] not in secure.out.stdout + secure.out.stderr  # up shows no key
    before = path.read_bytes()
    again = _cli(secure.env, "up")
    assert again.returncode == 0 and f"keys: kept {path}" in again.stderr, again.stderr
    assert path.read_bytes() == before

    model, model_url = _model(secure, model_dir)
    proxy, proxy_url = _proxy(secure, model_dir, model_url)
    sink = SinkProcess(secure.settings(), secure.root)
    for proc in (model, proxy, sink):
        proc.start()
    try:
        wait_healthy(model_url, model)
        wait_healthy(proxy_url, proxy)  # healthy: its probe of the model server got through
        sink.wait_ready(assigned=False)

        # the model server: the model key (the proxy's), nobody else's; its weight routes the
        # admin key only (the proxy sends it there), not the model key
        for route in ("/v1/models", "/is_paused", "/weight_info"):
            assert _status("GET", model_url + route) == 401, route
            assert _status("GET", model_url + route, keys["analyst"]) == 401, route
            assert _status("GET", model_url + route, keys["model"]) == 200, route
        assert _status("POST", model_url + "/pause") == 401
        load = {"path": str(model_dir / "nowhere"), "version": 1}
        for role in (None, "model", "analyst", "evaluator"):
            key = keys[role] if role else None
            assert _status("POST", model_url + "/v1/load_weights", key, json=load) == 401, role
            assert _status("POST", model_url + "/pause", key) == 401, role
        assert _status("POST", model_url + "/v1/load_weights", keys["admin"], json=load) == 400

        # the proxy: its admin routes and rollout creation take the admin key
        status = proxy_url + "/v1/admin/status"
        assert _status("GET", status) == 401
        for role in ("analyst", "model", "metrics"):
            assert _status("GET", status, keys[role]) == 401, role
        assert _status("GET", status, keys["admin"]) == 200
        body = {"task_id": "t", "group_id": "g"}
        assert _status("POST", proxy_url + "/v1/rollouts", json=body) == 401
        made = httpx.post(
            proxy_url + "/v1/rollouts",
            json=body,
            headers={"Authorization": f"Bearer {keys['admin']}"},
            timeout=60,
        )
        assert made.status_code == 201, made.text
        rollout = made.json()
        chat = httpx.post(  # the rollout's token; the proxy sends the file's model key on
            f"{rollout['base_url']}/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {rollout['token']}"},
            timeout=120,
        )
        assert chat.status_code == 200, chat.text
        update = httpx.post(  # the proxy reloads the model server with the file's admin key
            proxy_url + "/v1/admin/update_weights",
            json={"path": str(model_dir), "version": 1},
            headers={"Authorization": f"Bearer {keys['admin']}"},
            timeout=120,
        )
        assert update.status_code == 200, update.text
        assert (update.json()["reloaded"], update.json()["failed"]) == (1, {}), update.text
        served = httpx.get(
            model_url + "/v1/policy_version",
            headers={"Authorization": f"Bearer {keys['model']}"},
            timeout=60,
        )
        assert served.json()["policy_version"] == 1, served.text
        assert _status("GET", proxy_url + "/metrics") == 401
        assert _status("GET", proxy_url + "/metrics", keys["admin"]) == 401
        assert _status("GET", proxy_url + "/metrics", keys["metrics"]) == 200

        # the analytics server: the analyst key (and the admin's)
        assert _status("GET", sink.url + "/reports") == 401
        assert _status("GET", sink.url + "/reports", keys["model"]) == 401
        assert _status("GET", sink.url + "/reports", keys["analyst"]) == 200
        assert _status("GET", sink.url + "/reports", keys["admin"]) == 200
        report = _cli(secure.env, "report", "--sql", "SELECT 41 + 1 AS n", "--url", sink.url)
        assert report.returncode == 0, report.stderr  # it sent the file's analyst key
        assert "42" in report.stdout
        for log in (model, proxy, sink):
            assert "!!!" not in log.current_log(), log.log_tail()
    finally:
        for proc in (sink, proxy, model):
            proc.stop()


def test_up_insecure_makes_no_keys_and_the_services_are_open(
    secure: Up, model_dir: Path, tmp_path: Path
) -> None:
    bootstrap = secure.env["ROLLSTREAM_KAFKA_BOOTSTRAP"]  # the module's broker, used as is
    open_ = _up(tmp_path, bootstrap, "--insecure")
    assert "!!! INSECURE: no keys made" in open_.out.stderr, open_.out.stderr
    assert "answer ANYONE" in open_.out.stderr
    assert not (open_.home / "keys.json").exists()
    assert _cli(open_.env, "keys", "path").returncode == 1

    proxy, proxy_url = _proxy(open_, model_dir, f"http://127.0.0.1:{free_port()}")  # no backend
    sink = SinkProcess(open_.settings(), open_.root)
    proxy.start()
    sink.start()
    try:
        _serving(proxy_url, proxy)
        sink.wait_ready(assigned=False)
        assert _status("GET", proxy_url + "/v1/admin/status") == 200
        made = httpx.post(
            proxy_url + "/v1/rollouts", json={"task_id": "t", "group_id": "g"}, timeout=60
        )
        assert made.status_code == 201, made.text
        assert _status("GET", proxy_url + "/metrics") == 200
        assert _status("GET", sink.url + "/reports") == 200
        assert "!!! no analytics_api_keys set" in sink.current_log(), sink.log_tail()
        assert "no proxy_api_keys set" in proxy.current_log(), proxy.log_tail()
    finally:
        sink.stop()
        proxy.stop()

    # --insecure on a home that has keys: none made, and the warning says they still apply
    keyed = _cli(secure.env, "up", "--insecure")
    assert keyed.returncode == 0, keyed.stderr
    assert "services on this home still require its keys" in keyed.stderr, keyed.stderr
