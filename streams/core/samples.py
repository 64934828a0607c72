"""Training samples from a Trajectory: path mode and tree mode.

Both read the trajectory as a token trie (``trie.py``): a token is (id, loss mask, behaviour
logprob, policy version), the mask 1 exactly on generated (completion) tokens.

- path mode: one sample per leaf of the trie, its tokens the full root-to-leaf sequence, so the
  adjacent calls of an append-only conversation merge into one sample. Behaviour logprobs are 0
  and token policy versions -1 where the mask is 0. loss_weight = 1 / num_samples, so the
  rollout counts once however many samples it yields.
- tree mode: one packed sample per tree (a subagent's chain with its own prompt is its own
  tree; roots that begin with the same tokens share them and one tree), tokens in DFS
  pre-order with ``parent_indices`` (the previous token on the path, -1 for the root token).
  Reading a leaf's ancestors back gives exactly its path sample, so a shared prefix is stored
  and computed once. loss_weight = leaves in the tree / leaves in the rollout, so each path's
  weight W/L equals its path-mode weight (see consumers/treepack.py).

sample_id = blake2b-128 hex of "mode \\x1f rollout_id \\x1f call ids from the root to the leaf"
(tree mode: the tree's first root call): the same trajectory always yields the same ids and
bytes.

Work is one numpy concatenation per sample array; Python touches each node a constant number
of times, plus once per leaf for the stretch of path only it has (the slices of a stretch that
several leaves share are listed once, at the branch point, and never copied twice).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from rollstream.schemas.events import (
    F32,
    I32,
    I64,
    U8,
    U32,
    Sample,
    SampleMode,
    Trajectory,
)

from .config import SampleConfig
from .trie import Piece, TokenTrie

__all__ = ["build_samples", "sample_id"]

_SEP = "\x1f"
_DEFAULT = SampleConfig()
_ZEROS = np.zeros(1 << 16, F32)  # read-only source of the zero logprobs of prompt tokens
_ZEROS.flags.writeable = False
Array = np.ndarray[Any, Any]
Arrays = tuple[Array, Array, Array, Array]  # (ids, loss mask, logprobs, token versions)


def sample_id(mode: SampleMode | str, rollout_id: str, call_ids: Sequence[str]) -> str:
    """Deterministic id of a sample: blake2b-128 hex of mode, rollout and call-id chain."""
    return _hasher(mode, rollout_id, call_ids).hexdigest()


def build_samples(
    trajectory: Trajectory, config: SampleConfig = _DEFAULT, *, advantage: float = 0.0
) -> list[Sample]:
    """Samples of one trajectory (none when it has no tokens). Raises InvalidTrajectory."""
    trie = TokenTrie(trajectory.nodes, config.share_prefixes)
    leaves = trie.leaves()
    if not leaves:
        return []
    if config.mode is SampleMode.PATH:
        weight = 1.0 / len(leaves)
        return [
            _sample(
                trajectory,
                SampleMode.PATH,
                path.hasher.hexdigest(),
                trajectory.nodes[leaf].call_id,
                path,
                None,
                advantage,
                weight,
            )
            for leaf, path in zip(leaves, _paths(trie, leaves, trajectory.rollout_id), strict=True)
        ]
    samples = []
    for first in trie.root_runs:
        root = trie.nodes[trie.runs[first].node].call_id
        pieces, parents, num_leaves = trie.packed(first, leaves)
        packed = _extend(None, pieces, _hasher(SampleMode.TREE, trajectory.rollout_id, [root]))
        samples.append(
            _sample(
                trajectory,
                SampleMode.TREE,
                packed.hasher.hexdigest(),
                root,
                packed,
                parents,
                advantage,
                num_leaves / len(leaves),
            )
        )
    return samples


class _Path(NamedTuple):
    """A root-to-somewhere path as the slices that make it up (materialized only for a
    sample, so a shared stretch is never copied twice) and what a sample needs about it."""

    ids: list[Array]
    logprobs: list[Array]
    lengths: list[int]
    flags: list[int]  # loss mask value of each slice
    versions: list[int]  # token policy version of each slice (-1 for prompt slices)
    hasher: Any  # blake2b over the sample id text so far
    generated: frozenset[int]  # policy versions of its generated tokens
    oldest_call: int  # smallest policy version of any call on it (when nothing is generated)


def _hasher(mode: SampleMode | str, rollout_id: str, call_ids: Sequence[str]) -> Any:
    return hashlib.blake2b(_SEP.join((str(mode), rollout_id, *call_ids)).encode(), digest_size=16)


def _zeros(n: int) -> Array:
    return _ZEROS[:n] if n <= len(_ZEROS) else np.zeros(n, F32)


def _extend(head: _Path | None, pieces: list[Piece], hasher: Any) -> _Path:
    """``head`` followed by the pieces (each split into its prompt and completion slices)."""
    ids: list[Array]
    logprobs: list[Array]
    lengths: list[int]
    flags: list[int]
    versions: list[int]
    if head is None:
        ids, logprobs, lengths, flags, versions = [], [], [], [], []
        generated: frozenset[int] = frozenset()
        oldest = min(node.policy_version for node, _, _ in pieces)
    else:
        ids, logprobs = list(head.ids), list(head.logprobs)
        lengths, flags, versions = list(head.lengths), list(head.flags), list(head.versions)
        generated = head.generated
        oldest = min(head.oldest_call, *(node.policy_version for node, _, _ in pieces))
    new_versions = set()
    for node, start, end in pieces:
        prompt = node.prompt_tokens
        n_prompt = len(prompt)
        if start < n_prompt:
            stop = end if end < n_prompt else n_prompt
            ids.append(prompt[start:stop])
            logprobs.append(_zeros(stop - start))
            lengths.append(stop - start)
            flags.append(0)
            versions.append(-1)
        if end > n_prompt:
            lo = start - n_prompt if start > n_prompt else 0
            ids.append(node.completion_ids[lo : end - n_prompt])
            logprobs.append(node.completion_logprobs[lo : end - n_prompt])
            lengths.append(end - n_prompt - lo)
            flags.append(1)
            versions.append(node.policy_version)
            new_versions.add(node.policy_version)
    if new_versions - generated:
        generated = generated | new_versions
    return _Path(ids, logprobs, lengths, flags, versions, hasher, generated, oldest)


def _arrays(path: _Path) -> Arrays:
    """(ids, loss mask, logprobs, token versions) of a path: one concatenation each."""
    if not path.ids:
        return np.zeros(0, U32), np.zeros(0, U8), np.zeros(0, F32), np.zeros(0, I64)
    counts = np.array(path.lengths)
    return (
        np.concatenate(path.ids),
        np.repeat(np.array(path.flags, U8), counts),
        np.concatenate(path.logprobs),
        np.repeat(np.array(path.versions, I64), counts),
    )


def _paths(trie: TokenTrie, leaves: list[int], rollout_id: str) -> list[_Path]:
    """Each leaf's path. A key (node, end) names the stretch of path up to position ``end`` of
    that node's own tokens; ``through[key]`` counts the leaves whose path contains it. Walking
    up from a leaf, the stretch ends where the count grows: a branch point, whose path is made
    once (memo) and used as the head of every path below it."""
    nodes, parent, seg_len = trie.nodes, trie.parent, trie.seg_len
    through: dict[tuple[int, int], int] = {(leaf, seg_len[leaf]): 1 for leaf in leaves}
    below = [0] * len(nodes)  # leaves at or under each node
    for leaf in leaves:
        below[leaf] += 1
    for i in range(len(nodes) - 1, -1, -1):  # children come after their parents
        up = parent[i]
        if up >= 0 and below[i]:
            below[up] += below[i]
            key = (up, nodes[i].prefix_len - nodes[up].prefix_len)
            through[key] = through.get(key, 0) + below[i]
    memo: dict[tuple[int, int], _Path] = {}
    out = []
    for leaf in leaves:
        stretches: list[tuple[tuple[int, int], int, list[tuple[int, int]]]] = []
        key = (leaf, seg_len[leaf])
        count, stretch = 1, [key]
        head = None
        x = leaf
        while parent[x] >= 0:
            up = parent[x]
            up_key = (up, nodes[x].prefix_len - nodes[up].prefix_len)
            if through[up_key] != count:  # a branch point above this stretch
                stretches.append((key, count, stretch))
                head = memo.get(up_key)
                if head is not None:
                    stretch = []
                    break
                key, count, stretch = up_key, through[up_key], []
            stretch.append(up_key)
            x = up
        if stretch:
            stretches.append((key, count, stretch))
        for key, count, stretch in reversed(stretches):
            stretch.reverse()  # root first
            ids = [nodes[i].call_id for i, _ in stretch]
            if head is None:
                hasher = _hasher(SampleMode.PATH, rollout_id, ids)
            else:
                hasher = head.hasher.copy()
                hasher.update("".join(_SEP + call_id for call_id in ids).encode())
            head = _extend(head, [(nodes[i], 0, end) for i, end in stretch], hasher)
            if count > 1:
                memo[key] = head
        assert head is not None
        out.append(head)
    return out


def _sample(
    trajectory: Trajectory,
    mode: SampleMode,
    sid: str,
    leaf_id: str,
    path: _Path,
    parents: Array | None,
    advantage: float,
    weight: float,
) -> Sample:
    tokens, mask, logprobs, token_versions = _arrays(path)
    versions = sorted(path.generated)
    return Sample(
        sample_id=sid,
        rollout_id=trajectory.rollout_id,
        group_id=trajectory.group_id,
        task_id=trajectory.task_id,
        input_ids=tokens,
        loss_mask=mask,
        behaviour_logprobs=logprobs,
        advantage=float(advantage),
        reward=float(trajectory.score),
        policy_version=versions[0] if versions else path.oldest_call,
        mode=mode,
        parent_indices=np.zeros(0, I32) if parents is None else parents,
        token_policy_versions=token_versions,
        loss_weight=weight,
        policy_versions=versions,
        leaf_id=leaf_id,
        num_tokens=len(tokens),
    )
