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

Text-only calls (an LlmCall with no tokens at all: no parent, prefix_len 0, empty arrays; what
the proxy's OTLP receiver records for a span without token ids) are never in a sample: only
tokens are laid out and they have none, so a rollout of text-only calls alone yields no sample,
and in a mixed one only the token calls are trained on (the text-only calls' text reaches them
as prompt tokens, masked 0). ``text_only_calls`` counts them in a trajectory.

sample_id = blake2b-128 hex of "mode \\x1f rollout_id \\x1f call ids from the root to the leaf"
(tree mode: the tree's first root call): the same trajectory always yields the same ids and
bytes.

Work: every node's tokens are laid end to end once as the packed bytes of the four sample
arrays (``_Flat``: one ``bytes.join`` each); a sample array is one more join of the few flat
ranges its path covers (nodes that follow each other in the layout merge into one range, so an
append-only path is one slice). Python touches each node a constant number of times (its
path-so-far is made once, from its parent's) and each leaf once.
"""

from __future__ import annotations

import hashlib
import struct
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
    TrajectoryNode,
)

from .config import SampleConfig
from .trie import Piece, TokenTrie, join_buffers

__all__ = ["build_samples", "is_text_only", "sample_id", "text_only_calls"]

_SEP = "\x1f"
_DEFAULT = SampleConfig()
_PROMPT_VERSION = struct.pack("<q", -1)  # token policy version of prompt tokens
_I64_PACK = struct.Struct("<q").pack
_NO_RANGES: list[int] = []
_NO_VERSIONS: frozenset[int] = frozenset()
Array = np.ndarray[Any, Any]
Arrays = tuple[Array, Array, Array, Array]  # (ids, loss mask, logprobs, token versions)


def sample_id(mode: SampleMode | str, rollout_id: str, call_ids: Sequence[str]) -> str:
    """Deterministic id of a sample: blake2b-128 hex of mode, rollout and call-id chain."""
    return _hasher(mode, rollout_id, call_ids).hexdigest()


def is_text_only(node: TrajectoryNode) -> bool:
    """A model call recorded without token ids: no parent, no prefix, no tokens."""
    return (
        node.parent_call_id is None
        and node.prefix_len == 0
        and not len(node.prompt_tokens)
        and not len(node.completion_ids)
    )


def text_only_calls(trajectory: Trajectory) -> int:
    """How many of the trajectory's calls were text-only (duplicates merged into a text-only
    node, ``rollstream.merged.*`` in its metadata, count too)."""
    nodes = {n.call_id for n in trajectory.nodes if is_text_only(n)}
    if not nodes:
        return 0
    merged = sum(
        1
        for key, kept in trajectory.metadata.items()
        if key.startswith("rollstream.merged.") and kept in nodes
    )
    return len(nodes) + merged


def build_samples(
    trajectory: Trajectory, config: SampleConfig = _DEFAULT, *, advantage: float = 0.0
) -> list[Sample]:
    """Samples of one trajectory (none when it has no tokens). Raises InvalidTrajectory."""
    trie = TokenTrie(trajectory.nodes, config.share_prefixes)
    leaves = trie.leaves()
    if not leaves:
        return []
    flat = _Flat(trajectory.nodes, trie)
    if config.mode is SampleMode.PATH:
        weight = 1.0 / len(leaves)
        return [
            _sample(
                trajectory,
                SampleMode.PATH,
                path.hasher.hexdigest(),
                trajectory.nodes[leaf].call_id,
                flat,
                path,
                None,
                advantage,
                weight,
            )
            for leaf, path in zip(
                leaves, _paths(trie, flat, leaves, trajectory.rollout_id), strict=True
            )
        ]
    samples = []
    for first in trie.root_runs:
        root = trie.nodes[trie.runs[first].node].call_id
        pieces, parents, num_leaves = trie.packed(first, leaves)
        packed = _packed(flat, pieces, _hasher(SampleMode.TREE, trajectory.rollout_id, [root]))
        samples.append(
            _sample(
                trajectory,
                SampleMode.TREE,
                packed.hasher.hexdigest(),
                root,
                flat,
                packed,
                parents,
                advantage,
                num_leaves / len(leaves),
            )
        )
    return samples


class _Flat:
    """Every node's own tokens laid end to end, node after node, as the packed bytes of the
    four sample arrays (ids, loss mask, behaviour logprobs, token versions), each made with
    one ``join``; token ``offset[i]`` is where node i's tokens start. A sample is then a few
    slices of these joined once more: a stretch of path whose nodes follow each other here
    (an append-only chain) is one slice. (``bytes.join`` over buffers costs a fraction of
    ``np.concatenate`` per part, and the constant runs are bytes repetitions.)"""

    __slots__ = ("ids", "logprobs", "mask", "offset", "versions")

    def __init__(self, nodes: list[TrajectoryNode], trie: TokenTrie) -> None:
        masks: list[bytes] = []
        logprobs: list[Any] = []
        versions: list[bytes] = []
        patterns: dict[int, bytes] = {}  # policy version -> its 8 bytes
        for node, n in zip(nodes, trie.seg_len, strict=True):
            n_gen = len(node.completion_ids)
            n_prompt = n - n_gen
            pattern = patterns.get(node.policy_version)
            if pattern is None:
                pattern = patterns[node.policy_version] = _I64_PACK(node.policy_version)
            masks += (b"\x00" * n_prompt, b"\x01" * n_gen)
            logprobs += (b"\x00" * (4 * n_prompt), node.completion_logprobs)
            versions += (_PROMPT_VERSION * n_prompt, pattern * n_gen)
        self.offset = trie.offset
        self.ids = memoryview(trie.id_bytes)
        self.mask = memoryview(b"".join(masks))
        self.logprobs = memoryview(join_buffers(logprobs))
        self.versions = memoryview(b"".join(versions))

    def arrays(self, ranges: list[int]) -> Arrays:
        """The four arrays (new, writable) of the flat token ranges [ranges[0], ranges[1]),
        [ranges[2], ranges[3]), ..."""
        spans = list(zip(ranges[::2], ranges[1::2], strict=True))
        ids, mask, logprobs, versions = self.ids, self.mask, self.logprobs, self.versions
        return (
            np.frombuffer(bytearray().join([ids[4 * a : 4 * b] for a, b in spans]), U32),
            np.frombuffer(bytearray().join([mask[a:b] for a, b in spans]), U8),
            np.frombuffer(bytearray().join([logprobs[4 * a : 4 * b] for a, b in spans]), F32),
            np.frombuffer(bytearray().join([versions[8 * a : 8 * b] for a, b in spans]), I64),
        )


class _Path(NamedTuple):
    """A root-to-somewhere path: its flat ranges (start, end, start, end, ...; adjacent ones
    merged) and what a sample needs about it."""

    ranges: list[int]
    hasher: Any  # blake2b over the sample id text so far
    generated: frozenset[int]  # policy versions of its generated tokens
    oldest_call: int  # smallest policy version of any call on it (when nothing is generated)


def _hasher(mode: SampleMode | str, rollout_id: str, call_ids: Sequence[str]) -> Any:
    return hashlib.blake2b(_SEP.join((str(mode), rollout_id, *call_ids)).encode(), digest_size=16)


def _paths(trie: TokenTrie, flat: _Flat, leaves: list[int], rollout_id: str) -> list[_Path]:
    """Each leaf's path. Per node, in node order (a parent comes before its children), what
    its path holds up to where its own tokens begin, made from its parent's: the flat ranges,
    the call ids, the generated policy versions and the oldest call version."""
    nodes, parent, seg_len, offset = trie.nodes, trie.parent, trie.seg_len, flat.offset
    needed = [False] * len(nodes)  # nodes on some leaf's path
    for leaf in leaves:
        x = leaf
        while x >= 0 and not needed[x]:
            needed[x] = True
            x = parent[x]
    ranges: list[list[int]] = [_NO_RANGES] * len(nodes)
    chain: list[str] = [""] * len(nodes)  # sample id text of the call ids root..node
    generated: list[frozenset[int]] = [_NO_VERSIONS] * len(nodes)
    oldest: list[int] = [0] * len(nodes)
    for i, node in enumerate(nodes):
        if not needed[i]:
            continue
        up = parent[i]
        if up < 0:
            chain[i] = node.call_id
            oldest[i] = node.policy_version
            continue
        upper = nodes[up]
        end = node.prefix_len - upper.prefix_len  # where node i hangs in its parent's tokens
        versions = generated[up]
        version = upper.policy_version
        if end > len(upper.prompt_tokens) and version not in versions:
            versions = versions | {version}
        generated[i] = versions
        oldest[i] = oldest[up] if oldest[up] < version else version
        chain[i] = chain[up] + _SEP + node.call_id
        head, start = ranges[up], offset[up]
        if head and head[-1] == start:  # node up's tokens continue the path's last range
            ranges[i] = [*head[:-1], start + end]
        else:
            ranges[i] = [*head, start, start + end]
    prefix = _SEP.join((str(SampleMode.PATH), rollout_id, ""))
    out = []
    for leaf in leaves:
        node = nodes[leaf]
        versions = generated[leaf]
        version = node.policy_version
        if seg_len[leaf] > len(node.prompt_tokens) and version not in versions:
            versions = versions | {version}
        head, start = ranges[leaf], offset[leaf]
        if head and head[-1] == start:
            leaf_ranges = [*head[:-1], start + seg_len[leaf]]
        else:
            leaf_ranges = [*head, start, start + seg_len[leaf]]
        hasher = hashlib.blake2b((prefix + chain[leaf]).encode(), digest_size=16)
        out.append(_Path(leaf_ranges, hasher, versions, min(oldest[leaf], version)))
    return out


def _packed(flat: _Flat, pieces: list[Piece], hasher: Any) -> _Path:
    """The packed tree's pieces, in order, as one path."""
    ranges: list[int] = []
    versions: set[int] = set()
    oldest = min(node.policy_version for node, _, _, _ in pieces)
    for node, i, start, end in pieces:
        a, b = flat.offset[i] + start, flat.offset[i] + end
        if a == b:
            continue
        if ranges and ranges[-1] == a:
            ranges[-1] = b
        else:
            ranges += (a, b)
        if end > len(node.prompt_tokens):
            versions.add(node.policy_version)
    return _Path(ranges, hasher, frozenset(versions), oldest)


def _sample(
    trajectory: Trajectory,
    mode: SampleMode,
    sid: str,
    leaf_id: str,
    flat: _Flat,
    path: _Path,
    parents: Array | None,
    advantage: float,
    weight: float,
) -> Sample:
    tokens, mask, logprobs, token_versions = flat.arrays(path.ranges)
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
