"""The rollout service when the recording proxy is SIGKILLed and started again mid-job: the new
proxy knows none of the rollouts the old one held (404), so each attempt caught in flight is
lost; the stage workers destroy its sandbox, drop its claim and queue the next attempt, and
every (task, sample) still ends with exactly one completed rollout with its reward. The lost
attempts end on the log without a RolloutFinished (the processors close them at their
inactivity timeout). Real parts: the session's broker, `rollstream proxy` (the tiny model's
tokenizer, no backend: the agent is a command), `rollstream workers`, bubblewrap."""

# ruff: noqa: F811  (the fixture settings, imported, is a parameter here)
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from _rollout_stack import tokenizer_proxy_process, wait_routes
from test_rollout_runner import ADMIN, settings  # noqa: F401 (module fixture)
from test_rollout_workers import (
    _ended,
    _events,
    _job,
    _solutions,
    _submit,
    _wait_done,
    _workers,
    sandbox_root,  # noqa: F401 (fixture)
)

from rollstream.infra.kafka import free_port
from rollstream.schemas import CommonSettings, Reward, RolloutFinished, StageEvent

pytestmark = pytest.mark.integration


def test_a_restarted_proxy_costs_attempts_not_samples(
    settings: CommonSettings, tmp_path: Path, sandbox_root: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proxy = tokenizer_proxy_process(
        settings, tmp_path, admin_key=ADMIN, producer="proxy-restart-it",
        model_dir=tmp_path / "models" / "tiny", port=port,
    )  # fmt: skip
    proxy.start()
    wait_routes(url, proxy)
    job = _job("it-restart", _solutions(tmp_path), run_s=4, eval_s=0, samples=2)
    workers = _workers("all", settings, tmp_path, url, sandbox_root)
    workers.start()
    try:
        planned = _submit(settings, job)
        deadline = time.monotonic() + 120
        while not any(  # RUN under way: the agents are in their sandboxes
            isinstance(e.body, StageEvent) and e.body.stage == "run" and e.body.phase == "started"
            for evs in _events(settings, job.id).values()
            for e in evs
        ):
            assert time.monotonic() < deadline, "no RUN started"
            time.sleep(0.3)
        assert proxy.proc is not None
        proxy.proc.send_signal(signal.SIGKILL)
        proxy.proc.wait(10)
        proxy.start()  # same port, same token secret, no memory of the open rollouts
        wait_routes(url, proxy)
        events = _wait_done(settings, job.id, planned, 240)
        time.sleep(2.0)  # the last sweep
    finally:
        workers.stop()
        proxy.stop()
    ended = _ended(events)
    assert len(ended) == planned
    for key, fins in ended.items():
        assert [f.status for f in fins] == ["completed"], (key, fins)  # one, and only one
    lost = [rid for rid, evs in events.items() if not any(
        isinstance(e.body, RolloutFinished) for e in evs)]  # fmt: skip
    assert lost, "the restart lost no attempt: it came too late to test anything"
    for rid, evs in events.items():
        if rid not in lost:
            finals = [e.body for e in evs if isinstance(e.body, Reward) and e.body.kind == "final"]
            assert [r.value for r in finals] == [1.0], rid
    assert not list(sandbox_root.glob("sbx-*")), "a sandbox was left behind"
    assert not list((tmp_path / "home" / "claims").glob("*.json")), "a claim was left behind"
    assert "lost by the proxy" in workers.current_log()
