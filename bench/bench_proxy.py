"""What the recording proxy adds to a model call: latency per call and throughput, proxied vs
direct, against the same instant backend, with the LiteLLM proxy as the anchor, in one run.

Processes (each its own interpreter, so the proxy is what is measured):
  fake backend   starlette + uvicorn; answers /v1/chat/completions (direct, LiteLLM) and the
                 token-id /v1/completions (our proxy) at once with the same fixed reply, or
                 after --backend-ms (a model's time per call; calls overlap, as in a batching
                 inference server), to see where the proxy stops being the bottleneck;
                 or, with --backend-server reference, `rollstream serve-model` with the tiny
                 torch model (greedy, 16 tokens): direct and LiteLLM send it chat, the proxy
                 token ids
  our proxy      rollstream's proxy (uvicorn, one worker) in front of the fake backend; every
                 call is rendered, tokenized, recorded as an LlmCall (in-memory transport, or a
                 real broker with --bootstrap) and answered; its hop to the backend uses
                 --http-client (ProxySettings.proxy_http_client); with a list
                 (http1,aiohttp,httpx) one proxy per client, measured side by side: the first
                 is "proxy", the others "proxy_<client>"
  baseline       with --baseline-rev REV: the same proxy process built from that git revision
                 (git archive into a temp dir, put first on PYTHONPATH), measured in the same
                 run, so before/after compare under the same machine load
  relay          --stream: the floor of any proxy here, a byte relay in its own process (asyncio
                 protocols on uvloop, no HTTP parsing, nothing recorded) in front of the fake
                 backend's direct routes: what one more process and loopback hop add
  LiteLLM        `litellm --config` (one worker) in front of the same fake backend, if installed
  load           64 streams (raw asyncio HTTP/1.1 keep-alive, one connection each), each a
                 multi-turn chat (the reply appended, a new user turn; reset after 8 turns)

Phases, per round and target (direct, proxy, baseline, litellm): "closed" (each stream sends as
soon as its last answer came: saturation throughput and latency under it) and "paced" (--rate
requests/s in total, below every target's capacity: the per-call overhead without queueing).
Medians over rounds. added_* = proxied - direct, per percentile.

The hop alone ("hop_<client>_*", each client of --http-client, every round): in this process,
CompletionBackend.complete (the proxy's own per-call code: orjson, the client, the answer
parsed) sends --hop-calls completions one after another to the fake backend; the median latency
(us) and this process's CPU per call (us), and each client's ratio to the first one's.

Streaming (--stream): the fake backend streams its reply one token per chunk, --token-ms apart
on its own clock (token i is due (i + 1) x token-ms after the request, as a model's decode loop
produces tokens whatever its HTTP layer does, so the cost of encoding each API's chunks does
not add up over the reply): vLLM's text_completion chunks on /v1/completions for the proxy;
OpenAI chat chunks and Anthropic Messages events on its own /v1/chat/completions and
/v1/messages for direct calls;
and 64 streams call with ``stream: true``, closed loop and then paced (--stream-rate calls/s in
total); with --backend-server reference (chat only) the tiny model streams instead, greedy, up
to 64 tokens (direct calls make the server render the chat template; the proxy sends ids).
Per call: the time to the first content token and to the last event ([DONE] /
message_stop), for the chat API and the Messages API, direct and through the proxy in the same
run, and through the relay ("relay_<api>": the floor); added_* = proxied (or relayed) - direct,
per percentile and phase; cpu_ms_per_call: the backend's and the proxy's CPU together,
own_cpu_ms_per_call: the proxy process's alone. With --baseline-rev the proxy of that revision
is measured too ("baseline_<api>"), and proxy_<api>_own_cpu_over_baseline is the ratio of the
two proxies' own CPU per call. With --unrecorded the same proxy with its LlmCalls skipped is
measured too ("unrecorded_<api>", not a mode of the proxy): what recording each call, which
the proxy does before the stream's last event so that a call it cannot record is an error
event and not a finished answer, adds to the last token.
LiteLLM (if it starts) is measured on the chat API the same way.

    .venv/bin/python bench/bench_proxy.py --stream [--quick] [--token-ms 20] [--api chat,messages]
        [--baseline-rev HEAD] [--unrecorded] [--backend-server reference --api chat]

    .venv/bin/python bench/bench_proxy.py [--quick] [--streams 64] [--rate 200]
        [--litellm PATH/TO/litellm] [--bootstrap HOST:PORT] [--baseline-rev HEAD]
        [--backend-ms 0] [--backend-server fake|reference]
        [--http-client http1|aiohttp|httpx|http1,aiohttp,httpx] [--hop-calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar, cast

import httpx

ROOT = Path(__file__).resolve().parents[1]
REPLY = "Sure, here is a short answer."
ADMIN = "bench-admin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- server modes


def serve_fake(port: int, reply_ids: list[int], service_ms: float = 0.0) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    lps = [-0.5] * len(reply_ids)
    completion = json.dumps({
        "id": "cmpl-1", "object": "text_completion", "model": "fake", "policy_version": 0,
        "choices": [{"index": 0, "text": REPLY, "token_ids": reply_ids, "finish_reason": "stop",
                     "logprobs": {"token_logprobs": lps}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": len(reply_ids)},
    }).encode()  # fmt: skip
    chat = json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "fake",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": REPLY}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": len(reply_ids), "total_tokens": 9},
    }).encode()  # fmt: skip

    def answer(payload: bytes) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            await request.body()
            if service_ms:  # a model's time per call; calls overlap, as in a batching server
                await asyncio.sleep(service_ms / 1000)
            return Response(payload, media_type="application/json")

        return endpoint

    completions, chat_completions = answer(completion), answer(chat)
    pieces = json.loads(os.environ.get("BENCH_REPLY_PIECES", "[]")) or [REPLY]
    step = max(service_ms, 0.0) / 1000

    async def tokens(events: Callable[[int, bool], bytes], end: bytes) -> Any:
        # a model's time per token (the first: its prefill), on the model's own clock: token i
        # is due (i + 1) x step after the request, however long the chunks before it took to
        # encode and send (a decode loop does not wait for its HTTP layer)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(len(reply_ids)):
            await asyncio.sleep(max(0.0, start + (i + 1) * step - loop.time()))
            yield events(i, i == len(reply_ids) - 1)
        yield end

    def vllm_chunk(i: int, last: bool) -> bytes:
        t = reply_ids[i]
        choice = {"index": 0, "text": pieces[i % len(pieces)], "token_ids": [t],
                  "logprobs": {"token_logprobs": [-0.5], "tokens": [f"token_id:{t}"],
                               "top_logprobs": [{f"token_id:{t}": -0.5}]},
                  "finish_reason": "stop" if last else None, "stop_reason": None}  # fmt: skip
        chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "fake",
                 "choices": [choice], "policy_version": 0}  # fmt: skip
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def chat_chunk(i: int, last: bool) -> bytes:
        delta = {"content": pieces[i % len(pieces)]} if not last else {}
        if i == 0:
            delta["role"] = "assistant"
        chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                 "model": "fake", "choices": [{"index": 0, "delta": delta,
                 "finish_reason": "stop" if last else None}]}  # fmt: skip
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def message_event(i: int, last: bool) -> bytes:
        out = b""
        if i == 0:
            msg: dict[str, Any] = {
                "id": "msg_1", "type": "message", "role": "assistant", "model": "fake",
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 1, "output_tokens": 0}}  # fmt: skip
            out += b"event: message_start\ndata: " + json.dumps(
                {"type": "message_start", "message": msg}).encode() + b"\n\n"  # fmt: skip
            start = {"type": "content_block_start", "index": 0,
                     "content_block": {"type": "text", "text": ""}}  # fmt: skip
            out += b"event: content_block_start\ndata: " + json.dumps(start).encode() + b"\n\n"
        if not last:
            delta = {"type": "content_block_delta", "index": 0,
                     "delta": {"type": "text_delta", "text": pieces[i % len(pieces)]}}  # fmt: skip
            return (
                out + b"event: content_block_delta\ndata: " + json.dumps(delta).encode() + b"\n\n"
            )
        stop = {"type": "message_delta", "delta": {"stop_reason": "end_turn",
                "stop_sequence": None}, "usage": {"output_tokens": len(reply_ids)}}  # fmt: skip
        block_stop = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}'
        return (
            out
            + block_stop
            + b"\n\nevent: message_delta\ndata: "
            + json.dumps(stop).encode()
            + (b"\n\n")
        )

    done = b"data: [DONE]\n\n"
    message_stop = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'

    def streaming(plain: Callable[[Request], Awaitable[Response]],
                  events: Callable[[int, bool], bytes], end: bytes) -> Any:  # fmt: skip
        async def endpoint(request: Request) -> Response:
            body = json.loads(await request.body() or b"{}")
            if not body.get("stream"):
                return await plain(request)
            return StreamingResponse(tokens(events, end), media_type="text/event-stream")

        return endpoint

    completions = streaming(completions, vllm_chunk, done)
    chat_completions = streaming(chat_completions, chat_chunk, done)
    messages = streaming(answer(b"{}"), message_event, message_stop)

    async def ok(request: Request) -> Response:
        return Response(b'{"policy_version": 0}', media_type="application/json")

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/health", ok), Route("/v1/policy_version", ok),
    ])  # fmt: skip
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_proxy(
    port: int,
    backend: str,
    model_path: str,
    bootstrap: str | None,
    http_client: str | None,
    record: bool = True,
) -> None:
    """The proxy as `rollstream proxy` runs it, recording to SinkTransport (or --bootstrap's
    broker). ``record=False`` (--unrecorded's target, not a mode of the proxy): each call's
    LlmCall is skipped, to show what recording it before the stream's end costs."""
    import uvicorn

    from rollstream.producers import Recorder

    try:
        from rollstream.producers.proxy.app import ProxySettings, create_app
    except ImportError:  # a --baseline-rev from before the rooms: producers/proxy.py
        old = importlib.import_module("rollstream.producers.proxy")
        ProxySettings, create_app = old.ProxySettings, old.create_app

    kw: dict[str, Any] = {"kafka_bootstrap": bootstrap} if bootstrap else {}
    if http_client:
        kw["proxy_http_client"] = http_client
    if "proxy_rate_limit_rps" in ProxySettings.model_fields:  # closed-loop streams: no limit
        kw["proxy_rate_limit_rps"] = 0
    settings = ProxySettings(
        proxy_backends=[backend], proxy_model_path=Path(model_path), proxy_api_keys=[ADMIN],
        spool_dir=None, proxy_port=port, namespace=f"bench{os.getpid()}", **kw,
    )  # fmt: skip
    if bootstrap:
        from rollstream.adapters.topics import ensure_topics

        ensure_topics(settings)
        recorder = Recorder(settings)
    else:
        recorder = Recorder(settings, transport=SinkTransport())
    app = create_app(settings, recorder=recorder)
    if not record:
        from rollstream.producers.proxy.service import Proxy

        Proxy._record = lambda *_, **__: None
    try:  # as `rollstream proxy` does (a --baseline-rev from before it has none)
        from rollstream.producers.proxy.app import settle_heap
    except ImportError:
        pass
    else:
        settle_heap()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_relay(port: int, backend: str) -> None:
    """The floor of any proxy here: a process that only copies bytes between each client
    connection and a connection of its own to the backend (asyncio protocols on uvloop, no HTTP
    parsing, nothing recorded). What it adds over direct is what one more process and one more
    loopback hop cost on this machine, before a proxy does any work of its own."""
    import uvloop

    host, _, bport = backend.removeprefix("http://").partition(":")

    class Upstream(asyncio.Protocol):
        def __init__(self, client: asyncio.Transport) -> None:
            self.client = client

        def data_received(self, data: bytes) -> None:
            self.client.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.client.close()

    class Client(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass
            self.upstream: asyncio.Transport | None = None
            self.pending: list[bytes] = []
            asyncio.get_running_loop().create_task(self.connect())

        async def connect(self) -> None:
            loop = asyncio.get_running_loop()
            try:
                up, _ = await loop.create_connection(
                    lambda: Upstream(self.transport), host, int(bport)
                )
            except OSError:
                self.transport.close()
                return
            self.upstream = cast(asyncio.Transport, up)
            for data in self.pending:
                up.write(data)
            self.pending.clear()

        def data_received(self, data: bytes) -> None:
            if self.upstream is None:
                self.pending.append(data)
            else:
                self.upstream.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.upstream is not None:
                self.upstream.close()

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Client, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(serve())


class SinkTransport:
    """A broker that acknowledges every record as it is produced and keeps only counts: the
    events are built, encoded and handed over exactly as with Kafka, without a Python broker
    (MemoryTransport) competing for the proxy's interpreter. --bootstrap uses a real broker."""

    def __init__(self) -> None:
        self.records = self.bytes = 0
        self._acks: deque[Any] = deque()  # produce (any thread) appends, poll pops: no lost ack

    def produce(self, topic: str, key: bytes, value: bytes, on_delivery: Any, *,
                timestamp_ms: int | None = None) -> None:  # fmt: skip
        self.records += 1
        self.bytes += len(value)
        self._acks.append(on_delivery)

    def poll(self, timeout: float = 0.0) -> int:
        n = 0
        while self._acks:
            self._acks.popleft()(None, None)  # (error, message), as the Kafka client reports
            n += 1
        if not n and timeout > 0:
            time.sleep(timeout)
        return n

    def flush(self, timeout: float) -> int:
        self.poll()
        return 0

    def describe(self, err: Any) -> Any:
        raise AssertionError(f"SinkTransport never fails a delivery, got {err!r}")

    def purge(self) -> None:
        self._acks.clear()

    def reachable(self, topic: str, timeout: float) -> bool:
        return True

    def delivered(self, topic: str, since_ms: int, digests: set[bytes], timeout: float) -> None:
        return None

    def close(self) -> None:
        pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def baseline_tree(rev: str, work: Path) -> Path:
    """The rollstream packages of git revision ``rev`` under ``work``; returns the directory to
    put first on PYTHONPATH (``rollstream/<package>`` -> the revision's top-level folders)."""
    src, pp = work / "baseline-src", work / "baseline-pp"
    src.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    (pp / "rollstream").mkdir(parents=True)
    for name in ("schemas", "adapters", "producers", "inference", "streams", "consumers", "infra"):
        if (src / name).is_dir():  # older revisions lack some packages
            (pp / "rollstream" / name).symlink_to(src / name)
    return pp


def start_backend(
    kind: str,
    port: int,
    mpath: Path,
    chat: Any,
    reply_ids: list[int],
    service_ms: float,
    work: Path,
) -> subprocess.Popen[bytes]:
    """``fake``: this script's fake backend (the fixed reply, after ``service_ms``, per token
    when streamed); ``reference``: `rollstream serve-model` with the tiny model, answering
    both APIs, and every load stream greedy (the same tokens whichever way in)."""
    if kind == "reference":
        cli = str(Path(sys.executable).with_name("rollstream"))
        env = {**os.environ, "ROLLSTREAM_MODEL_NAME": "fake"}  # the name clients ask for
        Stream.extra = {"temperature": 0}
        return spawn([cli, "serve-model", "--port", str(port), "--model", str(mpath)],
                     work / "fake.log", env)  # fmt: skip
    pieces = [chat.decode([t]) for t in reply_ids]  # chat: the model's ChatTemplate
    env = {**os.environ, "BENCH_REPLY_PIECES": json.dumps(pieces)}
    return spawn([sys.executable, str(Path(__file__).resolve()), "--serve-fake", str(port),
                  "--reply-ids", ",".join(map(str, reply_ids)), "--backend-ms", str(service_ms)],
                 work / "fake.log", env)  # fmt: skip


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


# --------------------------------------------------------------------------- load


class Stream:
    """One keep-alive HTTP/1.1 connection playing a multi-turn chat."""

    extra: ClassVar[dict[str, Any]] = {}  # more body fields for every call

    def __init__(self, host: str, port: int, path: str, token: str, index: int) -> None:
        self.host, self.port, self.path, self.token, self.index = host, port, path, token, index
        self.turn = 0
        self.messages: list[dict[str, Any]] = []
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def body(self) -> bytes:
        if self.turn % 8 == 0:
            self.messages = [
                {"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": f"Question {self.index}: what is up?"},
            ]
        return json.dumps({"model": "fake", "messages": self.messages, "max_tokens": 16,
                           **self.extra}).encode()  # fmt: skip

    async def call(self) -> float:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        body = self.body()
        head = (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Authorization: Bearer {self.token}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        t0 = time.perf_counter()
        self.writer.write(head + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        status = int(raw[9:12])
        headers = raw.decode("latin-1").lower()
        if "transfer-encoding: chunked" in headers:
            payload = b""
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                payload += await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            length = int(headers.split("content-length:")[1].split("\r\n")[0])
            payload = await self.reader.readexactly(length)
        elapsed = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {payload[:300]!r}")
        reply = json.loads(payload)["choices"][0]["message"]["content"]  # what came back
        self.messages += [{"role": "assistant", "content": reply},
                          {"role": "user", "content": f"And then ({self.turn})?"}]  # fmt: skip
        self.turn += 1
        return elapsed

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def run_phase(streams: list[Stream], duration: float, rate: float | None) -> dict[str, Any]:
    lat: list[float] = []
    stop = time.perf_counter() + duration
    interval = len(streams) / rate if rate else 0.0

    async def loop(s: Stream, offset: float) -> None:
        nxt = time.perf_counter() + offset
        while True:
            if interval:
                delay = nxt - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                nxt += interval
            if time.perf_counter() >= stop:
                return
            lat.append(await s.call())

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(s, i * interval / len(streams)) for i, s in enumerate(streams)))
    wall = time.perf_counter() - t0
    lat.sort()
    n = len(lat)
    return {"n": n, "rps": n / wall, "p50_ms": 1000 * lat[n // 2],
            "p99_ms": 1000 * lat[min(n - 1, int(n * 0.99))]}  # fmt: skip


def make_streams(target: str, port: int, rollouts: list[dict[str, Any]], n: int) -> list[Stream]:
    if target.startswith("proxy") or target == "baseline":
        return [Stream("127.0.0.1", port, f"/rollouts/{r['rollout_id']}/v1/chat/completions",
                       r["token"], i) for i, r in enumerate(rollouts[:n])]  # fmt: skip
    return [Stream("127.0.0.1", port, "/v1/chat/completions", "sk-bench", i) for i in range(n)]


async def hop(client: str, url: str, calls: int) -> tuple[float, float]:
    """(median latency in us, this process's CPU in us per call) of ``calls`` completions sent
    one after another by the proxy's own backend code over ``client``."""
    import numpy as np

    from rollstream.producers.proxy.pool import BackendPool

    pool = BackendPool.from_urls([url], http_client=client, timeout_s=30, health_interval_s=0)
    backend = pool.members[0].backend
    prompt = np.arange(1, 301, dtype=np.uint32)  # a 300-token prompt
    for _ in range(50):  # connections and caches warm
        await backend.complete(prompt, max_tokens=16)
    lat = []
    cpu0 = time.process_time()
    for _ in range(calls):
        t0 = time.perf_counter()
        await backend.complete(prompt, max_tokens=16)
        lat.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu0) / calls
    await pool.aclose()
    return 1e6 * statistics.median(lat), 1e6 * cpu


# --------------------------------------------------------------------------- streaming


class SseCall(Stream):
    """One keep-alive connection playing a multi-turn chat with ``stream: true``, over the
    chat API or the Messages API (``api``): each call's (time to first token, time to last)."""

    def __init__(self, host: str, port: int, path: str, token: str, index: int, api: str) -> None:
        super().__init__(host, port, path, token, index)
        self.api = api

    def body(self) -> bytes:
        if self.turn % 8 == 0:
            self.messages = [{"role": "user", "content": f"Question {self.index}: what is up?"}]
        body: dict[str, Any] = {"model": "fake", "messages": self.messages, "max_tokens": 64,
                                "stream": True, **self.extra}  # fmt: skip
        if self.api == "messages":
            body["system"] = "You are a concise assistant."
        else:
            body["messages"] = [{"role": "system", "content": "You are a concise assistant."},
                                *self.messages]  # fmt: skip
        return json.dumps(body).encode()

    async def call_stream(self) -> tuple[float, float]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        reader = self.reader
        assert reader is not None
        body = self.body()
        auth = "x-api-key" if self.api == "messages" else "Authorization"
        value = self.token if self.api == "messages" else f"Bearer {self.token}"
        head = (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}\r\n{auth}: {value}\r\n"
                "anthropic-version: 2023-06-01\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        t0 = time.perf_counter()
        self.writer.write(head + body)
        raw = await reader.readuntil(b"\r\n\r\n")
        status = int(raw[9:12])
        if b"chunked" not in raw.lower():
            length = int(raw.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            raise RuntimeError(f"HTTP {status}: {(await reader.readexactly(length))[:300]!r}")
        first = 0.0
        text, buf = [], b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            buf += data[:-2]
            *events, buf = buf.split(b"\n\n")
            for event in events:
                line = event[event.find(b"data: ") + 6 :]
                if line == b"[DONE]" or not line.startswith(b"{"):
                    continue
                obj = json.loads(line)
                if self.api == "messages":
                    piece = (obj.get("delta") or {}).get("text") or ""
                else:
                    piece = (obj["choices"][0]["delta"].get("content") or "") if obj.get(
                        "choices") else ""  # fmt: skip
                if piece:
                    first = first or time.perf_counter() - t0
                    text.append(piece)
        last = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"HTTP {status}")
        self.messages += [{"role": "assistant", "content": "".join(text)},
                          {"role": "user", "content": f"And then ({self.turn})?"}]  # fmt: skip
        self.turn += 1
        return first, last


async def run_stream_phase(
    calls: list[SseCall], duration: float, rate: float | None = None
) -> dict[str, Any]:
    """Closed loop (``rate`` None: each stream calls again as soon as its answer ended) or
    paced (``rate`` calls/s in total, spread over the streams)."""
    firsts: list[float] = []
    lasts: list[float] = []
    stop = time.perf_counter() + duration
    interval = len(calls) / rate if rate else 0.0

    async def loop(c: SseCall, offset: float) -> None:
        nxt = time.perf_counter() + offset
        while True:
            if interval:
                if (delay := nxt - time.perf_counter()) > 0:
                    await asyncio.sleep(delay)
                nxt += interval
            if time.perf_counter() >= stop:
                return
            f, la = await c.call_stream()
            firsts.append(f)
            lasts.append(la)

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(c, i * interval / len(calls)) for i, c in enumerate(calls)))
    wall = time.perf_counter() - t0
    out: dict[str, Any] = {"n": len(lasts), "rps": len(lasts) / wall}
    for name, xs in (("first", sorted(firsts)), ("last", sorted(lasts))):
        out[f"{name}_p50_ms"] = 1000 * xs[len(xs) // 2]
        out[f"{name}_p99_ms"] = 1000 * xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    return out


def stream_bench(args: argparse.Namespace) -> None:
    """--stream: time to first and to last token, direct vs proxy (vs LiteLLM), per API."""
    duration = args.duration or (2.0 if args.quick else 10.0)
    rounds = args.rounds or (1 if args.quick else 3)
    apis = [a.strip() for a in args.api.split(",") if a.strip()]
    if args.backend_server == "reference" and apis != ["chat"]:
        raise SystemExit("--stream --backend-server reference: --api chat (it serves no Messages)")
    deadline = time.monotonic() + (27.0 if args.quick else 600.0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t_start = time.monotonic()
        fport, pport = free_port(), free_port()
        lite, lport, lite_error = start_litellm(args.litellm, fport, work)
        mpath = model_dir(args.model_path)
        from rollstream.producers.proxy.chat import ChatTemplate

        chat = ChatTemplate.from_dir(mpath)
        reply_ids = [*chat.encode(REPLY).tolist(), chat.eos_id]
        me = [sys.executable, str(Path(__file__).resolve())]
        fake = start_backend(
            args.backend_server, fport, mpath, chat, reply_ids, args.token_ms, work
        )
        ours: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}  # kind -> (port, process)

        def start(kind: str, port: int, *more: str, env: dict[str, str] | None = None) -> None:
            ours[kind] = port, spawn(
                [*me, "--serve-proxy", str(port), "--backend", f"http://127.0.0.1:{fport}",
                 "--model-path", str(mpath), "--http-client", "http1", *more],
                work / f"{kind}.log", env)  # fmt: skip

        start("proxy", pport)
        if args.unrecorded:  # the same proxy, its LlmCalls not recorded: what recording costs
            start("unrecorded", free_port(), "--skip-record")
        if args.baseline_rev:  # the proxy of that revision, measured in the same run
            tree = baseline_tree(args.baseline_rev, work)
            start("baseline", free_port(), env={**os.environ, "PYTHONPATH": str(tree)})
        rport = free_port()  # the floor: a byte relay in front of the backend's direct routes
        relay = spawn([*me, "--serve-relay", str(rport), "--backend", f"http://127.0.0.1:{fport}"],
                      work / "relay.log")  # fmt: skip
        procs = [p for p in (fake, relay, *(p for _, p in ours.values()), lite) if p is not None]
        results: dict[str, list[dict[str, Any]]] = {}
        try:
            assert wait_http(f"http://127.0.0.1:{fport}/health", fake, 120), "backend"
            assert wait_http(f"http://127.0.0.1:{rport}/health", relay, 30), "relay"
            for kind, (port, proc) in ours.items():
                ok = wait_http(f"http://127.0.0.1:{port}/health", proc, 90)
                assert ok, (work / f"{kind}.log").read_text()[-2000:]
            admin = {"Authorization": f"Bearer {ADMIN}"}
            rollouts = {kind: [httpx.post(f"http://127.0.0.1:{port}/v1/rollouts", headers=admin,
                                          json={"task_id": f"b{i}", "group_id": "bench"}).json()
                               for i in range(args.streams)]
                        for kind, (port, _) in ours.items()}  # fmt: skip
            targets: list[tuple[str, str, int]] = []
            for api in apis:
                targets += [(f"direct_{api}", api, fport), (f"relay_{api}", api, rport)]
                targets += [(f"{kind}_{api}", api, port) for kind, (port, _) in ours.items()]
            if lite is not None and "chat" in apis:
                targets.append(("litellm_chat", "chat", lport))

            def calls(target: str, api: str, port: int) -> list[SseCall]:
                tail = "chat/completions" if api == "chat" else "messages"
                kind = target.partition("_")[0]
                if kind in rollouts:
                    return [
                        SseCall("127.0.0.1", port, f"/rollouts/{r['rollout_id']}/v1/{tail}",
                                r["token"], i, api)
                        for i, r in enumerate(rollouts[kind])
                    ]  # fmt: skip
                return [SseCall("127.0.0.1", port, f"/v1/{tail}", "sk-bench", i, api)
                        for i in range(args.streams)]  # fmt: skip

            async def measure() -> None:
                try:
                    import uvloop

                    uvloop.install()
                except ImportError:
                    pass
                for _ in range(rounds):
                    for target, api, port in list(targets):
                        if target.startswith("litellm") and f"{target}_closed" not in results:
                            url = f"http://127.0.0.1:{port}/health/liveliness"
                            left = max(1.0, deadline - time.monotonic() - 4 * duration)
                            if not await asyncio.to_thread(wait_http, url, lite, left):
                                targets.remove((target, api, port))
                                continue
                        group = calls(target, api, port)
                        await run_stream_phase(group[:4], 0.3)  # warm connections
                        kind = target.partition("_")[0]
                        own = (  # the process in front of the backend, if any
                            ours[kind][1].pid if kind in ours else
                            relay.pid if kind == "relay" else
                            lite.pid if kind == "litellm" and lite else None
                        )  # fmt: skip
                        server = [fake.pid] + ([own] if own is not None else [])
                        for mode, rate in (("closed", None), ("paced", args.stream_rate)):
                            cpu0 = {pid: cpu_seconds(pid) for pid in server}
                            res = await run_stream_phase(group, duration, rate)
                            cpu = {pid: cpu_seconds(pid) - cpu0[pid] for pid in server}
                            res["cpu_ms_per_call"] = 1000 * sum(cpu.values()) / max(1, res["n"])
                            if own is not None:  # that process alone
                                res["own_cpu_ms_per_call"] = 1000 * cpu[own] / max(1, res["n"])
                            results.setdefault(f"{target}_{mode}", []).append(res)
                        for c in group:
                            c.close()

            asyncio.run(measure())
            status = httpx.get(f"http://127.0.0.1:{pport}/v1/admin/status", headers=admin).json()
            lite_log = (work / "litellm.log").read_text(errors="replace") if lite else ""
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()

    out: dict[str, Any] = {
        "mode": "stream", "backend_server": args.backend_server, "streams": args.streams,
        "token_ms": args.token_ms if args.backend_server == "fake" else None,
        "paced_rate": args.stream_rate,
        "tokens_per_reply": len(reply_ids), "duration_s": duration, "rounds": rounds,
    }  # fmt: skip
    keys = ("first_p50_ms", "first_p99_ms", "last_p50_ms", "last_p99_ms", "rps", "cpu_ms_per_call")
    for target, res in results.items():
        for key in (*keys, "own_cpu_ms_per_call"):
            if key in res[0]:
                out[f"{target}_{key}"] = round(statistics.median(r[key] for r in res), 3)
    for target in results:
        kind, _, api_mode = target.partition("_")
        if kind == "direct" or f"direct_{api_mode}" not in results:
            continue
        base = f"direct_{api_mode}"
        for key in (*keys[:4], keys[5]):
            out[f"{target}_added_{key}"] = round(out[f"{target}_{key}"] - out[f"{base}_{key}"], 3)
        out[f"{target}_rps_ratio"] = round(out[f"{target}_rps"] / out[f"{base}_rps"], 3)
        if kind == "baseline":  # the working tree's proxy against that revision's, same run
            mine = f"proxy_{api_mode}_own_cpu_ms_per_call"
            if mine in out:
                ratio = out[mine] / out[f"{target}_own_cpu_ms_per_call"]
                out[f"proxy_{api_mode}_own_cpu_over_baseline"] = round(ratio, 3)
    out["proxy_calls"] = status["stats"]["completed"]
    out["proxy_events_submitted"] = status["delivery"]["submitted"]
    if lite is not None and "litellm_chat_closed" not in results:
        lite_error = f"litellm did not answer /health/liveliness in time: {lite_log[-600:]}"
    out["litellm"] = "measured" if "litellm_chat_closed" in results else lite_error
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    print(f"{'target':22} {'first p50':>10} {'first p99':>10} {'last p50':>10} {'last p99':>10} "
          f"{'calls/s':>8} {'cpu ms/call':>11} {'own cpu ms':>10}")  # fmt: skip
    for target in results:
        f50, f99 = out[f"{target}_first_p50_ms"], out[f"{target}_first_p99_ms"]
        l50, l99, rps = (
            out[f"{target}_last_p50_ms"],
            out[f"{target}_last_p99_ms"],
            out[f"{target}_rps"],
        )
        cpu, own = out[f"{target}_cpu_ms_per_call"], out.get(f"{target}_own_cpu_ms_per_call")
        print(f"{target:22} {f50:10.2f} {f99:10.2f} {l50:10.2f} {l99:10.2f} {rps:8.0f} {cpu:11.3f}"
              + (f" {own:10.3f}" if own is not None else ""))  # fmt: skip
    print(json.dumps(out))


# --------------------------------------------------------------------------- main


def model_dir(path: str | None) -> Path:
    target = Path(path) if path else ROOT / ".rollstream" / "models" / "tiny"
    if not (target / "tokenizer.json").is_file():
        from rollstream.inference.tinymodel import ensure_tiny_model

        ensure_tiny_model(target)
    return target


def start_litellm(exe: str | None, backend_port: int, work: Path) -> tuple[Any, int, str]:
    """(process, port, error). The binary: --litellm, else `litellm` next to this Python or
    on PATH."""
    candidates = [exe] if exe else [str(Path(sys.executable).with_name("litellm")), "litellm"]
    binary = next((c for c in candidates if c and shutil.which(c)), None)
    if binary is None:
        return None, 0, "litellm is not installed (pip install 'litellm[proxy]')"
    port = free_port()
    cfg = work / "litellm.yaml"
    cfg.write_text(
        "model_list:\n  - model_name: fake\n    litellm_params:\n      model: openai/fake\n"
        f"      api_base: http://127.0.0.1:{backend_port}/v1\n      api_key: sk-fake\n"
        "litellm_settings:\n  telemetry: false\n  drop_params: true\n"
    )
    env = {**os.environ, "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_MASTER_KEY": "sk-bench"}  # fmt: skip
    out = (work / "litellm.log").open("wb")
    proc = subprocess.Popen([binary, "--config", str(cfg), "--port", str(port), "--num_workers",
                             "1"], stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    return proc, port, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--duration", type=float, default=None, help="seconds per phase")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--rate", type=float, default=200.0, help="paced phase, requests/s in total")
    ap.add_argument("--litellm", default=None)
    ap.add_argument("--bootstrap", default=None, help="record to this Kafka broker")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--backend-server", choices=["fake", "reference"], default="fake",
                    help="fake: fixed reply (after --backend-ms); reference: `rollstream "
                         "serve-model` with the tiny model (greedy, 16 tokens)")  # fmt: skip
    ap.add_argument("--backend-ms", type=float, default=0.0,
                    help="fake backend time per call (0: instant); calls overlap")  # fmt: skip
    ap.add_argument("--baseline-rev", default=None,
                    help="also measure the proxy of this git revision (e.g. HEAD)")  # fmt: skip
    ap.add_argument(
        "--http-client",
        default="http1",
        help="the proxy's client of its backend hop: http1, aiohttp or httpx; a comma-separated "
        "list measures one proxy per client side by side",
    )
    ap.add_argument(
        "--hop-calls", type=int, default=None, help="calls per client and round (hop figures)"
    )
    ap.add_argument(
        "--stream",
        action="store_true",
        help="streamed calls: time to first and last token, chat and Messages API",
    )
    ap.add_argument("--api", default="chat,messages", help="--stream: chat, messages or both")
    ap.add_argument("--stream-rate", type=float, default=64.0,
                    help="--stream: the paced phase's calls/s in total")  # fmt: skip
    ap.add_argument("--unrecorded", action="store_true",
                    help="--stream: also the proxy with its LlmCalls not recorded (what "
                         "recording each call before the stream ends costs)")  # fmt: skip
    ap.add_argument("--token-ms", type=float, default=20.0,
                    help="--stream: the fake backend's time per token")  # fmt: skip
    ap.add_argument("--serve-fake", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-proxy", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-relay", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip-record", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reply-ids", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_fake:
        return serve_fake(args.serve_fake, [int(x) for x in args.reply_ids.split(",")],
                          args.backend_ms)  # fmt: skip
    if args.serve_relay:
        return serve_relay(args.serve_relay, args.backend)
    if args.serve_proxy:
        return serve_proxy(
            args.serve_proxy, args.backend, args.model_path, args.bootstrap, args.http_client,
            record=not args.skip_record,
        )  # fmt: skip
    if args.stream:
        return stream_bench(args)
    clients = [c.strip() for c in args.http_client.split(",") if c.strip()]
    if not clients or not set(clients) <= {"http1", "aiohttp", "httpx"}:
        ap.error("--http-client: http1, aiohttp or httpx, or a comma-separated list of them")
    hop_calls = args.hop_calls or (300 if args.quick else 2000)

    duration = args.duration or (1.5 if args.quick else 10.0)
    rounds = args.rounds or (1 if args.quick else 3)
    deadline = time.monotonic() + (27.0 if args.quick else 600.0)  # LiteLLM's startup budget
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t_start = time.monotonic()
        fport, pport = free_port(), free_port()
        lite, lport, lite_error = start_litellm(args.litellm, fport, work)  # slow: start first
        mpath = model_dir(args.model_path)
        from rollstream.producers.proxy.chat import ChatTemplate

        chat = ChatTemplate.from_dir(mpath)
        reply_ids = [*chat.encode(REPLY).tolist(), chat.eos_id]
        me = [sys.executable, str(Path(__file__).resolve())]
        fake = start_backend(
            args.backend_server, fport, mpath, chat, reply_ids, args.backend_ms, work
        )
        ours: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}  # target -> (port, process)
        for i, client in enumerate(clients):
            target = "proxy" if i == 0 else f"proxy_{client}"
            port = pport if i == 0 else free_port()
            command = [*me, "--serve-proxy", str(port), "--backend", f"http://127.0.0.1:{fport}"]
            command += ["--model-path", str(mpath), "--http-client", client]
            command += ["--bootstrap", args.bootstrap] if args.bootstrap else []
            ours[target] = port, spawn(command, work / f"{target}.log")
        base = None
        if args.baseline_rev:
            bport = free_port()
            env = {**os.environ, "PYTHONPATH": str(baseline_tree(args.baseline_rev, work))}
            base = spawn([*me, "--serve-proxy", str(bport), "--backend",
                          f"http://127.0.0.1:{fport}", "--model-path", str(mpath)]
                         + (["--bootstrap", args.bootstrap] if args.bootstrap else []),
                         work / "baseline.log", env)  # fmt: skip
        procs = [p for p in (fake, *(p for _, p in ours.values()), base, lite) if p is not None]
        try:
            assert wait_http(f"http://127.0.0.1:{fport}/health", fake, 120), "backend"
            targets = {"direct": fport}
            pids = {"direct": [fake.pid]}
            for target, (port, proc) in ours.items():
                ok = wait_http(f"http://127.0.0.1:{port}/health", proc, 90)
                assert ok, (work / f"{target}.log").read_text()[-2000:]
                targets[target], pids[target] = port, [proc.pid, fake.pid]
            if base is not None:
                ok = wait_http(f"http://127.0.0.1:{bport}/health", base, 90)
                assert ok, (work / "baseline.log").read_text()[-2000:]
                targets["baseline"], pids["baseline"] = bport, [base.pid, fake.pid]
            if lite is not None:
                targets["litellm"] = lport  # measured last, if it is up by then
            admin = {"Authorization": f"Bearer {ADMIN}"}
            rollouts = {t: [httpx.post(f"http://127.0.0.1:{targets[t]}/v1/rollouts", headers=admin,
                                       json={"task_id": f"b{i}", "group_id": "bench"}).json()
                            for i in range(args.streams)]
                        for t in [*ours, "baseline"] if t in targets}  # fmt: skip
            if lite is not None:
                pids["litellm"] = [lite.pid, fake.pid]
            results: dict[str, dict[str, list[dict[str, Any]]]] = {
                t: {"closed": [], "paced": []} for t in targets
            }
            hops: dict[str, list[tuple[float, float]]] = {c: [] for c in clients}
            hop_on = args.backend_server == "fake"  # the real model: too slow to call alone

            async def measure() -> None:
                try:
                    import uvloop  # the load generator must not be the bottleneck

                    uvloop.install()
                except ImportError:
                    pass
                for _ in range(rounds):
                    for client in clients if hop_on else ():
                        url = f"http://127.0.0.1:{fport}"
                        hops[client].append(await hop(client, url, hop_calls))
                    for target, port in list(targets.items()):
                        if target == "litellm" and not results[target]["closed"]:
                            url = f"http://127.0.0.1:{port}/health/liveliness"
                            left = max(1.0, deadline - time.monotonic() - 4 * duration)
                            if not await asyncio.to_thread(wait_http, url, lite, left):
                                del targets[target], results[target]
                                break
                        for mode, rate in (("closed", None), ("paced", args.rate)):
                            streams = make_streams(target, port, rollouts.get(target, []),
                                                   args.streams)  # fmt: skip
                            await run_phase(streams[:4], 0.2, None)  # warm connections
                            cpu0 = {p.pid: cpu_seconds(p.pid) for p in procs}
                            res = await run_phase(streams, duration, rate)
                            server = pids[target]  # the process that answers this target
                            res["cpu_ms_per_call"] = (
                                1000
                                * sum(cpu_seconds(pid) - cpu0[pid] for pid in server)
                                / max(1, res["n"])
                            )
                            results[target][mode].append(res)
                            for s in streams:
                                s.close()

            asyncio.run(measure())
            status = httpx.get(f"http://127.0.0.1:{pport}/v1/admin/status", headers=admin).json()
            work_log = (work / "litellm.log").read_text(errors="replace") if lite else None
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()

    def med(target: str, mode: str, key: str) -> float:
        return round(statistics.median(r[key] for r in results[target][mode]), 3)

    out: dict[str, Any] = {
        "streams": args.streams, "rate": args.rate, "duration_s": duration, "rounds": rounds,
        "recording": "kafka" if args.bootstrap else "memory", "backend_ms": args.backend_ms,
        "backend_server": args.backend_server,
    }  # fmt: skip
    for target in targets:
        for mode in ("closed", "paced"):
            for key in ("p50_ms", "p99_ms", "rps", "cpu_ms_per_call"):
                out[f"{target}_{mode}_{key}"] = med(target, mode, key)
    for target in [t for t in targets if t != "direct"]:
        for mode in ("closed", "paced"):
            out[f"{target}_{mode}_added_cpu_ms_per_call"] = round(
                out[f"{target}_{mode}_cpu_ms_per_call"] - out[f"direct_{mode}_cpu_ms_per_call"], 3
            )
            for q in ("p50", "p99"):
                out[f"{target}_{mode}_added_{q}_ms"] = round(
                    out[f"{target}_{mode}_{q}_ms"] - out[f"direct_{mode}_{q}_ms"], 3
                )
            out[f"{target}_{mode}_throughput_ratio"] = round(
                out[f"{target}_closed_rps"] / out["direct_closed_rps"], 3
            ) if mode == "closed" else None  # fmt: skip
    if hops[clients[0]]:
        out["hop_calls"] = hop_calls
        for client in clients:
            for i, key in enumerate(("p50_us", "cpu_us_per_call")):
                out[f"hop_{client}_{key}"] = round(statistics.median(h[i] for h in hops[client]), 1)
        for client in clients[1:]:
            for key in ("p50_us", "cpu_us_per_call"):
                ratio = out[f"hop_{client}_{key}"] / out[f"hop_{clients[0]}_{key}"]
                out[f"hop_{client}_over_{clients[0]}_{key}"] = round(ratio, 2)
    out["proxy_events_submitted"] = status["delivery"]["submitted"]
    out["proxy_calls"] = status["stats"]["completed"]
    if lite is not None and "litellm" not in targets:
        log = (work_log or "")[-600:]
        lite_error = f"litellm did not answer /health/liveliness in time: {log}"
    out["litellm"] = "measured" if "litellm" in targets else lite_error
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    print(f"{'target':8} {'mode':6} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'cpu ms/call':>11}")
    for target in targets:
        for mode in ("closed", "paced"):
            p50, p99 = out[f"{target}_{mode}_p50_ms"], out[f"{target}_{mode}_p99_ms"]
            rps, cpu = out[f"{target}_{mode}_rps"], out[f"{target}_{mode}_cpu_ms_per_call"]
            print(f"{target:8} {mode:6} {p50:8.2f} {p99:8.2f} {rps:8.0f} {cpu:11.3f}")
    for client in clients if "hop_calls" in out else ():
        p50, cpu = out[f"hop_{client}_p50_us"], out[f"hop_{client}_cpu_us_per_call"]
        print(f"hop {client:8} p50 {p50:8.1f} us  cpu {cpu:8.1f} us/call")
    print(json.dumps({k: v for k, v in out.items() if v is not None}))


if __name__ == "__main__":
    main()
