"""Nothing leaks: finding what dead workers left behind, and destroying it.

Every sandbox records its owner (host, pid, process start time, boot id; sandbox.py's
``SandboxOwner``) where its provider can list it: bwrap and local keep a state file
``<root>/<id>.json`` beside the sandbox directory ``<root>/<id>/``; docker keeps container and
volume labels. ``reap(providers)`` asks each provider for its records and destroys those whose
owner is dead (same host, and no live process with that pid and start time, or another boot)
or that outlived ``limits.lifetime``. A stage worker calls it when it starts, so a worker killed
with SIGKILL leaves no sandbox behind once any worker of that stage (re)starts. Owners on other
hosts are never judged dead from here (their own host reaps them).

Processes: a bwrap sandbox's processes die with the worker anyway (``setpriv --pdeathsig`` on
bwrap, ``--die-with-parent`` inside); the reaper still kills any process whose environment
holds ``ROLLSTREAM_SANDBOX_ID=<id>`` (every exec of every host-dir kind gets it), which is how a
local sandbox's leftovers are found too. Docker containers are removed with their processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import stat
import time
from collections.abc import Iterable
from pathlib import Path

from rollstream.producers.rollouts.sandbox import SandboxProvider

__all__ = ["MARKER_ENV", "kill_marked_processes", "reap", "remove_tree"]

log = logging.getLogger("rollstream.producers.rollouts")

MARKER_ENV = "ROLLSTREAM_SANDBOX_ID"


def kill_marked_processes(
    sandbox_id: str, *, proc: Path = Path("/proc"), wait_s: float = 5.0
) -> int:
    """SIGKILL every process whose environment holds ``ROLLSTREAM_SANDBOX_ID=<sandbox_id>``
    (those this process may read: all as root, its own user's otherwise) and wait up to
    ``wait_s`` until none is left (a SIGKILLed process is gone, or a zombie whose environment
    reads empty). Returns how many were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + wait_s
    while pids := _marked(sandbox_id, proc):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        if time.monotonic() > deadline:
            log.warning("sandbox %s: processes %s survive SIGKILL", sandbox_id, pids)
            break
        time.sleep(0.02)
    return len(killed)


def _marked(sandbox_id: str, proc: Path) -> list[int]:
    marker = f"\0{MARKER_ENV}={sandbox_id}\0".encode()
    me = os.getpid()
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = b"\0" + (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if marker in environ:
            pids.append(int(entry.name))
    return pids


def remove_tree(path: Path) -> None:
    """rmtree that also removes what a sandbox made unwritable (its own dirs at mode 0500), and
    that another process removing the same tree at the same time (two reapers) does not fail."""
    if not (path.exists() or path.is_symlink()):
        return
    try:
        shutil.rmtree(path, onerror=_gone_is_fine)
    except PermissionError:  # not as root: a dir without write permission for its owner
        _open_up(path)
        shutil.rmtree(path, onerror=_gone_is_fine)


def _gone_is_fine(
    func: object, path: str, exc_info: tuple[type[BaseException], BaseException, object]
) -> None:
    if not issubclass(exc_info[0], FileNotFoundError):
        raise exc_info[1]


def _open_up(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.chmod(path, stat.S_IRWXU)
        for entry in os.scandir(path):
            if entry.is_dir(follow_symlinks=False):
                _open_up(Path(entry.path))


def reap(providers: Iterable[SandboxProvider], *, stage: str | None = None) -> dict[str, list[str]]:
    """Destroy what dead owners left, per provider kind: ``{kind: [sandbox ids]}``."""
    out: dict[str, list[str]] = {}
    for provider in providers:
        reaped = provider.reap(stage=stage)
        out[provider.kind] = reaped
        if reaped:
            log.info("reaped %d %s sandbox(es): %s", len(reaped), provider.kind, reaped)
    return out
