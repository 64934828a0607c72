"""Trajectory builder: ordering, idempotence, lifecycle, contract violations as values, timeouts,
scoring, and state snapshots."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.schemas.events import (
    Branch,
    Event,
    LlmCall,
    Reward,
    RolloutFinished,
    RolloutStarted,
    ToolCall,
    Trajectory,
)
from rollstream.streams.core import (
    TRANSITIONS,
    BuilderConfig,
    ConfigError,
    GroupConfig,
    GroupState,
    Invalid,
    InvalidCode,
    Phase,
    RolloutState,
    Score,
    ScoringError,
    StateFormatError,
    add_to_group,
    apply,
    expire,
    replay,
    should_evict,
    state_from_bytes,
    state_to_bytes,
)

GOLDEN = Path(__file__).parent.parent / "fixtures" / "golden"
_spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
assert _spec is not None and _spec.loader is not None
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)


def load(case: str) -> list[Event]:
    lines = (GOLDEN / f"{case}.events.jsonl").read_text().splitlines()
    return [Event.from_json(json.loads(line)) for line in lines]


def run(events: list[Event], config: BuilderConfig | None = None) -> tuple[RolloutState, list[Any]]:
    state: RolloutState | None = None
    outputs: list[Any] = []
    for event in events:
        state, out = apply(state, event, config or BuilderConfig())
        outputs += out
    assert state is not None
    return state, outputs


def codes(outputs: list[Any]) -> list[tuple[int, str]]:
    return [(o.event.seq, str(o.code)) for o in outputs if isinstance(o, Invalid)]


def small_log() -> Any:
    log = golden.Log("r1", task_id="t1", group_id="g1", group_size=2)
    log.call("c1", None, 0, [1, 2], [3])
    log.call("c2", "c1", 3, [4], [5, 6])
    return log


# --- lifecycle table and ordering -------------------------------------------------------------


def test_transition_table_is_explicit() -> None:
    assert TRANSITIONS[(Phase.NEW, "RolloutStarted")] is Phase.RUNNING
    assert TRANSITIONS[(Phase.RUNNING, "RolloutFinished")] is Phase.CLOSED
    assert TRANSITIONS[(Phase.RUNNING, "timeout")] is Phase.CLOSED
    assert (Phase.NEW, "LlmCall") not in TRANSITIONS
    assert (Phase.RUNNING, "RolloutStarted") not in TRANSITIONS
    assert not any(phase in (Phase.CLOSED, Phase.REJECTED) for phase, _ in TRANSITIONS)


def test_out_of_order_events_wait_for_the_gap() -> None:
    events = small_log().add(RolloutFinished("completed")).events
    state, out = apply(None, events[3])
    assert out == [] and state.next_seq == 0 and sorted(state.pending) == [3]
    state, out = apply(state, events[2])
    state, out = apply(state, events[0])
    assert out == [] and state.next_seq == 1  # seq 1 still missing
    state, out = apply(state, events[1])
    (trajectory,) = out
    assert isinstance(trajectory, Trajectory)
    assert [n.call_id for n in trajectory.nodes] == ["c1", "c2"]
    assert (state.phase, state.next_seq, state.pending) == (Phase.CLOSED, 4, {})


def test_duplicates_are_ignored_and_conflicting_seqs_refused() -> None:
    events = small_log().events
    state, out = run([events[0], events[0], events[2], events[2], events[1]])
    assert out == [] and state.duplicates == 2 and state.next_seq == 3
    impostor = Event("other-id", "r1", 1, events[1].ts, events[1].body)
    state, out = apply(state, impostor)
    assert codes(out) == [(1, "seq_conflict")]


def test_first_event_must_be_rollout_started() -> None:
    call = LlmCall("c1", None, 0, [1], [2], [-0.5])
    events = [
        Event(f"x{i}", "r2", i, i, body) for i, body in enumerate([call, Reward(1.0), Reward(2.0)])
    ]
    state, out = run([events[2], events[1], events[0]])  # 1 and 2 wait for seq 0
    assert codes(out) == [(0, "not_started"), (1, "rejected"), (2, "rejected")]
    assert state.phase is Phase.REJECTED
    assert codes(apply(state, Event("x3", "r2", 3, 3, Reward(0.0)))[1]) == [(3, "rejected")]


def test_started_twice_wrong_rollout_negative_seq() -> None:
    log = small_log().add(RolloutStarted("t1", "g1"))
    state, out = run(log.events)
    assert codes(out) == [(3, "duplicate_start")]
    stray = Event("s", "r-other", 4, 1, Reward(1.0))
    assert codes(apply(state, stray)[1]) == [(4, "wrong_rollout")]
    assert codes(apply(state, Event("n", "r1", -1, 1, Reward(1.0)))[1]) == [(-1, "bad_seq")]


def test_contract_violations_are_values_and_consume_their_seq() -> None:
    log = small_log()
    log.call("c1", None, 0, [9], [9])  # call_id reused
    log.call("c3", None, 2, [9], [9])  # prefix without a parent
    log.add(Reward(float("nan"), "final"))
    log.add(Branch("b1", "retry", "c404"))
    log.add(ToolCall("t1", "ls", at_call_id="c404"))
    log.add(Reward(1.0, "final", at_call_id="c2"))
    log.add(RolloutFinished("completed"))
    _, out = run(log.events)
    assert codes(out) == [
        (3, "duplicate_call_id"),
        (4, "prefix_out_of_range"),
        (5, "bad_reward"),
        (6, "unknown_call"),
        (7, "unknown_call"),
    ]
    (trajectory,) = [o for o in out if isinstance(o, Trajectory)]
    assert trajectory.score == 1.0 and trajectory.num_events == 10 and trajectory.last_seq == 9
    for invalid in (o for o in out if isinstance(o, Invalid)):
        assert invalid.reason.startswith(f"rollout r1 seq {invalid.event.seq}: ")


def test_events_after_close_are_refused_including_buffered_ones() -> None:
    log = small_log().add(RolloutFinished("completed")).add(Reward(1.0)).add(Reward(2.0))
    events = log.events
    state, out = run([events[5], *events[:4]])  # seq 5 buffered, flushed at close
    assert codes(out) == [(5, "after_close")]
    state, out = apply(state, events[4])
    assert codes(out) == [(4, "after_close")]
    assert apply(state, events[4])[1] == []  # a duplicate of a refused event: ignored
    assert state.tree.nodes == {} and state.started is None  # tombstone only


def test_reorder_buffer_is_bounded() -> None:
    events = small_log().events
    _, out = run([events[2], events[1]], BuilderConfig(max_pending=1))
    assert codes(out) == [(1, "reorder_buffer_full")]


# --- timeouts ---------------------------------------------------------------------------------


def test_expire_truncates_an_idle_rollout_and_refuses_what_is_behind_a_gap() -> None:
    log = small_log().add(Reward(0.5, "milestone"))  # seq 3
    log.add(ToolCall("t1", "ls")).add(Reward(9.0, "final"))  # seq 4 is lost, 5 waits for it
    events = log.events
    config = BuilderConfig(inactivity_timeout_us=1_000)
    state, _ = run([*events[:4], events[5]], config)
    last = state.last_ts
    assert expire(state, last + 999, config)[1] == []
    state, out = expire(state, last + 1_000, config)
    trajectory, refused = out
    assert isinstance(trajectory, Trajectory) and isinstance(refused, Invalid)
    assert (trajectory.status, trajectory.score_source, trajectory.score) == (
        "truncated",
        "partial",
        0.5,
    )
    assert trajectory.finished_ts == last and trajectory.error == "inactivity timeout"
    assert (refused.event.seq, refused.code) == (5, InvalidCode.GAP_AT_TIMEOUT)
    assert codes(apply(state, events[4], config)[1]) == [(4, "after_close")]
    assert not should_evict(state, last + 1_000, config)
    assert should_evict(state, last + config.closed_retention_us, config)


def test_expire_of_a_rollout_that_never_started() -> None:
    events = small_log().events
    config = BuilderConfig(inactivity_timeout_us=10)
    state, _ = run(events[1:], config)
    state, out = expire(state, state.last_ts + 10, config)
    assert codes(out) == [(1, "gap_at_timeout"), (2, "gap_at_timeout")]
    assert state.phase is Phase.REJECTED
    assert expire(state, state.last_ts + 10**9, config)[1] == []  # expiring twice: nothing


# --- scoring ----------------------------------------------------------------------------------


def test_scorers_are_chosen_by_name() -> None:
    events = small_log().add(Reward(0.5, "milestone")).add(RolloutFinished("failed")).events
    (t,) = [o for o in run(events)[1] if isinstance(o, Trajectory)]
    assert (t.score, t.score_source) == (0.5, "partial")
    (t,) = [
        o for o in run(events, BuilderConfig(scorer="final_only"))[1] if isinstance(o, Trajectory)
    ]
    assert (t.score, t.score_source) == (0.0, "none")

    def tokens_generated(trajectories: Any) -> list[Score]:
        return [
            Score(float(sum(len(n.completion_ids) for n in t.nodes)), "partial")
            for t in trajectories
        ]

    config = BuilderConfig(scorer="length", scorers={"length": tokens_generated})
    (t,) = [o for o in run(events, config)[1] if isinstance(o, Trajectory)]
    assert t.score == 3.0
    with pytest.raises(ConfigError):
        BuilderConfig(scorer="nope")

    def broken(trajectories: Any) -> list[Score]:
        raise RuntimeError("boom")

    with pytest.raises(ScoringError):
        run(events, BuilderConfig(scorer="b", scorers={"b": broken}))


# --- tree rebuild against the naive LlmCall semantics -----------------------------------------


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dedup=st.booleans())
def test_nodes_keep_every_calls_exact_token_sequence(seed: int, dedup: bool) -> None:
    events = golden.random_rollout(seed, n_calls=10)
    full = golden.full_sequences(events)
    _, out = run(events, BuilderConfig(dedup=dedup))
    (trajectory,) = out
    nodes = {n.call_id: n for n in trajectory.nodes}
    rebuilt: dict[str, list[int]] = {}
    for node in trajectory.nodes:  # TrajectoryNode semantics: parent's prefix + prompt + completion
        prefix = [] if node.parent_call_id is None else rebuilt[node.parent_call_id]
        assert (
            node.parent_call_id is None or nodes[node.parent_call_id].prefix_len < node.prefix_len
        )
        rebuilt[node.call_id] = (
            prefix[: node.prefix_len] + node.prompt_tokens.tolist() + node.completion_ids.tolist()
        )
        assert rebuilt[node.call_id] == full[node.call_id]
    merged = {k.removeprefix("rollstream.merged."): v for k, v in trajectory.metadata.items()}
    assert set(merged) | set(nodes) == set(full)
    for duplicate, kept in merged.items():
        assert full[duplicate] == full[kept]
    if not dedup:
        assert merged == {}


# --- snapshots --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["append_only", "rewind", "retry", "subagent", "failed", "invalid"]
)
def test_snapshot_after_every_event_changes_nothing(case: str) -> None:
    events = load(case)
    order = events[::-1]  # worst case: everything buffered until seq 0
    _, want = run(order)
    state: RolloutState | None = None
    got: list[Any] = []
    for event in order:
        state, out = apply(state, event)
        got += out
        data = state_to_bytes(state)
        state = state_from_bytes(data)
        assert isinstance(state, RolloutState)
        assert state_to_bytes(state) == data  # deterministic
    assert [o.to_json() for o in got if isinstance(o, Trajectory)] == [
        o.to_json() for o in want if isinstance(o, Trajectory)
    ]
    assert codes(got) == codes(want)


def test_group_state_snapshot_and_bad_bytes() -> None:
    _, out = replay(load("groups"))
    trajectories = [o for o in out if isinstance(o, Trajectory) and o.group_id == "g-mixed"]
    state, _ = add_to_group(None, trajectories[0], GroupConfig())
    state, _ = add_to_group(state, trajectories[1], GroupConfig())
    data = state_to_bytes(state)
    restored = state_from_bytes(data)
    assert isinstance(restored, GroupState) and state_to_bytes(restored) == data
    for t in trajectories[2:]:
        state, out_a = add_to_group(state, t)
        restored, out_b = add_to_group(restored, t)
    assert [s.to_json() for s in out_a[0].samples] == [s.to_json() for s in out_b[0].samples]
    for bad in (b"", b"nope" * 4, data[:-3] + b"\xff\xff\xff", data[:20]):
        with pytest.raises(StateFormatError):
            state_from_bytes(bad)


def test_restored_arrays_are_zero_copy_views() -> None:
    state, _ = run(small_log().events)
    restored = state_from_bytes(state_to_bytes(state))
    assert isinstance(restored, RolloutState)
    node = restored.tree.nodes["c2"]
    assert not node.completion_ids.flags.writeable
    assert np.array_equal(node.completion_ids, [5, 6]) and node.prefix_len == 3
