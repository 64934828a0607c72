"""``POST /v1/traces``: the proxy as an OTLP/HTTP trace receiver. A harness instrumented with
OpenTelemetry (GenAI semantic conventions) exports its spans here and its model calls, tool
executions and end become rollout events, with no proxy in its model calls' path.

    POST /v1/traces   admin key   ExportTraceServiceRequest (application/x-protobuf or
                                  application/json; gzip or identity)
                      -> 200 ExportTraceServiceResponse in the same encoding; spans that could
                         not be used: partial_success {rejected_spans, error_message}

otlp.py turns the request into facts per rollout; this module records them through the
proxy's ``Rollouts`` (the registry the rollout API writes through, so each rollout has one
writer and one gap-free seq):

- a rollout named by a trace that is not open is opened here (RolloutStarted with the task,
  group, run and harness the spans or resource name); one created through ``POST
  /v1/rollouts`` (its id in ``rollstream.rollout_id``) is written into as it is;
- a model call: an LlmCall with ``call_id`` = the span id. With token ids it is a token call
  (the context trie finds its parent and delta). Without, a text-only call: an LlmCall with no
  tokens at all (no parent, prefix_len 0, empty arrays) and the span's usage, which the stream
  processors never make a sample of (streams/core/samples.py ``text_only_calls``). A failed
  call (error status): a RolloutError;
- a tool execution: a ToolCall at the rollout's latest model call (once per tool_call_id);
- the root span's end: RolloutFinished (error status: failed) for a rollout opened here; one
  created through the rollout API is finished by its owner (``/finish``), after its rewards.

A span exported twice (an exporter's retry) is recorded once. A span for a finished rollout, or
one otlp.py rejects, is counted in ``rejected_spans``; a malformed body is a 400, never a 500.
``OtlpApi.stats`` counts everything (text-only calls on their own).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from rollstream.producers.proxy.openai_wire import Answer, HttpRequest
from rollstream.producers.proxy.otlp import (
    Decoded,
    ModelCall,
    OtlpLimits,
    RootEnd,
    ToolUse,
    TraceFacts,
    decode_request,
    encode_response,
    inflate,
    map_request,
    media_type,
)
from rollstream.producers.proxy.rollout_api import Auth, OpenRollout, Rollouts
from rollstream.producers.sdk.recorder import RecorderUsageError
from rollstream.schemas import RolloutStatus, Usage

__all__ = ["OtlpApi", "OtlpStats"]

_NONE: list[int] = []
_NO_LOGPROBS: list[float] = []


@dataclass(slots=True)
class OtlpStats:
    requests: int = 0
    spans: int = 0
    ignored_spans: int = 0  # no gen_ai operation the receiver maps (and not a root)
    rejected_spans: int = 0
    duplicate_spans: int = 0  # exported again: recorded once
    rollouts_opened: int = 0
    rollouts_finished: int = 0
    token_calls: int = 0
    text_only_calls: int = 0  # LlmCalls without token ids: never trained on
    failed_calls: int = 0  # model calls with an error status: RolloutError events
    tool_calls: int = 0


@dataclass(slots=True)
class _Trace:
    """What the receiver remembers of a rollout it writes into."""

    opened_here: bool
    seen: set[str] = field(default_factory=set)  # "<kind>:<span id>" recorded already
    last_call: str | None = None  # the latest model call: where tool calls attach


class OtlpApi:
    """The ``/v1/traces`` handler over the proxy's rollout registry and admin keys."""

    def __init__(
        self,
        rollouts: Rollouts,
        auth: Auth,
        *,
        max_body_bytes: int,
        limits: OtlpLimits | None = None,
        max_traces: int = 100_000,
    ) -> None:
        self.rollouts, self.auth = rollouts, auth
        self.max_body_bytes = max_body_bytes
        self.limits = limits or OtlpLimits()
        self.max_traces = max_traces
        self.stats = OtlpStats()
        self._traces: OrderedDict[str, _Trace] = OrderedDict()  # by rollout id, oldest first

    async def traces(self, request: HttpRequest) -> Answer:
        self.auth.admin(request.token)
        kind = media_type(request.headers.get("content-type"))
        body = inflate(
            await request.body(), request.headers.get("content-encoding"), self.max_body_bytes
        )
        decoded = map_request(decode_request(body, kind), self.limits)
        self.record(decoded)
        s = self.stats
        s.requests += 1
        s.spans += decoded.spans
        s.ignored_spans += decoded.ignored
        s.rejected_spans += decoded.rejected
        message = "; ".join(decoded.errors)
        return Answer(
            encode_response(kind, decoded.rejected, message), headers={"content-type": kind}
        )

    def record(self, decoded: Decoded) -> None:
        """Record every trace's facts; what cannot be recorded is rejected in ``decoded``."""
        for trace in decoded.traces:
            if trace.facts:
                self._record_trace(trace, decoded)

    def _state(self, trace: TraceFacts, decoded: Decoded) -> tuple[OpenRollout, _Trace] | None:
        rid = trace.rollout_id
        ro = self.rollouts.get(rid) if rid in self.rollouts.open else None  # its idle clock too
        state = self._traces.get(rid)
        if ro is None:
            if rid in self.rollouts.finished:
                spans = len({f.span_id for f in trace.facts})
                decoded.reject(f"rollout {rid} is finished", self.limits, spans)
                return None
            ro = self.rollouts.create(
                rollout_id=rid,
                task_id=trace.task_id,
                group_id=trace.group_id,
                harness=trace.harness,
                run_id=trace.run_id,
                group_size=trace.group_size,
                metadata=trace.metadata,
            )
            self.stats.rollouts_opened += 1
            state = _Trace(opened_here=True)
        elif state is None:  # opened through the rollout API
            state = _Trace(opened_here=False)
        self._traces[rid] = state
        self._traces.move_to_end(rid)
        while len(self._traces) > self.max_traces:
            self._traces.popitem(last=False)
        return ro, state

    def _record_trace(self, trace: TraceFacts, decoded: Decoded) -> None:
        opened = self._state(trace, decoded)
        if opened is None:
            return
        ro, state = opened
        for fact in trace.facts:
            key = f"{type(fact).__name__}:{fact.span_id}"
            if key in state.seen:
                self.stats.duplicate_spans += 1
                continue
            state.seen.add(key)
            try:
                if isinstance(fact, ModelCall):
                    self._model_call(ro, state, fact)
                elif isinstance(fact, ToolUse):
                    self._tool_use(ro, state, fact)
                elif isinstance(fact, RootEnd) and state.opened_here:
                    self._finish(trace.rollout_id, fact)
                    self._traces.pop(trace.rollout_id, None)
                    return
            except RecorderUsageError as exc:  # the rollout finished meanwhile
                decoded.reject(f"span {fact.span_id}: {exc}", self.limits)

    def _model_call(self, ro: OpenRollout, state: _Trace, call: ModelCall) -> None:
        backend = f"otlp:{call.provider}" if call.provider else "otlp"
        if call.error is not None:
            ro.handle.error("model", call.error, backend=backend)
            ro.errors += 1
            self.stats.failed_calls += 1
            return
        if call.text_only:
            prompt, completion, logprobs = _NONE, _NONE, _NO_LOGPROBS
            usage: Usage | None = Usage(call.input_tokens, call.output_tokens, call.cached_tokens)
        else:
            prompt, completion, logprobs = call.prompt_ids, call.completion_ids, call.logprobs
            usage = None  # counted from the tokens
        ro.handle.llm_call(
            prompt,
            completion,
            logprobs,
            call_id=call.span_id,
            finish_reason=call.finish_reason,
            model=call.model,
            backend=backend,
            policy_version=call.policy_version,
            latency_ms=call.latency_ms,
            usage=usage,
        )
        if call.text_only:
            self.stats.text_only_calls += 1
        else:
            self.stats.token_calls += 1
        ro.calls += 1
        state.last_call = call.span_id

    def _tool_use(self, ro: OpenRollout, state: _Trace, tool: ToolUse) -> None:
        if not ro.memory.claim_tool_result(tool.tool_call_id):
            self.stats.duplicate_spans += 1  # reported already (a chat tool message, the API)
            return
        ro.handle.tool_call(
            tool.name,
            tool.arguments,
            tool.result,
            is_error=tool.is_error,
            duration_ms=tool.duration_ms,
            at_call_id=state.last_call,
            tool_call_id=tool.tool_call_id,
        )
        self.stats.tool_calls += 1

    def _finish(self, rollout_id: str, end: RootEnd) -> None:
        status = RolloutStatus.FAILED if end.error is not None else RolloutStatus.COMPLETED
        if self.rollouts.finish(rollout_id, status, end.error):
            self.stats.rollouts_finished += 1
