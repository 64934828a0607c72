"""The host-dir machinery under every host sandbox, on the ``local`` kind (no isolation, so no
bubblewrap needed): bounded exec (deadline kills the process group, output cut and flagged,
stdin, 127 for a missing command), symlink-proof copy in/out, state files and the reaper; and
the command lines the bwrap and docker kinds build (pure functions)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rollstream.producers.rollouts.bwrap import bwrap_argv, host_binds
from rollstream.producers.rollouts.docker_sandbox import container_options
from rollstream.producers.rollouts.local import LocalProvider, run_bounded
from rollstream.producers.rollouts.reaper import reap
from rollstream.producers.rollouts.sandbox import (
    SandboxFileError,
    SandboxLabels,
    SandboxLimits,
    SandboxOwner,
    SandboxRecord,
    SandboxSpec,
    SandboxSpecError,
    SandboxStateError,
    new_sandbox_id,
)

ENV = {"PATH": "/usr/bin:/bin"}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_run_bounded_output_exit_code_and_stdin(tmp_path: Path) -> None:
    r = run_bounded(
        ["sh", "-c", "cat; echo err >&2; exit 7"],
        env=ENV,
        cwd=tmp_path,
        stdin=b"in" * 100_000,
        timeout=10,
        max_output=1 << 20,
    )
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (7, b"in" * 100_000, b"err\n", False)


def test_run_bounded_cuts_output_and_flags_it(tmp_path: Path) -> None:
    r = run_bounded(
        ["sh", "-c", "head -c 300000 /dev/zero; echo e >&2"],
        env=ENV,
        cwd=tmp_path,
        stdin=None,
        timeout=10,
        max_output=1000,
    )
    assert r.exit_code == 0 and len(r.stdout) == 1000 and r.stdout_truncated
    assert r.stderr == b"e\n" and not r.stderr_truncated


def test_run_bounded_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "bg.pid"
    t0 = time.monotonic()
    r = run_bounded(
        ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; echo started; wait"],
        env=ENV,
        cwd=tmp_path,
        stdin=None,
        timeout=0.5,
        max_output=100,
    )
    assert r.timed_out and r.exit_code == 137 and r.stdout == b"started\n"
    assert time.monotonic() - t0 < 5
    assert not _alive(int(pidfile.read_text()))


def test_run_bounded_kills_background_leftovers_after_exit(tmp_path: Path) -> None:
    pidfile = tmp_path / "bg.pid"
    r = run_bounded(
        ["sh", "-c", f"sleep 60 > /dev/null 2>&1 & echo $! > {pidfile}"],
        env=ENV,
        cwd=tmp_path,
        stdin=None,
        timeout=10,
        max_output=100,
    )
    assert r.ok
    deadline = time.monotonic() + 5
    while _alive(int(pidfile.read_text())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(int(pidfile.read_text()))


def test_run_bounded_missing_command_is_127(tmp_path: Path) -> None:
    r = run_bounded(
        ["/nonexistent/tool"], env=ENV, cwd=tmp_path, stdin=None, timeout=5, max_output=100
    )
    assert r.exit_code == 127 and b"tool" in r.stderr


@pytest.fixture
def local(tmp_path: Path) -> LocalProvider:
    return LocalProvider(tmp_path / "sandboxes")


def test_local_sandbox_exec_files_and_destroy(local: LocalProvider) -> None:
    spec = SandboxSpec(kind="local", files={"task/in.txt": b"41"}, env={"K": "v"})
    sb = local.create(spec)
    assert (local.root / f"{sb.id}.json").is_file()
    r = sb.exec("echo $(( $(cat task/in.txt) + 1 )) > task/out.txt; echo $K", timeout=10)
    assert r.ok and r.stdout == b"v\n"
    assert sb.copy_out("task/out.txt") == b"42\n"
    assert sb.copy_out("/work/task/out.txt") == b"42\n"
    assert sb.exec(["pwd"], cwd="task").stdout.strip().endswith(b"/work/task")
    sb.copy_in(b"x" * 10, "big")
    with pytest.raises(SandboxFileError, match="max_bytes"):
        sb.copy_out("big", max_bytes=9)
    with pytest.raises(SandboxFileError):
        sb.copy_out("missing")
    with pytest.raises(SandboxFileError):
        sb.copy_out("task")  # a directory
    with pytest.raises(SandboxFileError):
        sb.copy_in(b"x", "../outside")
    with pytest.raises(SandboxSpecError) as err:
        sb.exec("true", timeout=601)
    assert err.value.field == "timeout"
    sb.destroy()
    sb.destroy()  # idempotent
    assert list(local.root.iterdir()) == []
    with pytest.raises(SandboxStateError):
        sb.exec("true")


def test_copy_never_follows_a_symlink_out(local: LocalProvider, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    with local.create(SandboxSpec(kind="local")) as sb:
        assert sb.exec(f"ln -s {secret} leak && ln -s {tmp_path} dir").ok
        with pytest.raises(SandboxFileError, match="symlink"):
            sb.copy_out("leak")
        with pytest.raises(SandboxFileError):
            sb.copy_out("dir/secret")
        with pytest.raises(SandboxFileError):
            sb.copy_in(b"overwritten", "leak")
        with pytest.raises(SandboxFileError):
            sb.copy_in(b"new", "dir/planted")
    assert secret.read_text() == "host secret" and not (tmp_path / "planted").exists()


def test_copy_in_a_directory(local: LocalProvider, tmp_path: Path) -> None:
    src = tmp_path / "task"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    (src / "link").symlink_to("/etc/passwd")
    with local.create(SandboxSpec(kind="local", files={"t": src})) as sb:
        assert sb.exec("./t/run.sh").stdout == b"ran\n"
        assert sb.copy_out("t/pkg/mod.py") == b"X = 1\n"
        assert not sb.exec("test -e t/link").ok  # host symlinks are not copied


def test_create_rejects_a_spec_of_another_kind(local: LocalProvider) -> None:
    with pytest.raises(SandboxSpecError) as err:
        local.create(SandboxSpec(kind="bwrap"))
    assert err.value.field == "kind"


def test_reaper_removes_only_dead_owners_sandboxes(local: LocalProvider) -> None:
    mine = local.create(SandboxSpec(kind="local", labels=SandboxLabels(stage="run")))
    me = SandboxOwner.current()
    dead_owner = SandboxOwner(me.host, me.pid, me.start + 12345, me.boot_id)
    orphan = SandboxRecord(new_sandbox_id(), "local", SandboxLabels(stage="run"), dead_owner, 0, 60)
    local._write_record(orphan)
    (local.root / orphan.id / "work").mkdir(parents=True)
    assert {r.id for r in local.records()} == {mine.id, orphan.id}
    assert local.reap(stage="eval") == []  # another stage's
    assert reap([local], stage="run") == {"local": [orphan.id]}
    assert not (local.root / orphan.id).exists()
    assert not (local.root / f"{orphan.id}.json").exists()
    assert [r.id for r in local.records()] == [mine.id]
    mine.destroy()


def test_bwrap_argv_isolates_by_default() -> None:
    spec = SandboxSpec(limits=SandboxLimits(memory=256 << 20, pids=64, disk=8 << 20))
    argv = bwrap_argv(
        bwrap="bwrap",
        prlimit="/usr/bin/prlimit",
        sandbox_id="sbx-1",
        spec=spec,
        argv=["python3", "-V"],
        cwd="sub",
        cpu_seconds=30,
        host_workdir="/srv/sbx-1/work",
        system=host_binds(),
    )
    assert "--unshare-all" in argv and "--share-net" not in argv
    assert argv[argv.index("--bind") + 1 : argv.index("--bind") + 3] == ["/srv/sbx-1/work", "/work"]
    assert argv[argv.index("--chdir") + 1] == "/work/sub"
    assert argv[argv.index("--cap-drop") + 1] == "ALL" and "--die-with-parent" in argv
    tail = argv[argv.index("/usr/bin/prlimit") :]
    assert tail == [
        "/usr/bin/prlimit",
        f"--as={256 << 20}",
        "--nproc=64",
        "--cpu=30",
        f"--fsize={8 << 20}",
        "--",
        "python3",
        "-V",
    ]
    assert argv[argv.index("/usr") - 1 : argv.index("/usr") + 2] == ["--ro-bind", "/usr", "/usr"]
    net = bwrap_argv(
        bwrap="bwrap",
        prlimit="/usr/bin/prlimit",
        sandbox_id="sbx-1",
        spec=SandboxSpec(network=True, image="/srv/rootfs"),
        argv=["true"],
        cwd="",
        cpu_seconds=1,
        host_workdir="/w",
        system=host_binds(),
    )
    assert "--share-net" in net and "/usr" not in net
    assert net[net.index("--ro-bind") : net.index("--ro-bind") + 3] == [
        "--ro-bind",
        "/srv/rootfs",
        "/",
    ]


def test_container_options_map_every_limit() -> None:
    spec = SandboxSpec(
        kind="docker", limits=SandboxLimits(cpu=1.5, memory=256 << 20, pids=64, disk=64 << 20)
    )
    record = SandboxRecord(
        new_sandbox_id(), "docker", SandboxLabels(rollout_id="r1"), SandboxOwner.current(), 0, 60
    )
    opts = container_options(record, spec, image="img", volume="v", network="host")
    assert opts["network_mode"] == "none"
    assert opts["mem_limit"] == opts["memswap_limit"] == 256 << 20
    assert opts["nano_cpus"] == 1_500_000_000 and opts["pids_limit"] == 64
    assert opts["read_only"] is True and opts["cap_drop"] == ["ALL"] and not opts["auto_remove"]
    assert opts["volumes"] == {"v": {"bind": "/work", "mode": "rw"}}
    assert opts["labels"]["rollstream.io/rollout-id"] == "r1"
    assert dict(opts["ulimits"][0]) == {"Name": "fsize", "Soft": 64 << 20, "Hard": 64 << 20}
    net = container_options(
        record, SandboxSpec(kind="docker", network=True), image="i", volume="v", network="host"
    )
    assert net["network_mode"] == "host"


def test_local_limits_memory_and_time(local: LocalProvider) -> None:
    spec = SandboxSpec(kind="local", limits=SandboxLimits(memory=256 << 20, timeout=5))
    with local.create(spec) as sb:
        r = sb.exec(["python3", "-c", "b = bytearray(512 << 20)"])
        assert r.exit_code != 0 and b"MemoryError" in r.stderr
        t0 = time.monotonic()
        r = sb.exec("sleep 30", timeout=0.3)
        assert r.timed_out and time.monotonic() - t0 < 3
        assert sb.exec("echo still usable").stdout == b"still usable\n"
    assert os.listdir(local.root) == []
