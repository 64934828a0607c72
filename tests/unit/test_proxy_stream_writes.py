"""How a streamed answer is written: the SSE templates filled per content delta, send_stream's
writes (the head with the first part, a LastPart with the end of the body, a hang-up or a
server's cancellation) and the lean client's read timeout over a streamed body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rollstream.adapters.asgi_stream import LastPart, send_stream
from rollstream.producers.errors import Http1Error
from rollstream.producers.proxy.anthropic_wire import sse_events
from rollstream.producers.proxy.http1 import Http1Transport
from rollstream.producers.proxy.openai_wire import SseTemplate, chat_chunk, dumps
from rollstream.producers.proxy.streaming import SseParser

TEXTS = ["", "a", " hello", 'quo"te \\ back', "tab\tnew\nline\r\x00\x1f", "é€😀\u2028", "</s>"]


def test_sse_templates_give_the_bytes_of_the_whole_event() -> None:
    head = {"id": "chatcmpl-01J", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    chat = SseTemplate(b"data: ", chat_chunk(head, {"content": SseTemplate.SLOT}))
    block = {"type": "content_block_delta", "index": 0}
    anthropic = SseTemplate(
        b"event: content_block_delta\ndata: ",
        {**block, "delta": {"type": "text_delta", "text": SseTemplate.SLOT}},
    )
    for text in TEXTS:
        assert chat.fill(text) == b"data: " + dumps(chat_chunk(head, {"content": text})) + b"\n\n"
        delta = {**block, "delta": {"type": "text_delta", "text": text}}
        assert anthropic.fill(text) == sse_events([("content_block_delta", delta)])
    with pytest.raises(ValueError, match="exactly once"):
        SseTemplate(b"data: ", {"a": SseTemplate.SLOT, "b": SseTemplate.SLOT})
    with pytest.raises(ValueError, match="exactly once"):
        SseTemplate(b"data: ", {"a": 1})


def test_sse_parser_reads_single_and_multi_line_events_alike() -> None:
    raw = b'data: {"a":1}\n\ndata:{"b":2}\n\ndata: x\ndata: y\n\nid: 3\ndata: z\n\n'
    assert SseParser().feed(raw) == [b'{"a":1}', b'{"b":2}', b"x\ny", b"z"]


class Client:
    """An ASGI client: the request body once, then ``receive`` waits until ``hang_up``."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()
        self.read = False

    async def receive(self) -> dict[str, Any]:
        if not self.read:
            self.read = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def kinds(self) -> list[tuple[str, bytes, bool]]:
        return [
            (m["type"].rsplit(".", 1)[1], m.get("body", b""), m.get("more_body", False))
            for m in self.sent
        ]


def test_the_head_waits_for_the_first_part_and_a_last_part_ends_the_body() -> None:
    async def main() -> None:
        client, log = Client(), []

        async def parts() -> AsyncIterator[bytes]:
            try:
                await asyncio.sleep(0.01)  # the first token
                log.append(f"first, {len(client.sent)} sent")
                yield b"a"
                yield b""  # an empty part goes on as it is
                yield LastPart(b"z")
                log.append("resumed")  # never: the body ended with the LastPart
            finally:
                log.append(f"closed after {len(client.sent)} sends")

        await send_stream(parts(), 200, [(b"x", b"1")], client.receive, client.send)
        assert client.kinds() == [
            ("start", b"", False),
            ("body", b"a", True),
            ("body", b"", True),
            ("body", b"z", False),
        ]
        assert client.sent[0]["status"] == 200 and client.sent[0]["headers"] == [(b"x", b"1")]
        assert log == ["first, 0 sent", "closed after 4 sends"]

        client = Client()

        async def plain() -> AsyncIterator[bytes]:
            yield b"a"

        await send_stream(plain(), 200, [], client.receive, client.send)
        assert client.kinds() == [("start", b"", False), ("body", b"a", True), ("body", b"", False)]

        client = Client()

        async def empty() -> AsyncIterator[bytes]:
            return
            yield b""  # pragma: no cover

        await send_stream(empty(), 204, [], client.receive, client.send)
        assert client.kinds() == [("start", b"", False), ("body", b"", False)]

    asyncio.run(main())


def test_a_hang_up_closes_the_parts_and_a_server_cancel_goes_on() -> None:
    async def main() -> None:
        client, log = Client(), []
        stalled = asyncio.Event()

        async def parts() -> AsyncIterator[bytes]:
            try:
                yield b"a"
                stalled.set()
                await asyncio.sleep(30)  # the backend is slow: the client goes away
                yield b"b"  # pragma: no cover
            except asyncio.CancelledError:
                log.append("cancelled")
                raise
            finally:
                log.append("closed")

        task = asyncio.ensure_future(send_stream(parts(), 200, [], client.receive, client.send))
        await stalled.wait()
        client.gone.set()
        await asyncio.wait_for(task, 5)  # returns: the hang-up is not an error of the caller
        assert not task.cancelled() and task.exception() is None
        assert log == ["cancelled", "closed"]
        assert client.kinds() == [("start", b"", False), ("body", b"a", True)]
        assert asyncio.current_task() is not None

        client, log = Client(), []
        stalled.clear()
        task = asyncio.ensure_future(send_stream(parts(), 200, [], client.receive, client.send))
        await stalled.wait()
        task.cancel()  # the server shuts down: its cancellation is not absorbed
        with pytest.raises(asyncio.CancelledError):
            await task
        assert log == ["cancelled", "closed"]

        client = Client()

        async def first_never() -> AsyncIterator[bytes]:
            await asyncio.sleep(30)
            yield b"a"  # pragma: no cover

        task = asyncio.ensure_future(
            send_stream(first_never(), 200, [], client.receive, client.send)
        )
        await asyncio.sleep(0.01)
        client.gone.set()
        await asyncio.wait_for(task, 5)
        assert client.sent == []  # gone before the first part: no head was written

    asyncio.run(main())


def test_a_failing_stream_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> Client:
        client = Client()

        async def parts() -> AsyncIterator[bytes]:
            yield b"a"
            raise RuntimeError("boom")

        await send_stream(parts(), 200, [], client.receive, client.send)
        return client

    client = asyncio.run(main())
    assert client.kinds() == [("start", b"", False), ("body", b"a", True)]
    assert "a streamed answer failed" in caplog.text


def test_the_read_timeout_is_per_read_over_a_streamed_body() -> None:
    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:  # keep-alive: one request after another
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                await reader.readexactly(2)
                stall = b"/stall" in head
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for i in range(6):  # 6 x 40 ms: longer than the read timeout, each gap shorter
                    await asyncio.sleep(0.5 if stall and i == 2 else 0.04)
                    writer.write(b"1\r\n%d\r\n" % i)
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        t = Http1Transport()
        head = b"POST /ok HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n"
        async with t.stream("127.0.0.1", port, head, b"{}", {"read": 0.15}) as (_, _, parts):
            assert [p async for p in parts] == [b"0", b"1", b"2", b"3", b"4", b"5"]
        got = []
        stall = head.replace(b"/ok", b"/stall")
        with pytest.raises(Http1Error, match="read timed out") as err:
            async with t.stream("127.0.0.1", port, stall, b"{}", {"read": 0.15}) as (_, _, ps):
                async for p in ps:
                    got.append(p)
        assert err.value.kind == "ReadTimeout" and got == [b"0", b"1"]
        await t.aclose()
        server.close()

    asyncio.run(main())
