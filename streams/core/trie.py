"""A trajectory's nodes laid out as a token trie (a radix tree of *runs*), shared by both
sample modes.

A token is the tuple (id, loss mask, behaviour logprob, policy version); the mask is 1 exactly on
completion tokens. Each node's own tokens (prompt_tokens then completion_ids) hang under its
tree parent at position prefix_len. Laying out a node reuses its ancestors' vertices and, when
``share`` is on, the leading vertices of earlier nodes under the same vertex that begin with
the same tokens (a retried prompt); the rest of its tokens become one new run of vertices.
Vertices get ids in creation order, a run's vertices are consecutive.

Roots (calls with no parent or prefix_len 0: a subagent's chain, or a retry of the first call)
start under a virtual root vertex -1; with ``share`` those that begin with the same tokens
share them and make one tree, otherwise each root starts its own tree.

Leaves are vertices with no child; a node is a leaf node when its path ends at one (the first
such node per leaf vertex). Adding a node costs O(1) bookkeeping plus vectorized compares
against the few sibling runs it could share with.
"""

from __future__ import annotations

import sys
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollstream.schemas.events import I32, U32, TrajectoryNode

from .errors import InvalidTrajectory
from .tree import full_len, lcp

__all__ = ["Piece", "TokenTrie", "join_buffers"]

Array = np.ndarray[Any, Any]
_NATIVE_U32 = sys.byteorder == "little" and memoryview(b"\0" * 4).cast("I").itemsize == 4
Piece = tuple[TrajectoryNode, int, int, int]  # node, its index, a [start, end) of its tokens


@dataclass(slots=True)
class _Run:
    node: int  # the node whose tokens these are
    start: int  # first position in that node's own tokens
    length: int
    v0: int  # first vertex id
    attach: int  # vertex of the token before the run, -1 for a root
    kids: list[int]  # runs attached to one of this run's vertices, in creation order


def join_buffers(parts: list[Any]) -> bytes:
    """The bytes of arrays (and bytes) end to end: ``bytes.join`` over their buffers, a
    fraction of ``np.concatenate``'s cost per part; a strided array is made contiguous first."""
    try:
        return b"".join(parts)
    except (BufferError, TypeError):
        return b"".join(
            [np.ascontiguousarray(p).data if isinstance(p, np.ndarray) else p for p in parts]
        )


class TokenTrie:
    """The trie of one trajectory. Raises InvalidTrajectory for an inconsistent tree."""

    def __init__(self, nodes: list[TrajectoryNode], share: bool) -> None:
        self.nodes = nodes
        self.share = share
        self.parent: list[int] = []  # effective tree parent (after walking up rewinds), -1
        self.seg_len = [len(n.prompt_tokens) + len(n.completion_ids) for n in nodes]
        # every node's own tokens end to end (one join); node i's start at offset[i]
        self.offset = [0] * (len(nodes) + 1)
        total = 0
        for i, n in enumerate(self.seg_len):
            total += n
            self.offset[i + 1] = total
        self.id_bytes = join_buffers(
            [a for n in nodes for a in (n.prompt_tokens, n.completion_ids)]
        )
        self._ids = np.frombuffer(self.id_bytes, U32)
        self._id_list = memoryview(self.id_bytes).cast("I") if _NATIVE_U32 else self._ids
        self.root_runs: list[int] = []  # one per tree (a root call with tokens)
        self.runs: list[_Run] = []
        self.end_vertex: list[int] = []  # where each node's path ends (-1: empty root)
        self._run_v0: list[int] = []
        self._attached: dict[int, list[int]] = {}  # vertex (-1: none) -> runs starting under it
        self._locs: list[list[tuple[int, int, int]]] = []  # (own position, vertex, length)
        self._next_vertex = 0
        index: dict[str, int] = {}
        for i, node in enumerate(nodes):
            if node.call_id in index:
                raise InvalidTrajectory(f"call {node.call_id} appears twice")
            if len(node.completion_logprobs) != len(node.completion_ids):
                raise InvalidTrajectory(f"call {node.call_id}: logprobs length != completion")
            self.parent.append(self._effective_parent(node, index))
            index[node.call_id] = i
            self._place(i)

    def _effective_parent(self, node: TrajectoryNode, index: dict[str, int]) -> int:
        q = node.prefix_len
        if node.parent_call_id is None:
            if q != 0:
                raise InvalidTrajectory(f"call {node.call_id}: prefix_len {q} without parent")
            return -1
        parent = index.get(node.parent_call_id, -2)
        if parent == -2:
            raise InvalidTrajectory(f"call {node.call_id}: parent not before it")
        if not 0 <= q <= full_len(self.nodes[parent]):
            raise InvalidTrajectory(f"call {node.call_id}: prefix_len {q} out of range")
        while parent >= 0 and q <= self.nodes[parent].prefix_len:
            parent = self.parent[parent]
        return parent

    # --- layout ---------------------------------------------------------------------------

    def _run_of(self, vertex: int) -> int:
        return bisect_right(self._run_v0, vertex) - 1

    def _vertex_at(self, i: int, pos: int) -> int:
        for start, vertex, length in self._locs[i]:
            if start <= pos < start + length:
                return vertex + pos - start
        raise AssertionError("position outside the node's tokens")

    def _place(self, i: int) -> None:
        parent, length = self.parent[i], self.seg_len[i]
        locs: list[tuple[int, int, int]] = []
        self._locs.append(locs)
        pos = 0
        if parent < 0:
            attach = -1
        else:
            offset = self.nodes[i].prefix_len - self.nodes[parent].prefix_len - 1
            attach = self._vertex_at(parent, offset)
        if self.share and length:
            pos, attach = self._follow(i, attach, locs)
        if pos < length:
            run_id, v0 = len(self.runs), self._next_vertex
            self.runs.append(_Run(i, pos, length - pos, v0, attach, []))
            self._run_v0.append(v0)
            self._attached.setdefault(attach, []).append(run_id)
            if attach >= 0:
                self.runs[self._run_of(attach)].kids.append(run_id)
            else:
                self.root_runs.append(run_id)
            locs.append((pos, v0, length - pos))
            self._next_vertex = v0 + length - pos
            attach = self._next_vertex - 1
        self.end_vertex.append(attach)

    def _follow(self, i: int, attach: int, locs: list[tuple[int, int, int]]) -> tuple[int, int]:
        """Walk node i's tokens down existing vertices under ``attach`` while they match;
        returns how many tokens matched and the last vertex reached. At each vertex the
        candidates are the run's own next token, then the runs branching off there (in
        creation order); the first that matches is followed."""
        pos, length = 0, self.seg_len[i]
        runs, attached = self.runs, self._attached
        while pos < length:
            k = 0
            if attach >= 0:
                run = runs[self._run_of(attach)]
                offset = attach - run.v0 + 1
                if offset < run.length:
                    k = self._match(run, offset, i, pos)
            if not k:
                offset = 0
                for r in attached.get(attach, ()):
                    run = runs[r]
                    k = self._match(run, 0, i, pos)
                    if k:
                        break
            if not k:
                break
            locs.append((pos, run.v0 + offset, k))
            pos += k
            attach = run.v0 + offset + k - 1
        return pos, attach

    def _lcp(self, a: int, b: int, n: int) -> int:
        """Longest common prefix of the n tokens at flat positions a and b (one memcmp when
        they are all equal, the usual case for a shared prompt)."""
        if n <= 0 or self._id_list[a] != self._id_list[b]:
            return 0
        data = self.id_bytes
        if data[4 * a : 4 * (a + n)] == data[4 * b : 4 * (b + n)]:
            return n
        return lcp(self._ids[a : a + n], self._ids[b : b + n])

    def _match(self, run: _Run, offset: int, i: int, pos: int) -> int:
        """How many tokens of ``run`` from offset and of node i from pos are the same vertex:
        equal id and mask, and for generated tokens equal logprob and version."""
        sa, sb = run.start + offset, pos
        n = min(run.length - offset, self.seg_len[i] - pos)
        if n <= 0:
            return 0
        fa, fb = self.offset[run.node] + sa, self.offset[i] + sb  # flat positions
        if self._id_list[fa] != self._id_list[fb]:  # the usual miss, before any slicing
            return 0
        a, b = self.nodes[run.node], self.nodes[i]
        # prompt tokens left before each side's completion: masks agree up to the nearer
        # boundary, and past it only when both sides cross it together
        pa, pb = max(len(a.prompt_tokens) - sa, 0), max(len(b.prompt_tokens) - sb, 0)
        both = min(n, pa, pb)
        k = self._lcp(fa, fb, both)
        if k < both or pa != pb or n <= pa:
            return k
        if a.policy_version != b.policy_version:
            return pa
        k = self._lcp(fa + pa, fb + pa, n - pa)  # the generated tokens' ids
        if not k:
            return pa
        ga, gb = sa + pa - len(a.prompt_tokens), sb + pb - len(b.prompt_tokens)
        la = a.completion_logprobs[ga : ga + k]
        lb = b.completion_logprobs[gb : gb + k]
        if la.tobytes() == lb.tobytes():
            return pa + k
        return pa + lcp(la.view(np.uint32), lb.view(np.uint32))

    # --- reading it -----------------------------------------------------------------------

    def leaves(self) -> list[int]:
        """Leaf nodes in node order: a node whose path ends at a vertex with no child (the
        first node per such vertex)."""
        seen: set[int] = set()
        leaves = []
        for i, vertex in enumerate(self.end_vertex):
            if vertex < 0 or vertex in seen:
                continue
            run = self.runs[self._run_of(vertex)]
            if vertex - run.v0 + 1 < run.length or vertex in self._attached:
                continue
            seen.add(vertex)
            leaves.append(i)
        return leaves

    def packed(self, first: int, leaves: list[int]) -> tuple[list[Piece], Array, int]:
        """The tree of root run ``first`` in DFS pre-order: pieces, parent indices (int32,
        -1 for the root token) and how many of ``leaves`` end in it.

        Pre-order: a run, then the runs attached to its vertices, latest vertex first (the
        run's own continuation is visited before a branch that leaves it earlier)."""
        order: list[int] = []
        stack = [first]
        while stack:
            r = stack.pop()
            order.append(r)
            kids = sorted(self.runs[r].kids, key=lambda k: -self.runs[k].attach)
            stack.extend(reversed(kids))
        out_offset: dict[int, int] = {}
        total = 0
        for r in order:
            out_offset[r] = total
            total += self.runs[r].length
        parents = np.arange(-1, total - 1, dtype=I32)
        pieces = []
        for r in order:
            run = self.runs[r]
            if run.attach >= 0:
                up = self._run_of(run.attach)
                parents[out_offset[r]] = out_offset[up] + run.attach - self.runs[up].v0
            pieces.append((self.nodes[run.node], run.node, run.start, run.start + run.length))
        num_leaves = sum(1 for leaf in leaves if self._run_of(self.end_vertex[leaf]) in out_offset)
        return pieces, parents, num_leaves
