"""The trainer's window of recently trained sample ids (batching.TrainedIds): FIFO and bounded,
and carried through a real checkpoint on disk (checkpoint.CheckpointStore) so a restart still
knows what was trained."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rollstream.consumers.errors import BatchingError, CheckpointError
from rollstream.consumers.training.batching import TrainedIds, sample_key
from rollstream.consumers.training.checkpoint import (
    TRAINED_IDS,
    CheckpointMeta,
    CheckpointStore,
    Manifest,
)


def test_trained_ids_are_found_and_the_oldest_go_first() -> None:
    ids = TrainedIds(3)
    for sid in ("a", "b", "c"):
        ids.add(sid)
    assert all(s in ids for s in "abc") and "d" not in ids and len(ids) == 3
    ids.add("b")  # already there: nothing moves
    ids.add("d")
    assert "a" not in ids and all(s in ids for s in "bcd") and len(ids) == 3
    assert ids.keys().tolist() == [sample_key(s) for s in "bcd"]
    assert 7 not in ids  # not a sample id


def test_a_zero_window_keeps_nothing_and_a_negative_one_is_refused() -> None:
    ids = TrainedIds(0)
    ids.add("a")
    assert "a" not in ids and len(ids) == 0 and ids.keys().tolist() == []
    with pytest.raises(BatchingError):
        TrainedIds(-1)


@given(
    capacity=st.integers(0, 50),
    stream=st.lists(st.integers(0, 80).map(lambda i: f"sample-{i}"), max_size=300),
)
def test_the_window_is_the_last_distinct_ids_in_arrival_order(
    capacity: int, stream: list[str]
) -> None:
    """Against a plain list model: FIFO over distinct ids, re-adds ignored, bounded."""
    ids = TrainedIds(capacity)
    model: list[str] = []
    for sid in stream:
        ids.add(sid)
        if capacity and sid not in model:
            model = [*model, sid][-capacity:]
        assert len(ids) == len(model) <= capacity
    assert ids.keys().tolist() == [sample_key(s) for s in model]
    assert {s for s in stream if s in ids} == set(model)
    # what a checkpoint carries rebuilds the same window, also under a smaller capacity
    again = TrainedIds(capacity, ids.keys())
    assert again.keys().tolist() == ids.keys().tolist()
    smaller = TrainedIds(capacity // 2, ids.keys())
    newest = model[max(0, len(model) - capacity // 2) :]
    assert smaller.keys().tolist() == [sample_key(s) for s in newest]


def test_the_window_grows_past_its_first_allocation() -> None:
    ids = TrainedIds(5000)
    for i in range(6000):
        ids.add(f"s{i}")
    assert len(ids) == 5000 and "s999" not in ids and "s1000" in ids and "s5999" in ids
    assert ids.keys().tolist() == [sample_key(f"s{i}") for i in range(1000, 6000)]


def _meta(step: int) -> CheckpointMeta:
    return CheckpointMeta(
        step=step,
        policy_version=step,
        offsets={"ns.samples": {0: step * 3}},
        counters={"duplicates_dropped": float(step)},
        manifest=Manifest("ns.samples", trained=[(0, step)], duplicate=[(0, step + 100)]),
    )


def test_the_window_survives_a_checkpoint_on_disk(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    store = CheckpointStore(tmp_path / "ckpt", fsync=False)
    ids = TrainedIds(4)
    for sid in ("a", "b", "c"):
        ids.add(sid)
    store.save(_meta(1), model, trained_ids=ids.keys())
    ids.add("d")
    ids.add("e")
    store.save(_meta(2), model, trained_ids=ids.keys())

    reopened = CheckpointStore(tmp_path / "ckpt")  # a restart
    latest = reopened.latest()
    assert latest is not None and latest.step == 2
    restored = TrainedIds(4, reopened.trained_ids(latest))
    assert "a" not in restored and all(s in restored for s in "bcde")
    assert latest.meta.manifest is not None and latest.meta.manifest.duplicate == [(0, 102)]
    assert [m.duplicate for _, m in reopened.manifests()] == [[(0, 101)], [(0, 102)]]


def test_a_checkpoint_without_a_window_reads_as_empty_and_a_bad_one_fails(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", fsync=False)
    ckpt = store.save(_meta(1), torch.nn.Linear(2, 2))  # written before the window existed
    assert store.trained_ids(ckpt).tolist() == []
    np.save(ckpt.path / TRAINED_IDS, np.zeros((2, 2), np.float32))
    with pytest.raises(CheckpointError, match="not uint64"):
        store.trained_ids(ckpt)
    (ckpt.path / TRAINED_IDS).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a trained-ids file"):
        store.trained_ids(ckpt)


def test_old_manifests_read_without_duplicates() -> None:
    old = {"topic": "t", "trained": [[0, 1]], "stale": [], "dlq": [[0, 2]]}
    assert Manifest.from_json(old) == Manifest("t", [(0, 1)], [], [(0, 2)], [])
