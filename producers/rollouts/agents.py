"""Agents of the rollout service: what the RUN stage runs against one sandbox.

An ``Agent`` takes an ``AgentContext`` (the rollout's sandbox, the task's instructions, the
rollout-scoped OpenAI endpoint of the recording proxy, a deadline and a logger) and returns an
``AgentOutcome``. Whatever happens in a run (a model that writes nonsense, a tool that fails,
a proxy that is gone, the deadline) is an outcome, never an exception: the runner must always
be able to evaluate or finish the rollout. Statuses:

- ``ok``: the agent stopped on its own: ``submit``, ``max_turns``, ``no_tool_call`` (a model
  reply without a tool call), ``context_full`` (the proxy answered 400
  ``context_length_exceeded``: prompt and completion no longer fit), or ``exit`` (a harness
  command exited 0). The runner evaluates the workdir.
- ``timeout``: the deadline passed (``deadline``); the workdir is still evaluated.
- ``failed``: the run could not go on (the proxy unreachable or refusing, the sandbox gone, a
  harness that exited non-zero); ``reason`` says why, and the rollout is not scored.

Kinds (``build_agent``):

- ``ToolAgent`` (``tool``): the OpenAI-tools loop. Each turn is one chat completion through
  the proxy (``<base_url>/chat/completions``, the rollout token as bearer), so the proxy records
  it as an LlmCall. Tools: ``bash(command)``, ``read_file(path)``, ``write_file(path, content)``
  and ``submit()``, each executed in the sandbox (bash with a timeout; every output bounded) and
  recorded as a ToolCall through ``POST /v1/rollouts/{id}/tool_calls`` (with the sandbox id, its
  duration and the LlmCall that asked for it). A malformed tool call (unknown tool, arguments
  that are not a JSON object, a missing or extra argument, a wrong type) is answered to the
  model as a tool error, not a crash. A model call the proxy refuses with 429 (paused for a
  weight update) or 503 (no backend) is made again after its Retry-After, deadline allowing.
- ``CommandAgent`` (``command``): any harness, unchanged, as a command run BESIDE the sandbox
  (on the worker's host, as the worker's user: the harness is trusted, the model is not; its
  model calls go through the proxy). Its environment is an allow-list of the worker's
  variables plus ``OPENAI_BASE_URL`` / ``OPENAI_API_BASE`` (older clients) / ``OPENAI_API_KEY``
  set to the rollout's URL and token, ``OPENAI_MODEL``, ``ROLLSTREAM_ROLLOUT_ID``,
  ``ROLLSTREAM_TASK_ID`` and ``ROLLSTREAM_INSTRUCTIONS_FILE``; its cwd a host directory holding
  a copy of the sandbox workdir, copied back into the sandbox after it exits (changed and new
  regular files; files it deleted are deleted; symlinks are not followed). It carries the
  sandbox's ``ROLLSTREAM_SANDBOX_ID``, so the reaper kills a harness a dead worker left behind.
- ``PythonAgent`` (``python``): ``module:function`` called in the worker as
  ``function(ctx, **options)``; it makes its model calls through ``ctx.endpoint`` (e.g. with a
  ``RolloutClient``), works in ``ctx.sandbox`` and returns an ``AgentOutcome``. Resolved and
  its options bound to its signature when built, so a wrong name or option fails the job, not
  every rollout. Trusted code, like a command agent's harness. It runs in a thread the deadline
  cannot kill: past the deadline the outcome is ``timeout`` (the workdir is still evaluated)
  and the thread is left to finish on its own. A function that raises, or returns something
  other than an AgentOutcome, is a ``failed`` outcome naming it.

Errors (producers/errors.py): ``AgentError`` when an agent cannot be built; ``RolloutCallError``
from ``RolloutClient`` (the built-in agents turn it into a failed outcome).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal, Protocol

import httpx

from rollstream.producers.errors import (
    AgentError,
    RolloutCallError,
    SandboxError,
    SandboxFileError,
    SandboxSpecError,
)
from rollstream.producers.rollouts.jobs import (
    AgentSpec,
    CommandAgentSpec,
    PythonAgentSpec,
    ToolAgentSpec,
)
from rollstream.producers.rollouts.local import run_bounded
from rollstream.producers.rollouts.reaper import MARKER_ENV
from rollstream.producers.rollouts.sandbox import Sandbox

__all__ = [
    "TOOLS",
    "Agent",
    "AgentContext",
    "AgentError",
    "AgentOutcome",
    "AgentStatus",
    "CommandAgent",
    "PythonAgent",
    "RolloutCallError",
    "RolloutClient",
    "RolloutEndpoint",
    "ToolAgent",
    "build_agent",
    "clip",
]

AgentStatus = Literal["ok", "failed", "timeout"]

MAX_OUTCOME_OUTPUT: Final = 16_384  # chars of a harness's output kept in its outcome
MAX_WRITE_BYTES: Final = 4 * 1024 * 1024  # one write_file
MAX_COMMAND_CHARS: Final = 64 * 1024  # one bash command
MAX_SYNC_FILES: Final = 10_000  # files of a workdir copied out for a harness
MAX_SYNC_BYTES: Final = 512 * 1024 * 1024
MAX_CHAT_RETRIES: Final = 20  # a model call refused with 429 / 503, tried again
_MIN_TIMEOUT: Final = 0.05  # less time than this left is the deadline


def clip(text: str, limit: int) -> str:
    """``text`` in at most about ``limit`` characters: its head and tail around a marker."""
    if len(text) <= limit:
        return text
    marker = f"\n[... {len(text) - limit} characters cut ...]\n"
    head = max(limit - len(marker), 0) * 2 // 3
    tail = max(limit - len(marker) - head, 0)
    return text[:head] + marker + (text[-tail:] if tail else "")


# --------------------------------------------------------------------------- context, outcome


@dataclass(frozen=True, slots=True)
class RolloutEndpoint:
    """What ``POST /v1/rollouts`` answered: the rollout-scoped OpenAI base URL and token, and
    the proxy's own root (for the rollout routes)."""

    rollout_id: str
    base_url: str
    token: str
    api_url: str
    policy_version: int = 0


@dataclass(slots=True)
class AgentContext:
    """One run of one agent. ``deadline`` is a ``time.monotonic()`` value."""

    sandbox: Sandbox
    task_id: str
    instructions: str
    endpoint: RolloutEndpoint
    deadline: float
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger(__name__))

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


@dataclass(frozen=True, slots=True)
class AgentOutcome:
    """How a run ended (module docstring): ``stop`` names the cause, ``reason`` explains a
    failure or a timeout; ``output`` is a harness's output (bounded)."""

    status: AgentStatus
    stop: str
    reason: str = ""
    turns: int = 0
    tool_calls: int = 0
    output: str = ""
    duration_s: float = 0.0


class Agent(Protocol):
    """Runs one rollout's RUN stage; never raises for what happens in the run."""

    @property
    def name(self) -> str: ...

    def run(self, ctx: AgentContext) -> AgentOutcome: ...


# --------------------------------------------------------------------------- the proxy, per rollout


class RolloutClient:
    """The rollout-scoped calls an agent makes: chat completions and tool-call records, with the
    rollout token. ``transport``: an httpx transport (tests: ``httpx.MockTransport``)."""

    def __init__(
        self, endpoint: RolloutEndpoint, *, transport: httpx.BaseTransport | None = None
    ) -> None:
        self.endpoint = endpoint
        self._http = httpx.Client(
            transport=transport,
            headers={"Authorization": f"Bearer {endpoint.token}"},
            timeout=httpx.Timeout(30.0),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chat(self, body: Mapping[str, Any], *, deadline: float) -> dict[str, Any]:
        """One chat completion before ``deadline`` (``time.monotonic()``); RolloutCallError for
        no answer, a non-200 answer or a body that is not a JSON object. A 429 (paused for a
        weight update) or 503 (no backend) is retried after its Retry-After while the deadline
        allows (the proxy records each refused call as a RolloutError)."""
        url = self.endpoint.base_url.rstrip("/") + "/chat/completions"
        for _ in range(MAX_CHAT_RETRIES):
            response = self._send(url, body, timeout=deadline - time.monotonic())
            if response.status_code not in (429, 503):
                break
            wait = _retry_after(response)
            if time.monotonic() + wait >= deadline:
                break
            time.sleep(wait)
        return self._answer(response, ok=200)

    def tool_call(
        self,
        *,
        name: str,
        arguments: str,
        result: str,
        is_error: bool,
        duration_ms: float,
        sandbox: str | None,
        at_call_id: str | None,
        tool_call_id: str | None,
    ) -> str:
        """Record one tool call; returns its id."""
        url = f"{self.endpoint.api_url.rstrip('/')}/v1/rollouts/{self.endpoint.rollout_id}"
        body = {
            "name": name or "<missing>",
            "arguments": arguments,
            "result": result,
            "is_error": is_error,
            "duration_ms": round(duration_ms, 3),
            "sandbox": sandbox,
            "at_call_id": at_call_id,
            "tool_call_id": tool_call_id,
        }
        answer = self._answer(self._send(url + "/tool_calls", body, timeout=30.0), ok=200)
        return str(answer.get("tool_call_id", ""))

    def _send(self, url: str, body: Mapping[str, Any], *, timeout: float) -> httpx.Response:
        timeout = max(timeout, _MIN_TIMEOUT)
        try:
            return self._http.post(url, json=body, timeout=timeout)
        except httpx.TimeoutException as exc:
            raise RolloutCallError(f"no answer from the proxy within {timeout:.1f} s") from exc
        except httpx.HTTPError as exc:
            raise RolloutCallError(f"cannot reach the proxy: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _answer(response: httpx.Response, *, ok: int) -> dict[str, Any]:
        if response.status_code != ok:
            raise RolloutCallError(
                f"the proxy answered {response.status_code}: {_error_text(response)}",
                status=response.status_code,
                code=_error_code(response),
            )
        try:
            data = response.json()
        except ValueError as exc:
            raise RolloutCallError(f"the proxy answered {ok} with a body that is not JSON") from exc
        if not isinstance(data, dict):
            raise RolloutCallError(f"the proxy answered {ok} with a body that is not an object")
        return data


def _retry_after(response: httpx.Response) -> float:
    """The answer's Retry-After in seconds (1 when absent or not a number), at most 30."""
    try:
        seconds = float(response.headers.get("retry-after", "1"))
    except ValueError:
        seconds = 1.0
    return min(max(seconds, 0.0), 30.0) if seconds == seconds else 1.0


def _error_code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["code"] or "")[:100]
    except (ValueError, KeyError, TypeError):
        return ""


def _error_text(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        return clip(str(error.get("message") or error), 500)
    except (ValueError, AttributeError):
        return clip(response.text, 500)


# --------------------------------------------------------------------------- the tool agent


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS: Final[list[dict[str, Any]]] = [
    _function(
        "bash",
        "Run a shell command in the working directory; returns its exit code and output.",
        {"command": {"type": "string", "description": "the command line (run by /bin/sh)"}},
    ),
    _function(
        "read_file",
        "Read a text file of the working directory.",
        {"path": {"type": "string", "description": "relative to the working directory"}},
    ),
    _function(
        "write_file",
        "Write a text file in the working directory (replacing it; parents are made).",
        {
            "path": {"type": "string", "description": "relative to the working directory"},
            "content": {"type": "string", "description": "the whole new content"},
        },
    ),
    _function("submit", "Say that the task is done; ends your turn for good.", {}),
]
_TOOL_ARGS: Final = {
    t["function"]["name"]: tuple(t["function"]["parameters"]["properties"]) for t in TOOLS
}


class _ToolFailure(Exception):
    """A tool call that cannot run as asked: answered to the model as a tool error."""


@dataclass(frozen=True, slots=True)
class _ToolResult:
    text: str
    is_error: bool = False
    submit: bool = False
    deadline: bool = False


class ToolAgent:
    """The built-in tool loop (module docstring), bounded by ``spec``'s turns, tokens and tool
    timeout and by the context's deadline."""

    def __init__(
        self, spec: ToolAgentSpec, *, transport: httpx.BaseTransport | None = None
    ) -> None:
        self.spec = spec
        self._transport = transport

    @property
    def name(self) -> str:
        return "tool"

    def run(self, ctx: AgentContext) -> AgentOutcome:
        t0 = time.monotonic()
        with RolloutClient(ctx.endpoint, transport=self._transport) as client:
            outcome = self._loop(ctx, client)
        return replace(outcome, duration_s=time.monotonic() - t0)

    def _loop(self, ctx: AgentContext, client: RolloutClient) -> AgentOutcome:
        spec = self.spec
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": spec.system_prompt},
            {"role": "user", "content": ctx.instructions},
        ]
        turns = calls = 0

        def end(status: AgentStatus, stop: str, reason: str = "") -> AgentOutcome:
            ctx.logger.debug("agent stops: %s %s %s", status, stop, reason)
            return AgentOutcome(status, stop, reason, turns, calls)

        while turns < spec.max_turns:
            left = ctx.remaining()
            if left < _MIN_TIMEOUT:
                return end("timeout", "deadline", f"the run's deadline passed after {turns} turns")
            body = {
                "model": spec.model,
                "messages": messages,
                "tools": TOOLS,
                "tool_choice": "auto",
                "max_tokens": spec.max_tokens,
                "temperature": spec.temperature,
                "top_p": spec.top_p,
            }
            try:
                reply = client.chat(body, deadline=ctx.deadline)
            except RolloutCallError as exc:
                if exc.code == "context_length_exceeded":
                    return end("ok", "context_full", str(exc))
                if ctx.remaining() < _MIN_TIMEOUT:
                    return end("timeout", "deadline", f"model call cut by the deadline: {exc}")
                return end("failed", "error", f"model call failed: {exc}")
            turns += 1
            try:
                message = reply["choices"][0]["message"]
                tool_calls = message.get("tool_calls") or []
                if not isinstance(tool_calls, list):
                    raise TypeError("tool_calls is not a list")
            except (KeyError, IndexError, TypeError, AttributeError) as exc:
                return end("failed", "error", f"the proxy's reply is no chat completion: {exc!r}")
            call_id = (reply.get("rollstream") or {}).get("call_id")
            assistant: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
            if tool_calls:
                assistant["tool_calls"] = tool_calls
            messages.append(assistant)
            if not tool_calls:
                return end("ok", "no_tool_call")
            for index, tool_call in enumerate(tool_calls):
                name, raw_args, tc_id = _tool_call_parts(tool_call, turns, index)
                t = time.monotonic()
                try:
                    result = self._run_tool(ctx, name, raw_args)
                except SandboxError as exc:  # gone, or cannot start anything: no way on
                    return end("failed", "error", f"the sandbox failed: {exc}")
                text = clip(result.text, spec.max_tool_output)
                try:
                    client.tool_call(
                        name=name,
                        arguments=raw_args,
                        result=text,
                        is_error=result.is_error,
                        duration_ms=(time.monotonic() - t) * 1000,
                        sandbox=ctx.sandbox.id,
                        at_call_id=call_id if isinstance(call_id, str) else None,
                        tool_call_id=tc_id,
                    )
                except RolloutCallError as exc:
                    return end("failed", "error", f"recording a tool call failed: {exc}")
                calls += 1
                messages.append({"role": "tool", "tool_call_id": tc_id, "content": text})
                if result.submit:
                    return end("ok", "submit")
                if result.deadline:
                    return end("timeout", "deadline", "the run's deadline passed in a tool")
        return end("ok", "max_turns")

    # ----------------------------------------------------------------- tools

    def _run_tool(self, ctx: AgentContext, name: str, raw_args: str) -> _ToolResult:
        try:
            args = _parse_arguments(name, raw_args)
            if name == "submit":
                return _ToolResult("submitted", submit=True)
            if name == "bash":
                return self._bash(ctx, args["command"])
            if name == "read_file":
                return _ToolResult(self._read(ctx, args["path"]))
            return _ToolResult(self._write(ctx, args["path"], args["content"]))
        except _ToolFailure as exc:
            return _ToolResult(f"error: {exc}", is_error=True)
        except (SandboxFileError, SandboxSpecError) as exc:  # the call's fault: an answer
            return _ToolResult(f"error: {exc}", is_error=True)

    def _bash(self, ctx: AgentContext, command: str) -> _ToolResult:
        if not command.strip() or len(command) > MAX_COMMAND_CHARS:
            raise _ToolFailure(f"command must be 1 to {MAX_COMMAND_CHARS} characters")
        left = ctx.remaining()
        if left < _MIN_TIMEOUT:
            return _ToolResult("error: no time left", is_error=True, deadline=True)
        limit = ctx.sandbox.spec.limits.timeout
        timeout = min(self.spec.tool_timeout_s, left, limit)
        result = ctx.sandbox.exec(command, timeout=timeout)
        parts = [f"exit code: {result.exit_code}"]
        if result.timed_out:
            parts[0] = f"timed out after {timeout:.1f} s (killed)"
        parts.append(result.text("stdout"))
        if result.stderr:
            parts.append("[stderr]\n" + result.text("stderr"))
        if result.stdout_truncated or result.stderr_truncated:
            parts.append("[output cut by the sandbox]")
        deadline = result.timed_out and ctx.remaining() < _MIN_TIMEOUT
        return _ToolResult("\n".join(parts), is_error=result.timed_out, deadline=deadline)

    def _read(self, ctx: AgentContext, path: str) -> str:
        data = ctx.sandbox.copy_out(path)
        return data.decode("utf-8", errors="replace")

    def _write(self, ctx: AgentContext, path: str, content: str) -> str:
        data = content.encode("utf-8", errors="surrogatepass")
        if len(data) > MAX_WRITE_BYTES:
            raise _ToolFailure(f"content is {len(data)} bytes, more than {MAX_WRITE_BYTES}")
        where = ctx.sandbox.copy_in(data, path)
        return f"wrote {len(data)} bytes to {where}"


def _tool_call_parts(tool_call: Any, turn: int, index: int) -> tuple[str, str, str]:
    """(name, arguments as text, id) of one tool call of a reply, whatever its shape."""
    if not isinstance(tool_call, dict):
        return "", json.dumps(tool_call, default=str)[:4096], f"call_t{turn}_{index}"
    fn = tool_call.get("function")
    fn = fn if isinstance(fn, dict) else {}
    name = fn.get("name")
    name = name if isinstance(name, str) else ""
    raw = fn.get("arguments", "")
    raw = raw if isinstance(raw, str) else json.dumps(raw, default=str)
    tc_id = tool_call.get("id")
    tc_id = tc_id if isinstance(tc_id, str) and tc_id else f"call_t{turn}_{index}"
    return name[:200], raw, tc_id


def _parse_arguments(name: str, raw: str) -> dict[str, str]:
    if name not in _TOOL_ARGS:
        raise _ToolFailure(f"unknown tool {name!r} (tools: {', '.join(_TOOL_ARGS)})")
    try:
        args = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        raise _ToolFailure(f"arguments of {name} are not JSON: {exc}") from exc
    if not isinstance(args, dict):
        raise _ToolFailure(f"arguments of {name} must be a JSON object")
    want = _TOOL_ARGS[name]
    extra = sorted(set(args) - set(want))
    if extra:
        raise _ToolFailure(f"{name} takes no argument {', '.join(extra)} (takes: {want})")
    for key in want:
        if key not in args:
            raise _ToolFailure(f"{name} needs the argument {key!r}")
        if not isinstance(args[key], str):
            raise _ToolFailure(f"argument {key!r} of {name} must be a string")
    return args


# --------------------------------------------------------------------------- the command agent


class CommandAgent:
    """An external harness run beside the sandbox (module docstring). ``environ``: the worker's
    environment, from which only ``spec.env``'s names pass; ``scratch``: where the host copies
    of workdirs are made (default: the system's temp dir)."""

    def __init__(
        self,
        spec: CommandAgentSpec,
        *,
        environ: Mapping[str, str],
        scratch: Path | None = None,
    ) -> None:
        self.spec = spec
        self._environ = dict(environ)
        self._scratch = scratch
        self._setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")

    @property
    def name(self) -> str:
        return f"command:{Path(self.spec.argv[0]).name}"[:128]

    def run(self, ctx: AgentContext) -> AgentOutcome:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="rs-harness-", dir=self._scratch) as tmp:
            root = Path(tmp)
            workdir, home = root / "work", root / "home"
            home.mkdir()
            (root / "tmp").mkdir()
            instructions = root / "instructions.md"
            instructions.write_text(ctx.instructions, encoding="utf-8")
            try:
                synced = _sync_out(ctx.sandbox, workdir)
            except (SandboxError, OSError) as exc:
                return _outcome("failed", "error", f"cannot copy the workdir out: {exc}", t0)
            left = ctx.remaining()
            if left < _MIN_TIMEOUT:
                return _outcome("timeout", "deadline", "no time left to start the harness", t0)
            result = run_bounded(
                self._argv(ctx, workdir, instructions),
                env=self._env(ctx, workdir, home, root / "tmp", instructions),
                cwd=workdir,
                stdin=None,
                timeout=left,
                max_output=self.spec.max_output,
            )
            output = clip(
                result.text("stdout") + ("\n[stderr]\n" + result.text("stderr")),
                MAX_OUTCOME_OUTPUT,
            )
            try:  # what the harness did counts, whatever its exit
                _sync_in(workdir, ctx.sandbox, synced)
            except (SandboxError, OSError) as exc:
                reason = f"cannot copy the workdir back: {exc}"
                return _outcome("failed", "error", reason, t0, output)
        if result.timed_out:
            reason = f"the harness ran past the deadline ({left:.1f} s)"
            return _outcome("timeout", "deadline", reason, t0, output)
        if result.exit_code != 0:
            reason = f"the harness exited with code {result.exit_code}"
            return _outcome("failed", "exit", reason, t0, output)
        return _outcome("ok", "exit", "", t0, output)

    def _argv(self, ctx: AgentContext, workdir: Path, instructions: Path) -> list[str]:
        values = {
            "{instructions}": ctx.instructions,
            "{instructions_file}": str(instructions),
            "{workdir}": str(workdir),
            "{model}": self.spec.model,
            "{base_url}": ctx.endpoint.base_url,
        }
        argv = []
        for arg in self.spec.argv:
            for key, value in values.items():
                arg = arg.replace(key, value)
            argv.append(arg)
        if self._setpriv is not None:  # the harness dies with the worker
            argv = [self._setpriv, "--pdeathsig", "KILL", "--", *argv]
        return argv

    def _env(
        self, ctx: AgentContext, workdir: Path, home: Path, tmp: Path, instructions: Path
    ) -> dict[str, str]:
        env = {k: self._environ[k] for k in self.spec.env if k in self._environ}
        env.update(self.spec.set_env)
        ep = ctx.endpoint
        env.update(
            {
                "OPENAI_BASE_URL": ep.base_url,
                "OPENAI_API_BASE": ep.base_url,
                "OPENAI_API_KEY": ep.token,
                "OPENAI_MODEL": self.spec.model,
                "HOME": str(home),
                "TMPDIR": str(tmp),
                "ROLLSTREAM_ROLLOUT_ID": ep.rollout_id,
                "ROLLSTREAM_TASK_ID": ctx.task_id,
                "ROLLSTREAM_INSTRUCTIONS_FILE": str(instructions),
                "ROLLSTREAM_WORKDIR": str(workdir),
                MARKER_ENV: ctx.sandbox.id,  # the reaper finds a harness left behind
            }
        )
        return env


def _outcome(
    status: AgentStatus, stop: str, reason: str, t0: float, output: str = ""
) -> AgentOutcome:
    return AgentOutcome(status, stop, reason, output=output, duration_s=time.monotonic() - t0)


def _sync_timeout(sandbox: Sandbox) -> float:
    return min(60.0, sandbox.spec.limits.timeout)


def _sync_out(sandbox: Sandbox, dest: Path) -> dict[str, str]:
    """Copy every regular file of the sandbox workdir to ``dest``; returns path -> SHA-256."""
    listing = sandbox.exec(["find", ".", "-type", "f", "-print0"], timeout=_sync_timeout(sandbox))
    if not listing.ok or listing.stdout_truncated:
        raise SandboxFileError(f"listing the workdir failed (exit {listing.exit_code})")
    names = [n.decode("utf-8", "surrogateescape") for n in listing.stdout.split(b"\0") if n]
    if len(names) > MAX_SYNC_FILES:
        raise SandboxFileError(f"more than {MAX_SYNC_FILES} files in the workdir")
    dest.mkdir(parents=True, exist_ok=True)
    digests, total = {}, 0
    for name in names:
        rel = name.removeprefix("./")
        data = sandbox.copy_out(rel)
        total += len(data)
        if total > MAX_SYNC_BYTES:
            raise SandboxFileError(f"more than {MAX_SYNC_BYTES} bytes in the workdir")
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        digests[rel] = hashlib.sha256(data).hexdigest()
    return digests


def _sync_in(src: Path, sandbox: Sandbox, before: Mapping[str, str]) -> None:
    """Copy the regular files of ``src`` that are new or changed into the sandbox, and delete
    there the files that were copied out and are gone; symlinks are never followed."""
    seen, total = set(), 0
    for folder, dirs, files in os.walk(src, followlinks=False):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        for name in files:
            path = os.path.join(folder, name)
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            rel = os.path.relpath(path, src)
            seen.add(rel)
            data = Path(path).read_bytes()
            total += len(data)
            if total > MAX_SYNC_BYTES:
                raise SandboxFileError(f"more than {MAX_SYNC_BYTES} bytes to copy back")
            if before.get(rel) != hashlib.sha256(data).hexdigest():
                sandbox.copy_in(data, rel)
    gone = sorted(set(before) - seen)
    for start in range(0, len(gone), 500):
        argv = ["rm", "-f", "--", *gone[start : start + 500]]
        result = sandbox.exec(argv, timeout=_sync_timeout(sandbox))
        if not result.ok:
            raise SandboxFileError(f"deleting {len(gone)} files failed (exit {result.exit_code})")


# --------------------------------------------------------------------------- the python agent


class PythonAgent:
    """``module:function`` run in the worker (module docstring)."""

    def __init__(self, spec: PythonAgentSpec) -> None:
        module_name, _, attr = spec.function.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise AgentError(f"agent.function: cannot import {module_name}: {exc}") from exc
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise AgentError(f"agent.function: {spec.function} is not a callable")
        try:
            inspect.signature(fn).bind(None, **spec.options)
        except TypeError as exc:
            raise AgentError(f"agent.options: {spec.function} does not take them: {exc}") from exc
        except ValueError:  # no signature to check (a builtin): the call will tell
            pass
        self.spec = spec
        self._fn: Callable[..., Any] = fn

    @property
    def name(self) -> str:
        return f"python:{self.spec.function}"[:128]

    def run(self, ctx: AgentContext) -> AgentOutcome:
        t0 = time.monotonic()
        left = ctx.remaining()
        if left < _MIN_TIMEOUT:
            return _outcome("timeout", "deadline", "no time left to start the agent", t0)
        box: dict[str, Any] = {}
        function = self.spec.function

        def call() -> None:
            try:
                box["value"] = self._fn(ctx, **self.spec.options)
            except BaseException as exc:  # reported as the outcome
                box["error"] = exc

        thread = threading.Thread(target=call, name=f"agent-{function}"[:64], daemon=True)
        thread.start()
        thread.join(left)
        if thread.is_alive():
            return _outcome("timeout", "deadline", f"{function} ran past {left:.1f} s", t0)
        if "error" in box:
            exc = box["error"]
            ctx.logger.warning("agent %s raised %r", function, exc, exc_info=exc)
            return _outcome("failed", "error", clip(f"{function} raised {exc!r}", 2000), t0)
        value = box.get("value")
        if not isinstance(value, AgentOutcome):
            reason = f"{function} returned {type(value).__name__}, not an AgentOutcome"
            return _outcome("failed", "error", reason, t0)
        if not value.duration_s:
            value = replace(value, duration_s=time.monotonic() - t0)
        return replace(value, output=clip(value.output, MAX_OUTCOME_OUTPUT))


# --------------------------------------------------------------------------- factory


def build_agent(
    spec: AgentSpec,
    *,
    environ: Mapping[str, str] | None = None,
    transport: httpx.BaseTransport | None = None,
    scratch: Path | None = None,
) -> Agent:
    """The agent of a job's ``agent`` spec. ``environ`` (the worker's environment) is needed
    by a command agent only; ``transport`` by tests of the tool agent."""
    if isinstance(spec, ToolAgentSpec):
        return ToolAgent(spec, transport=transport)
    if isinstance(spec, PythonAgentSpec):
        return PythonAgent(spec)
    if isinstance(spec, CommandAgentSpec):
        if environ is None:
            raise AgentError("a command agent needs the worker's environment (environ=)")
        return CommandAgent(spec, environ=environ, scratch=scratch)
    raise AgentError(f"unknown agent spec {type(spec).__name__}")
