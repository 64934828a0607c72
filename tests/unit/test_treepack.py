"""Tree packing: structure on hand-drawn trees, and tree mode == path mode (loss and gradients)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollstream.consumers.training.batching import collate
from rollstream.consumers.training.ppo import LossConfig, batch_loss
from rollstream.consumers.training.treepack import (
    TreeError,
    additive_mask,
    ancestor_mask,
    batch_token_logprobs,
    gather_logprobs,
    leaf_paths,
    path_token_logprobs,
    positions_from_parents,
    subtree_ends,
    tree_path_counts,
    tree_token_logprobs,
)
from rollstream.schemas.events import Sample, SampleMode

# The hand-drawn tree used below (token index, parent in brackets):
#
#   0 [-1]            prompt root
#   ├── 1 [0]
#   │   ├── 2 [1]
#   │   │   └── 3 [2]   leaf
#   │   └── 4 [1]       leaf
#   └── 5 [0]
#       └── 6 [5]       leaf
TREE = torch.tensor([-1, 0, 1, 2, 1, 0, 5])


def test_subtree_ends_and_depths_of_hand_drawn_tree() -> None:
    assert subtree_ends(TREE).tolist() == [7, 5, 4, 4, 5, 7, 7]
    assert positions_from_parents(TREE).tolist() == [0, 1, 2, 3, 2, 1, 2]


def test_ancestor_mask_of_hand_drawn_tree() -> None:
    expected = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],  # 4 sees 0, 1 and itself, not its sibling branch 2-3
        [1, 0, 0, 0, 0, 1, 0],
        [1, 0, 0, 0, 0, 1, 1],
    ]
    mask = ancestor_mask(TREE)
    assert mask.dtype == torch.bool
    assert mask.int().tolist() == expected


def test_leaf_paths_and_path_counts_of_hand_drawn_tree() -> None:
    assert [p.tolist() for p in leaf_paths(TREE)] == [[0, 1, 2, 3], [0, 1, 4], [0, 5, 6]]
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1]])
    counts = tree_path_counts(TREE.unsqueeze(0), loss_mask)
    # Leaves below each token: 0 -> {3, 4, 6}, 1 -> {3, 4}, the rest one each.
    assert counts.paths_through.tolist() == [[3, 2, 1, 1, 1, 1, 1]]
    # Masked tokens per path: 0-1-2-3 -> 3, 0-1-4 -> 2, 0-5-6 -> 2.
    third, half = 1 / 3, 1 / 2
    expected = [third + half + half, third + half, third, third, half, half, half]
    torch.testing.assert_close(counts.inv_path_len[0], torch.tensor(expected))
    assert counts.num_paths.tolist() == [3.0]


def test_forest_and_padding_in_a_batch() -> None:
    # Row 0: two roots (0 -> 1, 2 -> 3); row 1: the hand-drawn tree with no padding.
    parents = torch.tensor([[-1, 0, -1, 2, -1, -1, -1], TREE.tolist()])
    valid = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1] * 7])
    assert subtree_ends(parents)[0].tolist() == [2, 2, 4, 4, 5, 6, 7]
    assert positions_from_parents(parents)[0].tolist() == [0, 1, 0, 1, 0, 0, 0]
    counts = tree_path_counts(parents, valid, valid)
    assert counts.num_paths.tolist() == [2.0, 3.0]  # padding tokens are not leaves
    assert counts.paths_through[0].tolist() == [1, 1, 1, 1, 0, 0, 0]
    mask = ancestor_mask(parents)
    assert mask.shape == (2, 7, 7)
    assert mask[0, 3].int().tolist() == [0, 0, 1, 1, 0, 0, 0]


@pytest.mark.parametrize(
    ("parents", "why"),
    [
        ([-1, 0, 0, 1], "pre-order"),  # 3's parent 1 closed when 2 (a child of 0) began
        ([-1, 1, 0], "earlier"),  # a token that is its own parent
        ([-1, 2, 0], "earlier"),  # a parent after its child
        ([-1, -2], "earlier"),
    ],
)
def test_invalid_orders_raise(parents: list[int], why: str) -> None:
    with pytest.raises(TreeError, match=why):
        subtree_ends(torch.tensor(parents))


# ---- property tests against plain-loop references -------------------------------------------


def _preorder_parents(moves: list[int]) -> list[int]:
    """Build a pre-order forest: before each token, climb ``move`` levels up the open path."""
    parents: list[int] = []
    stack: list[int] = []
    for i, move in enumerate(moves):
        del stack[max(0, len(stack) - move) :]
        parents.append(stack[-1] if stack else -1)
        stack.append(i)
    return parents


def _ancestors(parents: list[int], i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


def _is_preorder(parents: list[int]) -> bool:
    n = len(parents)
    for i in range(n):
        below = [j for j in range(n) if i in _ancestors(parents, j)]
        if below != list(range(i, i + len(below))):
            return False
    return True


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_structure_matches_reference_on_random_trees(moves: list[int]) -> None:
    parents = _preorder_parents(moves)
    n = len(parents)
    t = torch.tensor(parents)
    depths = [len(_ancestors(parents, i)) - 1 for i in range(n)]
    assert positions_from_parents(t).tolist() == depths
    expected = [[j in _ancestors(parents, i) for j in range(n)] for i in range(n)]
    assert ancestor_mask(t).tolist() == expected
    leaves = [i for i in range(n) if i not in parents]
    assert [p.tolist() for p in leaf_paths(t)] == [sorted(_ancestors(parents, x)) for x in leaves]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=12))
def test_preorder_check_matches_reference(draws: list[int]) -> None:
    parents = [(d % (i + 1)) - 1 for i, d in enumerate(draws)]  # any parent in [-1, i)
    if _is_preorder(parents):
        subtree_ends(torch.tensor(parents))
    else:
        with pytest.raises(TreeError):
            subtree_ends(torch.tensor(parents))


# ---- logprobs on a tiny Qwen2 -----------------------------------------------------------------

VOCAB = 128


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="eager",  # type: ignore[call-arg]
    )
    return Qwen2ForCausalLM(config).eval()


def test_gather_logprobs_reads_the_source_position() -> None:
    # Position 0 predicts [0.25, 0.75], position 1 predicts [0.5, 0.5], position 2 [0.9, 0.1].
    probs = torch.tensor([[[0.25, 0.75], [0.5, 0.5], [0.9, 0.1]]])
    logits = probs.log() + 3.0  # any shift: log-softmax removes it
    ids = torch.tensor([[1, 1, 0]])
    sources = torch.tensor([[-1, 0, 0]])  # a tree: tokens 1 and 2 are both children of 0
    logp = gather_logprobs(logits, ids, sources)
    torch.testing.assert_close(logp, torch.tensor([[0.0, math.log(0.75), math.log(0.25)]]))


def test_chain_tree_equals_causal_forward(model: Qwen2ForCausalLM) -> None:
    ids = torch.randint(0, VOCAB, (9,))
    path = path_token_logprobs(model, ids)
    chain = tree_token_logprobs(model, ids, torch.arange(-1, 8))
    assert path.shape == (9,) and path[0] == 0
    torch.testing.assert_close(chain, path, rtol=1e-5, atol=1e-6)
    logits = model(input_ids=ids[None]).logits[0]  # (T, V)
    manual = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None]).squeeze(1)
    torch.testing.assert_close(path[1:], manual, rtol=1e-5, atol=1e-6)


def test_tree_logprobs_equal_each_leaf_path(model: Qwen2ForCausalLM) -> None:
    ids = torch.randint(0, VOCAB, (7,))
    tree = tree_token_logprobs(model, ids, TREE)
    for path in leaf_paths(TREE):
        torch.testing.assert_close(
            tree[path], path_token_logprobs(model, ids[path]), rtol=1e-5, atol=1e-6
        )


def test_4d_mask_reaches_attention(model: Qwen2ForCausalLM) -> None:
    # Guard against a transformers upgrade that rebuilds custom 4-D masks: masking the whole
    # prompt must change the logits.
    ids = torch.randint(0, VOCAB, (1, 5))
    positions = torch.arange(5)[None]
    causal = additive_mask(ancestor_mask(torch.arange(-1, 4))[None], torch.float32)
    alone = additive_mask(torch.eye(5, dtype=torch.bool)[None], torch.float32)
    a = model(input_ids=ids, attention_mask=causal, position_ids=positions).logits
    b = model(input_ids=ids, attention_mask=alone, position_ids=positions).logits
    torch.testing.assert_close(a[:, 0], b[:, 0])  # token 0 sees only itself either way
    assert not torch.allclose(a[:, 4], b[:, 4])


# ---- tree mode == path mode: loss and gradients ---------------------------------------------

# A segment is (tokens, generated?, children); trees are emitted in DFS pre-order.
Segment = tuple[int, bool, list["Segment"]]
ROLLOUT_A: Segment = (
    4,
    False,
    [(3, True, [(2, False, [(3, True, []), (2, True, [])])]), (4, True, [])],
)
ROLLOUT_B: Segment = (3, False, [(5, True, []), (2, True, [])])


def _emit(segment: Segment) -> tuple[list[int], list[int]]:
    parents: list[int] = []
    mask: list[int] = []

    def visit(seg: Segment, parent: int) -> None:
        count, generated, children = seg
        for _ in range(count):
            parents.append(parent)
            mask.append(int(generated))
            parent = len(parents) - 1
        for child in children:
            visit(child, parent)

    visit(segment, -1)
    return parents, mask


def _sample(
    sid: str,
    rid: str,
    ids: np.ndarray,
    mask: np.ndarray,
    blp: np.ndarray,
    advantage: float,
    weight: float,
    parents: np.ndarray | None = None,
) -> Sample:
    return Sample(
        sample_id=sid,
        rollout_id=rid,
        group_id="g",
        task_id="t",
        input_ids=ids.astype(np.uint32),
        loss_mask=mask.astype(np.uint8),
        behaviour_logprobs=blp.astype(np.float32),
        advantage=advantage,
        reward=0.0,
        policy_version=3,
        mode=SampleMode.PATH if parents is None else SampleMode.TREE,
        parent_indices=np.zeros(0, np.int32) if parents is None else parents.astype(np.int32),
        loss_weight=weight,
    )


def _tree_and_paths(model: Qwen2ForCausalLM) -> tuple[list[Sample], list[Sample]]:
    """Two tree rollouts and one plain path rollout, in tree form and in path form."""
    gen = torch.Generator().manual_seed(1)
    trees: list[Sample] = []
    paths: list[Sample] = []
    for rid, segment, advantage in (("A", ROLLOUT_A, 0.8), ("B", ROLLOUT_B, -1.1)):
        parents_list, mask_list = _emit(segment)
        parents = torch.tensor(parents_list)
        mask = torch.tensor(mask_list)
        ids = torch.randint(0, VOCAB, (len(parents_list),), generator=gen)
        with torch.no_grad():
            current = tree_token_logprobs(model, ids, parents)
        noise = 0.4 * torch.randn(current.shape, generator=gen)  # ratios on both clip sides
        blp = ((current + noise) * mask).numpy()
        trees.append(
            _sample(rid, rid, ids.numpy(), mask.numpy(), blp, advantage, 1.0, parents.numpy())
        )
        leaves = leaf_paths(parents)
        for k, path in enumerate(leaves):
            idx = path.numpy()
            paths.append(
                _sample(
                    f"{rid}{k}",
                    rid,
                    ids.numpy()[idx],
                    mask.numpy()[idx],
                    blp[idx],
                    advantage,
                    1.0 / len(leaves),
                )
            )
    plain_mask = np.array([0, 0, 1, 1, 1, 1])
    plain = _sample(
        "C",
        "C",
        torch.randint(0, VOCAB, (6,), generator=gen).numpy(),
        plain_mask,
        np.array([0, 0, -4.0, -5.0, -4.5, -5.5]) * plain_mask,
        0.5,
        1.0,
    )
    return [*trees, plain], [*paths, plain]


def _loss_and_grads(
    model: Qwen2ForCausalLM, samples: list[Sample], config: LossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model.zero_grad()
    batch = collate(samples)
    loss, stats = batch_loss(batch_token_logprobs(model, batch), batch, config)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), stats, grads


@pytest.mark.parametrize("objective", ["ppo", "decoupled"])
@pytest.mark.parametrize("normalization", ["rollout", "token", "sequence"])
def test_tree_mode_equals_path_mode(
    model: Qwen2ForCausalLM, normalization: str, objective: str
) -> None:
    trees, paths = _tree_and_paths(model)
    assert len(paths) == 3 + 2 + 1
    config = LossConfig(normalization=normalization, objective=objective)  # type: ignore[arg-type]
    tree_loss, tree_stats, tree_grads = _loss_and_grads(model, trees, config)
    path_loss, path_stats, path_grads = _loss_and_grads(model, paths, config)

    assert tree_loss != 0
    torch.testing.assert_close(tree_loss, path_loss, rtol=1e-5, atol=0)
    for name in ("clip_frac", "approx_kl", "ratio_mean"):
        torch.testing.assert_close(tree_stats[name], path_stats[name], rtol=1e-5, atol=1e-7)
    if objective == "ppo":  # the clip against the behaviour policy acts on some tokens
        assert 0 < path_stats["clip_frac"] < 1
    else:  # against the weights being trained it never does; the behaviour weights act instead
        assert path_stats["clip_frac"] == 0
        torch.testing.assert_close(
            tree_stats["behaviour_capped_frac"], path_stats["behaviour_capped_frac"]
        )
    assert tree_grads.keys() == path_grads.keys() and len(tree_grads) > 0
    for name, grad in path_grads.items():
        rel = (tree_grads[name] - grad).norm() / grad.norm()
        assert rel < 1e-5, f"{name}: relative gradient error {rel:.2e}"
    # The tree batch trains fewer token positions for the same objective.
    assert tree_stats["tokens"] < path_stats["tokens"]
