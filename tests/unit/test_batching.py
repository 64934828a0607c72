"""Staleness filter, token-budget batcher and collate over real Sample records."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.consumers.training.batching import (
    BatchingError,
    StalenessFilter,
    TokenBudgetBatcher,
    collate,
    validate_sample,
)
from rollstream.schemas.codec import Codec
from rollstream.schemas.events import Sample, SampleMode


def make_sample(
    n: int = 4,
    *,
    sid: str = "s",
    version: int = 0,
    mask: list[int] | None = None,
    parents: list[int] | None = None,
    advantage: float = 0.5,
    weight: float = 1.0,
) -> Sample:
    mask_arr = np.array([0] + [1] * (n - 1) if mask is None else mask, dtype=np.uint8)
    return Sample(
        sample_id=sid,
        rollout_id="r-" + sid,
        group_id="g",
        task_id="t",
        input_ids=np.arange(100, 100 + n, dtype=np.uint32),
        loss_mask=mask_arr,
        behaviour_logprobs=(-0.5 * mask_arr).astype(np.float32),
        advantage=advantage,
        reward=1.0,
        policy_version=version,
        mode=SampleMode.PATH if parents is None else SampleMode.TREE,
        parent_indices=np.array(parents or [], dtype=np.int32),
        loss_weight=weight,
    )


# ---- staleness --------------------------------------------------------------------------------


def test_staleness_filter_keeps_and_drops_with_counters() -> None:
    stale = StalenessFilter(max_staleness=2)
    samples = [
        make_sample(3, sid="a", version=8),  # 10 - 8 = 2: kept
        make_sample(5, sid="b", version=7),  # 3 > 2: dropped
        make_sample(3, sid="c", version=10),  # on-policy
        make_sample(3, sid="d", version=11),  # newer than the trainer: kept
    ]
    kept = stale.filter(samples, current_version=10)
    assert [s.sample_id for s in kept] == ["a", "c", "d"]
    assert (stale.kept, stale.dropped, stale.dropped_tokens) == (3, 1, 5)
    assert stale.max_seen_staleness == 3


def test_on_policy_filter_and_validation() -> None:
    on_policy = StalenessFilter(max_staleness=0)
    assert on_policy.keep(make_sample(version=4), 4)
    assert not on_policy.keep(make_sample(version=3), 4)
    with pytest.raises(BatchingError):
        StalenessFilter(max_staleness=-1)


# ---- token budget -----------------------------------------------------------------------------


def _lengths(batches: list[list[Sample]]) -> list[list[int]]:
    return [[len(s.input_ids) for s in batch] for batch in batches]


def test_batcher_closes_on_padded_budget() -> None:
    batcher = TokenBudgetBatcher(max_tokens=12)
    samples = [make_sample(n, sid=str(i)) for i, n in enumerate([3, 3, 3, 3, 5, 2, 12, 1])]
    batches = list(batcher.batches(samples))
    # 4 x 3 = 12 fits; adding 5 would pad to 5 x 5 = 25; 2 pads to 5 (2 x 5 = 10);
    # 12 alone is 12; 1 would make 2 x 12.
    assert _lengths(batches) == [[3, 3, 3, 3], [5, 2], [12], [1]]
    assert [s.sample_id for b in batches for s in b] == [str(i) for i in range(8)]
    assert batcher.pending == 0 and batcher.flush() is None


def test_batcher_add_flush_and_limits() -> None:
    batcher = TokenBudgetBatcher(max_tokens=100, max_samples=2)
    assert batcher.add(make_sample(4, sid="a")) is None
    assert batcher.pending_padded_tokens == 4
    closed = batcher.add(make_sample(6, sid="b"))  # max_samples reached: closed at once
    assert closed is not None and [s.sample_id for s in closed] == ["a", "b"]
    assert batcher.add(make_sample(3, sid="c")) is None
    assert [s.sample_id for s in batcher.flush() or []] == ["c"]
    with pytest.raises(BatchingError, match="exceed the budget"):
        batcher.add(make_sample(101, sid="long"))
    with pytest.raises(BatchingError):
        TokenBudgetBatcher(max_tokens=0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=30), st.integers(20, 64))
def test_batcher_invariants(lengths: list[int], budget: int) -> None:
    samples = [make_sample(n, sid=str(i)) for i, n in enumerate(lengths)]
    batches = list(TokenBudgetBatcher(max_tokens=budget).batches(samples))
    assert [s for b in batches for s in b] == samples  # order kept, nothing lost or repeated
    for batch, nxt in zip(batches, [*batches[1:], None], strict=True):
        sizes = [len(s.input_ids) for s in batch]
        assert len(sizes) * max(sizes) <= budget
        if nxt is not None:  # greedy: the next sample did not fit
            with_next = [*sizes, len(nxt[0].input_ids)]
            assert len(with_next) * max(with_next) > budget


# ---- collate ----------------------------------------------------------------------------------


def test_collate_path_shapes_and_padding() -> None:
    a = make_sample(3, sid="a", advantage=1.0, weight=0.5, version=2)
    b = make_sample(5, sid="b", mask=[0, 0, 1, 1, 0], advantage=-1.0, weight=0.25, version=3)
    batch = collate([a, b])
    assert batch["input_ids"].shape == (2, 5) and batch["input_ids"].dtype == torch.long
    assert batch["input_ids"].tolist() == [[100, 101, 102, 0, 0], [100, 101, 102, 103, 104]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0]]
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["old_logprobs"].tolist() == [[0, -0.5, -0.5, 0, 0], [0, 0, -0.5, -0.5, 0]]
    assert batch["advantages"].tolist() == [1.0, -1.0]
    assert batch["weights"].tolist() == [0.5, 0.25]
    assert batch["policy_versions"].tolist() == [2, 3]
    assert "parent_indices" not in batch
    # one path per sample: k = 1 on real tokens, 1 / n with n masked tokens, L = 1
    assert batch["paths_through"].tolist() == batch["attention_mask"].float().tolist()
    assert batch["inv_path_len"][0, :3].tolist() == [0.5] * 3
    assert batch["num_paths"].tolist() == [1.0, 1.0]


def test_collate_tree_batch_turns_paths_into_chains() -> None:
    tree = make_sample(5, sid="t", parents=[-1, 0, 1, 0, 3], mask=[0, 1, 1, 1, 1])
    path = make_sample(3, sid="p")
    batch = collate([tree, path])
    assert batch["parent_indices"].tolist() == [[-1, 0, 1, 0, 3], [-1, 0, 1, -1, -1]]
    assert batch["num_paths"].tolist() == [2.0, 1.0]
    assert batch["paths_through"][0].tolist() == [2, 1, 1, 1, 1]


def test_collate_decoded_wire_records() -> None:
    codec = Codec()
    samples = [make_sample(4, sid="a"), make_sample(2, sid="b", parents=[-1, 0])]
    decoded = [codec.decode(codec.encode(s), expect=Sample) for s in samples]
    assert not decoded[0].input_ids.flags.writeable  # read-only views of the wire bytes
    batch = collate(decoded)
    assert batch["input_ids"].tolist() == [[100, 101, 102, 103], [100, 101, 0, 0]]


@pytest.mark.parametrize(
    ("sample", "why"),
    [
        (make_sample(3, mask=[1, 1, 1]), "no preceding token"),
        (make_sample(3, mask=[0, 1]), "lengths differ"),
        (make_sample(3, parents=[-1, 0, -1], mask=[0, 1, 1]), "no preceding token"),
        (make_sample(4, parents=[-1, 0, 0, 1]), "pre-order"),
        (make_sample(3, parents=[-1, 0]), "parent indices"),
        (make_sample(0, mask=[]), "no tokens"),
    ],
)
def test_invalid_samples_raise(sample: Sample, why: str) -> None:
    with pytest.raises(BatchingError, match=why):
        validate_sample(sample)
    with pytest.raises(BatchingError, match=why):
        collate([make_sample(), sample])


def test_collate_empty() -> None:
    with pytest.raises(BatchingError):
        collate([])
