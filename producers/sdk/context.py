"""Per-rollout context trie: turns a full prompt into an LlmCall delta (pure; no I/O).

A harness (or the recording proxy) sees each model call's FULL prompt token IDs. On the wire an
LlmCall carries only ``parent_call_id``, ``prefix_len`` and ``prompt_delta``, where

    full prompt = (parent prompt + parent completion)[:prefix_len] + prompt_delta

so an append-only conversation costs its unique tokens, and an edited context is a rewind
(``prefix_len`` shorter than the parent's full sequence).

The parent is the earlier call whose full sequence (prompt + completion) shares the LONGEST
prefix with the new prompt; ties go to the most recent call. No shared token means no parent.

Structure: a radix tree (compressed trie) over the calls' full sequences. Each edge holds a
numpy slice of token IDs; children are found by their first token; each node knows the most
recent call in its subtree. A lookup walks the new prompt down the tree comparing whole edge
slices with numpy (first mismatch via ``np.flatnonzero``), so it costs one vectorised compare
over the prompt plus one Python step per branch point, never a per-token Python loop. Edges
store only the tokens a call added (copies of the new suffix), so memory is O(unique tokens),
not O(calls x context). Fast path for the common case (the prompt extends the previous call's
full sequence): the trie keeps that sequence in one growable bytearray (with a numpy view for
writes), checks the prompt against it with one ``bytearray.startswith`` over the prompt's own
buffer (a memcmp: no copy, no boolean temporary; 2-3x faster than a numpy elementwise compare)
and resumes the walk at the previous call's node; when that node is a leaf (an append-only
conversation) the new call is just a new leaf below it. An append-only turn thus costs one
memcmp plus O(new tokens), whatever the depth.

Memory: edge labels are views into the trie's own arena of token blocks, and the last sequence's
buffer is such a block too. An appended leaf's label is a view into that buffer itself (its tokens
are written once, where the sequence needs them anyway); when a rewind rewrites the buffer, the
labels that still view it are copied into the arena first, and a buffer outgrown while labels view
it stays in the arena. Blocks come from, and go back to, one process-wide pool of free
blocks (``release()``, which the Recorder calls when a rollout finishes; a grown buffer's old
block goes back at once). A rollout's tokens thus reuse memory the process already touched:
fresh memory for them, handed back to the OS at the end of every rollout, cost ~100 page faults
(~160 us) per 20-call rollout of 2,000-token turns on this machine (docs/benchmarks.md).

Errors (producers/errors.py): ContextError (a ProducerError and a ValueError) when a call id is
reused or an unknown call is asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from rollstream.producers.errors import ContextError, ProducerError

__all__ = ["ContextError", "ContextMatch", "ContextTrie", "ProducerError", "common_prefix"]

_U32 = np.dtype("<u4")
_U32_MAX = int(np.iinfo(_U32).max)  # TOKEN_ID_MAX of rollstream.schemas.events
_PROBE = 4096  # compare a short head first so an early mismatch in a long edge stays cheap

Tokens = npt.NDArray[Any]


class ContextMatch(NamedTuple):
    """Where a new prompt attaches: ``prompt == parent_sequence[:prefix_len] + prompt_delta``."""

    parent_call_id: str | None
    prefix_len: int
    prompt_delta: Tokens


def _tokens(value: Any) -> Tokens:
    """A one-dimensional C-contiguous uint32 array (the array itself when it is one)."""
    if isinstance(value, np.ndarray) and value.dtype == _U32 and value.ndim == 1:
        return value if value.flags.c_contiguous else np.ascontiguousarray(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return np.frombuffer(value, dtype=_U32)
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ContextError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "ui":  # floats, bools, objects (ints past 64 bits)
        raise ContextError(f"token ids must be integers, got {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > _U32_MAX):  # the cast below would wrap them
        raise ContextError(f"token ids must be in [0, {_U32_MAX}] (uint32)")
    return np.ascontiguousarray(arr, dtype=_U32)


def common_prefix(a: Tokens, b: Tokens) -> int:
    """Length of the common prefix of two token arrays (vectorised)."""
    n = min(len(a), len(b))
    start = 0
    for stop in (min(n, _PROBE), n):
        if stop <= start:
            continue
        neq = np.flatnonzero(a[start:stop] != b[start:stop])
        if neq.size:
            return start + int(neq[0])
        start = stop
    return n


_Block = tuple[bytearray, "Tokens"]  # memory and its uint32 view (the view pins the memory)


class _BlockPool:
    """Free token blocks kept for reuse, by power-of-two size, up to ``keep_bytes`` in all."""

    MIN_TOKENS = 1 << 12  # 16 KB

    def __init__(self, keep_bytes: int = 64 << 20) -> None:
        self.keep_bytes = keep_bytes
        self.kept_bytes = 0
        self._free: dict[int, list[_Block]] = {}
        self._lock = threading.Lock()

    def take(self, tokens: int) -> _Block:
        """A block of at least ``tokens`` tokens (contents undefined)."""
        size = max(self.MIN_TOKENS, 1 << (tokens - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                self.kept_bytes -= 4 * size
                return free.pop()
        memory = bytearray(4 * size)
        return memory, np.frombuffer(memory, _U32)

    def give(self, block: _Block) -> None:
        size = 4 * len(block[1])
        with self._lock:
            if self.kept_bytes + size <= self.keep_bytes:
                self._free.setdefault(len(block[1]), []).append(block)
                self.kept_bytes += size


_POOL = _BlockPool()
_EMPTY: _Block = (bytearray(), np.zeros(0, _U32))
_ARENA_MAX = 1 << 18  # tokens per arena block (1 MB); a longer label gets a block of its own
_NONE_SHARED = 1 << 62  # no label views the sequence buffer


class _Node:
    __slots__ = ("children", "depth", "epoch", "label", "latest_id", "parent")

    def __init__(self, label: Tokens, parent: _Node | None, depth: int) -> None:
        self.label = label  # tokens on the edge from parent to this node
        self.parent = parent
        self.depth = depth  # tokens from the root to the END of this node's label
        self.children: dict[int, _Node] = {}
        self.latest_id: str | None = None  # most recent call below (stale while on the spine)
        self.epoch = -1  # == trie epoch: on the spine, the path of the most recent call


# A point in the tree: ``offset`` tokens into the edge leading to ``node`` (offset ==
# len(node.label) when the point is the node itself). Plain tuples: this is the hot path.
_Cursor = tuple[_Node, int]


class ContextTrie:
    """The calls of one rollout, as a radix tree over their full token sequences.

    ``add(call_id, prompt_ids, completion_ids)`` returns the ContextMatch to put on the wire and
    records the call; ``match(prompt_ids)`` only looks. ``sequence(call_id)`` rebuilds a call's
    full sequence (prompt + completion). Not thread-safe: one trie per rollout, guarded by the
    rollout's lock.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.anchor: str | None = None  # an explicit branch point's call, for the next add
        self.tokens_held = 0  # tokens the trie's labels hold (its memory, 4 bytes each)
        self._root = _Node(np.zeros(0, _U32), None, 0)
        self._ends: dict[str, _Node] = {}
        self._epoch = 0
        self._last_id: str | None = None
        self._last: _Node | None = None  # end node of the most recent call
        # its full sequence as uint32 bytes in _buf[: 4 * _buf_len]; _tokens: the same memory
        self._buf, self._tokens = _EMPTY
        self._buf_len = 0
        self._shared_from = _NONE_SHARED  # labels view the buffer from this token on
        self._blocks: list[_Block] = []  # the arena: edge labels are views into these blocks
        self._arena = _EMPTY[1]  # the block being filled, from _arena_pos on
        self._arena_pos = 0

    def release(self) -> None:
        """Give the trie's memory back to the process's pool and empty the trie. Call it when
        the rollout is over (the Recorder does); nothing the trie returned refers to it.
        The nodes' parent links are cut first: without cycles the nodes are freed as soon as
        the trie lets go of them, instead of waiting for (and paying) the cyclic GC, which
        otherwise ran a collection every ~450 model calls to find them."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            node.parent = None
            stack.extend(node.children.values())
        blocks, self._blocks = self._blocks, []
        if len(self._tokens):
            blocks.append((self._buf, self._tokens))
        self._reset()
        for block in blocks:
            _POOL.give(block)

    def _keep(self, tokens: Tokens, more: Tokens | None = None) -> Tokens:
        """``tokens`` (then ``more``) copied into the arena; returns the arena's view."""
        mid = len(tokens)
        n = mid + (0 if more is None else len(more))
        pos = self._arena_pos
        if pos + n > len(self._arena):
            size = min(max(2 * len(self._arena), _BlockPool.MIN_TOKENS), _ARENA_MAX)
            block = _POOL.take(max(n, size))
            self._blocks.append(block)
            self._arena, pos = block[1], 0
        self._arena_pos = pos + n
        self.tokens_held += n
        label = self._arena[pos : pos + n]
        label[:mid] = tokens
        if more is not None:
            label[mid:] = more
        return label

    def __len__(self) -> int:
        return len(self._ends)

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._ends

    def __iter__(self) -> Iterator[str]:
        return iter(self._ends)

    # --- lookup ------------------------------------------------------------------------------

    def _walk(self, seq: Tokens, start: _Cursor, pos: int) -> tuple[_Cursor, int]:
        """Follow ``seq[pos:]`` from ``start`` as far as it matches; returns (cursor, pos)."""
        node, offset = start
        n = len(seq)
        if offset < len(node.label):  # resume mid-edge
            k = common_prefix(node.label[offset:], seq[pos:])
            pos += k
            offset += k
            if offset < len(node.label):
                return (node, offset), pos
        while pos < n:
            child = node.children.get(int(seq[pos]))
            if child is None:
                break
            k = common_prefix(child.label, seq[pos:])
            pos += k
            if k < len(child.label):
                return (child, k), pos
            node = child
        return (node, len(node.label)), pos

    def _extends_last(self, prompt: Tokens) -> bool:
        n = self._buf_len
        # prompt is C-contiguous (_tokens): startswith reads its memory in place (.data)
        return (
            self._last is not None
            and 0 < n <= len(prompt)
            and self._buf.startswith(prompt[:n].data)
        )

    def _locate(self, prompt: Tokens) -> tuple[_Cursor, int, bool]:
        if self._extends_last(prompt):
            assert self._last is not None
            start = (self._last, len(self._last.label))
            return (*self._walk(prompt, start, self._buf_len), True)
        return (*self._walk(prompt, (self._root, 0), 0), False)

    def _remember(self, prompt: Tokens, completion: Tokens, extends: bool, end: _Node) -> None:
        """Keep the new call's full sequence in the buffer (append when it extends the last)."""
        start = self._buf_len if extends else 0
        self._store(start, prompt[start:], completion)
        self._last = end

    def _store(self, start: int, tokens: Tokens, more: Tokens | None = None) -> None:
        """Write ``tokens`` (then ``more``) into the buffer from token ``start`` on. The buffer
        doubles when full, so an append-only turn copies only its new tokens; what lies past
        ``_buf_len`` is stale and never read. Labels may view the buffer from ``_shared_from``
        to ``_buf_len``: a write below ``_buf_len`` (a rewind) moves them to the arena first,
        and an outgrown buffer they view joins the arena instead of the pool."""
        if start < self._buf_len and self._shared_from < self._buf_len:
            self._unshare()
        mid = start + len(tokens)
        end = mid + (0 if more is None else len(more))
        if end > len(self._tokens):
            self._grow(start, end)
        self._tokens[start:mid] = tokens
        if more is not None:
            self._tokens[mid:end] = more
        self._buf_len = end

    def _grow(self, keep: int, size: int) -> None:
        """Replace the buffer by one of at least ``size`` tokens holding its first ``keep``
        (the numpy view pins the bytearray, so it cannot grow in place)."""
        grown, view = _POOL.take(max(size, 2 * len(self._tokens)))
        view[:keep] = self._tokens[:keep]
        if self._shared_from < keep:
            self._blocks.append((self._buf, self._tokens))
        elif len(self._tokens):
            _POOL.give((self._buf, self._tokens))
        self._buf, self._tokens = grown, view
        self._shared_from = _NONE_SHARED

    def _unshare(self) -> None:
        """Copy the labels that view the sequence buffer into the arena. They all lie on the
        path of the most recent call (only appended leaves view it, and the spine moves off
        them only through a rewind, which calls this), below ``_shared_from``."""
        node, buf = self._last, self._tokens
        while node is not None and node.depth > self._shared_from:
            if node.label.base is buf:
                node.label = self._keep(node.label)
            node = node.parent
        self._shared_from = _NONE_SHARED

    def match(self, prompt_ids: Any) -> ContextMatch:
        """The parent call and shared prefix for ``prompt_ids``, without recording anything."""
        prompt = _tokens(prompt_ids)
        cursor, pos, _ = self._locate(prompt)
        return self._result(cursor, pos, prompt)

    def _result(self, cursor: _Cursor, pos: int, prompt: Tokens) -> ContextMatch:
        if pos == 0:
            return ContextMatch(None, 0, prompt)
        # every call below the cursor shares exactly ``pos`` tokens; take the most recent one
        node = cursor[0]
        latest = self._last_id if node.epoch == self._epoch else node.latest_id
        return ContextMatch(latest, pos, prompt[pos:])

    # --- insert ------------------------------------------------------------------------------

    def add(self, call_id: str, prompt_ids: Any, completion_ids: Any = ()) -> ContextMatch:
        """Record a call; returns where its prompt attaches (computed before recording it).

        After an explicit branch point naming call X (``anchor = X``, set by
        ``RolloutHandle.branch``), the next call recorded attaches under X when its prompt
        continues X's full sequence (prompt + completion): parent X, ``prefix_len`` = that
        sequence's length. Without it the longest shared prefix decides, and a harness that
        rewinds to X after X already had a child Y would hang the new call inside Y (the chat
        template's next header follows X's reply in both). The anchor is one-shot: the next
        call takes it whether it continues X or not."""
        source, self.anchor = self.anchor, None
        if source is None:
            return self._add(call_id, prompt_ids, completion_ids)
        match = self._add(call_id, prompt_ids, completion_ids)
        if source == match.parent_call_id or source == call_id or source not in self._ends:
            return match
        n = self.sequence_len(source)
        prompt = _tokens(prompt_ids)
        if n == 0 or len(prompt) < n or common_prefix(self.sequence(source), prompt[:n]) < n:
            return match
        return ContextMatch(source, n, prompt[n:])

    def _add(self, call_id: str, prompt_ids: Any, completion_ids: Any = ()) -> ContextMatch:
        if call_id in self._ends:
            raise ContextError(f"call {call_id!r} is already recorded in this rollout")
        prompt = _tokens(prompt_ids)
        completion = _tokens(completion_ids)
        last, n = self._last, self._buf_len
        extends = self._extends_last(prompt)
        if extends and last is not None:
            if not last.children and (len(prompt) > n or len(completion)):
                return self._append_leaf(call_id, prompt, completion)
            cursor, pos = self._walk(prompt, (last, len(last.label)), n)
        else:
            cursor, pos = self._walk(prompt, (self._root, 0), 0)
        result = self._result(cursor, pos, prompt)
        rest = np.concatenate((prompt[pos:], completion)) if len(completion) else prompt[pos:]
        if len(rest):
            cursor, used = self._walk(rest, cursor, 0)
            rest = rest[used:]
        end = self._split(cursor)
        if len(rest):
            leaf = _Node(self._keep(rest), end, end.depth + len(rest))
            end.children[int(rest[0])] = leaf
            end = leaf
        self._ends[call_id] = end
        self._mark_spine(end, extends)
        self._last_id = call_id
        self._remember(prompt, completion, extends, end)
        return result

    def _append_leaf(self, call_id: str, prompt: Tokens, completion: Tokens) -> ContextMatch:
        """The common case in a few steps: the prompt extends the previous call's full
        sequence, which ends at a leaf, and adds tokens; the new call is one new leaf below it
        (what the general path of ``add`` does, without walking, splitting or re-stamping)."""
        last, n = self._last, self._buf_len
        assert last is not None and last.depth == n and last.epoch == self._epoch
        result = ContextMatch(self._last_id, n, prompt[n:])  # ``last`` is on the spine
        self._store(n, result.prompt_delta, completion)
        end = self._buf_len
        rest = self._tokens[n:end]  # the label is the buffer's own new tokens
        if n < self._shared_from:
            self._shared_from = n
        leaf = _Node(rest, last, end)
        leaf.epoch = self._epoch  # on the spine, below the previous call's node
        last.children[int(rest[0])] = leaf
        self._ends[call_id] = leaf
        self._last_id = call_id
        self._last = leaf
        return result

    def add_delta(
        self,
        call_id: str,
        parent_call_id: str | None,
        prefix_len: int,
        prompt_delta: Any,
        completion_ids: Any = (),
    ) -> Tokens:
        """Record a call given as a wire delta (replay, a proxy rebuilding its state); returns
        the call's full prompt."""
        prompt = self.full_prompt(parent_call_id, prefix_len, prompt_delta)
        self.add(call_id, prompt, completion_ids)
        return prompt

    def _mark_spine(self, end: _Node, extends: bool) -> None:
        """Keep "most recent call below each node" right without touching every ancestor on
        every call: nodes on the spine (root -> most recent call) are stamped with the current
        epoch and answer ``_last_id``. An appended call only stamps its new nodes; a call that
        leaves the spine writes the old spine's answer down and stamps a new one (O(depth))."""
        node: _Node | None = end
        if extends:  # end lies below the previous call's node: the spine just grows
            while node is not None and node.epoch != self._epoch:
                node.epoch = self._epoch
                node = node.parent
            return
        old: _Node | None = self._last
        while old is not None and old.epoch == self._epoch:
            old.latest_id = self._last_id
            old = old.parent
        self._epoch += 1
        while node is not None:
            node.epoch = self._epoch
            node = node.parent

    def _split(self, cursor: _Cursor) -> _Node:
        """Make the cursor's point a node (split the edge when it is mid-edge)."""
        node, offset = cursor
        if offset == len(node.label):
            return node
        parent = node.parent
        assert parent is not None  # the root's label is empty, so a cursor mid-edge has a parent
        mid = _Node(node.label[:offset], parent, node.depth - len(node.label) + offset)
        mid.latest_id, mid.epoch = node.latest_id, node.epoch
        parent.children[int(node.label[0])] = mid
        node.label = node.label[offset:]
        node.parent = mid
        mid.children[int(node.label[0])] = node
        return mid

    # --- reconstruction ----------------------------------------------------------------------

    def sequence(self, call_id: str) -> Tokens:
        """A recorded call's full sequence: prompt + completion."""
        node: _Node | None = self._ends.get(call_id)
        if node is None:
            raise ContextError(f"unknown call {call_id!r}")
        parts: list[Tokens] = []
        while node is not None:
            parts.append(node.label)
            node = node.parent
        parts.reverse()
        return np.concatenate(parts) if parts else np.zeros(0, _U32)

    def sequence_len(self, call_id: str) -> int:
        node = self._ends.get(call_id)
        if node is None:
            raise ContextError(f"unknown call {call_id!r}")
        return node.depth

    def full_prompt(self, parent_call_id: str | None, prefix_len: int, prompt_delta: Any) -> Tokens:
        """Inverse of ``match``: ``(parent sequence)[:prefix_len] + prompt_delta``."""
        delta = _tokens(prompt_delta)
        if parent_call_id is None:
            if prefix_len:
                raise ContextError(f"prefix_len {prefix_len} without a parent call")
            return delta
        parent = self.sequence(parent_call_id)
        if not 0 <= prefix_len <= len(parent):
            raise ContextError(
                f"prefix_len {prefix_len} outside parent {parent_call_id!r} ({len(parent)} tokens)"
            )
        return np.concatenate((parent[:prefix_len], delta))
