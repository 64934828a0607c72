"""The context tree of one rollout, rebuilt from LlmCall records.

An LlmCall's full prompt is ``(parent.prompt + parent.completion)[:prefix_len] + prompt_delta``
(no parent: an empty prefix). The tree keeps one ``TrajectoryNode`` per distinct call, in
arrival (seq) order, normalized so that a node's ``prefix_len`` falls inside its tree parent's
own tokens and its ``prompt_tokens`` are exactly the tokens new relative to that parent:

- a rewind (prefix_len shorter than the parent's full sequence) that reaches back into an
  ancestor's tokens re-parents the node to that ancestor;
- a prompt_delta that starts by repeating the parent's tokens after prefix_len (a proxy that
  sent a conservative prefix) is folded into prefix_len, so an append is recognised as one;
- prefix_len 0 (with or without a parent) starts a separate root: a subagent's chain;
- a call with the same tree parent, prefix_len, prompt tokens and completion as an existing
  node is merged into it (``aliases`` maps the duplicate's id to the kept one; later children
  of the duplicate hang under the kept node and are deduplicated against its children).

Every step is O(new tokens) numpy work; an append is O(1) apart from the call's own arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rollstream.schemas.events import LlmCall, TrajectoryNode

from .errors import ContractViolation, InvalidCode

__all__ = ["CallTree", "full_len", "lcp"]


def full_len(node: TrajectoryNode) -> int:
    """Length of the node's full sequence (its path's prompt + its completion)."""
    return node.prefix_len + len(node.prompt_tokens) + len(node.completion_ids)


def lcp(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> int:
    """Length of the longest common prefix of two 1-D arrays (vectorized)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    first = int(differ.argmax())
    return first if differ[first] else n


class CallTree:
    """Nodes by call id (seq order), duplicate aliases, and the indexes that keep adds cheap."""

    __slots__ = ("_siblings", "aliases", "nodes")

    def __init__(self) -> None:
        self.nodes: dict[str, TrajectoryNode] = {}
        self.aliases: dict[str, str] = {}
        self._siblings: dict[tuple[str | None, int], list[str]] = {}

    @classmethod
    def from_nodes(
        cls, nodes: list[TrajectoryNode], aliases: dict[str, str] | None = None
    ) -> CallTree:
        """Rebuild a tree from already-normalized nodes (a restored state)."""
        tree = cls()
        for node in nodes:
            tree._insert(node)
        tree.aliases = dict(aliases or {})
        return tree

    def resolve(self, call_id: str) -> str | None:
        """The id of the node a call id names (itself or the node it was merged into)."""
        call_id = self.aliases.get(call_id, call_id)
        return call_id if call_id in self.nodes else None

    def _insert(self, node: TrajectoryNode) -> None:
        self.nodes[node.call_id] = node
        self._siblings.setdefault((node.parent_call_id, node.prefix_len), []).append(node.call_id)

    def add(self, call: LlmCall, *, dedup: bool = True) -> str:
        """Add a call; returns the id of the node that holds it (a merged duplicate returns the
        kept node's id). Raises ContractViolation and leaves the tree unchanged on bad input."""
        call_id = call.call_id
        if call_id in self.nodes or call_id in self.aliases:
            raise ContractViolation(InvalidCode.DUPLICATE_CALL_ID, f"call_id {call_id} seen")
        completion = call.completion_ids
        if len(call.completion_logprobs) != len(completion):
            raise ContractViolation(
                InvalidCode.LOGPROBS_LENGTH,
                f"{len(call.completion_logprobs)} logprobs for {len(completion)} tokens",
            )
        q = call.prefix_len
        parent: TrajectoryNode | None = None
        if call.parent_call_id is None:
            if q != 0:
                raise ContractViolation(
                    InvalidCode.PREFIX_OUT_OF_RANGE, f"prefix_len {q} without a parent call"
                )
        else:
            parent_id = self.resolve(call.parent_call_id)
            if parent_id is None:
                raise ContractViolation(
                    InvalidCode.UNKNOWN_PARENT, f"parent call {call.parent_call_id} unknown"
                )
            parent = self.nodes[parent_id]
            if not 0 <= q <= full_len(parent):
                raise ContractViolation(
                    InvalidCode.PREFIX_OUT_OF_RANGE,
                    f"prefix_len {q} outside the parent's {full_len(parent)} tokens",
                )
            while parent is not None and q <= parent.prefix_len:  # rewind into an ancestor
                up = parent.parent_call_id
                parent = None if up is None else self.nodes[up]
        prompt = call.prompt_delta
        if parent is not None and len(prompt) and q < full_len(parent):
            k = _shared_continuation(parent, q, prompt)
            if k:
                q += k
                prompt = prompt[k:]
        parent_id = None if parent is None else parent.call_id
        if dedup:
            for sibling_id in self._siblings.get((parent_id, q), ()):
                sibling = self.nodes[sibling_id]
                if _same(sibling.prompt_tokens, prompt) and _same(
                    sibling.completion_ids, completion
                ):
                    self.aliases[call_id] = sibling_id
                    return sibling_id
        self._insert(
            TrajectoryNode(
                call_id=call_id,
                parent_call_id=parent_id,
                prefix_len=q,
                prompt_tokens=prompt,
                completion_ids=completion,
                completion_logprobs=call.completion_logprobs,
                policy_version=call.policy_version,
                finish_reason=call.finish_reason,
            )
        )
        return call_id


def _same(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    """Equal token arrays (same dtype here): one memcmp, no temporary bool array."""
    return len(a) == len(b) and a.tobytes() == b.tobytes()


def _shared_continuation(parent: TrajectoryNode, q: int, prompt: np.ndarray[Any, Any]) -> int:
    """How many leading tokens of ``prompt`` repeat the parent's full sequence from q on
    (parent.prefix_len < q < full_len(parent): the tokens lie in the parent's own segment)."""
    offset = q - parent.prefix_len
    own_prompt = parent.prompt_tokens
    if offset < len(own_prompt):
        k = lcp(prompt, own_prompt[offset:])
        if k < len(own_prompt) - offset or k == len(prompt):
            return k
        return k + lcp(prompt[k:], parent.completion_ids)
    return lcp(prompt, parent.completion_ids[offset - len(own_prompt) :])
