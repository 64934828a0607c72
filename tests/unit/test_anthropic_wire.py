"""The Anthropic Messages wire (producers/proxy/anthropic_wire.py): requests brought to the chat
form, every bad field refused with its name, the Message and its SSE events, error objects."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollstream.producers.errors import ApiError
from rollstream.producers.proxy import anthropic_wire as aw
from rollstream.producers.proxy.messages import message_key, normalize_messages, normalize_tools

WEATHER = {
    "name": "get_weather",
    "description": "The weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
BASE: dict[str, Any] = {
    "model": "m",
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "hi"}],
}


def parse(**kw: Any) -> aw.MessagesRequest:
    return aw.parse_messages_request({**BASE, **kw})


def refused(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as err:
        aw.parse_messages_request(body)
    assert err.value.status == 400
    return err.value


def test_a_tool_conversation_in_the_chat_form() -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather in Oslo?", "cache_control": {"type": "ephemeral"}}
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Oslo"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "snow"}],
                },
                {"type": "text", "text": "and tomorrow?"},
            ],
        },
    ]
    req = parse(
        system=[{"type": "text", "text": "Be brief."}],
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        temperature=0.5,
        top_p=0.9,
        stop_sequences=["\n"],
        metadata={"user_id": "u1"},
        thinking={"type": "disabled"},
        stream=True,
    )
    chat = req.chat
    assert req.stream and not chat.params.stream
    assert chat.params.max_tokens == 16 and chat.params.stop == ("\n",)
    assert chat.params.sampling["temperature"] == 0.5 and chat.params.sampling["top_p"] == 0.9
    assert chat.tool_choice == "required"
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "The weather of a city",
            },
        }
    ]
    msgs = normalize_messages(chat.messages)  # what render_turn does with them
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert msgs[0]["content"] == "Be brief." and msgs[4]["content"] == "and tomorrow?"
    assert msgs[3] == {"role": "tool", "content": "snow", "tool_call_id": "toolu_1"}
    (call,) = msgs[2]["tool_calls"]
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert normalize_tools(chat.tools) == chat.tools


def test_a_reply_sent_back_has_the_key_it_was_remembered_by() -> None:
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
        }
    ]
    blocks = aw.content_blocks("Checking.", calls)
    assert blocks == [
        {"type": "text", "text": "Checking."},
        {
            "type": "tool_use",
            "id": "call_1",
            "name": "get_weather",
            "input": {"city": "Oslo", "days": 2},
        },
    ]
    req = parse(
        messages=[
            BASE["messages"][0],
            {"role": "assistant", "content": blocks},
            {"role": "user", "content": "ok"},
        ]
    )
    back = normalize_messages(req.chat.messages)[1]
    assert message_key(back["content"], back["tool_calls"]) == message_key("Checking.", calls)
    # a tool call whose arguments are no JSON object still answers a valid block
    bad = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}]
    assert aw.content_blocks(None, bad) == [
        {"type": "tool_use", "id": "c", "name": "f", "input": {}}
    ]
    assert aw.content_blocks("", []) == []


def test_defaults_and_string_forms() -> None:
    req = parse(system="sys", tool_choice={"type": "auto"})  # tool_choice without tools: no-op
    assert req.chat.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]
    assert req.chat.tools is None and req.chat.tool_choice is None
    assert req.chat.params.sampling["temperature"] == 1.0 and not req.stream
    assert parse(
        tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
    ).chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert parse(tools=[WEATHER], tool_choice={"type": "none"}).chat.tool_choice == "none"
    assert parse(system="").chat.messages == BASE["messages"]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"frequency_penalty": 0.1}, "frequency_penalty"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_k": 5}, "top_k"),
        ({"top_k": "x"}, "top_k"),
        ({"stream": "yes"}, "stream"),
        ({"model": 3}, "model"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"metadata": {"user_id": "u" * 300}}, "metadata.user_id"),
        ({"metadata": {"session": "s"}}, "metadata.session"),
        ({"metadata": []}, "metadata"),
        ({"stop_sequences": "\n"}, "stop_sequences"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
        ({"system": 5}, "system"),
        ({"system": [{"type": "image"}]}, "system[0].type"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages[0].name"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]},
            "messages[0].content[0].y",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": 3}],
                    }
                ]
            },
            "messages[0].content[0].content",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "no"}],
                    }
                ]
            },
            "messages[0].content[0].is_error",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}],
                    },
                    {"role": "user", "content": "b"},
                ]
            },
            "messages[1].content[0].input",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]},
                    {"role": "user", "content": "b"},
                ]
            },
            "messages[1].content[0].type",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "The answer is"},
                ]
            },
            "messages[1]",
        ),
        ({"tools": {}}, "tools"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tools": [{**WEATHER, "name": ""}]}, "tools[0].name"),
        ({"tools": [{**WEATHER, "strict": True}]}, "tools[0].strict"),
        ({"tools": [{**WEATHER, "description": 1}]}, "tools[0].description"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}}, "tool_choice.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "some"}}, "tool_choice.type"),
    ],
)
def test_bad_fields_are_refused_by_name(change: dict[str, Any], param: str) -> None:
    body = {**BASE, **change}
    body = {k: v for k, v in body.items() if v is not None}
    err = refused(body)
    assert err.param == param, err.message
    assert json.loads(aw.error_body(err))["error"]["message"].startswith(f"{param}: ")


def test_the_message_and_its_events() -> None:
    calls = [
        {
            "id": "call_9",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }
    ]
    message = aw.message_body(
        call_id="01J",
        model="tiny",
        content=aw.content_blocks("Looking.", calls),
        stop_reason=aw.stop_reason("stop", tool_use=True, stop_sequence=None),
        stop_sequence=None,
        input_tokens=12,
        output_tokens=7,
        ext={"call_id": "01J"},
    )
    answer = aw.message_answer(message, stream=False)
    assert not answer.sse and answer.status == 200
    body = json.loads(answer.body)
    assert {k: body[k] for k in ("id", "type", "role", "model", "stop_reason", "usage")} == {
        "id": "msg_01J",
        "type": "message",
        "role": "assistant",
        "model": "tiny",
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 12, "output_tokens": 7},
    }
    assert body["stop_sequence"] is None and body["rollstream"] == {"call_id": "01J"}

    stream = aw.message_answer(message, stream=True)
    assert stream.sse
    frames = stream.body.decode().split("\n\n")
    assert frames[-1] == ""
    events = []
    for frame in frames[:-1]:
        head, data = frame.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        events.append((head[7:], json.loads(data[6:])))
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": 12, "output_tokens": 0}
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    assert events[2][1]["delta"] == {"type": "text_delta", "text": "Looking."}
    assert events[4][1]["content_block"] == {
        "type": "tool_use",
        "id": "call_9",
        "name": "get_weather",
        "input": {},
    }
    delta = events[5][1]
    assert delta["index"] == 1 and delta["delta"]["type"] == "input_json_delta"
    assert json.loads(delta["delta"]["partial_json"]) == {"city": "Oslo"}
    assert events[7][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[7][1]["usage"] == {"output_tokens": 7}


def test_stop_reasons() -> None:
    assert aw.stop_reason("stop", tool_use=False, stop_sequence=None) == "end_turn"
    assert aw.stop_reason("abort", tool_use=False, stop_sequence=None) == "end_turn"
    assert aw.stop_reason("length", tool_use=False, stop_sequence=None) == "max_tokens"
    assert aw.stop_reason("stop", tool_use=False, stop_sequence="\n") == "stop_sequence"
    assert aw.stop_reason("stop", tool_use=True, stop_sequence="\n") == "tool_use"
    assert set(aw.STOP_REASONS) == {"end_turn", "max_tokens", "stop_sequence", "tool_use"}


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (409, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_error_objects(status: int, kind: str) -> None:
    answer = aw.error_answer(ApiError(status, "nope", headers={"Retry-After": "1"}))
    assert answer.status == status and answer.headers["Retry-After"] == "1"
    assert json.loads(answer.body) == {"type": "error", "error": {"type": kind, "message": "nope"}}
    assert (answer.headers.get("x-should-retry") == "false") == (status == 409)


def test_context_overflow_wording() -> None:
    err = aw.prompt_too_long(250, 200)
    assert (err.status, err.message) == (400, "prompt is too long: 250 tokens > 200 maximum")
    body = json.loads(aw.error_body(err))["error"]
    assert body == {"type": "invalid_request_error", "message": err.message}
    limit = aw.context_limit(100, 50, 128)
    assert limit.message.startswith("input length and `max_tokens` exceed context limit: ")
    assert "100 + 50 > 128" in limit.message


def test_null_fields_count_as_absent() -> None:
    """A response block sent back as the client parsed it carries its unset fields as null."""
    block: dict[str, Any] = {
        "type": "tool_use",
        "id": "t",
        "name": "f",
        "input": {},
        "caller": None,
    }
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "text", "text": "x", "citations": None}, block]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]},
    ]
    req = parse(messages=messages, container=None, top_k=None)
    assert [m["role"] for m in req.chat.messages] == ["user", "assistant", "tool"]
    assert refused({**BASE, "container": "c"}).param == "container"
