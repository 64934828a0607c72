"""Evaluators of the rollout service: what the EVAL stage runs in a rollout's sandbox after RUN.

An ``Evaluator`` scores a task's sandbox before a deadline and returns an ``Evaluation``: the
final reward, milestones (partial credit, each a name and a value, so the processors'
partial-progress score has signal even when the final reward is 0) and a status:

- ``ok``: the evaluator judged the work; ``final`` and ``milestones`` become Reward events
  (kinds ``final`` and ``milestone``, their ``evaluator`` field naming the evaluator, so they
  are told apart from rewards a harness posts).
- ``failed``: the evaluator could not judge (the check crashed, printed no result, the sandbox
  was gone, the callable raised or returned no number); ``reason`` says why.
- ``timeout``: the check ran past its time.

A failed or timed-out evaluation gives no reward at all: the runner finishes the rollout
``failed`` / ``timeout`` with the reason, never with a silent zero. ``output`` keeps the
evaluator's output, bounded.

Kinds (``build_evaluator``):

- ``SuiteEvaluator`` (``suite``): the task's hidden tests (tasks.py). Writes
  ``task.hidden_check_files()`` into the workdir (removing first whatever the agent left at
  those paths: a file, a directory or a symlink), runs
  ``task.check_command()`` within the task's ``timeout_s`` and the deadline, and parses the
  runner's output (``parse_check_output``): final = ``CheckResult.reward`` (1.0 only if every
  hidden test passed), and a milestone of 1/total per passed test. A check is judged when it
  exits 0 or 1 and reports at least one test; a signal, another exit code or no test reported
  at all is ``failed``.
- ``CommandEvaluator`` (``command``): a command in the sandbox; a number on its last line of
  output is the final reward, else exit 0 scores 1.0 and another exit 0.0. Exit codes 126, 127
  (cannot run) and 128+ (killed by a signal) are ``failed``.
- ``PythonEvaluator`` (``python``): ``module:function`` called with (task, sandbox) in the
  worker; it returns a number (the final reward) or an Evaluation. It runs in a thread the
  deadline cannot kill: past the deadline the evaluation is ``timeout`` and the thread is left
  to finish on its own (its sandbox is destroyed under it).

Errors (producers/errors.py): ``EvaluatorError`` when an evaluator cannot be built.
"""

from __future__ import annotations

import importlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Literal, Protocol

from rollstream.producers.errors import EvaluatorError, SandboxError
from rollstream.producers.rollouts.agents import clip
from rollstream.producers.rollouts.jobs import (
    CommandEvaluatorSpec,
    EvaluatorSpec,
    PythonEvaluatorSpec,
    SuiteEvaluatorSpec,
)
from rollstream.producers.rollouts.sandbox import ExecResult, Sandbox
from rollstream.producers.rollouts.tasks import Task, parse_check_output
from rollstream.schemas import REWARD_BOUND

__all__ = [
    "CommandEvaluator",
    "EvalStatus",
    "Evaluation",
    "Evaluator",
    "EvaluatorError",
    "PythonEvaluator",
    "SuiteEvaluator",
    "build_evaluator",
]

EvalStatus = Literal["ok", "failed", "timeout"]

MAX_REASON: Final = 1_000
_MIN_TIMEOUT: Final = 0.05


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One evaluation (module docstring). ``final`` and ``milestones`` mean something only
    when ``status`` is ``ok``."""

    final: float
    milestones: tuple[tuple[str, float], ...] = ()
    status: EvalStatus = "ok"
    reason: str = ""
    output: str = ""
    duration_s: float = 0.0
    passed: int = 0  # checks passed, of ``total`` (0 / 0: an evaluator that reports no checks)
    total: int = 0

    @classmethod
    def not_judged(cls, status: EvalStatus, reason: str, output: str = "") -> Evaluation:
        return cls(0.0, (), status, clip(reason, MAX_REASON), output)

    def bounded(self) -> Evaluation:
        """This evaluation, or ``failed`` when a reward it would post is not a number in
        [-REWARD_BOUND, REWARD_BOUND] (the proxy would refuse it; the contract says why)."""
        if self.status != "ok":
            return self
        values = [("final", self.final), *self.milestones]
        for name, value in values:
            if not (math.isfinite(value) and abs(value) <= REWARD_BOUND):
                return Evaluation.not_judged(
                    "failed",
                    f"reward {name} = {value!r} is outside [-{REWARD_BOUND:g}, {REWARD_BOUND:g}]",
                    self.output,
                )
        return self


class Evaluator(Protocol):
    """Scores a task's sandbox; never raises for what the check does."""

    @property
    def name(self) -> str: ...

    def evaluate(self, task: Task, sandbox: Sandbox, deadline: float) -> Evaluation: ...


def _output(result: ExecResult, limit: int) -> str:
    text = result.text("stdout")
    if result.stderr:
        text += "\n[stderr]\n" + result.text("stderr")
    return clip(text, limit)


def _timeout(deadline: float, *bounds: float) -> float:
    return min((deadline - time.monotonic(), *bounds))


def _timed(evaluation: Evaluation, t0: float) -> Evaluation:
    return replace(evaluation, duration_s=time.monotonic() - t0)


# --------------------------------------------------------------------------- suite


class SuiteEvaluator:
    """The task's hidden tests (module docstring)."""

    def __init__(self, spec: SuiteEvaluatorSpec | None = None) -> None:
        self.spec = spec or SuiteEvaluatorSpec(kind="suite")

    @property
    def name(self) -> str:
        return "suite"

    def evaluate(self, task: Task, sandbox: Sandbox, deadline: float) -> Evaluation:
        t0 = time.monotonic()
        return _timed(self._evaluate(task, sandbox, deadline), t0)

    def _evaluate(self, task: Task, sandbox: Sandbox, deadline: float) -> Evaluation:
        limit = self.spec.max_output
        files = task.hidden_check_files()
        no_time = Evaluation.not_judged("timeout", "no time left for the check")
        try:
            # whatever the agent left at these paths (a file, a directory, a symlink) goes
            timeout = _timeout(deadline, sandbox.spec.limits.timeout, 30.0)
            if timeout < _MIN_TIMEOUT:
                return no_time
            cleared = sandbox.exec(["rm", "-rf", "--", *sorted(files)], timeout=timeout)
            if not cleared.ok:
                reason = f"could not clear the check's paths (exit {cleared.exit_code})"
                return Evaluation.not_judged("failed", reason, _output(cleared, limit))
            for path, text in files.items():
                sandbox.copy_in(text.encode(), path)
            timeout = _timeout(deadline, task.timeout_s, sandbox.spec.limits.timeout)
            if timeout < _MIN_TIMEOUT:
                return no_time
            result = sandbox.exec(task.check_command(self.spec.python), timeout=timeout)
        except SandboxError as exc:
            return Evaluation.not_judged("failed", f"the check could not run: {exc}")
        output = _output(result, limit)
        if result.timed_out:
            reason = f"the check ran past {timeout:.1f} s"
            return Evaluation.not_judged("timeout", reason, output)
        check = parse_check_output(result.stdout, expected=task.hidden_test_names())
        reported = parse_check_output(result.stdout).total  # tests the output names at all
        if result.exit_code not in (0, 1) or not reported:
            why = "no test reported" if not reported else f"exit code {result.exit_code}"
            stderr = clip(result.text("stderr").strip(), 300)
            reason = f"the check crashed ({why})" + (f": {stderr}" if stderr else "")
            return Evaluation.not_judged("failed", reason, output)
        total = check.total or 1
        milestones = tuple((t.name, 1.0 / total) for t in check.tests if t.passed)
        return Evaluation(
            final=check.reward,
            milestones=milestones,
            reason=check.error or "",
            output=output,
            passed=len(milestones),
            total=check.total,
        )


# --------------------------------------------------------------------------- command


class CommandEvaluator:
    """A command in the sandbox (module docstring)."""

    def __init__(self, spec: CommandEvaluatorSpec) -> None:
        self.spec = spec

    @property
    def name(self) -> str:
        return "command"

    def evaluate(self, task: Task, sandbox: Sandbox, deadline: float) -> Evaluation:
        t0 = time.monotonic()
        return _timed(self._evaluate(sandbox, deadline), t0)

    def _evaluate(self, sandbox: Sandbox, deadline: float) -> Evaluation:
        timeout = _timeout(deadline, sandbox.spec.limits.timeout)
        if timeout < _MIN_TIMEOUT:
            return Evaluation.not_judged("timeout", "no time left for the evaluator")
        try:
            result = sandbox.exec(list(self.spec.argv), timeout=timeout, env=self.spec.env)
        except SandboxError as exc:
            return Evaluation.not_judged("failed", f"the evaluator could not run: {exc}")
        output = _output(result, self.spec.max_output)
        if result.timed_out:
            return Evaluation.not_judged("timeout", f"ran past {timeout:.1f} s", output)
        code = result.exit_code
        if code in (126, 127) or code >= 128:
            return Evaluation.not_judged("failed", f"the evaluator crashed (exit {code})", output)
        number = _last_number(result.text("stdout").splitlines())
        final = number if number is not None else 1.0 if code == 0 else 0.0
        return Evaluation(final=final, output=output)


def _last_number(lines: Sequence[str]) -> float | None:
    for line in reversed(lines):
        if line.strip():
            try:
                value = float(line.strip())
            except ValueError:
                return None
            return value if math.isfinite(value) else None
    return None


# --------------------------------------------------------------------------- python


class PythonEvaluator:
    """``module:function`` called with (task, sandbox) (module docstring); resolved when built,
    so a wrong name fails the job at submission, not every rollout."""

    def __init__(self, spec: PythonEvaluatorSpec | str) -> None:
        target = spec.function if isinstance(spec, PythonEvaluatorSpec) else spec
        module_name, _, attr = target.partition(":")
        if not module_name or not attr:
            raise EvaluatorError(f"evaluator.function: {target!r} is not 'module:function'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise EvaluatorError(f"evaluator.function: cannot import {module_name}: {exc}") from exc
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise EvaluatorError(f"evaluator.function: {target} is not a callable")
        self.function = target
        self._fn: Callable[[Task, Sandbox], Any] = fn

    @property
    def name(self) -> str:
        return f"python:{self.function}"

    def evaluate(self, task: Task, sandbox: Sandbox, deadline: float) -> Evaluation:
        t0 = time.monotonic()
        return _timed(self._evaluate(task, sandbox, deadline), t0)

    def _evaluate(self, task: Task, sandbox: Sandbox, deadline: float) -> Evaluation:
        timeout = _timeout(deadline)
        if timeout < _MIN_TIMEOUT:
            return Evaluation.not_judged("timeout", "no time left for the evaluator")
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = self._fn(task, sandbox)
            except BaseException as exc:  # reported as the evaluation's failure
                box["error"] = exc

        thread = threading.Thread(target=call, name=f"evaluator-{self.function}", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            return Evaluation.not_judged("timeout", f"{self.function} ran past {timeout:.1f} s")
        if "error" in box:
            exc = box["error"]
            return Evaluation.not_judged("failed", f"{self.function} raised {exc!r}")
        value = box.get("value")
        if isinstance(value, Evaluation):
            return value
        if isinstance(value, int | float) and math.isfinite(value):
            return Evaluation(final=float(value))
        return Evaluation.not_judged(
            "failed", f"{self.function} returned {type(value).__name__}, not a number"
        )


# --------------------------------------------------------------------------- factory


def build_evaluator(spec: EvaluatorSpec) -> Evaluator:
    """The evaluator of a job's ``evaluator`` spec."""
    if isinstance(spec, SuiteEvaluatorSpec):
        return SuiteEvaluator(spec)
    if isinstance(spec, CommandEvaluatorSpec):
        return CommandEvaluator(spec)
    if isinstance(spec, PythonEvaluatorSpec):
        return PythonEvaluator(spec)
    raise EvaluatorError(f"unknown evaluator spec {type(spec).__name__}")
