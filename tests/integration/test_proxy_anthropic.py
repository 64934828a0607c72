"""The proxy's Anthropic Messages route (POST /v1/messages) driven by Anthropic's own Python client:
text, streaming, a tool_use round trip and errors, every call an LlmCall of the rollout on the
Kafka log, chained exactly as chat completions are."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from test_proxy import (
    ScriptedBackend,
    assert_append_only,
    by_rollout,
    calls_of,
    consume,
    create_rollout,
    model_dir,
    model_server,
    proxy_settings,
    running_proxy,
    serve,
)

from rollstream.producers.proxy.chat import ChatTemplate
from rollstream.schemas import CommonSettings, ToolCall

pytestmark = pytest.mark.integration
__all__ = ["model_dir", "model_server"]  # module fixtures shared with test_proxy

WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


class StoppingBackend(ScriptedBackend):
    """A scripted backend that reports the stop token it ended on, as vLLM does."""

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.prompts.append(body["prompt"])
        ids = self.script.popleft() if self.script else self.default
        stop = ids[-1] if ids and ids[-1] in body.get("stop_token_ids", []) else None
        choice = {
            "token_ids": ids,
            "finish_reason": "stop",
            "stop_reason": stop,
            "logprobs": {"token_logprobs": [-1.0] * len(ids)},
        }
        return JSONResponse(
            {
                "model": "scripted",
                "policy_version": 0,
                "choices": [choice],
                "usage": {"prompt_tokens": len(body["prompt"])},
            }
        )


def client_of(ro: dict[str, Any], **kw: Any) -> anthropic.Anthropic:
    """Anthropic's client on the rollout's URL (it appends /v1/messages itself)."""
    kw.setdefault("max_retries", 0)
    kw.setdefault("timeout", 60.0)  # else the client refuses a large non-streamed max_tokens
    return anthropic.Anthropic(base_url=ro["base_url"].removesuffix("/v1"), **kw)


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_text_and_streaming_calls_are_chained(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, model_server: str
) -> None:
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [model_server])
    with running_proxy(settings) as (url, recorder, _):
        ro = create_rollout(url)
        client = client_of(ro, api_key=ro["token"])  # the token as x-api-key
        msgs: list[Any] = [{"role": "user", "content": "Tell me a story."}]
        m1 = client.messages.create(
            model="rollstream-tiny", max_tokens=10, system="You are terse.", messages=msgs
        )
        assert (m1.type, m1.role, m1.model) == ("message", "assistant", "rollstream-tiny")
        assert m1.stop_reason in ("end_turn", "max_tokens") and m1.stop_sequence is None
        assert m1.usage.input_tokens > 0 and 0 < m1.usage.output_tokens <= 10
        assert m1.id == f"msg_{(m1.model_extra or {})['rollstream']['call_id']}"
        texts = [text_of(m1)]
        msgs += [
            {"role": "assistant", "content": [b.model_dump() for b in m1.content]},
            {"role": "user", "content": [{"type": "text", "text": "more"}]},
        ]
        with client.messages.stream(
            model="rollstream-tiny", max_tokens=10, system="You are terse.", messages=msgs
        ) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert streamed == text_of(final)
        assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
        texts.append(streamed)
        msgs += [{"role": "assistant", "content": streamed}, {"role": "user", "content": "end"}]
        # the token as a bearer token, on the unscoped URL
        bearer = anthropic.Anthropic(base_url=url, auth_token=ro["token"], max_retries=0)
        m3 = bearer.messages.create(
            model="m", max_tokens=10, system="You are terse.", messages=msgs
        )
        texts.append(text_of(m3))
        assert recorder.flush(30)

    calls = calls_of(by_rollout(consume(kafka_settings))[ro["rollout_id"]])
    assert len(calls) == 3
    assert_append_only(calls)
    chat = ChatTemplate.from_dir(model_dir)
    assert [chat.decode(c.completion_ids).strip() for c in calls] == [t.strip() for t in texts]
    assert [c.usage.completion_tokens for c in calls[:1]] == [m1.usage.output_tokens]


def test_tool_use_round_trip_and_stop_sequences(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path
) -> None:
    chat = ChatTemplate.from_dir(model_dir)
    eos = chat.eos_id
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    newline = int(chat.encode("\n")[0])
    backend = StoppingBackend()
    backend.script.extend(
        [
            [*chat.encode(call_text).tolist(), eos],
            [*chat.encode("Snow").tolist(), newline],  # ends on the stop sequence
            [*chat.encode("Bye").tolist(), eos],
        ]
    )
    with serve(backend.app()) as burl:
        settings = proxy_settings(kafka_settings, tmp_path, model_dir, [burl])
        with running_proxy(settings) as (url, recorder, _):
            ro = create_rollout(url)
            client = client_of(ro, api_key=ro["token"])
            msgs: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
            r1 = client.messages.create(model="m", max_tokens=64, tools=[WEATHER], messages=msgs)
            assert r1.stop_reason == "tool_use"
            (tool_use,) = [b for b in r1.content if b.type == "tool_use"]
            assert (tool_use.name, tool_use.input) == ("get_weather", {"city": "Oslo"})
            msgs += [
                {"role": "assistant", "content": [b.model_dump() for b in r1.content]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": tool_use.id, "content": "snow"}
                    ],
                },
            ]
            r2 = client.messages.create(
                model="m", max_tokens=64, tools=[WEATHER], messages=msgs, stop_sequences=["\n"]
            )
            assert text_of(r2) == "Snow"
            assert (r2.stop_reason, r2.stop_sequence) == ("stop_sequence", "\n")
            msgs += [{"role": "assistant", "content": "Snow"}, {"role": "user", "content": "ok"}]
            with client.messages.stream(
                model="m", max_tokens=64, tools=[WEATHER], messages=msgs
            ) as stream:
                assert "".join(stream.text_stream) == "Bye"
                assert stream.get_final_message().stop_reason == "end_turn"
            assert recorder.flush(30)

    events = by_rollout(consume(kafka_settings))[ro["rollout_id"]]
    kinds = [e.kind for e in events]
    # the rollout is left open: the proxy's shutdown finishes it
    assert kinds == [
        "RolloutStarted",
        "LlmCall",
        "ToolCall",
        "LlmCall",
        "LlmCall",
        "RolloutFinished",
    ]
    calls = calls_of(events)
    prompts = assert_append_only(calls)  # each reply's generated ids extend the next prompt
    assert backend.prompts == [p.tolist() for p in prompts]
    (tool_event,) = [e.body for e in events if isinstance(e.body, ToolCall)]
    assert (tool_event.tool_call_id, tool_event.name, tool_event.result) == (
        tool_use.id,
        "get_weather",
        "snow",
    )
    assert tool_event.at_call_id == calls[0].call_id
    assert calls[1].drift_tokens == 0  # the tool call came back as it was generated
    text = chat.decode(prompts[1], skip_special_tokens=False)
    assert '"name": "get_weather"' in text and "<|im_start|>tool\nsnow<|im_end|>" in text


def test_errors_in_anthropic_shape(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path
) -> None:
    backend = ScriptedBackend()
    with serve(backend.app()) as burl:
        settings = proxy_settings(
            kafka_settings, tmp_path, model_dir, [burl], proxy_max_prompt_tokens=200
        )
        with running_proxy(settings) as (url, recorder, _):
            ro, other = create_rollout(url), create_rollout(url)
            client = client_of(ro, api_key=ro["token"], max_retries=3)
            ok: Any = [{"role": "user", "content": "hi"}]
            long: Any = [{"role": "user", "content": "word " * 300}]
            t0 = time.monotonic()
            with pytest.raises(anthropic.BadRequestError) as err:
                client.messages.create(model="m", max_tokens=8, messages=long)
            assert time.monotonic() - t0 < 2.0  # no backoff: not retried
            body = err.value.body
            assert isinstance(body, dict) and body["type"] == "error"
            assert body["error"]["type"] == "invalid_request_error"
            assert body["error"]["message"].startswith("prompt is too long: ")
            assert body["error"]["message"].endswith(" tokens > 200 maximum")
            with pytest.raises(anthropic.BadRequestError) as err:
                client.messages.create(model="m", max_tokens=10**7, messages=ok)
            assert "exceed context limit" in err.value.message
            with pytest.raises(anthropic.AuthenticationError):
                client_of(ro, api_key="rs1.x.y").messages.create(
                    model="m", max_tokens=8, messages=ok
                )
            with pytest.raises(anthropic.PermissionDeniedError):
                client_of(ro, api_key=other["token"]).messages.create(
                    model="m", max_tokens=8, messages=ok
                )
            r = httpx.post(
                f"{url}/v1/messages",
                json={"model": "m", "messages": ok},
                headers={"x-api-key": ro["token"]},
            )
            assert r.status_code == 400
            assert r.json() == {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
            }
            r = httpx.post(
                f"{url}/v1/messages",
                headers={"x-api-key": ro["token"]},
                json={"model": "m", "max_tokens": 8, "messages": ok, "n": 2},
            )
            assert r.status_code == 400 and r.json()["error"]["message"].startswith("n: ")
            assert client.messages.create(model="m", max_tokens=8, messages=ok).type == "message"
            httpx.post(
                f"{url}/v1/rollouts/{ro['rollout_id']}/finish",
                json={},
                headers={"Authorization": f"Bearer {ro['token']}"},
            )
            t0 = time.monotonic()
            with pytest.raises(anthropic.APIStatusError) as status_err:
                client.messages.create(model="m", max_tokens=8, messages=ok)
            assert status_err.value.status_code == 409
            assert time.monotonic() - t0 < 2.0  # x-should-retry: false
            spec = httpx.get(f"{url}/openapi.json").json()
            assert "post" in spec["paths"]["/rollouts/{rollout_id}/v1/messages"]
            assert recorder.flush(30)

    calls = calls_of(by_rollout(consume(kafka_settings))[ro["rollout_id"]])
    assert len(calls) == 1  # refused calls are not recorded
