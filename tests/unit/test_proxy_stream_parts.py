"""The pure part of streamed calls (producers/proxy/streaming.py) and the lean client's
streamed exchange (Http1Transport.stream) against a real local socket server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rollstream.inference.tinymodel import train_tokenizer
from rollstream.producers.errors import Http1Error
from rollstream.producers.proxy.http1 import Http1Transport
from rollstream.producers.proxy.streaming import (
    ContentStream,
    IncrementalText,
    SseParser,
    TokenChunk,
    merge_chunks,
    parse_chunk,
)


def test_sse_parser_joins_events_split_anywhere() -> None:
    raw = (
        b'data: {"a": 1}\n\n: a comment\n\nevent: x\r\ndata: {"b":\r\ndata: 2}\r\n\r\n'
        b"data: [DONE]\n\n"
    )
    for cut in range(len(raw)):
        p = SseParser()
        got = p.feed(raw[:cut]) + p.feed(raw[cut:])
        assert got == [b'{"a": 1}', b'{"b":\n2}', b"[DONE]"], cut
    with pytest.raises(ValueError, match="over 8 bytes"):
        SseParser(max_event_bytes=8).feed(b"data: 0123456789")


def _vllm(ids: list[int], lps: list[float], **choice: object) -> dict[str, object]:
    tops = [{f"token_id:{t}": v, "token_id:7": -9.0} for t, v in zip(ids, lps, strict=False)]
    lp = {"token_logprobs": lps, "tokens": [f"token_id:{t}" for t in ids], "top_logprobs": tops}
    return {"choices": [{"index": 0, "text": "x", "logprobs": lp, "token_ids": ids, **choice}]}


def test_parse_chunk_reads_vllms_streamed_chunks() -> None:
    c = parse_chunk(_vllm([5], [-0.5], finish_reason=None), top_k=1)
    assert c == TokenChunk([5], [-0.5], [[(5, -0.5)]], None, None, None, None)
    last = parse_chunk({**_vllm([9], [-1.0], finish_reason="stop", stop_reason=9),
                        "policy_version": 4, "model": "m"})  # fmt: skip
    assert last is not None and last.finish_reason == "stop" and last.stop_reason == 9
    assert last.policy_version == 4 and last.model == "m" and last.top_logprobs is None
    old = _vllm([3, 4], [-1.0, -2.0])
    del old["choices"][0]["token_ids"]  # type: ignore[index]  # vLLM < 0.10.2
    assert parse_chunk(old) == TokenChunk([3, 4], [-1.0, -2.0])
    assert parse_chunk({"choices": [], "usage": {"completion_tokens": 3}}) is None
    bad: Any
    for bad in (
        _vllm([1, 2], [-1.0]),  # ids and logprobs do not line up
        _vllm([-1], [-1.0]),
        _vllm([1], [None]),  # type: ignore[list-item]
        {"choices": "nope"},
        [],
    ):
        with pytest.raises(ValueError):
            parse_chunk(bad)


def test_chunks_that_arrive_together_go_on_as_one() -> None:
    a = TokenChunk([1], [-1.0], policy_version=3, backend="b")
    b = TokenChunk([2, 3], [-2.0, -3.0], [[(2, -2.0)], [(3, -3.0)]], "stop", 3, None, "m")
    assert merge_chunks([a]) is a
    assert merge_chunks([a, b]) == TokenChunk(
        [1, 2, 3], [-1.0, -2.0, -3.0], [[], [(2, -2.0)], [(3, -3.0)]], "stop", 3, 3, "m", "b"
    )


def test_content_stream_holds_back_a_tool_call_marker() -> None:
    s = ContentStream(tools=True, markers=("<tool_call>",))
    out = [s.push(p) for p in ["Let", " me check", ". <tool", "_call>\n{", '"name"', "}"]]
    assert out == ["Let", " me check", ".", "", "", ""]
    assert s.finish("Let me check.") == ""
    s = ContentStream(tools=True, markers=("<tool_call>",))
    assert [s.push(p) for p in ["a <to", "day", "  ", "x"]] == ["a", " <today", "", "  x"]
    assert s.finish("a <today  x\n") == "\n"  # no call: the rest of the text, as parsed
    s = ContentStream(tools=False, markers=("<tool_call>",))
    assert [s.push(p) for p in ["<tool", "_call> ", "x"]] == ["<tool", "_call> ", "x"]
    s = ContentStream(tools=True, markers=("<|python_tag|>",), whole_json=True)
    assert [s.push(p) for p in [" ", '{"name"', ": 1}"]] == ["", "", ""]
    assert s.finish(None) == ""
    s = ContentStream(tools=True, markers=("<|python_tag|>",), whole_json=True)
    assert [s.push(p) for p in ["Hi", " {"]] == ["Hi", " {"]


def test_incremental_text_equals_decode() -> None:
    tok = train_tokenizer()
    text = "naïve café → 日本語 🙂 <tool_call> ok"
    ids = tok.encode(text, add_special_tokens=False)
    inc = IncrementalText(lambda x: tok.decode(x, skip_special_tokens=False))
    pieces = [inc.push([t]) for t in ids] + [inc.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


async def _server(
    handler: object,
) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    return server, server.sockets[0].getsockname()[1]


def test_http1_stream_hands_out_parts_and_pools_only_finished_connections() -> None:
    async def main() -> None:
        opened, closed = [], asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            opened.append(writer)
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    await reader.readexactly(n)
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                                 b"Content-Type: text/event-stream\r\n\r\n")  # fmt: skip
                    for i in range(3):
                        part = json.dumps({"i": i}).encode()
                        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                        await writer.drain()
                        await asyncio.sleep(0.01)
                    writer.write(b"0\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                closed.set()

        server, port = await _server(handle)
        t = Http1Transport()
        head = b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n"
        async with t.stream("127.0.0.1", port, head, b"{}", {"read": 5}) as (status, hs, parts):
            assert status == 200 and (b"Content-Type", b"text/event-stream") in hs
            got = [json.loads(p) async for p in parts]
        assert got == [{"i": 0}, {"i": 1}, {"i": 2}]
        async with t.stream("127.0.0.1", port, head, b"{}", {"read": 5}) as (_, _, parts):
            async for _ in parts:
                break  # left early: the connection is closed, not pooled
        await asyncio.wait_for(closed.wait(), 5)
        assert len(opened) == 1  # the finished stream's connection was reused for the second
        async with t.stream("127.0.0.1", port, head, b"{}", {"read": 5}) as (_, _, parts):
            assert len([p async for p in parts]) == 3
        assert len(opened) == 2
        await t.aclose()
        server.close()
        with pytest.raises(Http1Error):
            async with t.stream("127.0.0.1", port, head, b"{}", {"connect": 1}):
                pass

    asyncio.run(main())
