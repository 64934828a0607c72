"""Trajectory builder: a reducer per rollout, ``apply(state, event) -> (state, outputs)``.

Events are applied in seq order (seq is per rollout, gap-free, from 0): a duplicate
(rollout_id, seq) is ignored, an early event waits in ``pending`` until the gap before it
fills. A rollout closes on RolloutFinished, or through ``expire`` after an inactivity timeout
(status truncated). On close the output is one ``Trajectory`` (tree, rewards, score); after it
the state shrinks to a tombstone that still recognises duplicates and refuses later events.

Contract violations never raise: they come out as ``Invalid(event, code, reason)`` values for
the dead-letter topic, and the event's seq counts as consumed.

Lifecycle (``TRANSITIONS``; a (phase, event) pair absent from the table is a violation):

    NEW --RolloutStarted--> RUNNING --LlmCall|ToolCall|Reward|Branch|RolloutError--> RUNNING
     |                         |--StageEvent|SandboxEvent|EvaluatorOutput--> RUNNING
     |                         |--RolloutFinished | timeout--> CLOSED
     |--anything else--> REJECTED (every later event is refused)
     |--timeout--> REJECTED (seq 0 never came)

The lifecycle bodies (``LIFECYCLE_TYPES``: a stage started or finished, a sandbox ready or
released, an evaluator's output) are facts of the rollout service about the rollout, not part
of its trajectory: they take their seq like any event and change neither the tree, the rewards
nor the score (the sink keeps them in their own tables).

``apply`` updates the state it is given in place and returns it; callers keep the returned one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

from rollstream.schemas.events import (
    LIFECYCLE_TYPES,
    Branch,
    Event,
    LlmCall,
    Reward,
    RewardRecord,
    RolloutError,
    RolloutFinished,
    RolloutStarted,
    RolloutStatus,
    ToolCall,
    Trajectory,
)

from .config import BuilderConfig
from .errors import ContractViolation, InvalidCode
from .scoring import REWARD_BOUND, reward_in_bounds, score_trajectories
from .tree import CallTree

__all__ = [
    "TIMEOUT",
    "TRANSITIONS",
    "Invalid",
    "Phase",
    "RolloutOutput",
    "RolloutState",
    "apply",
    "expire",
    "replay",
    "should_evict",
]

_DEFAULT = BuilderConfig()


class Phase(enum.StrEnum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"
    REJECTED = "rejected"


TIMEOUT = "timeout"  # the pseudo-event of expire()

TRANSITIONS: Mapping[tuple[Phase, str], Phase] = {
    (Phase.NEW, "RolloutStarted"): Phase.RUNNING,
    (Phase.NEW, TIMEOUT): Phase.REJECTED,
    (Phase.RUNNING, "LlmCall"): Phase.RUNNING,
    (Phase.RUNNING, "ToolCall"): Phase.RUNNING,
    (Phase.RUNNING, "Reward"): Phase.RUNNING,
    (Phase.RUNNING, "Branch"): Phase.RUNNING,
    (Phase.RUNNING, "RolloutError"): Phase.RUNNING,
    **{(Phase.RUNNING, cls.__name__): Phase.RUNNING for cls in LIFECYCLE_TYPES},
    (Phase.RUNNING, "RolloutFinished"): Phase.CLOSED,
    (Phase.RUNNING, TIMEOUT): Phase.CLOSED,
}
_TERMINAL = frozenset({Phase.CLOSED, Phase.REJECTED})


@dataclass(frozen=True, slots=True)
class Invalid:
    """An event refused by the builder, bound for the DLQ (re-encode it with the Codec)."""

    event: Event
    code: InvalidCode
    reason: str


RolloutOutput: TypeAlias = Trajectory | Invalid


@dataclass(slots=True)
class RolloutState:
    """Everything the builder knows about one rollout. Serialise with ``state_to_bytes``."""

    rollout_id: str
    phase: Phase = Phase.NEW
    next_seq: int = 0  # every seq below it was applied
    event_ids: list[str] = field(default_factory=list)  # by seq, to spot conflicting seqs
    pending: dict[int, Event] = field(default_factory=dict)  # seq > next_seq, waiting
    refused_seqs: set[int] = field(default_factory=set)  # seq > next_seq refused when terminal
    last_ts: int = 0  # largest ts of any accepted event: the inactivity clock
    duplicates: int = 0
    started: RolloutStarted | None = None
    started_ts: int = 0
    tree: CallTree = field(default_factory=CallTree)
    rewards: list[RewardRecord] = field(default_factory=list)
    branches: dict[str, str] = field(default_factory=dict)  # branch_id -> "kind:source_call"
    error: str | None = None
    status: RolloutStatus | None = None


def _refuse(state: RolloutState, event: Event, code: InvalidCode, reason: str) -> Invalid:
    return Invalid(event, code, f"rollout {state.rollout_id} seq {event.seq}: {reason}")


def apply(
    state: RolloutState | None, event: Event, config: BuilderConfig = _DEFAULT
) -> tuple[RolloutState, list[RolloutOutput]]:
    """Apply one event of one rollout. ``state`` None starts a new rollout."""
    if state is None:
        state = RolloutState(event.rollout_id)
    if event.rollout_id != state.rollout_id:
        return state, [_refuse(state, event, InvalidCode.WRONG_ROLLOUT, "another rollout's")]
    seq = event.seq
    if seq < 0:
        return state, [_refuse(state, event, InvalidCode.BAD_SEQ, "negative seq")]
    known = state.pending.get(seq)
    if seq < state.next_seq or known is not None:
        seen_id = state.event_ids[seq] if known is None else known.event_id
        if seen_id != event.event_id:
            return state, [
                _refuse(state, event, InvalidCode.SEQ_CONFLICT, f"seq taken by {seen_id}")
            ]
        state.duplicates += 1
        return state, []
    if seq in state.refused_seqs:
        state.duplicates += 1
        return state, []
    if state.phase in _TERMINAL:
        state.refused_seqs.add(seq)
        return state, [_refuse_terminal(state, event)]
    if event.ts > state.last_ts:
        state.last_ts = event.ts
    if seq > state.next_seq:
        if len(state.pending) >= config.max_pending:
            return state, [
                _refuse(state, event, InvalidCode.REORDER_BUFFER_FULL, "reorder buffer full")
            ]
        state.pending[seq] = event
        return state, []
    outputs: list[RolloutOutput] = []
    _apply_in_order(state, event, config, outputs)
    while state.phase not in _TERMINAL and state.next_seq in state.pending:
        _apply_in_order(state, state.pending.pop(state.next_seq), config, outputs)
    if state.pending and state.phase in _TERMINAL:
        _flush_pending(state, outputs, None)
    return state, outputs


def expire(
    state: RolloutState, now_us: int, config: BuilderConfig = _DEFAULT
) -> tuple[RolloutState, list[RolloutOutput]]:
    """Close a rollout idle for ``config.inactivity_timeout_us`` (status truncated): emits its
    Trajectory with what was applied, and the events stuck behind a gap as Invalid."""
    if state.phase in _TERMINAL or now_us - state.last_ts < config.inactivity_timeout_us:
        return state, []
    outputs: list[RolloutOutput] = []
    missing = state.next_seq
    state.phase = TRANSITIONS[(state.phase, TIMEOUT)]
    if state.phase is Phase.CLOSED:
        state.status = RolloutStatus.TRUNCATED
        outputs.append(_close(state, state.last_ts, "inactivity timeout", config))
    _flush_pending(state, outputs, missing)
    return state, outputs


def should_evict(state: RolloutState, now_us: int, config: BuilderConfig = _DEFAULT) -> bool:
    """True when the shell may delete the state: closed or rejected, and quiet for
    ``config.closed_retention_us`` (after that a late duplicate would be refused as new)."""
    return state.phase in _TERMINAL and now_us - state.last_ts >= config.closed_retention_us


def replay(
    events: Iterable[Event], config: BuilderConfig = _DEFAULT
) -> tuple[dict[str, RolloutState], list[RolloutOutput]]:
    """Run events of any number of rollouts through ``apply`` (tests, replays, benchmarks)."""
    states: dict[str, RolloutState] = {}
    outputs: list[RolloutOutput] = []
    for event in events:
        state, out = apply(states.get(event.rollout_id), event, config)
        states[event.rollout_id] = state
        outputs.extend(out)
    return states, outputs


# --- internals ---------------------------------------------------------------------------------


def _refuse_terminal(state: RolloutState, event: Event) -> Invalid:
    if state.phase is Phase.REJECTED:
        return _refuse(state, event, InvalidCode.REJECTED, "the rollout was refused at seq 0")
    return _refuse(state, event, InvalidCode.AFTER_CLOSE, f"after close ({state.status})")


def _flush_pending(state: RolloutState, outputs: list[RolloutOutput], gap: int | None) -> None:
    for seq in sorted(state.pending):
        event = state.pending[seq]
        state.refused_seqs.add(seq)
        if gap is None:
            outputs.append(_refuse_terminal(state, event))
        else:
            outputs.append(
                _refuse(state, event, InvalidCode.GAP_AT_TIMEOUT, f"seq {gap} never arrived")
            )
    state.pending.clear()


def _apply_in_order(
    state: RolloutState, event: Event, config: BuilderConfig, outputs: list[RolloutOutput]
) -> None:
    state.next_seq += 1
    state.event_ids.append(event.event_id)
    kind = event.kind
    phase = TRANSITIONS.get((state.phase, kind))
    if phase is None:
        if state.phase is Phase.NEW:
            state.phase = Phase.REJECTED
            outputs.append(
                _refuse(
                    state, event, InvalidCode.NOT_STARTED, f"seq 0 is {kind}, not RolloutStarted"
                )
            )
        else:
            outputs.append(_refuse(state, event, InvalidCode.DUPLICATE_START, "started twice"))
        return
    try:
        _HANDLERS[kind](state, event, config)
    except ContractViolation as exc:
        outputs.append(_refuse(state, event, exc.code, exc.reason))
        return
    state.phase = phase
    if phase is Phase.CLOSED:
        outputs.append(_close(state, event.ts, None, config))


def _on_started(state: RolloutState, event: Event, config: BuilderConfig) -> None:
    assert isinstance(event.body, RolloutStarted)
    state.started = event.body
    state.started_ts = event.ts


def _on_llm_call(state: RolloutState, event: Event, config: BuilderConfig) -> None:
    assert isinstance(event.body, LlmCall)
    state.tree.add(event.body, dedup=config.dedup)


def _known_call(state: RolloutState, call_id: str | None) -> str | None:
    if call_id is None:
        return None
    resolved = state.tree.resolve(call_id)
    if resolved is None:
        raise ContractViolation(InvalidCode.UNKNOWN_CALL, f"call {call_id} unknown")
    return resolved


def _on_tool_call(state: RolloutState, event: Event, config: BuilderConfig) -> None:
    assert isinstance(event.body, ToolCall)
    _known_call(state, event.body.at_call_id)


def _on_reward(state: RolloutState, event: Event, config: BuilderConfig) -> None:
    reward = event.body
    assert isinstance(reward, Reward)
    if not reward_in_bounds(reward.value):
        raise ContractViolation(
            InvalidCode.BAD_REWARD,
            f"reward value {reward.value} is not a number in [-{REWARD_BOUND:g}, {REWARD_BOUND:g}]",
        )
    at_call = _known_call(state, reward.at_call_id)
    state.rewards.append(RewardRecord(reward.value, str(reward.kind), reward.name, at_call))


def _on_branch(state: RolloutState, event: Event, config: BuilderConfig) -> None:
    branch = event.body
    assert isinstance(branch, Branch)
    source = _known_call(state, branch.source_call_id)
    state.branches[branch.branch_id] = f"{branch.kind}:{source or ''}"


def _on_error(state: RolloutState, event: Event, config: BuilderConfig) -> None:
    assert isinstance(event.body, RolloutError)
    state.error = f"{event.body.source}: {event.body.message}"


def _on_finished(state: RolloutState, event: Event, config: BuilderConfig) -> None:
    assert isinstance(event.body, RolloutFinished)
    state.status = event.body.status
    if event.body.error is not None:
        state.error = event.body.error


def _on_lifecycle(state: RolloutState, event: Event, config: BuilderConfig) -> None:
    """A lifecycle fact: its seq is consumed, the trajectory does not change."""
    assert isinstance(event.body, LIFECYCLE_TYPES)


_HANDLERS = {
    **{cls.__name__: _on_lifecycle for cls in LIFECYCLE_TYPES},
    "RolloutStarted": _on_started,
    "LlmCall": _on_llm_call,
    "ToolCall": _on_tool_call,
    "Reward": _on_reward,
    "Branch": _on_branch,
    "RolloutError": _on_error,
    "RolloutFinished": _on_finished,
}


def _close(
    state: RolloutState, finished_ts: int, error: str | None, config: BuilderConfig
) -> Trajectory:
    """Build and score the Trajectory, then shrink the state to a tombstone."""
    started = state.started
    assert started is not None and state.status is not None
    metadata = dict(started.metadata)
    for branch_id, value in state.branches.items():
        metadata[f"rollstream.branch.{branch_id}"] = value
    for duplicate, kept in state.tree.aliases.items():
        metadata[f"rollstream.merged.{duplicate}"] = kept
    trajectory = Trajectory(
        rollout_id=state.rollout_id,
        task_id=started.task_id,
        group_id=started.group_id,
        status=str(state.status),
        score=0.0,
        nodes=list(state.tree.nodes.values()),
        attempt=started.attempt,
        group_size=started.group_size,
        run_id=started.run_id,
        error=state.error if state.error is not None else error,
        score_source="none",
        rewards=state.rewards,
        num_events=state.next_seq,
        last_seq=state.next_seq - 1,
        started_ts=state.started_ts,
        finished_ts=finished_ts,
        metadata=dict(sorted(metadata.items())),
    )
    score_trajectories([trajectory], config.score_fn)
    state.tree = CallTree()
    state.rewards = []
    state.branches = {}
    state.started = None
    return trajectory
