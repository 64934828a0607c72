"""True streaming through the recording proxy, with the official clients, the real Kafka broker
and a real reference model server (in this process, so its counters can be read), plus a
scripted vLLM-format streaming backend for timing, tool calls and failures:

- the first chunk reaches the client long before the last token is generated;
- the recorded LlmCall holds exactly the streamed tokens (text, count, logprobs);
- a client that hangs up ends the model server's request (its abort counter) and the proxy
  records a RolloutError (code 499), no LlmCall;
- a backend that fails before its first token is replaced; one that fails after it ends the
  stream with an error event (the openai client raises APIError) and a RolloutError (502);
- a streamed reply that is a tool call comes as one tool_calls delta, with no marker text;
- Anthropic's client streams the same way (text deltas as they come, tool_use blocks)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from test_proxy import (
    by_rollout,
    calls_of,
    consume,
    create_rollout,
    free_port,
    model_dir,
    proxy_settings,
    running_proxy,
    serve,
)

from rollstream.inference.server import create_app as create_model_app
from rollstream.inference.settings import ModelServerSettings
from rollstream.producers.proxy.chat import ChatTemplate
from rollstream.schemas import CommonSettings, LlmCall, RolloutError

pytestmark = pytest.mark.integration
__all__ = ["model_dir"]  # module fixture shared with test_proxy


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The reference model server, in a thread of this process."""
    threads = torch.get_num_threads()
    port = free_port()
    home = tmp_path_factory.mktemp("ref_home")
    settings = ModelServerSettings(
        model_path=model_dir, model_port=port, model_create=False, home=home
    )
    server = uvicorn.Server(
        uvicorn.Config(create_model_app(settings), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)
    torch.set_num_threads(threads)


class StreamingBackend:
    """A vLLM-shaped completion server that streams scripted token ids in vLLM's chunks (one
    per token, ``delay`` s apart, no policy_version), or answers ``status`` at once, or cuts
    the connection after ``cut_after`` tokens."""

    def __init__(self) -> None:
        self.script: deque[list[int]] = deque()
        self.default = [2]
        self.delay = 0.0
        self.status: int | None = None
        self.cut_after: int | None = None
        self.requests = 0

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests += 1
        if self.status is not None:
            return JSONResponse({"error": {"message": "down", "code": self.status}}, self.status)
        ids = self.script.popleft() if self.script else self.default
        assert body.get("stream") is True and body.get("return_token_ids") is True

        async def chunks() -> AsyncIterator[bytes]:
            for i, t in enumerate(ids):
                if self.cut_after is not None and i == self.cut_after:
                    raise RuntimeError("the backend died mid-stream")
                last = i == len(ids) - 1
                lp = {
                    "text_offset": [i],
                    "token_logprobs": [-0.25 - i / 100],
                    "tokens": [f"token_id:{t}"],
                    "top_logprobs": [{f"token_id:{t}": -0.25}],
                }
                choice = {
                    "index": 0,
                    "text": "?",
                    "logprobs": lp,
                    "token_ids": [t],
                    "finish_reason": "stop" if last else None,
                    "stop_reason": None,
                }
                if i == 0:
                    choice["prompt_token_ids"] = body["prompt"]
                chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0,
                         "model": "scripted", "choices": [choice]}  # fmt: skip
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                await asyncio.sleep(self.delay)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    def app(self) -> Starlette:
        async def ok(request: Request) -> Response:
            return JSONResponse({"weight_version": "0"})

        return Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/health", ok),
                Route("/weight_info", ok),
            ]
        )


def _long_seed(base_url: str, token: str, messages: Any, want: int) -> int:
    """A seed whose (deterministic) completion of ``messages`` is at least ``want`` tokens,
    found with unstreamed calls in a probe rollout."""
    client = openai.OpenAI(base_url=base_url, api_key=token, max_retries=0)
    for seed in range(40):
        r = client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=1200,
            seed=seed,
        )
        if r.usage is not None and r.usage.completion_tokens >= want:
            return seed
    raise AssertionError("no seed gives a long completion")


def test_openai_stream_is_live_and_recorded_exactly(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, reference: str
) -> None:
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [reference])
    msgs: Any = [{"role": "user", "content": "Tell me a long story."}]
    with running_proxy(settings) as (url, recorder, _):
        probe = create_rollout(url)
        seed = _long_seed(probe["base_url"], probe["token"], msgs, 400)
        ro = create_rollout(url)
        client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
        started = time.perf_counter()
        stream = client.chat.completions.create(
            model="m", messages=msgs, max_tokens=1200, seed=seed, stream=True,
            logprobs=True, stream_options={"include_usage": True},
        )  # fmt: skip
        stamps, texts, lps = [], [], []
        chunks = []
        for chunk in stream:
            stamps.append(time.perf_counter() - started)
            chunks.append(chunk)
            if chunk.choices and chunk.choices[0].delta.content:
                texts.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                lps += [e.logprob for e in chunk.choices[0].logprobs.content]
        first_content = next(
            i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content
        )
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens >= 400
        # the first token left long before the last was generated
        assert stamps[first_content] < stamps[-1] / 4, (stamps[first_content], stamps[-1])
        assert len(stamps) > 20  # chunk by chunk (tokens that arrive together go together)
        ext = (chunks[-2].model_extra or {})["rollstream"]
        assert recorder.flush(30)

    events = by_rollout(consume(kafka_settings))[ro["rollout_id"]]
    (call,) = calls_of(events)
    assert call.call_id == ext["call_id"]
    chat = ChatTemplate.from_dir(model_dir)
    assert chat.decode(call.completion_ids) == "".join(texts)
    assert len(call.completion_ids) == usage.completion_tokens == len(lps)
    assert np.array_equal(call.completion_logprobs, np.asarray(lps, dtype=np.float32))
    assert call.backend == reference and call.finish_reason in ("stop", "length")


def test_a_client_hang_up_ends_the_backend_request(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, reference: str
) -> None:
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [reference])
    msgs: Any = [{"role": "user", "content": "Write a very long poem."}]
    with running_proxy(settings) as (url, recorder, proxy):
        probe = create_rollout(url)
        seed = _long_seed(probe["base_url"], probe["token"], msgs, 500)
        ro = create_rollout(url)
        before = httpx.get(f"{reference}/v1/load").json()["streams_aborted"]
        body = {"model": "m", "messages": msgs, "max_tokens": 1200, "seed": seed, "stream": True}
        headers = {"Authorization": f"Bearer {ro['token']}"}
        with httpx.stream(
            "POST", f"{ro['base_url']}/chat/completions", json=body, headers=headers, timeout=60
        ) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: {")
                if got == 5:
                    break  # leaving the block closes the connection
        deadline = time.monotonic() + 20
        while httpx.get(f"{reference}/v1/load").json()["streams_aborted"] == before:
            assert time.monotonic() < deadline, "the model server kept generating"
            time.sleep(0.02)
        while proxy.pool.inflight:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert recorder.flush(30)

    events = by_rollout(consume(kafka_settings))[ro["rollout_id"]]
    assert calls_of(events) == []
    (err,) = [e.body for e in events if isinstance(e.body, RolloutError)]
    assert err.code == 499 and "closed the stream" in err.message and err.call_id


def test_failover_before_the_first_token_and_failure_after_it(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path
) -> None:
    chat = ChatTemplate.from_dir(model_dir)
    down, up = StreamingBackend(), StreamingBackend()
    down.status = 503
    reply = [*chat.encode("Fine, thanks.").tolist(), chat.eos_id]
    up.default = reply
    with serve(down.app()) as down_url, serve(up.app()) as up_url:
        settings = proxy_settings(
            kafka_settings, tmp_path, model_dir, [down_url, up_url], proxy_backend_kind="vllm"
        )
        with running_proxy(settings) as (url, recorder, _):
            rollouts = [create_rollout(url) for _ in range(2)]
            clients = [
                openai.OpenAI(base_url=r["base_url"], api_key=r["token"], max_retries=0)
                for r in rollouts
            ]
            msgs: Any = [{"role": "user", "content": "How are you?"}]
            # the first rollout lands on the backend that is down: it fails over, unseen
            for client in clients:
                stream = client.chat.completions.create(
                    model="m", messages=msgs, max_tokens=20, stream=True
                )
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                assert text == "Fine, thanks."
            assert down.requests >= 1
            # after its first token, a failure is an error event: the client raises
            up.cut_after = 3
            stream = clients[0].chat.completions.create(
                model="m", messages=msgs, max_tokens=20, stream=True
            )
            with pytest.raises(openai.APIError, match="failed after 3 streamed tokens"):
                for _ in stream:
                    pass
            assert recorder.flush(30)

    by = by_rollout(consume(kafka_settings))
    events = by[rollouts[0]["rollout_id"]]
    calls = calls_of(events)
    assert len(calls) == 1 and calls[0].backend == up_url
    assert calls[0].completion_ids.tolist() == reply
    errors = [e.body for e in events if isinstance(e.body, RolloutError)]
    assert [e.code for e in errors] == [502]


def test_tool_calls_are_held_back_and_sent_whole(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path
) -> None:
    chat = ChatTemplate.from_dir(model_dir)
    backend = StreamingBackend()
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    backend.script.append([*chat.encode("Let me check. " + call_text).tolist(), chat.eos_id])
    backend.script.append([*chat.encode("It is sunny.").tolist(), chat.eos_id])
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    with serve(backend.app()) as b_url:
        settings = proxy_settings(
            kafka_settings, tmp_path, model_dir, [b_url], proxy_backend_kind="vllm"
        )
        with running_proxy(settings) as (url, recorder, _):
            ro = create_rollout(url)
            client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
            msgs: Any = [{"role": "user", "content": "Weather in Paris?"}]
            chunks = list(
                client.chat.completions.create(
                    model="m", messages=msgs, tools=tools, max_tokens=60, stream=True
                )
            )
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
            assert content == "Let me check."  # no marker text ever went out
            assert len(calls) == 1 and calls[0].function is not None
            assert calls[0].function.name == "get_weather"
            assert json.loads(calls[0].function.arguments or "") == {"city": "Paris"}
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            # the harness answers the call; the next (streamed) call chains on the first
            msgs += [
                {"role": "assistant", "content": content, "tool_calls": [{
                    "id": calls[0].id, "type": "function", "function": {
                        "name": "get_weather", "arguments": calls[0].function.arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
            ]  # fmt: skip
            stream = client.chat.completions.create(
                model="m", messages=msgs, tools=tools, max_tokens=60, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == "It is sunny."
            assert recorder.flush(30)

    events = by_rollout(consume(kafka_settings))[ro["rollout_id"]]
    first, second = calls_of(events)
    assert second.parent_call_id == first.call_id
    assert second.prefix_len == len(first.prompt_delta) + len(first.completion_ids)


def test_anthropic_client_streams(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, reference: str
) -> None:
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [reference])
    with running_proxy(settings) as (url, recorder, _):
        ro = create_rollout(url)
        base = ro["base_url"].removesuffix("/v1")
        client = anthropic.Anthropic(base_url=base, api_key=ro["token"], max_retries=0)
        pieces = []
        with client.messages.stream(
            model="m", max_tokens=64, messages=[{"role": "user", "content": "Say hello."}]
        ) as stream:
            for text in stream.text_stream:
                pieces.append(text)
            message = stream.get_final_message()
        assert recorder.flush(30)

    events = by_rollout(consume(kafka_settings))[ro["rollout_id"]]
    (call,) = [e.body for e in events if isinstance(e.body, LlmCall)]
    chat = ChatTemplate.from_dir(model_dir)
    text = "".join(b.text for b in message.content if b.type == "text")
    assert "".join(pieces) == text == chat.decode(call.completion_ids)
    assert message.usage.output_tokens == len(call.completion_ids)
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert len(pieces) > 1 or len(call.completion_ids) < 3


def test_responses_client_streams(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, reference: str
) -> None:
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [reference])
    with running_proxy(settings) as (url, recorder, _):
        ro = create_rollout(url)
        client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
        deltas, types, final = [], [], None
        for ev in client.responses.create(
            model="m", input="Say hello.", max_output_tokens=40, stream=True, store=False
        ):
            types.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        assert final is not None
        assert recorder.flush(30)

    assert types[:2] == ["response.created", "response.in_progress"]
    events = by_rollout(consume(kafka_settings))[ro["rollout_id"]]
    (call,) = calls_of(events)
    chat = ChatTemplate.from_dir(model_dir)
    assert "".join(deltas) == final.output_text == chat.decode(call.completion_ids)
    assert final.usage is not None and final.usage.output_tokens == len(call.completion_ids)
