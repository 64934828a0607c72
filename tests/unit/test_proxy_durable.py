"""The proxy takes no work whose events it would lose: while Kafka is unreachable and the
recorder's spool is full, model calls, rollout creation and the rollout API answer 503
``events_not_durable`` with Retry-After (the official openai client raises InternalServerError,
and by default retries it); once Kafka is back and the spool drained, they are answered again
and every event accepted before is delivered once. Real Recorder and spool; the Kafka client is
the SDK's in-memory transport (the I/O edge)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_proxy_fastpath import ADMIN, Backend, chat, make_app
from test_proxy_ratelimit import USER, asgi, new_rollout, sdk_asgi

from rollstream.producers import MemoryTransport, Recorder
from rollstream.producers.proxy.app import ProxyApp, create_app
from rollstream.producers.proxy.backends import CompletionBackend
from rollstream.producers.proxy.chat import ChatTemplate
from rollstream.producers.proxy.pool import BackendPool
from rollstream.producers.proxy.settings import ProxySettings

__all__ = ["chat"]  # the module fixture shared with test_proxy_fastpath


async def until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_a_full_spool_with_kafka_down_is_a_503_not_a_silent_drop(
    chat: ChatTemplate, tmp_path: Path
) -> None:
    settings = ProxySettings(
        spool_dir=tmp_path / "spool", spool_max_bytes=1 << 16, degrade_after_s=0.2,
        probe_interval_s=0.05, queue_size=10, proxy_api_keys=[ADMIN], proxy_rate_limit_rps=0,
    )  # fmt: skip
    transport = MemoryTransport()
    recorder = Recorder(settings, transport=transport)
    backend = Backend(chat)
    http_backend = httpx.AsyncClient(transport=httpx.MockTransport(backend.handle))
    pool = BackendPool([CompletionBackend("http://b", "b", http=http_backend)],
                       health_interval_s=0, backend_wait_s=0.2)  # fmt: skip
    app = create_app(settings, recorder=recorder, pool=pool, chat=chat)
    assert isinstance(app, ProxyApp)
    proxy = app.state.proxy

    async def main() -> None:
        await proxy.pool.start()
        http = asgi(app)
        ro = await new_rollout(http)
        client = openai.AsyncOpenAI(
            base_url=ro["base_url"], api_key=ro["token"], max_retries=0, http_client=sdk_asgi(app)
        )
        assert (await client.chat.completions.create(model="m", messages=USER)).choices
        transport.available = False  # the broker goes away; another rollout fills the spool
        filler = recorder.rollout(task_id="filler", group_id="g")
        await until(lambda: (filler.reward(0.5, "partial"), recorder.stats.state)[1] == "degraded")
        while recorder.accepting:
            filler.reward(0.5, "partial")
        with pytest.raises(openai.InternalServerError) as err:
            await client.chat.completions.create(model="m", messages=USER)
        assert err.value.status_code == 503 and err.value.code == "events_not_durable"
        assert err.value.response.headers["retry-after"] == "5"
        token = {"Authorization": f"Bearer {ro['token']}"}
        r = await http.post(f"/v1/rollouts/{ro['rollout_id']}/rewards", json={"value": 1.0},
                            headers=token)  # fmt: skip
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        r = await http.post("/v1/rollouts", json={"task_id": "t"},
                            headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
        assert r.status_code == 503
        status = await http.get("/v1/admin/status", headers={"Authorization": f"Bearer {ADMIN}"})
        assert status.json()["refused_not_durable"] == 3
        transport.available = True  # back: the spool drains, the proxy answers again
        await until(lambda: recorder.accepting and recorder.stats.spool_backlog == 0)
        assert (await client.chat.completions.create(model="m", messages=USER)).choices
        await proxy.pool.aclose()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        stats = recorder.close(5)
    # the proxy refused work instead, and the spool's reserve held what came before: no drop
    assert stats.dropped == 0
    ids = [m.key for m in transport.messages(settings.topics().events)]
    assert len(ids) == stats.sent


def test_what_the_proxy_holds_is_bounded(chat: ChatTemplate) -> None:
    """Open rollouts past ``proxy_max_open_rollouts``: 503 with Retry-After; a rollout's model
    calls past ``proxy_max_rollout_calls`` or its context past ``proxy_max_rollout_tokens``: 409
    ``rollout_too_large``, while its rewards and finish are still taken."""
    app, recorder = make_app(chat, Backend(chat), proxy_max_open_rollouts=2,
                             proxy_max_rollout_calls=2, proxy_rate_limit_rps=0)  # fmt: skip
    proxy = app.state.proxy

    async def main() -> None:
        await proxy.pool.start()
        http = asgi(app)
        a, _ = await new_rollout(http), await new_rollout(http)
        r = await http.post("/v1/rollouts", json={"task_id": "t"},
                            headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_open_rollouts"
        assert r.headers["retry-after"] == "5"
        client = openai.AsyncOpenAI(base_url=a["base_url"], api_key=a["token"], max_retries=0,
                                    http_client=sdk_asgi(app))  # fmt: skip
        for _ in range(2):
            assert (await client.chat.completions.create(model="m", messages=USER)).choices
        with pytest.raises(openai.ConflictError) as err:
            await client.chat.completions.create(model="m", messages=USER)
        assert err.value.code == "rollout_too_large"
        assert "proxy_max_rollout_calls" in str(err.value)
        token = {"Authorization": f"Bearer {a['token']}"}
        rid = a["rollout_id"]
        partial = {"value": 0.5, "kind": "partial"}
        r = await http.post(f"/v1/rollouts/{rid}/rewards", json=partial, headers=token)
        assert r.status_code == 200
        r = await http.post(f"/v1/rollouts/{rid}/finish", json={}, headers=token)
        assert r.status_code == 200
        r = await http.post("/v1/rollouts", json={"task_id": "t"},
                            headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
        assert r.status_code == 201  # one finished: room again
        await proxy.pool.aclose()

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        recorder.close(5)


def test_a_rollouts_context_is_bounded_in_tokens(chat: ChatTemplate) -> None:
    app, recorder = make_app(chat, Backend(chat), proxy_max_rollout_tokens=1_024,
                             proxy_rate_limit_rps=0)  # fmt: skip
    proxy = app.state.proxy

    async def main() -> None:
        await proxy.pool.start()
        http = asgi(app)
        a = await new_rollout(http)
        client = openai.AsyncOpenAI(base_url=a["base_url"], api_key=a["token"], max_retries=0,
                                    http_client=sdk_asgi(app))  # fmt: skip
        calls = 0
        with pytest.raises(openai.ConflictError) as err:
            for i in range(200):  # each call adds new tokens (a new user message)
                text = f"question {i}: " + "lorem ipsum dolor " * 8
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": text}]
                )
                calls += 1
        assert err.value.code == "rollout_too_large" and "proxy_max_rollout_tokens" in str(
            err.value
        )
        assert 1 <= calls < 200
        await proxy.pool.aclose()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        recorder.close(5)
