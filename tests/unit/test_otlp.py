"""The OTLP trace receiver: GenAI spans (built with opentelemetry-proto's classes, sent as
protobuf and as OTLP/JSON) -> rollout facts -> events through the proxy's rollout registry, and
the stream core's handling of the text-only calls that come out of it."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
from typing import Any

import httpx
import numpy as np
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from rollstream.producers import MemoryTransport, Recorder
from rollstream.producers.errors import ApiError
from rollstream.producers.proxy.backends import CompletionBackend
from rollstream.producers.proxy.openai_wire import HttpRequest
from rollstream.producers.proxy.otlp import (
    ModelCall,
    OtlpLimits,
    RootEnd,
    ToolUse,
    decode_request,
    encode_response,
    inflate,
    map_request,
)
from rollstream.producers.proxy.otlp_api import OtlpApi
from rollstream.producers.proxy.pool import BackendPool
from rollstream.producers.proxy.rollout_api import Auth, Rollouts, RolloutTokens
from rollstream.producers.proxy.settings import ProxySettings
from rollstream.schemas import (
    Event,
    LlmCall,
    RolloutFinished,
    RolloutStarted,
    RolloutStatus,
    ToolCall,
    Trajectory,
)
from rollstream.schemas.events import RolloutError
from rollstream.streams.core import (
    SampleConfig,
    add_to_group,
    apply,
    build_samples,
    text_only_calls,
)
from rollstream.streams.core.config import AdvantageConfig, GroupConfig

TRACE = bytes.fromhex("5b8efff798038103d269b633813fc60c")
ADMIN = "otlp-admin-key"


def kv(key: str, value: Any) -> KeyValue:
    return KeyValue(key=key, value=any_value(value))


def any_value(value: Any) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, list):
        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    return AnyValue(string_value=value)


def span(
    n: int, parent: int | None, start: int, name: str, error: str | None = None, **attrs: Any
) -> Span:
    status = Status(code=Status.STATUS_CODE_ERROR, message=error) if error else Status()
    return Span(
        trace_id=TRACE,
        span_id=n.to_bytes(8, "big"),
        parent_span_id=b"" if parent is None else parent.to_bytes(8, "big"),
        name=name,
        start_time_unix_nano=1_000_000 * start,
        end_time_unix_nano=1_000_000 * (start + 5),
        attributes=[kv(k.replace("__", "."), v) for k, v in attrs.items()],
        status=status,
    )


def request(spans: list[Span], **resource: Any) -> ExportTraceServiceRequest:
    res = Resource(attributes=[kv(k.replace("__", "."), v) for k, v in resource.items()])
    return ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=res, scope_spans=[ScopeSpans(spans=spans)])]
    )


def sid(n: int) -> str:
    return n.to_bytes(8, "big").hex()


TOKENS = {
    "rollstream.prompt_token_ids": [1, 2, 3],
    "rollstream.completion_token_ids": [4, 5],
    "rollstream.completion_logprobs": [-0.5, -0.25],
}


def agent_trace() -> list[Span]:
    """An agent: a token call, a tool, a text-only call; spans out of start order (as an
    exporter sends them: by end), the root last."""
    token_call = span(
        2,
        1,
        10,
        "chat m",
        gen_ai__operation__name="chat",
        gen_ai__request__model="m",
        gen_ai__response__finish_reasons=["tool_calls"],
    )
    token_call.attributes.extend(kv(k, v) for k, v in TOKENS.items())
    return [
        span(
            4,
            1,
            30,
            "chat gpt",
            gen_ai__operation__name="chat",
            gen_ai__request__model="gpt",
            gen_ai__provider__name="openai",
            gen_ai__usage__input_tokens=40,
            gen_ai__usage__output_tokens=7,
            gen_ai__usage__cache_read__input_tokens=32,
            gen_ai__input__messages='[{"role": "user", "parts": []}]',
            gen_ai__output__messages='[{"role": "assistant", "parts": []}]',
        ),
        span(
            3,
            1,
            20,
            "execute_tool search",
            gen_ai__operation__name="execute_tool",
            gen_ai__tool__name="search",
            gen_ai__tool__call__id="call_1",
            gen_ai__tool__call__arguments='{"q": "x"}',
            gen_ai__tool__call__result="found",
        ),
        token_call,
        span(
            1,
            None,
            0,
            "invoke_agent solver",
            gen_ai__operation__name="invoke_agent",
            gen_ai__agent__name="solver",
        ),
    ]


# --------------------------------------------------------------------------- mapping


def test_a_trace_maps_to_facts_in_start_order() -> None:
    decoded = map_request(request(agent_trace(), service__name="harness"))
    assert (decoded.spans, decoded.rejected, decoded.ignored) == (4, 0, 0)
    [trace] = decoded.traces
    assert trace.rollout_id == trace.trace_id == TRACE.hex()
    assert (trace.task_id, trace.group_id, trace.harness) == ("solver", "solver", "harness")
    assert trace.metadata["otlp.trace_id"] == TRACE.hex()
    kinds = [type(f).__name__ for f in trace.facts]
    assert kinds == ["ModelCall", "ToolUse", "ModelCall", "RootEnd"]
    call, tool, text, end = trace.facts
    assert isinstance(call, ModelCall) and not call.text_only
    assert (call.span_id, call.model, call.finish_reason) == (sid(2), "m", "tool_calls")
    assert (call.prompt_ids, call.completion_ids, call.logprobs) == (
        [1, 2, 3],
        [4, 5],
        [-0.5, -0.25],
    )
    assert call.latency_ms == 5.0
    assert isinstance(tool, ToolUse)
    assert (tool.name, tool.tool_call_id, tool.arguments, tool.result) == (
        "search",
        "call_1",
        '{"q": "x"}',
        "found",
    )
    assert isinstance(text, ModelCall) and text.text_only
    assert (text.input_tokens, text.output_tokens, text.cached_tokens) == (40, 7, 32)
    assert (text.model, text.provider) == ("gpt", "openai")
    assert text.input_messages.startswith('[{"role": "user"')
    assert isinstance(end, RootEnd) and end.error is None


def test_otlp_json_with_hex_ids_maps_like_protobuf() -> None:
    proto = request(agent_trace(), service__name="harness")
    data = json_format.MessageToDict(proto)  # bytes as base64: OTLP/JSON wants hex
    for rs in data["resourceSpans"]:
        for s in rs["scopeSpans"][0]["spans"]:
            for key in ("traceId", "spanId", "parentSpanId"):
                if key in s:
                    s[key] = base64.b64decode(s[key]).hex()
    data["resourceSpans"][0]["unknownField"] = 1  # receivers ignore unknown fields
    from_json = map_request(decode_request(json.dumps(data).encode(), "application/json"))
    from_proto = map_request(decode_request(proto.SerializeToString(), "application/x-protobuf"))
    assert from_json.traces == from_proto.traces and from_json.rejected == 0


def test_rollout_and_task_come_from_attributes_span_before_resource() -> None:
    spans = [
        span(2, 1, 1, "chat", gen_ai__operation__name="chat", rollstream__task_id="from-span"),
        span(1, None, 0, "root"),
    ]
    decoded = map_request(
        request(
            spans,
            rollstream__rollout_id="ro-7",
            rollstream__task_id="from-resource",
            rollstream__group_id="g",
            rollstream__group_size=4,
            rollstream__run_id="run",
        )
    )
    [trace] = decoded.traces
    assert (trace.rollout_id, trace.task_id, trace.group_id) == ("ro-7", "from-span", "g")
    assert (trace.group_size, trace.run_id) == (4, "run")


def test_bad_spans_are_rejected_and_named_the_rest_mapped() -> None:
    partial = span(2, 1, 1, "chat", gen_ai__operation__name="chat")
    partial.attributes.append(kv("rollstream.prompt_token_ids", [1, 2]))
    uneven = span(3, 1, 2, "chat", gen_ai__operation__name="chat")
    uneven.attributes.extend(kv(k, v) for k, v in TOKENS.items())
    uneven.attributes.append(kv("rollstream.completion_logprobs", [-1.0]))  # the later wins
    negative = span(4, 1, 3, "chat", gen_ai__operation__name="chat")
    negative.attributes.extend(
        kv(k, v) for k, v in {**TOKENS, "rollstream.prompt_token_ids": [-1]}.items()
    )
    spans = [
        partial,
        uneven,
        negative,
        span(5, 1, 4, "tool", gen_ai__operation__name="execute_tool"),  # no tool name
        span(6, 1, 5, "embed", gen_ai__operation__name="embeddings"),  # not a fact
        span(7, 1, 6, "chat", gen_ai__operation__name="chat"),  # text-only: fine
    ]
    decoded = map_request(request(spans))
    assert (decoded.spans, decoded.rejected, decoded.ignored) == (6, 4, 1)
    text = " | ".join(decoded.errors)
    assert "missing rollstream.completion_token_ids, rollstream.completion_logprobs" in text
    assert "1 values for 2 completion tokens" in text
    assert "rollstream.prompt_token_ids must be an array of token ids" in text
    assert "gen_ai.tool.name" in text
    [trace] = decoded.traces
    assert [f.span_id for f in trace.facts] == [sid(7)]


def test_limits_bound_spans_tokens_and_errors() -> None:
    limits = OtlpLimits(max_spans=3, max_tokens=2, max_errors=2)
    big = span(1, 9, 0, "chat", gen_ai__operation__name="chat")
    big.attributes.extend(kv(k, v) for k, v in TOKENS.items())  # 3 prompt tokens > 2
    spans = [big] + [span(n, 9, n, "other") for n in range(2, 7)]
    decoded = map_request(request(spans), limits)
    assert (decoded.spans, decoded.rejected, decoded.ignored) == (6, 4, 2)
    assert len(decoded.errors) == 2 and "3 spans over the limit of 3" in decoded.errors[0]
    bad_id = map_request(request([span(1, None, 0, "r")], rollstream__rollout_id="no/slash"))
    assert bad_id.rejected == 1 and not bad_id.traces


def test_error_status_makes_failed_calls_tools_and_rollouts() -> None:
    spans = [
        span(2, 1, 1, "chat", "rate limited", gen_ai__operation__name="chat"),
        span(
            3, 1, 2, "tool", "boom", gen_ai__operation__name="execute_tool", gen_ai__tool__name="t"
        ),
        span(1, None, 0, "root", "gave up"),
    ]
    call, tool, end = map_request(request(spans)).traces[0].facts
    assert isinstance(call, ModelCall) and call.error == "rate limited"
    assert isinstance(tool, ToolUse) and tool.is_error and tool.result == "boom"
    assert tool.tool_call_id == sid(3)
    assert isinstance(end, RootEnd) and end.error == "gave up"


def test_a_root_model_call_is_its_rollout() -> None:
    [trace] = map_request(
        request([span(1, None, 0, "chat", gen_ai__operation__name="chat")])
    ).traces
    assert [type(f).__name__ for f in trace.facts] == ["ModelCall", "RootEnd"]


def test_wire_errors_and_responses() -> None:
    with pytest.raises(ApiError) as exc:
        decode_request(b"\xff\xff\xff", "application/x-protobuf")
    assert exc.value.status == 400
    with pytest.raises(ApiError) as exc:
        decode_request(b"{}", "text/plain")
    assert exc.value.status == 415
    with pytest.raises(ApiError) as exc:
        decode_request(
            b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}',
            "application/json",
        )
    assert exc.value.status == 400 and "traceId" in exc.value.message
    assert decode_request(b"", None) == ExportTraceServiceRequest()  # protobuf by default
    body = gzip.compress(b"x" * 100)
    assert inflate(body, "gzip", 100) == b"x" * 100
    with pytest.raises(ApiError) as exc:
        inflate(body, "gzip", 99)
    assert exc.value.status == 413
    with pytest.raises(ApiError) as exc:
        inflate(body, "br", 100)
    assert exc.value.status == 415
    ok = ExportTraceServiceResponse.FromString(encode_response("application/x-protobuf", 0, ""))
    assert not ok.HasField("partial_success")
    partial = json.loads(encode_response("application/json", 2, "why"))
    assert partial == {"partialSuccess": {"rejectedSpans": "2", "errorMessage": "why"}}


# --------------------------------------------------------------------------- recording


def receiver() -> tuple[OtlpApi, Rollouts, Recorder, MemoryTransport]:
    settings = ProxySettings(spool_dir=None)
    transport = MemoryTransport()
    recorder = Recorder(settings, transport=transport)
    http = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    pool = BackendPool([CompletionBackend("http://b", "b", http=http)], health_interval_s=0)
    rollouts = Rollouts(recorder, pool)
    auth = Auth(RolloutTokens(b"s" * 32), [ADMIN])
    return OtlpApi(rollouts, auth, max_body_bytes=1 << 20), rollouts, recorder, transport


def events(recorder: Recorder, transport: MemoryTransport) -> list[Event]:
    assert recorder.flush(10)
    return [recorder.codec.decode(m.value) for m in transport.messages(recorder.topic)]


def post(api: OtlpApi, body: bytes, content_type: str, token: str | None = ADMIN) -> Any:
    async def read_json() -> dict[str, Any]:
        raise AssertionError("the receiver reads bytes")

    async def read_bytes() -> bytes:
        return body

    http = HttpRequest(
        token, {}, {}, "http://proxy/", read_json, read_bytes, {"content-type": content_type}
    )
    return asyncio.run(api.traces(http))


def test_spans_become_one_rollouts_events_once() -> None:
    api, rollouts, recorder, transport = receiver()
    children, root = agent_trace()[:3], agent_trace()[3:]
    body = request(children).SerializeToString()
    answer = post(api, body, "application/x-protobuf")
    assert answer.status == 200 and answer.headers == {"content-type": "application/x-protobuf"}
    assert ExportTraceServiceResponse.FromString(answer.body) == ExportTraceServiceResponse()
    post(api, body, "application/x-protobuf")  # an exporter's retry: recorded once
    post(api, request(root).SerializeToString(), "application/x-protobuf")
    evs = events(recorder, transport)
    assert [e.seq for e in evs] == list(range(5)) and {e.rollout_id for e in evs} == {TRACE.hex()}
    started, call, tool, text, finished = (e.body for e in evs)
    assert isinstance(started, RolloutStarted) and started.task_id == "otlp"  # no name yet
    assert isinstance(call, LlmCall) and call.call_id == sid(2)
    assert (call.prompt_delta.tolist(), call.completion_ids.tolist()) == ([1, 2, 3], [4, 5])
    assert (call.finish_reason, call.backend, call.usage.prompt_tokens) == ("tool_calls", "otlp", 3)
    assert isinstance(tool, ToolCall) and (tool.tool_call_id, tool.at_call_id) == ("call_1", sid(2))
    assert isinstance(text, LlmCall) and text.parent_call_id is None and text.prefix_len == 0
    assert len(text.prompt_delta) == len(text.completion_ids) == len(text.completion_logprobs) == 0
    assert (text.usage.prompt_tokens, text.usage.completion_tokens, text.usage.cached_tokens) == (
        40,
        7,
        32,
    )
    assert text.backend == "otlp:openai" and text.model == "gpt"
    assert isinstance(finished, RolloutFinished) and finished.status is RolloutStatus.COMPLETED
    s = api.stats
    assert (s.token_calls, s.text_only_calls, s.tool_calls, s.duplicate_spans) == (1, 1, 1, 3)
    assert (s.rollouts_opened, s.rollouts_finished, s.rejected_spans) == (1, 1, 0)
    late = post(api, body, "application/x-protobuf")  # the rollout is over
    assert ExportTraceServiceResponse.FromString(late.body).partial_success.rejected_spans == 3
    assert TRACE.hex() not in rollouts.open


def test_a_rollout_created_through_the_api_is_written_into_not_finished() -> None:
    api, rollouts, recorder, transport = receiver()
    rollouts.create(rollout_id="ro-1", task_id="t", group_id="g")
    spans = [span(2, 1, 1, "chat", "503", gen_ai__operation__name="chat"), span(1, None, 0, "r")]
    data = json_format.MessageToDict(request(spans, rollstream__rollout_id="ro-1"))
    for s in data["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        for key in ("traceId", "spanId", "parentSpanId"):
            if key in s:
                s[key] = base64.b64decode(s[key]).hex()
    answer = post(api, json.dumps(data).encode(), "application/json; charset=utf-8")
    assert json.loads(answer.body) == {} and answer.headers["content-type"] == "application/json"
    assert "ro-1" in rollouts.open  # its owner finishes it (after its rewards)
    bodies = [e.body for e in events(recorder, transport)]
    assert [type(b).__name__ for b in bodies] == ["RolloutStarted", "RolloutError"]
    assert isinstance(bodies[1], RolloutError) and bodies[1].message == "503"
    assert api.stats.failed_calls == 1


def test_auth_and_bad_bodies_answer_4xx() -> None:
    api = receiver()[0]
    with pytest.raises(ApiError) as exc:
        post(api, b"", "application/x-protobuf", token=None)
    assert exc.value.status == 401
    with pytest.raises(ApiError) as exc:
        post(api, b"not json", "application/json")
    assert exc.value.status == 400


# --------------------------------------------------------------------------- stream core


def test_text_only_calls_are_counted_and_never_sampled() -> None:
    """The stream core on what the receiver records: a text-only call is a node with no tokens;
    no sample holds it, the token call beside it is trained on alone; ``text_only_calls``
    counts them (duplicates merged by the tree too)."""
    empty = np.zeros(0, np.uint32)

    def text_call(call_id: str) -> LlmCall:
        return LlmCall(call_id, None, 0, empty, empty, np.zeros(0, np.float32))

    def trajectory(rid: str, calls: list[LlmCall]) -> Trajectory:
        bodies = [RolloutStarted("task", "g", group_size=2), *calls, RolloutFinished()]
        state, out = None, []
        for seq, body in enumerate(bodies):
            state, o = apply(state, Event(f"{rid}-{seq}", rid, seq, seq + 1, body))
            out += o
        [t] = out
        assert isinstance(t, Trajectory)
        return t

    only_text = trajectory("r1", [text_call("a"), text_call("b")])
    mixed = trajectory(
        "r2", [LlmCall("t", None, 0, [1, 2, 3], [4, 5], [-0.1, -0.2]), text_call("c")]
    )
    assert (text_only_calls(only_text), text_only_calls(mixed)) == (2, 1)  # "b" merged into "a"
    for mode in ("path", "tree"):
        assert build_samples(only_text, SampleConfig(mode=mode)) == []
        [sample] = build_samples(mixed, SampleConfig(mode=mode))
        assert sample.input_ids.tolist() == [1, 2, 3, 4, 5] and sample.loss_weight == 1.0
    config = GroupConfig(advantage=AdvantageConfig(drop_zero_variance=False))
    state, _ = add_to_group(None, only_text, config)
    _, [closed] = add_to_group(state, mixed, config)
    assert closed.stats.num_samples == 1 and closed.stats.rollouts_without_samples == 1
