"""An open-source agent harness, installed from PyPI as a user would and left unmodified, runs as
a rollout of the rollout service: mini-swe-agent (through litellm) in a venv of its own, driven by
the command agent from `examples/jobs/mini-swe-agent.yaml`, against the recording proxy and the
reference model server (the tiny model) on the session's Kafka broker. Its model calls are on the
log as the rollout's LlmCalls (token ids and all; as many as the harness's own trajectory counts),
the rollout ends once, and the harness's installed files are byte for byte what pip installed.

The tiny model has a 2,048-token context and writes no valid tool call, so the job is bounded to
fit it: a short task prompt instead of mini.yaml's ~1,900-token one, 24 completion tokens a call,
at most 3 model calls, and no retries by mini (the proxy's 413 for a context overflow reaches
litellm as a retryable APIError: mini's default 10 attempts take minutes; with one, the harness
exits 1 and the rollout fails at RUN within seconds). The example's bubblewrap arguments for the
model's bash commands are checked on their own, through the harness's own environment class.
The harness venv is cached under ~/.cache/rollstream (built once, under a file lock)."""

from __future__ import annotations

import base64
import csv
import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from _rollout_stack import events_of, fresh_settings, rollout_stack

from rollstream.infra.kafka import KafkaBroker
from rollstream.producers.rollouts.agents import build_agent
from rollstream.producers.rollouts.bwrap import BwrapProvider
from rollstream.producers.rollouts.evaluators import build_evaluator
from rollstream.producers.rollouts.jobs import expand, parse_job, resolve_tasks
from rollstream.producers.rollouts.runner import run_rollout
from rollstream.schemas import CommonSettings, LlmCall, RolloutFinished, RolloutStarted

pytestmark = pytest.mark.integration

PACKAGE, VERSION = "mini-swe-agent", "2.4.6"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "jobs" / "mini-swe-agent.yaml"
CACHE = Path.home() / ".cache" / "rollstream"
ADMIN = "admin-key-for-harness-tests"
TASK_ID = "balanced-brackets"
STEP_LIMIT = 3
RUN_TIMEOUT_S = 120
# Runs in the harness venv: its own bubblewrap environment, configured as the example job does.
# argv[1]: JSON {cwd, wrapper_args, commands}; prints {name: output dict}.
EXECUTE = """
import json, sys
from minisweagent.environments.extra.bubblewrap import BubblewrapEnvironment

args = json.loads(sys.argv[1])
env = BubblewrapEnvironment(cwd=args["cwd"], wrapper_args=args["wrapper_args"], timeout=20)
print(json.dumps({k: env.execute({"command": c}) for k, c in args["commands"].items()}))
"""
SHORT_PROMPT = (
    "{{task}}\n\nUse the bash tool for every command. When done, run exactly: "
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
)


# --------------------------------------------------------------------------- the harness venv


def ensure_harness_venv(root: Path, package: str, version: str, wait_s: float = 900.0) -> Path:
    """``root/harness-venv-<version>``: a venv made with ``python -m venv`` holding
    ``package==version`` from PyPI, built once and reused. A file lock keeps concurrent test
    runs from building it at once; a marker written last (naming the package and this Python)
    tells a finished venv from one a killed run left half-built, which is built again."""
    root.mkdir(parents=True, exist_ok=True)
    venv = root / f"harness-venv-{version}"
    marker = venv / ".rollstream-complete"
    key = f"{package}=={version} python {sys.version_info.major}.{sys.version_info.minor}"
    with open(root / f"harness-venv-{version}.lock", "w") as lock:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, f"{venv} stayed locked for {wait_s} s"
                time.sleep(1.0)
        if marker.is_file() and marker.read_text() == key:
            return venv
        shutil.rmtree(venv, ignore_errors=True)  # venvs are not relocatable: built in place
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-input"]
        subprocess.run(
            [*pip, "--disable-pip-version-check", f"{package}=={version}"],
            check=True,
            timeout=wait_s,
        )
        marker.write_text(key)
    return venv


def site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python3*/site-packages")
    return found


def record_mismatches(venv: Path, distribution: str) -> tuple[int, list[str]]:
    """(files checked, files that differ) of a distribution's installed files against pip's
    RECORD (path, sha256 in urlsafe base64, size)."""
    site = site_packages(venv)
    name = distribution.replace("-", "_")
    (dist_info,) = site.glob(f"{name}-*.dist-info")
    checked, bad = 0, []
    with open(dist_info / "RECORD", newline="") as f:
        for path, digest, size in csv.reader(f):
            if not digest:  # RECORD itself, and files pip does not hash
                continue
            algo, _, want = digest.partition("=")
            assert algo == "sha256", digest
            data = (site / path).read_bytes()
            got = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            checked += 1
            if got != want or str(len(data)) != size:
                bad.append(path)
    return checked, bad


def tree_state(folder: Path) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime_ns) of every file under ``folder``."""
    state = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            state[os.path.relpath(path, folder)] = (st.st_size, st.st_mtime_ns)
    return state


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def harness_venv() -> Path:
    venv = ensure_harness_venv(CACHE, PACKAGE, VERSION)
    assert (venv / "bin" / "mini").is_file()
    return venv


@pytest.fixture(scope="module")
def settings(kafka: KafkaBroker, tmp_path_factory: pytest.TempPathFactory) -> CommonSettings:
    return fresh_settings(kafka.bootstrap, tmp_path_factory.mktemp("harness-home"))


@pytest.fixture(scope="module")
def proxy_url(settings: CommonSettings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("harness-services")
    with rollout_stack(settings, tmp, admin_key=ADMIN, producer="proxy-harness-it") as url:
        yield url


@pytest.fixture(scope="module")
def provider() -> Iterator[BwrapProvider]:
    # bwrap runs as an unprivileged host user when we are root: it must reach the root dir
    root = Path(tempfile.mkdtemp(prefix="rs-harness-sb-"))
    root.chmod(0o755)
    yield BwrapProvider(root / "bwrap")
    shutil.rmtree(root, ignore_errors=True)


def bounded_job(venv: Path, trajectory: Path) -> dict[str, Any]:
    """The example job with the harness's path, one task and one sample, bounded for the tiny
    model (module docstring), writing its trajectory to ``trajectory``."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    agent = spec["agent"]
    assert agent["argv"][0] == "mini"
    agent["argv"] = [
        str(venv / "bin" / "mini"),
        *agent["argv"][1:],
        *("-c", f"agent.step_limit={STEP_LIMIT}"),
        *("-c", "model.model_kwargs.max_tokens=24"),
        *("-c", f"agent.instance_template={SHORT_PROMPT}"),
        f"--output={trajectory}",
    ]
    agent["set_env"]["MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT"] = "1"
    spec.update(
        job_id="it-mini-swe-agent",
        tasks={"suite": "pycoding", "ids": [TASK_ID]},
        samples_per_task=1,
        timeouts={"init": 60, "run": RUN_TIMEOUT_S, "eval": 60},
        run_id="it",
    )
    return spec


# --------------------------------------------------------------------------- the rollout


def test_mini_swe_agent_from_pypi_runs_as_a_rollout(
    settings: CommonSettings,
    proxy_url: str,
    provider: BwrapProvider,
    harness_venv: Path,
    tmp_path: Path,
) -> None:
    site = site_packages(harness_venv)
    before = tree_state(site)
    trajectory = tmp_path / "trajectory.json"
    job = parse_job(bounded_job(harness_venv, trajectory))
    (task,) = resolve_tasks(job)
    (plan,) = expand(job, [task])

    t0 = time.monotonic()
    result = run_rollout(
        plan,
        job,
        task,
        proxy_url=proxy_url,
        admin_key=ADMIN,
        sandbox_provider=provider,
        agent=build_agent(job.agent, environ=os.environ),
        evaluator=build_evaluator(job.evaluator),
        worker_id="w1",
    )
    elapsed = time.monotonic() - t0
    agent = result.agent
    assert agent is not None, result
    assert (result.status, result.stage) == ("completed", "done"), (result, agent.output)
    assert (agent.status, agent.stop) == ("ok", "exit"), agent.output
    assert elapsed < RUN_TIMEOUT_S
    assert result.evaluation is not None and result.evaluation.final == 0.0  # unsolved
    assert provider.records() == []

    # the harness's own account of its run: every model call it made is on the log
    traj = json.loads(trajectory.read_text())
    assert traj["info"]["mini_version"] == VERSION
    api_calls = traj["info"]["model_stats"]["api_calls"]
    assert 1 <= api_calls <= STEP_LIMIT, traj["info"]
    assert traj["info"]["exit_status"] in {"LimitsExceeded", "RepeatedFormatError", "Submitted"}

    events = events_of(settings, plan.rollout_id)
    started, finished = events[0].body, events[-1].body
    assert isinstance(started, RolloutStarted) and isinstance(finished, RolloutFinished)
    assert started.harness == "command:mini"
    assert sum(isinstance(e.body, RolloutFinished) for e in events) == 1
    assert (finished.status.value, finished.error) == ("completed", None)
    calls = [e.body for e in events if isinstance(e.body, LlmCall)]
    assert len(calls) == api_calls
    for call in calls:  # recorded by the proxy with the policy's tokens
        assert call.prompt_len > 0 and len(call.completion_ids) > 0
        assert len(call.completion_logprobs) == len(call.completion_ids)
    # each call continues the one before it: the harness resends its conversation
    assert [c.parent_call_id for c in calls[1:]] == [c.call_id for c in calls[:-1]]

    # the harness ran unmodified: pip's RECORD still verifies, nothing under site-packages moved
    checked, bad = record_mismatches(harness_venv, PACKAGE)
    assert checked > 50 and bad == []
    assert tree_state(site) == before


def example_wrapper_args() -> list[str]:
    """The bubblewrap arguments the example job gives mini's environment."""
    argv = yaml.safe_load(EXAMPLE.read_text())["agent"]["argv"]
    (arg,) = [a for a in argv if a.startswith("environment.wrapper_args=")]
    args = json.loads(arg.partition("=")[2])
    assert isinstance(args, list) and all(isinstance(a, str) for a in args)
    return args


def test_the_example_keeps_the_harness_commands_off_the_host(
    harness_venv: Path, tmp_path: Path
) -> None:
    """The model's bash commands, run by the harness's own bubblewrap environment with the
    example's arguments: the workdir is writable, the rest of the host is not there or
    read-only, no network (not even the host's loopback), none of the harness's environment."""
    workdir, outside = tmp_path / "work", tmp_path / "outside.txt"
    workdir.mkdir()
    outside.write_text("host file")
    with socket.create_server(("127.0.0.1", 0)) as server:  # listening on the host
        port = server.getsockname()[1]
        commands = {
            "write": "echo made > made.txt && id -u && pwd",
            "usr": "touch /usr/rollstream-probe",
            "outside": f"cat {outside}",
            "env": "echo key=${OPENAI_API_KEY:-none}",
            "net": f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected",
        }
        args = {"cwd": str(workdir), "wrapper_args": example_wrapper_args(), "commands": commands}
        env = {**os.environ, "OPENAI_API_KEY": "rs1.rollout-token", "MSWEA_SILENT_STARTUP": "1"}
        done = subprocess.run(
            [str(harness_venv / "bin" / "python"), "-c", EXECUTE, json.dumps(args)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["write"]["returncode"] == 0, out["write"]
    assert out["write"]["output"].split() == ["1000", str(workdir)]
    assert (workdir / "made.txt").read_text() == "made\n"
    assert out["usr"]["returncode"] != 0 and "Read-only" in out["usr"]["output"]
    assert out["outside"]["returncode"] != 0 and "host file" not in out["outside"]["output"]
    assert out["env"]["output"].strip() == "key=none"
    assert out["net"]["returncode"] != 0 and "connected" not in out["net"]["output"]


def test_litellm_in_the_harness_classifies_the_proxys_context_overflow(
    harness_venv: Path, proxy_url: str
) -> None:
    """The harness's own litellm (unmodified, from its venv) raises ContextWindowExceededError
    for a prompt past the model's context, at once: not a generic error it retries."""
    opened = httpx.post(
        f"{proxy_url}/v1/rollouts",
        json={"task_id": "context-overflow"},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    assert opened.status_code == 201, opened.text
    ro = opened.json()
    script = (
        "import sys, time, litellm\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    litellm.completion(model='openai/policy', api_base=sys.argv[1], api_key=sys.argv[2],\n"
        "                       messages=[{'role': 'user', 'content': 'word ' * 5000}],\n"
        "                       num_retries=3)\n"
        "except litellm.ContextWindowExceededError as exc:\n"
        "    print('context-window', round(time.monotonic() - t0, 2))\n"
        "except Exception as exc:\n"
        "    print('other', type(exc).__name__, exc)\n"
    )
    done = subprocess.run(
        [str(harness_venv / "bin" / "python"), "-c", script, ro["base_url"], ro["token"]],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    said = [
        line.split() for line in done.stdout.splitlines() if line.startswith(("context", "other"))
    ]
    assert said and said[-1][0] == "context-window", done.stdout + done.stderr[-2000:]
    assert float(said[-1][1]) < 10.0  # no backoff
