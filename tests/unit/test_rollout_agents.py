"""The agents against a fake proxy at the HTTP edge (httpx.MockTransport answering OpenAI
chat completions with scripted tool calls, and taking tool-call records) and a real sandbox
(the ``local`` kind: the loop's mechanics, not isolation, are under test here): files written
by write_file appear in the sandbox, bash output goes back to the model, submit ends the loop,
malformed tool calls are answered as tool errors, max_turns and the deadline end it, proxy
failures are outcomes. The command agent runs a real harness script beside the sandbox; the
python agent calls functions of this module with the context and its options."""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollstream.producers.rollouts.agents import (
    TOOLS,
    AgentContext,
    AgentError,
    AgentOutcome,
    CommandAgent,
    PythonAgent,
    RolloutEndpoint,
    ToolAgent,
    build_agent,
)
from rollstream.producers.rollouts.jobs import CommandAgentSpec, PythonAgentSpec, ToolAgentSpec
from rollstream.producers.rollouts.local import LocalProvider
from rollstream.producers.rollouts.sandbox import Sandbox, SandboxLimits, SandboxSpec

ENDPOINT = RolloutEndpoint(
    rollout_id="r1",
    base_url="http://proxy.test/rollouts/r1/v1",
    token="rs1.r1.sig",
    api_url="http://proxy.test",
)


def call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"name": name, "arguments": args}


class FakeProxy:
    """Answers chat completions from a script (a list of tool calls per reply; [] for a reply
    with text only) and records what the agent sent."""

    def __init__(self, script: list[list[dict[str, Any]]], *, repeat: bool = False) -> None:
        self.script = itertools.cycle(script) if repeat else iter(script)
        self.chats: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] = []
        self.status: int | None = None  # answer every chat with this status instead
        self.code = "x"  # and this error code
        self.refusals: list[int] = []  # statuses to answer first (Retry-After: 0), in order
        self.ids = itertools.count()

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == f"Bearer {ENDPOINT.token}"
        body = json.loads(request.content)
        if request.url.path == "/rollouts/r1/v1/chat/completions":
            self.chats.append(body)
            error = {"message": "scripted failure", "type": "x", "code": self.code}
            if self.refusals:
                status = self.refusals.pop(0)
                return httpx.Response(status, json={"error": error}, headers={"Retry-After": "0"})
            if self.status is not None:
                return httpx.Response(self.status, json={"error": error})
            calls = next(self.script, [])
            n = next(self.ids)
            message: dict[str, Any] = {"role": "assistant", "content": f"thinking {n}"}
            if calls:
                message["tool_calls"] = [
                    {"id": f"call_{n}_{i}", "type": "function", "function": c}
                    for i, c in enumerate(calls)
                ]
            return httpx.Response(
                200,
                json={
                    "id": f"chatcmpl-{n}",
                    "object": "chat.completion",
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "message": message,
                            "finish_reason": "tool_calls" if calls else "stop",
                        }
                    ],
                    "rollstream": {"call_id": f"llm{n}", "rollout_id": "r1"},
                },
            )
        if request.url.path == "/v1/rollouts/r1/tool_calls":
            self.tools.append(body)
            return httpx.Response(200, json={"rollout_id": "r1", "tool_call_id": "t"})
        return httpx.Response(404, json={"error": {"message": "no route"}})

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)

    def tool_messages(self, chat: int) -> list[str]:
        return [m["content"] for m in self.chats[chat]["messages"] if m["role"] == "tool"]


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[Sandbox]:
    provider = LocalProvider(tmp_path / "sandboxes")
    spec = SandboxSpec(
        kind="local", files={"main.py": b"print('start')\n"}, limits=SandboxLimits(timeout=20)
    )
    with provider.create(spec) as sb:
        yield sb


def context(sandbox: Sandbox, seconds: float = 30.0) -> AgentContext:
    return AgentContext(
        sandbox=sandbox,
        task_id="t1",
        instructions="Make main.py print 42.",
        endpoint=ENDPOINT,
        deadline=time.monotonic() + seconds,
    )


def tool_agent(proxy: FakeProxy, **options: Any) -> ToolAgent:
    return ToolAgent(ToolAgentSpec(kind="tool", **options), transport=proxy.transport())


def test_write_bash_submit(sandbox: Sandbox) -> None:
    proxy = FakeProxy(
        [
            [call("write_file", {"path": "pkg/answer.py", "content": "print(6 * 7)\n"})],
            [call("bash", {"command": "python3 pkg/answer.py; echo oops >&2; exit 3"})],
            [call("read_file", {"path": "pkg/answer.py"}), call("submit", {})],
            [call("bash", {"command": "echo never"})],
        ]
    )
    outcome = tool_agent(proxy, max_turns=10).run(context(sandbox))
    assert (outcome.status, outcome.stop, outcome.turns, outcome.tool_calls) == (
        "ok",
        "submit",
        3,
        4,
    )
    assert sandbox.copy_out("pkg/answer.py") == b"print(6 * 7)\n"  # written in the sandbox
    assert proxy.tool_messages(1) == ["wrote 13 bytes to /work/pkg/answer.py"]
    bash_out = proxy.tool_messages(2)[1]
    assert bash_out.startswith("exit code: 3\n42\n") and "[stderr]\noops" in bash_out
    # every tool call recorded once, with the sandbox, the call that asked for it, its id
    assert [t["name"] for t in proxy.tools] == ["write_file", "bash", "read_file", "submit"]
    assert [t["at_call_id"] for t in proxy.tools] == ["llm0", "llm1", "llm2", "llm2"]
    assert [t["tool_call_id"] for t in proxy.tools] == [
        "call_0_0",
        "call_1_0",
        "call_2_0",
        "call_2_1",
    ]
    assert {t["sandbox"] for t in proxy.tools} == {sandbox.id}
    assert proxy.tools[2]["result"] == "print(6 * 7)\n" and not proxy.tools[2]["is_error"]
    assert all(t["duration_ms"] >= 0 for t in proxy.tools)
    # the model saw the tools, the task and its own replies with their tool calls
    first = proxy.chats[0]
    assert first["tools"] == TOOLS and first["messages"][1]["content"] == "Make main.py print 42."
    assert proxy.chats[1]["messages"][2]["tool_calls"][0]["id"] == "call_0_0"
    assert proxy.chats[1]["messages"][3]["tool_call_id"] == "call_0_0"


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (call("bash", "{not json"), "not JSON"),
        (call("bash", "[1, 2]"), "must be a JSON object"),
        (call("bash", {}), "needs the argument 'command'"),
        (call("bash", {"command": 7}), "must be a string"),
        (call("write_file", {"path": "a", "content": "b", "mode": "x"}), "takes no argument"),
        (call("rm_rf", {}), "unknown tool 'rm_rf'"),
        ({"arguments": "{}"}, "unknown tool ''"),
        (call("read_file", {"path": "../../etc/passwd"}), "outside the workdir"),
        (call("read_file", {"path": "missing.txt"}), "error:"),
        (call("write_file", {"path": "/etc/x", "content": "b"}), "outside the workdir"),
    ],
)
def test_a_malformed_tool_call_is_answered_as_a_tool_error(
    sandbox: Sandbox, bad: dict[str, Any], words: str
) -> None:
    proxy = FakeProxy([[bad], [call("bash", {"command": "echo fine"})], []])
    outcome = tool_agent(proxy).run(context(sandbox))
    assert (outcome.status, outcome.stop, outcome.turns) == ("ok", "no_tool_call", 3)
    (error,) = proxy.tool_messages(1)
    assert error.startswith("error:") and words in error
    assert proxy.tools[0]["is_error"] is True and proxy.tools[0]["result"] == error
    assert proxy.tool_messages(2)[1] == "exit code: 0\nfine\n"  # and the loop went on


def test_max_turns_ends_the_loop(sandbox: Sandbox) -> None:
    proxy = FakeProxy([[call("bash", {"command": "echo again"})]], repeat=True)
    outcome = tool_agent(proxy, max_turns=3).run(context(sandbox))
    assert (outcome.status, outcome.stop, outcome.turns, outcome.tool_calls) == (
        "ok",
        "max_turns",
        3,
        3,
    )
    assert len(proxy.chats) == 3


def test_the_deadline_ends_the_loop_and_kills_the_tool(sandbox: Sandbox) -> None:
    proxy = FakeProxy([[call("bash", {"command": "sleep 30"})]], repeat=True)
    t0 = time.monotonic()
    outcome = tool_agent(proxy, tool_timeout_s=20).run(context(sandbox, seconds=1.0))
    assert time.monotonic() - t0 < 10
    assert (outcome.status, outcome.stop) == ("timeout", "deadline")
    assert proxy.tools[0]["is_error"] and proxy.tools[0]["result"].startswith("timed out")


def test_a_tool_timeout_is_an_answer_not_the_end(sandbox: Sandbox) -> None:
    proxy = FakeProxy([[call("bash", {"command": "sleep 30"})], []])
    outcome = tool_agent(proxy, tool_timeout_s=0.5).run(context(sandbox))
    assert (outcome.status, outcome.stop) == ("ok", "no_tool_call")
    assert proxy.tool_messages(1)[0].startswith("timed out after 0.5 s")


def test_tool_output_is_bounded(sandbox: Sandbox) -> None:
    proxy = FakeProxy([[call("bash", {"command": "head -c 100000 /dev/zero | tr '\\0' a"})], []])
    tool_agent(proxy, max_tool_output=1000).run(context(sandbox))
    (text,) = proxy.tool_messages(1)
    assert len(text) <= 1000 and "characters cut" in text


@pytest.mark.parametrize(
    ("status", "code", "outcome_status", "stop"),
    [
        (400, "context_length_exceeded", "ok", "context_full"),
        (400, "invalid_value", "failed", "error"),
        (500, "internal", "failed", "error"),
        (401, "unauthorized", "failed", "error"),
    ],
)
def test_proxy_answers_become_outcomes(
    sandbox: Sandbox, status: int, code: str, outcome_status: str, stop: str
) -> None:
    proxy = FakeProxy([])
    proxy.status, proxy.code = status, code
    outcome = tool_agent(proxy).run(context(sandbox))
    assert (outcome.status, outcome.stop, outcome.turns) == (outcome_status, stop, 0)
    assert str(status) in outcome.reason and "scripted failure" in outcome.reason


def test_a_paused_or_busy_proxy_is_asked_again(sandbox: Sandbox) -> None:
    proxy = FakeProxy([[call("bash", {"command": "echo hi"})], []])
    proxy.refusals = [429, 503, 429]
    outcome = tool_agent(proxy).run(context(sandbox))
    assert (outcome.status, outcome.stop, outcome.turns) == ("ok", "no_tool_call", 2)
    assert len(proxy.chats) == 5 and proxy.tool_messages(4) == ["exit code: 0\nhi\n"]


def test_an_unreachable_proxy_is_a_failed_outcome(sandbox: Sandbox) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    agent = ToolAgent(ToolAgentSpec(kind="tool"), transport=httpx.MockTransport(refuse))
    outcome = agent.run(context(sandbox))
    assert (outcome.status, outcome.stop) == ("failed", "error")
    assert "cannot reach the proxy" in outcome.reason


def test_a_destroyed_sandbox_fails_the_run(sandbox: Sandbox) -> None:
    proxy = FakeProxy([[call("bash", {"command": "true"})]])
    sandbox.destroy()
    outcome = tool_agent(proxy).run(context(sandbox))
    assert outcome.status == "failed" and "destroyed" in outcome.reason


# --------------------------------------------------------------------------- command agent

HARNESS = r"""
import json, os, pathlib, sys
seen = {k: os.environ.get(k) for k in ("OPENAI_BASE_URL", "OPENAI_API_BASE", "OPENAI_API_KEY",
        "OPENAI_MODEL", "ROLLSTREAM_ROLLOUT_ID", "ROLLSTREAM_TASK_ID", "SECRET", "ALLOWED",
        "FIXED")}
seen["instructions"] = pathlib.Path(os.environ["ROLLSTREAM_INSTRUCTIONS_FILE"]).read_text()
seen["argv"] = sys.argv[1:]
seen["main"] = pathlib.Path("main.py").read_text()
pathlib.Path("main.py").write_text("print(42)\n")
pathlib.Path("sub").mkdir()
pathlib.Path("sub/new.txt").write_text("new\n")
pathlib.Path("gone.txt").unlink()
os.symlink("/etc/hostname", "link.txt")
print(json.dumps(seen))
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def command_agent(tmp_path: Path, exit_code: int = 0) -> CommandAgent:
    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    spec = CommandAgentSpec(
        kind="command",
        argv=[sys.executable, str(script), "{model}", "{instructions}"],
        env=["PATH", "ALLOWED", "EXIT"],
        set_env={"FIXED": "yes"},
        model="policy-7",
    )
    environ = {"PATH": "/usr/bin:/bin", "ALLOWED": "ok", "SECRET": "no", "EXIT": str(exit_code)}
    return CommandAgent(spec, environ=environ, scratch=tmp_path)


def test_command_agent_runs_a_harness_beside_the_sandbox(tmp_path: Path, sandbox: Sandbox) -> None:
    sandbox.copy_in(b"bye\n", "gone.txt")
    outcome = command_agent(tmp_path).run(context(sandbox))
    assert (outcome.status, outcome.stop) == ("ok", "exit"), outcome
    seen = json.loads(outcome.output.split("\n[stderr]\n")[0])
    assert seen["OPENAI_BASE_URL"] == seen["OPENAI_API_BASE"] == ENDPOINT.base_url
    assert seen["OPENAI_API_KEY"] == ENDPOINT.token and seen["OPENAI_MODEL"] == "policy-7"
    assert (seen["ROLLSTREAM_ROLLOUT_ID"], seen["ROLLSTREAM_TASK_ID"]) == ("r1", "t1")
    assert (seen["ALLOWED"], seen["FIXED"], seen["SECRET"]) == ("ok", "yes", None)
    assert seen["argv"] == ["policy-7", "Make main.py print 42."]
    assert seen["instructions"] == "Make main.py print 42." and seen["main"] == "print('start')\n"
    # what the harness did is in the sandbox: changed, new and deleted files; no symlink
    assert sandbox.copy_out("main.py") == b"print(42)\n"
    assert sandbox.copy_out("sub/new.txt") == b"new\n"
    listing = sandbox.exec(["find", ".", "-mindepth", "1"]).text()
    assert "gone.txt" not in listing and "link.txt" not in listing


def test_command_agent_exit_and_timeout(tmp_path: Path, sandbox: Sandbox) -> None:
    sandbox.copy_in(b"bye\n", "gone.txt")
    failed = command_agent(tmp_path, exit_code=3).run(context(sandbox))
    assert (failed.status, failed.stop) == ("failed", "exit") and "code 3" in failed.reason
    assert sandbox.copy_out("main.py") == b"print(42)\n"  # copied back all the same

    sleeper = CommandAgent(
        CommandAgentSpec(kind="command", argv=["sleep", "30"]), environ={"PATH": "/usr/bin:/bin"}
    )
    t0 = time.monotonic()
    timed = sleeper.run(context(sandbox, seconds=1.0))
    assert (timed.status, timed.stop) == ("timeout", "deadline") and time.monotonic() - t0 < 10


def test_build_agent() -> None:
    assert isinstance(build_agent(ToolAgentSpec(kind="tool")), ToolAgent)
    spec = CommandAgentSpec(kind="command", argv=["h"])
    assert isinstance(build_agent(spec, environ={}), CommandAgent)
    assert build_agent(spec, environ={}).name == "command:h"
    with pytest.raises(AgentError, match="environ"):
        build_agent(spec)


# --------------------------------------------------------------------------- the python agent

RELEASE = threading.Event()  # lets the blocked agent below end once its test has seen it


def writes_and_counts(ctx: AgentContext, *, turns: int = 1, word: str = "hi") -> AgentOutcome:
    ctx.sandbox.copy_in((word * turns).encode(), "out.txt")
    return AgentOutcome("ok", "done", turns=turns, output=f"{ctx.task_id} {ctx.endpoint.token}")


def raises(ctx: AgentContext) -> AgentOutcome:
    raise RuntimeError("agent bug")


def returns_a_number(ctx: AgentContext) -> Any:
    return 42


def blocks(ctx: AgentContext) -> AgentOutcome:
    RELEASE.wait(30)
    return AgentOutcome("ok", "late")


def python_agent(function: str, **options: Any) -> PythonAgent:
    agent = build_agent(
        PythonAgentSpec(kind="python", function=f"{__name__}:{function}", options=options)
    )
    assert isinstance(agent, PythonAgent)
    return agent


def test_python_agent_runs_its_function_with_the_context_and_options(sandbox: Sandbox) -> None:
    agent = python_agent("writes_and_counts", turns=3, word="ab")
    assert agent.name == f"python:{__name__}:writes_and_counts"
    outcome = agent.run(context(sandbox))
    assert (outcome.status, outcome.stop, outcome.turns) == ("ok", "done", 3)
    assert outcome.output == f"t1 {ENDPOINT.token}" and outcome.duration_s > 0
    assert sandbox.copy_out("out.txt") == b"ababab"


def test_python_agent_failures_are_outcomes(sandbox: Sandbox) -> None:
    failed = python_agent("raises").run(context(sandbox))
    assert (failed.status, failed.stop) == ("failed", "error")
    assert "raises raised RuntimeError('agent bug')" in failed.reason
    wrong = python_agent("returns_a_number").run(context(sandbox))
    assert wrong.status == "failed" and "returned int, not an AgentOutcome" in wrong.reason


def test_python_agent_past_its_deadline_is_a_timeout(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    try:
        outcome = python_agent("blocks").run(context(sandbox, seconds=0.3))
    finally:
        RELEASE.set()
    assert (outcome.status, outcome.stop) == ("timeout", "deadline")
    assert time.monotonic() - t0 < 10
    late = python_agent("blocks").run(context(sandbox, seconds=0.0))
    assert late.status == "timeout" and "no time left" in late.reason


@pytest.mark.parametrize(
    ("function", "options", "words"),
    [
        ("rollstream_no_such_module:run", {}, "agent.function: cannot import"),
        (f"{__name__}:no_such_function", {}, "is not a callable"),
        (f"{__name__}:ENDPOINT", {}, "is not a callable"),
        (f"{__name__}:raises", {"turns": 2}, "agent.options"),
        (f"{__name__}:writes_and_counts", {"colour": "red"}, "agent.options"),
    ],
)
def test_a_python_agent_that_cannot_run_is_refused_when_built(
    function: str, options: dict[str, Any], words: str
) -> None:
    with pytest.raises(AgentError, match=words):
        build_agent(PythonAgentSpec(kind="python", function=function, options=options))
