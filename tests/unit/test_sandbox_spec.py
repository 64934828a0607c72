"""The sandbox contract's values: every limit, label, env entry, path and file of a spec is
bounded, and a bad one is a SandboxSpecError naming its field; records round-trip through
labels; the reaper's verdict on owners (dead pid, reused pid, other host, expired)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollstream.producers.errors import ProducerError
from rollstream.producers.rollouts.sandbox import (
    MANIFEST_KINDS,
    SANDBOX_KINDS,
    ExecResult,
    SandboxError,
    SandboxLabels,
    SandboxLimits,
    SandboxOwner,
    SandboxRecord,
    SandboxSpec,
    SandboxSpecError,
    SandboxUnavailable,
    new_sandbox_id,
    open_provider,
    provider_class,
    sandbox_relpath,
    shell_argv,
)


def test_defaults_are_valid_and_network_is_off() -> None:
    spec = SandboxSpec()
    assert spec.kind == "bwrap" and spec.network is False and spec.workdir == "/work"
    assert spec.limits.memory == 1 << 30 and spec.limits.timeout == 600.0


def test_errors_derive_from_the_producers_root() -> None:
    assert issubclass(SandboxError, ProducerError)
    assert issubclass(SandboxSpecError, ValueError)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cpu", 0),
        ("cpu", 1000.0),
        ("cpu", float("nan")),
        ("memory", 1024),
        ("memory", 1.5e9),  # not an integer
        ("pids", 0),
        ("pids", True),  # a bool is not a count
        ("timeout", 0),
        ("timeout", float("inf")),
        ("disk", -1),
        ("output", 1 << 40),
        ("copy_out", "big"),
        ("lifetime", 0.5),
    ],
)
def test_a_limit_out_of_bounds_names_its_field(field: str, value: object) -> None:
    with pytest.raises(SandboxSpecError) as err:
        SandboxLimits(**{field: value})
    assert err.value.field == f"limits.{field}"
    assert str(err.value).startswith(f"limits.{field}: ")


@pytest.mark.parametrize("value", ["-x", "x-", "a b", "é", "x" * 64, "a/b", 3])
def test_a_label_value_must_be_a_kubernetes_label_value(value: object) -> None:
    with pytest.raises(SandboxSpecError) as err:
        SandboxLabels(rollout_id=value)
    assert err.value.field == "labels.rollout_id"


def test_good_labels() -> None:
    labels = SandboxLabels(job_id="j-1", rollout_id="01J" + "A" * 23, stage="run", worker_id="w.0")
    assert labels.as_dict()["stage"] == "run"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "firecracker"}, "kind"),
        ({"image": ""}, "image"),
        ({"network": "yes"}, "network"),
        ({"workdir": "work"}, "workdir"),
        ({"workdir": "/"}, "workdir"),
        ({"workdir": "/tmp/w"}, "workdir"),
        ({"workdir": "/work/../etc"}, "workdir"),
        ({"env": {"1BAD": "x"}}, "env.1BAD"),
        ({"env": {"A": "nul\0"}}, "env.A"),
        ({"env": {f"V{i}": "x" for i in range(300)}}, "env"),
        ({"files": {"../escape": b"x"}}, "files.../escape"),
        ({"files": {"/etc/passwd": b"x"}}, "files./etc/passwd"),
        ({"files": {"a": "text, not bytes"}}, "files.a"),
        ({"limits": {"memory": 1}}, "limits"),
    ],
)
def test_a_bad_spec_names_its_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(SandboxSpecError) as err:
        SandboxSpec(**kwargs)
    assert err.value.field == field


def test_from_dict_reads_a_job_file_and_names_unknown_keys() -> None:
    spec = SandboxSpec.from_dict(
        {
            "kind": "docker",
            "network": True,
            "limits": {"memory": 256 << 20, "timeout": 30},
            "labels": {"stage": "eval"},
            "files": {"task/main.py": "print(1)\n"},
        }
    )
    assert spec.kind == "docker" and spec.limits.memory == 256 << 20
    assert spec.files == {"task/main.py": b"print(1)\n"} and spec.labels.stage == "eval"
    with pytest.raises(SandboxSpecError) as err:
        SandboxSpec.from_dict({"limits": {"memroy": 1}})
    assert err.value.field == "limits.memroy"
    with pytest.raises(SandboxSpecError) as err:
        SandboxSpec.from_dict({"netwrok": True})
    assert err.value.field == "sandbox.netwrok"
    with pytest.raises(SandboxSpecError) as err:
        SandboxSpec.from_dict({"limits": {"pids": 1}})
    assert err.value.field == "limits.pids"


@pytest.mark.parametrize(
    ("path", "rel"),
    [("a.txt", "a.txt"), ("/work/a/b", "a/b"), ("./a/../b", "b"), (".", ""), ("/work", "")],
)
def test_sandbox_relpath(path: str, rel: str) -> None:
    assert sandbox_relpath("/work", path) == rel


@pytest.mark.parametrize("path", ["../x", "/work/../x", "/workx/a", "/etc/passwd", "", "a\0b"])
def test_sandbox_relpath_refuses_to_leave_the_workdir(path: str) -> None:
    with pytest.raises(SandboxSpecError):
        sandbox_relpath("/work", path)


def test_shell_argv() -> None:
    assert shell_argv("echo hi") == ["/bin/sh", "-c", "echo hi"]
    assert shell_argv(["ls", "-l"]) == ["ls", "-l"]
    for bad in ([], [""], ["a\0"], ["x" * (300 * 1024)]):
        with pytest.raises(SandboxSpecError) as err:
            shell_argv(bad)
        assert err.value.field == "command"


def test_record_round_trips_through_labels() -> None:
    record = SandboxRecord(
        id=new_sandbox_id(),
        kind="docker",
        labels=SandboxLabels(job_id="j", rollout_id="r", stage="run", worker_id="w1"),
        owner=SandboxOwner.current(),
        created_at=1_700_000_000.25,
        lifetime=60.0,
    )
    flat = record.to_labels()
    assert all(k.startswith("rollstream.io/") and isinstance(v, str) for k, v in flat.items())
    assert SandboxRecord.from_labels(flat) == record
    with pytest.raises(SandboxSpecError):
        SandboxRecord.from_labels({**flat, "rollstream.io/sandbox-id": "../../etc"})
    with pytest.raises(SandboxSpecError):
        SandboxRecord.from_labels({"rollstream.io/kind": "docker"})


def _record(owner: SandboxOwner, created_at: float = 1e12) -> SandboxRecord:
    return SandboxRecord(new_sandbox_id(), "bwrap", SandboxLabels(), owner, created_at, 60.0)


def test_reap_reason_judges_owners() -> None:
    me = SandboxOwner.current()
    assert me.alive() and _record(me).reap_reason(now=1e12) is None
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = SandboxOwner(me.host, child.pid, me.start, me.boot_id)
    assert not dead.alive() and _record(dead).reap_reason() == "owner-dead"
    reused = SandboxOwner(me.host, os.getpid(), me.start + 1, me.boot_id)  # same pid, not me
    assert _record(reused).reap_reason() == "owner-dead"
    rebooted = SandboxOwner(me.host, os.getpid(), me.start, "another-boot")
    assert _record(rebooted).reap_reason() == "owner-dead"
    elsewhere = SandboxOwner("some-other-host", 1, 1, "x")
    assert elsewhere.alive()  # not ours to judge
    assert _record(me, created_at=1000.0).reap_reason(now=1061.0) == "expired"


def test_exec_result() -> None:
    r = ExecResult(0, b"ok\xff", b"", 0.1)
    assert r.ok and r.text() == "ok\ufffd"
    assert not ExecResult(0, b"", b"", 1.0, timed_out=True).ok
    assert not ExecResult(1, b"", b"", 1.0).ok


def test_registry_resolves_kinds(tmp_path: Path) -> None:
    assert set(SANDBOX_KINDS) == {"bwrap", "docker", "local"} and MANIFEST_KINDS == ("k8s",)
    assert provider_class("local").kind == "local"
    assert open_provider("local", root=tmp_path).kind == "local"
    with pytest.raises(SandboxSpecError) as err:
        provider_class("vm")
    assert err.value.field == "kind"
    with pytest.raises(SandboxUnavailable, match="manifests only"):
        provider_class("k8s")
