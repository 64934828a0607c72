"""Bounds of the proxy's pure parts: request bodies nest at most MAX_JSON_DEPTH levels, ints
stay within +-2**53 - 1, token ids within uint32, JSON texts in messages and replies never
raise a RecursionError, a non-ASCII token is no token, and the OpenAPI document states the
bounds the server enforces."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from rollstream.inference.tinymodel import CHAT_TEMPLATE, train_tokenizer
from rollstream.producers.errors import ApiError
from rollstream.producers.proxy.anthropic_wire import content_blocks
from rollstream.producers.proxy.chat import ChatTemplate, message_key, parse_reply
from rollstream.producers.proxy.openai_wire import (
    MAX_JSON_DEPTH,
    MAX_REWARDS,
    json_text,
    number,
    parse_json,
    parse_text_request,
    too_deep,
)
from rollstream.producers.proxy.openapi import OPENAPI
from rollstream.producers.proxy.rollout_api import RolloutTokens
from rollstream.schemas.events import (
    METADATA_MAX_KEYS,
    POLICY_VERSION_MAX,
    REWARD_BOUND,
    SAFE_INT_MAX,
    SAMPLING_MAX_KEYS,
    TOKEN_ID_MAX,
)


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def api_error(fn: Any, *args: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        fn(*args)
    return err.value


def test_too_deep_counts_objects_and_arrays() -> None:
    assert not too_deep(1) and not too_deep("x" * 100)
    assert not too_deep({}, 1) and too_deep({"a": {}}, 1)
    assert not too_deep(nested(MAX_JSON_DEPTH)) and too_deep(nested(MAX_JSON_DEPTH + 1))
    assert not too_deep(nested(100_000), 10**6)  # iterative: no recursion at any depth
    assert too_deep(nested(100_000))


def test_parse_json_refuses_a_field_nested_too_deep_and_names_it() -> None:
    ok = {"messages": [], "metadata": nested(MAX_JSON_DEPTH - 1)}  # the body itself is level 1
    assert parse_json(json.dumps(ok).encode()) == ok
    for field, depth in (("metadata", MAX_JSON_DEPTH), ("tools", 250), ("messages", 1000)):
        value = "[" * depth + "]" * depth  # past what json.dumps itself would write
        err = api_error(parse_json, f'{{"model": "m", "{field}": {value}}}'.encode())
        assert (err.status, err.param, err.code) == (400, field, "invalid_value"), field
        assert f"deeper than {MAX_JSON_DEPTH} levels" in err.message
    # past orjson's own limit (1024): invalid JSON, still a 400
    err = api_error(parse_json, b'{"a": ' + b"[" * 2000 + b"]" * 2000 + b"}")
    assert (err.status, err.code) == (400, "invalid_json")
    # many brackets inside strings alone do not make a body deep
    flat = {"content": "[[[[{{{{" * 1000}
    assert parse_json(json.dumps(flat).encode()) == flat


def test_json_text_is_bounded_and_never_recurses_out() -> None:
    assert json_text('{"city": "Paris"}') == {"city": "Paris"}
    for text in ("[" * 100_000 + "]" * 100_000, json.dumps(nested(MAX_JSON_DEPTH + 1))):
        with pytest.raises(ValueError, match=f"deeper than {MAX_JSON_DEPTH}"):
            json_text(text)
    deep_args = "[" * 100_000 + "]" * 100_000
    call = {"function": {"name": "f", "arguments": deep_args}}
    assert message_key(None, [call]).endswith(deep_args)  # kept as text, not a RecursionError
    blocks = content_blocks(None, [{"id": "c1", **call}])
    assert blocks == [{"type": "tool_use", "id": "c1", "name": "f", "input": {}}]


def test_parse_reply_keeps_a_too_deep_tool_block_as_text() -> None:
    tok: Tokenizer = train_tokenizer().backend_tokenizer
    chat = ChatTemplate(tok, CHAT_TEMPLATE, special_tokens={"eos_token": "<|im_end|>"})
    deep = json.dumps({"name": "f", "arguments": nested(MAX_JSON_DEPTH + 5)})
    shallow = json.dumps({"name": "g", "arguments": {"q": [1]}})
    text = f"<tool_call>\n{deep}\n</tool_call><tool_call>\n{shallow}\n</tool_call>"
    reply = parse_reply(chat, chat.encode(text), tools_enabled=True)
    assert [c["function"]["name"] for c in reply.tool_calls] == ["g"]
    assert deep in (reply.content or "")


def test_number_bounds_every_int_and_float() -> None:
    assert number({"seed": SAFE_INT_MAX}, "seed", None) == SAFE_INT_MAX
    for value in (SAFE_INT_MAX + 1, 2**64 - 1, -(2**63)):
        err = api_error(number, {"seed": value}, "seed", None)
        assert (err.status, err.param) == (400, "seed")
    err = api_error(number, {"version": 2**64 - 1}, "version", None, int, 0)
    assert err.param == "version" and f"[0, {POLICY_VERSION_MAX}]" in err.message
    err = api_error(number, {"presence_penalty": 10**400}, "presence_penalty", 0.0, float)
    assert err.param == "presence_penalty"  # no OverflowError converting it


def test_text_prompt_token_ids_past_uint32_are_a_400_naming_prompt() -> None:
    ok = parse_text_request({"prompt": [0, TOKEN_ID_MAX]})
    assert ok.prompt == [0, TOKEN_ID_MAX]
    for ids in ([TOKEN_ID_MAX + 1], [1, 2**63], [2**64 - 1], [-1], [[5, 2**63]]):
        err = api_error(parse_text_request, {"prompt": ids})
        assert (err.status, err.param) == (400, "prompt"), ids


def test_a_non_ascii_token_is_no_token() -> None:
    tokens = RolloutTokens(b"0123456789abcdef0123")
    good = tokens.issue("r1")
    assert tokens.verify(good) == "r1"
    for bad in (good[:-1] + "é", "rs1.r1.\u00e9\u00e9", "rs1.é.x", "\u2603"):
        assert tokens.verify(bad) is None, bad  # hmac.compare_digest would raise TypeError


def _op(path: str, method: str = "post") -> dict[str, Any]:
    schema: dict[str, Any] = OPENAPI["paths"][path][method]["requestBody"]["content"]
    return schema["application/json"]["schema"]


def test_openapi_states_the_bounds() -> None:
    reward = _op("/v1/rollouts/{rollout_id}/rewards")["oneOf"]
    value = reward[0]["properties"]["value"]
    assert (value["minimum"], value["maximum"]) == (-REWARD_BOUND, REWARD_BOUND)
    batch = reward[1]["properties"]["rewards"]
    assert batch["maxItems"] == MAX_REWARDS
    version = _op("/v1/admin/update_weights")["properties"]["version"]
    assert (version["minimum"], version["maximum"]) == (0, POLICY_VERSION_MAX)
    rollout = _op("/v1/rollouts")["properties"]
    assert rollout["attempt"]["maximum"] == rollout["group_size"]["maximum"] == SAFE_INT_MAX
    assert rollout["metadata"]["maxProperties"] == METADATA_MAX_KEYS
    assert rollout["sampling"]["maxProperties"] == SAMPLING_MAX_KEYS
    prompt = _op("/v1/completions")["properties"]["prompt"]["oneOf"]
    ids = next(p for p in prompt if p.get("type") == "array" and "maxItems" not in p)
    assert (ids["items"]["minimum"], ids["items"]["maximum"]) == (0, TOKEN_ID_MAX)
    seed = _op("/v1/chat/completions")["properties"]["seed"]
    assert (seed["minimum"], seed["maximum"]) == (-SAFE_INT_MAX, SAFE_INT_MAX)
    assert f"at most {MAX_JSON_DEPTH} levels" in OPENAPI["info"]["description"]
    # every integer and number field of every body states both bounds
    for path, methods in OPENAPI["paths"].items():
        for op in methods.values():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            for schema in _walk(body.get("schema", {})):
                if schema.get("type") in ("integer", "number"):
                    assert "minimum" in schema and "maximum" in schema, (path, schema)


def _walk(schema: Any) -> list[dict[str, Any]]:
    out, stack = [], [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            out.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return out


def test_chat_render_of_prompt_ids_is_bounded_before_numpy() -> None:
    """render_text casts the prompt to int64: parse_text_request's bound is what keeps an id
    past 2**63 from becoming an OverflowError (a 500) there."""
    with pytest.raises(OverflowError):
        np.asarray([2**64 - 1], dtype=np.int64)
    assert api_error(parse_text_request, {"prompt": [2**64 - 1]}).param == "prompt"


def test_lifecycle_duration_refuses_huge_and_non_finite_numbers() -> None:
    from rollstream.producers.proxy.lifecycle import MAX_DURATION_MS, _Item

    for bad in (10**400, float("inf"), float("nan"), -1, MAX_DURATION_MS + 1):
        with pytest.raises(ApiError, match="duration_ms"):
            _Item({"duration_ms": bad}, "events[0]", {"duration_ms"}).duration()
    assert _Item({"duration_ms": 12}, "events[0]", {"duration_ms"}).duration() == 12.0
