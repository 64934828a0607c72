"""The harness SDK: record a rollout's events from inside any Python agent harness.

    recorder = Recorder(RecorderSettings())            # or Recorder(settings, transport=...)
    with recorder.rollout(task_id="t1", group_id="g1") as r:
        call = r.llm_call(prompt_ids, completion_ids, logprobs, model="m")
        r.tool_call("search", arguments={"q": "x"}, result="...", at_call_id=call)
        r.reward(1.0)
    recorder.close()                                   # also runs at exit

Every event is an ``Event`` envelope (ULID event_id, per-rollout gap-free seq from 0 =
RolloutStarted, key = rollout_id) encoded with the schemas' Codec and handed to ``Delivery``
(producers/sdk/delivery.py), which never raises into or blocks the harness. ``llm_call`` takes the
FULL prompt; the rollout's ContextTrie turns it into parent_call_id + prefix_len + prompt_delta.
An LlmCall (one per model call: the hot path) is written from its fields by the codec's flat
writer, without building records, and an id the SDK makes for the call is also its event's id.
A ``with`` block left by an exception finishes the rollout as failed (``repr`` of the error;
KeyboardInterrupt/SystemExit: aborted) and the exception propagates. Misuse (logprobs that do
not match the completion, an event after finish) raises RecorderUsageError at the call site.

Errors (producers/errors.py): RecorderError, the SDK's root under ProducerError, and
RecorderUsageError (a ValueError too) for a call that cannot make a valid event.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from rollstream.adapters.codecs import build_codec
from rollstream.producers.errors import RecorderError, RecorderUsageError, SpoolError
from rollstream.producers.sdk.context import ContextMatch, ContextTrie
from rollstream.producers.sdk.delivery import Delivery, DeliveryStats
from rollstream.producers.sdk.ids import new_ulid as _ulid
from rollstream.producers.sdk.settings import RecorderSettings, kafka_producer_options
from rollstream.producers.sdk.spool import Spool
from rollstream.producers.sdk.transport import KafkaTransport, Transport
from rollstream.schemas import (
    LIFECYCLE_TYPES,
    Branch,
    BranchKind,
    Codec,
    EncodeError,
    Event,
    Lifecycle,
    LlmCall,
    Reward,
    RewardKind,
    RolloutError,
    RolloutFinished,
    RolloutStarted,
    RolloutStatus,
    ToolCall,
    Usage,
)
from rollstream.schemas.events import (
    SAFE_INT_MAX,
    SAMPLING_MAX_KEYS,
    Body,
    metadata_problem,
    policy_version_problem,
    reward_problem,
    token_ids_problem,
)

__all__ = [
    "Recorder",
    "RecorderError",
    "RecorderSettings",
    "RecorderUsageError",
    "RolloutHandle",
    "kafka_producer_options",
]

log = logging.getLogger("rollstream.producers")

_U32 = np.dtype("<u4")
_F32 = np.dtype("<f4")
# an LlmCall event's leaf fields, in the order Recorder._emit_llm_call passes them to the
# codec's flat writer (which checks, when it is made, that they are exactly the schema's)
_LLM_CALL_FIELDS = (
    "event_id",
    "rollout_id",
    "seq",
    "ts",
    "producer",
    "schema_version",
    "call_id",
    "parent_call_id",
    "prefix_len",
    "prompt_delta",
    "completion_ids",
    "completion_logprobs",
    "finish_reason",
    "model",
    "backend",
    "policy_version",
    "latency_ms",
    "usage_prompt_tokens",
    "usage_completion_tokens",
    "usage_cached_tokens",
    "drift_tokens",
)
_SCHEMA_VERSION: int = Event.__dataclass_fields__["schema_version"].default
_INTS = (int, np.integer)  # what a long field takes (numpy's ints too, as the encoder does)


_E = TypeVar("_E", bound=enum.Enum)


def _bounded(name: str, problem: str | None) -> None:
    """RecorderUsageError naming the argument when a bound check found a ``problem``."""
    if problem is not None:
        raise RecorderUsageError(f"{name} {problem}")


def _count(name: str, value: Any) -> None:
    """A count (attempt, group size, drift tokens): an int in [0, SAFE_INT_MAX]."""
    if isinstance(value, bool) or not isinstance(value, _INTS) or not 0 <= value <= SAFE_INT_MAX:
        raise RecorderUsageError(f"{name} must be an integer in [0, {SAFE_INT_MAX}], got {value!r}")


def _sampling(sampling: dict[str, float] | None) -> dict[str, float]:
    """``sampling`` as finite floats, at most SAMPLING_MAX_KEYS of them."""
    if sampling is not None and len(sampling) > SAMPLING_MAX_KEYS:
        raise RecorderUsageError(f"sampling has more than {SAMPLING_MAX_KEYS} entries")
    out = {}
    for key, value in (sampling or {}).items():
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            number = math.nan
        if not math.isfinite(number):
            raise RecorderUsageError(f"sampling[{key!r}] must be a finite number, got {value!r}")
        out[str(key)] = number
    return out


def _enum(cls: type[_E], value: Any) -> _E:
    try:
        return cls(value)
    except ValueError as exc:
        choices = ", ".join(str(m.value) for m in cls)
        raise RecorderUsageError(f"{value!r} is not a {cls.__name__} ({choices})") from exc


class Recorder:
    """Records rollouts to ``Topics(namespace).events``. Thread-safe; build one per process.

    ``transport`` replaces the Kafka client (``MemoryTransport`` in unit tests)."""

    def __init__(
        self,
        settings: RecorderSettings | None = None,
        *,
        transport: Transport | None = None,
        codec: Codec | None = None,
        on_drop: Callable[[int, str], None] | None = None,
    ) -> None:
        """``on_drop(events, reason)`` is called when events are dropped (Kafka unreachable and
        the spool missing, full or failing; recorded after close): the harness learns it at
        once, besides ``stats.dropped``. It runs outside the recorder's locks."""
        self.settings = settings or RecorderSettings()
        s = self.settings
        self.topic = s.topics().events
        self.codec = codec or build_codec(s)  # registry framing when a registry URL is set
        if transport is None:
            transport = KafkaTransport(s.kafka_config(), kafka_producer_options(s))
        spool = None
        if s.spool_dir is not None:
            try:
                spool = Spool(
                    s.spool_dir,
                    fsync=s.spool_fsync,
                    fsync_interval_s=s.spool_fsync_interval_ms / 1000,
                    segment_bytes=s.spool_segment_bytes,
                    max_bytes=s.spool_max_bytes,
                )
            except SpoolError as exc:  # the harness still runs; outages then cost events
                log.error("spool disabled (events are dropped while Kafka is down): %s", exc)
        self.delivery = Delivery(
            transport,
            spool=spool,
            probe_topic=self.topic,
            queue_size=s.queue_size,
            degrade_after_s=s.degrade_after_s,
            probe_interval_s=s.probe_interval_s,
            close_timeout_s=s.close_timeout_s,
            on_drop=on_drop,
        )
        self._producer = s.producer
        self._encode = self.codec.encode  # bound once: every event goes through these two
        self._submit = self.delivery.submit
        # the hot path (one per model call): an LlmCall written straight from its fields, or
        # (a codec with a schema registry has no flat writer) through records
        self._write_llm_call = (
            self.codec.flat_writer("rollstream.Event", "rollstream.LlmCall", _LLM_CALL_FIELDS)
            or self._llm_call_as_records
        )

    def rollout(
        self,
        *,
        task_id: str,
        group_id: str,
        rollout_id: str | None = None,
        attempt: int = 0,
        harness: str = "",
        policy_version: int = 0,
        group_size: int | None = None,
        run_id: str = "",
        sampling: dict[str, float] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> RolloutHandle:
        """Start a rollout (emits RolloutStarted, seq 0). Use it as a context manager.
        Values past their bounds (rollstream.schemas.events: a policy version in
        [0, POLICY_VERSION_MAX], counts in [0, SAFE_INT_MAX], finite sampling numbers,
        metadata within METADATA_MAX_KEYS / METADATA_MAX_CHARS) raise RecorderUsageError
        naming the argument, and nothing is recorded."""
        _bounded("policy_version", policy_version_problem(policy_version))
        _count("attempt", attempt)
        if group_size is not None:
            _count("group_size", group_size)
        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        _bounded("metadata", metadata_problem(meta))
        started = RolloutStarted(
            task_id=task_id,
            group_id=group_id,
            attempt=attempt,
            harness=harness,
            policy_version=policy_version,
            group_size=group_size,
            run_id=run_id,
            sampling=_sampling(sampling),
            metadata=meta,
        )
        return RolloutHandle(self, rollout_id or _ulid(), started)

    def _emit(
        self, rollout_id: str, key: bytes, seq: int, body: Body, event_id: str | None = None
    ) -> str:
        if event_id is None:
            event_id = _ulid()
        ts = time.time_ns() // 1000
        event = Event(event_id, rollout_id, seq, ts, body, self._producer)
        try:
            value = self._encode(event)
        except EncodeError as exc:  # a field of the wrong type: the caller's bug, said here
            raise RecorderUsageError(f"cannot encode {type(body).__name__}: {exc}") from exc
        self._submit(self.topic, key, value, ts // 1000)
        return event_id

    def _emit_llm_call(
        self,
        rollout_id: str,
        key: bytes,
        seq: int,
        event_id: str,
        call_id: str,
        match: ContextMatch,
        completion: np.ndarray,
        logprobs: np.ndarray,
        finish_reason: str,
        model: str,
        backend: str,
        policy_version: int,
        latency_ms: float,
        usage: Usage | None,
        drift_tokens: int,
    ) -> None:
        """``_emit`` of an LlmCall, without building records when the codec can write it
        from its fields (the same bytes; ``Codec.flat_writer``)."""
        ts = time.time_ns() // 1000
        try:
            if usage is None:  # the usual case: counted here
                prompt_tokens = match.prefix_len + len(match.prompt_delta)
                completion_tokens, cached_tokens = len(completion), 0
            else:
                prompt_tokens, completion_tokens = usage.prompt_tokens, usage.completion_tokens
                cached_tokens = usage.cached_tokens
            value = self._write_llm_call(  # arguments in _LLM_CALL_FIELDS' order
                event_id,
                rollout_id,
                seq,
                ts,
                self._producer,
                _SCHEMA_VERSION,
                call_id,
                match.parent_call_id,
                match.prefix_len,
                match.prompt_delta,
                completion,
                logprobs,
                finish_reason,
                model,
                backend,
                policy_version,
                latency_ms,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                drift_tokens,
            )
        except Exception as exc:  # a field of the wrong type: the caller's bug, said here
            raise RecorderUsageError(f"cannot encode LlmCall: {type(exc).__name__}: {exc}") from exc
        self._submit(self.topic, key, value, ts // 1000)

    def _llm_call_as_records(
        self,
        event_id: str,
        rollout_id: str,
        seq: int,
        ts: int,
        producer: str,
        schema_version: int,
        call_id: str,
        parent_call_id: str | None,
        prefix_len: int,
        prompt_delta: np.ndarray,
        completion_ids: np.ndarray,
        completion_logprobs: np.ndarray,
        finish_reason: str,
        model: str,
        backend: str,
        policy_version: int,
        latency_ms: float,
        usage_prompt_tokens: int,
        usage_completion_tokens: int,
        usage_cached_tokens: int,
        drift_tokens: int,
    ) -> bytes:
        """The flat writer's signature, through records and ``Codec.encode``."""
        usage = Usage(usage_prompt_tokens, usage_completion_tokens, usage_cached_tokens)
        call = LlmCall(
            call_id,
            parent_call_id,
            prefix_len,
            prompt_delta,
            completion_ids,
            completion_logprobs,
            finish_reason,
            model,
            backend,
            policy_version,
            latency_ms,
            usage,
            drift_tokens,
        )
        return self._encode(Event(event_id, rollout_id, seq, ts, call, producer, schema_version))

    @property
    def stats(self) -> DeliveryStats:
        return self.delivery.stats

    @property
    def accepting(self) -> bool:
        """Whether an event recorded now would be kept (sent, queued or spooled), not dropped:
        a service should refuse new work (503) while this is False."""
        return self.delivery.accepting

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything recorded so far is acknowledged (False on timeout)."""
        return self.delivery.flush(timeout)

    def close(self, timeout: float | None = None) -> DeliveryStats:
        """Deliver what can be delivered within ``timeout``; spool the rest for the next run."""
        return self.delivery.close(self.settings.close_timeout_s if timeout is None else timeout)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RolloutHandle:
    """One rollout being recorded. Methods are thread-safe; seq is assigned in call order."""

    def __init__(self, recorder: Recorder, rollout_id: str, started: RolloutStarted) -> None:
        self.recorder = recorder
        self.rollout_id = rollout_id
        self._key = rollout_id.encode()  # the Kafka key of every event of the rollout
        self.task_id = started.task_id
        self.group_id = started.group_id
        self.policy_version = started.policy_version
        self.context = ContextTrie()
        self.status: RolloutStatus | None = None
        self._lock = threading.Lock()
        self._seq = 0
        self._emit(started)

    @property
    def seq(self) -> int:
        """The seq the next event will get (= events recorded so far)."""
        return self._seq

    @property
    def finished(self) -> bool:
        return self.status is not None

    def _emit(self, body: Body, event_id: str | None = None) -> str:
        # caller holds self._lock or is the constructor
        event_id = self.recorder._emit(self.rollout_id, self._key, self._seq, body, event_id)
        self._seq += 1
        return event_id

    def _check_open(self, what: str) -> None:
        if self.status is not None:
            raise RecorderUsageError(
                f"{what} after rollout {self.rollout_id} finished ({self.status})"
            )

    def llm_call(
        self,
        prompt_ids: Any,
        completion_ids: Any,
        logprobs: Any,
        *,
        call_id: str | None = None,
        finish_reason: str = "stop",
        model: str = "",
        backend: str = "",
        policy_version: int | None = None,
        latency_ms: float = 0.0,
        usage: Usage | None = None,
        drift_tokens: int = 0,
    ) -> str:
        """Record a model call from its FULL prompt token IDs; returns its call_id. Token ids
        must be integers in [0, TOKEN_ID_MAX] and ``policy_version`` in [0, POLICY_VERSION_MAX]
        (RecorderUsageError naming the argument otherwise: numpy and the Avro writer would wrap
        them)."""
        completion = completion_ids
        if not (isinstance(completion, np.ndarray) and completion.dtype == _U32):
            completion = np.asarray(completion_ids)
            _bounded("completion_ids", token_ids_problem(completion))
            completion = np.ascontiguousarray(completion, dtype=_U32)
        elif not completion.flags.c_contiguous:
            completion = np.ascontiguousarray(completion)
        try:
            lps = np.ascontiguousarray(logprobs, dtype=_F32)
        except (TypeError, ValueError, OverflowError) as exc:
            raise RecorderUsageError(f"logprobs must be numbers: {exc}") from exc
        if completion.ndim != 1 or lps.shape != completion.shape:
            raise RecorderUsageError(
                f"logprobs {lps.shape} must match completion_ids {completion.shape}, one per token"
            )
        if not (  # checked before the trie records the call: no event, no trace of it
            isinstance(finish_reason, str)
            and isinstance(model, str)
            and isinstance(backend, str)
            and isinstance(drift_tokens, _INTS)
            and (policy_version is None or isinstance(policy_version, _INTS))
            and (usage is None or isinstance(usage, Usage))
            and (call_id is None or isinstance(call_id, str))
        ):
            raise RecorderUsageError(
                "cannot encode LlmCall: finish_reason, model, backend and call_id must be str, "
                "drift_tokens and policy_version int, usage a Usage; got "
                f"{[type(v).__name__ for v in (finish_reason, model, backend, call_id)]}, "
                f"{type(drift_tokens).__name__}, {type(policy_version).__name__}, "
                f"{type(usage).__name__}"
            )
        if policy_version is not None:
            _bounded("policy_version", policy_version_problem(policy_version))
        _count("drift_tokens", drift_tokens)
        event_id = None
        if not call_id:  # a call id the SDK makes is also its event's id (one fresh ULID)
            call_id = event_id = _ulid()
        with self._lock:
            if self.status is not None:
                self._check_open("llm_call")
            match = self.context.add(call_id, prompt_ids, completion)
            self.recorder._emit_llm_call(
                self.rollout_id,
                self._key,
                self._seq,
                event_id or _ulid(),
                call_id,
                match,
                completion,
                lps,
                finish_reason,
                model,
                backend,
                self.policy_version if policy_version is None else policy_version,
                float(latency_ms),
                usage,
                drift_tokens,
            )
            self._seq += 1
        return call_id

    def tool_call(
        self,
        name: str,
        arguments: str | dict[str, Any] | list[Any] = "",
        result: str = "",
        *,
        is_error: bool = False,
        duration_ms: float = 0.0,
        sandbox: str | None = None,
        at_call_id: str | None = None,
        tool_call_id: str | None = None,
    ) -> str:
        """Record a tool call (the result is cut to ``max_tool_result_chars``); returns its id."""
        if not isinstance(arguments, str):
            try:
                arguments = json.dumps(arguments, ensure_ascii=False, default=str)
            except (ValueError, RecursionError) as exc:  # a cycle, or nested past the stack
                raise RecorderUsageError(f"arguments cannot be written as JSON: {exc}") from exc
        limit = self.recorder.settings.max_tool_result_chars
        result = str(result)
        truncated = len(result) > limit
        event_id = None
        if not tool_call_id:  # as in llm_call: the SDK's id is also the event's
            tool_call_id = event_id = _ulid()
        body = ToolCall(
            tool_call_id=tool_call_id,
            name=name,
            arguments=arguments,
            result=result[:limit] if truncated else result,
            result_truncated=truncated,
            is_error=is_error,
            duration_ms=float(duration_ms),
            sandbox=sandbox,
            at_call_id=at_call_id,
        )
        with self._lock:
            self._check_open("tool_call")
            self._emit(body, event_id)
        return tool_call_id

    def reward(
        self,
        value: float,
        kind: RewardKind | str = RewardKind.FINAL,
        *,
        name: str = "",
        at_call_id: str | None = None,
        evaluator: str = "",
    ) -> str:
        """Record a reward (final, partial, milestone or penalty); returns the event id.
        ``value`` must be a finite number in [-REWARD_BOUND, REWARD_BOUND] (1e6): any other
        raises RecorderUsageError (a ValueError) naming ``value`` here, in the harness, rather
        than being dead-lettered as ``bad_reward`` by the stream processors later."""
        _bounded("value", reward_problem(value))
        body = Reward(float(value), _enum(RewardKind, kind), name, at_call_id, evaluator)
        with self._lock:
            self._check_open("reward")
            return self._emit(body)

    def branch(
        self,
        kind: BranchKind | str = BranchKind.FORK,
        *,
        source_call_id: str | None = None,
        reason: str = "",
        branch_id: str | None = None,
    ) -> str:
        """Record an explicit branch point (retry, rewind, fork, subagent, summarize). With
        ``source_call_id`` X, the next ``llm_call`` whose prompt continues X's full sequence is
        recorded under X (``ContextTrie.add``), even when a later call of X shares more."""
        branch_id = branch_id or _ulid()
        body = Branch(branch_id, _enum(BranchKind, kind), source_call_id, reason)
        with self._lock:
            self._check_open("branch")
            self._emit(body)
            if source_call_id is not None:
                self.context.anchor = source_call_id
        return branch_id

    def error(
        self,
        source: str,
        message: str,
        *,
        code: int = 0,
        call_id: str | None = None,
        backend: str = "",
    ) -> str:
        """Record an error the rollout survived (a failed model or tool call)."""
        body = RolloutError(source, message, code, call_id, backend)
        with self._lock:
            self._check_open("error")
            return self._emit(body)

    def lifecycle(self, bodies: Sequence[Lifecycle]) -> list[str]:
        """Record lifecycle facts (a stage started or finished, a sandbox ready or released, an
        evaluator's output), in order and with consecutive seqs; returns their event ids."""
        for body in bodies:
            if not isinstance(body, LIFECYCLE_TYPES):
                raise RecorderUsageError(
                    f"not a lifecycle body: {type(body).__name__} (StageEvent, SandboxEvent "
                    "or EvaluatorOutput)"
                )
        with self._lock:
            self._check_open("lifecycle")
            return [self._emit(body) for body in bodies]

    def finish(
        self, status: RolloutStatus | str = RolloutStatus.COMPLETED, error: str | None = None
    ) -> bool:
        """Emit RolloutFinished; False (and nothing emitted) if it was already finished."""
        final = _enum(RolloutStatus, status)
        with self._lock:
            if self.status is not None:
                return False
            self._emit(RolloutFinished(final, error))
            self.status = final
            self.context.release()  # its token memory goes back to the process's pool
        return True

    def __enter__(self) -> RolloutHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.finish(RolloutStatus.COMPLETED)
        elif isinstance(exc, Exception):
            self.finish(RolloutStatus.FAILED, repr(exc))
        else:  # KeyboardInterrupt, SystemExit, GeneratorExit
            self.finish(RolloutStatus.ABORTED, repr(exc))
