"""The proxy's OpenAI Responses route (POST /v1/responses) driven by the official openai client:
text, streamed events, a function-call round trip and errors, every call an LlmCall of the rollout
on the Kafka log, chained exactly as chat completions are."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
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
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}


def client_of(base_url: str, token: str, **kw: Any) -> openai.OpenAI:
    kw.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=base_url, api_key=token, **kw)


def sent_back(response: Any) -> list[dict[str, Any]]:
    """A response's output items as a harness sends them back (unset fields as null)."""
    return [item.model_dump() for item in response.output]


def test_text_and_streamed_calls_are_chained(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, model_server: str
) -> None:
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [model_server])
    with running_proxy(settings) as (url, recorder, _):
        ro = create_rollout(url)
        client = client_of(ro["base_url"], ro["token"])
        r1 = client.responses.create(
            model="rollstream-tiny",
            instructions="You are terse.",
            input="Tell me a story.",
            max_output_tokens=10,
        )
        assert (r1.object, r1.model) == ("response", "rollstream-tiny")
        assert r1.status in ("completed", "incomplete")
        if r1.status == "incomplete":
            assert r1.incomplete_details and r1.incomplete_details.reason == "max_output_tokens"
        assert r1.usage and r1.usage.input_tokens > 0 and 0 < r1.usage.output_tokens <= 10
        assert r1.id == f"resp_{(r1.model_extra or {})['rollstream']['call_id']}"
        texts = [r1.output_text]
        items: list[Any] = [
            {"role": "user", "content": "Tell me a story."},
            *sent_back(r1),
            {"role": "user", "content": [{"type": "input_text", "text": "more"}]},
        ]
        events = list(
            client.responses.create(
                model="m",
                instructions="You are terse.",
                input=items,
                max_output_tokens=10,
                stream=True,
                store=False,
            )
        )
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created"
        last = events[-1]
        assert last.type in ("response.completed", "response.incomplete")
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert streamed == last.response.output_text
        texts.append(streamed)
        items += [*sent_back(last.response), {"role": "user", "content": "end"}]
        # the token names the rollout on the unscoped URL
        r3 = client_of(f"{url}/v1", ro["token"]).responses.create(
            model="m", instructions="You are terse.", input=items, max_output_tokens=10
        )
        texts.append(r3.output_text)
        assert recorder.flush(30)

    calls = calls_of(by_rollout(consume(kafka_settings))[ro["rollout_id"]])
    assert len(calls) == 3
    assert_append_only(calls)
    chat = ChatTemplate.from_dir(model_dir)
    assert [chat.decode(c.completion_ids).strip() for c in calls] == [t.strip() for t in texts]
    assert calls[0].usage.completion_tokens == r1.usage.output_tokens


def test_function_call_round_trip(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path
) -> None:
    chat = ChatTemplate.from_dir(model_dir)
    eos = chat.eos_id
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    backend = ScriptedBackend()
    backend.script.extend(
        [
            [*chat.encode(call_text).tolist(), eos],
            [*chat.encode("Snow").tolist(), eos],
            [*chat.encode("Bye").tolist(), eos],
        ]
    )
    codex_like: Any = {
        "tools": [WEATHER],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "instructions": "You help with the weather.",
    }
    with serve(backend.app()) as burl:
        settings = proxy_settings(kafka_settings, tmp_path, model_dir, [burl])
        with running_proxy(settings) as (url, recorder, _):
            ro = create_rollout(url)
            client = client_of(ro["base_url"], ro["token"])
            items: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
            r1 = client.responses.create(model="m", input=items, **codex_like)
            assert r1.status == "completed"
            (fc,) = r1.output
            assert fc.type == "function_call" and fc.name == "get_weather"
            assert fc.arguments == '{"city": "Oslo"}' and fc.call_id.startswith("call_")
            items += [
                *sent_back(r1),
                {"type": "function_call_output", "call_id": fc.call_id, "output": "snow"},
            ]
            r2 = client.responses.create(model="m", input=items, **codex_like)
            assert r2.output_text == "Snow" and r2.output[0].type == "message"
            items += [*sent_back(r2), {"role": "user", "content": "ok"}]
            with client.responses.stream(model="m", input=items, **codex_like) as stream:
                deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
                final = stream.get_final_response()
            assert "".join(deltas) == final.output_text == "Bye"
            assert (
                final.status == "completed"
                and final.usage
                and final.usage.output_tokens == len(chat.encode("Bye")) + 1
            )
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
        fc.call_id,
        "get_weather",
        "snow",
    )
    assert tool_event.at_call_id == calls[0].call_id
    assert calls[1].drift_tokens == 0  # the function call came back as it was generated
    text = chat.decode(prompts[1], skip_special_tokens=False)
    assert '"name": "get_weather"' in text and "<|im_start|>tool\nsnow<|im_end|>" in text


def test_errors_in_openai_shape(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path
) -> None:
    backend = ScriptedBackend()
    with serve(backend.app()) as burl:
        settings = proxy_settings(
            kafka_settings, tmp_path, model_dir, [burl], proxy_max_prompt_tokens=200
        )
        with running_proxy(settings) as (url, recorder, _):
            ro, other = create_rollout(url), create_rollout(url)
            client = client_of(ro["base_url"], ro["token"], max_retries=3)
            t0 = time.monotonic()
            with pytest.raises(openai.BadRequestError) as err:
                client.responses.create(model="m", input="word " * 300)
            assert time.monotonic() - t0 < 2.0  # no backoff: not retried
            assert (err.value.code, err.value.param) == ("context_length_exceeded", "input")
            assert "maximum context length is 200 tokens" in err.value.message
            with pytest.raises(openai.BadRequestError) as err:
                client.responses.create(model="m", input="hi", max_output_tokens=10**7)
            assert (err.value.code, err.value.param) == (
                "context_length_exceeded",
                "max_output_tokens",
            )
            with pytest.raises(openai.BadRequestError) as err:
                client.responses.create(model="m", input="hi", previous_response_id="resp_1")
            assert (err.value.param, err.value.code) == ("previous_response_id", "unsupported")
            with pytest.raises(openai.BadRequestError) as err:
                client.responses.create(
                    model="m",
                    input="hi",
                    text={"format": {"type": "json_schema", "name": "A", "schema": {}}},
                )
            assert (err.value.param, err.value.code) == ("text.format", "unsupported")
            with pytest.raises(openai.AuthenticationError):
                client_of(ro["base_url"], "rs1.x.y").responses.create(model="m", input="hi")
            with pytest.raises(openai.PermissionDeniedError):
                client_of(ro["base_url"], other["token"]).responses.create(model="m", input="hi")
            r = httpx.post(
                f"{url}/v1/responses",
                json={"model": "m", "input": "hi", "n": 2},
                headers={"Authorization": f"Bearer {ro['token']}"},
            )
            assert r.status_code == 400
            assert r.json()["error"] == {
                "message": "unknown field `n`",
                "type": "invalid_request_error",
                "param": "n",
                "code": "unknown",
            }
            assert client.responses.create(model="m", input="hi").status == "completed"
            httpx.post(
                f"{url}/v1/rollouts/{ro['rollout_id']}/finish",
                json={},
                headers={"Authorization": f"Bearer {ro['token']}"},
            )
            t0 = time.monotonic()
            with pytest.raises(openai.ConflictError):
                client.responses.create(model="m", input="hi")
            assert time.monotonic() - t0 < 2.0  # x-should-retry: false
            spec = httpx.get(f"{url}/openapi.json").json()
            assert "post" in spec["paths"]["/rollouts/{rollout_id}/v1/responses"]
            assert "post" in spec["paths"]["/v1/responses"]
            assert recorder.flush(30)

    calls = calls_of(by_rollout(consume(kafka_settings))[ro["rollout_id"]])
    assert len(calls) == 1  # refused calls are not recorded
