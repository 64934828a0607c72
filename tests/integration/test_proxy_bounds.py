"""Hostile values through the real proxy (uvicorn) on the real Kafka broker: every one is a 4xx
whose ``param`` names the field (401 for a token that is not one), never a 500, and nothing of
a refused request reaches the log; the values at the bounds themselves pass and read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from test_proxy import (  # model_dir: the module fixture shared with test_proxy
    ADMIN,
    ScriptedBackend,
    by_rollout,
    consume,
    create_rollout,
    model_dir,
    proxy_settings,
    running_proxy,
    serve,
)

from rollstream.producers.proxy.openai_wire import MAX_JSON_DEPTH, MAX_REWARDS
from rollstream.schemas import CommonSettings, RolloutStarted, ToolCall
from rollstream.schemas.events import (
    METADATA_MAX_KEYS,
    POLICY_VERSION_MAX,
    SAFE_INT_MAX,
    SAMPLING_MAX_KEYS,
    TOKEN_ID_MAX,
)

__all__ = ["model_dir"]  # the module fixture shared with test_proxy

ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


def deep(depth: int) -> str:
    """A JSON value nesting ``depth`` arrays (as text: past what json.dumps writes)."""
    return "[" * depth + "]" * depth


def post(url: str, **kw: Any) -> tuple[int, dict[str, Any]]:
    r = httpx.post(url, timeout=30, **kw)
    body = r.json()
    if r.status_code != 200 and r.status_code != 201:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return r.status_code, body


def refused(url: str, param: str | None, status: int = 400, **kw: Any) -> str:
    got, body = post(url, **kw)
    assert got == status, (param, got, body)
    if param is not None:
        assert body["error"]["param"] == param, (param, body)
    return str(body["error"]["message"])


def test_hostile_values_are_4xx_naming_the_field(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path
) -> None:
    backend = ScriptedBackend()
    with serve(backend.app()) as burl:
        settings = proxy_settings(
            kafka_settings, tmp_path, model_dir, [burl], proxy_max_body_bytes=4 << 20
        )
        with running_proxy(settings) as (url, recorder, _proxy):
            rollouts = f"{url}/v1/rollouts"
            # --- the rollout API: counts, sampling, metadata (size and depth)
            many_meta = {str(i): "v" for i in range(METADATA_MAX_KEYS + 1)}
            many_sampling = {str(i): 1.0 for i in range(SAMPLING_MAX_KEYS + 1)}
            for body, param in (
                ({"attempt": 2**64 - 1}, "attempt"),  # wrapped to -1 before
                ({"group_size": 2**63}, "group_size"),
                ({"attempt": SAFE_INT_MAX + 1}, "attempt"),
                ({"sampling": {"temperature": 10**30}}, "sampling.temperature"),
                ({"sampling": many_sampling}, "sampling"),
                ({"metadata": many_meta}, "metadata"),
            ):
                refused(rollouts, param, json={"task_id": "t", **body}, headers=ADMIN_AUTH)
            raw = f'{{"task_id": "t", "metadata": {{"a": {deep(300)}}}}}'.encode()
            msg = refused(rollouts, "metadata", content=raw, headers=ADMIN_AUTH)
            assert f"deeper than {MAX_JSON_DEPTH} levels" in msg
            edge = f'{{"task_id": "t", "attempt": {SAFE_INT_MAX}, "metadata": ' + (
                f'{{"a": {deep(MAX_JSON_DEPTH - 2)}}}}}'  # body 1 + metadata 1 + 30 = 32
            )
            ok = post(rollouts, content=edge.encode(), headers=ADMIN_AUTH)
            assert ok[0] == 201, ok
            edge_id = ok[1]["rollout_id"]

            ro = create_rollout(url)
            auth = {"Authorization": f"Bearer {ro['token']}"}
            rid = ro["rollout_id"]
            # --- token ids of a text completion: uint32, never an OverflowError
            completions = f"{ro['base_url']}/completions"
            for ids in ([2**63], [2**64 - 1], [TOKEN_ID_MAX + 1], [1, -1]):
                refused(completions, "prompt", json={"prompt": ids}, headers=auth)
            # --- every int within +-2**53 - 1; the admin's policy version too
            chat = f"{ro['base_url']}/chat/completions"
            hi = {"messages": [{"role": "user", "content": "hi"}]}
            refused(chat, "seed", json={**hi, "seed": 2**64 - 1}, headers=auth)
            refused(chat, "max_tokens", json={**hi, "max_tokens": 2**63}, headers=auth)
            weights = f"{url}/v1/admin/update_weights"
            msg = refused(weights, "version", json={"path": "/x", "version": 2**64 - 1},
                          headers=ADMIN_AUTH)  # fmt: skip
            assert str(POLICY_VERSION_MAX) in msg
            # --- nesting: a body field, and JSON text in a tool call's arguments
            tools_raw = f'{{"messages": [{{"role": "user", "content": "x"}}], "tools": {deep(99)}}}'
            refused(chat, "tools", content=tools_raw.encode(), headers=auth)
            args = "[" * 1100  # a JSON *string* python's json recurses out on (RecursionError)
            history = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"},
            ]  # fmt: skip
            status, body = post(chat, json={"messages": history}, headers=auth)
            assert status == 200, body
            # --- the rollout routes: rewards, tool calls
            rewards = f"{url}/v1/rollouts/{rid}/rewards"
            batch = {"rewards": [{"value": 0.0}] * (MAX_REWARDS + 1)}
            refused(rewards, "rewards", json=batch, headers=auth)
            tools = f"{url}/v1/rollouts/{rid}/tool_calls"
            refused(tools, "duration_ms", json={"name": "t", "duration_ms": 10**30}, headers=auth)
            raw = f'{{"name": "t", "arguments": {{"a": {deep(100)}}}}}'.encode()
            refused(tools, "arguments", content=raw, headers=auth)
            status, _ = post(tools, json={"name": "t", "arguments": {"q": [[1]]}}, headers=auth)
            assert status == 200
            # --- a token that is not ASCII is no token: 401, on every way a token comes in
            for header in (
                {b"Authorization": b"Bearer rs1.\xc3\xa9.x"},
                {b"Authorization": b"Bearer " + ro["token"].encode() + b"\xe9"},
            ):
                refused(chat, None, 401, json=hi, headers=header)
                refused(rewards, None, 401, json={"value": 1.0}, headers=header)
                refused(rollouts, None, 401, json={"task_id": "t"}, headers=header)
            messages = f"{url}/rollouts/{rid}/v1/messages"
            r = httpx.post(messages, headers={b"x-api-key": b"rs1.\xe9\xe9"},
                           json={"max_tokens": 4, **hi})  # fmt: skip
            assert r.status_code == 401, r.text
            assert post(f"{url}/v1/rollouts/{rid}/finish", json={}, headers=auth)[0] == 200
            assert recorder.flush(30)

    events = by_rollout(consume(kafka_settings))
    assert set(events) == {edge_id, rid}  # no refused create reached the log
    (started,) = [e.body for e in events[edge_id] if isinstance(e.body, RolloutStarted)]
    assert started.attempt == SAFE_INT_MAX  # the bound itself, read back exactly
    kinds = [e.kind for e in events[rid]]  # the chat call with deep arguments, the tool call
    assert kinds == ["RolloutStarted", "LlmCall", "ToolCall", "RolloutFinished"]
    (recorded,) = [e.body for e in events[rid] if isinstance(e.body, ToolCall)]
    assert recorded.arguments == '{"q": [[1]]}'
