"""A harness instrumented with the real OpenTelemetry SDK exports its GenAI spans (OTLP/HTTP,
protobuf) to the proxy's /v1/traces; the rollout events are read back from the real Kafka."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode
from test_proxy import (
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

from rollstream.schemas import (
    CommonSettings,
    LlmCall,
    RolloutError,
    RolloutFinished,
    RolloutStarted,
    RolloutStatus,
    ToolCall,
)

pytestmark = pytest.mark.integration
__all__ = ["model_dir"]  # the module fixture shared with test_proxy


def tracing(url: str, **resource: str) -> TracerProvider:
    exporter = OTLPSpanExporter(
        endpoint=f"{url}/v1/traces", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    )
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def run_agent(provider: TracerProvider, rollout_id: str | None = None, fail: bool = False) -> int:
    """One agent run, traced as the GenAI conventions say: a token call, a tool, a text-only
    call (a model whose token ids the harness does not see); returns the trace id."""
    tracer = provider.get_tracer("harness")
    extra = {"rollstream.rollout_id": rollout_id} if rollout_id else {}
    with tracer.start_as_current_span("invoke_agent solver") as agent:
        agent.set_attributes({"gen_ai.operation.name": "invoke_agent", **extra})
        with tracer.start_as_current_span("chat policy") as s:
            s.set_attributes(
                {
                    "gen_ai.operation.name": "chat",
                    "gen_ai.request.model": "policy",
                    "gen_ai.response.finish_reasons": ["tool_calls"],
                    **extra,
                    "rollstream.prompt_token_ids": [5, 6, 7, 8],
                    "rollstream.completion_token_ids": [9, 10],
                    "rollstream.completion_logprobs": [-0.5, -1.5],
                }
            )
        with tracer.start_as_current_span("execute_tool grep") as s:
            s.set_attributes(
                {
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "grep",
                    "gen_ai.tool.call.id": "call_7",
                    "gen_ai.tool.call.arguments": '{"p": "x"}',
                    "gen_ai.tool.call.result": "3 matches",
                    **extra,
                }
            )
        with tracer.start_as_current_span("chat judge") as s:
            s.set_attributes(
                {
                    "gen_ai.operation.name": "chat",
                    "gen_ai.request.model": "judge",
                    "gen_ai.provider.name": "openai",
                    "gen_ai.usage.input_tokens": 120,
                    "gen_ai.usage.output_tokens": 9,
                    **extra,
                    "gen_ai.input.messages": '[{"role": "user", "parts": [{"type": "text"}]}]',
                }
            )
        if fail:
            agent.set_status(Status(StatusCode.ERROR, "gave up"))
        return agent.get_span_context().trace_id


def test_a_traced_harness_records_rollouts_without_the_proxy_in_its_path(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path
) -> None:
    with serve(ScriptedBackend().app()) as burl:
        settings = proxy_settings(kafka_settings, tmp_path, model_dir, [burl])
        with running_proxy(settings) as (url, recorder, proxy):
            provider = tracing(
                url,
                **{
                    "service.name": "otel-harness",
                    "rollstream.task_id": "task-otel",
                    "rollstream.group_id": "g-otel",
                },
            )
            ok = format(run_agent(provider), "032x")
            failed = format(run_agent(provider, fail=True), "032x")
            created = create_rollout(
                url, task_id="t-api", group_id="g-api", final_rewards="harness"
            )
            owned = created["rollout_id"]
            run_agent(provider, rollout_id=owned)
            assert provider.force_flush(30)
            stats = proxy.otlp.stats
            assert (stats.token_calls, stats.text_only_calls, stats.tool_calls) == (3, 3, 3)
            assert (stats.rollouts_opened, stats.rollouts_finished, stats.rejected_spans) == (
                2,
                2,
                0,
            )
            assert owned in proxy.rollouts.open  # its owner finishes it, after its reward
            auth = {"Authorization": f"Bearer {created['token']}"}
            for route, body in (("rewards", {"value": 1.0}), ("finish", {})):
                r = httpx.post(f"{url}/v1/rollouts/{owned}/{route}", json=body, headers=auth)
                assert r.status_code == 200, r.text
            status = httpx.get(
                f"{url}/v1/admin/status", headers={"Authorization": f"Bearer {ADMIN}"}
            ).json()
            assert status["otlp"]["text_only_calls"] == 3
            refused = httpx.post(
                f"{url}/v1/traces",
                content=b"",
                headers={"content-type": "application/x-protobuf", "authorization": "Bearer nope"},
            )
            assert refused.status_code == 401
            provider.shutdown()
            assert recorder.flush(30)
    rollouts = by_rollout(consume(kafka_settings))
    assert set(rollouts) == {ok, failed, owned}
    for rid in (ok, failed):
        evs = rollouts[rid]
        assert [e.seq for e in evs] == list(range(5))
        started, call, tool, text, finished = (e.body for e in evs)
        assert isinstance(started, RolloutStarted)
        assert (started.task_id, started.group_id, started.harness) == (
            "task-otel",
            "g-otel",
            "otel-harness",
        )
        assert started.metadata["otlp.trace_id"] == rid
        assert isinstance(call, LlmCall) and call.model == "policy"
        assert call.prompt_delta.tolist() == [5, 6, 7, 8] and call.completion_ids.tolist() == [
            9,
            10,
        ]
        assert call.completion_logprobs.tolist() == [-0.5, -1.5]
        assert isinstance(tool, ToolCall) and (tool.name, tool.tool_call_id) == ("grep", "call_7")
        assert (tool.arguments, tool.result, tool.at_call_id) == (
            '{"p": "x"}',
            "3 matches",
            call.call_id,
        )
        assert isinstance(text, LlmCall) and text.model == "judge" and text.backend == "otlp:openai"
        assert len(text.prompt_delta) == len(text.completion_ids) == text.prefix_len == 0
        assert (text.usage.prompt_tokens, text.usage.completion_tokens) == (120, 9)
        assert isinstance(finished, RolloutFinished)
    done = rollouts[ok][-1].body
    assert isinstance(done, RolloutFinished) and done.status is RolloutStatus.COMPLETED
    last = rollouts[failed][-1].body
    assert isinstance(last, RolloutFinished) and last.status is RolloutStatus.FAILED
    assert last.error == "gave up"
    kinds = [type(e.body).__name__ for e in rollouts[owned]]
    assert kinds == [
        "RolloutStarted",
        "LlmCall",
        "ToolCall",
        "LlmCall",
        "Reward",
        "RolloutFinished",
    ]
    assert not any(isinstance(e.body, RolloutError) for evs in rollouts.values() for e in evs)
