"""The sandbox kinds for real: bubblewrap (rootless, as an unprivileged host user when the tests
run as root) and docker (a private dockerd started for the session, the image imported from
the cached rootfs tar). Each behaviour is checked on both: exec output and exit code, stdin,
timeouts that kill every process and leave the sandbox usable, memory and process limits, no
network by default (a listening socket on the host's 127.0.0.1 is unreachable) and network when
asked, a writable workdir over a read-only system, copy in/out without following symlinks,
idempotent destroy. And nothing leaks: a worker SIGKILLed while its sandbox runs a command
leaves, after ``reap()``, no process, no directory, no container and no volume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _dockerd
import pytest

from rollstream.producers.rollouts.bwrap import BwrapProvider
from rollstream.producers.rollouts.docker_sandbox import DockerProvider
from rollstream.producers.rollouts.local import LocalProvider
from rollstream.producers.rollouts.reaper import MARKER_ENV
from rollstream.producers.rollouts.rootfs import ensure_rootfs_tar, extract_rootfs
from rollstream.producers.rollouts.sandbox import (
    SandboxFileError,
    SandboxLabels,
    SandboxLimits,
    SandboxProvider,
    SandboxSpec,
    SandboxSpecError,
    SandboxStateError,
)

pytestmark = pytest.mark.integration

dockerd = _dockerd.dockerd  # the session's private dockerd (a fixture)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sandbox_root() -> Iterator[Path]:
    # bwrap runs as an unprivileged host user when we are root: it must reach the root dir, so
    # not under pytest's 0700 tmp dirs
    root = Path(tempfile.mkdtemp(prefix="rs-sandboxes-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def bwrap_provider(sandbox_root: Path) -> BwrapProvider:
    return BwrapProvider(sandbox_root / "bwrap")


@pytest.fixture(scope="module")
def docker_provider(dockerd: _dockerd.Dockerd) -> Iterator[DockerProvider]:
    provider = DockerProvider(base_url=dockerd.base_url, image_cache=_dockerd.image_cache())
    provider.ensure_image()
    yield provider
    provider.close()


@pytest.fixture(params=["bwrap", "docker"])
def provider(request: pytest.FixtureRequest) -> SandboxProvider:
    p: SandboxProvider = request.getfixturevalue(f"{request.param}_provider")
    return p


def _spec(provider: SandboxProvider, **kw: object) -> SandboxSpec:
    return SandboxSpec(kind=provider.kind, **kw)


@pytest.fixture
def listening_port() -> Iterator[int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    yield srv.getsockname()[1]
    srv.close()


def _connect(port: int) -> list[str]:
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)"
    return ["python3", "-c", code]


def test_exec_output_exit_code_env_stdin_cwd(provider: SandboxProvider) -> None:
    spec = _spec(provider, files={"sub/data.txt": b"41\n"}, env={"GREETING": "hi"})
    with provider.create(spec) as sb:
        r = sb.exec("echo out; echo err >&2; echo $GREETING $EXTRA; exit 3", env={"EXTRA": "x"})
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (
            3,
            b"out\nhi x\n",
            b"err\n",
            False,
        )
        r = sb.exec(["python3", "-c", "import sys; print(int(sys.stdin.read()) + 1)"], stdin=b"41")
        assert r.ok and r.stdout == b"42\n"
        assert sb.exec(["cat", "data.txt"], cwd="sub").stdout == b"41\n"
        assert sb.exec(["pwd"], cwd="/work/sub").stdout == b"/work/sub\n"
        assert sb.exec(["no-such-command"]).exit_code == 127
        piped = sb.exec("wc -c", stdin=b"z" * (2 << 20))  # more than any pipe or socket buffer
        assert piped.ok and piped.stdout.split() == [b"2097152"]
        big = sb.exec("head -c 3000000 /dev/zero", timeout=30)
        assert big.ok and big.stdout_truncated and len(big.stdout) == spec.limits.output


def test_timeout_kills_every_process_and_the_sandbox_stays_usable(
    provider: SandboxProvider,
) -> None:
    with provider.create(_spec(provider)) as sb:
        t0 = time.monotonic()
        r = sb.exec(
            "(while :; do echo x >> ticks; sleep 0.05; done) & echo started; wait", timeout=1
        )
        assert r.timed_out and r.exit_code == 137 and r.stdout == b"started\n"
        assert time.monotonic() - t0 < 8
        size = len(sb.copy_out("ticks"))
        time.sleep(0.5)  # the ticker would have written ~10 lines by now if it still ran
        assert len(sb.copy_out("ticks")) == size > 0
        assert sb.exec("echo still usable; cat ticks | head -1").stdout == b"still usable\nx\n"


def test_memory_limit(provider: SandboxProvider) -> None:
    spec = _spec(provider, limits=SandboxLimits(memory=128 << 20))
    with provider.create(spec) as sb:
        small = sb.exec(["python3", "-c", "s = b'x' * (16 << 20); print(len(s))"])
        assert small.ok and small.stdout == b"16777216\n"
        big = sb.exec(["python3", "-c", "s = b'x' * (512 << 20); print('allocated')"])
        assert big.exit_code != 0 and b"allocated" not in big.stdout  # MemoryError or OOM kill


def test_process_limit(provider: SandboxProvider) -> None:
    spec = _spec(provider, limits=SandboxLimits(pids=16))
    code = (
        "import subprocess\n"
        "ps = []\n"
        "try:\n"
        "    for _ in range(40): ps.append(subprocess.Popen(['sleep', '5']))\n"
        "except OSError as e: print('refused', e.errno)\n"
        "print(len(ps))\n"
        "for p in ps: p.kill()\n"
    )
    with provider.create(spec) as sb:
        r = sb.exec(["python3", "-c", code], timeout=60)
        lines = r.stdout.decode().split()
        assert lines[0] == "refused" and int(lines[-1]) < 16, r


def test_no_network_by_default_and_network_when_asked(
    provider: SandboxProvider, listening_port: int
) -> None:
    with provider.create(_spec(provider)) as sb:
        r = sb.exec(_connect(listening_port))
        assert r.exit_code != 0 and b"Error" in r.stderr
    with provider.create(_spec(provider, network=True)) as sb:
        assert sb.exec(_connect(listening_port)).ok


def test_workdir_writable_system_read_only(provider: SandboxProvider) -> None:
    with provider.create(_spec(provider)) as sb:
        r = sb.exec(
            "touch /work/new && echo w; touch /usr/x || echo usr-ro; touch /etc/x || echo etc-ro;"
            "echo t > /tmp/t && cat /tmp/t; id -u"
        )
        assert r.stdout == b"w\nusr-ro\netc-ro\nt\n1000\n", r
        hidden = sb.exec(f"ls {Path(__file__)} /root/.bashrc {REPO}/pyproject.toml")
        assert hidden.exit_code != 0 and hidden.stdout == b""


def test_copy_in_and_out(provider: SandboxProvider, tmp_path: Path) -> None:
    src = tmp_path / "task"
    (src / "tests").mkdir(parents=True)
    (src / "solution.py").write_text("def f():\n    return 42\n")
    (src / "tests" / "test_f.py").write_text("from solution import f\nassert f() == 42\n")
    with provider.create(_spec(provider)) as sb:
        assert sb.copy_in(src, "task") == "/work/task"
        assert sb.copy_in(b"\x00\x01binary", "/work/blob.bin") == "/work/blob.bin"
        r = sb.exec(["python3", "tests/test_f.py"], cwd="task", env={"PYTHONPATH": "/work/task"})
        assert r.ok, r
        assert sb.copy_out("blob.bin") == b"\x00\x01binary"
        assert sb.exec("echo result > task/out.txt && ln -s /etc/passwd leak").ok
        assert sb.copy_out("/work/task/out.txt") == b"result\n"
        with pytest.raises(SandboxFileError):
            sb.copy_out("leak")
        with pytest.raises(SandboxFileError):
            sb.copy_out("task/out.txt", max_bytes=3)
        with pytest.raises(SandboxFileError):
            sb.copy_out("nope.txt")
        with pytest.raises(SandboxFileError):
            sb.copy_in(b"x", "/etc/x")


def test_destroy_is_idempotent_and_leaves_nothing(provider: SandboxProvider) -> None:
    sb = provider.create(_spec(provider, labels=SandboxLabels(stage="eval")))
    assert sb.id in {r.id for r in provider.records()}
    sb.destroy()
    sb.destroy()
    assert sb.id not in {r.id for r in provider.records()}
    _assert_gone(provider, sb.id)
    with pytest.raises(SandboxStateError):
        sb.exec("true")


def test_a_missing_image_names_the_field(provider: SandboxProvider) -> None:
    before = {r.id for r in provider.records()}
    with pytest.raises(SandboxSpecError) as err:
        provider.create(_spec(provider, image="/no/such/rootfs"))  # not a dir; bad reference
    with pytest.raises(SandboxSpecError) as err:
        provider.create(_spec(provider, image="rollstream-no-such-image:1"))
    assert err.value.field == "image"
    assert {r.id for r in provider.records()} == before  # nothing half-made is left


def test_bwrap_process_limits_are_per_sandbox(bwrap_provider: BwrapProvider) -> None:
    # the same host user runs every sandbox: each still gets its own 16 processes
    spec = SandboxSpec(limits=SandboxLimits(pids=16))
    boxes = [bwrap_provider.create(spec) for _ in range(3)]
    try:
        with ThreadPoolExecutor(3) as pool:
            results = list(
                pool.map(
                    lambda sb: sb.exec("for i in 1 2 3 4 5 6 7 8 9 10; do sleep 1 & done; wait"),
                    boxes,
                )
            )
        assert all(r.ok for r in results), results
    finally:
        for sb in boxes:
            sb.destroy()


def test_bwrap_on_the_built_rootfs(bwrap_provider: BwrapProvider, sandbox_root: Path) -> None:
    tar, _ = ensure_rootfs_tar(_dockerd.image_cache())
    rootfs = extract_rootfs(tar, sandbox_root / "rootfs")
    with bwrap_provider.create(SandboxSpec(image=str(rootfs))) as sb:
        r = sb.exec("grep -c sandbox /etc/passwd; python3 -c 'import json, ssl; print(6 * 7)'")
        assert r.stdout == b"1\n42\n", r


# --------------------------------------------------------------------------- nothing leaks

CHILD = r"""
import json, sys, threading, time
from rollstream.producers.rollouts.sandbox import SandboxSpec, SandboxLabels, open_provider
kind, options = sys.argv[1], json.loads(sys.argv[2])
provider = open_provider(kind, **options)
sb = provider.create(SandboxSpec(kind=kind, labels=SandboxLabels(stage="run", worker_id="w9")))
threading.Thread(
    target=sb.exec, args=("echo up > started; sleep 300 & sleep 300",), daemon=True
).start()
while True:
    try:
        if sb.copy_out("started"):
            break
    except Exception:
        time.sleep(0.05)
print(sb.id, flush=True)
time.sleep(600)
"""


def _marked_pids(sandbox_id: str) -> list[int]:
    marker = f"{MARKER_ENV}={sandbox_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _assert_gone(provider: SandboxProvider, sandbox_id: str) -> None:
    if isinstance(provider, DockerProvider):
        label = f"rollstream.io/sandbox-id={sandbox_id}"
        assert provider.client.containers.list(all=True, filters={"label": label}) == []
        assert provider.client.volumes.list(filters={"label": label}) == []
    else:
        assert isinstance(provider, BwrapProvider | LocalProvider)
        assert not (provider.root / sandbox_id).exists()
        assert not (provider.root / f"{sandbox_id}.json").exists()
        assert _marked_pids(sandbox_id) == []


@pytest.mark.parametrize("kind", ["bwrap", "docker", "local"])
def test_a_sigkilled_worker_leaves_nothing_after_reap(
    kind: str, sandbox_root: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "docker":
        provider: SandboxProvider = request.getfixturevalue("docker_provider")
        assert isinstance(provider, DockerProvider)
        options = {"base_url": request.getfixturevalue("dockerd").base_url}
        options["image"] = provider.ensure_image()
    else:
        root = sandbox_root / f"kill-{kind}"
        provider = BwrapProvider(root) if kind == "bwrap" else LocalProvider(root)
        options = {"root": str(root)}
    worker = subprocess.Popen(
        [sys.executable, "-c", CHILD, kind, json.dumps(options)],
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    try:
        assert worker.stdout is not None
        sandbox_id = worker.stdout.readline().decode().strip()
        assert sandbox_id.startswith("sbx-"), "the worker did not start its sandbox"
        os.kill(worker.pid, signal.SIGKILL)
    finally:
        worker.kill()
        worker.wait()
    record = next(r for r in provider.records() if r.id == sandbox_id)
    assert record.labels.worker_id == "w9" and record.owner.pid == worker.pid
    if kind == "local":  # no namespace: the background sleep outlived its worker
        assert _marked_pids(sandbox_id)
    assert sandbox_id in provider.reap(stage="run")
    _assert_gone(provider, sandbox_id)
    assert sandbox_id not in provider.reap()
