"""Typed records that mirror the .avsc files in schemas/avro (the source of truth).

Token IDs and logprobs are numpy arrays in Python and packed little-endian bytes on the wire
(uint32 ids, float32 logprobs, uint8 masks, int32 parent indices, int64 versions), so decoding
them is one ``np.frombuffer`` call, never a per-element loop. Arrays decoded from the wire are
read-only views of the record's bytes; copy them before writing into them.

Each class knows how to turn itself into the dict fastavro writes (``to_avro``) and back
(``from_avro``), and into plain JSON-able data (``to_json``; token arrays become lists).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias

import numpy as np
import numpy.typing as npt

__all__ = [
    "BODY_TYPES",
    "F32",
    "I32",
    "I64",
    "LIFECYCLE_TYPES",
    "METADATA_MAX_CHARS",
    "METADATA_MAX_KEYS",
    "POLICY_VERSION_MAX",
    "REWARD_BOUND",
    "SAFE_INT_MAX",
    "SAMPLING_MAX_KEYS",
    "TOKEN_ID_MAX",
    "U8",
    "U32",
    "Body",
    "Branch",
    "BranchKind",
    "EvaluatorOutput",
    "Event",
    "Lifecycle",
    "LlmCall",
    "PolicyVersion",
    "Record",
    "Reward",
    "RewardKind",
    "RewardRecord",
    "RolloutError",
    "RolloutFinished",
    "RolloutStarted",
    "RolloutStatus",
    "Sample",
    "SampleMode",
    "SandboxEvent",
    "SandboxPhase",
    "StageEvent",
    "StageName",
    "StagePhase",
    "ToolCall",
    "Trajectory",
    "TrajectoryNode",
    "Usage",
    "as_array",
    "metadata_problem",
    "policy_version_problem",
    "reward_problem",
    "token_ids_problem",
]

U32 = np.dtype("<u4")
F32 = np.dtype("<f4")
U8 = np.dtype("u1")
I32 = np.dtype("<i4")
I64 = np.dtype("<i8")

Array: TypeAlias = npt.NDArray[Any]


class RewardKind(enum.StrEnum):
    FINAL = "final"
    PARTIAL = "partial"
    MILESTONE = "milestone"
    PENALTY = "penalty"


class BranchKind(enum.StrEnum):
    RETRY = "retry"
    REWIND = "rewind"
    FORK = "fork"
    SUBAGENT = "subagent"
    SUMMARIZE = "summarize"


class RolloutStatus(enum.StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    ABORTED = "aborted"
    TRUNCATED = "truncated"


class StageName(enum.StrEnum):
    INIT = "init"
    RUN = "run"
    EVAL = "eval"


class StagePhase(enum.StrEnum):
    STARTED = "started"
    FINISHED = "finished"


class SandboxPhase(enum.StrEnum):
    READY = "ready"
    RELEASED = "released"


class SampleMode(enum.StrEnum):
    PATH = "path"
    TREE = "tree"


# --- bounds: what a value from outside may be before a record is built from it ------------------
# The Avro writer encodes any int as a long and numpy casts ids to uint32 without complaint, so a
# value past these bounds would not fail: it would wrap (2**64 - 1 reads back as -1, -1 as
# 4294967295). Producers (SDK, proxy, rollout API) check them with the *_problem functions below,
# which return why a value is out of bounds (None when it is not), so each caller raises its own
# error naming its own field.

# 2**53 - 1 (JavaScript's Number.MAX_SAFE_INTEGER): an integer that JSON readers (the web UI,
# clients in any language, float64 columns) read back exactly; far inside the Avro long
# and ClickHouse Int64 the versions are stored as, and more versions than any trainer publishes
SAFE_INT_MAX = 2**53 - 1
POLICY_VERSION_MAX = SAFE_INT_MAX  # PolicyVersion.version, LlmCall / RolloutStarted .policy_version
TOKEN_ID_MAX = 2**32 - 1  # token ids are packed as uint32 (U32)
METADATA_MAX_KEYS = 256  # RolloutStarted.metadata entries
METADATA_MAX_CHARS = 65_536  # characters of one metadata key or value
SAMPLING_MAX_KEYS = 64  # RolloutStarted.sampling entries


def policy_version_problem(value: object) -> str | None:
    """Why ``value`` is not a policy version (an int in [0, POLICY_VERSION_MAX]), else None."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        return f"must be an integer, not {type(value).__name__}"
    if not 0 <= value <= POLICY_VERSION_MAX:
        return f"must be in [0, {POLICY_VERSION_MAX}] (2**53 - 1)"
    return None


def reward_problem(value: object) -> str | None:
    """Why ``value`` is not a reward value (a finite number in [-REWARD_BOUND, REWARD_BOUND]:
    the stream processors dead-letter any other as ``bad_reward``), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        return f"must be a number, not {type(value).__name__}"
    try:
        number = float(value)
    except OverflowError:  # an int past the float range
        number = math.inf
    if not (math.isfinite(number) and abs(number) <= REWARD_BOUND):
        return f"must be a finite number in [-{REWARD_BOUND:g}, {REWARD_BOUND:g}]"
    return None


def token_ids_problem(values: Array) -> str | None:
    """Why the array ``values`` is not a sequence of token ids (integers in [0, TOKEN_ID_MAX],
    one dimension), else None. A uint32 array passes at once; others are range-checked once
    (vectorised): numpy would cast them to uint32 by wrapping."""
    if values.dtype == U32 and values.ndim == 1:
        return None
    if values.ndim != 1:
        return f"must be a one-dimensional sequence of token ids, not shape {values.shape}"
    if not values.size:
        return None
    kind = values.dtype.kind
    if kind not in "ui":  # floats, bools, objects (ints past 64 bits), strings
        return f"must be integers in [0, {TOKEN_ID_MAX}], not {values.dtype}"
    if (kind == "i" and values.min() < 0) or values.max() > TOKEN_ID_MAX:
        return f"must be integers in [0, {TOKEN_ID_MAX}] (uint32)"
    return None


def metadata_problem(metadata: dict[str, str]) -> str | None:
    """Why a metadata map (string keys and values) is past its bounds (METADATA_MAX_KEYS
    entries, METADATA_MAX_CHARS characters per key or value), else None."""
    if len(metadata) > METADATA_MAX_KEYS:
        return f"has {len(metadata)} keys, more than {METADATA_MAX_KEYS}"
    for key, value in metadata.items():
        if len(key) > METADATA_MAX_CHARS or len(value) > METADATA_MAX_CHARS:
            return f"key or value of {key[:40]!r} longer than {METADATA_MAX_CHARS} characters"
    return None


def as_array(value: Any, dtype: np.dtype[Any]) -> Array:
    """Coerce a list, array or packed bytes into a contiguous array of ``dtype``."""
    if isinstance(value, bytes | bytearray | memoryview):
        return np.frombuffer(value, dtype=dtype)
    return np.ascontiguousarray(value, dtype=dtype)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _coercer(
    arrays: dict[str, np.dtype[Any]], enums: dict[str, type[enum.StrEnum]]
) -> Callable[[Any], None]:
    """A ``__post_init__`` that turns the given fields into arrays of their dtype and members of
    their enum, generated as one straight-line function (values already right cost a type test
    each). ``is_coercer`` tells readers that this is all it does."""
    env: dict[str, Any] = {
        "_ndarray": np.ndarray,
        "_as_array": as_array,
        "_set": object.__setattr__,
    }
    lines = ["def __post_init__(self):"]
    for i, (name, dtype) in enumerate(arrays.items()):
        env[f"_d{i}"] = dtype
        lines += [
            f"    v = self.{name}",
            f"    if not (isinstance(v, _ndarray) and (v.dtype is _d{i} or v.dtype == _d{i})):",
            f"        _set(self, {name!r}, _as_array(v, _d{i}))",
        ]
    for i, (name, enum_type) in enumerate(enums.items()):
        env[f"_e{i}"] = enum_type
        lines += [
            f"    v = self.{name}",
            f"    if not isinstance(v, _e{i}):",
            f"        _set(self, {name!r}, _e{i}(v))",
        ]
    exec(compile("\n".join(lines), "<rollstream record coercer>", "exec"), env)
    post_init: Callable[[Any], None] = env["__post_init__"]
    post_init.is_coercer = True  # type: ignore[attr-defined]
    return post_init


class _Record:
    """Shared machinery. Subclasses declare which fields are packed arrays, nested records,
    lists of records and enums; conversion plans are computed once per class."""

    AVRO_NAME: ClassVar[str]
    _arrays: ClassVar[dict[str, np.dtype[Any]]] = {}
    _nested: ClassVar[dict[str, type[_Record]]] = {}
    _nested_lists: ClassVar[dict[str, type[_Record]]] = {}
    _enums: ClassVar[dict[str, type[enum.StrEnum]]] = {}

    @classmethod
    def _field_names(cls) -> tuple[str, ...]:
        return _field_names(cls)  # type: ignore[arg-type]  # classes are hashable

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # before @dataclass looks: a class with packed arrays or enums gets a __post_init__
        # that coerces them (straight-line, made for its fields); one without gets none, so
        # its __init__ makes no call at all (the SDK builds three records per model call)
        if (cls._arrays or cls._enums) and "__post_init__" not in cls.__dict__:
            cls.__post_init__ = _coercer(cls._arrays, cls._enums)  # type: ignore[attr-defined]

    def to_avro(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self._field_names():
            value = getattr(self, name)
            if name in self._arrays:
                out[name] = value.tobytes()
            elif name in self._nested:
                out[name] = value.to_avro()
            elif name in self._nested_lists:
                out[name] = [item.to_avro() for item in value]
            elif name in self._enums:
                out[name] = str(value)
            else:
                out[name] = value
        return out

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> Any:
        kwargs: dict[str, Any] = {}
        for name in cls._field_names():
            value = data[name]
            if name in cls._arrays:
                value = np.frombuffer(value, dtype=cls._arrays[name])
            elif name in cls._nested:
                value = cls._nested[name].from_avro(value)
            elif name in cls._nested_lists:
                item_cls = cls._nested_lists[name]
                value = [item_cls.from_avro(item) for item in value]
            elif name in cls._enums:
                value = cls._enums[name](value)
            kwargs[name] = value
        return cls(**kwargs)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self._field_names():
            value = getattr(self, name)
            if name in self._arrays:
                out[name] = value.tolist()
            elif name in self._nested:
                out[name] = value.to_json()
            elif name in self._nested_lists:
                out[name] = [item.to_json() for item in value]
            elif name in self._enums:
                out[name] = str(value)
            else:
                out[name] = value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Any:
        """Inverse of ``to_json`` (token arrays from lists); used by golden JSONL logs."""
        kwargs: dict[str, Any] = {}
        for name in cls._field_names():
            if name not in data:
                continue  # dataclass default
            value = data[name]
            if name in cls._nested:
                value = cls._nested[name].from_json(value)
            elif name in cls._nested_lists:
                item_cls = cls._nested_lists[name]
                value = [item_cls.from_json(item) for item in value]
            kwargs[name] = value  # arrays and enums are coerced by __post_init__
        return cls(**kwargs)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for name in self._field_names():
            a, b = getattr(self, name), getattr(other, name)
            if name in self._arrays:
                if not np.array_equal(a, b, equal_nan=a.dtype.kind == "f"):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]


# --- event bodies -----------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class RolloutStarted(_Record):
    AVRO_NAME: ClassVar[str] = "rollstream.RolloutStarted"
    task_id: str
    group_id: str
    attempt: int = 0
    harness: str = ""
    policy_version: int = 0
    group_size: int | None = None
    run_id: str = ""
    sampling: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(eq=False, slots=True)
class Usage(_Record):
    AVRO_NAME: ClassVar[str] = "rollstream.Usage"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(eq=False, slots=True)
class LlmCall(_Record):
    """prefix_len tokens are shared with the parent's full sequence; prompt_delta is new.
    The full prompt is ``parent.prompt + parent.completion`` cut to prefix_len, then the delta."""

    AVRO_NAME: ClassVar[str] = "rollstream.LlmCall"
    _arrays: ClassVar[dict[str, np.dtype[Any]]] = {
        "prompt_delta": U32,
        "completion_ids": U32,
        "completion_logprobs": F32,
    }
    _nested: ClassVar[dict[str, type[_Record]]] = {"usage": Usage}
    call_id: str
    parent_call_id: str | None
    prefix_len: int
    prompt_delta: Array
    completion_ids: Array
    completion_logprobs: Array
    finish_reason: str = "stop"
    model: str = ""
    backend: str = ""
    policy_version: int = 0
    latency_ms: float = 0.0
    usage: Usage = field(default_factory=Usage)
    drift_tokens: int = 0

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + len(self.prompt_delta)


@dataclass(eq=False, slots=True)
class ToolCall(_Record):
    AVRO_NAME: ClassVar[str] = "rollstream.ToolCall"
    tool_call_id: str
    name: str
    arguments: str = ""
    result: str = ""
    result_truncated: bool = False
    is_error: bool = False
    duration_ms: float = 0.0
    sandbox: str | None = None
    at_call_id: str | None = None


REWARD_BOUND = 1e6  # a Reward.value is a number in [-REWARD_BOUND, REWARD_BOUND]


@dataclass(eq=False, slots=True)
class Reward(_Record):
    """A reward: ``value`` is a number in [-REWARD_BOUND, REWARD_BOUND]; the stream processors
    dead-letter any other (NaN, infinities, 1e308) as ``bad_reward``, the proxy answers 400."""

    AVRO_NAME: ClassVar[str] = "rollstream.Reward"
    _enums: ClassVar[dict[str, type[enum.StrEnum]]] = {"kind": RewardKind}
    value: float
    kind: RewardKind = RewardKind.FINAL
    name: str = ""
    at_call_id: str | None = None
    evaluator: str = ""


@dataclass(eq=False, slots=True)
class Branch(_Record):
    AVRO_NAME: ClassVar[str] = "rollstream.Branch"
    _enums: ClassVar[dict[str, type[enum.StrEnum]]] = {"kind": BranchKind}
    branch_id: str
    kind: BranchKind = BranchKind.FORK
    source_call_id: str | None = None
    reason: str = ""


@dataclass(eq=False, slots=True)
class RolloutError(_Record):
    AVRO_NAME: ClassVar[str] = "rollstream.RolloutError"
    source: str
    message: str
    code: int = 0
    call_id: str | None = None
    backend: str = ""


@dataclass(eq=False, slots=True)
class RolloutFinished(_Record):
    AVRO_NAME: ClassVar[str] = "rollstream.RolloutFinished"
    _enums: ClassVar[dict[str, type[enum.StrEnum]]] = {"status": RolloutStatus}
    status: RolloutStatus = RolloutStatus.COMPLETED
    error: str | None = None


# --- lifecycle bodies: facts of the rollout service about a rollout, beside its trajectory ------


@dataclass(eq=False, slots=True)
class StageEvent(_Record):
    """A stage (init, run, eval) of the rollout service started or finished. ``status`` is ""
    when started and ok | failed | timeout when finished; ``duration_ms`` is 0 when started."""

    AVRO_NAME: ClassVar[str] = "rollstream.StageEvent"
    _enums: ClassVar[dict[str, type[enum.StrEnum]]] = {"stage": StageName, "phase": StagePhase}
    stage: StageName = StageName.RUN
    phase: StagePhase = StagePhase.STARTED
    status: str = ""
    duration_ms: float = 0.0
    job_id: str = ""
    worker: str = ""
    reason: str = ""


@dataclass(eq=False, slots=True)
class SandboxEvent(_Record):
    """A rollout's sandbox is ready (``duration_ms``: its create time) or released (its destroy
    time). ``kind``: the provider (bwrap, docker, local, ...)."""

    AVRO_NAME: ClassVar[str] = "rollstream.SandboxEvent"
    _enums: ClassVar[dict[str, type[enum.StrEnum]]] = {"phase": SandboxPhase}
    sandbox_id: str
    phase: SandboxPhase = SandboxPhase.READY
    kind: str = ""
    duration_ms: float = 0.0
    job_id: str = ""


@dataclass(eq=False, slots=True)
class EvaluatorOutput(_Record):
    """What an evaluator said (its rewards are Reward events): ok | failed | timeout, checks
    passed of total, and its output (bounded; see ``output_truncated``)."""

    AVRO_NAME: ClassVar[str] = "rollstream.EvaluatorOutput"
    evaluator: str
    status: str = "ok"
    passed: int = 0
    total: int = 0
    output: str = ""
    output_truncated: bool = False
    job_id: str = ""


Body: TypeAlias = (
    RolloutStarted
    | LlmCall
    | ToolCall
    | Reward
    | Branch
    | RolloutError
    | RolloutFinished
    | StageEvent
    | SandboxEvent
    | EvaluatorOutput
)
# lifecycle facts of the rollout service: on the log beside the trajectory, not in it
Lifecycle: TypeAlias = StageEvent | SandboxEvent | EvaluatorOutput
LIFECYCLE_TYPES: tuple[type[_Record], ...] = (StageEvent, SandboxEvent, EvaluatorOutput)
_BODY_CLASSES: tuple[type[_Record], ...] = (
    RolloutStarted,
    LlmCall,
    ToolCall,
    Reward,
    Branch,
    RolloutError,
    RolloutFinished,
    *LIFECYCLE_TYPES,
)  # in the order of Event.body's union
BODY_TYPES: dict[str, type[_Record]] = {cls.AVRO_NAME: cls for cls in _BODY_CLASSES}


@dataclass(eq=False, slots=True)
class Event(_Record):
    """The envelope of rollout.events. ``ts`` is microseconds since the epoch (UTC)."""

    AVRO_NAME: ClassVar[str] = "rollstream.Event"
    event_id: str
    rollout_id: str
    seq: int
    ts: int
    body: Body
    producer: str = ""
    schema_version: int = 1

    @property
    def kind(self) -> str:
        return type(self.body).__name__

    def to_avro(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "rollout_id": self.rollout_id,
            "seq": self.seq,
            "ts": self.ts,
            "producer": self.producer,
            "schema_version": self.schema_version,
            "body": (self.body.AVRO_NAME, self.body.to_avro()),
        }

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> Event:
        name, body = data["body"]
        return cls(
            event_id=data["event_id"],
            rollout_id=data["rollout_id"],
            seq=data["seq"],
            ts=data["ts"],
            producer=data["producer"],
            schema_version=data["schema_version"],
            body=BODY_TYPES[name].from_avro(body),
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Event:
        body_cls = BODY_TYPES[f"rollstream.{data['type']}"]
        return cls(
            event_id=data["event_id"],
            rollout_id=data["rollout_id"],
            seq=data["seq"],
            ts=data["ts"],
            producer=data.get("producer", ""),
            schema_version=data.get("schema_version", 1),
            body=body_cls.from_json(data["body"]),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "rollout_id": self.rollout_id,
            "seq": self.seq,
            "ts": self.ts,
            "producer": self.producer,
            "schema_version": self.schema_version,
            "type": self.kind,
            "body": self.body.to_json(),
        }


# --- derived records ---------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class PolicyVersion(_Record):
    AVRO_NAME: ClassVar[str] = "rollstream.PolicyVersion"
    version: int
    checkpoint_uri: str
    trainer_step: int
    ts: int
    samples_trained: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False, slots=True)
class TrajectoryNode(_Record):
    AVRO_NAME: ClassVar[str] = "rollstream.TrajectoryNode"
    _arrays: ClassVar[dict[str, np.dtype[Any]]] = {
        "prompt_tokens": U32,
        "completion_ids": U32,
        "completion_logprobs": F32,
    }
    call_id: str
    parent_call_id: str | None
    prefix_len: int
    prompt_tokens: Array
    completion_ids: Array
    completion_logprobs: Array
    policy_version: int = 0
    finish_reason: str = "stop"


@dataclass(eq=False, slots=True)
class RewardRecord(_Record):
    AVRO_NAME: ClassVar[str] = "rollstream.RewardRecord"
    value: float
    kind: str
    name: str = ""
    at_call_id: str | None = None


@dataclass(eq=False, slots=True)
class Trajectory(_Record):
    AVRO_NAME: ClassVar[str] = "rollstream.Trajectory"
    _nested_lists: ClassVar[dict[str, type[_Record]]] = {
        "nodes": TrajectoryNode,
        "rewards": RewardRecord,
    }
    rollout_id: str
    task_id: str
    group_id: str
    status: str
    score: float
    nodes: list[TrajectoryNode]
    attempt: int = 0
    group_size: int | None = None
    run_id: str = ""
    error: str | None = None
    score_source: str = "final"
    rewards: list[RewardRecord] = field(default_factory=list)
    num_events: int = 0
    last_seq: int = -1
    started_ts: int = 0
    finished_ts: int = 0
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(eq=False, slots=True)
class Sample(_Record):
    AVRO_NAME: ClassVar[str] = "rollstream.Sample"
    _arrays: ClassVar[dict[str, np.dtype[Any]]] = {
        "input_ids": U32,
        "loss_mask": U8,
        "behaviour_logprobs": F32,
        "parent_indices": I32,
        "token_policy_versions": I64,
    }
    _enums: ClassVar[dict[str, type[enum.StrEnum]]] = {"mode": SampleMode}
    sample_id: str
    rollout_id: str
    group_id: str
    task_id: str
    input_ids: Array
    loss_mask: Array
    behaviour_logprobs: Array
    advantage: float
    reward: float
    policy_version: int
    mode: SampleMode = SampleMode.PATH
    parent_indices: Array = field(default_factory=lambda: np.zeros(0, I32))
    token_policy_versions: Array = field(default_factory=lambda: np.zeros(0, I64))
    loss_weight: float = 1.0
    policy_versions: list[int] = field(default_factory=list)
    leaf_id: str = ""
    num_tokens: int = 0


Record: TypeAlias = Event | PolicyVersion | Trajectory | Sample
