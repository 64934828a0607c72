"""Verified re-inserts (consumers/store/verify.py): which rows of a batch are still missing."""

from __future__ import annotations

import pyarrow as pa

from rollstream.consumers.store.verify import fresh_token, missing_rows


def table(offsets: list[int], tag: str) -> pa.Table:
    return pa.table(
        {"event_id": [f"{tag}{o}" for o in offsets], "kafka_offset": pa.array(offsets, pa.int64())}
    )


def test_only_rows_whose_offsets_are_absent_are_kept() -> None:
    tables = {"events": table([10, 11, 12, 13], "e"), "rewards": table([11, 13], "r")}
    out = missing_rows(tables, {"events": {10, 12}, "rewards": {11, 13}})
    assert set(out) == {"events"}  # every reward is there: nothing to insert
    assert out["events"].column("event_id").to_pylist() == ["e11", "e13"]
    assert out["events"].schema == tables["events"].schema


def test_nothing_present_keeps_every_row_and_a_table_absent_from_present_counts_as_empty() -> None:
    tables = {"events": table([5, 6], "e"), "llm_calls": table([6], "c")}
    out = missing_rows(tables, {"events": set()})
    assert {k: v.num_rows for k, v in out.items()} == {"events": 2, "llm_calls": 1}


def test_fresh_tokens_keep_the_batch_token_and_never_repeat() -> None:
    tokens = {fresh_token("events:3:0:399") for _ in range(1000)}
    assert len(tokens) == 1000
    assert all(t.startswith("events:3:0:399:v") for t in tokens)
