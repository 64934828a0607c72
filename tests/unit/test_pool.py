"""The backend pool (producers/proxy/pool.py) over real CompletionBackends whose HTTP edge is an
in-process fake server (httpx.MockTransport): routing, failover, health, pause/drain/resume; and
the policy watcher that drives its weight updates, its Kafka edges in memory."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from rollstream.producers.proxy.backends import BackendRejected, CompletionBackend
from rollstream.producers.proxy.policy_watch import PolicyWatcher
from rollstream.producers.proxy.pool import BackendPool, NoBackendAvailable, PoolError, PoolPaused
from rollstream.schemas import Codec, CommonSettings, PolicyVersion
from rollstream.schemas.dlq import CODE_UNDECODABLE, HEADER_NAMES, read_headers


class FakeServer:
    """A vLLM-shaped reference server at the HTTP edge: completions, health, weights."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.alive = True
        self.status = 200  # answer completions with this status
        self.delay = 0.0
        self.version = 0
        self.fail_reload = False
        self.prompts: list[list[int]] = []
        self.reloads: list[tuple[str, int]] = []
        self.started = 0  # completions begun (before the delay)
        self.cut: asyncio.Event | None = None  # set by POST /pause?mode=abort
        self.max_tokens: list[int] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.alive:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/policy_version":
            return httpx.Response(200, json={"policy_version": self.version})
        if path == "/pause":
            assert request.url.params["mode"] == "abort"
            self.cut = self.cut or asyncio.Event()
            self.cut.set()
            await asyncio.sleep(0.01)  # the running batch ends
            return httpx.Response(200, json={})
        if path == "/resume":
            self.cut = None
            return httpx.Response(200, json={})
        body = json.loads(request.content or b"{}")
        if path == "/v1/load_weights":
            await asyncio.sleep(0.01)
            if self.fail_reload:
                return httpx.Response(500, json={"error": {"message": "disk full"}})
            self.version = body["version"]
            self.reloads.append((body["path"], body["version"]))
            return httpx.Response(200, json={"policy_version": self.version})
        assert path == "/v1/completions"
        self.started += 1
        self.cut = self.cut or asyncio.Event()
        try:  # a pause with mode=abort ends the generation now, with the token it has
            await asyncio.wait_for(self.cut.wait(), self.delay)
            ids = [7]
            self.prompts.append(body["prompt"])
            return httpx.Response(200, json={
                "model": "m", "policy_version": self.version,
                "choices": [{"token_ids": ids, "finish_reason": "abort",
                             "logprobs": {"token_logprobs": [-0.25]}}],
                "usage": {"prompt_tokens": len(body["prompt"])},
            })  # fmt: skip
        except TimeoutError:
            pass
        self.max_tokens.append(body.get("max_tokens"))
        if not self.alive:  # died while generating
            raise httpx.ReadError("connection reset", request=request)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": f"{self.status}"}})
        self.prompts.append(body["prompt"])
        ids = [7, 8, 2]
        return httpx.Response(200, json={
            "model": "m", "policy_version": self.version,
            "choices": [{"token_ids": ids, "finish_reason": "stop",
                         "logprobs": {"token_logprobs": [-0.5] * len(ids)}}],
            "usage": {"prompt_tokens": len(body["prompt"])},
        })  # fmt: skip


def make_pool(n: int = 2, **kw: Any) -> tuple[BackendPool, list[FakeServer]]:
    servers = [FakeServer(f"b{i}") for i in range(n)]
    backends = [
        CompletionBackend(
            f"http://{s.name}",
            s.name,
            http=httpx.AsyncClient(transport=httpx.MockTransport(s.handle)),
        )
        for s in servers
    ]
    kw.setdefault("health_interval_s", 0)  # tests drive health checks themselves
    return BackendPool(backends, **kw), servers


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 20))


def test_least_loaded_and_sticky() -> None:
    async def main() -> None:
        pool, servers = make_pool(2)
        await pool.start()
        for rid in ("r0", "r1", "r2", "r3"):
            await pool.complete(rid, [1, 2], max_tokens=4)
        assert [m.active for m in pool.members] == [2, 2]
        first = {rid: pool.backend_of(rid) for rid in ("r0", "r1", "r2", "r3")}
        for _ in range(3):  # later calls stay where the rollout started
            for rid in first:
                out = await pool.complete(rid, [1, 2, 7, 8, 2, 3], max_tokens=4)
                assert out.backend == first[rid]
        pool.release("r0")
        pool.release("r2")  # one slot freed on each, or two on one: the next goes to the emptier
        emptier = min(pool.members, key=lambda m: m.active).name
        await pool.complete("r4", [1], max_tokens=4)
        assert pool.backend_of("r4") == emptier
        assert sum(len(s.prompts) for s in servers) == 17
        await pool.aclose()

    run(main)


def test_failover_moves_the_rollout_and_retries_the_call() -> None:
    async def main() -> None:
        pool, (a, b) = make_pool(2)
        await pool.start()
        await pool.complete("r", [1], max_tokens=4)
        home = pool.backend_of("r")
        dead, other = (a, b) if home == "b0" else (b, a)
        dead.alive = False
        out = await pool.complete("r", [1, 7, 8, 2, 5], max_tokens=4)
        assert out.backend == other.name and pool.backend_of("r") == other.name
        assert other.prompts[-1] == [1, 7, 8, 2, 5]  # the same call, retried
        st = pool.stats
        assert (st.failovers, st.moved, st.completed) == (1, 1, 2)
        dead_member = next(m for m in pool.members if m.name == dead.name)
        assert not dead_member.healthy and dead_member.active == 0
        dead.alive = True  # comes back: readmitted by the next health check
        await pool.check_health()
        assert dead_member.healthy
        await pool.aclose()

    run(main)


def test_dies_mid_generation_then_retried_elsewhere() -> None:
    async def main() -> None:
        pool, (a, b) = make_pool(2)
        await pool.start()
        a.delay = b.delay = 0.2
        calls = [
            asyncio.create_task(pool.complete(f"r{i}", [i + 1], max_tokens=4)) for i in range(4)
        ]
        await asyncio.sleep(0.05)
        a.alive = False  # its two calls are in flight
        outs = await asyncio.gather(*calls)
        assert {o.backend for o in outs} == {"b1"} and len(b.prompts) == 4
        assert pool.stats.failovers == 2
        await pool.aclose()

    run(main)


def test_no_backend_then_one_returns() -> None:
    async def main() -> None:
        pool, (a,) = make_pool(1, backend_wait_s=0.3)
        await pool.start()
        a.alive = False
        with pytest.raises(NoBackendAvailable) as err:
            await pool.complete("r", [1], max_tokens=4)
        assert err.value.last_error is not None
        pool.backend_wait_s = 5.0
        call = asyncio.create_task(pool.complete("r", [1], max_tokens=4))
        await asyncio.sleep(0.1)
        a.alive = True
        assert (await call).backend == "b0"
        await pool.aclose()

    run(main)


def test_rejected_calls_are_not_retried() -> None:
    async def main() -> None:
        pool, (a, b) = make_pool(2)
        await pool.start()
        a.status = b.status = 400
        with pytest.raises(BackendRejected):
            await pool.complete("r", [1], max_tokens=4)
        assert pool.stats.dispatched == 1 and all(m.healthy for m in pool.members)
        await pool.aclose()

    run(main)


def test_pause_holds_calls_until_resume_and_drain_waits() -> None:
    async def main() -> None:
        pool, (a,) = make_pool(1, pause_wait_s=5.0)
        await pool.start()
        a.delay = 0.1
        inflight = asyncio.create_task(pool.complete("r0", [1], max_tokens=4))
        await asyncio.sleep(0.02)
        pool.pause()
        held = [asyncio.create_task(pool.complete(f"r{i}", [1], max_tokens=4)) for i in range(1, 4)]
        assert await pool.drain(2.0)  # the call in flight finished
        assert inflight.done() and pool.inflight == 0
        started = a.started
        await asyncio.sleep(0.1)
        assert a.started == started == 1 and not any(t.done() for t in held)
        pool.resume()
        await asyncio.gather(*held)
        assert a.started == 4 and pool.stats.paused_waits == 3
        await pool.aclose()

    run(main)


def test_pause_longer_than_the_wait_answers_paused() -> None:
    async def main() -> None:
        pool, _ = make_pool(1, pause_wait_s=0.05, retry_after_s=3)
        await pool.start()
        pool.pause()
        with pytest.raises(PoolPaused) as err:
            await pool.complete("r", [1], max_tokens=4)
        assert err.value.retry_after_s == 3 and pool.stats.paused_rejects == 1
        await pool.aclose()

    run(main)


def test_update_weights_pauses_drains_reloads_resumes() -> None:
    async def main() -> None:
        pool, (a, b) = make_pool(2, pause_wait_s=5.0)
        await pool.start()
        a.delay = b.delay = 0.1
        before = [asyncio.create_task(pool.complete(f"r{i}", [1], max_tokens=4)) for i in range(4)]
        await asyncio.sleep(0.02)
        update = asyncio.create_task(pool.update_weights("/ckpt/3", 3))
        await asyncio.sleep(0.02)
        after = [asyncio.create_task(pool.complete(f"r{i}", [1, 7, 8, 2], max_tokens=4))
                 for i in range(4)]  # fmt: skip
        result = await update
        assert result["reloaded"] == 2 and result["failed"] == {}
        old, new = await asyncio.gather(*before), await asyncio.gather(*after)
        assert {o.policy_version for o in old} == {0}  # finished before the reload
        assert {o.policy_version for o in new} == {3}  # held until after it
        assert a.reloads == b.reloads == [("/ckpt/3", 3)] and pool.policy_version == 3
        assert not pool.paused
        await pool.aclose()

    run(main)


def test_a_backend_that_misses_an_update_reloads_before_serving() -> None:
    async def main() -> None:
        pool, (a, b) = make_pool(2)
        await pool.start()
        b.fail_reload = True
        result = await pool.update_weights("/ckpt/1", 1)
        assert result["reloaded"] == 1 and "b1" in result["failed"]
        assert [m.healthy for m in pool.members] == [True, False]
        b.fail_reload = False
        await pool.check_health()  # answers again: reloaded first, then readmitted
        assert b.reloads == [("/ckpt/1", 1)] and pool.members[1].healthy
        a.fail_reload = b.fail_reload = True
        with pytest.raises(PoolError):
            await pool.update_weights("/ckpt/2", 2)
        assert not pool.paused  # resumed even when the update failed
        # nobody loaded it (a bad path): every backend still serves version 1, none taken out,
        # and the health loop does not chase the bad path
        assert [m.healthy for m in pool.members] == [True, True] and pool.policy_version == 1
        a.fail_reload = b.fail_reload = False
        await pool.check_health()
        assert a.reloads == [("/ckpt/1", 1)] and b.reloads == [("/ckpt/1", 1)]
        out = await pool.complete("r9", [1], max_tokens=2)
        assert out.policy_version == 1
        await pool.aclose()

    run(main)


def test_pool_needs_unique_backends() -> None:
    with pytest.raises(PoolError):
        BackendPool([])
    b = CompletionBackend("http://x", "same")
    with pytest.raises(PoolError):
        BackendPool([b, CompletionBackend("http://y", "same")])


# --------------------------------------------------------------------------- the lean transport


class Http1Server:
    """A real local HTTP/1.1 server (asyncio) with scripted behaviours per path."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                path = head.split(b" ")[1]
                if path == b"/chunked":
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")  # fmt: skip
                elif path == b"/close":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
                    )
                    await writer.drain()
                    writer.close()
                    return
                elif path == b"/slow":
                    await asyncio.sleep(1.0)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                else:
                    out = json.dumps({"echo": body.decode(), "path": path.decode()}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n" % len(out) + out)  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def test_http1_transport_keep_alive_chunked_and_errors() -> None:
    from rollstream.producers.proxy.http1 import Http1Transport

    async def main() -> None:
        srv = Http1Server()
        await srv.start()
        base = f"http://127.0.0.1:{srv.port}"
        async with httpx.AsyncClient(transport=Http1Transport(), timeout=5) as client:
            for i in range(5):  # one connection, reused
                r = await client.post(f"{base}/v1/completions", json={"i": i})
                assert r.status_code == 200 and json.loads(r.json()["echo"]) == {"i": i}
            assert srv.connections == 1
            r = await client.get(f"{base}/chunked")
            assert r.text == "hello world"
            r = await client.get(f"{base}/close")  # the server closes: next request reconnects
            assert r.text == "ok"
            await client.get(f"{base}/x")
            assert srv.connections == 2
            with pytest.raises(httpx.ReadTimeout):
                await client.get(f"{base}/slow", timeout=httpx.Timeout(5, read=0.1))
            with pytest.raises(httpx.ConnectError):
                await client.get(f"http://127.0.0.1:{free_port()}/health")
        # a reused connection that the server dropped while idle: resent on a fresh one
        async with httpx.AsyncClient(transport=Http1Transport(), timeout=5) as client:
            srv2 = Http1Server()
            await srv2.start()
            url = f"http://127.0.0.1:{srv2.port}/a"
            await client.get(url)
            transport = client._transport
            assert isinstance(transport, Http1Transport)
            for conns in transport._idle.values():  # the server side goes away
                for conn in conns:
                    conn.writer.transport.abort()
            await asyncio.sleep(0.05)
            assert (await client.get(url)).status_code == 200

    run(main)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- the policy watcher


class Message:
    """A consumed record, as confluent-kafka's Message shows it."""

    def __init__(self, value: bytes | None, key: bytes | None, offset: int) -> None:
        self._value, self._key, self._offset = value, key, offset

    def value(self) -> bytes | None:
        return self._value

    def key(self) -> bytes | None:
        return self._key

    def topic(self) -> str:
        return "policy.versions"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def error(self) -> None:
        return None


class ListConsumer:
    """The consumer edge in memory: hands out its messages, then nothing."""

    def __init__(self, messages: list[Message]) -> None:
        self.messages, self.closed = list(messages), False

    def poll(self, timeout: float) -> Message | None:
        if self.messages:
            return self.messages.pop(0)
        time.sleep(min(timeout, 0.01))
        return None

    def close(self) -> None:
        self.closed = True


class ListProducer:
    """The producer edge in memory: keeps what it is asked to send and acknowledges it."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self._pending: list[Any] = []

    def produce(self, topic: str, **kw: Any) -> None:
        self.sent.append({"topic": topic, **kw})
        self._pending.append(kw["on_delivery"])

    def flush(self, timeout: float) -> int:
        while self._pending:
            self._pending.pop(0)(None, None)
        return 0


def test_policy_watcher_applies_versions_and_dead_letters_undecodable_records() -> None:
    settings = CommonSettings(namespace="unit")

    async def main() -> None:
        pool, (a, b) = make_pool(2)
        await pool.start()
        good = Codec().encode(PolicyVersion(2, "/ckpt/2", 20, 1_735_689_600_000_000))
        consumer = ListConsumer([Message(b"not avro", b"k", 5), Message(good, None, 6)])
        producer = ListProducer()
        watcher = PolicyWatcher(
            settings,
            asyncio.get_running_loop(),
            pool.update_weights,
            lambda: pool.policy_version,
            poll_s=0.01,
            consumer=consumer,
            producer=producer,
        ).start()
        while pool.policy_version != 2:  # the bad record came first: dead-lettered by now
            await asyncio.sleep(0.01)
        await asyncio.to_thread(watcher.stop)
        assert consumer.closed and watcher.applied == [2] and watcher.dead_letters == 1
        assert a.reloads == b.reloads == [("/ckpt/2", 2)]
        (sent,) = producer.sent  # the bad record, unchanged, to the DLQ topic
        dlq = settings.topics().dlq
        assert (sent["topic"], sent["key"], sent["value"]) == (dlq, b"k", b"not avro")
        assert [name for name, _ in sent["headers"]] == list(HEADER_NAMES)
        headers = read_headers(sent["headers"])
        assert headers["stage"] == "policy_watcher" and headers["code"] == CODE_UNDECODABLE
        origin = (
            headers["original_topic"],
            headers["original_partition"],
            headers["original_offset"],
        )
        assert origin == ("policy.versions", "0", "5")
        assert headers["reason"] and headers["processor"].startswith("rollstream-proxy-policy-")
        await pool.aclose()

    run(main)


def test_interrupting_update_cuts_the_generations_and_continues_them() -> None:
    """mode interrupt: the update waits for no generation; a cut call goes on with its prompt
    extended by the token it had and max_tokens reduced by it, on the new weights, and its
    Completion says which tokens are of which version. An abort the pool did not cause comes
    back as it is."""

    async def main() -> None:
        pool, (a, b) = make_pool(2, pause_wait_s=5.0, weight_update_mode="interrupt")
        await pool.start()
        a.delay = b.delay = 2.0
        calls = [asyncio.create_task(pool.complete(f"r{i}", [1, 2], max_tokens=4))
                 for i in range(2)]  # fmt: skip
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        a.delay = b.delay = 0.0
        result = await pool.update_weights("/ckpt/3", 3)
        assert time.monotonic() - t0 < 1.0  # it did not wait for the 2 s generations
        assert result["mode"] == "interrupt" and result["reloaded"] == 2
        for out in await asyncio.gather(*calls):
            assert out.token_ids.tolist() == [7, 7, 8, 2] and out.finish_reason == "stop"
            assert out.logprobs.tolist() == [-0.25, -0.5, -0.5, -0.5]
            assert out.parts == ((1, 0), (3, 3)) and out.policy_version == 3
        assert sorted(a.prompts + b.prompts) == [[1, 2], [1, 2], [1, 2, 7], [1, 2, 7]]
        assert a.max_tokens + b.max_tokens == [3, 3]
        assert pool.stats.interrupted == 2 and not pool.paused
        # the backend aborted by someone else (no update of the pool's): returned as it is
        a.delay = b.delay = 2.0
        call = asyncio.create_task(pool.complete("r0", [1], max_tokens=4))
        await asyncio.sleep(0.05)
        for s in (a, b):
            if s.cut is not None:
                s.cut.set()
        out = await call
        assert out.finish_reason == "abort" and out.parts == () and out.token_ids.tolist() == [7]
        with pytest.raises(PoolError):
            await pool.update_weights("/ckpt/4", 4, "later")  # type: ignore[arg-type]
        with pytest.raises(PoolError):
            make_pool(1, weight_update_mode="sometimes")
        await pool.aclose()

    run(main)
