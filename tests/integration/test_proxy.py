"""The recording proxy end to end: the real `openai` client -> proxy (uvicorn) -> reference model
server (subprocess) or a scripted vLLM-shaped backend; events read back from the real Kafka."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from _kafka_read import read_topic
from confluent_kafka import Producer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollstream.inference.tinymodel import ensure_tiny_model
from rollstream.producers import ContextTrie, Recorder
from rollstream.producers.proxy.app import create_app
from rollstream.producers.proxy.chat import ChatTemplate
from rollstream.producers.proxy.policy_watch import PolicyWatcher
from rollstream.producers.proxy.settings import ProxySettings
from rollstream.schemas import (
    REWARD_BOUND,
    Codec,
    CommonSettings,
    EvaluatorOutput,
    Event,
    LlmCall,
    PolicyVersion,
    Reward,
    RewardKind,
    RolloutError,
    SandboxEvent,
    StageEvent,
    ToolCall,
)
from rollstream.schemas.dlq import CODE_UNDECODABLE, HEADER_NAMES, read_headers

pytestmark = pytest.mark.integration

ADMIN = "admin-key-for-tests"
codec = Codec()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run an ASGI app with uvicorn in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def start_model_server(model_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "ROLLSTREAM_MODEL_PATH": str(model_dir),
           "ROLLSTREAM_MODEL_PORT": str(port), "ROLLSTREAM_MODEL_CREATE": "false"}  # fmt: skip
    cli = str(Path(sys.executable).with_name("rollstream"))  # `rollstream serve-model`
    proc = subprocess.Popen(
        [cli, "serve-model"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, "model server exited"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("model server did not come up")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def model_server(model_dir: Path) -> Iterator[str]:
    proc, url = start_model_server(model_dir)
    yield url
    stop(proc)


class ScriptedBackend:
    """A vLLM-shaped completion server that answers scripted token ids (to force exact
    tokenizations: tool calls, non-canonical splits) and records what it was asked."""

    def __init__(self) -> None:
        self.script: deque[list[int]] = deque()
        self.prompts: list[list[int]] = []
        self.default: list[int] = [2]
        self.delay = 0.0

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.prompts.append(body["prompt"])
        if self.delay:
            await asyncio.sleep(self.delay)
        ids = self.script.popleft() if self.script else self.default
        return JSONResponse({"model": "scripted", "policy_version": 0, "choices": [{
            "token_ids": ids, "finish_reason": "stop",
            "logprobs": {"token_logprobs": [-1.0] * len(ids)}}],
            "usage": {"prompt_tokens": len(body["prompt"])}})  # fmt: skip

    def app(self) -> Starlette:
        async def ok(request: Request) -> Response:
            return JSONResponse({"policy_version": 0})

        return Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/health", ok), Route("/v1/policy_version", ok),
        ])  # fmt: skip


def proxy_settings(common: CommonSettings, tmp_path: Path, model_dir: Path,
                   backends: list[str], **kw: Any) -> ProxySettings:  # fmt: skip
    kw.setdefault("proxy_health_interval_s", 0.5)
    return ProxySettings(
        **common.model_dump(), spool_dir=tmp_path / "spool", producer="proxy-it",
        proxy_backends=backends, proxy_model_path=model_dir, proxy_api_keys=[ADMIN],
        proxy_token_secret="secret-for-integration-tests", **kw,
    )  # fmt: skip


@contextmanager
def running_proxy(settings: ProxySettings) -> Iterator[tuple[str, Recorder, Any]]:
    recorder = Recorder(settings)
    app = create_app(settings, recorder=recorder)
    try:
        with serve(app) as url:
            yield url, recorder, app.state.proxy
    finally:
        recorder.close(30)


def create_rollout(url: str, **body: Any) -> dict[str, Any]:
    body.setdefault("task_id", "t1")
    body.setdefault("group_id", "g1")
    r = httpx.post(f"{url}/v1/rollouts", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 201, r.text
    return r.json()


def consume(settings: CommonSettings, timeout: float = 60.0) -> list[Event]:
    """Every event on the events topic (up to the high watermarks now), each partition in offset
    order."""
    return [
        codec.decode(m.value()) for m in read_topic(settings, settings.topics().events, timeout)
    ]


def by_rollout(events: list[Event]) -> dict[str, list[Event]]:
    out: dict[str, list[Event]] = {}
    for e in events:
        out.setdefault(e.rollout_id, []).append(e)
    for evs in out.values():
        evs.sort(key=lambda e: e.seq)
        assert [e.seq for e in evs] == list(range(len(evs)))
    return out


def calls_of(events: list[Event]) -> list[LlmCall]:
    return [e.body for e in events if isinstance(e.body, LlmCall)]


def full_prompts(calls: list[LlmCall]) -> list[np.ndarray]:
    """Rebuild every call's full prompt from the wire deltas (as a consumer would)."""
    trie = ContextTrie()
    return [trie.add_delta(c.call_id, c.parent_call_id, c.prefix_len, c.prompt_delta,
                           c.completion_ids) for c in calls]  # fmt: skip


def assert_append_only(calls: list[LlmCall]) -> list[np.ndarray]:
    prompts = full_prompts(calls)
    for prev, call, prompt, prev_prompt in zip(
        calls, calls[1:], prompts[1:], prompts, strict=False
    ):
        seq = np.concatenate([prev_prompt, prev.completion_ids])
        assert call.parent_call_id == prev.call_id
        assert call.prefix_len == len(seq)  # the whole previous sequence is shared
        assert np.array_equal(prompt[: len(seq)], seq)
    return prompts


# --------------------------------------------------------------------------- tests


def test_openai_client_multi_turn_with_tools(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, model_server: str
) -> None:
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [model_server])
    with running_proxy(settings) as (url, recorder, _):
        ro = create_rollout(url, task_id="weather", group_id="g-weather", metadata={"k": "v"})
        client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
        assert client.models.list().data[0].id == "rollstream-tiny"
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You answer with tools."},
                                      {"role": "user", "content": "Weather in Paris?"}]  # fmt: skip
        backend_ids, seeds = [], [11, 12, 13]
        for turn, seed in enumerate(seeds):
            resp = client.chat.completions.create(
                model="rollstream-tiny", messages=msgs, tools=TOOLS, max_tokens=12, seed=seed,
                temperature=1.0, extra_body={"return_token_ids": True},
            )  # fmt: skip
            choice = resp.choices[0]
            backend_ids.append(choice.model_extra["token_ids"])
            msgs.append(choice.message.model_dump(exclude_none=True))
            if turn == 0:  # the harness calls a tool, and the model reads the result
                fn = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
                call = {"id": "call_h1", "type": "function", "function": fn}
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
                msgs.append({"role": "tool", "tool_call_id": "call_h1", "content": "sunny, 21C"})
            else:
                msgs.append({"role": "user", "content": f"and turn {turn}?"})
        auth = {"Authorization": f"Bearer {ro['token']}"}
        last_call = resp.model_extra["rollstream"]["call_id"]
        tool = {"name": "get_weather", "arguments": {"city": "Paris"}, "result": "sunny, 21C",
                "duration_ms": 3.5, "at_call_id": last_call,
                "tool_call_id": "call_api_1"}  # fmt: skip
        r = httpx.post(f"{url}/v1/rollouts/{ro['rollout_id']}/tool_calls", json=tool, headers=auth)
        assert r.status_code == 200, r.text
        assert "duplicate" not in r.json()
        # the same tool call reported again (a retried request): answered, not recorded twice
        r = httpx.post(f"{url}/v1/rollouts/{ro['rollout_id']}/tool_calls", json=tool, headers=auth)
        assert r.status_code == 200 and r.json()["duplicate"] is True, r.text
        rewards = f"{url}/v1/rollouts/{ro['rollout_id']}/rewards"
        r = httpx.post(rewards, json={"value": 1.0}, headers=auth)  # final: the evaluator's
        assert r.status_code == 403 and r.json()["error"]["param"] == "kind", r.text
        r = httpx.post(rewards, json={"value": 0.5, "kind": "partial"}, headers=auth)
        assert r.status_code == 200, r.text
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = httpx.post(rewards, json={"value": 1.0, "evaluator": "judge"}, headers=admin)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/rollouts/{ro['rollout_id']}/finish", json={},
                       headers={"Authorization": f"Bearer {ro['token']}"})  # fmt: skip
        assert r.json()["finished"] is True
        assert recorder.flush(30)

    events = by_rollout(consume(kafka_settings))[ro["rollout_id"]]
    kinds = [e.kind for e in events]
    assert kinds == ["RolloutStarted", "LlmCall", "LlmCall", "LlmCall", "ToolCall", "Reward",
                     "Reward", "RolloutFinished"]  # fmt: skip
    rewards = [e.body for e in events if isinstance(e.body, Reward)]
    assert [(r.kind, r.value, r.evaluator) for r in rewards] == [
        (RewardKind.PARTIAL, 0.5, ""), (RewardKind.FINAL, 1.0, "judge")
    ]  # fmt: skip
    (tool_event,) = [e.body for e in events if isinstance(e.body, ToolCall)]
    assert (tool_event.name, tool_event.result) == ("get_weather", "sunny, 21C")
    assert tool_event.at_call_id == calls_of(events)[-1].call_id
    assert events[0].body.task_id == "weather" and events[0].body.metadata == {"k": "v"}
    calls = calls_of(events)
    prompts = assert_append_only(calls)
    for call, prompt, ids, seed in zip(calls, prompts, backend_ids, seeds, strict=True):
        assert call.completion_ids.tolist() == ids
        assert call.backend == model_server and call.policy_version == 0
        assert call.latency_ms > 0 and call.usage.prompt_tokens == len(prompt)
        # the backend, asked directly with the recorded prompt, samples the recorded tokens
        direct = httpx.post(f"{model_server}/v1/completions", json={
            "prompt": prompt.tolist(), "max_tokens": 12, "seed": seed, "temperature": 1.0,
            "return_token_ids": True, "skip_special_tokens": False}).json()  # fmt: skip
        assert direct["choices"][0]["token_ids"] == call.completion_ids.tolist()
    # the harness's tool call and the tool result were rendered into the third prompt
    chat = ChatTemplate.from_dir(model_dir)
    text = chat.decode(prompts[1], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>tool\nsunny, 21C<|im_end|>" in text


def test_streaming_chain(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, model_server: str
) -> None:
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [model_server])
    with running_proxy(settings) as (url, recorder, _):
        ro = create_rollout(url)
        client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "Tell me a story."}]
        streamed = []
        for turn in range(3):
            stream = client.chat.completions.create(
                model="m", messages=msgs, max_tokens=10, seed=turn, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            chunks = list(stream)
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            assert finish in ("stop", "length")
            streamed.append(text)
            msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        assert recorder.flush(30)

    calls = calls_of(by_rollout(consume(kafka_settings))[ro["rollout_id"]])
    assert len(calls) == 3
    assert_append_only(calls)
    chat = ChatTemplate.from_dir(model_dir)
    assert [chat.decode(c.completion_ids) for c in calls] == streamed


def test_tool_calls_and_drift_with_scripted_backend(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path
) -> None:
    chat = ChatTemplate.from_dir(model_dir)
    eos = chat.eos_id
    hello = [chat.tokenizer.token_to_id(c) for c in "Hello"] + [eos]  # H e l l o: not BPE's way
    assert chat.encode("Hello").tolist() != hello[:-1]
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    tool_ids = [*chat.encode(call_text).tolist(), eos]
    backend = ScriptedBackend()
    backend.script.extend([hello, tool_ids, [*chat.encode("Done.").tolist(), eos]])
    with serve(backend.app()) as burl:
        settings = proxy_settings(kafka_settings, tmp_path, model_dir, [burl])
        with running_proxy(settings) as (url, recorder, _):
            ro = create_rollout(url)
            client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
            msgs: list[dict[str, Any]] = [{"role": "user", "content": "Greet me"}]
            r1 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
            assert r1.choices[0].message.content == "Hello"
            msgs += [r1.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "Weather in Oslo?"}]  # fmt: skip
            r2 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
            (tc,) = r2.choices[0].message.tool_calls
            assert r2.choices[0].finish_reason == "tool_calls"
            assert (tc.function.name, tc.function.arguments) == ("get_weather", '{"city": "Oslo"}')
            msgs += [r2.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": "snow"}]  # fmt: skip
            r3 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
            assert r3.choices[0].message.content == "Done."
            assert r2.model_extra["rollstream"]["drift_tokens"] > 0
            assert recorder.flush(30)

    events = by_rollout(consume(kafka_settings))[ro["rollout_id"]]
    calls = calls_of(events)
    prompts = assert_append_only(calls)
    assert backend.prompts == [p.tolist() for p in prompts]  # what the backend got
    retok = [*chat.encode("Hello").tolist(), eos]
    shared = next(i for i, (x, y) in enumerate(zip(hello, retok, strict=False)) if x != y)
    assert calls[1].drift_tokens == max(len(hello), len(retok)) - shared > 0
    assert calls[0].drift_tokens == 0 and calls[2].drift_tokens == 0  # tool call: canonical
    assert prompts[1][len(prompts[0]) : len(prompts[0]) + len(hello)].tolist() == hello
    (tool_event,) = [e.body for e in events if isinstance(e.body, ToolCall)]
    assert (tool_event.tool_call_id, tool_event.name, tool_event.result) == (
        tc.id,
        "get_weather",
        "snow",
    )
    assert tool_event.at_call_id == calls[1].call_id


def test_edited_history_is_a_rewind(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path
) -> None:
    chat = ChatTemplate.from_dir(model_dir)
    backend = ScriptedBackend()
    backend.default = [*chat.encode("Sure thing.").tolist(), chat.eos_id]
    with serve(backend.app()) as burl:
        settings = proxy_settings(kafka_settings, tmp_path, model_dir, [burl])
        with running_proxy(settings) as (url, recorder, _):
            ro = create_rollout(url)
            client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
            msgs: list[dict[str, Any]] = [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "First question"},
            ]
            for q in ("Second question", "Third question"):
                r = client.chat.completions.create(model="m", messages=msgs)
                msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": q}]  # fmt: skip
            client.chat.completions.create(model="m", messages=msgs)
            edited = [msgs[0], {"role": "user", "content": "First question, edited"}, *msgs[2:]]
            client.chat.completions.create(model="m", messages=edited)
            assert recorder.flush(30)

    calls = calls_of(by_rollout(consume(kafka_settings))[ro["rollout_id"]])
    prompts = full_prompts(calls)
    assert_append_only(calls[:3])
    rewind = calls[3]
    assert np.array_equal(prompts[3], np.asarray(backend.prompts[3], dtype=np.uint32))
    parent = calls[[c.call_id for c in calls].index(rewind.parent_call_id)]
    parent_seq = np.concatenate([prompts[calls.index(parent)], parent.completion_ids])
    shared = int(np.argmax(parent_seq[: len(prompts[3])] != prompts[3][: len(parent_seq)]))
    assert rewind.prefix_len == shared < len(parent_seq)  # a rewind to the edit point
    system_len = len(chat.encode(chat.render([msgs[0]], None, False)))
    assert system_len <= rewind.prefix_len < len(prompts[0])
    assert len(rewind.prompt_delta) == len(prompts[3]) - shared


def test_pool_failover_when_a_backend_is_killed(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path
) -> None:
    (pa, ua), (pb, ub) = start_model_server(model_dir), start_model_server(model_dir)
    try:
        settings = proxy_settings(kafka_settings, tmp_path, model_dir, [ua, ub])
        with running_proxy(settings) as (url, recorder, proxy):
            rollouts = [create_rollout(url, task_id=f"t{i}") for i in range(6)]

            async def harness(ro: dict[str, Any], gate: asyncio.Event, done1: asyncio.Event) -> int:
                client = openai.AsyncOpenAI(
                    base_url=ro["base_url"], api_key=ro["token"], max_retries=0
                )
                msgs: list[dict[str, Any]] = [{"role": "user", "content": "Count with me"}]
                for turn in range(4):
                    if turn == 1:
                        done1.set()
                        await gate.wait()
                    r = await client.chat.completions.create(model="m", messages=msgs,
                                                             max_tokens=6, seed=turn)  # fmt: skip
                    msgs += [r.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": f"next {turn}"}]  # fmt: skip
                await client.close()
                return 4

            async def main() -> list[int]:
                gate = asyncio.Event()
                firsts = [asyncio.Event() for _ in rollouts]
                tasks = [
                    asyncio.create_task(harness(ro, gate, f))
                    for ro, f in zip(rollouts, firsts, strict=True)
                ]
                await asyncio.gather(*(f.wait() for f in firsts))
                homes = {
                    ro["rollout_id"]: proxy.pool.backend_of(ro["rollout_id"]) for ro in rollouts
                }
                assert set(homes.values()) == {ua, ub}  # spread over both
                gate.set()
                await asyncio.sleep(0.05)  # second calls in flight
                pa.send_signal(signal.SIGKILL)  # one backend dies with rollouts pinned to it
                return await asyncio.gather(*tasks)

            assert asyncio.run(main()) == [4] * 6
            st = proxy.pool.stats
            assert st.moved == 3 and st.completed == 24
            for ro in rollouts:
                assert proxy.pool.backend_of(ro["rollout_id"]) == ub
                proxy.rollouts.finish(ro["rollout_id"], "completed")
            assert recorder.flush(30)
    finally:
        stop(pa)
        stop(pb)

    grouped = by_rollout(consume(kafka_settings))
    assert len(grouped) == 6
    for evs in grouped.values():
        calls = calls_of(evs)
        assert len(calls) == 4  # no call lost
        assert_append_only(calls)
        assert calls[-1].backend == ub
        assert not any(isinstance(e.body, RolloutError) for e in evs)


def test_pause_drain_resume_and_weight_update_under_load(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, model_server: str
) -> None:
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [model_server])
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with running_proxy(settings) as (url, recorder, proxy):
        rollouts = [create_rollout(url, task_id=f"t{i}") for i in range(4)]
        finished_at: list[float] = []
        failures: list[BaseException] = []

        async def harness(ro: dict[str, Any], stop_at: asyncio.Event) -> None:
            client = openai.AsyncOpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
            msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
            while not stop_at.is_set():
                try:
                    r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
                except openai.OpenAIError as exc:
                    failures.append(exc)
                    return
                finished_at.append(time.monotonic())
                msgs += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "again"}]  # fmt: skip
            await client.close()

        async def main() -> None:
            stop_at = asyncio.Event()
            tasks = [asyncio.create_task(harness(ro, stop_at)) for ro in rollouts]
            async with httpx.AsyncClient(base_url=url, headers=admin, timeout=60) as http:
                await asyncio.sleep(1.0)
                r = await http.post("/v1/admin/pause", params={"drain": "true"})
                assert r.json() == {"paused": True, "drained": True, "inflight": 0}
                dispatched = proxy.pool.stats.dispatched
                await asyncio.sleep(0.3)  # answers of the drained calls reach the clients
                answered = len(finished_at)
                await asyncio.sleep(1.0)
                assert proxy.pool.stats.dispatched == dispatched  # nothing went to the backend
                assert len(finished_at) == answered  # and nothing was answered
                assert (await http.post("/v1/admin/resume")).json() == {"paused": False}
                await asyncio.sleep(0.5)
                r = await http.post("/v1/admin/update_weights",
                                    json={"path": str(model_dir), "version": 1})  # fmt: skip
                assert r.status_code == 200 and r.json()["reloaded"] == 1, r.text
                await asyncio.sleep(1.0)
                status = (await http.get("/v1/admin/status")).json()
                assert status["policy_version"] == 1 and status["stats"]["paused_waits"] > 0
            stop_at.set()
            await asyncio.gather(*tasks)

        asyncio.run(main())
        assert failures == []
        for ro in rollouts:
            proxy.rollouts.finish(ro["rollout_id"], "completed")
        assert recorder.flush(30)

    grouped = by_rollout(consume(kafka_settings))
    versions = []
    for evs in grouped.values():
        calls = calls_of(evs)
        assert_append_only(calls)
        mine = [c.policy_version for c in calls]
        assert mine == sorted(mine)  # version 0, then 1 after the update
        versions += mine
        assert not any(isinstance(e.body, RolloutError) for e in evs)
    assert versions.count(1) > 0 and versions.count(0) > 0


def test_lifecycle_events_admin_only_in_order(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path
) -> None:
    backend = ScriptedBackend()
    backend.script.append([7, 8, ChatTemplate.from_dir(model_dir).eos_id])
    with serve(backend.app()) as burl:
        settings = proxy_settings(kafka_settings, tmp_path, model_dir, [burl])
        with running_proxy(settings) as (url, recorder, _):
            ro = create_rollout(url, task_id="life")
            events_url = f"{url}/v1/rollouts/{ro['rollout_id']}/events"
            admin = {"Authorization": f"Bearer {ADMIN}"}
            harness = {"Authorization": f"Bearer {ro['token']}"}

            def post(body: Any, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
                r = httpx.post(events_url, json=body, headers=headers)
                return r.status_code, r.json()

            init = [
                {"type": "stage", "stage": "init", "phase": "started", "job_id": "j1",
                 "worker": "w1"},
                {"type": "sandbox", "phase": "ready", "sandbox_id": "sb1", "kind": "bwrap",
                 "duration_ms": 12.5, "job_id": "j1"},
                {"type": "stage", "stage": "init", "phase": "finished", "status": "ok",
                 "duration_ms": 20.0, "job_id": "j1", "worker": "w1"},
            ]  # fmt: skip
            status, body = post({"events": init}, admin)
            assert status == 200 and body["recorded"] == 3, body
            # a harness token may not post them (even its own rollout's), nor no token
            status, body = post({"events": init[:1]}, harness)
            assert status == 403 and body["error"]["code"] == "forbidden"
            assert post({"events": init[:1]}, {})[0] == 401
            # a bad field: 400 naming it, nothing recorded
            bad_stage = [init[0], {**init[2], "stage": "deploy"}]
            status, body = post({"events": bad_stage}, admin)
            assert status == 400 and body["error"]["param"] == "events[1].stage", body
            status, body = post({"events": [{**init[2], "status": ""}]}, admin)
            assert status == 400 and body["error"]["param"] == "events[0].status"
            status, body = post({"events": [{"type": "sandbox", "phase": "ready"}]}, admin)
            assert status == 400 and body["error"]["param"] == "events[0].sandbox_id"
            status, body = post({"events": [{**init[0], "worker": "w" * 300}]}, admin)
            assert status == 400 and body["error"]["param"] == "events[0].worker"
            status, body = post({"events": [{"type": "logs"}]}, admin)
            assert status == 400 and body["error"]["param"] == "events[0].type"
            client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            done = [
                {"type": "evaluator_output", "evaluator": "suite", "status": "ok", "passed": 2,
                 "total": 3, "output": "x" * 9000, "job_id": "j1"},
                {"type": "sandbox", "phase": "released", "sandbox_id": "sb1", "kind": "bwrap",
                 "duration_ms": 3.0, "job_id": "j1"},
            ]  # fmt: skip
            assert post({"events": done}, admin)[0] == 200
            fin = httpx.post(
                f"{url}/v1/rollouts/{ro['rollout_id']}/finish", json={}, headers=harness
            )
            assert fin.status_code == 200
            status, body = post({"events": done[1:]}, admin)
            assert status == 409 and body["error"]["code"] == "rollout_finished"
            assert recorder.flush(30)

    events = by_rollout(consume(kafka_settings))[ro["rollout_id"]]
    assert [e.kind for e in events] == [
        "RolloutStarted", "StageEvent", "SandboxEvent", "StageEvent", "LlmCall",
        "EvaluatorOutput", "SandboxEvent", "RolloutFinished",
    ]  # fmt: skip
    started, ready, finished = (e.body for e in events[1:4])
    assert isinstance(started, StageEvent) and isinstance(finished, StageEvent)
    assert (started.stage, started.phase, started.status, started.worker) == (
        "init",
        "started",
        "",
        "w1",
    )
    assert (finished.phase, finished.status, finished.duration_ms) == ("finished", "ok", 20.0)
    assert isinstance(ready, SandboxEvent)
    assert (ready.sandbox_id, ready.phase, ready.kind, ready.duration_ms) == (
        "sb1",
        "ready",
        "bwrap",
        12.5,
    )
    output = events[5].body
    assert isinstance(output, EvaluatorOutput)
    assert (output.passed, output.total, len(output.output), output.output_truncated) == (
        2,
        3,
        8192,
        True,
    )


def test_bad_input_answers(kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path) -> None:
    backend = ScriptedBackend()
    with serve(backend.app()) as burl:
        dead = f"http://127.0.0.1:{free_port()}"
        settings = proxy_settings(kafka_settings, tmp_path, model_dir, [burl],
                                  proxy_max_body_bytes=4096, proxy_max_prompt_tokens=200,
                                  proxy_backend_wait_s=0.5, proxy_health_interval_s=60)  # fmt: skip
        with running_proxy(settings) as (url, recorder, proxy):
            a, b = create_rollout(url, final_rewards="harness"), create_rollout(url)
            chat_a = f"{a['base_url']}/chat/completions"
            auth = {"Authorization": f"Bearer {a['token']}"}
            ok = {"messages": [{"role": "user", "content": "hi"}]}

            def post(u: str, **kw: Any) -> tuple[int, dict[str, Any]]:
                r = httpx.post(u, **kw)
                body = r.json()
                if r.status_code != 200:
                    assert set(body["error"]) == {"message", "type", "param", "code"}
                return r.status_code, body

            assert post(chat_a, content=b"{not json", headers=auth)[0] == 400
            status, body = post(chat_a, json={"messages": [{"role": "user"}]}, headers=auth)
            assert status == 400 and body["error"]["param"] == "messages[0].content"
            status, body = post(chat_a, json={**ok, "temperature": "hot"}, headers=auth)
            assert status == 400 and body["error"]["param"] == "temperature"
            assert post(chat_a, json=ok)[0] == 401
            assert post(chat_a, json=ok, headers={"Authorization": "Bearer rs1.x.y"})[0] == 401
            status, body = post(chat_a, json=ok, headers={"Authorization": f"Bearer {b['token']}"})
            assert status == 403 and body["error"]["code"] == "forbidden"
            big = {"messages": [{"role": "user", "content": "x" * 5000}]}
            assert post(chat_a, json=big, headers=auth)[0] == 413
            long = {"messages": [{"role": "user", "content": "word " * 300}]}
            status, body = post(chat_a, json=long, headers=auth)
            assert status == 400 and body["error"]["code"] == "context_length_exceeded"
            assert body["error"]["type"] == "invalid_request_error"
            # the official client raises its BadRequestError, and does not retry it
            client = openai.OpenAI(base_url=a["base_url"], api_key=a["token"], max_retries=3)
            t0 = time.monotonic()
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="policy", messages=long["messages"])
            assert err.value.code == "context_length_exceeded"
            assert "maximum context length is 200 tokens" in err.value.message
            assert time.monotonic() - t0 < 2.0  # no backoff: not retried
            assert post(f"{url}/rollouts/nope/v1/chat/completions", json=ok,
                        headers={"Authorization": f"Bearer {ADMIN}"})[0] == 404  # fmt: skip
            assert post(f"{url}/v1/rollouts", json={"task_id": "x"})[0] == 401
            assert post(chat_a, json=ok, headers=auth)[0] == 200  # the unscoped URL works too
            assert post(f"{url}/v1/chat/completions", json=ok, headers=auth)[0] == 200
            assert httpx.get(f"{url}/openapi.json").json()["openapi"].startswith("3.")
            # backend down: 503, recorded as a RolloutError
            proxy.pool.members[0].backend.base_url = dead
            status, body = post(chat_a, json=ok, headers=auth)
            assert status == 503 and body["error"]["code"] == "backend_unavailable"
            proxy.pool.members[0].backend.base_url = burl
            # a reward outside [-1e6, 1e6] (the processors would dead-letter it) is 400 naming
            # `value`, and nothing of a refused batch is recorded; the bound itself passes
            rewards = f"{url}/v1/rollouts/{a['rollout_id']}/rewards"
            bound = f"must be a number in [-{REWARD_BOUND:g}, {REWARD_BOUND:g}]"
            for bad in (1e6 + 1, -1.7e308, True, "1", None):
                status, body = post(rewards, json={"value": bad}, headers=auth)
                assert status == 400 and body["error"]["param"] == "value", (bad, body)
                assert bound in body["error"]["message"]
            for bad_json in (b'{"value": NaN}', b'{"value": Infinity}', b'{"value": 1e400}'):
                status, body = post(rewards, content=bad_json, headers=auth)  # not even JSON
                assert status == 400 and body["error"]["code"] == "invalid_json", (bad_json, body)
            batch = {"rewards": [{"value": 0.5}, {"value": -2e6, "kind": "partial"}]}
            status, body = post(rewards, json=batch, headers=auth)
            assert status == 400 and body["error"]["param"] == "rewards[1].value"
            edges = [{"value": REWARD_BOUND}, {"value": -REWARD_BOUND, "kind": "penalty"}]
            status, body = post(rewards, json={"rewards": edges}, headers=auth)
            assert status == 200 and body["recorded"] == 2
            post(f"{url}/v1/rollouts/{a['rollout_id']}/finish", json={"status": "failed"},
                 headers=auth)  # fmt: skip
            status, body = post(chat_a, json=ok, headers=auth)
            assert status == 409 and body["error"]["code"] == "rollout_finished"
            assert recorder.flush(30)

    events = by_rollout(consume(kafka_settings))[a["rollout_id"]]
    (err,) = [e.body for e in events if isinstance(e.body, RolloutError)]
    assert err.code == 503 and err.backend == burl and err.call_id
    assert [e.kind for e in events][-1] == "RolloutFinished"
    assert len(calls_of(events)) == 2
    assert [e.body.value for e in events if isinstance(e.body, Reward)] == [1e6, -1e6]


def test_policy_watcher_dead_letters_an_undecodable_record(kafka_settings: CommonSettings) -> None:
    """On the real broker: the watcher starts at the topic's last record, an undecodable one,
    sends it unchanged to the DLQ topic with the shared headers, and applies the next
    PolicyVersion."""
    topics = kafka_settings.topics()
    producer = Producer(kafka_settings.kafka_config())
    producer.produce(topics.policy, key=b"bad", value=b"\x00not a policy version")
    assert producer.flush(30) == 0
    applied: list[tuple[str, int]] = []

    async def apply(uri: str, version: int) -> None:
        applied.append((uri, version))

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def current() -> int:
            return max((v for _, v in applied), default=0)

        watcher = PolicyWatcher(kafka_settings, loop, apply, current, poll_s=0.1).start()
        deadline = time.monotonic() + 60
        while watcher.dead_letters == 0:
            assert time.monotonic() < deadline, "no dead letter"
            await asyncio.sleep(0.05)
        pv = PolicyVersion(1, "file:///ckpt/1", 10, 1_735_689_600_000_000)
        producer.produce(topics.policy, value=codec.encode(pv))
        assert producer.flush(30) == 0
        while not applied:
            assert time.monotonic() < deadline, "the next version was not applied"
            await asyncio.sleep(0.05)
        await asyncio.to_thread(watcher.stop)

    asyncio.run(main())
    assert applied == [("file:///ckpt/1", 1)]
    (dead,) = read_topic(kafka_settings, topics.dlq, 30)
    assert (dead.key(), dead.value()) == (b"bad", b"\x00not a policy version")
    headers = read_headers(dead.headers())
    assert [name for name, _ in dead.headers()] == list(HEADER_NAMES)
    assert (headers["stage"], headers["code"]) == ("policy_watcher", CODE_UNDECODABLE)
    assert (headers["original_topic"], headers["original_offset"]) == (topics.policy, "0")


def test_n_choices_are_sibling_samples_on_the_log(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, model_server: str
) -> None:
    """n=3 through the official client: three choices sampled by the reference server (seeds
    s, s+1, s+2), three LlmCalls with one full prompt on the log; the harness keeps choice 1,
    and the next call extends choice 1's sequence."""
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [model_server])
    with running_proxy(settings) as (url, recorder, _):
        ro = create_rollout(url)
        client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "Say something."}]
        resp = client.chat.completions.create(
            model="m", messages=msgs, n=3, max_tokens=8, seed=5,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        assert [c.index for c in resp.choices] == [0, 1, 2]
        ids = [c.model_extra["token_ids"] for c in resp.choices]
        assert resp.usage.completion_tokens == sum(map(len, ids))
        call_ids = resp.model_extra["rollstream"]["call_ids"]
        kept = resp.choices[1].message.model_dump(exclude_none=True)
        msgs += [kept, {"role": "user", "content": "Go on."}]
        client.chat.completions.create(model="m", messages=msgs, max_tokens=8, seed=9)
        assert recorder.flush(30)

    calls = calls_of(by_rollout(consume(kafka_settings))[ro["rollout_id"]])
    assert [c.call_id for c in calls[:3]] == call_ids and len(calls) == 4
    assert [c.completion_ids.tolist() for c in calls[:3]] == ids
    prompts = full_prompts(calls)
    prompt = prompts[0]
    assert resp.usage.prompt_tokens == len(prompt)
    for i in (1, 2):
        assert np.array_equal(prompts[i], prompt)
        assert calls[i].prefix_len == len(prompt) and len(calls[i].prompt_delta) == 0
        assert calls[i].parent_call_id in call_ids[:i]
    for i, seed in enumerate((5, 6, 7)):  # each choice is the backend's sample for its seed
        direct = httpx.post(f"{model_server}/v1/completions", json={
            "prompt": prompt.tolist(), "max_tokens": 8, "seed": seed, "temperature": 1.0,
            "return_token_ids": True, "skip_special_tokens": False}).json()  # fmt: skip
        assert direct["choices"][0]["token_ids"] == ids[i]
    nxt = calls[3]
    assert nxt.parent_call_id == call_ids[1]
    assert nxt.prefix_len == len(prompt) + len(ids[1])


def test_top_logprobs_response_format_and_tool_choice(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, model_server: str
) -> None:
    """From the real reference server: top_logprobs=2 gives two alternatives per token, best
    first, while the LlmCall keeps the sampled tokens' logprobs. response_format json_object is
    refused (the reference server cannot constrain decoding); tool_choice "required" is
    answered as sampled, with tool_choice_met false when the reply has no tool call."""
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [model_server])
    with running_proxy(settings) as (url, recorder, _):
        ro = create_rollout(url)
        client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "Count to three."}]
        resp = client.chat.completions.create(
            model="m", messages=msgs, max_tokens=10, seed=3, logprobs=True, top_logprobs=2
        )
        content = resp.choices[0].logprobs.content
        for entry in content:
            assert len(entry.top_logprobs) == 2
            best, second = entry.top_logprobs
            assert best.logprob >= second.logprob
            assert entry.logprob <= best.logprob + 1e-5  # top-k of the same distribution
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="m", messages=msgs, response_format={"type": "json_object"}
            )
        assert err.value.param == "response_format" and err.value.code == "unsupported"
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="m", messages=msgs, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_time"}},
            )  # fmt: skip
        assert err.value.param == "tool_choice"
        forced = client.chat.completions.create(
            model="m", messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=6, seed=1
        )
        choice = forced.choices[0]
        met = choice.model_extra["tool_choice_met"]
        assert met is bool(choice.message.tool_calls)
        assert (choice.finish_reason == "tool_calls") is met
        assert recorder.flush(30)

    calls = calls_of(by_rollout(consume(kafka_settings))[ro["rollout_id"]])
    assert len(calls) == 2  # the refused requests are not recorded
    assert calls[0].completion_logprobs.tolist() == pytest.approx([e.logprob for e in content])


def test_interrupting_weight_update_continues_calls_on_the_new_weights(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, model_server: str
) -> None:
    """``proxy_weight_update_mode=interrupt``: an update cuts the generations in flight (the
    reference server pauses with mode=abort) and each goes on under the new weights. The client
    gets one whole answer (max_tokens tokens, plain or streamed); the log holds one LlmCall per
    part, the later extending the earlier, each with its version; the stream core builds one
    sample whose tokens carry both versions."""
    from rollstream.schemas import Trajectory
    from rollstream.streams.core.samples import SampleConfig, build_samples
    from rollstream.streams.core.trajectory import apply

    settings = proxy_settings(
        kafka_settings, tmp_path, model_dir, [model_server], proxy_weight_update_mode="interrupt"
    )
    admin = {"Authorization": f"Bearer {ADMIN}"}
    n_plain, n_streamed, max_tokens = 5, 5, 400
    with running_proxy(settings) as (url, recorder, proxy):
        old = proxy.pool.policy_version
        rollouts = [create_rollout(url, task_id=f"i{i}") for i in range(n_plain + n_streamed)]

        async def plain(ro: dict[str, Any]) -> tuple[int, str]:
            client = openai.AsyncOpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
            r = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "go on"}],
                max_tokens=max_tokens, extra_body={"return_token_ids": True},
            )  # fmt: skip
            await client.close()
            return len(r.choices[0].model_extra["token_ids"]), r.choices[0].finish_reason

        midway: list[asyncio.Event] = []  # set once a stream is 10 chunks into its answer

        async def streamed(ro: dict[str, Any]) -> tuple[int, str]:
            client = openai.AsyncOpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "go on"}],
                max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            finish, tokens, chunks = "", 0, 0
            async for chunk in stream:
                chunks += 1
                if chunks == 10 and not finish:
                    midway[0].set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            await client.close()
            return tokens, finish

        async def main() -> tuple[list[tuple[int, str]], dict[str, Any]]:
            midway.append(asyncio.Event())
            tasks = [asyncio.create_task(streamed(ro)) for ro in rollouts[n_plain:]]
            tasks += [asyncio.create_task(plain(ro)) for ro in rollouts[:n_plain]]
            # the update comes while a stream is in the middle of its answer (the reference
            # server runs one batch at a time: calls queued behind it start on the new weights)
            await asyncio.wait_for(midway[0].wait(), 30)
            async with httpx.AsyncClient(base_url=url, headers=admin, timeout=60) as http:
                r = await http.post("/v1/admin/update_weights",
                                    json={"path": str(model_dir), "version": old + 1})  # fmt: skip
                assert r.status_code == 200, r.text
            answers = await asyncio.gather(*tasks)
            return answers[n_streamed:] + answers[:n_streamed], r.json()

        answers, update = asyncio.run(main())
        assert update["mode"] == "interrupt" and update["reloaded"] == 1
        cut = proxy.pool.stats.interrupted
        assert cut >= 1  # 400-token generations were in flight
        for tokens, finish in answers:  # whole answers, cut or not
            assert finish in ("stop", "length") and 0 < tokens <= max_tokens
            assert finish == "stop" or tokens == max_tokens
        for ro in rollouts:
            proxy.rollouts.finish(ro["rollout_id"], "completed")
        assert recorder.flush(30)

    grouped = by_rollout(consume(kafka_settings))
    split = streamed_split = 0
    for i, ro in enumerate(rollouts):
        events = grouped[ro["rollout_id"]]
        calls = calls_of(events)
        prompts = assert_append_only(calls)
        if len(calls) == 1:
            continue
        split += 1
        streamed_split += i >= n_plain
        parts = calls[:-1]
        assert [c.finish_reason for c in parts] == ["abort"] * len(parts)
        assert [c.policy_version for c in calls] == [old] * len(parts) + [old + 1]
        for before, after, prompt in zip(calls, calls[1:], prompts[1:], strict=False):
            assert after.parent_call_id == before.call_id and len(after.prompt_delta) == 0
            assert after.prefix_len == len(prompt)  # the earlier part's prompt and tokens
        total = sum(len(c.completion_ids) for c in calls)
        state, out = None, []
        for e in events:
            state, o = apply(state, e)
            out += o
        [t] = [o for o in out if isinstance(o, Trajectory)]
        [sample] = build_samples(t, SampleConfig(mode="path"))
        versions = sample.token_policy_versions[sample.loss_mask.astype(bool)]
        assert len(versions) == total and sample.policy_version == old
        assert versions[0] == old and versions[-1] == old + 1
        assert sorted(sample.policy_versions) == [old, old + 1]
    assert 1 <= split <= cut  # a cut call is on the log in parts (none if cut before a token)
    assert streamed_split >= 1  # a streamed call went on too
