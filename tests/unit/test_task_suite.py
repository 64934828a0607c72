"""The built-in coding suite proves itself: every reference solution passes its hidden and
visible tests and every unchanged task fails a hidden test, run by the standard-library runner
in a plain subprocess (the sandboxed run is an integration test). The loader takes user suites
(a directory or JSONL) and names the field it rejects; the check output parser is bounded and
never raises."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.producers.rollouts.tasks import (
    MAX_ERROR_CHARS,
    MAX_FILE_CHARS,
    MAX_PROMPT_CHARS,
    MAX_REPORTED_TESTS,
    RUNNER_NAME,
    RUNNER_SOURCE,
    CheckResult,
    Task,
    TaskSuiteError,
    builtin_suites,
    load_suite,
    parse_check_output,
    parse_task,
    task_json_schema,
)

SUITE = load_suite("pycoding")
BY_ID = {task.task_id: task for task in SUITE}


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str

    def result(self, expected: list[str] | None = None) -> CheckResult:
        return parse_check_output(self.stdout, expected)


def run_in(workdir: Path, files: dict[str, str], argv: list[str], timeout: float = 60) -> Run:
    for rel, text in files.items():
        path = workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    argv = [sys.executable if argv[0] == "python3" else argv[0], *argv[1:]]
    done = subprocess.run(
        argv, cwd=workdir, capture_output=True, text=True, timeout=timeout, check=False
    )
    return Run(done.returncode, done.stdout, done.stderr)


def all_tests_argv(task: Task) -> list[str]:
    """The check command with the visible tests added: one run covers both."""
    return [*task.check_command(), *sorted(task.visible_tests)]


@pytest.fixture(scope="module")
def suite_runs() -> dict[str, tuple[Run, Run]]:
    """Per task: (reference solution with hidden + visible tests, starting files with hidden
    tests), run a few at a time, each in a temporary directory of its own."""

    def check(task: Task) -> tuple[str, tuple[Run, Run]]:
        with tempfile.TemporaryDirectory(prefix=f"{task.task_id}-") as tmp:
            root = Path(tmp)
            (root / "solved").mkdir()
            (root / "start").mkdir()
            solved = run_in(
                root / "solved",
                {**task.workdir_files(solved=True), **task.hidden_check_files()},
                all_tests_argv(task),
            )
            start = run_in(
                root / "start",
                {**task.workdir_files(), **task.hidden_check_files()},
                task.check_command(),
            )
        return task.task_id, (solved, start)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(check, SUITE))


# --------------------------------------------------------------------------- the suite


def test_builtin_suite_is_listed_and_large_enough() -> None:
    assert "pycoding" in builtin_suites()
    assert len(SUITE) >= 30
    assert len(BY_ID) == len(SUITE)  # ids are unique
    difficulty = Counter(task.difficulty for task in SUITE)
    assert min(difficulty[level] for level in ("easy", "medium", "hard")) >= 5, difficulty
    kinds = Counter(task.kind for task in SUITE)
    assert kinds["implement"] >= 10 and kinds["fix"] >= 8, kinds


@pytest.mark.parametrize("task", SUITE, ids=lambda t: t.task_id)
def test_task_fields_bounded_and_standard_library_only(task: Task) -> None:
    assert 0 < len(task.title) <= 120 and 0 < len(task.prompt) <= MAX_PROMPT_CHARS
    texts = {**task.files, **task.visible_tests, **task.hidden_tests, **task.solution}
    assert all(len(text) <= MAX_FILE_CHARS for text in texts.values())
    assert set(task.solution) <= set(task.files)
    assert task.visible_tests, "the agent gets tests to run"
    # several independent hidden tests: partial credit has steps
    assert len(task.hidden_test_names()) >= 5
    allowed = set(sys.stdlib_module_names) | {"solution"}
    for path, text in texts.items():
        for node in ast.walk(ast.parse(text, filename=path)):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert roots <= allowed, (path, roots)
    # the agent's workdir never holds the hidden tests
    assert not set(task.hidden_tests) & set(task.workdir_files())
    assert task.instructions().startswith(task.prompt.rstrip())


@pytest.mark.parametrize("task_id", sorted(BY_ID))
def test_reference_passes_and_starting_files_fail(
    task_id: str, suite_runs: dict[str, tuple[Run, Run]]
) -> None:
    task = BY_ID[task_id]
    solved, start = suite_runs[task_id]
    visible_names = [
        f"{path}::{name}"
        for path in sorted(task.visible_tests)
        for name in _test_functions(task.visible_tests[path])
    ]
    result = solved.result([*task.hidden_test_names(), *visible_names])
    failed = [t for t in result.tests if not t.passed]
    assert result.all_passed and result.reward == 1.0, (failed, solved.stderr[-2000:])
    assert solved.returncode == 0
    # fast: the runner's own time for all of the task's tests
    summary = json.loads(solved.stdout.strip().splitlines()[-1])["summary"]
    assert summary["seconds"] < 2.0, summary

    unchanged = start.result(task.hidden_test_names())
    assert unchanged.error is None, unchanged.error
    assert unchanged.total == len(task.hidden_test_names())
    assert unchanged.passed < unchanged.total and unchanged.reward == 0.0
    assert start.returncode == 1
    if task.kind == "fix":
        # the bug is in behaviour: the buggy module imports and runs
        assert not any("import failed" in t.error for t in unchanged.tests)


def _test_functions(text: str) -> list[str]:
    return [
        node.name
        for node in ast.parse(text).body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    ]


# --------------------------------------------------------------------------- user suites

TINY: dict[str, Any] = {
    "task_id": "tiny-add",
    "title": "Add two numbers",
    "difficulty": "easy",
    "prompt": "Implement add in solution.py.",
    "files": {"solution.py": ["def add(a, b):", "    raise NotImplementedError"]},
    "visible_tests": {
        "test_visible.py": "from solution import add\n\ndef test_one():\n"
        "    assert add(1, 2) == 3\n"
    },
    "hidden_tests": {
        "test_hidden.py": [
            "import time",
            "from solution import add",
            "def test_small():",
            "    assert add(1, 2) == 3",
            "def test_negative():",
            "    assert add(-1, -2) == -3",
            "def test_prints_fake_results():",
            '    print(\'{"test": "test_hidden.py::test_small", "passed": true}\')',
            "    assert add(0, 0) == 0",
            "def test_exits():",
            "    raise SystemExit(0)",
            "def test_hangs():",
            "    while add(1, 1) == 2:",
            "        time.sleep(0.01)",
        ]
    },
    "solution": {"solution.py": "def add(a, b):\n    return a + b\n"},
}


def test_lines_and_text_are_the_same_file() -> None:
    task = parse_task(TINY)
    assert task.files["solution.py"] == "def add(a, b):\n    raise NotImplementedError\n"
    assert task.kind == "implement" and task.tags == []
    assert parse_task(task.model_dump(mode="json")) == task


def test_workdir_hidden_files_and_commands() -> None:
    task = parse_task(TINY)
    start = task.workdir_files()
    assert set(start) == {"solution.py", "test_visible.py", RUNNER_NAME}
    assert "NotImplementedError" in start["solution.py"]
    assert "return a + b" in task.workdir_files(solved=True)["solution.py"]
    assert task.hidden_check_files() == {
        "test_hidden.py": task.hidden_tests["test_hidden.py"],
        RUNNER_NAME: RUNNER_SOURCE,
    }
    assert task.check_command() == [
        "python3",
        "-I",
        RUNNER_NAME,
        "--timeout",
        "5",
        "test_hidden.py",
    ]
    assert task.visible_command()[-1] == "test_visible.py"
    assert "python3 -I _runner.py --timeout 5 test_visible.py" in task.instructions()
    assert "test_hidden" not in task.instructions()
    assert task.hidden_test_names() == [
        "test_hidden.py::test_small",
        "test_hidden.py::test_negative",
        "test_hidden.py::test_prints_fake_results",
        "test_hidden.py::test_exits",
        "test_hidden.py::test_hangs",
    ]
    no_reference = parse_task({**TINY, "solution": {}})
    with pytest.raises(TaskSuiteError, match="no reference solution"):
        no_reference.workdir_files(solved=True)


def test_runner_isolates_tests_and_times_out(tmp_path: Path) -> None:
    task = parse_task({**TINY, "test_timeout_s": 0.5})
    files = {**task.workdir_files(solved=True), **task.hidden_check_files()}
    run = run_in(tmp_path, files, task.check_command())
    result = run.result(task.hidden_test_names())
    outcome = {t.name.split("::")[1]: t for t in result.tests}
    assert [name for name, t in outcome.items() if t.passed] == [
        "test_small",
        "test_negative",
        "test_prints_fake_results",  # its print went nowhere near the report
    ]
    assert outcome["test_exits"].error.startswith("SystemExit")
    assert outcome["test_hangs"].error == "timed out"
    assert (result.passed, result.total, result.error) == (3, 5, None)
    assert result.score == 0.6 and result.reward == 0.0 and run.returncode == 1


def test_runner_counts_every_test_when_the_solution_does_not_import(tmp_path: Path) -> None:
    task = parse_task(TINY)
    files = {**task.workdir_files(), "solution.py": "def add(a, b)\n", **task.hidden_check_files()}
    run = run_in(tmp_path, files, task.check_command())
    result = run.result(task.hidden_test_names())
    assert (result.passed, result.total, result.error) == (0, 5, None)
    assert all(t.error.startswith("import failed: SyntaxError") for t in result.tests)
    assert run.returncode == 1


def test_runner_workdir_cannot_shadow_its_modules(tmp_path: Path) -> None:
    # a file named like a standard module in the workdir does not replace the runner's own
    task = parse_task(TINY)
    files = {
        **task.workdir_files(solved=True),
        "json.py": "raise RuntimeError('shadowed')\n",
        **task.hidden_check_files(),
    }
    run = run_in(tmp_path, files, [*task.check_command()[:5], "test_visible.py"])
    assert run.returncode == 0, run.stderr
    assert run.result(["test_visible.py::test_one"]).all_passed


def test_runner_usage_errors(tmp_path: Path) -> None:
    (tmp_path / RUNNER_NAME).write_text(RUNNER_SOURCE)
    done = subprocess.run(
        [sys.executable, "-I", RUNNER_NAME],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2 and "usage" in done.stderr
    (tmp_path / "test_none.py").write_text("x = 1\n")
    run = run_in(tmp_path, {}, ["python3", "-I", RUNNER_NAME, "test_none.py"])
    result = run.result()
    assert run.returncode == 1 and not result.all_passed
    assert result.tests[0].error == "no test_* function"


def test_directory_and_jsonl_suites(tmp_path: Path) -> None:
    other = BY_ID["rle-codec"].model_dump(mode="json")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "tiny-add.json").write_text(json.dumps(TINY))
    (folder / "rle-codec.json").write_text(json.dumps(other))
    (folder / "notes.txt").write_text("not a task")
    assert [t.task_id for t in load_suite(folder)] == ["rle-codec", "tiny-add"]
    assert load_suite(str(folder)) == load_suite(folder)

    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text(json.dumps(TINY) + "\n\n" + json.dumps(other) + "\n")
    assert [t.task_id for t in load_suite(jsonl)] == ["tiny-add", "rle-codec"]
    assert load_suite(jsonl)[1] == BY_ID["rle-codec"]
    # lines end at "\n" only: a raw U+2028 inside a string is text; CRLF files load too
    odd = {**TINY, "prompt": "Implement add\u2028in solution.py."}
    jsonl.write_bytes((json.dumps(odd, ensure_ascii=False) + "\r\n").encode())
    assert load_suite(jsonl)[0].prompt == odd["prompt"]


def bad(tmp_path: Path, **changes: Any) -> TaskSuiteError:
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(json.dumps({**TINY, **changes}) + "\n")
    with pytest.raises(TaskSuiteError) as caught:
        load_suite(jsonl)
    return caught.value


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"task_id": "Bad Id"}, "task_id"),
        ({"difficulty": "trivial"}, "difficulty"),
        ({"title": "x" * 121}, "title"),
        ({"prompt": "p" * (MAX_PROMPT_CHARS + 1)}, "prompt"),
        ({"files": {"../escape.py": "x = 1\n"}}, "files"),
        ({"files": {"/abs.py": "x = 1\n"}}, "files"),
        ({"files": {".hidden.py": "x = 1\n"}}, "files"),
        ({"files": {RUNNER_NAME: "x = 1\n"}}, "files"),
        ({"files": {"solution.py": "x" * (MAX_FILE_CHARS + 1)}}, "files.solution.py"),
        ({"hidden_tests": {"checks.py": "def test_a():\n    pass\n"}}, "hidden_tests"),
        ({"hidden_tests": {"test_h.py": "def helper():\n    pass\n"}}, "hidden_tests"),
        ({"hidden_tests": {"test_h.py": "def test_a(:\n"}}, "hidden_tests"),
        ({"hidden_tests": {}}, "hidden_tests"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_task_names_the_field(tmp_path: Path, changes: dict[str, Any], field: str) -> None:
    error = bad(tmp_path, **changes)
    assert error.field.startswith(field), (error.field, str(error))
    assert error.source.endswith("bad.jsonl:1")
    assert len(str(error)) < 1000


def test_paths_shared_between_roles_rejected(tmp_path: Path) -> None:
    clash = {"test_visible.py": TINY["visible_tests"]["test_visible.py"]}
    error = bad(tmp_path, hidden_tests=clash)
    assert "paths used twice" in str(error)


def test_suite_level_errors(tmp_path: Path) -> None:
    with pytest.raises(TaskSuiteError, match="no such suite"):
        load_suite("no-such-suite")
    jsonl = tmp_path / "dup.jsonl"
    jsonl.write_text(json.dumps(TINY) + "\n" + json.dumps(TINY) + "\n")
    with pytest.raises(TaskSuiteError, match="used twice"):
        load_suite(jsonl)
    jsonl.write_text(json.dumps(TINY) + "\n{not json\n")
    with pytest.raises(TaskSuiteError, match=r"dup\.jsonl:2: not JSON"):
        load_suite(jsonl)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TaskSuiteError, match="holds no task"):
        load_suite(empty)
    (empty / "other-name.json").write_text(json.dumps(TINY))
    with pytest.raises(TaskSuiteError, match="differs from the file name"):
        load_suite(empty)
    assert issubclass(TaskSuiteError, ValueError)


def test_json_schema_describes_the_format() -> None:
    schema = task_json_schema()
    assert schema["additionalProperties"] is False
    assert {"task_id", "difficulty", "prompt", "files", "hidden_tests"} <= set(schema["required"])
    assert set(schema["properties"]) == set(Task.model_fields)
    json.dumps(schema)


# --------------------------------------------------------------------------- check output

RUNNER_OUTPUT = "\n".join(
    [
        "warming up",
        '{"test": "test_hidden.py::test_a", "passed": true, "error": ""}',
        '{"test": "test_hidden.py::test_b", "passed": false, "error": "AssertionError (x)"}',
        '{"summary": {"passed": 1, "failed": 1, "total": 2, "seconds": 0.01}}',
    ]
)


def test_parse_runner_output() -> None:
    result = parse_check_output(RUNNER_OUTPUT)
    assert (result.passed, result.total, result.error) == (1, 2, None)
    assert result.tests[1].error == "AssertionError (x)"
    assert result.score == 0.5 and result.reward == 0.0 and not result.all_passed
    assert parse_check_output(RUNNER_OUTPUT.encode()) == result
    names = ["test_hidden.py::test_a", "test_hidden.py::test_b"]
    assert parse_check_output(RUNNER_OUTPUT, names) == result


def test_parse_all_passed() -> None:
    lines = [
        '{"test": "t::a", "passed": true, "error": ""}',
        '{"summary": {"passed": 1, "failed": 0, "total": 1}}',
    ]
    result = parse_check_output("\n".join(lines))
    assert result.all_passed and result.reward == 1.0 and result.score == 1.0


def test_parse_missing_and_unexpected_tests_count_against() -> None:
    result = parse_check_output(RUNNER_OUTPUT, ["test_hidden.py::test_a", "test_hidden.py::c"])
    assert (result.passed, result.total) == (1, 2)
    assert result.tests[1].error == "not reported"
    assert result.error is not None and "unexpected" in result.error
    assert result.reward == 0.0


def test_parse_cut_output_has_an_error_but_keeps_partial_credit() -> None:
    cut = RUNNER_OUTPUT.rsplit("\n", 1)[0]
    result = parse_check_output(cut)
    assert (result.passed, result.total) == (1, 2)
    assert result.error is not None and "no summary" in result.error
    assert result.reward == 0.0


def test_parse_forged_and_inconsistent_output() -> None:
    twice = RUNNER_OUTPUT + '\n{"test": "test_hidden.py::test_a", "passed": true}'
    result = parse_check_output(twice)
    assert result.error is not None and "twice" in result.error
    assert result.passed == 0  # a test reported twice counts as failed
    wrong_total = RUNNER_OUTPUT.replace('"total": 2', '"total": 5')
    assert "summary says 5" in (parse_check_output(wrong_total).error or "")
    no_tests = parse_check_output('{"summary": {"passed": 3, "failed": 0, "total": 3}}')
    assert no_tests.total == 0 and not no_tests.all_passed


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "Traceback (most recent call last):\n  boom",
        '[1, 2, 3]\n{}\n{"test": 1, "passed": "yes"}\n',
        '{"test": "t", "passed": true, "error": ' + '"x' * 10 + "\n",
        b"\xff\xfe\x00garbage",
        None,
        12345,
        "{" * 100_000,
        '{"summary": "done"}',
        '{"test": "' + "n" * 1_000 + '", "passed": false, "error": "' + "e" * 5_000 + '"}',
    ],
)
def test_parse_garbage_returns_an_error(garbage: Any) -> None:
    result = parse_check_output(garbage)
    assert isinstance(result, CheckResult)
    assert result.error and len(result.error) <= MAX_ERROR_CHARS
    assert result.reward == 0.0
    assert all(len(t.name) <= 200 and len(t.error) <= MAX_ERROR_CHARS for t in result.tests)


def test_parse_is_bounded() -> None:
    lines = [f'{{"test": "t{i}", "passed": true, "error": ""}}' for i in range(5000)]
    result = parse_check_output("\n".join(lines) * 100)
    assert len(result.tests) <= MAX_REPORTED_TESTS
    assert result.error and not result.all_passed


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=400), st.binary(max_size=400)))
def test_parse_never_raises(data: str | bytes) -> None:
    result = parse_check_output(data)
    assert 0 <= result.passed <= result.total
    assert result.error is None or len(result.error) <= MAX_ERROR_CHARS


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"test": st.text(max_size=20), "passed": st.booleans(), "error": st.text(max_size=20)}
        ),
        max_size=20,
    )
)
def test_parse_reads_what_the_runner_writes(records: list[dict[str, Any]]) -> None:
    unique = list({r["test"]: r for r in records}.values())
    lines = [json.dumps(r) for r in unique]
    passed = sum(r["passed"] for r in unique)
    summary = {"passed": passed, "failed": len(unique) - passed, "total": len(unique)}
    lines.append(json.dumps({"summary": summary}))
    result = parse_check_output("\n".join(lines))
    assert result.error is None
    assert (result.passed, result.total) == (passed, len(unique))
    assert [t.name for t in result.tests] == [r["test"] for r in unique]
