"""Coding tasks for the rollout service: the Task model, the suite loader and the check protocol.

A task is a small repository the agent starts from (``files``), tests it may run
(``visible_tests``), tests only the evaluator runs (``hidden_tests``) and, for a suite that
proves itself, a reference ``solution`` (files that replace starting ones). The built-in suite
``pycoding`` (producers/rollouts/suites/pycoding/, one JSON file per task) holds small Python
tasks: implement a function from its spec, or fix a bug in given code.

The check needs nothing but the Python standard library inside the sandbox. Tests are plain
``test_*`` functions using ``assert``; the runner (``RUNNER_SOURCE``, written as ``_runner.py``
beside the tests) runs each one, prints one JSON line per test and a summary line, and exits 0
only if every test passed::

    {"test": "test_hidden.py::test_empty", "passed": false, "error": "AssertionError ..."}
    {"summary": {"passed": 4, "failed": 1, "total": 5}}

The runner lists the tests of a file from its syntax tree before importing it, so a solution
that does not import still counts every test (as failed) and partial credit keeps one
denominator. It runs under ``python3 -I`` (the workdir is not on ``sys.path`` until the runner's
own imports are done), captures what tests print, and fails a test that runs past its time.
It does not defend against a solution written to forge its output (in-process code can write
to the same stdout): that is the sandbox's and the evaluator's concern.

The evaluator side: ``task.hidden_check_files()`` go into the workdir after RUN (they overwrite
any file of the same name), ``task.check_command()`` runs there, and the pure
``parse_check_output(stdout, expected=task.hidden_test_names())`` gives a ``CheckResult``:
``score`` (passed / total, the partial credit) and ``reward`` (1.0 only if every test passed).

A user suite is a directory of ``*.json`` task files or a JSONL file, one task per line; the
format is ``task_json_schema()``. A file's text may be given as one string or as a list of lines
(joined with newlines, plus a final one).

Errors::

    ProducerError                  (rollstream.producers.errors)
    └── TaskSuiteError             a task or suite that cannot be loaded: a missing suite, bad
                                   JSON, a field out of bounds, duplicate ids (ValueError);
                                   .source names the file (and line), .field the field
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from rollstream.producers.errors import TaskSuiteError

__all__ = [
    "BUILTIN_SUITES_DIR",
    "RUNNER_NAME",
    "RUNNER_SOURCE",
    "CheckResult",
    "Task",
    "TaskSuiteError",
    "TestOutcome",
    "builtin_suites",
    "load_suite",
    "parse_check_output",
    "parse_task",
    "task_json_schema",
]

BUILTIN_SUITES_DIR = Path(__file__).resolve().parent / "suites"
RUNNER_NAME = "_runner.py"

MAX_FILE_CHARS = 64 * 1024
MAX_TASK_CHARS = 512 * 1024
MAX_FILES = 16
MAX_PROMPT_CHARS = 8_000
MAX_TESTS_PER_TASK = 200
MAX_TASKS_PER_SUITE = 100_000
MAX_SOURCE_BYTES = 2 * MAX_TASK_CHARS  # one task file (JSON escapes may double its size)

MAX_OUTPUT_CHARS = 1_000_000  # of a check's stdout, parsed
MAX_LINE_CHARS = 16_000
MAX_REPORTED_TESTS = 1_000
MAX_NAME_CHARS = 200
MAX_ERROR_CHARS = 300

_ID_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
_PATH_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_SUITE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


# --------------------------------------------------------------------------- the model


def _join_lines(value: Any) -> Any:
    """A text given as a list of lines becomes one string, each line ending with a newline."""
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "".join(line + "\n" for line in value)
    return value


_TEXT_SCHEMA = {
    "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
    "description": "a text, or its lines (joined with newlines, plus a final one)",
}

FileText = Annotated[
    str,
    StringConstraints(max_length=MAX_FILE_CHARS),
    BeforeValidator(_join_lines),
    WithJsonSchema({**_TEXT_SCHEMA, "maxLength": MAX_FILE_CHARS}),
]
Prompt = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_PROMPT_CHARS),
    BeforeValidator(_join_lines),
    WithJsonSchema({**_TEXT_SCHEMA, "maxLength": MAX_PROMPT_CHARS}),
]
RelPath = Annotated[
    str,
    StringConstraints(min_length=1, max_length=160),
    Field(description="a relative POSIX path: no '..', no absolute path, no hidden component"),
]
Files = Annotated[dict[RelPath, FileText], Field(max_length=MAX_FILES)]
Tag = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,39}$")]


def _check_path(path: str) -> str:
    parts = path.split("/")
    if len(parts) > 4 or not all(_PATH_PART.match(part) for part in parts):
        raise ValueError(
            f"bad path {path[:80]!r}: up to 4 components of letters, digits, '_', '.', '-',"
            " none starting with '.' or '-'"
        )
    return path


def _test_functions(path: str, text: str) -> list[str]:
    """The ``test_*`` functions a test file defines at its top level (as the runner finds them)."""
    try:
        tree = ast.parse(text, filename=path)
    except (SyntaxError, ValueError) as exc:
        raise ValueError(f"test file {path} does not parse: {exc}") from exc
    names = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    ]
    return list(dict.fromkeys(names))


class Task(BaseModel):
    """One coding task. Every text is bounded; paths are relative and safe to write under a
    workdir; test files are ``test_*.py``; starting files, visible tests, hidden tests and the
    runner never share a path (the solution may only replace or add starting files)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: Annotated[str, StringConstraints(pattern=_ID_PATTERN)]
    title: Annotated[str, StringConstraints(min_length=1, max_length=120)]
    difficulty: Literal["easy", "medium", "hard"]
    kind: Literal["implement", "fix"] = "implement"
    prompt: Prompt
    files: Files = Field(min_length=1, description="the starting files")
    visible_tests: Files = Field(default_factory=dict, description="tests the agent may run")
    hidden_tests: Files = Field(min_length=1, description="tests only the evaluator runs")
    solution: Files = Field(
        default_factory=dict, description="reference files that replace or add starting files"
    )
    tags: Annotated[list[Tag], Field(max_length=16)] = Field(default_factory=list)
    timeout_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=20.0, description="the whole check, in seconds"
    )
    test_timeout_s: Annotated[float, Field(gt=0, le=120)] = Field(
        default=5.0, description="one test function, in seconds"
    )

    @field_validator("files", "visible_tests", "hidden_tests", "solution")
    @classmethod
    def _safe_paths(cls, files: dict[str, str]) -> dict[str, str]:
        for path in files:
            _check_path(path)
            if path == RUNNER_NAME:
                raise ValueError(f"{RUNNER_NAME} is the runner's own path")
        return files

    @field_validator("visible_tests", "hidden_tests")
    @classmethod
    def _test_files(cls, files: dict[str, str]) -> dict[str, str]:
        for path, text in files.items():
            name = PurePosixPath(path).name
            if not (name.startswith("test_") and name.endswith(".py")):
                raise ValueError(f"test file {path} is not named test_*.py")
            if not _test_functions(path, text):
                raise ValueError(f"test file {path} defines no test_* function")
        return files

    @model_validator(mode="after")
    def _disjoint_and_bounded(self) -> Task:
        start, visible, hidden = set(self.files), set(self.visible_tests), set(self.hidden_tests)
        clashes = (start & visible) | (start & hidden) | (visible & hidden)
        clashes |= set(self.solution) & (visible | hidden)
        if clashes:
            raise ValueError(f"paths used twice: {sorted(clashes)}")
        size = len(self.prompt) + sum(
            len(path) + len(text)
            for files in (self.files, self.visible_tests, self.hidden_tests, self.solution)
            for path, text in files.items()
        )
        if size > MAX_TASK_CHARS:
            raise ValueError(f"task is {size} characters, more than {MAX_TASK_CHARS}")
        if len(self.hidden_test_names()) > MAX_TESTS_PER_TASK:
            raise ValueError(f"more than {MAX_TESTS_PER_TASK} hidden tests")
        return self

    # ----------------------------------------------------------------- what goes where

    def workdir_files(self, solved: bool = False) -> dict[str, str]:
        """The agent's workdir: starting files, visible tests and the runner; ``solved`` applies
        the reference solution (a task without one raises TaskSuiteError)."""
        if solved and not self.solution:
            raise TaskSuiteError("has no reference solution", source=self.task_id)
        out = dict(self.files)
        if solved:
            out.update(self.solution)
        out.update(self.visible_tests)
        out[RUNNER_NAME] = RUNNER_SOURCE
        return out

    def hidden_check_files(self) -> dict[str, str]:
        """Written into the workdir after RUN, over anything of the same name: the hidden tests
        and a fresh copy of the runner."""
        return {**self.hidden_tests, RUNNER_NAME: RUNNER_SOURCE}

    def check_command(self, python: str = "python3") -> list[str]:
        """The evaluator's argv, run in the workdir: every hidden test file."""
        return self._runner_argv(python, self.hidden_tests)

    def visible_command(self, python: str = "python3") -> list[str]:
        """The argv the agent may run itself: the visible tests."""
        return self._runner_argv(python, self.visible_tests)

    def _runner_argv(self, python: str, tests: dict[str, str]) -> list[str]:
        return [python, "-I", RUNNER_NAME, "--timeout", f"{self.test_timeout_s:g}", *sorted(tests)]

    def hidden_test_names(self) -> list[str]:
        """``file::function`` of every hidden test, as the runner reports them."""
        return [
            f"{path}::{name}"
            for path in sorted(self.hidden_tests)
            for name in _test_functions(path, self.hidden_tests[path])
        ]

    def instructions(self) -> str:
        """What the agent is told: the prompt, its files and how to run the visible tests."""
        lines = [self.prompt.rstrip(), "", "Files in your working directory:"]
        lines += [f"- {path}" for path in sorted(self.workdir_files()) if path != RUNNER_NAME]
        if self.visible_tests:
            lines += ["", "Run the visible tests with: " + " ".join(self.visible_command())]
        return "\n".join(lines) + "\n"


def task_json_schema() -> dict[str, Any]:
    """The JSON Schema of one task (a task file, or one line of a JSONL suite)."""
    return Task.model_json_schema()


# --------------------------------------------------------------------------- loading


def builtin_suites() -> list[str]:
    """Names of the suites shipped with rollstream."""
    if not BUILTIN_SUITES_DIR.is_dir():
        return []
    return sorted(
        p.name for p in BUILTIN_SUITES_DIR.iterdir() if p.is_dir() and _SUITE_NAME.match(p.name)
    )


def parse_task(data: Any, *, source: str = "") -> Task:
    """One task from decoded JSON; a field out of bounds raises TaskSuiteError naming it."""
    try:
        return Task.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = ".".join(str(part) for part in first["loc"])[:200]
        message = str(first["msg"])[:300]
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise TaskSuiteError(message + more, source=source, field=field) from exc


def load_suite(name_or_path: str | Path) -> list[Task]:
    """Tasks of a built-in suite (by name, e.g. ``"pycoding"``; write ``./name`` for a local
    directory of the same name), of a directory of ``*.json`` task files (sorted by file name,
    each named after its task_id) or of a JSONL file (in line order). Ids must be unique."""
    path = _resolve(name_or_path)
    if path.is_dir():
        tasks = _load_dir(path)
    elif path.is_file():
        tasks = _load_jsonl(path)
    else:
        raise TaskSuiteError("no such suite, directory or JSONL file", source=str(name_or_path))
    if not tasks:
        raise TaskSuiteError("the suite holds no task", source=str(path))
    seen: set[str] = set()
    for task in tasks:
        if task.task_id in seen:
            raise TaskSuiteError(f"task id {task.task_id!r} is used twice", source=str(path))
        seen.add(task.task_id)
    return tasks


def _resolve(name_or_path: str | Path) -> Path:
    if isinstance(name_or_path, str) and _SUITE_NAME.match(name_or_path):
        builtin = BUILTIN_SUITES_DIR / name_or_path
        if builtin.is_dir():
            return builtin
    return Path(name_or_path)


def _load_dir(directory: Path) -> list[Task]:
    paths = sorted(p for p in directory.glob("*.json") if not p.name.startswith((".", "_")))
    if len(paths) > MAX_TASKS_PER_SUITE:
        raise TaskSuiteError(f"more than {MAX_TASKS_PER_SUITE} tasks", source=str(directory))
    tasks = []
    for path in paths:
        source = str(path)
        raw = _read(path, MAX_SOURCE_BYTES)
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise TaskSuiteError(f"not JSON: {exc}", source=source) from exc
        task = parse_task(data, source=source)
        if task.task_id != path.stem:
            raise TaskSuiteError(
                f"task_id {task.task_id!r} differs from the file name", source=source
            )
        tasks.append(task)
    return tasks


def _load_jsonl(path: Path) -> list[Task]:
    tasks = []
    try:
        with path.open("rb") as fh:
            number = 0
            while raw := fh.readline(MAX_SOURCE_BYTES + 1):
                number += 1
                source = f"{path}:{number}"
                if len(raw) > MAX_SOURCE_BYTES:
                    raise TaskSuiteError("line too long for one task", source=source)
                if not raw.strip():
                    continue
                try:
                    data = json.loads(raw)
                except ValueError as exc:  # UnicodeDecodeError included
                    raise TaskSuiteError(f"not JSON: {exc}", source=source) from exc
                tasks.append(parse_task(data, source=source))
                if len(tasks) > MAX_TASKS_PER_SUITE:
                    raise TaskSuiteError(f"more than {MAX_TASKS_PER_SUITE} tasks", source=str(path))
    except OSError as exc:
        raise TaskSuiteError(f"cannot read: {exc}", source=str(path)) from exc
    return tasks


def _read(path: Path, limit: int) -> str:
    try:
        with path.open("rb") as fh:
            raw = fh.read(limit + 1)
    except OSError as exc:
        raise TaskSuiteError(f"cannot read: {exc}", source=str(path)) from exc
    if len(raw) > limit:
        raise TaskSuiteError(f"larger than {limit} bytes", source=str(path))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskSuiteError(f"not UTF-8: {exc}", source=str(path)) from exc


# --------------------------------------------------------------------------- check results


@dataclass(frozen=True, slots=True)
class TestOutcome:
    """One test as the runner reported it (``error`` is empty when it passed)."""

    __test__ = False  # not a pytest class

    name: str
    passed: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class CheckResult:
    """A check's tests. ``error`` says why the output cannot be fully trusted (no summary, a
    count that disagrees, an expected test not reported...): the passed tests still count for
    partial credit, but the reward is 1.0 only with no error and every test passed."""

    passed: int
    total: int
    tests: tuple[TestOutcome, ...] = ()
    error: str | None = None

    @property
    def all_passed(self) -> bool:
        return self.error is None and self.total > 0 and self.passed == self.total

    @property
    def score(self) -> float:
        """Partial credit: passed / total (0.0 with no test)."""
        return self.passed / self.total if self.total else 0.0

    @property
    def reward(self) -> float:
        """The final reward: 1.0 only if every test passed, else 0.0."""
        return 1.0 if self.all_passed else 0.0


def parse_check_output(stdout: str | bytes, expected: Iterable[str] | None = None) -> CheckResult:
    """Read the runner's output (pure, bounded, never raises). Lines that are not the runner's
    JSON are ignored. With ``expected`` (``task.hidden_test_names()``) the total is the expected
    tests, and one that was not reported counts as failed."""
    try:
        return _parse(stdout, expected)
    except Exception as exc:  # a bug here must not take the evaluator down
        return CheckResult(0, 0, (), _clip(f"cannot parse the check output: {exc!r}"))


def _parse(stdout: str | bytes, expected: Iterable[str] | None) -> CheckResult:
    if isinstance(stdout, bytes):
        stdout = stdout[: MAX_OUTPUT_CHARS * 4].decode("utf-8", errors="replace")
    if not isinstance(stdout, str):
        return CheckResult(0, 0, (), f"output is {type(stdout).__name__}, not text")
    problems: list[str] = []
    if len(stdout) > MAX_OUTPUT_CHARS:
        stdout = stdout[:MAX_OUTPUT_CHARS]
        problems.append(f"output cut at {MAX_OUTPUT_CHARS} characters")
    outcomes: dict[str, TestOutcome] = {}
    twice: list[str] = []
    summary: dict[str, Any] | None = None
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{") or len(line) > MAX_LINE_CHARS:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if isinstance(record.get("summary"), dict):
            summary = record["summary"]
            continue
        name, passed = record.get("test"), record.get("passed")
        if not isinstance(name, str) or not isinstance(passed, bool):
            continue
        name = name[:MAX_NAME_CHARS]
        if name in outcomes:
            twice.append(name)
            outcomes[name] = TestOutcome(name, False, "reported twice")
            continue
        if len(outcomes) >= MAX_REPORTED_TESTS:
            problems.append(f"more than {MAX_REPORTED_TESTS} tests reported")
            break
        error = record.get("error")
        text = _clip(error) if isinstance(error, str) and not passed else ""
        outcomes[name] = TestOutcome(name, passed, text or ("" if passed else "failed"))

    if twice:
        problems.append(f"{len(twice)} tests reported twice: {_clip(', '.join(twice[:5]))}")
    expected_names = None if expected is None else list(dict.fromkeys(expected))
    if expected_names is not None:
        known = set(expected_names)
        unexpected = [name for name in outcomes if name not in known]
        if unexpected:
            problems.append(f"unexpected tests reported: {_clip(', '.join(unexpected))}")
        missing = [name for name in expected_names if name not in outcomes]
        if missing:
            problems.append(f"{len(missing)} expected tests not reported")
        tests = [
            outcomes.get(name, TestOutcome(name, False, "not reported")) for name in expected_names
        ]
    else:
        tests = list(outcomes.values())

    if summary is None:
        if not outcomes:
            problems.insert(0, "no test results in the output")
        else:
            problems.append("no summary line (the runner did not finish)")
    else:
        said = summary.get("total")
        if not isinstance(said, int) or isinstance(said, bool) or said != len(outcomes):
            problems.append(f"the summary says {said!r} tests, the output has {len(outcomes)}")
    passed = sum(t.passed for t in tests)
    total = len(tests) if expected_names is None else len(expected_names)
    error = _clip("; ".join(problems)) if problems else None
    return CheckResult(passed, total, tuple(tests), error)


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


# --------------------------------------------------------------------------- the runner

RUNNER_SOURCE = r'''"""Test runner of rollstream's coding tasks (standard library only).

    python3 -I _runner.py [--timeout SECONDS] test_file.py ...

Runs every top-level test_* function of each file, prints one JSON line per test
({"test": "file::name", "passed": bool, "error": text}) and a summary line
({"summary": {"passed": n, "failed": n, "total": n}}). Exit 0 only if every test passed.
"""

import ast
import contextlib
import importlib.util
import io
import json
import os
import signal
import sys
import time
import traceback

MAX_ERROR = 300
OUT = sys.stdout


class TestTimeout(BaseException):
    """Raised in a test that runs past its time (a BaseException: `except Exception` in the
    code under test does not swallow it)."""


def on_alarm(signum, frame):
    raise TestTimeout()


def emit(record):
    OUT.write(json.dumps(record, ensure_ascii=True) + "\n")
    OUT.flush()


def describe(exc, path):
    if isinstance(exc, TestTimeout):
        return "timed out"
    text = type(exc).__name__
    detail = str(exc)
    if detail:
        text += ": " + detail
    target = os.path.abspath(path)
    where = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if os.path.abspath(frame.filename) == target:
            where = frame
    if where is not None:
        text += " (%s:%d: %s)" % (os.path.basename(path), where.lineno, (where.line or "").strip())
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR else text[: MAX_ERROR - 3] + "..."


@contextlib.contextmanager
def guarded(timeout):
    sink = io.StringIO()
    timed = hasattr(signal, "setitimer")
    if timed:
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)


def test_names(path):
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), filename=path)
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    return list(dict.fromkeys(n for n in names if n.startswith("test_")))


def run_file(index, path, timeout):
    try:
        names = test_names(path)
    except Exception as exc:
        return [(path + "::<collect>", False, describe(exc, path))]
    if not names:
        return [(path + "::<collect>", False, "no test_* function")]
    module = None
    import_error = None
    try:
        spec = importlib.util.spec_from_file_location("_rs_test_%d" % index, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        with guarded(timeout):
            spec.loader.exec_module(module)
    except BaseException as exc:
        import_error = "import failed: " + describe(exc, path)
    results = []
    for name in names:
        full = path + "::" + name
        if import_error is not None:
            results.append((full, False, import_error[:MAX_ERROR]))
            continue
        func = getattr(module, name, None)
        if not callable(func):
            results.append((full, False, "not a function"))
            continue
        try:
            with guarded(timeout):
                func()
        except BaseException as exc:
            results.append((full, False, describe(exc, path)))
        else:
            results.append((full, True, ""))
    return results


def main(argv):
    timeout = 5.0
    files = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--timeout" and args:
            timeout = float(args.pop(0))
        elif arg.startswith("-"):
            sys.stderr.write("usage: _runner.py [--timeout SECONDS] test_file.py ...\n")
            return 2
        else:
            files.append(arg)
    if not files:
        sys.stderr.write("usage: _runner.py [--timeout SECONDS] test_file.py ...\n")
        return 2
    for folder in sorted({os.getcwd()} | {os.path.dirname(os.path.abspath(f)) for f in files}):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    passed = total = 0
    started = time.perf_counter()
    for index, path in enumerate(files):
        for name, ok, error in run_file(index, path, timeout):
            emit({"test": name, "passed": ok, "error": error})
            total += 1
            passed += ok
    seconds = round(time.perf_counter() - started, 3)
    emit({"summary": {"passed": passed, "failed": total - passed, "total": total,
                      "seconds": seconds}})
    return 0 if total and passed == total else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''
