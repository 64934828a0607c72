"""A private dockerd for the sandbox tests (and bench/bench_sandbox.py): started as root on its
own socket, data root and exec root in a temp dir, so it never touches a system daemon; no
iptables, no bridge (containers get ``none`` or ``host`` networking). Storage: overlay2 when
the kernel has overlayfs (a container starts in ~0.3 s), else vfs (copies the image per
container, ~1 s). Stopped with SIGTERM (its containers with it), mounts under the data root
undone, the temp dir removed.

The sandbox image's rootfs tar is cached across sessions in ``$ROLLSTREAM_HOME/images`` (or the
checkout's ``.rollstream/images``), so a fresh daemon only re-imports it (~1 s).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def image_cache() -> Path:
    home = os.environ.get("ROLLSTREAM_HOME")
    return (Path(home) if home else REPO / ".rollstream") / "images"


@dataclass
class Dockerd:
    base_url: str
    root: Path
    storage_driver: str
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        _unmount_under(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


def _unmount_under(root: Path) -> None:
    prefix = str(root) + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f if line.split()[1].startswith(prefix)]
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


def _overlay_ok() -> bool:
    with contextlib.suppress(OSError):
        return "overlay" in Path("/proc/filesystems").read_text()
    return False


def start_dockerd(storage_driver: str | None = None, timeout: float = 60.0) -> Dockerd:
    """Start a private dockerd; overlay2 first where the kernel has it, vfs if that fails."""
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise RuntimeError("dockerd is not installed (apt-get install docker.io)")
    drivers = [storage_driver] if storage_driver else (["overlay2"] if _overlay_ok() else [])
    drivers += [] if storage_driver else ["vfs"]
    last = ""
    for driver in drivers:
        root = Path(tempfile.mkdtemp(prefix="rs-dockerd-"))
        sock = root / "docker.sock"
        log = (root / "dockerd.log").open("wb")
        proc = subprocess.Popen(
            [
                dockerd,
                "--iptables=false",
                "--ip6tables=false",
                "--bridge=none",
                f"--storage-driver={driver}",
                "--data-root",
                str(root / "data"),
                "--exec-root",
                str(root / "exec"),
                "--pidfile",
                str(root / "dockerd.pid"),
                "-H",
                f"unix://{sock}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        daemon = Dockerd(f"unix://{sock}", root, driver, proc)
        if _wait_ready(daemon, timeout):
            return daemon
        last = (root / "dockerd.log").read_text(errors="replace")[-2000:]
        daemon.stop()
    raise RuntimeError(f"dockerd did not start ({drivers}):\n{last}")


def _wait_ready(daemon: Dockerd, timeout: float) -> bool:
    import docker

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.proc.poll() is not None:
            return False
        with contextlib.suppress(docker.errors.DockerException):
            client = docker.DockerClient(base_url=daemon.base_url, timeout=10)
            try:
                if client.ping():
                    return True
            finally:
                client.close()
        time.sleep(0.2)
    return False


@pytest.fixture(scope="session")
def dockerd() -> Iterator[Dockerd]:
    daemon = start_dockerd()
    try:
        yield daemon
    finally:
        daemon.stop()
