"""Tree-packed forward: a whole trajectory tree in one sequence, a shared prefix computed once.

A tree-mode Sample lists its tokens in DFS pre-order with ``parent_indices`` (the parent's index,
-1 for a root; several roots make a forest). Pre-order means every subtree is one contiguous
range ``[i, end[i])``, and everything here follows from that array of subtree ends:

    token i attends to j   iff  j is i or an ancestor of i   iff  j <= i < end[j]
    position of i          =    depth of i (number of ancestors), as on its own path
    logit predicting i     =    the logits at parent_indices[i]  (path mode: at i - 1)

So a tree token sees exactly the keys, positions and logits it would see on any root-to-leaf
path through it, and the tree forward equals the path forward token for token.

Equal objectives. In path mode the same tree is L samples, one per root-to-leaf path (leaf =
a token with no child), each with loss weight W/L where W is the tree sample's loss_weight (the
group aggregator gives a rollout's samples 1/num_samples each, so a one-tree rollout has W = 1).
A token shared by k paths appears k times there. ``tree_path_counts`` gives, for every token:
    paths_through[i] = k_i = number of leaf paths through i
    inv_path_len[i]  = sum over those paths p of 1 / n_p,  n_p = masked tokens on p (min 1)
and per sample num_paths = L. ``ppo.loss_coefficients`` turns these into
per-token loss coefficients that make the tree loss, and so its gradients, equal to the path
loss under every normalization. Path samples are the one-path case (k = 1, 1/n, L = 1).

Every operation is vectorized over a (B, T) batch (O(T log T) per sample, no per-token Python
loop); padding tokens must be roots (-1) after the real tokens. The attention mask is dense
(B, 1, T, T): tree mode is for trees that fit one dense attention matrix.

Errors (rollstream.consumers.errors):
    ConsumerError, ValueError
    └── TreeError   parent_indices that are not a DFS pre-order forest
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from rollstream.consumers.errors import TreeError

__all__ = [
    "PathCounts",
    "TreeError",
    "additive_mask",
    "ancestor_mask",
    "batch_token_logprobs",
    "gather_logprobs",
    "leaf_paths",
    "path_token_logprobs",
    "positions_from_parents",
    "sequence_path_counts",
    "subtree_ends",
    "tree_path_counts",
    "tree_token_logprobs",
]


class PathCounts(NamedTuple):
    """How many root-to-leaf paths run through each token (see the module docstring)."""

    paths_through: Tensor  # (B, T) float, k_i; 0 on padding
    inv_path_len: Tensor  # (B, T) float, sum over the paths p through i of 1 / n_p
    num_paths: Tensor  # (B,) float, L


# ---- tree structure ---------------------------------------------------------------------------


def _as_batch(x: Tensor) -> tuple[Tensor, bool]:
    """(T,) -> (1, T); (B, T) unchanged. Returns whether it was 1-D."""
    if x.dim() == 1:
        return x.unsqueeze(0), True
    if x.dim() != 2:
        raise TreeError(f"expected a (T,) or (B, T) tensor, got shape {tuple(x.shape)}")
    return x, False


def subtree_ends(parent_indices: Tensor) -> Tensor:
    """End (exclusive) of each token's subtree in DFS pre-order; (T,) or (B, T) -> same shape.

    In pre-order the subtree of i is the run after i of tokens whose parent is >= i, so
    end[i] = min{ j > i : parent[j] < i } (or T). Found for all i at once by binary lifting over
    a sparse table of range minimums of parent: O(T log T). Raises TreeError when the order is
    not a pre-order forest (a parent at or after its child, or a child outside its parent's
    subtree)."""
    parents, squeeze = _as_batch(parent_indices.long())
    batch, seq_len = parents.shape
    device = parents.device
    if seq_len == 0:
        return parent_indices.long().clone()
    idx = torch.arange(seq_len, device=device)  # (T,)
    if bool(((parents < -1) | (parents >= idx)).any()):
        raise TreeError("each parent index must be -1 or an earlier token")

    levels = max(1, (seq_len - 1).bit_length())  # 2**levels >= T
    width = seq_len + 2**levels
    # mins[k][:, j] = min(parents[:, j : j + 2**k]); past the end is -2, below any i >= 0.
    base = torch.full((batch, width), -2, dtype=torch.long, device=device)
    base[:, :seq_len] = parents
    mins = [base]
    for k in range(1, levels + 1):
        prev, step = mins[-1], 2 ** (k - 1)
        nxt = torch.full_like(prev, -2)
        nxt[:, : width - step] = torch.minimum(prev[:, : width - step], prev[:, step:])
        mins.append(nxt)

    # Jump from i + 1 over blocks whose parents are all >= i; stop at the first parent < i.
    end = (idx + 1).expand(batch, seq_len).clone()  # (B, T)
    for k in range(levels, -1, -1):
        block_min = mins[k].gather(1, end)  # (B, T)
        end = torch.where(block_min >= idx, end + 2**k, end)
    end = end.clamp(max=seq_len)

    # Pre-order check: every child lies inside its parent's subtree.
    has_parent = parents >= 0
    parent_end = end.gather(1, parents.clamp(min=0))  # (B, T)
    if bool((has_parent & (idx >= parent_end)).any()):
        raise TreeError("tokens are not in DFS pre-order (a child outside its parent's subtree)")
    return end.squeeze(0) if squeeze else end


def _count_over_ancestors(ends: Tensor, values: Tensor) -> Tensor:
    """out[i] = sum of values[j] over j ancestor-or-self of i (j <= i < end[j]). (B, T)."""
    batch, seq_len = ends.shape
    diff = torch.zeros(batch, seq_len + 1, dtype=values.dtype, device=values.device)
    diff[:, :seq_len] += values
    diff.scatter_add_(1, ends, -values)
    return diff.cumsum(1)[:, :seq_len]


def _sum_over_subtree(ends: Tensor, values: Tensor) -> Tensor:
    """out[i] = sum of values[j] over j in the subtree of i (i <= j < end[i]). (B, T)."""
    batch, seq_len = ends.shape
    prefix = torch.zeros(batch, seq_len + 1, dtype=values.dtype, device=values.device)
    prefix[:, 1:] = values.cumsum(1)
    start = torch.arange(seq_len, device=ends.device).expand(batch, seq_len)
    return prefix.gather(1, ends) - prefix.gather(1, start)


def positions_from_parents(parent_indices: Tensor) -> Tensor:
    """Depth of each token (0 for a root): its position id on its own path. Same shape, long."""
    ends, squeeze = _as_batch(subtree_ends(parent_indices))
    ones = torch.ones(ends.shape, dtype=torch.long, device=ends.device)
    depth = _count_over_ancestors(ends, ones) - 1  # (B, T)
    return depth.squeeze(0) if squeeze else depth


def _mask_from_ends(ends: Tensor) -> Tensor:
    """(B, T) subtree ends -> (B, T, T) bool, [b, i, j] = j is i or an ancestor of i."""
    idx = torch.arange(ends.shape[1], device=ends.device)
    query = idx.view(1, -1, 1)  # i
    key = idx.view(1, 1, -1)  # j
    return (key <= query) & (query < ends.unsqueeze(1))


def ancestor_mask(parent_indices: Tensor) -> Tensor:
    """(T,) -> (T, T) bool, or (B, T) -> (B, T, T): token i attends to j iff j is i or an
    ancestor of i."""
    ends, squeeze = _as_batch(subtree_ends(parent_indices))
    mask = _mask_from_ends(ends)
    return mask.squeeze(0) if squeeze else mask


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, T, T) bool -> (B, 1, T, T) float: 0 where allowed, the dtype's min elsewhere.

    The form transformers' eager and sdpa attention add to the scores; finfo.min rather than
    -inf keeps a fully masked row finite."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias.unsqueeze(1)


def tree_path_counts(
    parent_indices: Tensor, loss_mask: Tensor, valid: Tensor | None = None
) -> PathCounts:
    """Leaf-path counts per token, for loss coefficients equal to path mode.

    parent_indices (B, T), loss_mask (B, T), valid (B, T) (1 on real tokens; default all)."""
    parents, _ = _as_batch(parent_indices)
    mask, _ = _as_batch(loss_mask)
    ends = subtree_ends(parents)  # (B, T)
    dtype = torch.float64
    real = torch.ones_like(mask, dtype=dtype) if valid is None else _as_batch(valid)[0].to(dtype)
    idx = torch.arange(parents.shape[1], device=parents.device)
    is_leaf = (ends == idx + 1).to(dtype) * real  # (B, T)
    masked_on_path = _count_over_ancestors(ends, mask.to(dtype) * real)  # (B, T), n at leaves
    inv_len = is_leaf / masked_on_path.clamp(min=1.0)  # (B, T), 1 / n_p at leaf p
    return PathCounts(
        paths_through=_sum_over_subtree(ends, is_leaf).float(),
        inv_path_len=_sum_over_subtree(ends, inv_len).float(),
        num_paths=is_leaf.sum(1).float(),
    )


def sequence_path_counts(loss_mask: Tensor, valid: Tensor | None = None) -> PathCounts:
    """PathCounts of ordinary samples: one path each, k = 1, 1 / n, L = 1. loss_mask (B, T),
    valid (B, T) (1 on real tokens; default all)."""
    mask = loss_mask.float()
    n = mask.sum(1, keepdim=True).clamp(min=1.0)  # (B, 1)
    through = torch.ones_like(mask) if valid is None else valid.float()
    return PathCounts(
        paths_through=through,
        inv_path_len=through / n,
        num_paths=torch.ones(mask.shape[0], device=mask.device),
    )


def leaf_paths(parent_indices: Tensor) -> list[Tensor]:
    """Root-to-leaf token indices of a (T,) tree, one long tensor per leaf, in leaf order.

    The path-mode view of a tree (tests, benchmarks, the sample builder's cross-check)."""
    ends = subtree_ends(parent_indices.view(-1))
    idx = torch.arange(ends.shape[0], device=ends.device)
    leaves = torch.nonzero(ends == idx + 1).flatten().tolist()
    return [torch.nonzero((idx <= leaf) & (leaf < ends)).flatten() for leaf in leaves]


# ---- logprobs ---------------------------------------------------------------------------------


def gather_logprobs(logits: Tensor, input_ids: Tensor, sources: Tensor) -> Tensor:
    """log p(input_ids[b, t]) under the logits at position sources[b, t]; 0 where sources < 0.

    logits (B, T, V), input_ids (B, T), sources (B, T) long -> (B, T) float32. Computes the
    log-sum-exp once per position and gathers single logits, never a second (B, T, V) tensor."""
    batch, seq_len, vocab = logits.shape
    has_source = sources >= 0  # (B, T)
    src = sources.clamp(min=0)  # (B, T)
    lse = torch.logsumexp(logits.float(), dim=-1)  # (B, T)
    rows = src + torch.arange(batch, device=logits.device).unsqueeze(1) * seq_len  # (B, T)
    flat = logits.reshape(batch * seq_len, vocab)  # (B*T, V)
    target = flat[rows.flatten(), input_ids.flatten()].view(batch, seq_len).float()  # (B, T)
    logp = target - lse.gather(1, src)  # (B, T)
    return torch.where(has_source, logp, torch.zeros_like(logp))


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype


def path_token_logprobs(
    model: Any, input_ids: Tensor, attention_mask: Tensor | None = None
) -> Tensor:
    """Ordinary causal forward. (T,) or (B, T) right-padded ids -> logprobs of the same shape;
    entry t is log p(input_ids[t] | tokens < t), 0 at t = 0 (aligned with behaviour_logprobs)."""
    ids, squeeze = _as_batch(input_ids)
    mask = None if attention_mask is None else _as_batch(attention_mask)[0]
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (B, T, V)
    idx = torch.arange(ids.shape[1], device=ids.device)
    sources = (idx - 1).expand_as(ids)  # (B, T)
    logp = gather_logprobs(logits, ids, sources)
    return logp.squeeze(0) if squeeze else logp


def tree_token_logprobs(model: Any, input_ids: Tensor, parent_indices: Tensor) -> Tensor:
    """One forward pass over packed trees. (T,) or (B, T) ids and parents -> logprobs, same shape.

    The model gets a (B, 1, T, T) additive ancestor mask and depth position ids (transformers
    passes a 4-D mask through unchanged; eager or sdpa attention add it to the scores). Entry i
    is log p(input_ids[i] | ancestors of i), read from the logits at parent_indices[i]; 0 at
    roots. Padding must be roots (-1) after the real tokens."""
    ids, squeeze = _as_batch(input_ids)
    parents, _ = _as_batch(parent_indices.long())
    ends = subtree_ends(parents)  # (B, T)
    ones = torch.ones_like(ends)
    positions = _count_over_ancestors(ends, ones) - 1  # (B, T) depth
    bias = additive_mask(_mask_from_ends(ends), _model_dtype(model))  # (B, 1, T, T)
    out = model(input_ids=ids, attention_mask=bias, position_ids=positions, use_cache=False)
    logp = gather_logprobs(out.logits, ids, parents)  # (B, T)
    return logp.squeeze(0) if squeeze else logp


def batch_token_logprobs(model: Any, batch: Mapping[str, Tensor]) -> Tensor:
    """Logprobs (B, T) for a batch from ``rollstream.consumers.training.batching.collate``: the tree
    forward when the batch has parent_indices, the ordinary causal forward otherwise."""
    if "parent_indices" in batch:
        return tree_token_logprobs(model, batch["input_ids"], batch["parent_indices"])
    return path_token_logprobs(model, batch["input_ids"], batch["attention_mask"])
