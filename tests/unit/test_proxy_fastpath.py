"""The proxy's per-call hot path, in process: the raw-ASGI model-call routes answer exactly what
the Starlette routes answer (success, SSE and every bad-input status), the lean backend client
(no httpx) fails the way the httpx one does, rollout tokens, and call ids."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from ulid import ULID

from rollstream.inference.tinymodel import CHAT_TEMPLATE, train_tokenizer
from rollstream.producers import ContextTrie, MemoryTransport, Recorder
from rollstream.producers.proxy.app import ProxyApp, _fast_route, create_app
from rollstream.producers.proxy.backends import (
    BackendKind,
    BackendRejected,
    BackendUnavailable,
    CompletionBackend,
)
from rollstream.producers.proxy.chat import ChatTemplate
from rollstream.producers.proxy.http1 import Http1Transport
from rollstream.producers.proxy.pool import BackendPool
from rollstream.producers.proxy.rollout_api import RolloutTokens
from rollstream.producers.proxy.service import new_ulid
from rollstream.producers.proxy.settings import ProxySettings
from rollstream.schemas import LlmCall, RolloutError

ADMIN = "unit-admin"


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 30))


@pytest.fixture(scope="module")
def chat() -> ChatTemplate:
    tok = train_tokenizer()
    return ChatTemplate(tok.backend_tokenizer, CHAT_TEMPLATE,
                        special_tokens={"eos_token": "<|im_end|>"}, max_model_len=512)  # fmt: skip


class Backend:
    """A reference backend in process (httpx.MockTransport): every completion is ``reply``."""

    def __init__(self, chat: ChatTemplate) -> None:
        assert chat.eos_id is not None
        self.reply = [*chat.encode("Hello there.").tolist(), chat.eos_id]
        self.status = 200

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            if self.status != 200:
                return httpx.Response(self.status, json={"error": {"message": "nope"}})
            return httpx.Response(200, json={"model": "m", "policy_version": 3, "choices": [{
                "token_ids": self.reply, "finish_reason": "stop",
                "logprobs": {"token_logprobs": [-0.5] * len(self.reply)}}]})  # fmt: skip
        return httpx.Response(200, json={"policy_version": 3})


def make_app(chat: ChatTemplate, backend: Backend, **kw: Any) -> tuple[ProxyApp, Recorder]:
    settings = ProxySettings(spool_dir=None, proxy_api_keys=[ADMIN], proxy_max_body_bytes=2048,
                             proxy_max_prompt_tokens=200, **kw)  # fmt: skip
    recorder = Recorder(settings, transport=MemoryTransport())
    http = httpx.AsyncClient(transport=httpx.MockTransport(backend.handle))
    pool = BackendPool([CompletionBackend("http://b", "b", http=http)], health_interval_s=0,
                       backend_wait_s=0.2)  # fmt: skip
    app = create_app(settings, recorder=recorder, pool=pool, chat=chat)
    assert isinstance(app, ProxyApp)
    return app, recorder


def test_fast_route_matches_the_starlette_paths() -> None:
    assert _fast_route("/v1/chat/completions") == ("chat", None)
    assert _fast_route("/v1/completions") == ("text", None)
    assert _fast_route("/v1/messages") == ("messages", None)
    assert _fast_route("/rollouts/r-1/v1/chat/completions") == ("chat", "r-1")
    assert _fast_route("/rollouts/r-1/v1/completions") == ("text", "r-1")
    assert _fast_route("/rollouts/r-1/v1/messages") == ("messages", "r-1")
    for other in (
        "/rollouts//v1/chat/completions",
        "/rollouts//v1/messages",
        "/rollouts/r/v1/models",
        "/rollouts/r/v1/responses",
        "/v1/models",
        "/v1/responses",
        "/rollouts/a/b/v1/chat/completions",
        "/rollouts/a/b/v1/messages",
        "/v1/chat/completions/",
        "/v1/messages/",
        "/v1//messages",
        "/rollouts/r/messages",
        "/health",
    ):
        assert _fast_route(other) is None, other  # fmt: skip


def test_raw_asgi_routes_answer_like_the_starlette_routes(chat: ChatTemplate) -> None:
    backend = Backend(chat)
    app, recorder = make_app(chat, backend)
    proxy = app.state.proxy

    async def via_starlette(scope: Any, receive: Any, send: Any) -> None:
        await Starlette.__call__(app, scope, receive, send)  # the routes, not the fast path

    async def main() -> None:
        await proxy.pool.start()
        fast = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://p")
        slow = httpx.AsyncClient(transport=httpx.ASGITransport(via_starlette), base_url="http://p")
        admin = {"Authorization": f"Bearer {ADMIN}"}
        a = (await fast.post("/v1/rollouts", json={"task_id": "t"}, headers=admin)).json()
        b = (await fast.post("/v1/rollouts", json={"task_id": "t"}, headers=admin)).json()
        chat_a = f"/rollouts/{a['rollout_id']}/v1/chat/completions"
        auth = {"Authorization": f"Bearer {a['token']}"}
        ok = {"messages": [{"role": "user", "content": "hi"}]}
        cases: list[tuple[str, dict[str, Any], int]] = [
            (chat_a, {"content": b"{not json", "headers": auth}, 400),
            (chat_a, {"content": b"[1]", "headers": auth}, 400),
            (chat_a, {"json": {"messages": [{"role": "user"}]}, "headers": auth}, 400),
            (chat_a, {"json": {**ok, "temperature": "hot"}, "headers": auth}, 400),
            (chat_a, {"json": {**ok, "n": 17}, "headers": auth}, 400),
            (chat_a, {"json": ok}, 401),
            (chat_a, {"json": ok, "headers": {"Authorization": "Bearer rs1.x.y"}}, 401),
            (chat_a, {"json": ok, "headers": {"Authorization": f"Bearer {b['token']}"}}, 403),
            (chat_a, {"json": {"messages": [{"role": "user", "content": "x" * 3000}]},
                      "headers": auth}, 413),
            (chat_a, {"json": {"messages": [{"role": "user", "content": "word " * 300}]},
                      "headers": auth}, 400),  # context_length_exceeded
            ("/rollouts/nope/v1/chat/completions", {"json": ok, "headers": admin}, 404),
            (f"/rollouts/{a['rollout_id']}/v1/completions",
             {"json": {"prompt": [1, 99999]}, "headers": auth}, 400),
            (f"/rollouts/{a['rollout_id']}/v1/completions",
             {"json": {"prompt": ""}, "headers": auth}, 400),
            (chat_a, {"json": {**ok, "stop": ["two words"]}, "headers": auth}, 400),
            (chat_a, {"json": {**ok, "tools": "nope"}, "headers": auth}, 400),
        ]  # fmt: skip
        for url, kw, status in cases:
            rf, rs = await fast.post(url, **kw), await slow.post(url, **kw)
            assert rf.status_code == rs.status_code == status, (url, rf.text, rs.text)
            assert rf.json() == rs.json(), url
            assert set(rf.json()["error"]) == {"message", "type", "param", "code"}
            assert rf.headers["content-type"] == rs.headers["content-type"]
            assert rf.headers["content-length"] == str(len(rf.content))

        for client in (fast, slow):  # success: the same answer but for ids and times
            r = await client.post(chat_a, json={**ok, "return_token_ids": True}, headers=auth)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello there."}
            assert body["choices"][0]["token_ids"] == backend.reply
            assert body["rollstream"]["policy_version"] == 3
            assert r.headers["content-type"] == "application/json"
            streamed = {**ok, "stream": True, "stream_options": {"include_usage": True}}
            r = await client.post("/v1/chat/completions", json=streamed, headers=auth)
            assert r.status_code == 200
            assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert r.headers["cache-control"] == "no-cache"
            lines = [ln for ln in r.text.split("\n\n") if ln]
            assert lines[-1] == "data: [DONE]"
            use = json.loads(lines[-2].removeprefix("data: "))["usage"]
            assert use["completion_tokens"] == len(backend.reply)
            r = await client.post(f"/rollouts/{a['rollout_id']}/v1/completions",
                                  json={"prompt": "Hi", "max_tokens": 8}, headers=auth)  # fmt: skip
            assert r.status_code == 200 and r.json()["object"] == "text_completion"
        assert proxy.rollouts.get(a["rollout_id"]).calls == 6

        # backend errors: 400 (it rejected the request) and 503 with Retry-After, both paths
        for status, want in ((422, 400), (500, 503)):
            backend.status = status
            rf, rs = (await fast.post(chat_a, json=ok, headers=auth),
                      await slow.post(chat_a, json=ok, headers=auth))  # fmt: skip
            assert rf.status_code == rs.status_code == want
            assert rf.headers.get("retry-after") == rs.headers.get("retry-after")
            assert (want == 503) == ("retry-after" in rf.headers)
        backend.status = 200
        # a GET on a model-call URL is Starlette's 405, not the fast path
        assert (await fast.get(chat_a, headers=auth)).status_code == 405
        await proxy.pool.aclose()

    try:
        run(main)
    finally:
        recorder.close(5)


def test_raw_asgi_messages_answer_like_the_starlette_route(chat: ChatTemplate) -> None:
    """/v1/messages on the fast path: Anthropic's error objects, statuses and headers as the
    Starlette route gives them, for every bad input; the same Message and the same streamed
    events (but for ids) on success; x-api-key or a bearer token."""
    backend = Backend(chat)
    app, recorder = make_app(chat, backend)
    proxy = app.state.proxy

    async def via_starlette(scope: Any, receive: Any, send: Any) -> None:
        await Starlette.__call__(app, scope, receive, send)

    async def main() -> None:
        await proxy.pool.start()
        fast = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://p")
        slow = httpx.AsyncClient(transport=httpx.ASGITransport(via_starlette), base_url="http://p")
        admin = {"Authorization": f"Bearer {ADMIN}"}
        a = (await fast.post("/v1/rollouts", json={"task_id": "t"}, headers=admin)).json()
        b = (await fast.post("/v1/rollouts", json={"task_id": "t"}, headers=admin)).json()
        url = f"/rollouts/{a['rollout_id']}/v1/messages"
        key = {"x-api-key": a["token"]}
        ok = {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
        cases: list[tuple[str, dict[str, Any], int]] = [
            (url, {"content": b"{not json", "headers": key}, 400),
            (url, {"content": b"[1]", "headers": key}, 400),
            (url, {"json": {"messages": ok["messages"]}, "headers": key}, 400),  # no max_tokens
            (url, {"json": {**ok, "messages": [{"role": "robot", "content": "x"}]},
                   "headers": key}, 400),
            (url, {"json": {**ok, "temperature": "hot"}, "headers": key}, 400),
            (url, {"json": ok}, 401),
            (url, {"json": ok, "headers": {"x-api-key": "rs1.x.y"}}, 401),
            (url, {"json": ok, "headers": {"x-api-key": b["token"]}}, 403),
            (url, {"json": {**ok, "messages": [{"role": "user", "content": "x" * 3000}]},
                   "headers": key}, 413),
            (url, {"json": {**ok, "messages": [{"role": "user", "content": "word " * 300}]},
                   "headers": key}, 400),  # prompt is too long
            ("/rollouts/nope/v1/messages", {"json": ok, "headers": admin}, 404),
            ("/v1/messages", {"json": ok, "headers": {"x-api-key": "nope"}}, 401),
            (url, {"json": {**ok, "stop_sequences": ["two words"]}, "headers": key}, 400),
        ]  # fmt: skip
        for u, kw, status in cases:
            rf, rs = await fast.post(u, **kw), await slow.post(u, **kw)
            assert rf.status_code == rs.status_code == status, (u, rf.text, rs.text)
            assert rf.json() == rs.json(), u
            assert rf.json()["type"] == "error" and set(rf.json()["error"]) == {"type", "message"}
            assert dict(rf.headers) == dict(rs.headers), u

        def same(x: Any) -> Any:  # ids and times differ from call to call
            if isinstance(x, dict):
                return {k: "*" if k in ("id", "call_id") else same(v) for k, v in x.items()}
            return [same(v) for v in x] if isinstance(x, list) else x

        for auth in (key, {"Authorization": f"Bearer {a['token']}"}):
            rf = await fast.post("/v1/messages", json=ok, headers=auth)
            rs = await slow.post("/v1/messages", json=ok, headers=auth)
            assert rf.status_code == rs.status_code == 200, rf.text
            assert same(rf.json()) == same(rs.json())
            assert rf.json()["content"] == [{"type": "text", "text": "Hello there."}]
            assert dict(rf.headers) == dict(rs.headers)
            streamed = {**ok, "stream": True}
            rf = await fast.post(url, json=streamed, headers=auth)
            rs = await slow.post(url, json=streamed, headers=auth)
            assert rf.status_code == rs.status_code == 200
            assert rf.headers["content-type"] == rs.headers["content-type"]
            assert rf.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert rf.headers["cache-control"] == rs.headers["cache-control"] == "no-cache"
            events = [
                [(e.split("\n")[0], same(json.loads(e.split("\n")[1].removeprefix("data: "))))
                 for e in r.text.split("\n\n") if e]
                for r in (rf, rs)
            ]  # fmt: skip
            assert events[0] == events[1]
            assert events[0][-1][0] == "event: message_stop"
        assert proxy.rollouts.get(a["rollout_id"]).calls == 8
        counted = app.metrics.service.registry.get_sample_value(
            "rollstream_proxy_requests_total",
            {"route": "/rollouts/{rollout_id}/v1/messages", "code": "200"},
        )
        assert counted == 4  # both paths count under the route template
        await proxy.pool.aclose()

    try:
        run(main)
    finally:
        recorder.close(5)


def test_raw_asgi_body_limit_across_chunks_and_disconnect(chat: ChatTemplate) -> None:
    app, recorder = make_app(chat, Backend(chat))
    proxy = app.state.proxy
    ro = proxy.rollouts.create(task_id="t", group_id="g")
    token = proxy.auth.tokens.issue(ro.rollout_id)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "root_path": "",
             "headers": [(b"authorization", f"Bearer {token}".encode())]}  # fmt: skip

    async def call(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return messages.pop(0)

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(scope, receive, send)
        return sent

    async def main() -> None:
        # no Content-Length; the chunks add up past the limit (2048): 413 before the end
        chunk = {"type": "http.request", "body": b"x" * 1500, "more_body": True}
        sent = await call([chunk, dict(chunk), {"type": "http.request", "body": b""}])
        assert sent[0]["status"] == 413
        assert json.loads(sent[1]["body"])["error"]["code"] == "body_too_large"
        # the client went away mid-body: nothing is answered
        assert await call([chunk, {"type": "http.disconnect"}]) == []

    try:
        run(main)
    finally:
        recorder.close(5)


class RawServer:
    """A tiny HTTP/1.1 server answering /v1/completions with a fixed status and body."""

    def __init__(self) -> None:
        self.status, self.body = 200, b"{}"
        self.requests: list[bytes] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n" % (
                    self.status, len(self.body)) + self.body)  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def test_lean_backend_path_answers_and_fails_like_httpx() -> None:
    async def main() -> None:
        srv = RawServer()
        port = await srv.start()
        lean = Http1Transport()
        http = httpx.AsyncClient(transport=lean, timeout=5)
        b = CompletionBackend(f"http://127.0.0.1:{port}/v1", "b", http=http, lean=lean,
                              api_key="k", model="m")  # fmt: skip
        srv.body = json.dumps({"policy_version": 7, "choices": [{
            "token_ids": [5, 6], "finish_reason": "stop", "stop_reason": 6,
            "logprobs": {"token_logprobs": [-1.0, -2.0]}}]}).encode()  # fmt: skip
        import numpy as np

        out = await b.complete(np.array([1, 2, 3], dtype=np.uint32), max_tokens=4, seed=1)
        assert out.token_ids.tolist() == [5, 6] and out.policy_version == 7
        assert out.stop_reason == 6 and out.prompt_tokens == 3
        head, _, body = srv.requests[-1].partition(b"\r\n\r\n")
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"Authorization: Bearer k" in head
        sent = json.loads(body)
        assert sent["prompt"] == [1, 2, 3] and sent["model"] == "m" and sent["seed"] == 1
        srv.status, srv.body = 400, b'{"error": {"message": "too long"}}'
        with pytest.raises(BackendRejected, match="too long") as rejected:
            await b.complete([1], max_tokens=1)
        assert rejected.value.status == 400
        srv.status, srv.body = 503, b"overloaded"
        with pytest.raises(BackendUnavailable, match="overloaded"):
            await b.complete([1], max_tokens=1)
        srv.status, srv.body = 200, b"{not json"
        with pytest.raises(Exception, match="invalid JSON"):
            await b.complete([1], max_tokens=1)
        # base_url reassigned (an operator or a test moving the backend): followed at once
        b.base_url = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(BackendUnavailable, match="connect"):
            await b.complete([1], max_tokens=1)
        await http.aclose()
        srv.server.close()

    run(main)


def test_rollout_tokens_remember_only_valid_ones() -> None:
    tokens = RolloutTokens(b"0123456789abcdef0123")
    good = tokens.issue("r1")
    assert tokens.verify(good) == "r1" and tokens.verify(good) == "r1"
    forged = good[:-2] + ("AA" if not good.endswith("AA") else "BB")
    assert tokens.verify(forged) is None and tokens.verify(forged) is None
    assert tokens.verify(RolloutTokens(b"another-secret-16b").issue("r1")) is None
    assert set(tokens._valid) == {good}


def test_new_ulid_is_a_monotonic_ulid() -> None:
    before = int(time.time() * 1000)
    ids = [new_ulid() for _ in range(2000)]
    after = int(time.time() * 1000)
    assert all(len(i) == 26 and str(ULID.from_str(i)) == i for i in ids)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    ms = ULID.from_str(ids[0]).milliseconds
    assert before <= ms <= after


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- structure


def test_every_producers_exception_derives_from_producer_error() -> None:
    """One error root (producers/errors.py): every exception class of the SDK and the proxy is a
    ProducerError defined there and drawn in its tree, but for http1's private ``_Stale``,
    which never leaves ``exchange``."""
    import importlib
    import inspect
    import pkgutil

    import rollstream.producers as root
    from rollstream.producers import errors

    found = {}
    rooms = ("rollstream.producers.sdk", "rollstream.producers.proxy")  # and the package's own
    for info in pkgutil.walk_packages(root.__path__, "rollstream.producers."):
        if info.name.count(".") > 2 and not info.name.startswith(rooms):
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            ours = inspect.isclass(obj) and obj.__module__.startswith("rollstream.producers")
            if ours and issubclass(obj, BaseException):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    private = {"rollstream.producers.proxy.http1._Stale"}
    assert private <= set(found)
    assert {n for n, c in found.items() if not issubclass(c, errors.ProducerError)} == private
    public = {n for n in found if n not in private}
    classes = [n for n in errors.__all__ if inspect.isclass(getattr(errors, n))]
    assert public == {f"rollstream.producers.errors.{n}" for n in classes}
    for name in errors.__all__:  # the tree in the docstring names every class
        assert name in (errors.__doc__ or "") or name == "Http1ErrorKind", name


def test_the_service_knows_no_http_framework() -> None:
    """service.py runs without Starlette or uvicorn; only app.py imports them."""
    import subprocess
    import sys

    code = (
        "import sys, rollstream.producers.proxy.service\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'starlette', 'uvicorn'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class Sampler:
    """A backend in process that answers each completion with the next of ``replies`` and,
    when asked for ``logprobs=k``, k alternatives per token (plus the sampled one, as vLLM and
    the reference server do); it keeps the request bodies."""

    def __init__(self, chat: ChatTemplate, texts: list[str]) -> None:
        assert chat.eos_id is not None
        self.replies = [[*chat.encode(t).tolist(), chat.eos_id] for t in texts]
        self.bodies: list[dict[str, Any]] = []
        self.status = 200

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return httpx.Response(200, json={"policy_version": 0})
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "nope"}})
        body = json.loads(request.content)
        ids = self.replies[len(self.bodies) % len(self.replies)]
        self.bodies.append(body)
        k = body["logprobs"]
        tops = [{f"token_id:{t}": -0.5, **{f"token_id:{1000 + a}": -1.0 - a for a in range(k)}}
                for t in ids]  # fmt: skip
        return httpx.Response(200, json={"model": "m", "choices": [{
            "token_ids": ids, "finish_reason": "stop",
            "logprobs": {"token_logprobs": [-0.5] * len(ids), "top_logprobs": tops}}]})  # fmt: skip


def sampler_app(
    chat: ChatTemplate, sampler: Sampler, kind: BackendKind = "reference"
) -> tuple[ProxyApp, Recorder, MemoryTransport]:
    settings = ProxySettings(spool_dir=None, proxy_api_keys=[ADMIN])
    transport = MemoryTransport()
    recorder = Recorder(settings, transport=transport)
    http = httpx.AsyncClient(transport=httpx.MockTransport(sampler.handle))
    backend = CompletionBackend("http://b", "b", kind=kind, http=http)
    pool = BackendPool([backend], health_interval_s=0, backend_wait_s=0.2)
    return create_app(settings, recorder=recorder, pool=pool, chat=chat), recorder, transport


def recorded(recorder: Recorder, transport: MemoryTransport) -> list[Any]:
    assert recorder.flush(10)
    return [recorder.codec.decode(m.value).body for m in transport.messages(recorder.topic)]


def test_n_choices_are_n_recorded_samples_of_one_prompt(chat: ChatTemplate) -> None:
    """n=3: three backend samples (seeds s, s+1, s+2), three choices, usage over all of them,
    three LlmCalls with the same full prompt; the next turn extends the choice sent back.
    Streamed, each chunk carries its choice's index."""
    sampler = Sampler(chat, ["Red.", "Blue sky.", "Green"])
    app, recorder, transport = sampler_app(chat, sampler)
    proxy = app.state.proxy

    async def main() -> tuple[list[str], list[int], int]:
        await proxy.pool.start()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://p")
        ro = proxy.create_rollout(task_id="t", group_id="g", base_url="http://p")
        url, auth = "/v1/chat/completions", {"Authorization": f"Bearer {ro['token']}"}
        user = [{"role": "user", "content": "Name a colour."}]
        r = await client.post(url, headers=auth, json={
            "messages": user, "n": 3, "seed": 7, "return_token_ids": True})  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        contents = [c["message"]["content"] for c in body["choices"]]
        assert sorted(contents) == ["Blue sky.", "Green", "Red."]
        assert sorted(b["seed"] for b in sampler.bodies) == [7, 8, 9]
        assert body["usage"]["completion_tokens"] == sum(len(x) for x in sampler.replies)
        prompt_len = body["usage"]["prompt_tokens"]
        assert all(len(c["prompt_token_ids"]) == prompt_len for c in body["choices"])
        ext = body["rollstream"]
        assert len(ext["call_ids"]) == 3 and ext["call_id"] == ext["call_ids"][0]
        assert body["id"] == f"chatcmpl-{ext['call_id']}"
        # the harness keeps choice 2: the next call extends it
        kept = body["choices"][2]
        back = [*user, kept["message"], {"role": "user", "content": "Why?"}]
        r2 = await client.post(url, headers=auth, json={"messages": back})
        assert r2.status_code == 200, r2.text
        # streamed: per choice a role, content and finish chunk, then usage
        r3 = await client.post(url, headers=auth, json={
            "messages": user, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}})  # fmt: skip
        chunks = [json.loads(x.removeprefix("data: ")) for x in r3.text.split("\n\n")
                  if x.startswith("data: {")]  # fmt: skip
        texts = {0: "", 1: ""}
        finishes: dict[int, str] = {}
        for ch in chunks[:-1]:
            (c,) = ch["choices"]
            texts[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                finishes[c["index"]] = c["finish_reason"]
        assert finishes == {0: "stop", 1: "stop"} and all(texts.values())
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
        await proxy.pool.aclose()
        return ext["call_ids"], kept["token_ids"], prompt_len

    try:
        call_ids, kept_ids, prompt_len = asyncio.run(asyncio.wait_for(main(), 30))
        calls = [e for e in recorded(recorder, transport) if isinstance(e, LlmCall)]
    finally:
        recorder.close(5)
    assert [c.call_id for c in calls[:3]] == call_ids and len(calls) == 6
    trie = ContextTrie()
    prompts = [trie.add_delta(c.call_id, c.parent_call_id, c.prefix_len, c.prompt_delta,
                              c.completion_ids) for c in calls]  # fmt: skip
    assert all(p.tolist() == prompts[0].tolist() for p in prompts[1:3])
    assert len(prompts[0]) == prompt_len
    for i in (1, 2):  # beside choice 0's completion: the whole prompt shared, nothing new
        assert calls[i].parent_call_id == call_ids[i - 1]
        assert calls[i].prefix_len == prompt_len and len(calls[i].prompt_delta) == 0
    nxt = calls[3]  # the turn after: choice 2's sequence is its prefix
    assert nxt.parent_call_id == call_ids[2]
    assert nxt.prefix_len == prompt_len + len(kept_ids)
    assert prompts[3][prompt_len : prompt_len + len(kept_ids)].tolist() == kept_ids


def test_top_logprobs_response_format_and_tool_choice(chat: ChatTemplate) -> None:
    """top_logprobs=k: k alternatives per token in OpenAI's chat shape, best first, the
    backend asked for k; the recorded LlmCall keeps the sampled tokens' logprobs only.
    response_format json_object/json_schema: 400 on a reference backend, passed on to vLLM.
    tool_choice "required" without a tool call in the reply: answered as sampled, flagged."""
    sampler = Sampler(chat, ["Hello there."])
    app, recorder, transport = sampler_app(chat, sampler)
    proxy = app.state.proxy
    user = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]

    async def main() -> None:
        await proxy.pool.start()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://p")
        ro = proxy.create_rollout(task_id="t", group_id="g", base_url="http://p")
        url, auth = "/v1/chat/completions", {"Authorization": f"Bearer {ro['token']}"}

        async def post(**kw: Any) -> tuple[int, dict[str, Any]]:
            r = await client.post(url, headers=auth, json={"messages": user, **kw})
            return r.status_code, r.json()

        status, body = await post(logprobs=True, top_logprobs=2)
        assert status == 200 and sampler.bodies[-1]["logprobs"] == 2
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == len(sampler.replies[0])
        for entry, t in zip(content, sampler.replies[0], strict=True):
            assert entry["logprob"] == -0.5 and entry["bytes"] == list(entry["token"].encode())
            assert [a["logprob"] for a in entry["top_logprobs"]] == [-0.5, -1.0]
            assert entry["top_logprobs"][0]["token"] == chat.tokenizer.decode(
                [t], skip_special_tokens=False
            )
        status, body = await post(logprobs=True)
        assert status == 200 and sampler.bodies[-1]["logprobs"] == 0
        assert all(e["top_logprobs"] == [] for e in body["choices"][0]["logprobs"]["content"])
        for bad, param, code in (
            ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),  # without logprobs
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
            ({"response_format": {"type": "json_object"}}, "response_format", "unsupported"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
             "response_format", "unsupported"),
            ({"response_format": {"type": "yaml"}}, "response_format", "invalid_value"),
            ({"tool_choice": "sometimes", "tools": tools}, "tool_choice", "invalid_value"),
            ({"tool_choice": "required"}, "tool_choice", "invalid_value"),  # no tools
            ({"tool_choice": {"type": "function", "function": {"name": "other"}},
              "tools": tools}, "tool_choice", "invalid_value"),
        ):  # fmt: skip
            status, body = await post(**bad)
            assert (status, body["error"]["param"], body["error"]["code"]) == (400, param, code)
        assert (await post(response_format={"type": "text"}))[0] == 200
        status, body = await post(tool_choice="required", tools=tools)
        assert status == 200
        choice = body["choices"][0]
        assert choice["tool_choice_met"] is False and choice["finish_reason"] == "stop"
        assert choice["message"]["content"] == "Hello there."
        status, body = await post(tool_choice="auto", tools=tools)
        assert status == 200 and "tool_choice_met" not in body["choices"][0]
        r = await client.post(f"/rollouts/{ro['rollout_id']}/v1/completions", headers=auth,
                              json={"prompt": "Hi", "n": 2})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
        # one failure among n samples: the call fails once, recorded once
        sampler.status = 422
        status, body = await post(n=3)
        assert status == 400 and body["error"]["code"] == "backend_rejected"
        await proxy.pool.aclose()

    try:
        run(main)
        events = recorded(recorder, transport)
    finally:
        recorder.close(5)
    calls = [e for e in events if isinstance(e, LlmCall)]
    assert len(calls) == 5 and len([e for e in events if isinstance(e, RolloutError)]) == 1
    assert calls[0].completion_logprobs.tolist() == [-0.5] * len(sampler.replies[0])

    # a vLLM pool decodes under a grammar: response_format goes to the backend as sent
    vllm = Sampler(chat, ['{"a": 1}'])
    app, recorder, _ = sampler_app(chat, vllm, kind="vllm")
    proxy = app.state.proxy
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}

    async def via_vllm() -> None:
        await proxy.pool.start()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://p")
        ro = proxy.create_rollout(task_id="t", group_id="g", base_url="http://p")
        body = {"messages": user, "response_format": fmt}
        auth = {"Authorization": f"Bearer {ro['token']}"}
        r = await client.post("/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == '{"a": 1}'
        assert vllm.bodies[-1]["response_format"] == fmt
        await proxy.pool.aclose()

    try:
        run(via_vllm)
    finally:
        recorder.close(5)


def test_settle_heap_freezes_the_start_up_heap_and_collects_young_objects_less_often() -> None:
    import gc

    from rollstream.producers.proxy.app import settle_heap

    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    try:
        kept = [1, 2]  # alive at start-up: frozen with the rest (out of every generation)
        assert any(o is kept for o in gc.get_objects())
        settle_heap()
        assert gc.get_freeze_count() > frozen
        assert gc.get_threshold() == (10_000, *threshold[1:])
        assert not any(o is kept for o in gc.get_objects())
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
