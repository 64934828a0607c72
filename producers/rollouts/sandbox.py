"""Sandboxes: where the rollout service runs an agent's tools and a task's tests.

The contract every kind implements, its bounded values and its errors. A stage worker builds
one ``SandboxProvider`` per kind it serves (``open_provider(kind, **options)``), creates a
``Sandbox`` per rollout from a ``SandboxSpec`` and destroys it when the rollout is done:

    provider = open_provider("bwrap", root=home / "sandboxes")
    provider.reap()                                   # what dead workers left behind
    with provider.create(SandboxSpec(labels=SandboxLabels(rollout_id=rid, stage="run"))) as sb:
        sb.copy_in(b"print(6 * 7)\\n", "main.py")
        result = sb.exec(["python3", "main.py"], timeout=10)   # ExecResult(exit_code=0, ...)
        report = sb.copy_out("report.json")

Kinds (``SANDBOX_KINDS``; modules are imported only when their kind is asked for):

| kind   | module             | isolation                                                  |
| ------ | ------------------ | ---------------------------------------------------------- |
| bwrap  | bwrap.py           | bubblewrap, rootless: the default                          |
| docker | docker_sandbox.py  | a container per sandbox through the docker SDK and dockerd |
| local  | local.py           | NONE: a bare subprocess in a temp dir (comparison, and     |
|        |                    | machines without bwrap); never for untrusted code          |
| k8s    | k8s.py             | a generated Kubernetes Job manifest; no cluster client     |

What a sandbox is, for every kind:
- A writable workdir (``spec.workdir``, ``/work`` by default) and a private ``/tmp``; the rest
  of the filesystem is read-only (``local``: the whole host, writable).
- No network unless ``spec.network`` (on means the host's network, so an agent reaches the
  recording proxy on the worker's localhost; the docker provider can name another network).
- Limits (``SandboxLimits``): memory, processes, CPU, wall time per exec, disk, bytes of output
  kept per stream, bytes one ``copy_out`` returns. How each kind enforces them is in its module;
  in short: bwrap uses rlimits set inside the sandbox (memory = address space per process, pids
  = processes of the sandbox's user namespace, CPU = CPU seconds, cores x timeout; disk =
  largest file written), docker uses cgroups (memory without swap, pids, CPU quota) and the same
  file-size rlimit, k8s writes resources.limits. No cgroups for bwrap: that needs a writable
  cgroup v2 tree with delegated controllers, and the machines this was built on run cgroup v1
  whose controllers belong to the machine's own runtime; rlimits work as root and as a normal
  user alike.
- ``exec(argv | shell string, timeout, env, stdin, cwd) -> ExecResult``: exit code (a signal is
  128 + its number, a missing command 127, as in a shell), stdout and stderr each kept up to
  ``limits.output`` bytes with a truncated flag, duration, ``timed_out``. A timeout kills every
  process of the exec (exit code 137) and the sandbox stays usable, its files kept: bwrap runs
  each exec in a fresh PID namespace, so no process outlives its exec anyway; docker kills every
  process of the sandbox user, those of earlier execs too. A non-zero exit or a timeout is a
  result, never an exception.
- One bwrap per exec, not a long-lived init per sandbox: an init would need every exec to enter
  its user, mount, PID and network namespaces (nsenter) and would let processes outlive their
  exec; a fresh bwrap gives each exec a clean PID namespace for about 10-20 ms. Measured
  (bench/bench_sandbox.py, 2 shared cores, as root; p50 over two runs on a busy box):
  create+destroy 0.7-7 ms for bwrap (a JSON file and two dirs; the spread is the disk), 0.5-0.6
  s for docker (overlay2), 1.7-8 ms for a bare temp dir; a trivial exec 11-22 ms in bwrap,
  65-93 ms in docker, 7-8 ms as a bare subprocess behind setpriv and prlimit (2-4 ms for
  ``subprocess.run`` alone).
- ``copy_in(bytes | Path, dest)`` writes under the workdir (only there); ``copy_out(path)``
  reads one regular file, at most ``limits.copy_out`` bytes; symlinks never lead outside.
- ``destroy()`` is idempotent; a sandbox is a context manager that destroys on exit.
- Labels: job_id, rollout_id, stage, worker_id (given), and the owner (host, pid, process start
  time, boot id: the process that created it), kept with the sandbox (bwrap/local: a state file
  beside the workdir; docker: container and volume labels; k8s: pod labels and annotations).
  ``provider.reap()`` destroys every sandbox whose owner is dead (or that outlived
  ``limits.lifetime``), so a worker killed with SIGKILL leaves nothing once any worker of the
  stage (re)starts and reaps (reaper.py).

Errors (one root, under the package's; the modules raise them):

    ProducerError                     rollstream.producers.errors
    └── SandboxError                  root of the sandboxes' errors
        ├── SandboxSpecError          a spec, limit, label or exec argument out of bounds
        │                             (ValueError); .field names it ("limits.memory")
        ├── SandboxUnavailable        the kind cannot run here: bwrap/setpriv/prlimit missing,
        │                             user namespaces off, dockerd unreachable or failing, the
        │                             image cannot be built, or a manifest-only kind (k8s)
        ├── SandboxStateError         the sandbox was destroyed (or its container is gone)
        ├── SandboxFileError          copy_in/copy_out: a path outside the workdir, missing, not
        │                             a regular file, or over the size bound
        └── SandboxExecError          the command could not be started at all (not a non-zero
                                      exit: that is a result)
"""

from __future__ import annotations

import importlib
import math
import os
import posixpath
import re
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, Final, Protocol, Self, runtime_checkable

from rollstream.producers.errors import (
    SandboxError,
    SandboxExecError,
    SandboxFileError,
    SandboxSpecError,
    SandboxStateError,
    SandboxUnavailable,
)

__all__ = [
    "LABEL_PREFIX",
    "MANIFEST_KINDS",
    "SANDBOX_KINDS",
    "SPEC_KINDS",
    "BaseSandbox",
    "ExecResult",
    "Sandbox",
    "SandboxError",
    "SandboxExecError",
    "SandboxFileError",
    "SandboxLabels",
    "SandboxLimits",
    "SandboxOwner",
    "SandboxProvider",
    "SandboxRecord",
    "SandboxSpec",
    "SandboxSpecError",
    "SandboxStateError",
    "SandboxUnavailable",
    "new_sandbox_id",
    "open_provider",
    "provider_class",
    "sandbox_relpath",
    "shell_argv",
]

# --------------------------------------------------------------------------- kinds

SANDBOX_KINDS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "bwrap": "rollstream.producers.rollouts.bwrap:BwrapProvider",
        "docker": "rollstream.producers.rollouts.docker_sandbox:DockerProvider",
        "local": "rollstream.producers.rollouts.local:LocalProvider",
    }
)
"""Kinds that run, by name: ``"module:Class"`` of their provider (imported on demand)."""

MANIFEST_KINDS: Final = ("k8s",)
"""Kinds that are generated, not run: ``rollstream.producers.rollouts.k8s`` writes the manifest."""

SPEC_KINDS: Final = (*SANDBOX_KINDS, *MANIFEST_KINDS)

LABEL_PREFIX: Final = "rollstream.io/"

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# --------------------------------------------------------------------------- bounded values

# A label value is valid as a Kubernetes label value, a docker label and a file name.
_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_SANDBOX_ID = re.compile(r"sbx-[0-9a-f]{20}")
MAX_ENV = 256  # variables in spec.env, and in one exec's env
MAX_ENV_BYTES = 256 * KiB  # all names and values together
MAX_ARGV_BYTES = 256 * KiB
MAX_STDIN = 64 * MiB
MAX_FILES = 10_000  # entries in spec.files
MAX_INLINE_BYTES = 256 * MiB  # all bytes values of spec.files together


def _bounded(name: str, value: Any, lo: float, hi: float, *, integer: bool) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise SandboxSpecError(name, f"must be {'an integer' if integer else 'a number'}")
    if not (lo <= value <= hi) or (isinstance(value, float) and not math.isfinite(value)):
        raise SandboxSpecError(name, f"must be between {lo:g} and {hi:g} (got {value!r})")


_LIMIT_BOUNDS: Final[Mapping[str, tuple[float, float, bool]]] = {  # (lo, hi, integer)
    "cpu": (0.01, 256.0, False),
    "memory": (16 * MiB, 1024 * GiB, True),
    "pids": (4, 1 << 22, True),
    "timeout": (0.001, 7 * 86400.0, False),
    "disk": (1 * MiB, 16 << 40, True),
    "output": (0, 256 * MiB, True),
    "copy_out": (0, 4 * GiB, True),
    "lifetime": (1.0, 30 * 86400.0, False),
}


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Resource bounds of one sandbox. Bytes are bytes, times are seconds."""

    cpu: float = 1.0  # cores (docker CPU quota, k8s limits.cpu; bwrap: CPU seconds cpu x timeout)
    memory: int = 1 * GiB  # bwrap/local: address space per process; docker/k8s: cgroup memory
    pids: int = 256  # processes (and threads) at once
    timeout: float = 600.0  # wall time of one exec (the default and the most an exec may ask)
    disk: int = 1 * GiB  # docker/k8s: the workdir's size; bwrap/local: the largest file written
    output: int = 1 * MiB  # bytes of stdout, and of stderr, kept per exec
    copy_out: int = 16 * MiB  # bytes one copy_out may return
    lifetime: float = 6 * 3600.0  # a sandbox older than this is reaped even if its owner lives

    def __post_init__(self) -> None:
        for name, (lo, hi, integer) in _LIMIT_BOUNDS.items():
            _bounded(f"limits.{name}", getattr(self, name), lo, hi, integer=integer)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "limits") -> SandboxLimits:
        return cls(**_known_keys(cls, data, where))


@dataclass(frozen=True, slots=True)
class SandboxLabels:
    """Who a sandbox belongs to (each value: empty, or a Kubernetes-valid label value)."""

    job_id: str = ""
    rollout_id: str = ""
    stage: str = ""  # init | run | eval, or a name of the caller's
    worker_id: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, str) or not _LABEL_VALUE.fullmatch(value):
                raise SandboxSpecError(
                    f"labels.{f.name}",
                    "must be at most 63 characters of [A-Za-z0-9._-], starting and ending "
                    f"with a letter or digit (got {value!r})",
                )

    def as_dict(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "labels") -> SandboxLabels:
        return cls(**_known_keys(cls, data, where))


def _known_keys(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise SandboxSpecError(where, f"must be a mapping (got {type(data).__name__})")
    names = {f.name for f in fields(cls)}
    for key in data:
        if key not in names:
            raise SandboxSpecError(f"{where}.{key}", f"unknown field (known: {sorted(names)})")
    return dict(data)


def _check_env(where: str, env: Mapping[str, str]) -> None:
    if not isinstance(env, Mapping):
        raise SandboxSpecError(where, "must be a mapping of names to strings")
    if len(env) > MAX_ENV:
        raise SandboxSpecError(where, f"at most {MAX_ENV} variables (got {len(env)})")
    total = 0
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise SandboxSpecError(f"{where}.{name}", "not a valid variable name")
        if not isinstance(value, str) or "\0" in value:
            raise SandboxSpecError(f"{where}.{name}", "must be a string without NUL")
        total += len(name) + len(value.encode())
    if total > MAX_ENV_BYTES:
        raise SandboxSpecError(where, f"more than {MAX_ENV_BYTES} bytes of names and values")


@dataclass(frozen=True, slots=True, eq=False)
class SandboxSpec:
    """What to create. ``image``: docker, the image (None: the provider's default, built locally
    by rootfs.py); bwrap, a root filesystem directory (None: the host's /usr and /etc read-only).
    ``files``: workdir-relative destination -> bytes, or a host file or directory to copy."""

    kind: str = "bwrap"
    image: str | None = None
    files: Mapping[str, bytes | Path] = field(default_factory=dict)
    network: bool = False
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    labels: SandboxLabels = field(default_factory=SandboxLabels)
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str = "/work"

    def __post_init__(self) -> None:
        if self.kind not in SPEC_KINDS:
            raise SandboxSpecError("kind", f"unknown sandbox kind {self.kind!r} ({SPEC_KINDS})")
        if self.image is not None and (
            not isinstance(self.image, str) or not 0 < len(self.image) <= 4096
        ):
            raise SandboxSpecError("image", "must be a non-empty string of at most 4096 chars")
        if not isinstance(self.network, bool):
            raise SandboxSpecError("network", "must be true or false")
        if not isinstance(self.limits, SandboxLimits):
            raise SandboxSpecError("limits", "must be a SandboxLimits")
        if not isinstance(self.labels, SandboxLabels):
            raise SandboxSpecError("labels", "must be a SandboxLabels")
        _check_env("env", self.env)
        wd = self.workdir
        if (
            not isinstance(wd, str)
            or not wd.startswith("/")
            or posixpath.normpath(wd) != wd
            or wd == "/"
            or wd.split("/")[1] in ("proc", "dev", "sys", "tmp", "usr", "etc")
            or len(wd) > 255
        ):
            raise SandboxSpecError(
                "workdir", f"must be a normalized absolute path outside system dirs (got {wd!r})"
            )
        if not isinstance(self.files, Mapping):
            raise SandboxSpecError("files", "must be a mapping of destination to bytes or Path")
        if len(self.files) > MAX_FILES:
            raise SandboxSpecError("files", f"at most {MAX_FILES} entries")
        inline = 0
        for dest, src in self.files.items():
            where = f"files.{dest}"
            if not isinstance(dest, str):
                raise SandboxSpecError("files", f"destination {dest!r} must be a string")
            sandbox_relpath(wd, dest, where=where)
            if isinstance(src, bytes):
                inline += len(src)
            elif not isinstance(src, Path):
                raise SandboxSpecError(where, "must be bytes or a pathlib.Path")
        if inline > MAX_INLINE_BYTES:
            raise SandboxSpecError("files", f"more than {MAX_INLINE_BYTES} inline bytes")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SandboxSpec:
        """From a job file's mapping: ``files`` values are inline text (or bytes); unknown keys
        are errors naming them."""
        raw = _known_keys(cls, data, "sandbox")
        if "limits" in raw and not isinstance(raw["limits"], SandboxLimits):
            raw["limits"] = SandboxLimits.from_dict(raw["limits"])
        if "labels" in raw and not isinstance(raw["labels"], SandboxLabels):
            raw["labels"] = SandboxLabels.from_dict(raw["labels"])
        if "files" in raw and isinstance(raw["files"], Mapping):
            raw["files"] = {
                k: v.encode() if isinstance(v, str) else v for k, v in raw["files"].items()
            }
        return cls(**raw)


def sandbox_relpath(workdir: str, path: str, *, where: str = "path") -> str:
    """The workdir-relative form of ``path`` (relative to the workdir, or absolute under it);
    ``""`` is the workdir itself. Anything that leaves the workdir is a SandboxSpecError."""
    if not isinstance(path, str) or not path or "\0" in path or len(path) > 4096:
        raise SandboxSpecError(where, f"must be a non-empty path without NUL (got {path!r})")
    full = posixpath.normpath(posixpath.join(workdir, path))
    if full == workdir:
        return ""
    if not full.startswith(workdir + "/"):
        raise SandboxSpecError(where, f"{path!r} is outside the workdir {workdir}")
    return full[len(workdir) + 1 :]


def shell_argv(command: str | Sequence[str]) -> list[str]:
    """A string runs under ``/bin/sh -c``; a sequence is the argv itself. Bounded, no NUL."""
    argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise SandboxSpecError("command", "must be a string or a non-empty list of strings")
    if any("\0" in a for a in argv) or not argv[0]:
        raise SandboxSpecError("command", "arguments must be non-empty at [0] and without NUL")
    if sum(len(a.encode()) + 1 for a in argv) > MAX_ARGV_BYTES:
        raise SandboxSpecError("command", f"more than {MAX_ARGV_BYTES} bytes of arguments")
    return argv


def new_sandbox_id() -> str:
    """``sbx-`` and 20 hex digits: valid as a file name, container name and k8s name part."""
    return f"sbx-{uuid.uuid4().hex[:20]}"


# --------------------------------------------------------------------------- owner and record


def _proc_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time, clock ticks after boot); None: no such
    process, or a zombie (dead, waiting for its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    after = stat[stat.rindex(b")") + 2 :].split()  # the name may hold spaces and parentheses
    if after[0] in (b"Z", b"X"):
        return None
    return int(after[19])


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class SandboxOwner:
    """The process that created a sandbox: host, pid, its start time and the boot it ran in, so
    a reused pid or a reboot never passes for the owner."""

    host: str
    pid: int
    start: int
    boot_id: str

    @classmethod
    def current(cls) -> SandboxOwner:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _proc_start_ticks(pid) or 0, _boot_id())

    def alive(self) -> bool:
        """False only when this host can tell the owner is gone: same host and a different
        boot, or no process with that pid and start time. Another host's owner counts alive."""
        if self.host != socket.gethostname():
            return True
        if self.boot_id and self.boot_id != _boot_id():
            return False
        return _proc_start_ticks(self.pid) == self.start


@dataclass(frozen=True, slots=True)
class SandboxRecord:
    """A sandbox as its provider finds it: what ``records()`` returns and ``reap()`` judges. Stored
    as a flat string mapping (``to_labels``): container labels, pod labels, the state file."""

    id: str
    kind: str
    labels: SandboxLabels
    owner: SandboxOwner
    created_at: float
    lifetime: float

    def to_labels(self) -> dict[str, str]:
        p = LABEL_PREFIX
        out = {f"{p}sandbox-id": self.id, f"{p}kind": self.kind}
        out.update({f"{p}{k.replace('_', '-')}": v for k, v in self.labels.as_dict().items()})
        o = self.owner
        out.update(
            {
                f"{p}owner-host": o.host,
                f"{p}owner-pid": str(o.pid),
                f"{p}owner-start": str(o.start),
                f"{p}owner-boot": o.boot_id,
                f"{p}created-at": f"{self.created_at:.3f}",
                f"{p}lifetime": f"{self.lifetime:g}",
            }
        )
        return out

    @classmethod
    def from_labels(cls, labels: Mapping[str, str]) -> SandboxRecord:
        p = LABEL_PREFIX
        try:
            sid = labels[f"{p}sandbox-id"]
            if not _SANDBOX_ID.fullmatch(sid):
                raise ValueError(f"sandbox id {sid!r}")
            return cls(
                id=sid,
                kind=labels[f"{p}kind"],
                labels=SandboxLabels(
                    **{k: labels.get(f"{p}{k.replace('_', '-')}", "") for k in _LABEL_FIELDS}
                ),
                owner=SandboxOwner(
                    labels[f"{p}owner-host"],
                    int(labels[f"{p}owner-pid"]),
                    int(labels[f"{p}owner-start"]),
                    labels[f"{p}owner-boot"],
                ),
                created_at=float(labels[f"{p}created-at"]),
                lifetime=float(labels[f"{p}lifetime"]),
            )
        except (KeyError, ValueError) as exc:
            raise SandboxSpecError("labels", f"not a sandbox record: {exc}") from exc

    def reap_reason(self, *, now: float | None = None) -> str | None:
        """Why this sandbox should be destroyed by a reaper ("owner-dead", "expired"), or None
        while its owner lives and it is within its lifetime."""
        if not self.owner.alive():
            return "owner-dead"
        if (time.time() if now is None else now) > self.created_at + self.lifetime:
            return "expired"
        return None


_LABEL_FIELDS: Final = tuple(f.name for f in fields(SandboxLabels))


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class ExecResult:
    """One exec's outcome. Output beyond ``limits.output`` bytes per stream is dropped (the
    process keeps running; the pipe is drained) and flagged."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_s: float
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def text(self, stream: str = "stdout") -> str:
        data = self.stdout if stream == "stdout" else self.stderr
        return data.decode("utf-8", "replace")


# --------------------------------------------------------------------------- protocols


@runtime_checkable
class Sandbox(Protocol):
    """One sandbox. Thread safety: one exec at a time per sandbox is what the kinds are tested
    with; the stage workers own a sandbox per rollout."""

    @property
    def id(self) -> str: ...
    @property
    def spec(self) -> SandboxSpec: ...
    @property
    def record(self) -> SandboxRecord: ...

    def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        cwd: str | None = None,
    ) -> ExecResult: ...

    def copy_in(self, src: bytes | Path, dest: str) -> str: ...

    def copy_out(self, path: str, *, max_bytes: int | None = None) -> bytes: ...

    def destroy(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None: ...


@runtime_checkable
class SandboxProvider(Protocol):
    """Creates, lists and reaps the sandboxes of one kind (one per worker process)."""

    kind: str

    def create(self, spec: SandboxSpec) -> Sandbox: ...

    def attach(self, sandbox_id: str, spec: SandboxSpec) -> Sandbox: ...

    def records(self) -> list[SandboxRecord]: ...

    def reap(self, *, stage: str | None = None, now: float | None = None) -> list[str]: ...

    def remove(self, sandbox_id: str) -> None: ...

    def close(self) -> None: ...


def provider_class(kind: str) -> type[Any]:
    """The provider class of a runnable kind (its module imported now)."""
    if kind in MANIFEST_KINDS:
        raise SandboxUnavailable(
            f"{kind!r} sandboxes are generated manifests only "
            "(rollstream.producers.rollouts.k8s); no cluster client runs them here"
        )
    if kind not in SANDBOX_KINDS:
        raise SandboxSpecError("kind", f"unknown sandbox kind {kind!r} ({SPEC_KINDS})")
    module, _, name = SANDBOX_KINDS[kind].partition(":")
    cls: type[Any] = getattr(importlib.import_module(module), name)
    return cls


def open_provider(kind: str, **options: Any) -> SandboxProvider:
    """Build the provider of ``kind`` with its options (bwrap/local: ``root``; docker:
    ``base_url``, ``image_cache``, ...)."""
    provider: SandboxProvider = provider_class(kind)(**options)
    return provider


# --------------------------------------------------------------------------- shared behaviour


class BaseSandbox:
    """What every kind shares: argument checks, workdir paths, idempotent destroy, the context
    manager. Subclasses implement ``_exec``, ``_copy_in``, ``_copy_out``, ``_destroy``."""

    def __init__(self, record: SandboxRecord, spec: SandboxSpec) -> None:
        self._record = record
        self._spec = spec
        self._destroyed = False

    @property
    def id(self) -> str:
        return self._record.id

    @property
    def spec(self) -> SandboxSpec:
        return self._spec

    @property
    def record(self) -> SandboxRecord:
        return self._record

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def _check_live(self) -> None:
        if self._destroyed:
            raise SandboxStateError(f"sandbox {self.id} was destroyed")

    def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        self._check_live()
        argv = shell_argv(command)
        limit = self._spec.limits.timeout
        if timeout is None:
            timeout = limit
        _bounded("timeout", timeout, 0.001, limit, integer=False)
        env = dict(env or {})
        _check_env("env", env)
        if stdin is not None and (not isinstance(stdin, bytes) or len(stdin) > MAX_STDIN):
            raise SandboxSpecError("stdin", f"must be bytes of at most {MAX_STDIN}")
        rel = sandbox_relpath(self._spec.workdir, cwd or ".", where="cwd")
        return self._exec(argv, float(timeout), {**self._spec.env, **env}, stdin, rel)

    def copy_in(self, src: bytes | Path, dest: str) -> str:
        """Write bytes, or a host file or directory, at ``dest`` (workdir-relative or absolute
        under the workdir; parents are made). Returns the absolute path in the sandbox."""
        self._check_live()
        try:
            rel = sandbox_relpath(self._spec.workdir, dest, where="dest")
        except SandboxSpecError as exc:
            raise SandboxFileError(str(exc)) from exc
        if not rel:
            raise SandboxFileError("dest: name a path under the workdir, not the workdir")
        if isinstance(src, Path):
            if not src.exists():
                raise SandboxFileError(f"src: {src} does not exist")
        elif not isinstance(src, bytes):
            raise SandboxFileError("src: must be bytes or a pathlib.Path")
        self._copy_in(src, rel)
        return posixpath.join(self._spec.workdir, rel)

    def copy_out(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """The bytes of one regular file under the workdir, at most ``max_bytes`` (default
        ``limits.copy_out``); a larger file is a SandboxFileError, not a silent cut."""
        self._check_live()
        bound = self._spec.limits.copy_out if max_bytes is None else max_bytes
        _bounded("max_bytes", bound, 0, self._spec.limits.copy_out, integer=True)
        try:
            rel = sandbox_relpath(self._spec.workdir, path, where="path")
        except SandboxSpecError as exc:
            raise SandboxFileError(str(exc)) from exc
        return self._copy_out(rel, bound)

    def destroy(self) -> None:
        """Kill every process and remove every trace; a second call does nothing."""
        if self._destroyed:
            return
        self._destroy()
        self._destroyed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.destroy()

    # the kind's part
    def _exec(
        self, argv: list[str], timeout: float, env: dict[str, str], stdin: bytes | None, cwd: str
    ) -> ExecResult:
        raise NotImplementedError

    def _copy_in(self, src: bytes | Path, rel: str) -> None:
        raise NotImplementedError

    def _copy_out(self, rel: str, max_bytes: int) -> bytes:
        raise NotImplementedError

    def _destroy(self) -> None:
        raise NotImplementedError
