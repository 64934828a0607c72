"""The proxy's rate limit per rollout token: the token bucket (ratelimit.py, a fake clock) and the
proxy answering 429 ``rate_limit_exceeded`` with Retry-After through the official clients (the
openai client raises RateLimitError, the anthropic client too, each in its API's error shape),
on the raw-ASGI fast path and through Starlette, for model calls and the rollout API; the admin
key is not limited, and the 429 of a paused pool keeps its own code."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from typing import Any

import anthropic
import httpx
import openai
import pytest
from pydantic import ValidationError
from test_proxy_fastpath import ADMIN, Backend, chat, make_app, run

from rollstream.producers.errors import ProxyConfigError
from rollstream.producers.proxy.chat import ChatTemplate
from rollstream.producers.proxy.ratelimit import RateLimiter, retry_after
from rollstream.producers.proxy.settings import ProxySettings

__all__ = ["chat"]  # the module fixture shared with test_proxy_fastpath

USER: Any = [{"role": "user", "content": "hi"}]
# the HTTP library the official SDKs are built on: httpx2 (openai 3.5x, anthropic 2.16), or httpx
SDK_HTTP: Any = importlib.import_module("httpx2") if importlib.util.find_spec("httpx2") else httpx


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- the bucket


def test_a_bucket_allows_its_burst_then_refuses_until_refilled() -> None:
    clock = Clock()
    limiter = RateLimiter(2.0, 3, clock=clock)
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a") == pytest.approx(0.5)  # one token at 2/s: in half a second
    assert limiter.take("a") == pytest.approx(0.5)  # a refusal takes nothing
    assert limiter.limited == 2
    assert limiter.take("b") == 0.0  # buckets are per key
    clock.now += 0.25
    assert limiter.take("a") == pytest.approx(0.25)
    clock.now += 0.25
    assert limiter.take("a") == 0.0  # the client that waited the answered time gets through
    assert limiter.take("a") == pytest.approx(0.5)
    clock.now += 100  # refills up to the burst, no further
    assert [limiter.take("a") for _ in range(4)][-1] == pytest.approx(0.5)


def test_fractional_rates_and_the_retry_after_header() -> None:
    clock = Clock()
    limiter = RateLimiter(0.1, 1, clock=clock)
    assert limiter.take("a") == 0.0
    assert limiter.take("a") == pytest.approx(10.0)
    assert retry_after(10.0) == 10
    assert retry_after(9.01) == 10  # rounded up: waiting that long finds a token
    assert retry_after(0.001) == 1  # never 0
    clock.now -= 50  # a clock that goes backwards refills nothing
    assert limiter.take("a") == pytest.approx(10.0)


def test_buckets_are_bounded_and_idle_ones_are_dropped() -> None:
    clock = Clock()
    limiter = RateLimiter(1.0, 2, clock=clock, max_buckets=3)
    for key in "abcd":
        limiter.take(key)
    assert len(limiter) == 3  # "a", the least recently used, was dropped
    # a fresh bucket of two (lenient, never stricter): the old one had one token left
    assert [limiter.take("a"), limiter.take("a"), limiter.take("a")] == [0.0, 0.0, 1.0]
    clock.now += 2.0  # burst / rate: every bucket is full again, the same as none
    limiter.take("z")
    limiter.take("z")
    assert len(limiter) <= 2  # two idle ones dropped per take
    limiter.take("z")
    assert len(limiter) == 1
    assert limiter.take("b") == 0.0


def test_the_limiter_refuses_bad_settings() -> None:
    clock = Clock()
    for rate, burst in ((0.0, 1), (-1.0, 1), (float("nan"), 1), (float("inf"), 1), (1.0, 0.5)):
        with pytest.raises(ProxyConfigError):
            RateLimiter(rate, burst, clock=clock)
    with pytest.raises(ProxyConfigError):
        RateLimiter(1.0, 1, clock=clock, max_buckets=0)
    bad_settings: list[dict[str, Any]] = [
        {"proxy_rate_limit_rps": -1},
        {"proxy_rate_limit_rps": "nan"},
        {"proxy_rate_limit_rps": 1e6},
        {"proxy_rate_limit_burst": 0},
    ]
    for bad in bad_settings:
        with pytest.raises(ValidationError):
            ProxySettings(spool_dir=None, **bad)
    s = ProxySettings(spool_dir=None)
    assert (s.proxy_rate_limit_rps, s.proxy_rate_limit_burst) == (20.0, 40)


# --------------------------------------------------------------------------- the proxy


def limited_app(chat: ChatTemplate, **kw: Any) -> Any:
    """The proxy in process with a limit of 2 requests then one per 100 s per rollout."""
    kw = {"proxy_rate_limit_rps": 0.01, "proxy_rate_limit_burst": 2, **kw}
    return make_app(chat, Backend(chat), **kw)


def asgi(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://p")


def sdk_asgi(app: Any) -> Any:
    """An HTTP client of the official SDKs' library that calls ``app`` in process."""
    return SDK_HTTP.AsyncClient(transport=SDK_HTTP.ASGITransport(app), base_url="http://p")


async def new_rollout(http: httpx.AsyncClient) -> dict[str, Any]:
    r = await http.post(
        "/v1/rollouts", json={"task_id": "t"}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_openai_client_gets_rate_limit_error_with_retry_after(chat: ChatTemplate) -> None:
    app, recorder = limited_app(chat)
    proxy = app.state.proxy

    async def main() -> None:
        await proxy.pool.start()
        http = asgi(app)
        ro = await new_rollout(http)
        client = openai.AsyncOpenAI(
            base_url=ro["base_url"], api_key=ro["token"], max_retries=0, http_client=sdk_asgi(app)
        )
        for _ in range(2):  # the burst (the raw-ASGI fast path)
            done = await client.chat.completions.create(model="m", messages=USER)
            assert done.choices[0].message.content == "Hello there."
        with pytest.raises(openai.RateLimitError) as err:
            await client.chat.completions.create(model="m", messages=USER)
        exc = err.value
        assert exc.status_code == 429 and exc.code == "rate_limit_exceeded"
        assert exc.response.headers["retry-after"] == "100"
        error = exc.response.json()["error"]
        assert error.pop("message").startswith("Rate limit reached for rollout")
        assert error == {"type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
        assert ro["rollout_id"] in exc.message
        # the Responses route (Starlette) and the rollout API share the rollout's bucket
        with pytest.raises(openai.RateLimitError):
            await client.responses.create(model="m", input="hi")
        auth = {"Authorization": f"Bearer {ro['token']}"}
        tool = {"name": "ls", "result": "ok"}
        r = await http.post(f"/v1/rollouts/{ro['rollout_id']}/tool_calls", json=tool, headers=auth)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert r.headers["retry-after"] == "100"
        r = await http.get(f"/v1/rollouts/{ro['rollout_id']}", headers=auth)
        assert r.status_code == 429
        # the admin key is not limited, on the same rollout
        admin = {"Authorization": f"Bearer {ADMIN}"}
        url = f"/rollouts/{ro['rollout_id']}/v1/chat/completions"
        r = await http.post(url, json={"messages": USER}, headers=admin)
        assert r.status_code == 200, r.text
        r = await http.post(f"/v1/rollouts/{ro['rollout_id']}/tool_calls", json=tool, headers=admin)
        assert r.status_code == 200, r.text
        # another rollout has its own bucket; a bad token is 401 before any limit
        other = await new_rollout(http)
        other_auth = {"Authorization": f"Bearer {other['token']}"}
        r = await http.post("/v1/chat/completions", json={"messages": USER}, headers=other_auth)
        assert r.status_code == 200, r.text
        bad = {"Authorization": "Bearer rs1.x.y"}
        r = await http.post("/v1/chat/completions", json={"messages": USER}, headers=bad)
        assert r.status_code == 401
        status = (await http.get("/v1/admin/status", headers=admin)).json()
        assert status["rate_limited"] == 4
        await proxy.pool.aclose()

    try:
        run(main)
    finally:
        recorder.close(5)


def test_anthropic_client_gets_rate_limit_error(chat: ChatTemplate) -> None:
    app, recorder = limited_app(chat, proxy_rate_limit_burst=1)
    proxy = app.state.proxy

    async def main() -> None:
        await proxy.pool.start()
        ro = await new_rollout(asgi(app))
        client = anthropic.AsyncAnthropic(
            base_url=ro["base_url"].removesuffix("/v1"),
            api_key=ro["token"],
            max_retries=0,
            http_client=sdk_asgi(app),
        )
        msg = await client.messages.create(model="m", max_tokens=8, messages=USER)
        assert msg.content[0].type == "text"
        with pytest.raises(anthropic.RateLimitError) as err:
            await client.messages.create(model="m", max_tokens=8, messages=USER)
        exc = err.value
        assert exc.status_code == 429 and exc.response.headers["retry-after"] == "100"
        body = exc.response.json()
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        assert "Rate limit reached" in body["error"]["message"]
        await proxy.pool.aclose()

    try:
        run(main)
    finally:
        recorder.close(5)


def test_no_limit_when_the_rate_is_zero(chat: ChatTemplate) -> None:
    app, recorder = limited_app(chat, proxy_rate_limit_rps=0, proxy_rate_limit_burst=1)
    proxy = app.state.proxy
    assert proxy.auth.limiter is None

    async def main() -> None:
        await proxy.pool.start()
        http = asgi(app)
        ro = await new_rollout(http)
        auth = {"Authorization": f"Bearer {ro['token']}"}
        for _ in range(5):
            r = await http.get(f"/v1/rollouts/{ro['rollout_id']}", headers=auth)
            assert r.status_code == 200, r.text
        await proxy.pool.aclose()

    try:
        run(main)
    finally:
        recorder.close(5)


def test_a_paused_pool_still_answers_its_own_429(chat: ChatTemplate) -> None:
    """The 429 of a pause (code ``paused``, Retry-After = proxy_retry_after_s) is not the rate
    limit's, and the official client raises RateLimitError for it too."""
    app, recorder = make_app(chat, Backend(chat))
    proxy = app.state.proxy
    proxy.pool.pause_wait_s, proxy.pool.retry_after_s = 0.05, 3.0

    async def main() -> None:
        await proxy.pool.start()
        http = asgi(app)
        ro = await new_rollout(http)
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert (await http.post("/v1/admin/pause", headers=admin)).json()["paused"] is True
        client = openai.AsyncOpenAI(
            base_url=ro["base_url"], api_key=ro["token"], max_retries=0, http_client=sdk_asgi(app)
        )
        with pytest.raises(openai.RateLimitError) as err:
            await client.chat.completions.create(model="m", messages=USER)
        assert err.value.code == "paused" and err.value.response.headers["retry-after"] == "3"
        await http.post("/v1/admin/resume", headers=admin)
        r = await client.chat.completions.create(model="m", messages=USER)
        assert r.choices[0].message.content == "Hello there."
        await proxy.pool.aclose()

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        recorder.close(5)
