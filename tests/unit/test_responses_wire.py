"""The OpenAI Responses wire (producers/proxy/responses_wire.py): requests brought to the chat form,
every bad field refused with its name, output items that come back as the remembered reply, the
Response and its SSE events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollstream.producers.errors import ApiError
from rollstream.producers.proxy import responses_wire as rw
from rollstream.producers.proxy.messages import message_key, normalize_messages, normalize_tools
from rollstream.producers.proxy.responses_api import responses_error

WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}
BASE: dict[str, Any] = {"model": "m", "input": "hi"}
CALLS = [
    {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
    }
]


def parse(**kw: Any) -> rw.ResponsesRequest:
    return rw.parse_responses_request({**BASE, **kw})


def refused(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as err:
        rw.parse_responses_request(body)
    assert err.value.status == 400
    return err.value


def test_a_tool_conversation_in_the_chat_form() -> None:
    items: list[dict[str, Any]] = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Oslo?"}]},
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
            "status": "completed",
        },
        {
            "type": "function_call",
            "call_id": "c2",
            "name": "get_weather",
            "arguments": '{"city": "Bergen"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "snow"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "rain"}],
        },
        {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "sun"},
        {"role": "user", "content": "and tomorrow?"},
    ]
    req = parse(
        instructions="Be brief.",
        input=items,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0.5,
        top_p=0.9,
        max_output_tokens=64,
        stream=True,
        store=False,
        parallel_tool_calls=False,
        metadata={"task": "t1"},
        reasoning={"effort": None},
        include=["reasoning.encrypted_content"],
        text={"format": {"type": "text"}},
        prompt_cache_key="k",
    )
    chat = req.chat
    assert req.stream and chat.params.max_tokens == 64 and chat.response_format is None
    assert chat.params.sampling["temperature"] == 0.5 and chat.params.sampling["top_p"] == 0.9
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather of a city",
                "parameters": WEATHER["parameters"],
            },
        }
    ]
    assert normalize_tools(chat.tools) == chat.tools
    msgs = normalize_messages(chat.messages)  # what render_turn does with them
    roles = [m["role"] for m in msgs]
    assert roles == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
        "user",
    ]
    assert msgs[0]["content"] == "Be brief." and msgs[2]["content"] == "Oslo?"
    assert msgs[3]["content"] == "Let me look."
    assert [c["id"] for c in msgs[3]["tool_calls"]] == ["c1", "c2"]
    assert msgs[5] == {"role": "tool", "content": "rain", "tool_call_id": "c2"}
    assert msgs[6]["content"] is None and msgs[6]["tool_calls"][0]["id"] == "c3"
    assert req.echo["metadata"] == {"task": "t1"} and req.echo["parallel_tool_calls"] is False
    assert req.echo["store"] is False and req.echo["instructions"] == "Be brief."


def test_output_items_sent_back_have_the_key_the_reply_was_remembered_by() -> None:
    items = rw.output_items("01J", "Checking.", CALLS, incomplete=False)
    assert [i["type"] for i in items] == ["message", "function_call"]
    assert items[1] == {
        "type": "function_call",
        "id": "fc_01J_0",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Oslo", "days": 2}',
        "status": "completed",
    }
    back = normalize_messages(
        parse(input=[{"role": "user", "content": "hi"}, *items]).chat.messages
    )
    assert message_key(back[1]["content"], back[1]["tool_calls"]) == message_key("Checking.", CALLS)
    # only tool calls: no message item, and the key still matches
    only = rw.output_items("01J", None, CALLS, incomplete=False)
    assert [i["type"] for i in only] == ["function_call"]
    back = normalize_messages(parse(input=[{"role": "user", "content": "hi"}, *only]).chat.messages)
    assert message_key(back[1]["content"], back[1]["tool_calls"]) == message_key(None, CALLS)
    # an empty reply is an empty message, so it comes back too
    (empty,) = rw.output_items("01J", "", [], incomplete=True)
    assert empty["status"] == "incomplete" and empty["content"][0]["text"] == ""


def test_defaults_and_string_forms() -> None:
    req = parse()
    assert req.chat.messages == [{"role": "user", "content": "hi"}]
    assert req.chat.tools is None and req.chat.tool_choice is None and not req.stream
    assert req.chat.params.max_tokens is None  # the proxy's default, capped by the room left
    assert req.echo["tool_choice"] == "auto" and req.echo["tools"] == []
    assert req.echo["store"] is True and req.echo["text"] == {"format": {"type": "text"}}
    assert parse(tool_choice="auto").chat.tool_choice == "auto"  # no tools: a no-op
    assert parse(instructions="").chat.messages == [{"role": "user", "content": "hi"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "A", "schema": schema, "strict": True}
    assert parse(text={"format": fmt}).chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "A", "schema": schema, "strict": True},
    }
    json_object = parse(text={"format": {"type": "json_object"}}).chat.response_format
    assert json_object == {"type": "json_object"}


def test_null_fields_count_as_absent() -> None:
    """An output item sent back as the client parsed it carries its unset fields as null."""
    item = {
        "type": "function_call",
        "call_id": "c",
        "name": "f",
        "arguments": "{}",
        "async_": None,
        "caller": None,
        "namespace": None,
    }
    req = parse(input=[{"role": "user", "content": "a"}, item], previous_response_id=None)
    assert [m["role"] for m in req.chat.messages] == ["user", "assistant"]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"input": None}, "input"),
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": [3]}, "input[0]"),
        ({"n": 2}, "n"),
        ({"stop": ["\n"]}, "stop"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": "9"}, "max_output_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream": "yes"}, "stream"),
        ({"store": "no"}, "store"),
        ({"parallel_tool_calls": 1}, "parallel_tool_calls"),
        ({"model": 3}, "model"),
        ({"instructions": ["x"]}, "instructions"),
        ({"user": "u" * 600}, "user"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "A"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input[0].name"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
        ),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
            "input[0].arguments",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
        ({"tools": {}}, "tools"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**WEATHER, "name": ""}]}, "tools[0].name"),
        ({"tools": [{**WEATHER, "parameters": "{}"}]}, "tools[0].parameters"),
        ({"tools": [{**WEATHER, "strict": "yes"}]}, "tools[0].strict"),
        ({"tools": [{**WEATHER, "x": 1}]}, "tools[0].x"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
            "tool_choice.name",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search"}}, "tool_choice.type"),
    ],
)
def test_bad_fields_are_refused_by_name(change: dict[str, Any], param: str) -> None:
    body = {**BASE, **change}
    body = {k: v for k, v in body.items() if v is not None}
    err = refused(body)
    assert err.param == param, err.message


def test_chat_parameter_names_in_responses_words() -> None:
    err = responses_error(ApiError(400, "long", param="messages", code="context_length_exceeded"))
    assert (err.param, err.code, err.message) == ("input", "context_length_exceeded", "long")
    assert responses_error(ApiError(400, "x", param="max_tokens")).param == "max_output_tokens"
    assert responses_error(ApiError(400, "x", param="messages[3].content")).param == "input"
    assert responses_error(ApiError(400, "x", param="tool_choice")).param == "tool_choice"
    assert responses_error(ApiError(401, "x")).param is None


def _response(incomplete: bool = False) -> dict[str, Any]:
    return rw.response_body(
        call_id="01J",
        created_at=1700000000,
        model="tiny",
        output=rw.output_items("01J", "Looking.", CALLS, incomplete=incomplete),
        incomplete=incomplete,
        input_tokens=12,
        output_tokens=7,
        echo=parse().echo,
        ext={"call_id": "01J"},
    )


def test_the_response_and_its_events() -> None:
    answer = rw.response_answer(_response(), stream=False)
    assert not answer.sse and answer.status == 200
    body = json.loads(answer.body)
    assert {k: body[k] for k in ("id", "object", "status", "incomplete_details", "model")} == {
        "id": "resp_01J",
        "object": "response",
        "status": "completed",
        "incomplete_details": None,
        "model": "tiny",
    }
    assert body["usage"]["input_tokens"] == 12 and body["usage"]["output_tokens"] == 7
    assert body["usage"]["total_tokens"] == 19 and body["rollstream"] == {"call_id": "01J"}
    assert body["output"][0]["content"] == [
        {"type": "output_text", "text": "Looking.", "annotations": []}
    ]

    stream = rw.response_answer(_response(), stream=True)
    assert stream.sse
    frames = stream.body.decode().split("\n\n")
    assert frames[-1] == ""
    events = []
    for frame in frames[:-1]:
        head, data = frame.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data[6:]))
        assert events[-1]["type"] == head[7:]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["usage"] is None and created["id"] == "resp_01J"
    assert events[2]["item"]["content"] == [] and events[2]["item"]["status"] == "in_progress"
    assert events[3]["part"]["text"] == "" and events[4]["delta"] == "Looking."
    assert events[4]["item_id"] == "msg_01J" and events[4]["output_index"] == 0
    assert events[8]["item"]["arguments"] == "" and events[9]["output_index"] == 1
    assert json.loads(events[10]["arguments"]) == {"city": "Oslo", "days": 2}
    assert events[-1]["response"] == body


def test_an_incomplete_response() -> None:
    body = _response(incomplete=True)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    events = rw.stream_events(body)
    assert events[-1]["type"] == "response.incomplete"
    assert events[0]["response"]["incomplete_details"] is None
