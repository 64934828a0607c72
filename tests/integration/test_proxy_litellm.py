"""litellm used as a library, pointed at the recording proxy as a harness would point it: the
litellm that mini-swe-agent installs from PyPI (the cached harness venv of test_harness_pypi.py),
unmodified, in its own interpreter, calling ``litellm.completion(model="openai/<model>",
api_base=<rollout base_url>, api_key=<rollout token>)`` against the proxy and the reference model
server. Plain, streamed and tool-calling calls are the rollout's LlmCalls on the Kafka log,
chained (parent links and prefix lengths); a context overflow reaches litellm as its
ContextWindowExceededError at once (not an error it retries), and the proxy's rate limit as its
RateLimitError."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_harness_pypi import CACHE, PACKAGE, VERSION, ensure_harness_venv
from test_proxy import (
    TOOLS,
    by_rollout,
    calls_of,
    consume,
    create_rollout,
    full_prompts,
    model_dir,
    model_server,
    proxy_settings,
    running_proxy,
)

from rollstream.producers.proxy.chat import ChatTemplate
from rollstream.schemas import CommonSettings

pytestmark = pytest.mark.integration
__all__ = ["model_dir", "model_server"]  # module fixtures shared with test_proxy

# Runs in the harness venv. argv: base_url, token, what ("chat" | "overflow" | "limit"), tools
# as JSON. Prints one JSON object: what litellm returned or raised, per call.
SCRIPT = r"""
import json, sys, time
import litellm

base, key, what, tools = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
kw = dict(model="openai/rollstream-tiny", api_base=base, api_key=key, max_retries=0,
          num_retries=0, temperature=1.0)
out = {}

def text_of(response):
    return response.choices[0].message.content or ""

def caught(fn):
    t0 = time.monotonic()
    try:
        fn()
        return {"raised": None}
    except Exception as exc:
        return {"raised": type(exc).__name__, "status": getattr(exc, "status_code", None),
                "context_window": isinstance(exc, litellm.ContextWindowExceededError),
                "bad_request": isinstance(exc, litellm.BadRequestError),
                "rate_limit": isinstance(exc, litellm.RateLimitError),
                "seconds": time.monotonic() - t0, "message": str(exc)[:500]}

if what == "chat":
    msgs = [{"role": "user", "content": "Tell me a story."}]
    plain = text_of(litellm.completion(messages=msgs, max_tokens=8, seed=1, **kw))
    msgs += [{"role": "assistant", "content": plain}, {"role": "user", "content": "More."}]
    chunks = list(litellm.completion(messages=msgs, max_tokens=8, seed=2, stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # a tool-calling conversation: the model's reply, then a tool call and its result
    talk = [{"role": "user", "content": "Weather in Paris?"}]
    r = litellm.completion(messages=talk, tools=tools, max_tokens=8, seed=3, **kw)
    call = {"id": "call_l1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    talk += [{"role": "assistant", "content": text_of(r)},
             {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_l1", "content": "sunny, 21C"}]
    r2 = litellm.completion(messages=talk, tools=tools, max_tokens=8, seed=4, **kw)
    out = {"plain": plain, "streamed": streamed, "chunks": len(chunks),
           "tool_reply": text_of(r), "finish": r2.choices[0].finish_reason}
elif what == "overflow":
    long = [{"role": "user", "content": "word " * 5000}]
    short = [{"role": "user", "content": "hi"}]
    out = {"prompt": caught(lambda: litellm.completion(messages=long, max_tokens=8, **kw)),
           "max_tokens": caught(lambda: litellm.completion(messages=short, max_tokens=100000,
                                                          **kw)),
           # litellm's own retries asked for: a context overflow is still not retried
           "retried": caught(lambda: litellm.completion(
               messages=long, max_tokens=8, **{**kw, "num_retries": 3}))}
elif what == "limit":
    short = [{"role": "user", "content": "hi"}]
    out = {"first": caught(lambda: litellm.completion(messages=short, max_tokens=4, **kw)),
           "second": caught(lambda: litellm.completion(messages=short, max_tokens=4, **kw))}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def litellm_python() -> Path:
    """The Python of the cached harness venv, which holds mini-swe-agent's litellm."""
    python = ensure_harness_venv(CACHE, PACKAGE, VERSION) / "bin" / "python"
    assert python.is_file()
    return python


def run_litellm(python: Path, ro: dict[str, Any], what: str) -> dict[str, Any]:
    done = subprocess.run(
        [str(python), "-c", SCRIPT, ro["base_url"], ro["token"], what, json.dumps(TOOLS)],
        capture_output=True,
        text=True,
        timeout=180,
        env={"PATH": "/usr/bin:/bin", "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return said


def test_litellm_calls_are_recorded_and_chained(
    kafka_settings: CommonSettings,
    tmp_path: Path,
    model_dir: Path,
    model_server: str,
    litellm_python: Path,
) -> None:
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [model_server])
    with running_proxy(settings) as (url, recorder, _):
        ro = create_rollout(url, task_id="litellm")
        said = run_litellm(litellm_python, ro, "chat")
        overflow = create_rollout(url, task_id="litellm-overflow")
        errors = run_litellm(litellm_python, overflow, "overflow")
        assert recorder.flush(30)

    assert said["chunks"] > 1 and said["finish"] in ("stop", "length")
    chat = ChatTemplate.from_dir(model_dir)
    calls = calls_of(by_rollout(consume(kafka_settings))[ro["rollout_id"]])
    assert len(calls) == 4
    prompts = full_prompts(calls)  # as a consumer rebuilds them from the wire deltas
    # plain then streamed, and the tool conversation's first call then its second (a tool call
    # and its result): each second call extends the first's whole sequence
    for first, second in ((0, 1), (2, 3)):
        sequence = [*prompts[first].tolist(), *calls[first].completion_ids.tolist()]
        assert calls[second].parent_call_id == calls[first].call_id
        assert calls[second].prefix_len == len(sequence)
        assert prompts[second][: len(sequence)].tolist() == sequence
    assert "get_weather" in chat.decode(prompts[2], skip_special_tokens=False)  # the tools
    for call in calls:  # recorded with the policy's tokens
        assert call.prompt_len > 0 and len(call.completion_ids) > 0
        assert len(call.completion_logprobs) == len(call.completion_ids)

    # a context overflow is litellm's ContextWindowExceededError (a BadRequestError), at once
    for case in ("prompt", "max_tokens", "retried"):
        err = errors[case]
        assert err["raised"] == "ContextWindowExceededError", (case, err)
        assert err["context_window"] and err["bad_request"] and err["status"] == 400, err
        assert err["seconds"] < 10.0, err  # no backoff
        assert "maximum context length" in err["message"], err


def test_litellm_sees_the_rate_limit_as_rate_limit_error(
    kafka_settings: CommonSettings,
    tmp_path: Path,
    model_dir: Path,
    model_server: str,
    litellm_python: Path,
) -> None:
    limit = {"proxy_rate_limit_rps": 0.01, "proxy_rate_limit_burst": 1}
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [model_server], **limit)
    with running_proxy(settings) as (url, recorder, _):
        ro = create_rollout(url, task_id="litellm-limit")
        said = run_litellm(litellm_python, ro, "limit")
        assert recorder.flush(30)
    assert said["first"]["raised"] is None, said
    second = said["second"]
    assert second["raised"] == "RateLimitError" and second["rate_limit"], second
    assert second["status"] == 429 and second["seconds"] < 10.0, second
