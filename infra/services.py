"""A small supervisor for the local stack's services: each is a ``rollstream <command>``
subprocess with its own log file under ``<home>/logs``, started in order and waited on until it
answers (an HTTP health URL or a log line), stopped in reverse order (SIGTERM, then SIGKILL).

    ServiceError                     root of rollstream.infra.services
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rollstream.infra.errors import ServiceError

__all__ = ["Service", "ServiceError", "Supervisor"]


@dataclass
class Service:
    name: str
    args: list[str]  # arguments of `rollstream`
    env: dict[str, str] = field(default_factory=dict)
    health_url: str | None = None
    ready_timeout: float = 120.0
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(self, home: Path, base_env: dict[str, str]) -> None:
        self.log_dir = Path(home) / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.base_env = base_env
        self.services: list[Service] = []

    def start(self, service: Service) -> Service:
        service.log_path = self.log_dir / f"{service.name}.log"
        env = {**os.environ, **self.base_env, **service.env, "PYTHONUNBUFFERED": "1"}
        with open(service.log_path, "ab") as log:
            service.proc = subprocess.Popen(
                [sys.executable, "-m", "rollstream.infra.cli", *service.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.services.append(service)
        if service.health_url:
            self._wait_http(service)
        return service

    def _wait_http(self, service: Service) -> None:
        assert service.health_url is not None
        deadline = time.monotonic() + service.ready_timeout
        while time.monotonic() < deadline:
            if not service.alive():
                raise ServiceError(f"{service.name} exited:\n{self.tail(service)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(service.health_url, timeout=2).status_code < 500:
                    return
            time.sleep(0.3)
        raise ServiceError(
            f"{service.name} not ready after {service.ready_timeout:.0f}s:\n{self.tail(service)}"
        )

    def wait_log(self, service: Service, needle: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not service.alive():
                raise ServiceError(f"{service.name} exited:\n{self.tail(service)}")
            if service.log_path and needle in service.log_path.read_text(errors="replace"):
                return
            time.sleep(0.3)
        raise ServiceError(
            f"{service.name}: {needle!r} not seen in {timeout:.0f}s:\n{self.tail(service)}"
        )

    def check(self) -> None:
        for s in self.services:
            if not s.alive() and s.proc is not None and s.proc.returncode not in (0, None):
                raise ServiceError(f"{s.name} exited ({s.proc.returncode}):\n{self.tail(s)}")

    @staticmethod
    def tail(service: Service, lines: int = 30) -> str:
        if service.log_path is None or not service.log_path.exists():
            return ""
        return "\n".join(service.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop_all(self, timeout: float = 15.0) -> None:
        for s in reversed(self.services):
            if s.alive():
                assert s.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(s.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for s in reversed(self.services):
            if s.proc is None:
                continue
            try:
                s.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(s.proc.pid, signal.SIGKILL)
                s.proc.wait(5)
        self.services.clear()
