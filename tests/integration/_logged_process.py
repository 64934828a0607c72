"""A rollstream service run as a subprocess by integration tests (so it can be SIGKILLed): its
environment is the test's minus every ROLLSTREAM_ variable plus the service's settings, and
every start appends to one log file behind a ``===== start N =====`` marker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from rollstream.schemas import CommonSettings


class LoggedProcess:
    """``rollstream ARGS...`` (``python -m rollstream.infra.cli``) with ``settings`` (Kafka,
    namespace, a home under ``tmp_path``) and ``env`` (full ROLLSTREAM_ names) on top of the
    test's own environment."""

    def __init__(
        self,
        args: list[str],
        settings: CommonSettings,
        tmp_path: Path,
        log_name: str,
        env: dict[str, str],
    ) -> None:
        self.args = args
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")},
            "ROLLSTREAM_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "ROLLSTREAM_NAMESPACE": settings.namespace,
            "ROLLSTREAM_HOME": str(tmp_path / "home"),
            **env,
        }
        self.log_path = tmp_path / log_name
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {self.starts} =====\n".encode())
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollstream.infra.cli", *self.args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def current_log(self) -> str:
        """The log of the run started last."""
        marker = f"===== start {self.starts} ====="
        return self.log_path.read_text(errors="replace").rpartition(marker)[2]

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
