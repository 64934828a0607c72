"""Sample builder: path samples are the recorded sequences with the generated tokens masked,
tree samples hold exactly the path samples, ids and bytes are deterministic."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.schemas import Codec
from rollstream.schemas.events import Sample, SampleMode, Trajectory, TrajectoryNode
from rollstream.streams.core import (
    InvalidTrajectory,
    RolloutState,
    SampleConfig,
    build_samples,
    replay,
    sample_id,
    state_from_bytes,
    state_to_bytes,
)

GOLDEN = Path(__file__).parent.parent / "fixtures" / "golden"
_spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
assert _spec is not None and _spec.loader is not None
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)

PATH, TREE = SampleConfig(mode="path"), SampleConfig(mode="tree")
Key = tuple[tuple[int, int, float, int], ...]


def trajectory_of(seed: int, n_calls: int = 10) -> Trajectory:
    _, out = replay(golden.random_rollout(seed, n_calls))
    (trajectory,) = out
    assert isinstance(trajectory, Trajectory)
    return trajectory


def keys(sample: Sample, index: list[int] | None = None) -> Key:
    """(token, mask, logprob, version) per token, optionally at the given positions."""
    rows = zip(
        sample.input_ids.tolist(),
        sample.loss_mask.tolist(),
        sample.behaviour_logprobs.tolist(),
        sample.token_policy_versions.tolist(),
        strict=True,
    )
    table = list(rows)
    return tuple(table if index is None else [table[i] for i in index])


def node_keys(nodes: list[TrajectoryNode]) -> dict[str, Key]:
    """Each node's full sequence as keys, from the TrajectoryNode semantics alone."""
    out: dict[str, Key] = {}
    for n in nodes:
        prefix = () if n.parent_call_id is None else out[n.parent_call_id][: n.prefix_len]
        prompt = tuple((t, 0, 0.0, -1) for t in n.prompt_tokens.tolist())
        gen = tuple(
            (t, 1, lp, n.policy_version)
            for t, lp in zip(n.completion_ids.tolist(), n.completion_logprobs.tolist(), strict=True)
        )
        out[n.call_id] = prefix + prompt + gen
    return out


def tree_paths(sample: Sample) -> list[Key]:
    """Root-to-leaf paths of a tree sample read back through parent_indices."""
    parents = sample.parent_indices.tolist()
    has_child = set(parents)
    paths = []
    for leaf in range(len(parents)):
        if leaf in has_child:
            continue
        path, i = [], leaf
        while i >= 0:
            path.append(i)
            i = parents[i]
        paths.append(keys(sample, path[::-1]))
    return paths


def assert_dfs_preorder(parents: list[int]) -> None:
    """Every token's parent is on the current root-to-token stack (subtrees contiguous)."""
    stack: list[int] = []
    for i, p in enumerate(parents):
        if p == -1:
            stack = []
        else:
            assert p < i and p in stack, f"token {i}: parent {p} not an open ancestor"
            while stack[-1] != p:
                stack.pop()
        stack.append(i)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_calls=st.integers(1, 12))
def test_path_samples_are_the_leaf_sequences_with_generated_tokens_masked(
    seed: int, n_calls: int
) -> None:
    trajectory = trajectory_of(seed, n_calls)
    full = node_keys(trajectory.nodes)
    sequences = {k for k in full.values() if k}
    # a leaf: a sequence that does not continue into another one
    leaves = {
        k for k in sequences if not any(len(o) > len(k) and o[: len(k)] == k for o in sequences)
    }
    samples = build_samples(trajectory, PATH)
    assert sorted(keys(s) for s in samples) == sorted(leaves)
    for s in samples:
        assert s.mode == SampleMode.PATH and s.num_tokens == len(s.input_ids)
        assert (
            keys(s) == full[s.leaf_id]
        )  # concatenated tokens = the leaf call's prompt + completion
        assert np.all(s.behaviour_logprobs[s.loss_mask == 0] == 0)
        assert np.all(s.token_policy_versions[s.loss_mask == 0] == -1)
        generated = s.token_policy_versions[s.loss_mask == 1]
        assert s.policy_versions == sorted(set(generated.tolist()))
        if len(generated):
            assert s.policy_version == generated.min()
        assert s.loss_weight == pytest.approx(1 / len(samples))
    assert len({s.sample_id for s in samples}) == len(samples)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_calls=st.integers(1, 12), share=st.booleans())
def test_tree_samples_hold_exactly_the_path_samples(seed: int, n_calls: int, share: bool) -> None:
    trajectory = trajectory_of(seed, n_calls)
    paths = build_samples(trajectory, SampleConfig("path", share_prefixes=share))
    trees = build_samples(trajectory, SampleConfig("tree", share_prefixes=share))
    roots = [n.call_id for n in trajectory.nodes if n.parent_call_id is None]
    assert {t.leaf_id for t in trees} <= set(roots)
    if not share:  # every root with tokens is its own tree
        assert [t.leaf_id for t in trees] == [
            r for r in roots if any(t.leaf_id == r for t in trees)
        ]
    from_trees: list[Key] = []
    for tree in trees:
        parents = tree.parent_indices.tolist()
        assert parents[0] == -1 and parents.count(-1) == 1
        assert_dfs_preorder(parents)
        tree_leaves = tree_paths(tree)
        assert tree.loss_weight == pytest.approx(len(tree_leaves) / len(paths))
        from_trees += tree_leaves
    assert Counter(from_trees) == Counter(keys(p) for p in paths)
    assert sum(t.loss_weight for t in trees) == pytest.approx(1.0 if paths else 0.0)
    # a token of the tree is a distinct trie position: never more tokens than the paths carry
    assert sum(t.num_tokens for t in trees) <= sum(p.num_tokens for p in paths)


def test_shared_prefixes_are_stored_once() -> None:
    log = golden.Log("r", task_id="t", group_id="g")
    log.call("c1", None, 0, [1] * 50, [2] * 10)
    for i in range(4):  # four retries of one prompt, each with its own answer
        log.call(f"r{i}", "c1", 60, [3] * 20, [10 + i] * 5)
    _, (trajectory,) = replay(log.add(golden.RolloutFinished()).events)
    paths = build_samples(trajectory, PATH)
    (tree,) = build_samples(trajectory, TREE)
    assert [p.num_tokens for p in paths] == [85] * 4
    assert tree.num_tokens == 60 + 20 + 4 * 5
    (unshared,) = build_samples(trajectory, SampleConfig("tree", share_prefixes=False))
    assert unshared.num_tokens == 60 + 4 * 25


@pytest.mark.parametrize("case", ["append_only", "rewind", "retry", "subagent", "groups"])
def test_ids_and_bytes_are_deterministic(case: str) -> None:
    codec = Codec()
    events = [golden.Event.from_json(e.to_json()) for e in getattr(golden, case)()]
    first = sorted(replay(events)[1], key=lambda t: t.rollout_id)
    again = sorted(replay(events[::-1])[1], key=lambda t: t.rollout_id)
    for config in (PATH, TREE):
        a = [codec.encode(s) for t in first for s in build_samples(t, config)]
        b = [codec.encode(s) for t in again for s in build_samples(t, config)]
        assert a == b and a
    t = first[0]
    restored = codec.decode(codec.encode(t))  # through the trajectories topic
    assert [codec.encode(s) for s in build_samples(restored, TREE)] == [
        codec.encode(s) for s in build_samples(t, TREE)
    ]


def test_sample_id_is_blake2b_of_mode_rollout_and_chain() -> None:
    import hashlib

    want = hashlib.blake2b(b"path\x1fr1\x1fc1\x1fc2", digest_size=16).hexdigest()
    assert sample_id("path", "r1", ["c1", "c2"]) == want
    assert sample_id("tree", "r1", ["c1", "c2"]) != want


def test_broken_trajectories_raise_invalid_trajectory() -> None:
    state = replay(golden.append_only()[:3])[0]["r-append"]
    node = state.tree.nodes["c1"]

    def with_nodes(*nodes: TrajectoryNode) -> Trajectory:
        return Trajectory("r", "t", "g", "completed", 1.0, list(nodes))

    orphan = TrajectoryNode(
        "x", "missing", 1, node.prompt_tokens, node.completion_ids, node.completion_logprobs
    )
    too_far = TrajectoryNode(
        "y", "c1", 99, node.prompt_tokens, node.completion_ids, node.completion_logprobs
    )
    short = TrajectoryNode(
        "z", None, 0, node.prompt_tokens, node.completion_ids, node.completion_logprobs[:1]
    )
    for bad in (
        with_nodes(orphan),
        with_nodes(node, too_far),
        with_nodes(short),
        with_nodes(node, node),
    ):
        with pytest.raises(InvalidTrajectory):
            build_samples(bad, PATH)
    assert build_samples(with_nodes(), PATH) == []
    snapshot = state_from_bytes(state_to_bytes(state))
    assert isinstance(snapshot, RolloutState) and snapshot.tree.nodes["c1"] == node


def test_empty_calls_add_no_samples() -> None:
    log = golden.Log("r", task_id="t", group_id="g")
    log.call("c1", None, 0, [], [])  # nothing at all
    log.call("c2", None, 0, [1], [2])
    log.call("c3", "c2", 2, [], [])  # an empty append: same sequence as c2
    _, (trajectory,) = replay(log.add(golden.RolloutFinished()).events)
    for config in (PATH, TREE):
        (sample,) = build_samples(trajectory, config)
        assert sample.input_ids.tolist() == [1, 2] and sample.leaf_id == "c2"
        assert sample.loss_weight == 1.0


def test_sample_arrays_are_fresh_whatever_the_node_arrays_are() -> None:
    """Node arrays may be read-only views of decoded bytes or strided views; sample arrays
    are new, writable, contiguous arrays that share memory with nothing."""
    trajectory = trajectory_of(7, 12)
    strided = Trajectory(
        "r-random",
        "t",
        "g",
        "completed",
        1.0,
        [
            TrajectoryNode(
                n.call_id,
                n.parent_call_id,
                n.prefix_len,
                np.repeat(n.prompt_tokens, 2)[::2],  # same values, not contiguous
                np.repeat(n.completion_ids, 2)[::2],
                np.repeat(n.completion_logprobs, 2)[::2],
                n.policy_version,
                n.finish_reason,
            )
            for n in trajectory.nodes
        ],
    )
    assert not all(n.completion_ids.flags.c_contiguous for n in strided.nodes)
    codec = Codec()
    decoded = codec.decode(codec.encode(trajectory))  # read-only views of the record bytes
    for config in (PATH, TREE):
        want = build_samples(trajectory, config)
        for other in (strided, decoded):
            assert [keys(s) for s in build_samples(other, config)] == [keys(s) for s in want]
        samples = build_samples(decoded, config)
        arrays = [
            getattr(s, name)
            for s in samples
            for name in ("input_ids", "loss_mask", "behaviour_logprobs", "token_policy_versions")
        ]
        for i, a in enumerate(arrays):
            assert a.flags.writeable and a.flags.c_contiguous
            assert not any(np.shares_memory(a, b) for b in arrays[i + 1 :])
            for node in decoded.nodes:
                assert not np.shares_memory(a, node.prompt_tokens)
                assert not np.shares_memory(a, node.completion_logprobs)
