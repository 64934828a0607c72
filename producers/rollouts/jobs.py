"""Jobs of the rollout service: the spec a team submits, and the rollouts it expands to.

A job says which tasks to run, how many samples of each (the GRPO group), with which agent, in
which sandbox, scored by which evaluator, within which time per stage, with how many attempts::

    job_id: pycoding-smoke            # optional: derived from a hash of the spec
    tasks: {suite: pycoding, limit: 4}   # or {path: tasks.jsonl} or {inline: [task, ...]}
    samples_per_task: 2
    agent: {kind: tool, max_turns: 12, max_tokens: 512, temperature: 1.0}
                                      # or {kind: command, argv: [...]}
                                      # or {kind: python, function: "pkg.mod:fn", options: {}}
    sandbox: {kind: bwrap, network: false, limits: {memory: 1073741824, timeout: 60}}
    evaluator: {kind: suite}
    timeouts: {init: 60, run: 600, eval: 120}
    attempts: 2

Every value is bounded; an unknown key, kind or out-of-bounds value is a ``JobSpecError`` whose
``field`` is the path of the value (``agent.max_turns``, ``tasks.inline[0].prompt``,
``sandbox.limits.memory``). The sandbox part is checked by sandbox.py's own ``SandboxSpec`` and
``SandboxLimits``; tasks by tasks.py's ``Task``.

Ids are deterministic, so a stage message delivered twice never makes a second rollout:
``rollout_id(job, task, sample, attempt)`` is the job id and 20 hex digits of a SHA-256 of the
four (at most 61 characters of ``[A-Za-z0-9_-]``, starting and ending with a letter or digit:
valid for the proxy's rollout ids, as a Kubernetes label value and as a file name), and
``group_id(job, task)`` groups every sample and attempt of one task. A retry is a new attempt
with a rollout id of its own (``next_attempt``).

Pure: nothing here does I/O but reading the job file (``load_job``) and the task files its
``tasks`` names (``resolve_tasks``, through tasks.py).

Errors::

    ProducerError                  (rollstream.producers.errors)
    └── JobSpecError               a job spec that cannot be used (ValueError); .field, .source
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StringConstraints,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from rollstream.producers.errors import JobSpecError, SandboxSpecError, TaskSuiteError
from rollstream.producers.rollouts.sandbox import SandboxLabels, SandboxLimits, SandboxSpec
from rollstream.producers.rollouts.tasks import Task, load_suite

__all__ = [
    "AGENT_KINDS",
    "EVALUATOR_KINDS",
    "ROLLOUT_ID_PATTERN",
    "AgentSpec",
    "CommandAgentSpec",
    "CommandEvaluatorSpec",
    "EvaluatorSpec",
    "JobSpec",
    "JobSpecError",
    "PythonAgentSpec",
    "PythonEvaluatorSpec",
    "RolloutPlan",
    "SandboxConfig",
    "StageTimeouts",
    "SuiteEvaluatorSpec",
    "TaskSource",
    "ToolAgentSpec",
    "expand",
    "group_id",
    "job_json_schema",
    "load_job",
    "next_attempt",
    "parse_job",
    "resolve_tasks",
    "rollout_id",
]

MAX_SPEC_BYTES: Final = 8 * 1024 * 1024  # a job file (inline tasks included)
MAX_INLINE_TASKS: Final = 64
MAX_SAMPLES: Final = 64
MAX_ATTEMPTS: Final = 5
MAX_ARGV: Final = 256
MAX_ARG_CHARS: Final = 4096
MAX_ENV: Final = 64
MAX_OPTIONS: Final = 32  # keyword arguments of a python agent

ROLLOUT_ID_PATTERN: Final = r"^[A-Za-z0-9_\-]{1,128}$"  # the proxy's (rollout_api.ROLLOUT_ID)
_JOB_ID = r"^[A-Za-z0-9](?:[A-Za-z0-9_-]{0,38}[A-Za-z0-9])?$"  # <= 40 chars, label-valid
_DIGEST_HEX = 20

AGENT_KINDS: Final = ("tool", "command", "python")
EVALUATOR_KINDS: Final = ("suite", "command", "python")

# --------------------------------------------------------------------------- bounded values

JobId = Annotated[str, StringConstraints(pattern=_JOB_ID)]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
EnvValue = Annotated[str, StringConstraints(max_length=MAX_ARG_CHARS, pattern=r"^[^\x00]*$")]
Arg = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_ARG_CHARS, pattern=r"^[^\x00]*$")
]
Argv = Annotated[list[Arg], Field(min_length=1, max_length=MAX_ARGV)]
TaskId = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")]
_FUNCTION = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$"
Function = Annotated[str, StringConstraints(max_length=256, pattern=_FUNCTION)]
OptionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]


def _option_value(value: Any) -> bool | int | float | str:
    """A python agent's option: a boolean, an integer within +-2**53, a finite number or a
    string (at most MAX_ARG_CHARS characters, no NUL)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if abs(value) > 2**53:
            raise ValueError("an integer option must be within +-2**53")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("a number option must be finite")
        return value
    if isinstance(value, str):
        if len(value) > MAX_ARG_CHARS or "\x00" in value:
            raise ValueError(f"a string option has at most {MAX_ARG_CHARS} characters, no NUL")
        return value
    raise ValueError(f"an option is a string, a number or a boolean, not {type(value).__name__}")


OptionValue = Annotated[
    bool | int | float | str,
    PlainValidator(_option_value),
    WithJsonSchema({"type": ["boolean", "integer", "number", "string"]}),
]


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --------------------------------------------------------------------------- tasks


class TaskSource(_Spec):
    """Where the tasks come from: exactly one of ``suite`` (a built-in suite by name), ``path``
    (a JSONL file or a directory of task files; relative to the job file) or ``inline`` (the
    tasks themselves, for small jobs). ``ids`` picks tasks by id, in that order; ``limit``
    keeps the first N (after ``ids``)."""

    suite: Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")] | None = None
    path: Annotated[str, StringConstraints(min_length=1, max_length=4096)] | None = None
    inline: Annotated[list[Task], Field(min_length=1, max_length=MAX_INLINE_TASKS)] | None = None
    ids: Annotated[list[TaskId], Field(min_length=1, max_length=10_000)] | None = None
    limit: Annotated[int, Field(ge=1, le=100_000)] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> TaskSource:
        given = [name for name in ("suite", "path", "inline") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of suite, path, inline (got {given or 'none'})")
        if self.ids is not None and len(set(self.ids)) != len(self.ids):
            raise ValueError("ids: a task id is named twice")
        return self


# --------------------------------------------------------------------------- agents

DEFAULT_SYSTEM_PROMPT: Final = (
    "You are a software engineer working in a sandboxed Linux shell. Use the tools to read "
    "and change files in your working directory and to run commands (run the tests). When "
    "the task is done, call submit."
)


class ToolAgentSpec(_Spec):
    """The built-in OpenAI-tools loop (agents.ToolAgent): bash, read_file, write_file, submit."""

    kind: Literal["tool"]
    model: Name = "policy"  # the model name sent to the proxy
    max_turns: Annotated[int, Field(ge=1, le=200)] = 20
    max_tokens: Annotated[int, Field(ge=1, le=32_768)] = 1024
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    tool_timeout_s: Annotated[float, Field(ge=0.1, le=3600)] = 60.0  # one tool's exec
    max_tool_output: Annotated[int, Field(ge=256, le=262_144)] = 16_384  # chars to the model
    system_prompt: Annotated[str, StringConstraints(min_length=1, max_length=8_000)] = (
        DEFAULT_SYSTEM_PROMPT
    )


class CommandAgentSpec(_Spec):
    """Any harness as a command (agents.CommandAgent), run beside the sandbox with the rollout's
    OpenAI base URL and token in its environment. ``env``: names of the worker's variables the
    harness may see (an allow-list); ``set_env``: fixed values. ``{instructions}``,
    ``{instructions_file}``, ``{workdir}``, ``{model}``, ``{base_url}`` in ``argv`` are
    replaced."""

    kind: Literal["command"]
    argv: Argv
    env: Annotated[list[EnvName], Field(max_length=MAX_ENV)] = Field(
        default_factory=lambda: ["PATH", "LANG", "LC_ALL", "TZ"]
    )
    set_env: Annotated[dict[EnvName, EnvValue], Field(max_length=MAX_ENV)] = Field(
        default_factory=dict
    )
    model: Name = "policy"
    max_output: Annotated[int, Field(ge=0, le=16 * 1024 * 1024)] = 1024 * 1024  # per stream


class PythonAgentSpec(_Spec):
    """A Python callable ``module:function`` run in the worker's RUN stage (agents.PythonAgent):
    called as ``function(ctx, **options)`` with the rollout's ``AgentContext``, it returns an
    ``AgentOutcome``. It makes its model calls through ``ctx.endpoint`` (the rollout's base URL
    and token) and works in ``ctx.sandbox``. Trusted code, like a command agent's harness.
    ``options``: keyword arguments (JSON scalars), checked against its signature when the
    agent is built."""

    kind: Literal["python"]
    function: Function
    options: Annotated[dict[OptionName, OptionValue], Field(max_length=MAX_OPTIONS)] = Field(
        default_factory=dict
    )


AgentSpec = Annotated[
    ToolAgentSpec | CommandAgentSpec | PythonAgentSpec, Field(discriminator="kind")
]


# --------------------------------------------------------------------------- sandbox


class SandboxConfig(_Spec):
    """The sandbox of each rollout; checked by sandbox.py's SandboxSpec (limits: SandboxLimits,
    bytes and seconds). ``network`` stays off unless the job needs it (the built-in agents run
    their model calls outside the sandbox)."""

    kind: Literal["bwrap", "docker", "local"] = "bwrap"
    image: Annotated[str, StringConstraints(min_length=1, max_length=4096)] | None = None
    network: StrictBool = False
    # values checked by SandboxLimits (numbers; bytes as integers), named in its errors
    limits: Annotated[dict[str, Any], Field(max_length=16)] = Field(default_factory=dict)
    env: Annotated[dict[EnvName, EnvValue], Field(max_length=MAX_ENV)] = Field(default_factory=dict)
    workdir: Annotated[str, StringConstraints(min_length=2, max_length=255)] = "/work"

    @model_validator(mode="after")
    def _valid_spec(self) -> SandboxConfig:
        self.to_spec()  # SandboxSpecError (a ValueError) names the field
        return self

    def sandbox_limits(self) -> SandboxLimits:
        # a whole number written as a float (YAML's 1.0e9) is an integer for the byte limits
        return SandboxLimits.from_dict(
            {
                k: int(v) if isinstance(v, float) and v.is_integer() else v
                for k, v in self.limits.items()
            }
        )

    def to_spec(
        self,
        labels: SandboxLabels | None = None,
        files: Mapping[str, bytes | Path] | None = None,
    ) -> SandboxSpec:
        """The SandboxSpec of one rollout's sandbox."""
        return SandboxSpec(
            kind=self.kind,
            image=self.image,
            files=dict(files or {}),
            network=self.network,
            limits=self.sandbox_limits(),
            labels=labels or SandboxLabels(),
            env=dict(self.env),
            workdir=self.workdir,
        )


# --------------------------------------------------------------------------- evaluators


class SuiteEvaluatorSpec(_Spec):
    """The task's own hidden tests (evaluators.SuiteEvaluator): final reward 1.0 when all pass,
    a milestone per passed test."""

    kind: Literal["suite"]
    python: Arg = "python3"  # the interpreter in the sandbox
    max_output: Annotated[int, Field(ge=256, le=1_000_000)] = 16_384  # chars kept


class CommandEvaluatorSpec(_Spec):
    """A command run in the sandbox after RUN (evaluators.CommandEvaluator): exit 0 scores 1.0,
    another exit 0.0, unless its last line of output is a number (then that number)."""

    kind: Literal["command"]
    argv: Argv
    env: Annotated[dict[EnvName, EnvValue], Field(max_length=MAX_ENV)] = Field(default_factory=dict)
    max_output: Annotated[int, Field(ge=256, le=1_000_000)] = 16_384


class PythonEvaluatorSpec(_Spec):
    """A Python callable ``module:function`` taking (task, sandbox) and returning a score."""

    kind: Literal["python"]
    function: Function


EvaluatorSpec = Annotated[
    SuiteEvaluatorSpec | CommandEvaluatorSpec | PythonEvaluatorSpec, Field(discriminator="kind")
]


# --------------------------------------------------------------------------- the job


class StageTimeouts(_Spec):
    """Wall time of each stage of one rollout, in seconds."""

    init: Annotated[float, Field(ge=1, le=3600)] = 300.0
    run: Annotated[float, Field(ge=1, le=86_400)] = 1800.0
    eval: Annotated[float, Field(ge=1, le=3600)] = 300.0


class JobSpec(_Spec):
    """One job (module docstring). ``job_id`` defaults to ``job-`` and 16 hex digits of a hash
    of the rest of the spec, so the same spec submitted twice is the same job."""

    job_id: JobId | None = None
    tasks: TaskSource
    samples_per_task: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = 1
    agent: AgentSpec
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    evaluator: EvaluatorSpec = Field(default_factory=lambda: SuiteEvaluatorSpec(kind="suite"))
    timeouts: StageTimeouts = Field(default_factory=StageTimeouts)
    attempts: Annotated[int, Field(ge=1, le=MAX_ATTEMPTS)] = 1
    run_id: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._:/@+-]{0,128}$")] = ""
    policy: Name | None = None

    @model_validator(mode="after")
    def _derive_id(self) -> JobSpec:
        if self.job_id is None:
            body = self.model_dump(mode="json", exclude={"job_id"})
            digest = _digest(json.dumps(body, sort_keys=True, separators=(",", ":")))
            object.__setattr__(self, "job_id", f"job-{digest[:16]}")  # frozen: set once, here
        return self

    @property
    def id(self) -> str:
        assert self.job_id is not None  # set by the validator
        return self.job_id


def job_json_schema() -> dict[str, Any]:
    """The JSON Schema of a job spec."""
    return JobSpec.model_json_schema()


# --------------------------------------------------------------------------- parsing


def parse_job(data: Any, *, source: str = "") -> JobSpec:
    """A job from decoded YAML or JSON; a bad value raises JobSpecError naming its path."""
    if not isinstance(data, Mapping):
        raise JobSpecError(f"a job is a mapping, not {type(data).__name__}", source=source)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        field, message = _describe(errors[0])
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise JobSpecError(message + more, field=field, source=source) from exc


def load_job(path: str | Path) -> JobSpec:
    """Read a job file: JSON when it ends in ``.json``, YAML otherwise (YAML aliases are
    refused: a small file must not expand to a huge spec). A relative ``tasks.path`` is taken
    relative to the job file."""
    path = Path(path)
    source = str(path)
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise JobSpecError(f"cannot read: {exc}", source=source) from exc
    if len(raw) > MAX_SPEC_BYTES:
        raise JobSpecError(f"larger than {MAX_SPEC_BYTES} bytes", source=source)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JobSpecError(f"not UTF-8: {exc}", source=source) from exc
    data = _load_json(text, source) if path.suffix == ".json" else _load_yaml(text, source)
    if isinstance(data, dict) and isinstance(data.get("tasks"), dict):
        rel = data["tasks"].get("path")
        if isinstance(rel, str) and rel and not Path(rel).is_absolute():
            data["tasks"] = {**data["tasks"], "path": str(path.parent.absolute() / rel)}
    return parse_job(data, source=source)


def _load_json(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise JobSpecError(f"not JSON: {exc}", source=source) from exc


def _load_yaml(text: str, source: str) -> Any:
    import yaml  # the rollouts extra's; imported when a YAML job is read

    class NoAliasLoader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(None, None, "aliases are not allowed", mark)
            return super().compose_node(parent, index)

    try:
        return yaml.load(text, Loader=NoAliasLoader)  # a SafeLoader
    except yaml.YAMLError as exc:
        raise JobSpecError(f"not YAML: {' '.join(str(exc).split())}", source=source) from exc


_UNION_FIELDS: Final = {"agent": AGENT_KINDS, "evaluator": EVALUATOR_KINDS}


def _describe(error: Mapping[str, Any]) -> tuple[str, str]:
    """(path, message) of one pydantic error: ``agent.max_turns``, ``tasks.inline[0].prompt``;
    the discriminator tag pydantic puts in the path is dropped, errors raised by sandbox.py
    and tasks.py add their own field to it."""
    loc = [part for part in error.get("loc", ()) if part != "[key]"]  # a bad key: its path
    if len(loc) >= 2 and loc[0] in _UNION_FIELDS and loc[1] in _UNION_FIELDS[loc[0]]:
        del loc[1]
    kind, message = error.get("type", ""), str(error.get("msg", ""))
    ctx = error.get("ctx") or {}
    if kind in ("union_tag_invalid", "union_tag_not_found") and loc:
        known = ", ".join(_UNION_FIELDS.get(str(loc[0]), ()))
        tag = ctx.get("tag")
        message = f"unknown kind {tag!r} (known: {known})" if tag else f"required ({known})"
        loc.append("kind")
    elif kind == "extra_forbidden":
        message = "unknown field"
    inner = ctx.get("error")
    if isinstance(inner, SandboxSpecError) and inner.field:
        loc.extend(inner.field.split("."))
        message = str(inner).removeprefix(f"{inner.field}: ")
    elif message.startswith("Value error, "):
        message = message.removeprefix("Value error, ")
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path[:300], message[:500]


# --------------------------------------------------------------------------- tasks of a job


def resolve_tasks(job: JobSpec) -> list[Task]:
    """The tasks of a job, in order (``ids`` and ``limit`` applied)."""
    source = job.tasks
    if source.inline is not None:
        tasks, where = list(source.inline), "tasks.inline"
    else:
        name, where = (source.suite, "tasks.suite") if source.suite else (source.path, "tasks.path")
        assert name is not None  # exactly one is set (TaskSource)
        try:
            tasks = load_suite(name)
        except TaskSuiteError as exc:
            raise JobSpecError(str(exc), field=where) from exc
    seen: set[str] = set()
    for task in tasks:
        if task.task_id in seen:
            raise JobSpecError(f"task id {task.task_id!r} is used twice", field=where)
        seen.add(task.task_id)
    if source.ids is not None:
        by_id = {task.task_id: task for task in tasks}
        for i, task_id in enumerate(source.ids):
            if task_id not in by_id:
                raise JobSpecError(f"no task {task_id!r} in {where}", field=f"tasks.ids[{i}]")
        tasks = [by_id[task_id] for task_id in source.ids]
    if source.limit is not None:
        tasks = tasks[: source.limit]
    return tasks


# --------------------------------------------------------------------------- ids and plans


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def rollout_id(job_id: str, task_id: str, sample_index: int, attempt: int) -> str:
    """The rollout of (job, task, sample, attempt): ``<job_id>-<20 hex digits>``; the same
    four always give the same id, any other four another."""
    key = json.dumps(["rollout", job_id, task_id, sample_index, attempt])
    return f"{job_id}-{_digest(key)[:_DIGEST_HEX]}"


def group_id(job_id: str, task_id: str) -> str:
    """The GRPO group of one task in one job (every sample and attempt of it)."""
    return f"{job_id}-{_digest(json.dumps(['group', job_id, task_id]))[:16]}"


_ROLLOUT_ID_RE = re.compile(ROLLOUT_ID_PATTERN)


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """One rollout to run: which job, task, sample and attempt, and its ids."""

    job_id: str
    task_id: str
    sample_index: int
    attempt: int
    rollout_id: str
    group_id: str
    group_size: int

    @classmethod
    def of(
        cls, job_id: str, task_id: str, sample_index: int, attempt: int, group_size: int
    ) -> RolloutPlan:
        rid = rollout_id(job_id, task_id, sample_index, attempt)
        assert _ROLLOUT_ID_RE.match(rid) and len(rid) <= 63
        return cls(
            job_id=job_id,
            task_id=task_id,
            sample_index=sample_index,
            attempt=attempt,
            rollout_id=rid,
            group_id=group_id(job_id, task_id),
            group_size=group_size,
        )


def expand(job: JobSpec, tasks: Iterable[Task] | Sequence[Task]) -> list[RolloutPlan]:
    """One plan per task x sample (task-major), attempt 0."""
    plans = []
    seen: set[str] = set()
    for task in tasks:
        if task.task_id in seen:
            raise JobSpecError(f"task id {task.task_id!r} is used twice", field="tasks")
        seen.add(task.task_id)
        for sample in range(job.samples_per_task):
            plans.append(RolloutPlan.of(job.id, task.task_id, sample, 0, job.samples_per_task))
    return plans


def next_attempt(plan: RolloutPlan, job: JobSpec) -> RolloutPlan | None:
    """The retry of a failed rollout (a new attempt, a new rollout id, the same group), or None
    when the job's attempts are used up."""
    if plan.attempt + 1 >= job.attempts:
        return None
    return RolloutPlan.of(
        plan.job_id, plan.task_id, plan.sample_index, plan.attempt + 1, plan.group_size
    )
