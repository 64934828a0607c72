"""The evaluators in real bubblewrap sandboxes: on three pycoding tasks the reference solution
scores 1.0 with a milestone per hidden test and the starting files score less; hidden files the
agent forged are overwritten; a check that crashes is ``failed`` and one past its deadline is
``timeout``, with the reason and no score. The command and Python evaluators, the same."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollstream.producers.rollouts.bwrap import BwrapProvider
from rollstream.producers.rollouts.evaluators import (
    CommandEvaluator,
    Evaluation,
    EvaluatorError,
    PythonEvaluator,
    SuiteEvaluator,
    build_evaluator,
)
from rollstream.producers.rollouts.jobs import (
    CommandEvaluatorSpec,
    PythonEvaluatorSpec,
    SuiteEvaluatorSpec,
)
from rollstream.producers.rollouts.sandbox import Sandbox, SandboxLimits, SandboxSpec
from rollstream.producers.rollouts.tasks import RUNNER_NAME, Task, load_suite, parse_task

TASKS = {t.task_id: t for t in load_suite("pycoding")}
THREE = ["balanced-brackets", "mean-division-fix", "lru-cache"]


@pytest.fixture(scope="module")
def provider() -> Iterator[BwrapProvider]:
    # bwrap runs as an unprivileged host user when we are root: it must reach the root dir, so
    # not under pytest's 0700 tmp dirs
    root = Path(tempfile.mkdtemp(prefix="rs-evaluators-"))
    root.chmod(0o755)
    yield BwrapProvider(root / "bwrap")
    shutil.rmtree(root, ignore_errors=True)


def sandbox_with(provider: BwrapProvider, files: dict[str, str]) -> Sandbox:
    spec = SandboxSpec(
        files={path: text.encode() for path, text in files.items()},
        limits=SandboxLimits(timeout=60),
    )
    return provider.create(spec)


def soon(seconds: float = 60.0) -> float:
    return time.monotonic() + seconds


@pytest.mark.parametrize("task_id", THREE)
def test_reference_solution_scores_one_with_every_milestone(
    provider: BwrapProvider, task_id: str
) -> None:
    task = TASKS[task_id]
    with sandbox_with(provider, task.workdir_files(solved=True)) as sb:
        ev = SuiteEvaluator().evaluate(task, sb, soon())
    names = task.hidden_test_names()
    assert (ev.status, ev.final, ev.reason) == ("ok", 1.0, ""), ev.output
    assert [name for name, _ in ev.milestones] == names
    assert all(value == pytest.approx(1 / len(names)) for _, value in ev.milestones)
    assert sum(value for _, value in ev.milestones) == pytest.approx(1.0)
    assert '"summary"' in ev.output and ev.duration_s > 0


@pytest.mark.parametrize("task_id", THREE)
def test_starting_files_score_less(provider: BwrapProvider, task_id: str) -> None:
    task = TASKS[task_id]
    with sandbox_with(provider, task.workdir_files()) as sb:
        ev = SuiteEvaluator().evaluate(task, sb, soon())
    assert ev.status == "ok" and ev.final == 0.0, ev
    assert len(ev.milestones) < len(task.hidden_test_names())


def test_forged_hidden_tests_and_runner_are_overwritten(provider: BwrapProvider) -> None:
    task = TASKS["balanced-brackets"]
    files = task.workdir_files()
    forged = "def test_a():\n    pass\n"
    files.update({path: forged for path in task.hidden_tests})
    files[RUNNER_NAME] = 'print(\'{"summary": {"passed": 99, "total": 99}}\')\n'
    with sandbox_with(provider, files) as sb:
        ev = SuiteEvaluator().evaluate(task, sb, soon())
        assert {p: sb.copy_out(p).decode() for p in task.hidden_tests} == task.hidden_tests
        # a directory, or a symlink out of the workdir, where a hidden file goes
        first, *_ = sorted(task.hidden_tests)
        assert sb.exec(f"rm {first} {RUNNER_NAME}; mkdir -p {first}/x").ok
        assert sb.exec(f"ln -s /etc/passwd {RUNNER_NAME}").ok
        again = SuiteEvaluator().evaluate(task, sb, soon())
        assert sb.copy_out(RUNNER_NAME).decode() == task.hidden_check_files()[RUNNER_NAME]
    assert ev.status == "ok" and ev.final == 0.0
    assert again.status == "ok" and again.final == 0.0


def test_a_crashing_check_is_failed_with_its_reason(provider: BwrapProvider) -> None:
    task = TASKS["balanced-brackets"]
    files = task.workdir_files()
    (module,) = task.files  # the module the hidden tests import: it kills the runner
    files[module] = "import os\nos._exit(3)\n"
    with sandbox_with(provider, files) as sb:
        ev = SuiteEvaluator().evaluate(task, sb, soon())
        missing = SuiteEvaluator(SuiteEvaluatorSpec(kind="suite", python="no-python")).evaluate(
            task, sb, soon()
        )
    assert ev.status == "failed" and "the check crashed" in ev.reason, ev
    assert (missing.status, missing.milestones) == ("failed", ())
    assert "exit code 127" in missing.reason or "no test reported" in missing.reason


def _sleepy_task() -> Task:
    base = TASKS["balanced-brackets"].model_dump(mode="json")
    base.update(
        task_id="sleepy",
        hidden_tests={"test_hidden.py": "import time\n\ndef test_slow():\n    time.sleep(30)\n"},
        visible_tests={},
        timeout_s=60,
        test_timeout_s=60,
    )
    return parse_task(base)


def test_a_check_past_the_deadline_times_out(provider: BwrapProvider) -> None:
    task = _sleepy_task()
    with sandbox_with(provider, task.workdir_files()) as sb:
        t0 = time.monotonic()
        ev = SuiteEvaluator().evaluate(task, sb, soon(1.5))
        took = time.monotonic() - t0
        assert sb.exec(["true"]).ok  # the sandbox stays usable
    assert (ev.status, ev.milestones) == ("timeout", ()) and "ran past" in ev.reason
    assert took < 10


def test_no_time_left_is_a_timeout(provider: BwrapProvider) -> None:
    task = TASKS["balanced-brackets"]
    with sandbox_with(provider, task.workdir_files(solved=True)) as sb:
        ev = SuiteEvaluator().evaluate(task, sb, time.monotonic() - 1)
    assert ev.status == "timeout"


# --------------------------------------------------------------------------- command


@pytest.mark.parametrize(
    ("script", "status", "final"),
    [
        ("exit 0", "ok", 1.0),
        ("echo checking; exit 1", "ok", 0.0),
        ("echo checking; echo 0.25", "ok", 0.25),
        ("echo 0.75; exit 1", "ok", 0.75),
        ("echo nan", "ok", 1.0),
        ("kill -9 $$", "failed", 0.0),
        ("exec no-such-command", "failed", 0.0),
        ("sleep 30", "timeout", 0.0),
    ],
)
def test_command_evaluator(provider: BwrapProvider, script: str, status: str, final: float) -> None:
    task = TASKS["balanced-brackets"]
    spec = CommandEvaluatorSpec(kind="command", argv=["sh", "-c", script])
    with sandbox_with(provider, task.workdir_files()) as sb:
        ev = CommandEvaluator(spec).evaluate(task, sb, soon(2.0))
    assert (ev.status, ev.final) == (status, final), ev
    assert (ev.reason != "") == (status != "ok")


def test_command_evaluator_sees_the_workdir(provider: BwrapProvider) -> None:
    task = TASKS["balanced-brackets"]
    argv = ["python3", "-c", "import pathlib; print(len(pathlib.Path('_runner.py').read_text()))"]
    with sandbox_with(provider, task.workdir_files()) as sb:
        ev = CommandEvaluator(CommandEvaluatorSpec(kind="command", argv=argv)).evaluate(
            task, sb, soon()
        )
    assert ev.final == float(len(task.workdir_files()[RUNNER_NAME]))


# --------------------------------------------------------------------------- python


def score_half(task: Task, sandbox: Sandbox) -> float:
    return 0.5 if sandbox.copy_out(next(iter(task.files))) else 0.0


def score_full(task: Task, sandbox: Sandbox) -> Evaluation:
    return Evaluation(final=1.0, milestones=(("own", 0.3),))


def score_raises(task: Task, sandbox: Sandbox) -> float:
    raise RuntimeError("broken evaluator")


def score_text(task: Task, sandbox: Sandbox) -> Any:
    return "high"


def score_slow(task: Task, sandbox: Sandbox) -> float:
    time.sleep(5)
    return 1.0


@pytest.mark.parametrize(
    ("function", "status", "final", "words"),
    [
        ("score_half", "ok", 0.5, ""),
        ("score_full", "ok", 1.0, ""),
        ("score_raises", "failed", 0.0, "broken evaluator"),
        ("score_text", "failed", 0.0, "returned str"),
        ("score_slow", "timeout", 0.0, "ran past"),
    ],
)
def test_python_evaluator(
    provider: BwrapProvider, function: str, status: str, final: float, words: str
) -> None:
    task = TASKS["balanced-brackets"]
    evaluator = build_evaluator(
        PythonEvaluatorSpec(kind="python", function=f"{__name__}:{function}")
    )
    assert evaluator.name == f"python:{__name__}:{function}"
    with sandbox_with(provider, task.workdir_files()) as sb:
        ev = evaluator.evaluate(task, sb, soon(1.0))
    assert (ev.status, ev.final) == (status, final) and words in ev.reason


@pytest.mark.parametrize(
    ("target", "words"),
    [("no_such_module_here:f", "cannot import"), (f"{__name__}:nothing", "not a callable")],
)
def test_python_evaluator_that_cannot_be_built(target: str, words: str) -> None:
    with pytest.raises(EvaluatorError, match=words):
        PythonEvaluator(target)


def test_build_evaluator() -> None:
    assert build_evaluator(SuiteEvaluatorSpec(kind="suite")).name == "suite"
    assert build_evaluator(CommandEvaluatorSpec(kind="command", argv=["true"])).name == "command"


def test_an_evaluation_outside_the_reward_bound_is_failed_not_posted() -> None:
    from rollstream.producers.rollouts.evaluators import Evaluation

    ok = Evaluation(final=0.5, milestones=(("m", 1.0),))
    assert ok.bounded() is ok
    huge = Evaluation(final=2e6).bounded()
    assert huge.status == "failed" and "final" in huge.reason
    bad_milestone = Evaluation(final=1.0, milestones=(("m", float("inf")),)).bounded()
    assert bad_milestone.status == "failed" and "m = inf" in bad_milestone.reason
    assert Evaluation.not_judged("timeout", "late").bounded().status == "timeout"
