"""The reference inference server's streamed completions (``stream: true`` on /v1/completions,
in vLLM's chunks), started for real with uvicorn and read over HTTP: the chunks carry the same
tokens, logprobs and text as the unstreamed answer, the first leaves while the rest is still
being generated, and a client that hangs up ends its request's generation (only its row)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
import uvicorn

from rollstream.inference.server import create_app
from rollstream.inference.settings import ModelServerSettings
from rollstream.inference.tinymodel import (
    GenerationResult,
    SamplingParams,
    generate,
    load_model,
    make_tiny_model,
)
from rollstream.inference.wire import IncrementalText

PROMPT = [11, 42, 7, 300, 5, 99]
FULL = {"return_token_ids": True, "return_tokens_as_token_ids": True, "logprobs": 2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    threads = torch.get_num_threads()
    tmp = tmp_path_factory.mktemp("model_server_stream")
    model_path = make_tiny_model(tmp / "tiny", seed=0, hidden=64)
    port = _free_port()
    settings = ModelServerSettings(
        model_path=model_path, model_port=port, model_create=False, home=tmp / "home"
    )
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="error")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=30)
    torch.set_num_threads(threads)


def _events(raw: str) -> list[Any]:
    out: list[Any] = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_streamed_chunks_carry_what_the_whole_answer_carries(url: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 40, "seed": 5, "temperature": 1.0, **FULL}
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{url}/v1/completions", json=stream, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    chunks = events[:-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(chunks)
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    lps = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert ids == whole["token_ids"]
    assert lps == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-5)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    tops = chunks[0]["choices"][0]["logprobs"]["top_logprobs"][0]
    assert f"token_id:{ids[0]}" in tops and len(tops) <= 3
    assert all(isinstance(c["policy_version"], int) for c in chunks)


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is up?"},
]


def test_streamed_chat_says_what_the_whole_chat_answer_says(url: str) -> None:
    body = {"messages": MESSAGES, "max_tokens": 30, "seed": 3, "temperature": 1.0}
    whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{url}/v1/chat/completions", json=stream, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in events[:-1]}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert all(set(d) == {"content"} for d in deltas)
    assert "".join(d["content"] for d in deltas) == whole["choices"][0]["message"]["content"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finish[:-1] == [None] * (len(chunks) - 1)
    assert finish[-1] == whole["choices"][0]["finish_reason"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all(c["policy_version"] == whole["policy_version"] for c in chunks)


def test_the_openai_client_streams_chat_from_the_model_server(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    body: dict[str, Any] = {"model": "rollstream-tiny", "messages": MESSAGES, "max_tokens": 20}
    whole = client.chat.completions.create(**body, temperature=0)
    pieces, finish = [], None
    for chunk in client.chat.completions.create(**body, temperature=0, stream=True):
        choice = chunk.choices[0]
        pieces.append(choice.delta.content or "")
        finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.chat.completions.create(**body, stream="yes")  # type: ignore[call-overload]


def test_first_chunk_leaves_long_before_the_last(url: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "seed": 1, "stream": True}

    async def main() -> tuple[float, float, int]:
        async with (
            httpx.AsyncClient(timeout=120) as http,
            http.stream("POST", f"{url}/v1/completions", json=body) as r,
        ):
            started = time.perf_counter()
            first = None
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    n += 1
                    if first is None:
                        first = time.perf_counter() - started
            return first or 0.0, time.perf_counter() - started, n

    first, last, n = asyncio.run(main())
    assert n == 1500
    assert first < last / 10, (first, last)


def test_a_client_hang_up_aborts_only_its_own_row(url: str) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            before = (await http.get("/v1/load")).json()["streams_aborted"]
            other = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "seed": 2}
            streamed = {**other, "max_tokens": 1900, "stream": True}
            # the two requests land in one batch: the unstreamed one must still get every token
            async with http.stream("POST", "/v1/completions", json=streamed) as r:
                plain = asyncio.create_task(http.post("/v1/completions", json=other))
                got = 0
                async for line in r.aiter_lines():
                    got += line.startswith("data: {")
                    if got == 3:
                        break  # leaving the block closes the connection
            started = time.monotonic()
            while (await http.get("/v1/load")).json()["streams_aborted"] == before:
                assert time.monotonic() - started < 20, "the hang-up was not noticed"
                await asyncio.sleep(0.01)
            choice = (await plain).json()["choices"][0]
            assert choice["finish_reason"] == "length" and len(choice["text"]) > 0
            while (await http.get("/v1/load")).json()["running"]:  # the batch is over
                await asyncio.sleep(0.01)
            assert time.monotonic() - started < 20

    asyncio.run(main())


def test_generate_row_abort_and_on_step(tmp_path: Any) -> None:
    """``generate`` hands every step's tokens to ``on_step`` and ends only the row that
    ``row_abort`` names; the others are unchanged (same seed, same tokens)."""
    model, _tok = load_model(make_tiny_model(tmp_path / "m", seed=0, hidden=32))
    params = [
        SamplingParams(30, seed=1, ignore_eos=True),
        SamplingParams(30, seed=2, ignore_eos=True),
    ]
    alone = generate(model, [PROMPT, PROMPT], params, pad_token_id=0)
    seen: list[list[tuple[int, int, bool]]] = []

    def on_step(rows: list[tuple[int, GenerationResult, bool]]) -> None:
        seen.append([(i, r.token_ids[-1], done) for i, r, done in rows])

    out = generate(
        model,
        [PROMPT, PROMPT],
        params,
        pad_token_id=0,
        row_abort=lambda i: i == 0 and len(seen) >= 4,
        on_step=on_step,
    )
    assert out[0].finish_reason == "abort" and len(out[0].token_ids) == 5
    assert out[1].token_ids == alone[1].token_ids and out[1].finish_reason == "length"
    assert out[0].token_ids == alone[0].token_ids[:5]
    streamed_1 = [t for step in seen for i, t, _ in step if i == 1]
    assert streamed_1 == out[1].token_ids
    assert [done for step in seen for i, _, done in step if i == 0][-1] is True


def test_incremental_text_waits_for_whole_characters(tmp_path: Any) -> None:
    _, tok = load_model(make_tiny_model(tmp_path / "m", seed=0, hidden=32))
    text = "naïve café → 日本語 🙂 ok"
    ids = tok.encode(text, add_special_tokens=False)
    inc = IncrementalText(tok)
    pieces = [inc.push(t) for t in ids]
    pieces.append(inc.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("client", ["http1", "aiohttp", "httpx"])
def test_the_proxys_backend_client_streams_what_it_completes(url: str, client: str) -> None:
    """CompletionBackend.stream over each per-call client gives, chunk by chunk, the tokens,
    logprobs and alternatives that complete() gives whole (same seed)."""
    from rollstream.producers.proxy.pool import BackendPool

    async def main() -> None:
        pool = BackendPool.from_urls([url], http_client=client, health_interval_s=0)
        backend = pool.members[0].backend
        kw: dict[str, Any] = {"max_tokens": 30, "seed": 3, "top_logprobs": 2}
        whole = await backend.complete(PROMPT, **kw)
        chunks = [c async for c in backend.stream(PROMPT, **kw)]
        assert [t for c in chunks for t in c.token_ids] == whole.token_ids.tolist()
        lps = [v for c in chunks for v in c.logprobs]
        assert lps == pytest.approx(whole.logprobs.tolist(), abs=1e-6)

        def rounded(steps: Any) -> list[list[tuple[int, float]]]:
            return [[(t, round(v, 4)) for t, v in step] for step in steps]

        streamed_tops = [step for c in chunks for step in c.top_logprobs or []]
        assert rounded(streamed_tops) == rounded(whole.top_logprobs)
        assert chunks[0].backend == backend.name and chunks[0].policy_version == 0
        assert chunks[-1].finish_reason == whole.finish_reason
        assert all(c.finish_reason is None for c in chunks[:-1])
        again = [c async for c in pool.stream("r1", PROMPT, **kw)]  # through the pool
        assert [t for c in again for t in c.token_ids] == whole.token_ids.tolist()
        assert pool.stats.completed == 1 and pool.inflight == 0
        await pool.aclose()

    asyncio.run(main())
