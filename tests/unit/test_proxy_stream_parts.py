"""The pure part of streamed calls (producers/proxy/streaming.py) and the lean client's
streamed exchange (Http1Transport.stream) against a real local socket server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# --------------------------------------------------------------------------- differential: the
# per-token code against the plain versions it replaced (same results, same errors)


def _parse_chunk_plain(data: Any, top_k: int = 0) -> TokenChunk | None:
    """parse_chunk's checks as all() over generators (what parse_chunk did before its loops)."""
    choice = data["choices"][0]
    lp = choice.get("logprobs") or {}
    logprobs = lp.get("token_logprobs") if isinstance(lp, dict) else None
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < 2**32 for t in ids):
        raise ValueError("a stream chunk's `token_ids` are not token ids")
    if not isinstance(logprobs, list) or len(logprobs) != len(ids):
        raise ValueError(f"{len(ids)} token ids but logprobs {logprobs!r:.80}")
    if not all(isinstance(v, int | float) and type(v) is not bool for v in logprobs):
        raise ValueError("a generated token has no logprob")
    return TokenChunk(token_ids=ids, logprobs=[float(v) for v in logprobs])


_ODD = st.one_of(
    st.integers(-3, 2**32 + 3), st.booleans(), st.none(), st.text(max_size=2),
    st.floats(allow_nan=False),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.one_of(st.integers(0, 2**32 - 1), _ODD), min_size=1, max_size=4),
    lps=st.lists(st.one_of(st.floats(allow_nan=False), st.integers(-5, 0), _ODD), max_size=5),
)
def test_parse_chunk_checks_as_the_plain_version(ids: list[Any], lps: list[Any]) -> None:
    data = {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": lps}}]}
    try:
        want: Any = _parse_chunk_plain(data)
    except ValueError as exc:
        want = str(exc)
    try:
        got: Any = parse_chunk(data)
    except ValueError as exc:
        got = str(exc)
    assert got == want
    if isinstance(got, TokenChunk):
        assert [type(v) for v in got.logprobs] == [float] * len(lps)


class _PlainText:
    """IncrementalText as it was: both windows decoded on every push."""

    def __init__(self, decode: Any) -> None:
        self._decode, self._prefix, self._read = decode, 0, 0
        self.ids: list[int] = []

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


_TOK = train_tokenizer()


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab é→日🙂<tool_call>|\n", max_size=30),
    cuts=st.lists(st.integers(1, 3), max_size=40),
    flush_at=st.integers(0, 10),
)
def test_incremental_text_gives_the_plain_versions_pieces(
    text: str, cuts: list[int], flush_at: int
) -> None:
    ids = list(_TOK.encode(text, add_special_tokens=False))
    ids += [5, 7][: len(cuts) % 3]  # sometimes special or partial tokens at the end

    def decode(x: list[int]) -> str:
        return str(_TOK.decode(x, skip_special_tokens=False))

    new, old = IncrementalText(decode), _PlainText(decode)
    got, want, pos = [], [], 0
    for i, n in enumerate([*cuts, len(ids)]):
        step, pos = ids[pos : pos + n], pos + n
        got.append(new.push(step))
        want.append(old.push(step))
        if i == flush_at:  # a flush in the middle: the window starts empty again
            got.append(new.flush())
            want.append(old.flush())
    got.append(new.flush())
    want.append(old.flush())
    assert got == want
    assert decode([]) == ""
