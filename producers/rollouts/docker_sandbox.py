"""The ``docker`` sandbox: one container per sandbox, through the docker SDK and a dockerd.

Needs the ``docker`` package (the rollouts extra) and a reachable dockerd (``base_url``, e.g.
``unix:///var/run/docker.sock``; the tests start a private one: tests/integration/_dockerd.py).

A sandbox is a container and a named volume, both labelled with the sandbox record
(``rollstream.io/sandbox-id``, ``.../job-id``, ``.../rollout-id``, ``.../stage``,
``.../worker-id``, ``.../owner-host|pid|start|boot``, ``.../created-at``, ``.../lifetime``):

- Image: ``spec.image``, or the provider's default: rootfs.py's tar of this machine's busybox,
  Python 3 and prlimit, imported once (``docker import``; no registry) as
  ``rollstream-sandbox:<key>``; the tar is cached under ``image_cache`` so a fresh dockerd
  imports it in about a second.
- The container: read-only root; the workdir is the volume ``<id>-work``; ``/tmp`` a tmpfs of
  ``min(disk, memory)`` bytes; ``network_mode="none"`` unless ``spec.network`` (then the
  provider's ``network``, by default ``host``, as bwrap shares the host's network); memory as
  ``mem_limit`` with no swap, CPU as ``nano_cpus``, processes as ``pids_limit`` (all cgroups),
  disk as the ``fsize`` ulimit (largest file written, as bwrap: vfs and plain volumes have no
  quota); every capability dropped, ``no-new-privileges``, docker's init as PID 1. Its main
  process (``sleep``) runs as root without capabilities; every exec runs as the sandbox user
  (1000:1000), which therefore cannot signal it. Auto-remove is off: ``destroy`` removes the
  container and its volume.
- ``exec``: ``exec_create`` + ``exec_start`` on a raw socket, read with a deadline and bounded
  output (the multiplexed stdout/stderr frames). At the deadline every process of the sandbox
  user is killed (``kill -9 -1`` run as that user), so the exec ends with 137 and the sandbox
  stays usable: files stay, processes of earlier execs die too. If that kill cannot run (the
  pids limit reached, say), the container is restarted, which kills everything; the volume
  keeps the files either way.
- ``copy_in`` / ``copy_out``: ``put_archive`` / ``get_archive`` (bounded: the archive's size is
  checked before it is read, and only a regular file is returned; docker resolves paths inside
  the container, so a symlink cannot reach the host).
- Reaping: ``records`` finds containers and volumes by the kind label; ``reap`` removes those whose
  owner is dead (sandbox.py's ``SandboxRecord.reap_reason``).
"""

from __future__ import annotations

import contextlib
import io
import selectors
import socket
import struct
import tarfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rollstream.producers.rollouts.rootfs import ensure_rootfs_tar
from rollstream.producers.rollouts.sandbox import (
    LABEL_PREFIX,
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

__all__ = ["DEFAULT_IMAGE_REPO", "DockerProvider", "DockerSandbox", "container_options"]

DEFAULT_IMAGE_REPO = "rollstream-sandbox"
SANDBOX_USER = "1000:1000"
_KIND_LABEL = f"{LABEL_PREFIX}kind=docker"
_FRAME = struct.Struct(">BxxxL")  # stream (1 stdout, 2 stderr), payload size
_DIR_BIT, _LINK_BIT = 1 << 31, 1 << 27  # Go's os.FileMode bits in get_archive's stat
_IDLE = ["sleep", "2147483647"]
_KILL_ALL = ["/bin/sh", "-c", "kill -9 -1"]
_DRAIN_AFTER_EXIT_S = 0.25
_NOT_FOUND = b"executable file not found"


def _docker() -> Any:
    try:
        import docker
    except ImportError as exc:  # pragma: no cover - the extra is installed in the tests
        raise SandboxUnavailable("the docker sandbox needs the `docker` package") from exc
    return docker


def container_options(
    record: SandboxRecord, spec: SandboxSpec, *, image: str, volume: str, network: str
) -> dict[str, Any]:
    """Keyword arguments of ``containers.create`` for one sandbox (pure; module docstring)."""
    lim = spec.limits
    docker = _docker()
    return {
        "image": image,
        "command": _IDLE,
        "name": record.id,
        "labels": record.to_labels(),
        "network_mode": network if spec.network else "none",
        "mem_limit": lim.memory,
        "memswap_limit": lim.memory,
        "nano_cpus": round(lim.cpu * 1e9),
        "pids_limit": lim.pids,
        "ulimits": [docker.types.Ulimit(name="fsize", soft=lim.disk, hard=lim.disk)],
        "read_only": True,
        "tmpfs": {"/tmp": f"size={min(lim.disk, lim.memory)},mode=1777"},
        "volumes": {volume: {"bind": spec.workdir, "mode": "rw"}},
        "working_dir": spec.workdir,
        "user": "0:0",
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "init": True,
        "hostname": "sandbox",
        "environment": dict(spec.env),
        "auto_remove": False,
        "detach": True,
    }


class DockerSandbox(BaseSandbox):
    """One container and its workdir volume."""

    def __init__(self, provider: DockerProvider, record: SandboxRecord, spec: SandboxSpec):
        super().__init__(record, spec)
        self._provider = provider
        self._api = provider.client.api
        self.container_id = ""
        self.volume = f"{record.id}-work"

    def base_env(self) -> dict[str, str]:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self._spec.workdir,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "SANDBOX_WORKDIR": self._spec.workdir,
        }

    def _abs(self, rel: str) -> str:
        return f"{self._spec.workdir}/{rel}" if rel else self._spec.workdir

    # ----------------------------------------------------------------- exec

    def _exec(
        self, argv: list[str], timeout: float, env: dict[str, str], stdin: bytes | None, cwd: str
    ) -> ExecResult:
        with self._provider.daemon_errors(f"sandbox {self.id}: exec"):
            return self._run(argv, timeout, env, stdin, cwd)

    def _run(
        self, argv: list[str], timeout: float, env: dict[str, str], stdin: bytes | None, cwd: str
    ) -> ExecResult:
        t0 = time.monotonic()
        errors = self._provider.errors
        try:
            exec_id = self._create_exec(argv, env, stdin is not None, cwd)
            sock = self._api.exec_start(exec_id, socket=True)
        except errors.NotFound as exc:
            raise SandboxStateError(f"sandbox {self.id}: its container is gone") from exc
        except errors.APIError as exc:
            raise SandboxExecError(f"sandbox {self.id}: exec failed: {exc}") from exc
        raw: socket.socket = getattr(sock, "_sock", sock)
        try:
            out, err, cut_o, cut_e, timed_out = self._pump(raw, exec_id, stdin, t0 + timeout)
        finally:
            with contextlib.suppress(OSError):
                sock.close()
            with contextlib.suppress(OSError):
                raw.close()
        if timed_out:
            self._kill_all()
        code = self._exit_code(exec_id, t0 + timeout + 5.0)
        if code == 126 and not err and _NOT_FOUND in out:  # the runtime's message, on stdout
            code, out, err = 127, b"", out  # a missing command is 127, as in a shell
        return ExecResult(
            exit_code=137 if timed_out else code,
            stdout=out,
            stderr=err,
            duration_s=time.monotonic() - t0,
            timed_out=timed_out,
            stdout_truncated=cut_o,
            stderr_truncated=cut_e,
        )

    def _create_exec(self, argv: list[str], env: dict[str, str], stdin: bool, cwd: str) -> str:
        errors = self._provider.errors
        for attempt in (1, 2):
            try:
                return str(
                    self._api.exec_create(
                        self.container_id,
                        argv,
                        stdout=True,
                        stderr=True,
                        stdin=stdin,
                        environment={**self.base_env(), **env},
                        workdir=self._abs(cwd),
                        user=SANDBOX_USER,
                    )["Id"]
                )
            except errors.APIError as exc:
                if exc.status_code != 409 or attempt == 2:  # 409: not running (its init died)
                    raise
                self._api.start(self.container_id)
        raise AssertionError("unreachable")

    def _pump(
        self, raw: socket.socket, exec_id: str, stdin: bytes | None, deadline: float
    ) -> tuple[bytes, bytes, bool, bool, bool]:
        """Send stdin and read the multiplexed output frames until EOF or the deadline."""
        cap = self._spec.limits.output
        bufs = {1: bytearray(), 2: bytearray()}
        cut = {1: False, 2: False}
        raw.setblocking(False)
        to_send = memoryview(stdin or b"")
        sel = selectors.DefaultSelector()
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if stdin is not None else 0)
        sel.register(raw, events)
        pending = bytearray()
        timed_out = False
        exited_at: float | None = None
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    timed_out = True
                    break
                if exited_at is not None and now - exited_at > _DRAIN_AFTER_EXIT_S:
                    break
                ready = sel.select(min(deadline - now, 0.25))
                if not ready:
                    if exited_at is None and not self._running(exec_id):
                        exited_at = time.monotonic()
                    continue
                if any(mask & selectors.EVENT_WRITE for _, mask in ready):
                    try:
                        to_send = to_send[raw.send(to_send[:65536]) :]
                    except BlockingIOError:
                        pass
                    except OSError:
                        to_send = to_send[len(to_send) :]  # it stopped reading: its result says
                    if not to_send:
                        with contextlib.suppress(OSError):
                            raw.shutdown(socket.SHUT_WR)
                        sel.modify(raw, selectors.EVENT_READ)
                if not any(mask & selectors.EVENT_READ for _, mask in ready):
                    continue
                try:
                    chunk = raw.recv(65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    break
                pending += chunk
                while len(pending) >= _FRAME.size:
                    stream, size = _FRAME.unpack_from(pending)
                    if len(pending) < _FRAME.size + size:
                        break
                    data = pending[_FRAME.size : _FRAME.size + size]
                    del pending[: _FRAME.size + size]
                    buf = bufs.get(stream)
                    if buf is None:
                        continue
                    room = cap - len(buf)
                    if size > room:
                        cut[stream] = True
                    buf += data[: max(room, 0)]
        finally:
            sel.close()
        return bytes(bufs[1]), bytes(bufs[2]), cut[1], cut[2], timed_out

    def _running(self, exec_id: str) -> bool:
        return bool(self._api.exec_inspect(exec_id).get("Running"))

    def _exit_code(self, exec_id: str, deadline: float) -> int:
        while True:
            info = self._api.exec_inspect(exec_id)
            if not info.get("Running") or time.monotonic() > deadline:
                code = info.get("ExitCode")
                return 137 if code is None else int(code)
            time.sleep(0.02)

    def _kill_all(self) -> None:
        """Kill every process of the sandbox user; restart the container if that fails."""
        errors = self._provider.errors
        try:
            kill_id = self._api.exec_create(self.container_id, _KILL_ALL, user=SANDBOX_USER)["Id"]
            self._api.exec_start(kill_id)
            if self._exit_code(kill_id, time.monotonic() + 5.0) in (0, 1):
                return  # 1: nothing left to kill
        except errors.APIError:
            pass
        try:
            self._api.kill(self.container_id)
            self._api.start(self.container_id)
        except errors.APIError as exc:
            raise SandboxStateError(f"sandbox {self.id}: cannot stop a timed-out exec") from exc

    # ----------------------------------------------------------------- files

    def _copy_in(self, src: bytes | Path, rel: str) -> None:
        with self._provider.daemon_errors(f"sandbox {self.id}: copy_in"):
            self._put(src, rel)

    def _put(self, src: bytes | Path, rel: str) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            parts = rel.split("/")
            for i in range(1, len(parts)):
                tar.addfile(_tarinfo("/".join(parts[:i]), tarfile.DIRTYPE, 0o755))
            for name, path, data in _walk(rel, src):
                if path is not None and path.is_dir():
                    tar.addfile(_tarinfo(name, tarfile.DIRTYPE, 0o755))
                    continue
                if data is None:
                    assert path is not None
                    data = path.read_bytes()
                mode = 0o755 if path is not None and path.stat().st_mode & 0o100 else 0o644
                info = _tarinfo(name, tarfile.REGTYPE, mode)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        try:
            ok = self._api.put_archive(self.container_id, self._spec.workdir, buf.getvalue())
        except self._provider.errors.APIError as exc:
            raise SandboxFileError(f"copy_in {rel!r}: {exc.explanation or exc}") from exc
        if not ok:
            raise SandboxFileError(f"copy_in {rel!r}: the daemon refused the archive")

    def _copy_out(self, rel: str, max_bytes: int) -> bytes:
        with self._provider.daemon_errors(f"sandbox {self.id}: copy_out"):
            return self._get(rel, max_bytes)

    def _get(self, rel: str, max_bytes: int) -> bytes:
        errors = self._provider.errors
        try:
            stream, st = self._api.get_archive(self.container_id, self._abs(rel))
        except errors.NotFound as exc:
            raise SandboxFileError(f"copy_out {rel!r}: no such file") from exc
        except errors.APIError as exc:
            raise SandboxFileError(f"copy_out {rel!r}: {exc.explanation or exc}") from exc
        try:
            if st.get("mode", 0) & (_DIR_BIT | _LINK_BIT) or st.get("linkTarget"):
                raise SandboxFileError(f"copy_out {rel!r}: not a regular file")
            if int(st.get("size", 0)) > max_bytes:
                raise SandboxFileError(
                    f"copy_out {rel!r}: {st['size']} bytes, more than max_bytes={max_bytes}"
                )
            data = bytearray()
            for chunk in stream:
                data += chunk
                if len(data) > max_bytes + 64 * 1024:  # a tar header or two beyond the file
                    raise SandboxFileError(f"copy_out {rel!r}: more than max_bytes={max_bytes}")
        finally:
            with contextlib.suppress(Exception):
                stream.close()
        with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                raise SandboxFileError(f"copy_out {rel!r}: not a regular file")
            f = tar.extractfile(member)
            assert f is not None
            out = f.read(max_bytes + 1)
        if len(out) > max_bytes:
            raise SandboxFileError(f"copy_out {rel!r}: more than max_bytes={max_bytes}")
        return out

    # ----------------------------------------------------------------- lifecycle

    def _destroy(self) -> None:
        self._provider.remove(self.id)


def _tarinfo(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode = kind, mode
    info.uid = info.gid = 1000
    info.mtime = int(time.time())
    return info


def _walk(rel: str, src: bytes | Path) -> Iterator[tuple[str, Path | None, bytes | None]]:
    """(archive name, host path or None, bytes or None) for what copy_in sends; host symlinks
    are skipped, as the host-dir kinds skip them."""
    if isinstance(src, bytes):
        yield rel, None, src
        return
    yield rel, src, None
    if src.is_dir():
        for child in sorted(src.rglob("*")):
            if child.is_symlink() or any(p.is_symlink() for p in child.relative_to(src).parents):
                continue
            yield f"{rel}/{child.relative_to(src).as_posix()}", child, None


class DockerProvider:
    """Docker sandboxes on one dockerd. ``base_url``: the daemon (default: the SDK's from the
    environment, DOCKER_HOST or /var/run/docker.sock); ``client``: a DockerClient instead;
    ``image``: the default image (None: build and import rootfs.py's, cached in
    ``image_cache``); ``network``: the network of a spec with ``network`` on."""

    kind = "docker"

    def __init__(
        self,
        *,
        base_url: str | None = None,
        client: Any | None = None,
        image: str | None = None,
        image_cache: Path | str | None = None,
        network: str = "host",
        timeout_s: float = 120.0,
    ) -> None:
        docker = _docker()
        import requests  # the docker SDK's transport

        self.errors = docker.errors
        self.api_errors: tuple[type[BaseException], ...] = (
            docker.errors.DockerException,
            requests.exceptions.RequestException,
        )
        try:
            if client is None:
                client = (
                    docker.DockerClient(base_url=base_url, timeout=int(timeout_s))
                    if base_url
                    else docker.from_env(timeout=int(timeout_s))
                )
            client.ping()
        except docker.errors.DockerException as exc:
            raise SandboxUnavailable(f"dockerd unreachable ({base_url or 'env'}): {exc}") from exc
        self.client = client
        self.network = network
        self._image = image
        self._image_cache = Path(image_cache) if image_cache is not None else None

    @contextlib.contextmanager
    def daemon_errors(self, what: str) -> Iterator[None]:
        """Map the SDK's errors to ours: a missing object is SandboxStateError, any other
        daemon or transport failure SandboxUnavailable (ours pass through)."""
        try:
            yield
        except SandboxError:
            raise
        except self.errors.NotFound as exc:
            raise SandboxStateError(f"{what}: not found ({exc})") from exc
        except self.api_errors as exc:
            raise SandboxUnavailable(f"{what}: dockerd failed: {exc}") from exc

    def ensure_image(self) -> str:
        """The default image, imported from rootfs.py's tar if the daemon lacks it."""
        if self._image is not None:
            return self._image
        if self._image_cache is None:
            raise SandboxSpecError("image", "no image given and no image_cache to build one in")
        tar, key = ensure_rootfs_tar(self._image_cache)
        tag = f"{DEFAULT_IMAGE_REPO}:{key}"
        try:
            self.client.images.get(tag)
        except self.errors.ImageNotFound:
            try:
                self.client.api.import_image_from_file(
                    str(tar),
                    repository=DEFAULT_IMAGE_REPO,
                    tag=key,
                    changes=[
                        "ENV PATH=/usr/local/bin:/usr/bin:/bin",
                        "WORKDIR /work",
                        f'LABEL {LABEL_PREFIX}rootfs="{key}"',
                    ],
                )
                self.client.images.get(tag)
            except self.errors.DockerException as exc:
                raise SandboxUnavailable(f"cannot import the sandbox image: {exc}") from exc
        self._image = tag
        return tag

    def create(self, spec: SandboxSpec) -> DockerSandbox:
        if spec.kind != self.kind:
            raise SandboxSpecError("kind", f"{spec.kind!r} given to the docker provider")
        image = spec.image or self.ensure_image()
        record = SandboxRecord(
            id=new_sandbox_id(),
            kind=self.kind,
            labels=spec.labels,
            owner=SandboxOwner.current(),
            created_at=time.time(),
            lifetime=spec.limits.lifetime,
        )
        sandbox = DockerSandbox(self, record, spec)
        try:
            self.client.volumes.create(name=sandbox.volume, labels=record.to_labels())
            options = container_options(
                record, spec, image=image, volume=sandbox.volume, network=self.network
            )
            container = self.client.containers.create(**options)
            sandbox.container_id = container.id
            container.start()
            for dest, src in spec.files.items():
                sandbox.copy_in(src, dest)
        except BaseException as exc:
            with contextlib.suppress(SandboxError):
                sandbox.destroy()  # what was made; the first error is the one to report
            if isinstance(exc, self.errors.ImageNotFound) or (
                isinstance(exc, self.errors.APIError) and "reference format" in str(exc)
            ):
                raise SandboxSpecError("image", f"no such image: {image!r}") from exc
            if isinstance(exc, self.api_errors):
                raise SandboxUnavailable(f"cannot create a docker sandbox: {exc}") from exc
            raise
        return sandbox

    def attach(self, sandbox_id: str, spec: SandboxSpec) -> DockerSandbox:
        """The sandbox ``sandbox_id`` made earlier (by any process using this dockerd), to
        work in; ``spec`` is the one it was made from. SandboxStateError when it is gone."""
        with self.daemon_errors(f"sandbox {sandbox_id}: attach"):
            try:
                container = self.client.containers.get(sandbox_id)
            except self.errors.NotFound as exc:
                raise SandboxStateError(f"sandbox {sandbox_id} is gone") from exc
        try:
            record = SandboxRecord.from_labels(container.labels)
        except SandboxSpecError as exc:
            raise SandboxStateError(f"sandbox {sandbox_id}: {exc}") from exc
        if container.status != "running":
            raise SandboxStateError(f"sandbox {sandbox_id} is {container.status}")
        sandbox = DockerSandbox(self, record, spec)
        sandbox.container_id = container.id
        return sandbox

    def records(self) -> list[SandboxRecord]:
        found: dict[str, SandboxRecord] = {}
        with self.daemon_errors("docker sandboxes: list"):
            containers = self.client.containers.list(all=True, filters={"label": _KIND_LABEL})
            volumes = self.client.volumes.list(filters={"label": _KIND_LABEL})
        labelled: list[Mapping[str, str]] = [c.labels for c in containers]
        labelled += [v.attrs.get("Labels") or {} for v in volumes]
        for labels in labelled:
            with contextlib.suppress(SandboxSpecError):
                record = SandboxRecord.from_labels(labels)
                found.setdefault(record.id, record)
        return sorted(found.values(), key=lambda r: r.created_at)

    def reap(self, *, stage: str | None = None, now: float | None = None) -> list[str]:
        reaped = []
        for record in self.records():
            if stage is not None and record.labels.stage != stage:
                continue
            if record.reap_reason(now=now) is not None:
                self.remove(record.id)
                reaped.append(record.id)
        return reaped

    def remove(self, sandbox_id: str) -> None:
        """Remove a sandbox's container (killing its processes) and then its volume."""
        NotFound = self.errors.NotFound
        with self.daemon_errors(f"sandbox {sandbox_id}: remove"):
            with contextlib.suppress(NotFound):
                self.client.api.remove_container(sandbox_id, force=True, v=True)
            with contextlib.suppress(NotFound):
                self.client.api.remove_volume(f"{sandbox_id}-work", force=True)

    def close(self) -> None:
        self.client.close()
