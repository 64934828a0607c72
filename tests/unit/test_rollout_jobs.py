"""Job specs and rollout plans (pure): a spec is bounded everywhere and a bad value is named by
its path; the example job loads; ids are deterministic, distinct per attempt and valid for the
proxy, a sandbox label and a file name."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollstream.producers.rollouts.jobs import (
    ROLLOUT_ID_PATTERN,
    CommandAgentSpec,
    JobSpec,
    JobSpecError,
    PythonAgentSpec,
    ToolAgentSpec,
    expand,
    group_id,
    load_job,
    next_attempt,
    parse_job,
    resolve_tasks,
    rollout_id,
)
from rollstream.producers.rollouts.sandbox import SANDBOX_KINDS, SandboxLabels
from rollstream.producers.rollouts.tasks import load_suite

REPO = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = {"tasks": {"suite": "pycoding", "limit": 3}, "agent": {"kind": "tool"}}
PROXY_ROLLOUT_ID = re.compile(ROLLOUT_ID_PATTERN)
LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


def job(**changes: Any) -> JobSpec:
    return parse_job({**BASE, **changes})


def test_defaults_and_a_derived_job_id() -> None:
    spec = job()
    assert isinstance(spec.agent, ToolAgentSpec) and spec.agent.max_turns == 20
    assert spec.evaluator.kind == "suite" and spec.sandbox.kind == "bwrap"
    assert spec.sandbox.network is False and spec.attempts == 1 and spec.samples_per_task == 1
    assert re.fullmatch(r"job-[0-9a-f]{16}", spec.id)
    assert job().id == spec.id  # the same spec is the same job
    assert job(samples_per_task=2).id != spec.id
    assert job(job_id="mine").id == "mine"


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"agent": {"kind": "tool", "max_turns": 0}}, "agent.max_turns", "greater than"),
        ({"agent": {"kind": "tool", "max_turns": 201}}, "agent.max_turns", "less than"),
        ({"agent": {"kind": "tool", "temperature": 3}}, "agent.temperature", "less than"),
        ({"agent": {"kind": "tool", "max_turn": 3}}, "agent.max_turn", "unknown field"),
        ({"agent": {"kind": "robot"}}, "agent.kind", "unknown kind 'robot'"),
        ({"agent": {}}, "agent.kind", "required"),
        ({"agent": {"kind": "command", "argv": []}}, "agent.argv", "at least 1"),
        ({"agent": {"kind": "command", "argv": ["a\0b"]}}, "agent.argv[0]", "pattern"),
        ({"agent": {"kind": "command", "argv": ["x"], "env": ["1BAD"]}}, "agent.env[0]", ""),
        ({"sandbox": {"kind": "k8s"}}, "sandbox.kind", "'bwrap', 'docker' or 'local'"),
        ({"sandbox": {"kind": "nspawn"}}, "sandbox.kind", ""),
        ({"sandbox": {"limits": {"memory": 10}}}, "sandbox.limits.memory", "between"),
        ({"sandbox": {"limits": {"memory": 1073741824.5}}}, "sandbox.limits.memory", "integer"),
        ({"sandbox": {"limits": {"cpu": "two"}}}, "sandbox.limits.cpu", "number"),
        ({"sandbox": {"limits": {"memry": 1 << 30}}}, "sandbox.limits.memry", "unknown"),
        ({"sandbox": {"workdir": "/etc"}}, "sandbox.workdir", "outside system dirs"),
        ({"sandbox": {"network": "yes"}}, "sandbox.network", "boolean"),
        ({"sandbox": {"env": {"1A": "x"}}}, "sandbox.env.1A", "pattern"),
        ({"evaluator": {"kind": "magic"}}, "evaluator.kind", "unknown kind"),
        ({"evaluator": {"kind": "python", "function": "no_colon"}}, "evaluator.function", ""),
        ({"evaluator": {"kind": "command"}}, "evaluator.argv", "required"),
        ({"tasks": {"suite": "pycoding", "path": "x"}}, "tasks", "exactly one"),
        ({"tasks": {}}, "tasks", "exactly one"),
        ({"tasks": {"inline": [{"task_id": "a"}]}}, "tasks.inline[0].title", "required"),
        ({"tasks": {"suite": "pycoding", "ids": ["a", "a"]}}, "tasks", "twice"),
        ({"samples_per_task": 65}, "samples_per_task", "less than"),
        ({"samples_per_task": 0}, "samples_per_task", "greater than"),
        ({"attempts": 6}, "attempts", "less than"),
        ({"timeouts": {"run": 0}}, "timeouts.run", "greater than"),
        ({"timeouts": {"eval": 1e9}}, "timeouts.eval", "less than"),
        ({"job_id": "-bad-"}, "job_id", "pattern"),
        ({"job_id": "x" * 41}, "job_id", "pattern"),
        ({"run_id": "a b"}, "run_id", "pattern"),
        ({"colour": "blue"}, "colour", "unknown field"),
    ],
)
def test_a_bad_value_is_named_by_its_path(changes: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(JobSpecError) as info:
        job(**changes)
    assert info.value.field == field, str(info.value)
    assert words in info.value.message
    assert str(info.value).startswith(f"{field}: ")


def test_not_a_mapping() -> None:
    with pytest.raises(JobSpecError, match="a job is a mapping"):
        parse_job(["tasks"])


def test_the_sandbox_part_makes_a_sandbox_spec() -> None:
    spec = job(
        sandbox={
            "kind": "local",
            "limits": {"memory": 1 << 29, "timeout": 30.0, "cpu": 2},
            "env": {"A": "b"},
        }
    )
    labels = SandboxLabels(job_id="j", rollout_id="r", stage="init")
    made = spec.sandbox.to_spec(labels, {"main.py": b"print(1)\n"})
    assert (made.kind, made.limits.memory, made.limits.timeout, made.limits.cpu) == (
        "local",
        1 << 29,
        30.0,
        2,
    )
    assert made.labels == labels and dict(made.env) == {"A": "b"} and not made.network
    assert set(
        JobSpec.model_json_schema()["$defs"]["SandboxConfig"]["properties"]["kind"]["enum"]
    ) <= set(SANDBOX_KINDS)


def test_command_agent_defaults() -> None:
    spec = job(agent={"kind": "command", "argv": ["harness", "--task", "{instructions_file}"]})
    assert isinstance(spec.agent, CommandAgentSpec)
    assert "PATH" in spec.agent.env and spec.agent.set_env == {}


# --------------------------------------------------------------------------- files


def test_load_the_example_job() -> None:
    spec = load_job(REPO / "examples" / "job.yaml")
    tasks = resolve_tasks(spec)
    assert len(tasks) == 4 and spec.samples_per_task == 2
    assert (spec.agent.kind, spec.sandbox.kind, spec.evaluator.kind) == ("tool", "bwrap", "suite")
    assert len(expand(spec, tasks)) == 8


def test_load_yaml_json_and_relative_task_paths(tmp_path: Path) -> None:
    suite = load_suite("pycoding")[:2]
    (tmp_path / "data").mkdir()
    lines = [json.dumps(t.model_dump(mode="json")) for t in suite]
    (tmp_path / "data" / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "job.yaml").write_text(
        "tasks: {path: data/tasks.jsonl}\nagent:\n  kind: tool\n  max_turns: 3\n"
    )
    spec = load_job(tmp_path / "job.yaml")
    assert [t.task_id for t in resolve_tasks(spec)] == [t.task_id for t in suite]
    assert spec.tasks.path == str(tmp_path / "data" / "tasks.jsonl")
    (tmp_path / "job.json").write_text(json.dumps({**BASE, "samples_per_task": 4}))
    assert load_job(tmp_path / "job.json").samples_per_task == 4


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("bad.yaml", "tasks: [unclosed\n", "not YAML"),
        ("bad.json", "{", "not JSON"),
        ("list.yaml", "- 1\n- 2\n", "a job is a mapping"),
        ("alias.yaml", "a: &x [1, 2]\nb: *x\n", "aliases are not allowed"),
        (
            "field.yaml",
            "tasks: {suite: pycoding}\nagent: {kind: tool, max_tokens: -1}\n",
            "agent.max_tokens",
        ),
    ],
)
def test_load_errors_name_the_file(tmp_path: Path, name: str, text: str, words: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(JobSpecError) as info:
        load_job(tmp_path / name)
    assert info.value.source == str(tmp_path / name) and words in str(info.value)


def test_missing_file_and_missing_tasks(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match="cannot read"):
        load_job(tmp_path / "nope.yaml")
    spec = job(tasks={"path": str(tmp_path / "none.jsonl")})
    with pytest.raises(JobSpecError) as info:
        resolve_tasks(spec)
    assert info.value.field == "tasks.path"


def test_ids_and_limit_select_tasks() -> None:
    spec = job(
        tasks={"suite": "pycoding", "ids": ["lru-cache", "dijkstra", "rle-codec"], "limit": 2}
    )
    assert [t.task_id for t in resolve_tasks(spec)] == ["lru-cache", "dijkstra"]
    with pytest.raises(JobSpecError) as info:
        resolve_tasks(job(tasks={"suite": "pycoding", "ids": ["lru-cache", "nope"]}))
    assert info.value.field == "tasks.ids[1]"


def test_inline_tasks() -> None:
    task = load_suite("pycoding")[0].model_dump(mode="json")
    spec = job(tasks={"inline": [task]})
    assert [t.task_id for t in resolve_tasks(spec)] == [task["task_id"]]


# --------------------------------------------------------------------------- ids and plans


def test_expand_is_deterministic_and_ids_are_valid() -> None:
    spec = job(samples_per_task=3)
    tasks = resolve_tasks(spec)
    plans = expand(spec, tasks)
    assert len(plans) == 9 and plans == expand(spec, tasks)
    assert [(p.task_id, p.sample_index) for p in plans[:4]] == [
        (tasks[0].task_id, 0),
        (tasks[0].task_id, 1),
        (tasks[0].task_id, 2),
        (tasks[1].task_id, 0),
    ]
    assert len({p.rollout_id for p in plans}) == 9
    assert len({p.group_id for p in plans}) == 3
    for p in plans:
        assert p.attempt == 0 and p.group_size == 3 and p.job_id == spec.id
        assert p.rollout_id == rollout_id(spec.id, p.task_id, p.sample_index, 0)
        assert p.group_id == group_id(spec.id, p.task_id)
        assert PROXY_ROLLOUT_ID.match(p.rollout_id) and len(p.rollout_id) <= 64
        assert LABEL.fullmatch(p.rollout_id)  # a sandbox label value too
        SandboxLabels(job_id=p.job_id, rollout_id=p.rollout_id)


def test_a_task_twice_is_refused() -> None:
    spec = job()
    task = resolve_tasks(spec)[0]
    with pytest.raises(JobSpecError, match="used twice"):
        expand(spec, [task, task])


def test_retries_are_new_attempts_with_new_ids_in_the_same_group() -> None:
    spec = job(attempts=3)
    first = expand(spec, resolve_tasks(spec))[0]
    second = next_attempt(first, spec)
    assert second is not None
    third = next_attempt(second, spec)
    assert third is not None and next_attempt(third, spec) is None
    assert [first.attempt, second.attempt, third.attempt] == [0, 1, 2]
    assert len({first.rollout_id, second.rollout_id, third.rollout_id}) == 3
    assert first.group_id == second.group_id == third.group_id
    assert (second.task_id, second.sample_index) == (first.task_id, first.sample_index)
    assert next_attempt(first, job()) is None  # one attempt: no retry


job_ids = st.from_regex(r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,38}[A-Za-z0-9])?", fullmatch=True)
task_ids = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,63}", fullmatch=True)


@given(job_ids, task_ids, st.integers(0, 63), st.integers(0, 4))
def test_rollout_ids_are_stable_valid_and_differ_per_attempt(
    job_id: str, task_id: str, sample: int, attempt: int
) -> None:
    rid = rollout_id(job_id, task_id, sample, attempt)
    assert rid == rollout_id(job_id, task_id, sample, attempt)
    assert PROXY_ROLLOUT_ID.match(rid) and len(rid) <= 63 and LABEL.fullmatch(rid)
    assert rid != rollout_id(job_id, task_id, sample, attempt + 1)
    assert rid != rollout_id(job_id, task_id, sample + 1, attempt)
    assert rid != rollout_id(job_id, task_id + "x", sample, attempt)
    assert group_id(job_id, task_id) == group_id(job_id, task_id)
    assert PROXY_ROLLOUT_ID.match(group_id(job_id, task_id))


def test_a_python_agent_takes_a_function_and_bounded_options() -> None:
    options = {"turns": 2, "name": "x", "greedy": True, "temperature": 0.5}
    spec = job(agent={"kind": "python", "function": "pkg.mod:run", "options": options})
    assert isinstance(spec.agent, PythonAgentSpec)
    assert spec.agent.function == "pkg.mod:run" and spec.agent.options == options
    assert parse_job(spec.model_dump(mode="json")) == spec  # a stage message's round trip
    assert job(agent={"kind": "python", "function": "m:f"}).agent == PythonAgentSpec(
        kind="python", function="m:f"
    )


@pytest.mark.parametrize(
    ("agent", "field", "words"),
    [
        ({"kind": "python"}, "agent.function", "required"),
        ({"kind": "python", "function": "no_colon"}, "agent.function", "pattern"),
        ({"kind": "python", "function": "m:f" + "x" * 300}, "agent.function", "at most 256"),
        ({"kind": "python", "function": "m:f", "argv": ["x"]}, "agent.argv", "unknown field"),
        ({"kind": "python", "function": "m:f", "options": {"1x": 1}}, "agent.options.1x", ""),
        ({"kind": "python", "function": "m:f", "options": {"x": [1]}}, "agent.options.x", "list"),
        (
            {"kind": "python", "function": "m:f", "options": {"x": float("nan")}},
            "agent.options.x",
            "finite",
        ),
        (
            {"kind": "python", "function": "m:f", "options": {"x": 2**60}},
            "agent.options.x",
            "2**53",
        ),
        ({"kind": "python", "function": "m:f", "options": {"x": "a\0"}}, "agent.options.x", "NUL"),
        (
            {"kind": "python", "function": "m:f", "options": {f"k{i}": i for i in range(33)}},
            "agent.options",
            "at most 32",
        ),
    ],
)
def test_a_bad_python_agent_is_named_by_its_path(
    agent: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(JobSpecError) as info:
        job(agent=agent)
    assert info.value.field == field, str(info.value)
    assert words in info.value.message
