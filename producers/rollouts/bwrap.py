"""The ``bwrap`` sandbox: bubblewrap, rootless, the default kind.

A bwrap sandbox is a host directory and a record (local.py's host-dir machinery): ``create``
writes ``<root>/<id>.json`` (labels, owner) and makes ``<root>/<id>/work``; every ``exec`` runs

    setpriv [--reuid U --regid G --clear-groups] --pdeathsig KILL --
      bwrap --unshare-all [--share-net] --unshare-user --uid 1000 --gid 1000 --cap-drop ALL
            --die-with-parent --new-session --hostname <id>
            (--ro-bind /usr /usr --ro-bind /etc /etc --symlink usr/bin /bin ...
             | --ro-bind <rootfs> /)
            --proc /proc --dev /dev --size <disk> --tmpfs /tmp
            --bind <root>/<id>/work /work --chdir /work/<cwd>
      -- prlimit --as=<memory> --nproc=<pids> --cpu=<cpu x timeout> --fsize=<disk> -- <command>

- One bwrap per exec, no long-lived init: a create costs a mkdir and a JSON file (and one probe
  exec per provider), an exec one bwrap start (bench/bench_sandbox.py measures both; an exec of
  ``true`` is a few ms). Each exec is a fresh PID namespace whose processes all die with it, so
  a timeout (SIGKILL to bwrap's process group; ``--die-with-parent`` takes the namespace down)
  leaves the sandbox usable, and no process outlives its exec. Files live in the workdir.
- Read-only system: the host's /usr and /etc (and the /bin, /lib... symlinks or dirs), or a
  root filesystem directory given as ``spec.image`` (rootfs.py builds one; it must hold
  /usr/bin/prlimit and a /work mount point). Nothing else of the host is visible: not /home,
  /root, /tmp, /run or the worker's checkout. bwrap binds the workdir by path, so the host
  user it runs as must be able to search every directory above the sandbox root (checked when
  the provider is built; bwrap 0.8's ``--bind-fd`` resolves the path again and fails there).
- No network: ``--unshare-all`` gives an empty network namespace (only its own loopback), so
  even the host's 127.0.0.1 is unreachable; ``spec.network`` adds ``--share-net`` (the host's
  network, which is what lets an agent reach the recording proxy on localhost).
- Users: inside, uid/gid 1000 without capabilities in its own user namespace. Outside, when the
  worker runs as root, bwrap is started as an unprivileged host user (``host_uid``, default
  65534 "nobody") that owns the workdir: a root-started bwrap would keep root's capabilities
  and, being root, no process limit applies to it. As a normal user bwrap runs as that user.
- Limits are rlimits set inside the namespaces (by prlimit, so the user namespace is created
  before them and a sandbox's process count is its own, not shared with other sandboxes of the
  same host user): memory is address space per process (RLIMIT_AS: an allocation beyond it
  fails with ENOMEM / MemoryError), pids the processes of the sandbox (RLIMIT_NPROC, counted per
  user namespace; includes bwrap's own init), CPU the CPU seconds of each process (cores x the
  exec's timeout), disk the largest file written (RLIMIT_FSIZE; /tmp is a tmpfs of that size).
  No cgroups: see sandbox.py. Wall time: the exec's timeout.
- Worker death: ``setpriv --pdeathsig KILL`` kills bwrap when the worker dies and bwrap's
  ``--die-with-parent`` kills the namespace; the reaper then removes the directory and record,
  and kills any process still carrying the sandbox's ``ROLLSTREAM_SANDBOX_ID``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

from rollstream.producers.rollouts.local import HostDirProvider, HostDirSandbox, _tool, run_bounded
from rollstream.producers.rollouts.reaper import MARKER_ENV
from rollstream.producers.rollouts.sandbox import (
    ExecResult,
    SandboxSpec,
    SandboxSpecError,
    SandboxUnavailable,
)

__all__ = [
    "SANDBOX_GID",
    "SANDBOX_UID",
    "BwrapProvider",
    "BwrapSandbox",
    "bwrap_argv",
    "host_binds",
]

SANDBOX_UID = 1000
SANDBOX_GID = 1000
NOBODY = 65534
_SYSTEM = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def host_binds(paths: Sequence[str] = _SYSTEM) -> list[str]:
    """bwrap arguments that show the host's system dirs read-only: a dir is ``--ro-bind``,
    a symlink (merged /usr: /bin -> usr/bin) is recreated with ``--symlink``."""
    args: list[str] = []
    for path in paths:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def bwrap_argv(
    *,
    bwrap: str,
    prlimit: str,
    sandbox_id: str,
    spec: SandboxSpec,
    argv: Sequence[str],
    cwd: str,
    cpu_seconds: int,
    host_workdir: str,
    system: Sequence[str],
) -> list[str]:
    """The bwrap command line of one exec (pure; see the module docstring)."""
    lim = spec.limits
    out = [bwrap, "--unshare-all"]
    if spec.network:
        out.append("--share-net")
    out += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)]
    out += ["--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", sandbox_id]
    if spec.image is not None:
        out += ["--ro-bind", spec.image, "/"]
    else:
        out += list(system)
    out += ["--proc", "/proc", "--dev", "/dev"]
    out += ["--size", str(min(lim.disk, lim.memory)), "--tmpfs", "/tmp"]
    out += ["--bind", host_workdir, spec.workdir]
    out += ["--chdir", f"{spec.workdir}/{cwd}" if cwd else spec.workdir, "--"]
    out += [prlimit, f"--as={lim.memory}", f"--nproc={lim.pids}", f"--cpu={cpu_seconds}"]
    out += [f"--fsize={lim.disk}", "--", *argv]
    return out


class BwrapSandbox(HostDirSandbox):
    """One bubblewrap sandbox: a workdir and a record; each exec is a fresh bwrap."""

    def _exec(
        self, argv: list[str], timeout: float, env: dict[str, str], stdin: bytes | None, cwd: str
    ) -> ExecResult:
        p = self._provider
        assert isinstance(p, BwrapProvider)
        command = bwrap_argv(
            bwrap=p.bwrap,
            prlimit=p.prlimit_in(self._spec.image),
            sandbox_id=self.id,
            spec=self._spec,
            argv=argv,
            cwd=cwd,
            cpu_seconds=self._cpu_seconds(timeout),
            host_workdir=str(self.host_workdir),
            system=p.system,
        )
        return run_bounded(
            [*p.prefix, *command],
            env={**self.base_env(), **env, MARKER_ENV: self.id},  # the reaper finds it
            cwd="/",
            stdin=stdin,
            timeout=timeout,
            max_output=self._spec.limits.output,
            procs=self._procs,
        )


class BwrapProvider(HostDirProvider):
    """bwrap sandboxes under ``root``. ``host_uid``/``host_gid``: the host user bwrap runs as
    when the worker is root (default 65534); ignored otherwise. ``system``: bwrap arguments
    for the read-only system when a spec names no rootfs (default ``host_binds()``)."""

    kind = "bwrap"
    sandbox_class = BwrapSandbox

    def __init__(
        self,
        root: Path | str,
        *,
        host_uid: int = NOBODY,
        host_gid: int = NOBODY,
        system: Sequence[str] | None = None,
        bwrap: str | None = None,
    ) -> None:
        super().__init__(root)
        self.bwrap = bwrap or _tool("bwrap")
        self.prlimit = _tool("prlimit")
        setpriv = _tool("setpriv")
        self.system = list(host_binds() if system is None else system)
        if os.geteuid() == 0:
            if host_uid <= 0 or host_gid <= 0:
                raise SandboxSpecError("host_uid", "bwrap must not run as root: name another user")
            self.file_owner = (host_uid, host_gid)
            self.prefix = [setpriv, "--reuid", str(host_uid), "--regid", str(host_gid)]
            self.prefix += ["--clear-groups", "--pdeathsig", "KILL", "--"]
            os.chmod(self.root, 0o755)
            _check_reachable(self.root, host_uid, host_gid)
        else:
            self.prefix = [setpriv, "--pdeathsig", "KILL", "--"]
        self._probe_lock = threading.Lock()
        self._probed = False

    def prlimit_in(self, rootfs: str | None) -> str:
        return self.prlimit if rootfs is None else "/usr/bin/prlimit"

    def _prepare(self, sandbox: HostDirSandbox) -> None:
        image = sandbox.spec.image
        if image is not None:
            if not os.path.isabs(image) or not os.path.isdir(image):
                raise SandboxSpecError("image", f"bwrap: not a rootfs directory: {image!r}")
            if self.file_owner is not None:
                _check_reachable(Path(image), *self.file_owner)
            for need in ("usr/bin/prlimit", sandbox.spec.workdir.lstrip("/")):
                if not os.path.lexists(os.path.join(image, need)):
                    raise SandboxSpecError("image", f"bwrap: the rootfs has no /{need}")
        with self._probe_lock:
            if self._probed:
                return
            result = sandbox.exec(["true"], timeout=min(30.0, sandbox.spec.limits.timeout))
            if not result.ok:
                raise SandboxUnavailable(
                    "bubblewrap cannot start a sandbox here (user namespaces disabled?): "
                    f"exit {result.exit_code}: {result.text('stderr').strip()[:500]}"
                )
            self._probed = True


def _check_reachable(path: Path, uid: int, gid: int) -> None:
    """bwrap runs as ``uid``: it must be able to walk down to ``path`` (search permission on
    every directory above it), or it cannot bind the workdir."""
    for d in [path, *path.parents]:
        st = d.stat()
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
        if not st.st_mode & bit:
            raise SandboxUnavailable(
                f"bwrap runs as uid {uid}, which cannot reach {path}: {d} is mode "
                f"{st.st_mode & 0o7777:o}; put the sandbox root where that user may search"
            )
