"""The rollout service's job queue on real parts: the session's Kafka broker and a recording
proxy started through the CLI (`rollstream proxy`, an admin key set; its backend is never
called). `rollstream jobs submit` puts one JobRecord on rollout.jobs and one INIT message per
task x sample on rollout.tasks.init (read back); the same spec again is refused; an invalid
spec names its field (CLI: one line, exit 1; HTTP: 400 with ``param``); ``tasks.path`` is
refused over HTTP; POST /v1/jobs queues a job (202) once (409); a job's status folds the events
posted through the proxy's rollout API; a cancel writes a cancelled record and the status says
so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _kafka_read import read_topic
from _rollout_stack import fresh_settings, tokenizer_proxy

from rollstream.infra.kafka import KafkaBroker
from rollstream.producers.rollouts.jobs import expand, parse_job, resolve_tasks
from rollstream.producers.rollouts.stages import JobRecord, StageMessage
from rollstream.schemas import CommonSettings

pytestmark = pytest.mark.integration

ADMIN = "admin-key-for-job-tests"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
TASKS = ["balanced-brackets", "caesar-shift"]


def spec(job_id: str, **changes: Any) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "tasks": {"suite": "pycoding", "ids": TASKS},
        "samples_per_task": 2,
        "agent": {"kind": "tool", "max_turns": 4},
        "sandbox": {"kind": "bwrap"},
        **changes,
    }


@pytest.fixture(scope="module")
def settings(kafka: KafkaBroker, tmp_path_factory: pytest.TempPathFactory) -> CommonSettings:
    return fresh_settings(kafka.bootstrap, tmp_path_factory.mktemp("jobs-home"))


@pytest.fixture(scope="module")
def proxy_url(settings: CommonSettings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("jobs-proxy")
    with tokenizer_proxy(
        settings, tmp, admin_key=ADMIN, producer="proxy-jobs-it", model_dir=tmp / "models" / "tiny"
    ) as url:
        yield url


def cli(settings: CommonSettings, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")},
        "ROLLSTREAM_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "ROLLSTREAM_NAMESPACE": settings.namespace,
        "ROLLSTREAM_HOME": str(settings.home),
    }
    return subprocess.run(
        [sys.executable, "-m", "rollstream.infra.cli", "jobs", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data))
    return path


def job_records(settings: CommonSettings, job_id: str) -> list[JobRecord]:
    msgs = read_topic(settings, settings.topics().jobs)
    return [JobRecord.decode(m.value()) for m in msgs if m.key() == job_id.encode()]


def test_cli_submit_queues_the_record_and_the_init_messages(
    settings: CommonSettings, tmp_path: Path
) -> None:
    job_file = write_yaml(tmp_path / "job.yaml", spec("it-cli-submit"))
    done = cli(settings, "submit", str(job_file), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "it-cli-submit: 4 rollouts queued" in done.stdout

    [record] = job_records(settings, "it-cli-submit")
    assert (record.type, record.task_ids, record.samples_per_task, record.rollouts) == (
        "submitted", TASKS, 2, 4,
    )  # fmt: skip
    job = parse_job(spec("it-cli-submit"))
    plans = expand(job, resolve_tasks(job))
    init = read_topic(settings, settings.topics().task("init"))
    messages = {m.key().decode(): StageMessage.decode(m.value()) for m in init}
    assert set(messages) == {p.rollout_id for p in plans}
    for plan in plans:
        msg = messages[plan.rollout_id]
        assert (msg.stage, msg.task_id, msg.sample_index, msg.attempt) == (
            "init", plan.task_id, plan.sample_index, 0,
        )  # fmt: skip
        assert msg.task.task_id == plan.task_id and msg.job.id == "it-cli-submit"

    again = cli(settings, "submit", str(job_file), cwd=tmp_path)
    assert again.returncode == 1
    assert "submitted already" in again.stderr
    assert len(job_records(settings, "it-cli-submit")) == 1
    assert len(read_topic(settings, settings.topics().task("init"))) == len(init)

    listed = cli(settings, "list", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = {r["job_id"]: r for r in json.loads(listed.stdout)}
    assert rows["it-cli-submit"]["rollouts"] == 4 and not rows["it-cli-submit"]["cancelled"]


def test_an_invalid_job_names_its_field(
    settings: CommonSettings, proxy_url: str, tmp_path: Path
) -> None:
    bad = spec("it-invalid", agent={"kind": "tool", "max_turns": 0})
    done = cli(settings, "submit", str(write_yaml(tmp_path / "bad.yaml", bad)), cwd=tmp_path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "agent.max_turns" in lines[0], done.stderr

    answer = httpx.post(f"{proxy_url}/v1/jobs", json=bad, headers=AUTH)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "agent.max_turns"

    unknown = spec("it-invalid", tasks={"suite": "pycoding", "ids": ["no-such-task"]})
    answer = httpx.post(f"{proxy_url}/v1/jobs", json=unknown, headers=AUTH)
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "tasks.ids[0]")

    with_path = spec("it-invalid", tasks={"path": "/etc"})
    answer = httpx.post(f"{proxy_url}/v1/jobs", json=with_path, headers=AUTH)
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "tasks.path")

    assert httpx.post(f"{proxy_url}/v1/jobs", json=spec("it-invalid")).status_code == 401
    assert httpx.get(f"{proxy_url}/v1/jobs").status_code == 401
    assert job_records(settings, "it-invalid") == []


def test_http_submit_queues_a_job_once(settings: CommonSettings, proxy_url: str) -> None:
    answer = httpx.post(f"{proxy_url}/v1/jobs", json=spec("it-http"), headers=AUTH, timeout=60)
    assert answer.status_code == 202, answer.text
    topic = settings.topics().task("init")
    assert answer.json() == {"job_id": "it-http", "rollouts": 4, "topic": topic}
    again = httpx.post(f"{proxy_url}/v1/jobs", json=spec("it-http"), headers=AUTH, timeout=60)
    assert (again.status_code, again.json()["error"]["code"]) == (409, "job_exists")
    assert len(job_records(settings, "it-http")) == 1
    listed = httpx.get(f"{proxy_url}/v1/jobs", headers=AUTH, timeout=60).json()["jobs"]
    assert [r["rollouts"] for r in listed if r["job_id"] == "it-http"] == [4]


def wait_delivered(proxy_url: str, timeout: float = 60.0) -> None:
    """Until the proxy's recorder has every event it accepted acknowledged by Kafka."""
    deadline = time.monotonic() + timeout
    while True:
        d = httpx.get(f"{proxy_url}/v1/admin/status", headers=AUTH).json()["delivery"]
        if d["sent"] == d["submitted"] and d["queued"] == d["in_flight"] == 0:
            return
        assert time.monotonic() < deadline, d
        time.sleep(0.05)  # polling the proxy's counters: there is no event to wait on here


def test_status_folds_the_events_posted_through_the_proxy_and_a_cancel(
    settings: CommonSettings, proxy_url: str, tmp_path: Path
) -> None:
    job_spec = spec("it-status", samples_per_task=1)
    answer = httpx.post(f"{proxy_url}/v1/jobs", json=job_spec, headers=AUTH, timeout=60)
    assert answer.status_code == 202, answer.text
    job = parse_job(job_spec)
    done_plan, running_plan = expand(job, resolve_tasks(job))

    with httpx.Client(base_url=proxy_url, headers=AUTH, timeout=30) as http:
        for plan in (done_plan, running_plan):
            created = http.post("/v1/rollouts", json={
                "rollout_id": plan.rollout_id, "task_id": plan.task_id,
                "group_id": plan.group_id, "attempt": 0, "group_size": 1,
                "metadata": {"job_id": "it-status", "sample": "0", "attempt": "0"},
            })  # fmt: skip
            assert created.status_code == 201, created.text
        rid = done_plan.rollout_id
        for stage in ("init", "run", "eval"):
            events = [
                {"type": "stage", "stage": stage, "phase": "started", "job_id": "it-status"},
                {"type": "stage", "stage": stage, "phase": "finished", "status": "ok",
                 "duration_ms": 12.0, "job_id": "it-status"},
            ]  # fmt: skip
            assert http.post(f"/v1/rollouts/{rid}/events", json={"events": events}).is_success
        reward = {"rewards": [{"value": 1.0, "kind": "final", "evaluator": "suite"}]}
        assert http.post(f"/v1/rollouts/{rid}/rewards", json=reward).is_success
        assert http.post(f"/v1/rollouts/{rid}/finish", json={"status": "completed"}).is_success
        started = {"type": "stage", "stage": "init", "phase": "started", "job_id": "it-status"}
        posted = http.post(
            f"/v1/rollouts/{running_plan.rollout_id}/events", json={"events": [started]}
        )
        assert posted.is_success
    wait_delivered(proxy_url)

    shown = cli(settings, "status", "it-status", "--json", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert status["state"] == "running"
    assert status["stages"] == {
        "init": {"queued": 0, "running": 1, "done": 1, "failed": 0, "timeout": 0},
        "run": {"queued": 0, "running": 0, "done": 1, "failed": 0, "timeout": 0},
        "eval": {"queued": 0, "running": 0, "done": 1, "failed": 0, "timeout": 0},
    }
    plans = {p["task_id"]: p for p in status["plans"]}
    assert (plans[TASKS[0]]["state"], plans[TASKS[0]]["reward"]) == ("completed", 1.0)
    assert plans[TASKS[1]]["state"] == "init"
    assert status["totals"] == {"planned": 2, "finished": 1, "completed": 1, "mean_reward": 1.0}
    over_http = httpx.get(f"{proxy_url}/v1/jobs/it-status", headers=AUTH, timeout=60).json()
    assert over_http == status
    table = cli(settings, "status", "it-status", cwd=tmp_path)
    assert table.returncode == 0 and "completed" in table.stdout, table.stderr

    cancelled = cli(settings, "cancel", "it-status", "--reason", "enough", cwd=tmp_path)
    assert cancelled.returncode == 0, cancelled.stderr
    records = job_records(settings, "it-status")
    assert [(r.type, r.reason) for r in records] == [("submitted", ""), ("cancelled", "enough")]
    status = json.loads(cli(settings, "status", "it-status", "--json", cwd=tmp_path).stdout)
    assert status["state"] == "cancelled"
    assert {p["task_id"]: p["state"] for p in status["plans"]} == {
        TASKS[0]: "completed",
        TASKS[1]: "cancelled",
    }
    missing = cli(settings, "cancel", "no-such-job", cwd=tmp_path)
    assert missing.returncode == 1 and "no job 'no-such-job'" in missing.stderr
    assert httpx.get(f"{proxy_url}/v1/jobs/no-such-job", headers=AUTH).status_code == 404
