"""Job evaluator tokens at the proxy (``POST /v1/jobs/{job_id}/evaluator-token``): the admin or
evaluator key mints one; it reads, scores (final rewards too), finishes and posts lifecycle
events of the rollouts created with that ``job_id`` in their metadata, 403 naming
``rollout_id`` on any other rollout, 401 everywhere else; it verifies across a restart with
the same ``proxy_token_secret``. And the stage workers' ``JobKeys``: the EVAL stage's calls
carry the job's token, minted once per job, minted again after a 401 (a proxy restarted with a
new secret), and the evaluator key itself when the proxy has no such route."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from test_proxy_fastpath import ADMIN, Backend, chat
from test_proxy_ratelimit import USER, asgi, sdk_asgi

from rollstream.infra.keys import create_keys, read_keys
from rollstream.producers import MemoryTransport, Recorder
from rollstream.producers.errors import RolloutCallError
from rollstream.producers.proxy.app import ProxyApp, create_app
from rollstream.producers.proxy.backends import CompletionBackend
from rollstream.producers.proxy.chat import ChatTemplate
from rollstream.producers.proxy.pool import BackendPool
from rollstream.producers.proxy.settings import ProxySettings
from rollstream.producers.rollouts.runner import ProxyClient
from rollstream.producers.rollouts.workers import JobKeys
from rollstream.schemas import Reward, RolloutFinished, StageEvent

__all__ = ["chat"]  # the module fixture shared with test_proxy_fastpath

EVALUATOR = "unit-evaluator"
SECRET = "unit-token-secret-of-some-length"
BEARER_ADMIN, BEARER_EVAL = (
    {"Authorization": f"Bearer {ADMIN}"},
    {"Authorization": f"Bearer {EVALUATOR}"},
)
STAGE = {"events": [{"type": "stage", "stage": "eval", "phase": "started"}]}


def proxy_app(
    chat: ChatTemplate, secret: str | None = SECRET, evaluator: str = EVALUATOR
) -> tuple[ProxyApp, Recorder, MemoryTransport]:
    settings = ProxySettings(
        spool_dir=None,
        proxy_api_keys=[ADMIN],
        proxy_evaluator_keys=[evaluator],
        proxy_token_secret=secret,
    )
    transport = MemoryTransport()
    recorder = Recorder(settings, transport=transport)
    http = httpx.AsyncClient(transport=httpx.MockTransport(Backend(chat).handle))
    pool = BackendPool(
        [CompletionBackend("http://b", "b", http=http)], health_interval_s=0, backend_wait_s=0.2
    )
    app = create_app(settings, recorder=recorder, pool=pool, chat=chat)
    assert isinstance(app, ProxyApp)
    return app, recorder, transport


async def open_rollout(http: httpx.AsyncClient, job_id: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"task_id": "t"}
    if job_id is not None:
        body["metadata"] = {"job_id": job_id, "sample": "0"}
    r = await http.post("/v1/rollouts", json=body, headers=BEARER_ADMIN)
    assert r.status_code == 201, r.text
    return dict(r.json())


async def mint(http: httpx.AsyncClient, job_id: str, headers: dict[str, str]) -> httpx.Response:
    return await http.post(f"/v1/jobs/{job_id}/evaluator-token", headers=headers)


def test_a_job_token_evaluates_its_jobs_rollouts_and_nothing_else(chat: ChatTemplate) -> None:
    app, recorder, transport = proxy_app(chat)
    proxy = app.state.proxy

    async def main() -> None:
        await proxy.pool.start()
        http = asgi(app)
        minted = await mint(http, "job-a", BEARER_ADMIN)
        assert minted.status_code == 200, minted.text
        assert minted.json()["job_id"] == "job-a"
        token = minted.json()["token"]
        assert token.startswith("rs1j.job-a.")
        by_evaluator = await mint(http, "job-a", BEARER_EVAL)
        assert by_evaluator.status_code == 200 and by_evaluator.json()["token"] == token
        job = {"Authorization": f"Bearer {token}"}

        a, b = await open_rollout(http, "job-a"), await open_rollout(http, "job-b")
        none = await open_rollout(http, None)
        rid = a["rollout_id"]
        ok = [
            await http.post(f"/v1/rollouts/{rid}/events", json=STAGE, headers=job),
            await http.post(f"/v1/rollouts/{rid}/rewards", json={"value": 1.0}, headers=job),
            await http.get(f"/v1/rollouts/{rid}", headers=job),
            await http.post(
                f"/v1/rollouts/{rid}/finish", json={"status": "completed"}, headers=job
            ),
        ]
        assert [r.status_code for r in ok] == [200] * 4, [r.text for r in ok]
        again = await http.post(f"/v1/rollouts/{rid}/finish", json={}, headers=job)
        assert again.status_code == 200 and again.json()["finished"] is False  # a retried finish
        assert (await http.get(f"/v1/rollouts/{rid}", headers=job)).json()["status"] == "completed"

        for other in (b["rollout_id"], none["rollout_id"]):  # job b's, and one of no job
            refused = [
                await http.post(f"/v1/rollouts/{other}/events", json=STAGE, headers=job),
                await http.post(f"/v1/rollouts/{other}/rewards", json={"value": 1.0}, headers=job),
                await http.get(f"/v1/rollouts/{other}", headers=job),
                await http.post(f"/v1/rollouts/{other}/finish", json={}, headers=job),
            ]
            for r in refused:
                assert r.status_code == 403, r.text
                error = r.json()["error"]
                assert error["param"] == "rollout_id" and error["code"] == "forbidden", error
        unknown = await http.post("/v1/rollouts/nope/finish", json={}, headers=job)
        assert unknown.status_code == 404, unknown.text

        brid = b["rollout_id"]
        elsewhere = {
            "create": await http.post("/v1/rollouts", json={"task_id": "t"}, headers=job),
            "tool_calls": await http.post(
                f"/v1/rollouts/{brid}/tool_calls", json={"name": "x"}, headers=job
            ),
            "branches": await http.post(f"/v1/rollouts/{brid}/branches", json={}, headers=job),
            "submit": await http.post("/v1/jobs", json={"tasks": {}}, headers=job),
            "jobs": await http.get("/v1/jobs", headers=job),
            "job": await http.get("/v1/jobs/job-a", headers=job),
            "mint": await mint(http, "job-b", job),  # no token of another job from it
            "pause": await http.post("/v1/admin/pause", headers=job),
            "status": await http.get("/v1/admin/status", headers=job),
            "traces": await http.post("/v1/traces", json={}, headers=job),
        }
        assert {k: r.status_code for k, r in elsewhere.items()} == dict.fromkeys(elsewhere, 401)
        client = openai.AsyncOpenAI(
            base_url=b["base_url"], api_key=token, max_retries=0, http_client=sdk_asgi(app)
        )
        with pytest.raises(openai.AuthenticationError):  # no model calls with it
            await client.chat.completions.create(model="m", messages=USER)

        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Bearer {b['token']}"},
        ):
            assert (await mint(http, "job-a", headers)).status_code == 401
        for bad in ("-job", "j" * 41, "job.a", "job%20a"):
            assert (await mint(http, bad, {})).status_code == 401  # the key first
            r = await mint(http, bad, BEARER_ADMIN)
            assert r.status_code == 400 and r.json()["error"]["param"] == "job_id", (bad, r.text)
        await proxy.pool.aclose()

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        assert recorder.flush(10)
        bodies = [recorder.codec.decode(m.value).body for m in transport.messages(recorder.topic)]
        finals = [x for x in bodies if isinstance(x, Reward) and x.kind == "final"]
        assert [r.value for r in finals] == [1.0]  # job a's rollout, posted with its token
        assert sum(isinstance(x, StageEvent) for x in bodies) == 1
        assert sum(isinstance(x, RolloutFinished) for x in bodies) == 1  # only a's (then stop)
    finally:
        recorder.close(5)


def test_a_job_token_verifies_after_a_restart_with_the_same_secret_only(
    chat: ChatTemplate,
) -> None:
    first, rec1, _ = proxy_app(chat)
    same, rec2, _ = proxy_app(chat)  # the proxy again, with the same proxy_token_secret
    fresh, rec3, _ = proxy_app(chat, secret=None)  # ... with a random one

    async def main() -> None:
        r = await mint(asgi(first), "job-a", BEARER_EVAL)
        job = {"Authorization": f"Bearer {r.json()['token']}"}
        for app, code in ((same, 200), (fresh, 401)):
            await app.state.proxy.pool.start()
            http = asgi(app)
            rid = (await open_rollout(http, "job-a"))["rollout_id"]
            answer = await http.post(
                f"/v1/rollouts/{rid}/rewards", json={"value": 0.5}, headers=job
            )
            assert answer.status_code == code, answer.text
            await app.state.proxy.pool.aclose()

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        for rec in (rec1, rec2, rec3):
            rec.close(5)


# --------------------------------------------------------------------------- the EVAL stage


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(app: Any) -> Iterator[int]:
    """Run the proxy's ASGI app with uvicorn in a thread; yields its port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


class Wire(httpx.HTTPTransport):
    """The workers' HTTP at the I/O edge: sent to the proxy at ``port`` (a restart at the same
    address is a change of port), each request's path and bearer key kept."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port
        self.sent: list[tuple[str, str]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(host="127.0.0.1", port=self.port)
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        self.sent.append((request.url.path, key))
        return super().handle_request(request)


def _open(port: int, job_id: str) -> str:
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/rollouts",
        headers=BEARER_ADMIN,
        timeout=10,
        json={"task_id": "t", "metadata": {"job_id": job_id}},
    )
    assert r.status_code == 201, r.text
    return str(r.json()["rollout_id"])


def test_the_eval_stage_posts_with_its_jobs_token_and_mints_again_after_a_restart(
    chat: ChatTemplate,
) -> None:
    app1, rec1, _ = proxy_app(chat, secret=None)
    app2, rec2, _ = proxy_app(chat, secret=None)  # the proxy restarted: a new random secret
    try:
        with serve(app1) as port1, serve(app2) as port2:
            wire = Wire(port1)
            evaluator = ProxyClient("http://proxy", EVALUATOR, transport=wire)
            keys = JobKeys(evaluator, EVALUATOR)
            ra, rb = _open(port1, "job-a"), _open(port1, "job-b")
            for _ in range(2):  # two rollouts' EVAL stages of one job: one token
                stage = keys.client("job-a")
                stage.events(ra, STAGE["events"])
                stage.rewards(ra, [{"value": 1.0, "kind": "final", "name": "suite"}])
            assert keys.client("job-a").finish(ra, "completed", None) is True
            with pytest.raises(RolloutCallError) as refused:  # another job's rollout
                keys.client("job-a").rewards(rb, [{"value": 1.0}])
            assert refused.value.status == 403
            mints = [p for p, _ in wire.sent if p.endswith("/evaluator-token")]
            assert mints == ["/v1/jobs/job-a/evaluator-token"]
            on_rollouts = [k for p, k in wire.sent if p.startswith("/v1/rollouts/")]
            assert on_rollouts and all(k.startswith("rs1j.job-a.") for k in on_rollouts)
            assert all(k == EVALUATOR for p, k in wire.sent if p.endswith("/evaluator-token"))

            wire.port = port2  # a restart: the cached token is refused once, minted again
            rc = _open(port2, "job-a")
            keys.client("job-a").rewards(rc, [{"value": 0.5}])
            assert keys.client("job-a").finish(rc, "completed", None) is True
            assert keys.minted == 2 and not keys.no_route
            expected = [
                (f"/v1/rollouts/{rc}/rewards", "rs1j."),  # 401: the old secret's
                ("/v1/jobs/job-a/evaluator-token", EVALUATOR[:5]),
                (f"/v1/rollouts/{rc}/rewards", "rs1j."),
                (f"/v1/rollouts/{rc}/finish", "rs1j."),
            ]
            assert [(p, k[:5]) for p, k in wire.sent[-4:]] == expected
            evaluator.close()
    finally:
        rec1.close(5)
        rec2.close(5)


def test_an_older_proxy_without_the_route_gets_the_evaluator_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sent: list[tuple[str, str]] = []

    def older_proxy(request: httpx.Request) -> httpx.Response:  # the I/O edge: an older proxy
        sent.append((request.url.path, request.headers.get("authorization", "")))
        if request.url.path.endswith("/evaluator-token"):
            return httpx.Response(404, json={"error": {"message": "Not Found"}})
        return httpx.Response(200, json={"rollout_id": "r", "recorded": 1, "finished": True})

    evaluator = ProxyClient("http://proxy", EVALUATOR, transport=httpx.MockTransport(older_proxy))
    keys = JobKeys(evaluator, EVALUATOR)
    with caplog.at_level(logging.WARNING, logger="rollstream.producers.rollouts.workers"):
        for job in ("job-a", "job-b"):
            keys.client(job).rewards("r", [{"value": 1.0}])
            assert keys.client(job).finish("r", "completed", None) is True
    assert keys.no_route and keys.minted == 0
    assert [p for p, _ in sent].count("/v1/jobs/job-a/evaluator-token") == 1  # asked once
    assert all(k == f"Bearer {EVALUATOR}" for _, k in sent)
    warned = [r for r in caplog.records if "evaluator-token route" in r.getMessage()]
    assert len(warned) == 1
    evaluator.close()


def test_the_job_token_cache_is_bounded() -> None:
    sent: list[str] = []

    def proxy(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        job = request.url.path.split("/")[3]
        return httpx.Response(200, json={"job_id": job, "token": f"rs1j.{job}.sig"})

    client = ProxyClient("http://proxy", EVALUATOR, transport=httpx.MockTransport(proxy))
    keys = JobKeys(client, EVALUATOR, max_jobs=2)
    for job in ("a", "b", "a", "c", "a", "b"):
        assert keys.key(job) == f"rs1j.{job}.sig"
    # a kept while used; b dropped when c came (least recent), so minted again
    assert [p.split("/")[3] for p in sent] == ["a", "b", "c", "b"]


# --------------------------------------------------------------------------- the CLI


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    return subprocess.run(
        [sys.executable, "-m", "rollstream.infra.cli", "keys", *args],
        env={**env, "ROLLSTREAM_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_keys_job_token_asks_the_proxy_with_the_homes_evaluator_key(
    chat: ChatTemplate, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    create_keys(home)
    evaluator = read_keys(home).get("evaluator").get_secret_value()
    app, recorder, _ = proxy_app(chat, evaluator=evaluator)
    other, other_recorder, _ = proxy_app(chat)  # a proxy that does not know this home's keys
    try:
        with serve(app) as port, serve(other) as other_port:
            url = f"http://127.0.0.1:{port}"
            shown = _cli(home, "job-token", "job-a", "--proxy-url", url)
            assert shown.returncode == 0, shown.stderr
            token = shown.stdout.strip()
            assert token.startswith("rs1j.job-a.") and shown.stdout == token + "\n"
            assert evaluator not in shown.stdout + shown.stderr
            rid = _open(port, "job-a")
            job = {"Authorization": f"Bearer {token}"}
            r = httpx.post(f"{url}/v1/rollouts/{rid}/finish", json={}, headers=job, timeout=10)
            assert r.status_code == 200, r.text

            refused = _cli(
                home, "job-token", "job-a", "--proxy-url", f"http://127.0.0.1:{other_port}"
            )
            assert refused.returncode == 1 and refused.stdout == ""
            assert "answered 401" in refused.stderr, refused.stderr
    finally:
        recorder.close(5)
        other_recorder.close(5)
    bad = _cli(home, "job-token", "job.a")
    assert bad.returncode == 2 and "`job_id`" in bad.stderr, bad.stderr
    assert _cli(home, "job-token").returncode == 2
    assert _cli(home, "path", "job-a").returncode == 2
    gone = _cli(home, "job-token", "job-a", "--proxy-url", f"http://127.0.0.1:{free_port()}")
    assert gone.returncode == 1 and "no answer from the proxy" in gone.stderr, gone.stderr
