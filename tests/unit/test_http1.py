"""The lean HTTP/1.1 client (producers/proxy/http1.py) against httpx's own transport (httpcore +
h11), on the same requests to a real local HTTP server: the same status, headers and body on
well-formed answers (Content-Length, chunked, keep-alive, connection close, HTTP/1.0, 1xx); on
malformed ones (bad or negative Content-Length, bad chunk size, a body cut short, a garbage
status line...) both fail, ours with an Http1Error (a ProducerError and a BackendUnavailable,
never a bare ValueError) that names the same httpx error. Then the same malformed answers
through the backend pool (it fails over) and through the proxy (a clean error answer, no 500)."""

from __future__ import annotations

import asyncio
import json
import socket
import socketserver
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import ClassVar

import httpx
import numpy as np
import pytest

from rollstream.inference.tinymodel import CHAT_TEMPLATE, train_tokenizer
from rollstream.producers import MemoryTransport, ProducerError, Recorder
from rollstream.producers.errors import BackendError, BackendUnavailable, Http1Error
from rollstream.producers.proxy.app import create_app
from rollstream.producers.proxy.chat import ChatTemplate
from rollstream.producers.proxy.http1 import Http1Transport
from rollstream.producers.proxy.pool import BackendPool
from rollstream.producers.proxy.settings import ProxySettings
from rollstream.schemas import RolloutError

# --------------------------------------------------------------------------- the server

OK_JSON = b'{"ok": true, "n": [1, 2, 3]}'


def _head(status: str = "200 OK", *lines: str) -> bytes:
    return (f"HTTP/1.1 {status}\r\n" + "".join(f"{line}\r\n" for line in lines) + "\r\n").encode()


# path -> (the raw answer, close the connection after it)
GOOD: dict[str, tuple[bytes, bool]] = {
    "/length": (_head("200 OK", "Content-Type: application/json",
                      f"Content-Length: {len(OK_JSON)}") + OK_JSON, False),
    "/chunked": (_head("200 OK", "Transfer-Encoding: chunked")
                 + b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", False),
    "/chunked-trailer": (_head("200 OK", "Transfer-Encoding: chunked")
                         + b"3\r\nabc\r\n0\r\nX-Checksum: 1\r\n\r\n", False),
    "/close": (_head("200 OK", "Connection: close", "Content-Length: 2") + b"ok", True),
    "/until-eof": (_head("200 OK", "Connection: close") + b"read to the end", True),
    "/http10": (b"HTTP/1.0 200 OK\r\nContent-Length: 4\r\n\r\nv1.0", True),
    "/no-content": (_head("204 No Content"), False),
    "/continue": (b"HTTP/1.1 100 Continue\r\n\r\n"
                  + _head("200 OK", "Content-Length: 5") + b"after", False),
    "/error": (_head("503 Service Unavailable", "Content-Length: 8") + b"overload", False),
    "/no-reason": (b"HTTP/1.1 200\r\nContent-Length: 1\r\n\r\nx", False),
    "/big": (_head("200 OK", f"Content-Length: {1 << 20}") + b"z" * (1 << 20), False),
    "/repeated-length": (_head("200 OK", "Content-Length: 3, 3") + b"abc", False),
}  # fmt: skip

MALFORMED: dict[str, tuple[bytes, bool]] = {
    "/length-not-a-number": (_head("200 OK", "Content-Length: abc") + b"abc", True),
    "/length-negative": (_head("200 OK", "Content-Length: -5") + b"abc", True),
    "/length-conflicting": (_head("200 OK", "Content-Length: 3", "Content-Length: 4")
                            + b"abcd", True),
    "/chunk-size-bad": (_head("200 OK", "Transfer-Encoding: chunked") + b"zz\r\nabc\r\n", True),
    "/chunk-too-long": (_head("200 OK", "Transfer-Encoding: chunked")
                        + b"2\r\nabcdef\r\n0\r\n\r\n", True),
    "/truncated-body": (_head("200 OK", "Content-Length: 100") + b"only ten b", True),
    "/truncated-chunks": (_head("200 OK", "Transfer-Encoding: chunked") + b"5\r\nhello\r\n", True),
    "/garbage-status": (b"garbage\r\n\r\n", True),
    "/status-not-a-number": (b"HTTP/1.1 abc OK\r\nContent-Length: 0\r\n\r\n", True),
    "/header-without-colon": (b"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 0\r\n\r\n",
                              True),
    "/nothing": (b"", True),
}  # fmt: skip


class _Handler(socketserver.BaseRequestHandler):
    routes: ClassVar[dict[str, tuple[bytes, bool]]] = {**GOOD, **MALFORMED}

    def handle(self) -> None:
        server: ScriptedServer = self.server  # type: ignore[assignment]
        server.connections += 1
        sock: socket.socket = self.request
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = sock.recv(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(buf) < length:
                buf += sock.recv(65536)
            buf = buf[length:]
            path = head.split(b" ")[1].decode()
            raw, close = self.routes[path.partition("?")[0]]
            sock.sendall(raw)
            if close:
                sock.shutdown(socket.SHUT_RDWR)
                return


class ScriptedServer(socketserver.ThreadingTCPServer):
    """A real HTTP/1.1 server on a local port, one thread per connection, keep-alive: each
    request is answered with the raw bytes scripted for its path."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.port = int(self.server_address[1])


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    srv = ScriptedServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 60))


def _head_bytes(port: int, path: str, method: str = "GET", body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: */*\r\n"
    if body or method == "POST":
        head += f"Content-Length: {len(body)}\r\n"
    return (head + "\r\n").encode()


def _headers(response: httpx.Response) -> dict[str, str]:
    """The answer's own headers (as sent, lower-cased names), without the framing ones."""
    skip = {"transfer-encoding", "content-length"}
    return {k.lower(): v for k, v in response.headers.items() if k.lower() not in skip}


# --------------------------------------------------------------------------- well-formed


@pytest.mark.parametrize("path", sorted(GOOD))
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_well_formed_answers_match_httpx(server: ScriptedServer, path: str, method: str) -> None:
    url = f"http://127.0.0.1:{server.port}{path}"
    payload = b'{"prompt": [1, 2, 3]}' if method == "POST" else None

    async def main() -> None:
        async with (
            httpx.AsyncClient(timeout=10) as reference,
            httpx.AsyncClient(transport=Http1Transport(), timeout=10) as ours,
        ):
            for _ in range(2):  # the second time over a kept-alive connection, where kept
                want = await reference.request(method, url, content=payload)
                got = await ours.request(method, url, content=payload)
                assert (got.status_code, got.content) == (want.status_code, want.content)
                assert _headers(got) == _headers(want)
        lean = Http1Transport()
        body = payload or b""
        status, headers, content = await lean.exchange(
            "127.0.0.1", server.port, _head_bytes(server.port, path, method, body), body,
            {"read": 10}, method=method,
        )  # fmt: skip
        assert (status, content) == (want.status_code, want.content)
        assert all(name.lower() != b"transfer-encoding" for name, _ in headers)
        await lean.aclose()

    run(main)


def test_keep_alive_reuses_one_connection_and_close_does_not(server: ScriptedServer) -> None:
    async def main() -> None:
        lean = Http1Transport()
        before = server.connections
        for _ in range(5):
            status, _, body = await lean.exchange(
                "127.0.0.1", server.port, _head_bytes(server.port, "/length"), timeouts={}
            )
            assert (status, body) == (200, OK_JSON)
        assert server.connections == before + 1
        for path in ("/close", "/until-eof", "/http10"):  # the server ends each connection
            await lean.exchange("127.0.0.1", server.port, _head_bytes(server.port, path))
            await lean.exchange("127.0.0.1", server.port, _head_bytes(server.port, "/length"))
        assert server.connections == before + 4
        await lean.aclose()

    run(main)


# --------------------------------------------------------------------------- malformed


@pytest.mark.parametrize("path", sorted(MALFORMED))
def test_malformed_answers_fail_like_httpx(server: ScriptedServer, path: str) -> None:
    url = f"http://127.0.0.1:{server.port}{path}"

    async def main() -> None:
        async with httpx.AsyncClient(timeout=10) as reference:
            with pytest.raises(httpx.TransportError) as want:
                await reference.get(url)
        lean = Http1Transport()
        with pytest.raises(Http1Error) as got:
            await lean.exchange("127.0.0.1", server.port, _head_bytes(server.port, path),
                                timeouts={"read": 10})  # fmt: skip
        assert isinstance(got.value, ProducerError) and isinstance(got.value, BackendUnavailable)
        assert not isinstance(got.value, ValueError)
        assert got.value.kind == type(want.value).__name__ == "RemoteProtocolError"
        assert not lean._idle.get(("127.0.0.1", server.port))  # the connection was dropped
        # under httpx the lean transport raises what httpcore raises
        async with httpx.AsyncClient(transport=lean, timeout=10) as ours:
            with pytest.raises(httpx.RemoteProtocolError):
                await ours.get(url)

    run(main)


def test_connect_and_timeout_errors_name_the_httpx_error(server: ScriptedServer) -> None:
    async def main() -> None:
        lean = Http1Transport()
        port = free_port()
        with pytest.raises(Http1Error) as err:
            await lean.exchange("127.0.0.1", port, _head_bytes(port, "/x"))
        assert err.value.kind == "ConnectError"
        async with httpx.AsyncClient(transport=lean) as ours:
            with pytest.raises(httpx.ConnectError):
                await ours.get(f"http://127.0.0.1:{port}/x")
        slow = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
        sport = slow.getsockname()[1]
        with pytest.raises(Http1Error) as err:
            await lean.exchange(
                "127.0.0.1", sport, _head_bytes(sport, "/x"), timeouts={"read": 0.1}
            )
        assert err.value.kind == "ReadTimeout"
        slow.close()
        await lean.aclose()

    run(main)


# --------------------------------------------------------------------------- through the pool


def _completion_answer(ids: list[int]) -> bytes:
    body = json.dumps({"model": "m", "policy_version": 0, "choices": [{
        "token_ids": ids, "finish_reason": "stop",
        "logprobs": {"token_logprobs": [-0.5] * len(ids)}}]}).encode()  # fmt: skip
    return _head("200 OK", f"Content-Length: {len(body)}") + body


class CompletionServer(ScriptedServer):
    """A backend at the socket: /health and /v1/policy_version answer well; /v1/completions
    answers ``completion`` (well-formed or not)."""

    def __init__(self, completion: bytes, close: bool) -> None:
        version = b'{"policy_version": 0}'
        routes = {
            "/health": (_head("200 OK", "Content-Length: 2") + b"{}", False),
            "/v1/policy_version": (_head("200 OK", f"Content-Length: {len(version)}") + version,
                                   False),
            "/v1/completions": (completion, close),
        }  # fmt: skip
        handler = type("H", (_Handler,), {"routes": routes})
        socketserver.ThreadingTCPServer.__init__(self, ("127.0.0.1", 0), handler)
        self.connections = 0
        self.port = int(self.server_address[1])


def serving(completion: bytes, close: bool = True) -> CompletionServer:
    srv = CompletionServer(completion, close)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.mark.parametrize("path", ["/length-not-a-number", "/chunk-size-bad", "/truncated-body"])
def test_a_malformed_backend_answer_fails_over_in_the_pool(path: str) -> None:
    bad, good = serving(MALFORMED[path][0]), serving(_completion_answer([7, 8, 2]), False)

    async def main() -> None:
        urls = [f"http://127.0.0.1:{bad.port}", f"http://127.0.0.1:{good.port}"]
        pool = BackendPool.from_urls(urls, timeout_s=10, health_interval_s=0, backend_wait_s=5)
        await pool.start()
        pool.route("r")  # the first rollout goes to the first backend: the malformed one
        assert pool.backend_of("r") == urls[0]
        out = await pool.complete("r", np.array([1, 2], dtype=np.uint32), max_tokens=4)
        assert out.token_ids.tolist() == [7, 8, 2] and out.backend == urls[1]
        assert pool.stats.failovers == 1 and pool.backend_of("r") == urls[1]
        bad_member = pool.members[0]
        assert not bad_member.healthy and "RemoteProtocolError" in bad_member.last_error
        await pool.aclose()

    try:
        run(main)
    finally:
        for srv in (bad, good):
            srv.shutdown()
            srv.server_close()


def test_a_malformed_backend_answer_is_a_clean_error_answer_not_a_500() -> None:
    tok = train_tokenizer()
    chat = ChatTemplate(tok.backend_tokenizer, CHAT_TEMPLATE,
                        special_tokens={"eos_token": "<|im_end|>"}, max_model_len=512)  # fmt: skip
    bad = serving(MALFORMED["/length-negative"][0])
    settings = ProxySettings(spool_dir=None, proxy_backends=[f"http://127.0.0.1:{bad.port}"],
                             proxy_backend_wait_s=0.3, proxy_health_interval_s=0)  # fmt: skip
    transport = MemoryTransport()
    recorder = Recorder(settings, transport=transport)
    app = create_app(settings, recorder=recorder, chat=chat)
    proxy = app.state.proxy

    async def main() -> None:
        await proxy.start()
        ro = proxy.rollouts.create(task_id="t", group_id="g")
        auth = {"Authorization": f"Bearer {proxy.auth.tokens.issue(ro.rollout_id)}"}
        ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://p")
        for path in ("/v1/chat/completions", "/v1/completions"):
            body = ok if "chat" in path else {"prompt": "hi", "max_tokens": 4}
            r = await client.post(path, json=body, headers=auth)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "backend_unavailable" and "RemoteProtocolError" in err["message"]
            assert r.headers["retry-after"] == "2"
        await proxy.stop()

    try:
        run(main)
        assert recorder.flush(10)
        events = [recorder.codec.decode(m.value) for m in transport.messages(recorder.topic)]
        errors = [e.body for e in events if isinstance(e.body, RolloutError)]
        assert [e.code for e in errors] == [503, 503]  # recorded, with the backend named
        assert {e.backend for e in errors} == {f"http://127.0.0.1:{bad.port}"}
    finally:
        recorder.close(5)
        bad.shutdown()
        bad.server_close()


def test_backend_errors_are_producer_errors() -> None:
    assert issubclass(Http1Error, BackendUnavailable)
    assert issubclass(BackendError, ProducerError)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
