"""Golden event logs through the stream core: exact outputs, hand-checked token lists, and the
same outputs when the logs arrive shuffled and duplicated."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.schemas.events import (
    EvaluatorOutput,
    Event,
    RolloutFinished,
    SampleMode,
    SandboxEvent,
    SandboxPhase,
    StageEvent,
    StageName,
    StagePhase,
    Trajectory,
)
from rollstream.streams.core import (
    GroupClosed,
    GroupConfig,
    Invalid,
    SampleConfig,
    add_to_group,
    build_samples,
    replay,
)

GOLDEN = Path(__file__).parent.parent / "fixtures" / "golden"
CASES = sorted(p.name.removesuffix(".events.jsonl") for p in GOLDEN.glob("*.events.jsonl"))
LP = [-0.125, -0.25, -0.375]  # the logprobs the golden logs give completion tokens 1, 2, 3


def load(case: str) -> list[Event]:
    lines = (GOLDEN / f"{case}.events.jsonl").read_text().splitlines()
    return [Event.from_json(json.loads(line)) for line in lines]


def expected(case: str) -> dict[str, Any]:
    return json.loads((GOLDEN / f"{case}.expected.json").read_text())


def rebuild(events: list[Event]) -> dict[str, Any]:
    """Trajectories (sorted by rollout) and refused events (sorted) as JSON-able data."""
    _, out = replay(events)
    trajectories = sorted((o for o in out if isinstance(o, Trajectory)), key=lambda t: t.rollout_id)
    invalid = sorted(
        [o.event.rollout_id, o.event.seq, str(o.code)] for o in out if isinstance(o, Invalid)
    )
    return {"trajectories": trajectories, "invalid": invalid}


def samples_json(trajectories: list[Trajectory], mode: SampleMode) -> list[dict[str, Any]]:
    config = SampleConfig(mode=mode)
    return [s.to_json() for t in trajectories for s in build_samples(t, config)]


def groups_json(trajectories: list[Trajectory], mode: SampleMode) -> list[dict[str, Any]]:
    config = GroupConfig(samples=SampleConfig(mode=mode))
    states: dict[str, Any] = {}
    closed: list[GroupClosed] = []
    for t in trajectories:
        states[t.group_id], out = add_to_group(states.get(t.group_id), t, config)
        closed += [o for o in out if isinstance(o, GroupClosed)]
    return [
        {
            "group_id": g.group_id,
            "stats": {k: getattr(g.stats, k) for k in g.stats.__slots__},
            "samples": [s.to_json() for s in g.samples],
        }
        for g in sorted(closed, key=lambda g: g.group_id)
    ]


def test_every_issue_case_has_a_golden_log() -> None:
    assert {"append_only", "rewind", "retry", "subagent", "failed", "groups"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_golden_outputs_exactly(case: str) -> None:
    want = expected(case)
    got = rebuild(load(case))
    assert [t.to_json() for t in got["trajectories"]] == want["trajectories"]
    assert got["invalid"] == want["invalid"]
    for mode in SampleMode:
        assert samples_json(got["trajectories"], mode) == want[f"samples_{mode}"]
        assert groups_json(got["trajectories"], mode) == want[f"groups_{mode}"]


def shuffled_with_duplicates(events: list[Event], seed: int) -> list[Event]:
    rng = random.Random(seed)
    noisy = events + [rng.choice(events) for _ in range(rng.randint(1, len(events)))]
    rng.shuffle(noisy)
    return noisy


@pytest.mark.parametrize("case", CASES)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_shuffled_and_duplicated_logs_give_identical_outputs(case: str, seed: int) -> None:
    want = expected(case)
    got = rebuild(shuffled_with_duplicates(load(case), seed))
    assert [t.to_json() for t in got["trajectories"]] == want["trajectories"]
    assert got["invalid"] == want["invalid"]
    for mode in SampleMode:
        assert groups_json(got["trajectories"], mode) == want[f"groups_{mode}"]


# --- hand-checked cases ------------------------------------------------------------------------


def nodes_of(trajectory: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (
            n["call_id"],
            n["parent_call_id"],
            n["prefix_len"],
            n["prompt_tokens"],
            n["completion_ids"],
        )
        for n in trajectory["nodes"]
    ]


def test_append_only_by_hand() -> None:
    want = expected("append_only")
    (traj,) = want["trajectories"]
    assert (traj["status"], traj["score"], traj["score_source"]) == ("completed", 1.0, "final")
    assert nodes_of(traj) == [
        ("c1", None, 0, [1, 2, 3], [10, 11]),
        ("c2", "c1", 5, [4, 5], [12, 13, 14]),
        ("c3", "c2", 10, [6], [15]),
    ]
    (path,) = want["samples_path"]  # three adjacent calls merged into one sample
    assert path["input_ids"] == [1, 2, 3, 10, 11, 4, 5, 12, 13, 14, 6, 15]
    assert path["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1]
    assert path["behaviour_logprobs"] == [0, 0, 0, *LP[:2], 0, 0, *LP, 0, LP[0]]
    assert path["token_policy_versions"] == [-1, -1, -1, 1, 1, -1, -1, 1, 1, 1, -1, 2]
    assert (path["policy_version"], path["policy_versions"]) == (1, [1, 2])
    assert (path["loss_weight"], path["leaf_id"], path["num_tokens"]) == (1.0, "c3", 12)
    (tree,) = want["samples_tree"]
    assert tree["input_ids"] == path["input_ids"]
    assert tree["parent_indices"] == list(range(-1, 11))


def test_rewind_by_hand() -> None:
    (traj,) = expected("rewind")["trajectories"]
    assert nodes_of(traj) == [
        ("c1", None, 0, [1, 2, 3], [10, 11]),
        ("c2", "c1", 5, [4, 5], [12, 13]),
        # c3 named c2 with prefix_len 4: only c1's first 4 tokens are kept -> child of c1
        ("c3", "c1", 4, [7, 8], [16]),
        # c4 said prefix_len 5 of c3 + [8, 16, 9]: [8, 16] repeat c3's tail -> an append to c3
        ("c4", "c3", 7, [9], [17, 18]),
    ]
    c2, c4 = expected("rewind")["samples_path"]
    assert (c2["leaf_id"], c4["leaf_id"]) == ("c2", "c4")
    assert c2["input_ids"] == [1, 2, 3, 10, 11, 4, 5, 12, 13]
    assert c2["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert c4["input_ids"] == [1, 2, 3, 10, 7, 8, 16, 9, 17, 18]
    assert c4["loss_mask"] == [0, 0, 0, 1, 0, 0, 1, 0, 1, 1]
    assert c4["behaviour_logprobs"] == [0, 0, 0, LP[0], 0, 0, LP[0], 0, *LP[:2]]
    assert c2["loss_weight"] == c4["loss_weight"] == 0.5
    (tree,) = expected("rewind")["samples_tree"]
    # c1 | c2 under c1's last token (4) | c3 under token 10 (index 3) | c4 under c3's last
    assert tree["input_ids"] == [1, 2, 3, 10, 11, 4, 5, 12, 13, 7, 8, 16, 9, 17, 18]
    assert tree["parent_indices"] == [-1, 0, 1, 2, 3, 4, 5, 6, 7, 3, 9, 10, 11, 12, 13]
    assert tree["loss_weight"] == 1.0


def test_retry_by_hand() -> None:
    want = expected("retry")
    (traj,) = want["trajectories"]
    assert nodes_of(traj) == [
        ("c1", None, 0, [1, 2], [10, 11]),
        ("c2", "c1", 4, [3, 4], [12]),
        ("c3", "c1", 4, [3, 4], [13, 14]),  # the retry; c4 was identical and merged into it
        ("c5", "c3", 8, [5], [15]),
    ]
    assert traj["metadata"] == {"rollstream.branch.b1": "retry:c2", "rollstream.merged.c4": "c3"}
    assert traj["rewards"][0]["at_call_id"] == "c3"  # the reward named c4, merged into c3
    assert [s["input_ids"] for s in want["samples_path"]] == [
        [1, 2, 10, 11, 3, 4, 12],
        [1, 2, 10, 11, 3, 4, 13, 14, 5, 15],
    ]
    (tree,) = want["samples_tree"]  # the retried prompt [3, 4] is stored once
    assert tree["input_ids"] == [1, 2, 10, 11, 3, 4, 12, 13, 14, 5, 15]
    assert tree["parent_indices"] == [-1, 0, 1, 2, 3, 4, 5, 5, 7, 8, 9]


def test_subagent_failed_and_group_cases() -> None:
    (sub,) = expected("subagent")["trajectories"]
    assert [n["parent_call_id"] for n in sub["nodes"]] == [None, None, "s1", "c1"]
    trees = expected("subagent")["samples_tree"]
    assert [(t["leaf_id"], t["loss_weight"]) for t in trees] == [("c1", 0.5), ("s1", 0.5)]
    (failed,) = expected("failed")["trajectories"]
    assert (failed["status"], failed["score_source"], failed["error"]) == (
        "failed",
        "partial",
        "sandbox crashed",
    )
    assert failed["score"] == pytest.approx(0.25 + 0.25 - 0.1)
    mixed, same = expected("groups")["groups_path"]
    assert (mixed["group_id"], mixed["stats"]["dropped_zero_variance"]) == ("g-mixed", False)
    assert [s["advantage"] for s in mixed["samples"]] == pytest.approx(
        [x * 0.5 / (0.5 + 1e-6) for x in (1, -1, -1, 1)]
    )
    assert (same["group_id"], same["stats"]["dropped_zero_variance"], same["samples"]) == (
        "g-same",
        True,
        [],
    )


# --- lifecycle facts interleaved ---------------------------------------------------------------


def with_lifecycle(events: list[Event]) -> tuple[list[Event], dict[str, int]]:
    """Each rollout's log with lifecycle bodies (stage, sandbox, evaluator output) after every
    event but its RolloutFinished, seqs renumbered gap-free; and how many each rollout got."""
    by_rollout: dict[str, dict[int, Event]] = {}
    for event in events:
        by_rollout.setdefault(event.rollout_id, {}).setdefault(event.seq, event)
    facts = [
        StageEvent(StageName.INIT, StagePhase.STARTED, job_id="j", worker="w"),
        SandboxEvent("sb-1", SandboxPhase.READY, kind="bwrap", duration_ms=12.5, job_id="j"),
        StageEvent(StageName.RUN, StagePhase.FINISHED, "ok", 950.0, "j", "w", ""),
        EvaluatorOutput("suite", "ok", 3, 4, "3 passed, 1 failed", False, "j"),
        SandboxEvent("sb-1", SandboxPhase.RELEASED, kind="bwrap", duration_ms=3.0, job_id="j"),
    ]
    out: list[Event] = []
    added: dict[str, int] = {}
    for rid, by_seq in by_rollout.items():
        seq = 0
        for i, old in enumerate(by_seq[s] for s in sorted(by_seq)):
            out.append(dataclasses.replace(old, seq=seq))
            seq += 1
            if isinstance(old.body, RolloutFinished):
                continue
            body = facts[i % len(facts)]
            out.append(Event(f"{old.event_id}.life", rid, seq, old.ts, body, producer="svc"))
            seq += 1
            added[rid] = added.get(rid, 0) + 1
    return out, added


LIFECYCLE_CASES = [c for c in CASES if c != "invalid"]  # that one's seqs are the point


def test_golden_cases_are_gap_free_so_lifecycle_can_be_interleaved() -> None:
    for case in LIFECYCLE_CASES:
        by_rollout: dict[str, set[int]] = {}
        for event in load(case):
            by_rollout.setdefault(event.rollout_id, set()).add(event.seq)
        assert all(seqs == set(range(len(seqs))) for seqs in by_rollout.values()), case


@pytest.mark.parametrize("case", LIFECYCLE_CASES)
def test_lifecycle_events_change_no_trajectory_nor_sample(case: str) -> None:
    want = expected(case)
    events, added = with_lifecycle(load(case))
    assert sum(added.values()) > 0
    got = rebuild(shuffled_with_duplicates(events, seed=len(events)))
    assert got["invalid"] == want["invalid"]  # accepted: no dead letter
    trajectories = [t.to_json() for t in got["trajectories"]]
    assert len(trajectories) == len(want["trajectories"])
    for t, w in zip(trajectories, want["trajectories"], strict=True):
        extra = added.get(t["rollout_id"], 0)
        assert t["num_events"] == w["num_events"] + extra  # their seqs were consumed
        assert t["last_seq"] == w["last_seq"] + extra
        drop = {"num_events", "last_seq"}
        assert {k: v for k, v in t.items() if k not in drop} == {
            k: v for k, v in w.items() if k not in drop
        }
    for mode in SampleMode:
        assert samples_json(got["trajectories"], mode) == want[f"samples_{mode}"]
        assert groups_json(got["trajectories"], mode) == want[f"groups_{mode}"]
