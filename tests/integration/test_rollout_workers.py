"""The rollout service's stage workers on real parts: the session's Kafka broker, the recording
proxy and model server (started as in test_rollout_runner), `rollstream workers` processes
per stage, bubblewrap sandboxes. A job queued on rollout.tasks.init runs through INIT, RUN and
EVAL to rewards on the log; with a worker of each stage SIGKILLed mid-task (and started again),
every (task, sample) still ends with exactly one rollout that is not aborted, with its
rewards, each aborted attempt is retried as a new attempt in the same group, and no sandbox
and no claim is left."""

# ruff: noqa: F811  (the fixtures settings and proxy_url, imported, are parameters here)
from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _kafka_read import read_topic
from _logged_process import LoggedProcess
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families
from test_rollout_runner import ADMIN, proxy_url, settings  # noqa: F401 (module fixtures)

from rollstream.producers.rollouts.jobs import parse_job, resolve_tasks
from rollstream.producers.rollouts.stages import first_messages
from rollstream.schemas import (
    Codec,
    CommonSettings,
    Event,
    Reward,
    RolloutFinished,
    RolloutStarted,
    StageEvent,
)

pytestmark = pytest.mark.integration

TASKS = ["balanced-brackets", "anagram-groups"]


@pytest.fixture
def sandbox_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="rs-workers-"))
    root.chmod(0o755)  # bwrap runs as an unprivileged host user when we are root
    yield root / "sandboxes"


def _job(job_id: str, solutions: Path, *, run_s: float, eval_s: float, samples: int) -> Any:
    # the agent copies the reference solution in (after a wait); the evaluator waits too, then
    # runs the task's hidden tests through the suite runner's command
    return parse_job(
        {
            "job_id": job_id,
            "tasks": {"suite": "pycoding", "ids": TASKS},
            "samples_per_task": samples,
            "agent": {
                "kind": "command",
                "argv": ["sh", "-c", f"sleep {run_s}; cp -r {solutions}/$ROLLSTREAM_TASK_ID/. ."],
            },
            "evaluator": {"kind": "suite"} if eval_s == 0 else {
                "kind": "command",
                "argv": ["sh", "-c", f"sleep {eval_s}; ls *.py >/dev/null"],
            },
            "sandbox": {"kind": "bwrap", "limits": {"timeout": 60}},
            "timeouts": {"init": 60, "run": 60, "eval": 60},
            "attempts": 3,
            "run_id": "it-workers",
        }
    )  # fmt: skip


def _solutions(tmp_path: Path) -> Path:
    job = parse_job(
        {"tasks": {"suite": "pycoding", "ids": TASKS}, "agent": {"kind": "command", "argv": ["x"]}}
    )
    root = tmp_path / "solutions"
    for task in resolve_tasks(job):
        for path, text in task.solution.items():
            (root / task.task_id / path).parent.mkdir(parents=True, exist_ok=True)
            (root / task.task_id / path).write_text(text)
    root.chmod(0o755)
    return root


def _submit(settings: CommonSettings, job: Any) -> int:
    messages = first_messages(job, resolve_tasks(job), now=time.time())
    producer = Producer({**settings.kafka_config(), "acks": "all"})
    for msg in messages:
        producer.produce(settings.topics().task("init"), key=msg.rollout_id, value=msg.encode())
    assert producer.flush(30) == 0
    return len(messages)


def _events(settings: CommonSettings, job_id: str) -> dict[str, list[Event]]:
    codec = Codec()
    by_rollout: dict[str, list[Event]] = defaultdict(list)
    for m in read_topic(settings, settings.topics().events, 60):
        e = codec.decode(m.value())
        if e.rollout_id.startswith(job_id + "-"):
            by_rollout[e.rollout_id].append(e)
    return {rid: sorted(evs, key=lambda e: e.seq) for rid, evs in by_rollout.items()}


def _ended(events: dict[str, list[Event]]) -> dict[tuple[str, int], list[RolloutFinished]]:
    """(task, sample) -> the RolloutFinished of each of its attempts."""
    out: dict[tuple[str, int], list[RolloutFinished]] = defaultdict(list)
    for evs in events.values():
        start = evs[0].body
        assert isinstance(start, RolloutStarted)
        key = (start.task_id, int(start.metadata["sample"]))
        out[key] += [e.body for e in evs if isinstance(e.body, RolloutFinished)]
    return out


def _wait_done(settings: CommonSettings, job_id: str, planned: int, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        events = _events(settings, job_id)
        ended = _ended(events)
        done = [k for k, fins in ended.items() if any(f.status != "aborted" for f in fins)]
        if len(done) == planned:
            return events
        assert time.monotonic() < deadline, f"{len(done)}/{planned} ended: {dict(ended)}"
        time.sleep(1.0)


def _workers(
    stage: str, settings: CommonSettings, tmp_path: Path, proxy: str, root: Path
) -> LoggedProcess:
    return LoggedProcess(
        ["workers", "--stage", stage, "--concurrency", "2"],
        settings,
        tmp_path,
        f"workers-{stage}.log",
        env={
            "ROLLSTREAM_ROLLOUTS_PROXY_URL": proxy,
            "ROLLSTREAM_ROLLOUTS_ADMIN_KEY": ADMIN,
            "ROLLSTREAM_ROLLOUTS_SANDBOX_ROOT": str(root),
            "ROLLSTREAM_ROLLOUTS_SWEEP_S": "1",
        },
    )


def _answered(proxy_url: str, route: str) -> dict[str, float]:
    """The proxy's answers on ``route`` (a template) so far, by status code (its /metrics)."""
    text = httpx.get(f"{proxy_url}/metrics", timeout=10).text
    return {
        s.labels["code"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "rollstream_proxy_requests_total" and s.labels.get("route") == route
    }


def _assert_clean(events: dict[str, list[Event]], planned: int, root: Path, home: Path) -> None:
    ended = _ended(events)
    assert len(ended) == planned
    for key, fins in ended.items():
        kept = [f for f in fins if f.status != "aborted"]
        assert len(kept) == 1, (key, fins)  # exactly one rollout of each sample counts
    for rid, evs in events.items():  # every attempt ends exactly once, in seq order
        assert [e.seq for e in evs] == list(range(len(evs))), rid
        assert sum(isinstance(e.body, RolloutFinished) for e in evs) == 1, rid
        fin = evs[-1].body
        assert isinstance(fin, RolloutFinished)
        if fin.status == "completed":
            finals = [e.body for e in evs if isinstance(e.body, Reward) and e.body.kind == "final"]
            assert [r.value for r in finals] == [1.0], rid
    assert not list(root.glob("sbx-*")), "a sandbox was left behind"
    assert not list((home / "claims").glob("*.json")), "a claim was left behind"


def test_a_job_runs_through_the_three_stages(
    settings: CommonSettings,
    proxy_url: str,
    tmp_path: Path,
    sandbox_root: Path,
) -> None:
    job = _job("it-stages", _solutions(tmp_path), run_s=0, eval_s=0, samples=2)
    workers = _workers("all", settings, tmp_path, proxy_url, sandbox_root)
    workers.start()
    try:
        planned = _submit(settings, job)
        events = _wait_done(settings, job.id, planned, 180)
    finally:
        workers.stop()
    _assert_clean(events, planned, sandbox_root, tmp_path / "home")
    # the EVAL stage minted its job's evaluator token once (one job, one worker process) and
    # every reward and finish was taken (the key on those calls: test_proxy_job_tokens.py)
    assert _answered(proxy_url, "/v1/jobs/{job_id}/evaluator-token") == {"200": 1.0}
    assert set(_answered(proxy_url, "/v1/rollouts/{rollout_id}/rewards")) == {"200"}
    assert set(_answered(proxy_url, "/v1/rollouts/{rollout_id}/finish")) == {"200"}
    for evs in events.values():
        fin = evs[-1].body
        assert isinstance(fin, RolloutFinished) and fin.status == "completed", fin
        stages = [(e.body.stage, e.body.phase) for e in evs if isinstance(e.body, StageEvent)]
        assert stages == [(s, p) for s in ("init", "run", "eval") for p in ("started", "finished")]
        workers_of = {e.body.worker for e in evs if isinstance(e.body, StageEvent)}
        assert len(workers_of) == 1  # one process served all three stages


def test_sigkill_a_worker_of_each_stage_loses_nothing(
    settings: CommonSettings,
    proxy_url: str,
    tmp_path: Path,
    sandbox_root: Path,
) -> None:
    job = _job("it-kill", _solutions(tmp_path), run_s=3, eval_s=3, samples=3)
    pools = {
        s: _workers(s, settings, tmp_path, proxy_url, sandbox_root) for s in ("init", "run", "eval")
    }
    for p in pools.values():
        p.start()
    try:
        planned = _submit(settings, job)
        for stage in ("init", "run", "eval"):  # kill each stage's worker once it works
            deadline = time.monotonic() + 120
            while not any(
                isinstance(e.body, StageEvent)
                and e.body.stage == stage
                and e.body.phase == "started"
                for evs in _events(settings, job.id).values()
                for e in evs
            ):
                assert time.monotonic() < deadline, f"no {stage} started"
                time.sleep(0.3)
            pools[stage].kill()
            pools[stage].proc.wait(10)  # type: ignore[union-attr]
            pools[stage].start()
        events = _wait_done(settings, job.id, planned, 300)
        time.sleep(2.0)  # a last sweep (every second) settles what the kills left
    finally:
        for p in pools.values():
            p.stop()
    _assert_clean(events, planned, sandbox_root, tmp_path / "home")
    aborted = [evs for evs in events.values() if evs[-1].body.status == "aborted"]
    assert aborted, "the kills aborted nothing: they came too late to test recovery"
    for evs in aborted:
        assert "stopped" in (evs[-1].body.error or "") or "gone" in (evs[-1].body.error or "")
    print(json.dumps({"rollouts": len(events), "aborted": len(aborted)}))
