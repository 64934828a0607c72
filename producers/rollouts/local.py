"""The ``local`` sandbox: a bare subprocess in a temp dir. UNSAFE: NO ISOLATION.

The command runs as the worker's own user, sees the whole host filesystem (and may write
anywhere the worker may), the host network and every host process. It exists as the baseline
the other kinds are measured against (bench/bench_sandbox.py) and for trusted code on machines
without bubblewrap; never run model-written code in it.

What it does bound: wall time per exec (the exec's process group is killed), output kept per
stream, address space (``prlimit --as``), CPU seconds (``--cpu``) and file size (``--fsize``);
not processes (RLIMIT_NPROC would count all the user's processes on the host). The command's
cwd is the sandbox's host directory, exported as ``SANDBOX_WORKDIR``; ``spec.workdir`` (/work)
is only the name copy_in/copy_out paths use, so commands should use relative paths.

The host-dir machinery here is shared with bwrap.py: ``<root>/<id>.json`` (the record: labels
and owner) is written before ``<root>/<id>/work`` exists and removed after it is gone, so the
reaper (reaper.py) always finds what a dead worker left. ``run_bounded`` runs one process with
a deadline and bounded output; ``SafeDir`` copies files in and out without following a symlink
anywhere (a sandbox cannot turn copy_out into a read of a host file).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from rollstream.producers.rollouts.reaper import MARKER_ENV, kill_marked_processes, remove_tree
from rollstream.producers.rollouts.sandbox import (
    BaseSandbox,
    ExecResult,
    SandboxError,
    SandboxExecError,
    SandboxFileError,
    SandboxOwner,
    SandboxRecord,
    SandboxSpec,
    SandboxSpecError,
    SandboxStateError,
    SandboxUnavailable,
    new_sandbox_id,
)

__all__ = ["HostDirProvider", "HostDirSandbox", "LocalProvider", "LocalSandbox", "run_bounded"]

_CHUNK = 64 * 1024
_DRAIN_AFTER_EXIT_S = 0.25  # how long pipes may stay open after the process exits


# --------------------------------------------------------------------------- one process


def run_bounded(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | Path | None,
    stdin: bytes | None,
    timeout: float,
    max_output: int,
    pass_fds: Sequence[int] = (),
    started: threading.Event | None = None,
    procs: set[subprocess.Popen[bytes]] | None = None,
) -> ExecResult:
    """Run ``argv`` in a new session with a wall-clock ``timeout``: at the deadline the whole
    process group gets SIGKILL. Keeps up to ``max_output`` bytes of stdout and of stderr and
    drains the rest. A command that cannot be found or executed is exit code 127 / 126, as in
    a shell; a signal is 128 + its number. After the exit the process group is killed too, so
    nothing it left in the background survives (what escaped the group excepted)."""
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
        )
    except FileNotFoundError as exc:
        return ExecResult(127, b"", f"{exc}\n".encode(), time.monotonic() - t0)
    except PermissionError as exc:
        return ExecResult(126, b"", f"{exc}\n".encode(), time.monotonic() - t0)
    except OSError as exc:
        raise SandboxExecError(f"cannot start {argv[0]!r}: {exc}") from exc
    if procs is not None:
        procs.add(proc)
    try:
        return _communicate(proc, stdin, t0 + timeout, max_output, t0)
    finally:
        _kill_group(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        if procs is not None:
            procs.discard(proc)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _communicate(
    proc: subprocess.Popen[bytes], stdin: bytes | None, deadline: float, cap: int, t0: float
) -> ExecResult:
    assert proc.stdout is not None and proc.stderr is not None
    out = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    cut = dict.fromkeys(out, False)
    sel = selectors.DefaultSelector()
    for fd in out:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin or b"")
    if proc.stdin is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        if pending:
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
    timed_out = False
    exited_at: float | None = None
    while sel.get_map():
        now = time.monotonic()
        if now >= deadline:
            timed_out = proc.poll() is None
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > _DRAIN_AFTER_EXIT_S:
            break  # a background process holds the pipes: it is killed with the group
        for key, _ in sel.select(min(deadline - now, 0.25)):
            fd = int(key.fd)
            if fd in out:
                try:
                    chunk = os.read(fd, _CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                room = cap - len(out[fd])
                if len(chunk) > room:
                    cut[fd] = True
                out[fd] += chunk[: max(room, 0)]
            else:
                try:
                    n = os.write(fd, pending[:_CHUNK])
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    n = len(pending)
                pending = pending[n:]
                if not pending:
                    sel.unregister(fd)
                    assert proc.stdin is not None
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
    sel.close()
    if timed_out:
        _kill_group(proc.pid)
    try:
        code = proc.wait(max(deadline - time.monotonic(), 0.0) + 1.0)
    except subprocess.TimeoutExpired:  # the pipes closed early (daemonized), the process runs on
        timed_out = True
        _kill_group(proc.pid)
        code = proc.wait()
    fo, fe = proc.stdout.fileno(), proc.stderr.fileno()
    return ExecResult(
        exit_code=128 - code if code < 0 else code,
        stdout=bytes(out[fo]),
        stderr=bytes(out[fe]),
        duration_s=time.monotonic() - t0,
        timed_out=timed_out,
        stdout_truncated=cut[fo],
        stderr_truncated=cut[fe],
    )


# --------------------------------------------------------------------------- files, no symlinks

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class SafeDir:
    """File access under one host directory that never follows a symlink (every component is
    opened relative to its parent with O_NOFOLLOW), so it stays inside even while a sandbox
    process rewrites the tree. ``owner``: (uid, gid) given to what it creates, or None."""

    def __init__(self, root: Path, owner: tuple[int, int] | None = None) -> None:
        self.root = root
        self.owner = owner

    def _chown(self, fd: int) -> None:
        if self.owner is not None:
            os.fchown(fd, *self.owner)

    def _open_parent(self, rel: str, *, create: bool) -> tuple[int, str]:
        parts = rel.split("/")
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for part in parts[:-1]:
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    self._chown(nxt)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    def write(self, rel: str, src: bytes | Path) -> None:
        try:
            parent, name = self._open_parent(rel, create=True)
            try:
                self._put(parent, name, src)
            finally:
                os.close(parent)
        except OSError as exc:
            raise SandboxFileError(f"copy_in {rel!r}: {_why(exc)}") from exc

    def _put(self, parent: int, name: str, src: bytes | Path) -> None:
        if isinstance(src, Path) and src.is_dir():
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=parent)
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            try:
                self._chown(fd)
                for child in sorted(src.iterdir()):
                    if child.is_symlink():
                        continue  # a host symlink would point at the host: not copied
                    self._put(fd, child.name, child)
            finally:
                os.close(fd)
            return
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        mode = 0o755 if isinstance(src, Path) and os.access(src, os.X_OK) else 0o644
        fd = os.open(name, flags, mode, dir_fd=parent)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            self._chown(fd)
            if isinstance(src, bytes):
                _write_all(fd, src)
            else:
                with src.open("rb") as f:
                    while chunk := f.read(1 << 20):
                        _write_all(fd, chunk)
        finally:
            os.close(fd)

    def read(self, rel: str, max_bytes: int) -> bytes:
        try:
            parent, name = self._open_parent(rel, create=False)
            try:
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                fd = os.open(name, flags, dir_fd=parent)
            finally:
                os.close(parent)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise SandboxFileError(f"copy_out {rel!r}: not a regular file")
                if st.st_size > max_bytes:
                    raise SandboxFileError(
                        f"copy_out {rel!r}: {st.st_size} bytes, more than max_bytes={max_bytes}"
                    )
                data = bytearray()
                while len(data) <= max_bytes and (chunk := os.read(fd, 1 << 20)):
                    data += chunk
            finally:
                os.close(fd)
        except OSError as exc:
            raise SandboxFileError(f"copy_out {rel!r}: {_why(exc)}") from exc
        if len(data) > max_bytes:  # it grew while read
            raise SandboxFileError(f"copy_out {rel!r}: more than max_bytes={max_bytes}")
        return bytes(data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _why(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "a symlink on the path (not followed)"
    if exc.errno == errno.ENOTDIR:
        return "a component is not a directory (or is a symlink)"
    return exc.strerror or str(exc)


# --------------------------------------------------------------------------- host-dir sandboxes


class HostDirSandbox(BaseSandbox):
    """A sandbox whose workdir is a host directory ``<root>/<id>/work`` (local and bwrap)."""

    def __init__(self, provider: HostDirProvider, record: SandboxRecord, spec: SandboxSpec):
        super().__init__(record, spec)
        self._provider = provider
        self.host_dir = provider.root / record.id
        self.host_workdir = self.host_dir / "work"
        self._files = SafeDir(self.host_workdir, provider.file_owner)
        self._procs: set[subprocess.Popen[bytes]] = set()

    def base_env(self) -> dict[str, str]:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self._spec.workdir,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "SANDBOX_WORKDIR": self._spec.workdir,
            MARKER_ENV: self.id,
        }

    def _copy_in(self, src: bytes | Path, rel: str) -> None:
        self._files.write(rel, src)

    def _copy_out(self, rel: str, max_bytes: int) -> bytes:
        return self._files.read(rel, max_bytes)

    def _destroy(self) -> None:
        for proc in list(self._procs):
            _kill_group(proc.pid)
        self._provider.remove(self.id)

    def _cpu_seconds(self, timeout: float) -> int:
        return max(1, math.ceil(self._spec.limits.cpu * timeout))


class HostDirProvider:
    """Creates, lists and reaps host-dir sandboxes under ``root``."""

    kind: ClassVar[str] = ""
    sandbox_class: ClassVar[type[HostDirSandbox]] = HostDirSandbox
    file_owner: tuple[int, int] | None = None

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).absolute()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SandboxUnavailable(f"sandbox root {self.root}: {exc}") from exc

    def create(self, spec: SandboxSpec) -> HostDirSandbox:
        if spec.kind != self.kind:
            raise SandboxSpecError("kind", f"{spec.kind!r} given to the {self.kind} provider")
        record = SandboxRecord(
            id=new_sandbox_id(),
            kind=self.kind,
            labels=spec.labels,
            owner=SandboxOwner.current(),
            created_at=time.time(),
            lifetime=spec.limits.lifetime,
        )
        self._write_record(record)  # first, so the reaper finds anything made after it
        sandbox = self.sandbox_class(self, record, spec)
        try:
            sandbox.host_dir.mkdir(mode=0o755)
            sandbox.host_workdir.mkdir(mode=0o755)
            if self.file_owner is not None:
                os.chown(sandbox.host_workdir, *self.file_owner)
            self._prepare(sandbox)
            for dest, src in spec.files.items():
                sandbox.copy_in(src, dest)
        except BaseException:
            with contextlib.suppress(SandboxError, OSError):
                sandbox.destroy()  # what was made; the first error is the one to report
            raise
        return sandbox

    def attach(self, sandbox_id: str, spec: SandboxSpec) -> HostDirSandbox:
        """The sandbox ``sandbox_id`` made earlier (by this or another process on this host),
        to work in; ``spec`` is the one it was made from. SandboxStateError when it is gone."""
        path = self.root / f"{sandbox_id}.json"
        try:
            record = SandboxRecord.from_labels(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise SandboxStateError(f"sandbox {sandbox_id} is gone: {exc}") from exc
        sandbox = self.sandbox_class(self, record, spec)
        if record.kind != self.kind or not sandbox.host_workdir.is_dir():
            raise SandboxStateError(f"sandbox {sandbox_id} is gone (no {self.kind} workdir)")
        return sandbox

    def _prepare(self, sandbox: HostDirSandbox) -> None:
        """A kind's check that the new sandbox can run (bwrap probes once)."""

    def _write_record(self, record: SandboxRecord) -> None:
        path = self.root / f"{record.id}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record.to_labels(), sort_keys=True))
        os.replace(tmp, path)

    def records(self) -> list[SandboxRecord]:
        records = []
        for path in sorted(self.root.glob("sbx-*.json")):
            try:
                record = SandboxRecord.from_labels(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # removed meanwhile, or not ours
            if record.kind == self.kind:
                records.append(record)
        return records

    def reap(self, *, stage: str | None = None, now: float | None = None) -> list[str]:
        reaped = []
        for record in self.records():
            if stage is not None and record.labels.stage != stage:
                continue
            if record.reap_reason(now=now) is not None:
                kill_marked_processes(record.id)
                self.remove(record.id)
                reaped.append(record.id)
        return reaped

    def remove(self, sandbox_id: str) -> None:
        """Remove a sandbox's directory, then its record (the reverse of create)."""
        remove_tree(self.root / sandbox_id)
        with contextlib.suppress(FileNotFoundError):
            (self.root / f"{sandbox_id}.json").unlink()

    def close(self) -> None:
        """Nothing held: sandboxes live on until destroyed or reaped."""


class LocalSandbox(HostDirSandbox):
    """UNSAFE: runs the command as the worker, on the host (see the module docstring)."""

    def base_env(self) -> dict[str, str]:
        env = super().base_env()
        env.update(HOME=str(self.host_workdir), SANDBOX_WORKDIR=str(self.host_workdir))
        env["TMPDIR"] = str(self.host_dir / "tmp")
        return env

    def _exec(
        self, argv: list[str], timeout: float, env: dict[str, str], stdin: bytes | None, cwd: str
    ) -> ExecResult:
        lim = self._spec.limits
        (self.host_dir / "tmp").mkdir(exist_ok=True)
        wrapped = [
            *self._provider_tools(),
            f"--as={lim.memory}",
            f"--cpu={self._cpu_seconds(timeout)}",
            f"--fsize={lim.disk}",
            "--",
            *argv,
        ]
        host_cwd = self.host_workdir / cwd if cwd else self.host_workdir
        if not host_cwd.is_dir() or host_cwd.is_symlink():
            raise SandboxFileError(f"cwd: {cwd!r} is not a directory of the workdir")
        return run_bounded(
            wrapped,
            env={**self.base_env(), **env, MARKER_ENV: self.id},  # the reaper finds it
            cwd=host_cwd,
            stdin=stdin,
            timeout=timeout,
            max_output=lim.output,
            procs=self._procs,
        )

    def _provider_tools(self) -> list[str]:
        p = self._provider
        assert isinstance(p, LocalProvider)
        return [p.setpriv, "--pdeathsig", "KILL", "--", p.prlimit]


class LocalProvider(HostDirProvider):
    """``local`` sandboxes under ``root``: no isolation (module docstring)."""

    kind = "local"
    sandbox_class = LocalSandbox

    def __init__(self, root: Path | str) -> None:
        super().__init__(root)
        self.setpriv = _tool("setpriv")
        self.prlimit = _tool("prlimit")


def _tool(name: str) -> str:
    path = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin")
    if path is None:
        raise SandboxUnavailable(f"{name} (util-linux) is not installed")
    return path
