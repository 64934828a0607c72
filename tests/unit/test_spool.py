"""The local append-only spool: order, acks, restarts, torn writes, slots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollstream.producers.sdk.spool import Spool, SpoolFull, SpoolItem, record_digest


def item(i: int, *, topic: str = "t", uncertain: bool = False, size: int = 10) -> SpoolItem:
    return SpoolItem(topic, f"k{i % 3}".encode(), f"v{i}".encode().ljust(size, b"."), i, uncertain)


def values(records: list) -> list[int]:
    return [int(r.value.rstrip(b".")[1:]) for r in records]


def drain(spool: Spool, *, ack: bool = True) -> list[int]:
    out = []
    while batch := spool.read(max_records=7):
        out += values(batch)
        if ack:
            for r in batch:
                spool.ack(r)
    return out


@pytest.mark.parametrize("fsync", ["always", "interval", "never"])
def test_fifo_round_trip(tmp_path: Path, fsync: str) -> None:
    spool = Spool(tmp_path, fsync=fsync)
    spool.extend(item(i) for i in range(50))
    assert (spool.backlog, spool.unread) == (50, 50)
    records = spool.read(max_records=5)
    assert [(r.topic, r.key, r.ts_ms) for r in records[:2]] == [("t", b"k0", 0), ("t", b"k1", 1)]
    for r in records:
        spool.ack(r)
    assert values(records) + drain(spool) == list(range(50))
    assert spool.backlog == 0
    spool.close()


def test_unacked_records_survive_a_restart_acked_ones_do_not(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.extend(item(i) for i in range(10))
    batch = spool.read(max_records=6)
    for r in batch[:4]:
        spool.ack(r)
    spool.close()  # records 4, 5 were read but never acked: they stay
    again = Spool(tmp_path)
    assert again.path == spool.path
    assert drain(again) == list(range(4, 10))
    again.close()
    assert Spool(tmp_path).backlog == 0


def test_ack_offset_only_advances_over_a_contiguous_prefix(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.extend(item(i) for i in range(5))
    batch = spool.read()
    spool.ack(batch[1])
    spool.ack(batch[2])
    spool.close()  # 0 unacked: 0..4 all come back (1, 2 were acked out of order)
    again = Spool(tmp_path)
    assert values(again.read()) == [0, 1, 2, 3, 4]
    again.close()


def test_prepend_goes_in_front_even_mid_read(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.extend(item(i) for i in range(10, 20))
    first = spool.read(max_records=3)
    for r in first:
        spool.ack(r)
    spool.prepend([item(1), item(2)])
    spool.prepend([item(0)])
    spool.append(item(20))
    assert drain(spool) == [0, 1, 2, *range(13, 21)]
    spool.close()


def test_prepend_survives_restart_in_order(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.extend(item(i) for i in range(5, 8))
    spool.prepend([item(3, uncertain=True), item(4)])
    spool.close()
    again = Spool(tmp_path)
    records = []
    while batch := again.read():
        records += batch
    assert values(records) == [3, 4, 5, 6, 7]
    assert [r.uncertain for r in records] == [True, False, False, False, False]
    again.close()


def test_rewind_gives_records_back(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.extend(item(i) for i in range(6))
    batch = spool.read()
    spool.ack(batch[0])
    spool.ack(batch[1])
    spool.rewind(batch[3])
    spool.ack(batch[2])
    assert spool.unread == 3
    assert drain(spool) == [3, 4, 5]
    assert spool.backlog == 0
    spool.close()


def test_torn_tail_is_truncated_on_open(tmp_path: Path) -> None:
    spool = Spool(tmp_path, fsync="always")
    spool.extend(item(i) for i in range(3))
    path = spool.path
    spool.close()
    seg = next(path.glob("*.seg"))
    with open(seg, "ab") as f:
        f.write(b"\x01\x02\x03\x04\x05")  # a crash in the middle of a header
    again = Spool(tmp_path)
    assert again.truncated_bytes == 5
    assert drain(again) == [0, 1, 2]
    again.append(item(3))
    assert drain(again) == [3]
    again.close()


def test_corrupt_record_is_detected_by_crc(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.extend(item(i) for i in range(4))
    path = spool.path
    spool.close()
    seg = next(path.glob("*.seg"))
    data = bytearray(seg.read_bytes())
    data[-3] ^= 0xFF  # flip a byte in the last record's value
    seg.write_bytes(bytes(data))
    again = Spool(tmp_path)
    assert drain(again) == [0, 1, 2]
    assert again.truncated_bytes > 0
    again.close()


def test_segments_rotate_and_are_deleted_when_acked(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=400)
    spool.extend(item(i, size=100) for i in range(3))
    spool.extend(item(i, size=100) for i in range(3, 6))
    spool.extend(item(i, size=100) for i in range(6, 9))
    assert len(list(spool.path.glob("*.seg"))) >= 2
    assert drain(spool) == list(range(9))
    assert len(list(spool.path.glob("*.seg"))) <= 1
    spool.close()
    assert Spool(tmp_path).backlog == 0


def test_record_larger_than_a_read_batch(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    big = SpoolItem("t", b"k", os.urandom(3 << 20), 1)
    spool.extend([item(0), big, item(2)])
    a = spool.read(max_bytes=1 << 20)
    b = spool.read(max_bytes=1 << 20)
    assert values(a) == [0]
    assert b[0].value == big.value
    spool.close()


def test_uncertain_digests_per_topic(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.prepend([item(5, uncertain=True), item(3, topic="u", uncertain=True), item(9)])
    spool.append(item(1))
    found = spool.uncertain()
    assert set(found) == {"t", "u"}
    since, digests = found["t"]
    assert since == 5
    assert digests == {record_digest("t", b"k2", item(5).value)}
    spool.close()


def test_each_live_writer_gets_its_own_slot(tmp_path: Path) -> None:
    a = Spool(tmp_path)
    b = Spool(tmp_path)
    assert a.path != b.path
    a.append(item(1))
    b.append(item(2))
    a.close()
    b.close()
    c = Spool(tmp_path)  # slot-0 is free again: its leftovers (and slot-1's) come with it
    assert c.path == a.path and sorted(drain(c)) == [1, 2]
    c.close()


def test_closed_spool_refuses_writes(tmp_path: Path) -> None:
    from rollstream.producers import SpoolError

    spool = Spool(tmp_path)
    spool.close()
    with pytest.raises(SpoolError):
        spool.append(item(1))


def test_orphaned_slots_are_adopted_in_order(tmp_path: Path) -> None:
    a = Spool(tmp_path)
    b = Spool(tmp_path)  # slot-1
    b.extend(item(i) for i in range(3))
    b.prepend([item(9)])
    b.close()  # its process died; slot-1 has no owner now
    a.append(item(5))
    a.close()
    c = Spool(tmp_path)  # takes slot-0, adopts slot-1 in front of its own records
    assert drain(c) == [9, 0, 1, 2, 5]
    assert not list(b.path.glob("*.seg"))
    c.close()


def test_the_spool_is_bounded_and_frees_room_as_records_are_acked(tmp_path: Path) -> None:
    item = SpoolItem("t", b"k", b"v" * 100, 1)
    spool = Spool(tmp_path, fsync="never", max_bytes=1_000)
    with pytest.raises(SpoolFull, match="spool_max_bytes"):
        spool.extend([item] * 20)  # all or nothing: none of the 20 written
    assert spool.backlog == 0 and not spool.full
    while not spool.full:
        try:
            spool.append(item)
        except SpoolFull:
            break
    held = spool.backlog
    assert 0 < held < 20 and spool.held_bytes <= 1_000
    spool.prepend([item] * 5)  # accepted work is never refused: prepend is not bounded
    assert spool.backlog == held + 5 and spool.full
    while batch := spool.read(max_records=100):
        for rec in batch:
            spool.ack(rec)
    assert spool.held_bytes == 0 and not spool.full
    spool.append(item)  # room again
    spool.close()
