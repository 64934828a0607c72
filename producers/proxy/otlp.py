"""OpenTelemetry traces (OTLP/HTTP, protobuf or JSON) read as rollout facts: the pure half of the
proxy's ``POST /v1/traces`` receiver (otlp_api.py records the facts).

A harness instrumented with the OpenTelemetry GenAI semantic conventions exports its spans to
the proxy; each span with a ``gen_ai.operation.name`` becomes one fact of its rollout:

    chat | text_completion | generate_content   -> ModelCall   (an LlmCall; an error status: a
                                                                RolloutError)
    execute_tool                                -> ToolUse     (a ToolCall)
    the trace's root span (no parent), ended    -> RootEnd     (RolloutFinished: ok/unset ->
                                                                completed, error -> failed)
    anything else (embeddings, retrieval, a nested invoke_agent, a span of another library)
                                                -> ignored, counted

Rollout: the attribute ``rollstream.rollout_id`` (on the span, else on the resource), else the
trace id (32 hex digits). Task: ``rollstream.task_id``, else ``gen_ai.agent.name``, else the
resource's ``service.name``, else "otlp"; group: ``rollstream.group_id``, else the task. Span
attributes are read before resource attributes, from the first span of the trace (in start
order) that has them.

Token IDs: a model-call span that carries ``rollstream.prompt_token_ids`` (the FULL prompt),
``rollstream.completion_token_ids`` and ``rollstream.completion_logprobs`` (int and double
arrays; one logprob per completion token) is a token call. Without them it is a text-only
call: its usage comes from ``gen_ai.usage.*`` and its messages (``gen_ai.input.messages`` /
``gen_ai.output.messages``, as attributes or on a span event) are read, bounded, but an
LlmCall has no field for text, so they go no further. Only some of the three token attributes,
or arrays that do not fit, make the span rejected (a harness bug, named in the answer).

Facts come out in start-time order per trace; ``ModelCall.text_only`` says which kind a call is.
A bad span (bad ids, a tool span without ``gen_ai.tool.name``, a token array past the limit)
is rejected: counted and described in ``Decoded.errors``, never raised. A payload that is no
ExportTraceServiceRequest raises ApiError 400; an unknown content type or encoding 415 (gzip
bodies are inflated, bounded).
"""

from __future__ import annotations

import base64
import json
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from rollstream.producers.errors import ApiError
from rollstream.schemas.events import policy_version_problem

__all__ = [
    "MODEL_OPERATIONS",
    "Decoded",
    "ModelCall",
    "OtlpLimits",
    "RootEnd",
    "ToolUse",
    "TraceFacts",
    "decode_request",
    "encode_response",
    "inflate",
    "map_request",
    "media_type",
]

MODEL_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})
TOOL_OPERATION = "execute_tool"
PROTOBUF, JSON = "application/x-protobuf", "application/json"
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9_\-]{1,128}")
_U32_MAX = 2**32 - 1
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


@dataclass(frozen=True, slots=True)
class OtlpLimits:
    """Bounds of one export request."""

    max_spans: int = 10_000  # spans read per request; the rest are rejected
    max_tokens: int = 1 << 20  # per token array of one call
    max_text_chars: int = 1 << 20  # per string kept (arguments, results, messages, errors)
    max_errors: int = 8  # reasons listed in the answer's error_message


@dataclass(frozen=True, slots=True)
class ModelCall:
    span_id: str  # 16 hex digits: the call id
    start_ns: int
    end_ns: int
    model: str
    provider: str
    finish_reason: str
    prompt_ids: list[int] | None  # None: a text-only call
    completion_ids: list[int] | None
    logprobs: list[float] | None
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    policy_version: int | None
    input_messages: str  # JSON text (bounded; "" when the span has none)
    output_messages: str
    error: str | None  # the span's error status message: a failed call

    @property
    def text_only(self) -> bool:
        return self.prompt_ids is None

    @property
    def latency_ms(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e6


@dataclass(frozen=True, slots=True)
class ToolUse:
    span_id: str
    start_ns: int
    end_ns: int
    name: str
    tool_call_id: str  # gen_ai.tool.call.id, else the span id
    arguments: str
    result: str
    is_error: bool

    @property
    def duration_ms(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e6


@dataclass(frozen=True, slots=True)
class RootEnd:
    """The trace's root span ended: the rollout is over (``error`` None: completed)."""

    span_id: str
    start_ns: int
    end_ns: int
    error: str | None


Fact: TypeAlias = ModelCall | ToolUse | RootEnd


@dataclass(slots=True)
class TraceFacts:
    """What one request says about one rollout: who it is and its facts in start order."""

    rollout_id: str
    trace_id: str
    task_id: str
    group_id: str
    harness: str
    run_id: str
    group_size: int | None
    metadata: dict[str, str]
    facts: list[Fact] = field(default_factory=list)


@dataclass(slots=True)
class Decoded:
    traces: list[TraceFacts]
    spans: int = 0  # spans in the request
    ignored: int = 0  # spans that are no fact (not rejected)
    rejected: int = 0
    errors: list[str] = field(default_factory=list)  # the first max_errors reasons

    def reject(self, reason: str, limits: OtlpLimits, count: int = 1) -> None:
        self.rejected += count
        if len(self.errors) < limits.max_errors:
            self.errors.append(reason)


# --------------------------------------------------------------------------- wire


def media_type(content_type: str | None) -> str:
    """``application/x-protobuf`` or ``application/json`` (415 for anything else)."""
    kind = (content_type or PROTOBUF).split(";", 1)[0].strip().lower()
    if kind in (PROTOBUF, "application/protobuf"):
        return PROTOBUF
    if kind == JSON:
        return JSON
    raise ApiError(
        415, f"Content-Type {kind!r}: OTLP/HTTP is {PROTOBUF} or {JSON}", param="content-type"
    )


def inflate(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body under its Content-Encoding (identity or gzip), at most ``limit`` bytes once
    inflated (413 past it, 415 for another encoding, 400 for a broken gzip stream)."""
    kind = (encoding or "identity").strip().lower()
    if kind == "identity":
        return body
    if kind != "gzip":
        raise ApiError(
            415, f"Content-Encoding {kind!r}: identity or gzip", param="content-encoding"
        )
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise ApiError(400, f"broken gzip body: {exc}", code="invalid_otlp") from exc
    if len(data) > limit:
        raise ApiError(413, f"request body over {limit} bytes inflated", code="body_too_large")
    return data


def decode_request(body: bytes, content_type: str | None) -> ExportTraceServiceRequest:
    """The request of an OTLP/HTTP body; ApiError 400 when it is not one (415: the type)."""
    kind = media_type(content_type)
    request = ExportTraceServiceRequest()
    try:
        if kind == PROTOBUF:
            request.ParseFromString(body)
        else:
            data = json.loads(body or b"{}")
            if not isinstance(data, dict):
                raise ValueError("the body is not a JSON object")
            _hex_ids_to_base64(data)
            json_format.ParseDict(data, request, ignore_unknown_fields=True)
    except (DecodeError, ValueError, json_format.ParseError, TypeError) as exc:
        raise ApiError(
            400, f"not an OTLP ExportTraceServiceRequest: {exc}", code="invalid_otlp"
        ) from exc
    return request


def encode_response(content_type: str, rejected: int, error_message: str) -> bytes:
    """An ExportTraceServiceResponse in the request's encoding (partial_success when
    ``rejected`` or ``error_message``)."""
    response = ExportTraceServiceResponse()
    if rejected or error_message:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = error_message
    if content_type == JSON:
        return json_format.MessageToJson(response, indent=None).encode()
    return response.SerializeToString()


def _hex_ids_to_base64(data: dict[str, Any]) -> None:
    """OTLP/JSON writes trace and span ids as hex; protobuf's JSON mapping reads bytes as
    base64. Rewrites the ids of spans and links in place (a value that is no hex is left for
    the parser to refuse)."""
    for rs in _dicts(data.get("resourceSpans")):
        for ss in _dicts(rs.get("scopeSpans")):
            for span in _dicts(ss.get("spans")):
                for obj in (span, *_dicts(span.get("links"))):
                    for key in _ID_FIELDS:
                        value = obj.get(key)
                        if isinstance(value, str) and value:
                            try:
                                obj[key] = base64.b64encode(bytes.fromhex(value)).decode()
                            except ValueError:
                                raise ValueError(f"{key} {value[:40]!r} is not hex") from None


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


# --------------------------------------------------------------------------- attributes


def _value(v: AnyValue, limits: OtlpLimits, depth: int = 0) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        if depth > 8:
            return None
        return [_value(x, limits, depth + 1) for x in v.array_value.values]
    if kind == "kvlist_value":
        if depth > 8:
            return None
        return {kv.key: _value(kv.value, limits, depth + 1) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    return getattr(v, kind)


def _attrs(kvs: Iterable[KeyValue], limits: OtlpLimits) -> dict[str, Any]:
    return {kv.key: _value(kv.value, limits) for kv in kvs}


def _text(value: Any, limits: OtlpLimits) -> str:
    """A string attribute as it is, anything else as JSON; cut to max_text_chars."""
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text[: limits.max_text_chars]


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _tokens(attrs: Mapping[str, Any], limits: OtlpLimits) -> tuple[Any, Any, Any] | str:
    """The token attributes (all None: a text-only call), or why they cannot be used."""
    keys = (
        "rollstream.prompt_token_ids",
        "rollstream.completion_token_ids",
        "rollstream.completion_logprobs",
    )
    present = [k for k in keys if k in attrs]
    if not present:
        return None, None, None
    if len(present) < len(keys):
        missing = ", ".join(k for k in keys if k not in attrs)
        return f"token ids need all of {', '.join(keys)}; missing {missing}"
    prompt, completion, logprobs = (attrs[k] for k in keys)
    for key, arr in zip(keys[:2], (prompt, completion), strict=True):
        if isinstance(arr, list) and len(arr) > limits.max_tokens:
            return f"{key} has {len(arr)} tokens, over {limits.max_tokens}"
        if not isinstance(arr, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _U32_MAX for t in arr
        ):
            return f"{key} must be an array of token ids (0 <= id < 2**32)"
    if not prompt:
        return "rollstream.prompt_token_ids is empty"
    if not isinstance(logprobs, list) or not all(
        isinstance(x, float | int) and not isinstance(x, bool) for x in logprobs
    ):
        return "rollstream.completion_logprobs must be an array of numbers"
    if len(logprobs) != len(completion):
        return (
            f"rollstream.completion_logprobs has {len(logprobs)} values for "
            f"{len(completion)} completion tokens"
        )
    return prompt, completion, [float(x) for x in logprobs]


def _messages(span: Span, attrs: Mapping[str, Any], key: str, limits: OtlpLimits) -> str:
    if key in attrs:
        return _text(attrs[key], limits)
    for event in span.events:  # e.g. gen_ai.client.inference.operation.details
        for kv in event.attributes:
            if kv.key == key:
                return _text(_value(kv.value, limits), limits)
    return ""


def _error(span: Span, attrs: Mapping[str, Any], limits: OtlpLimits) -> str | None:
    if span.status.code != Status.STATUS_CODE_ERROR:
        return None
    message = span.status.message or _text(attrs.get("error.type"), limits) or "error"
    return message[: limits.max_text_chars]


# --------------------------------------------------------------------------- mapping


def _model_call(
    span: Span, sid: str, attrs: Mapping[str, Any], limits: OtlpLimits
) -> ModelCall | str:
    tokens = _tokens(attrs, limits)
    if isinstance(tokens, str):
        return tokens
    prompt, completion, logprobs = tokens
    reasons = attrs.get("gen_ai.response.finish_reasons")
    if isinstance(reasons, list) and reasons and isinstance(reasons[0], str):
        finish = reasons[0][:64]
    else:
        finish = "stop"
    model = attrs.get("gen_ai.response.model") or attrs.get("gen_ai.request.model") or ""
    version = attrs.get("rollstream.policy_version")
    return ModelCall(
        span_id=sid,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        model=_text(model, limits)[:256],
        provider=_text(attrs.get("gen_ai.provider.name") or attrs.get("gen_ai.system"), limits)[
            :64
        ],
        finish_reason=finish,
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=logprobs,
        input_tokens=_int(attrs.get("gen_ai.usage.input_tokens")),
        output_tokens=_int(attrs.get("gen_ai.usage.output_tokens")),
        cached_tokens=_int(attrs.get("gen_ai.usage.cache_read.input_tokens")),
        policy_version=version if policy_version_problem(version) is None else None,
        input_messages=_messages(span, attrs, "gen_ai.input.messages", limits),
        output_messages=_messages(span, attrs, "gen_ai.output.messages", limits),
        error=_error(span, attrs, limits),
    )


def _tool_use(span: Span, sid: str, attrs: Mapping[str, Any], limits: OtlpLimits) -> ToolUse | str:
    name = attrs.get("gen_ai.tool.name")
    if not isinstance(name, str) or not name:
        return "an execute_tool span needs gen_ai.tool.name"
    call_id = attrs.get("gen_ai.tool.call.id")
    error = _error(span, attrs, limits)
    result = attrs.get("gen_ai.tool.call.result")
    return ToolUse(
        span_id=sid,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        name=name[:256],
        tool_call_id=call_id[:256] if isinstance(call_id, str) and call_id else sid,
        arguments=_text(attrs.get("gen_ai.tool.call.arguments"), limits),
        result=_text(result, limits) if result is not None else (error or ""),
        is_error=error is not None,
    )


def _facts(span: Span, sid: str, attrs: Mapping[str, Any], limits: OtlpLimits) -> list[Fact] | str:
    """The span's fact, then (a root span) the end of its rollout; or why the span is bad."""
    if len(sid) != 16:
        return "span id is not 8 bytes"
    operation = attrs.get("gen_ai.operation.name")
    facts: list[Fact] = []
    fact: Fact | str | None = None
    if operation in MODEL_OPERATIONS:
        fact = _model_call(span, sid, attrs, limits)
    elif operation == TOOL_OPERATION:
        fact = _tool_use(span, sid, attrs, limits)
    if isinstance(fact, str):
        return fact
    if fact is not None:
        facts.append(fact)
    if not span.parent_span_id:
        error = _error(span, attrs, limits)
        facts.append(RootEnd(sid, span.start_time_unix_nano, span.end_time_unix_nano, error))
    return facts


def _pick(key: str, spans: list[dict[str, Any]], resource: Mapping[str, Any]) -> Any:
    for attrs in spans:
        if key in attrs:
            return attrs[key]
    return resource.get(key)


def _trace(
    trace_id: str, spans: list[dict[str, Any]], resource: Mapping[str, Any], limits: OtlpLimits
) -> TraceFacts:
    def text(key: str) -> str:
        value = _pick(key, spans, resource)
        return value[:256] if isinstance(value, str) else ""

    rollout_id = text("rollstream.rollout_id") or trace_id
    task = text("rollstream.task_id") or text("gen_ai.agent.name") or text("service.name")
    task = task or "otlp"
    size = _pick("rollstream.group_size", spans, resource)
    metadata = {"otlp.trace_id": trace_id}
    for key in ("service.name", "gen_ai.conversation.id", "gen_ai.agent.name"):
        if text(key):
            metadata[f"otlp.{key}"] = text(key)
    return TraceFacts(
        rollout_id=rollout_id,
        trace_id=trace_id,
        task_id=task,
        group_id=text("rollstream.group_id") or task,
        harness=text("service.name") or "otlp",
        run_id=text("rollstream.run_id"),
        group_size=size if isinstance(size, int) and 0 < size <= 1 << 20 else None,
        metadata=metadata,
    )


def map_request(request: ExportTraceServiceRequest, limits: OtlpLimits | None = None) -> Decoded:
    """The rollout facts of an export request, per trace (in first-seen order), each trace's
    facts in start-time order (a root's end last). Bad spans are rejected, never raised."""
    limits = limits or OtlpLimits()
    decoded = Decoded([])
    spans: list[tuple[Span, dict[str, Any], dict[str, Any]]] = []  # span, its attrs, resource
    for rs in request.resource_spans:
        resource = _attrs(rs.resource.attributes, limits)
        for ss in rs.scope_spans:
            for span in ss.spans:
                decoded.spans += 1
                if len(spans) < limits.max_spans:
                    spans.append((span, _attrs(span.attributes, limits), resource))
    if decoded.spans > len(spans):
        over = decoded.spans - len(spans)
        decoded.reject(f"{over} spans over the limit of {limits.max_spans} per request", limits)
        decoded.rejected += over - 1
    spans.sort(key=lambda s: (s[0].start_time_unix_nano, not s[0].parent_span_id))
    traces: dict[str, TraceFacts] = {}
    by_trace: dict[str, list[tuple[Span, dict[str, Any], dict[str, Any]]]] = {}
    for item in spans:
        by_trace.setdefault(item[0].trace_id.hex(), []).append(item)
    for trace_id, items in by_trace.items():
        if len(trace_id) != 32:
            decoded.reject(f"trace id {trace_id!r} is not 16 bytes", limits, len(items))
            continue
        resource = items[0][2]
        trace = _trace(trace_id, [a for _, a, _ in items], resource, limits)
        if not _ROLLOUT_ID.fullmatch(trace.rollout_id):  # match() took a trailing newline
            reason = f"rollstream.rollout_id {trace.rollout_id!r}: [A-Za-z0-9_-]{{1,128}}"
            decoded.reject(reason, limits, len(items))
            continue
        roots: list[Fact] = []
        for span, attrs, _ in items:
            sid = span.span_id.hex()
            facts = _facts(span, sid, attrs, limits)
            if isinstance(facts, str):
                decoded.reject(f"span {sid} ({span.name[:64]!r}): {facts}", limits)
                continue
            if not facts:
                decoded.ignored += 1
            for fact in facts:
                (roots if isinstance(fact, RootEnd) else trace.facts).append(fact)
        trace.facts += roots  # the rollout ends after everything else the request holds
        traces[trace_id] = trace
    decoded.traces = list(traces.values())
    return decoded
