"""Local append-only spool: where events wait, in order, while Kafka cannot take them.

Layout: ``<directory>/slot-<n>/`` is held by one live writer at a time (``flock`` on its LOCK
file; a second recorder takes the next free slot). A slot holds segment files read in id order:

    <id>.seg   b"RSSPOOL1", then records:
               crc32 u32 | flags u8 | topic_len u16 | key_len u32 | value_len u32 | ts_ms i64
               | topic | key | value          (little-endian; the CRC covers all after itself)
    <id>.ack   8-byte offset: every record before it was delivered (or moved to the front)

``append`` writes at the tail. ``prepend`` writes a new segment whose id sorts before all
others: older records that came back (failed deliveries, events still in memory) go in front of
everything already spooled, so per-key order holds. ``read`` hands out unread records in order,
``ack`` marks one delivered (the ack offset advances over the contiguous delivered prefix; a
fully acked segment is deleted), ``rewind`` gives back records read but never handed on.

A spool left by a dead process is found by the next writer of the same slot: on open each
segment is scanned from its ack offset, CRCs checked, a torn tail (crash mid-write) truncated.
Durability follows the fsync policy: ``always`` (every write), ``interval`` (``sync_if_due``,
called by the delivery thread), ``never`` (the OS decides). Records flagged ``uncertain`` may
already be in Kafka (their delivery was in doubt); the reader checks them before re-sending.

A spool holds at most ``max_bytes`` of records not yet acknowledged (None: no bound): ``extend``
raises SpoolFull past it; ``full`` says so a reserve (1/16, at most 16 MiB) before. ``prepend``
is not bounded: what it writes was accepted already (failed deliveries, events still in
memory), and losing it would lose acknowledged work; it is bounded by the delivery queue that
holds it.

Errors (producers/errors.py): SpoolError, a ProducerError, when the spool directory cannot be
used (the OSError wrapped); SpoolFull, a SpoolError, when it holds ``max_bytes``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollstream.producers.errors import SpoolError, SpoolFull

__all__ = [
    "FsyncPolicy",
    "Spool",
    "SpoolError",
    "SpoolFull",
    "SpoolItem",
    "SpoolRecord",
    "record_digest",
]

log = logging.getLogger("rollstream.producers")

FsyncPolicy = Literal["always", "interval", "never"]
MAGIC = b"RSSPOOL1"
_HEADER = struct.Struct("<IBHIIq")  # crc, flags, topic_len, key_len, value_len, ts_ms
_ACK = struct.Struct("<Q")
_UNCERTAIN = 1
_ID_BIAS = 1 << 40  # ids below the first segment (prepends) stay non-negative in file names
_MAX_SLOTS = 256
_CHUNK = 8 << 20


def record_digest(topic: str, key: bytes, value: bytes) -> bytes:
    """Identity of a record, used to find out whether an uncertain one reached Kafka."""
    h = hashlib.blake2b(digest_size=16)
    h.update(topic.encode())
    h.update(b"\0")
    h.update(len(key).to_bytes(4, "little"))
    h.update(key)
    h.update(value)
    return h.digest()


@dataclass(slots=True)
class SpoolItem:
    """A record to write: where it goes and when it was recorded."""

    topic: str
    key: bytes
    value: bytes
    ts_ms: int
    uncertain: bool = False


@dataclass(slots=True)
class SpoolRecord:
    """A record read from the spool; pass it back to ``ack`` or ``rewind``."""

    topic: str
    key: bytes
    value: bytes
    ts_ms: int
    uncertain: bool
    segment: int
    offset: int
    end: int


def _encode(item: SpoolItem) -> bytes:
    topic = item.topic.encode()
    flags = _UNCERTAIN if item.uncertain else 0
    rest = _HEADER.pack(0, flags, len(topic), len(item.key), len(item.value), item.ts_ms)[4:]
    crc = zlib.crc32(item.value, zlib.crc32(item.key, zlib.crc32(topic, zlib.crc32(rest))))
    return b"".join((struct.pack("<I", crc), rest, topic, item.key, item.value))


def _decode(buf: bytes | memoryview, pos: int) -> tuple[SpoolItem, int] | None:
    """The record at ``pos`` and the offset after it; None when incomplete or corrupt."""
    if len(buf) - pos < _HEADER.size:
        return None
    crc, flags, tlen, klen, vlen, ts = _HEADER.unpack_from(buf, pos)
    body = pos + _HEADER.size
    end = body + tlen + klen + vlen
    if end > len(buf):
        return None
    view = memoryview(buf)
    check = zlib.crc32(view[pos + 4 : end])
    if check != crc:
        return None
    topic = bytes(view[body : body + tlen]).decode(errors="replace")
    key = bytes(view[body + tlen : body + tlen + klen])
    value = bytes(view[body + tlen + klen : end])
    return SpoolItem(topic, key, value, ts, bool(flags & _UNCERTAIN)), end


def _record_size(buf: bytes, pos: int) -> int | None:
    if len(buf) - pos < _HEADER.size:
        return None
    _, _, tlen, klen, vlen, _ = _HEADER.unpack_from(buf, pos)
    return _HEADER.size + tlen + klen + vlen


def _records(fd: int, start: int, size: int) -> Iterator[tuple[SpoolItem, int, int]]:
    """(item, start, end) of each valid record in ``fd[start:size]``, read in 8 MiB chunks;
    stops at the first incomplete or corrupt record."""
    pos = start
    while pos < size:
        data = os.pread(fd, min(_CHUNK, size - pos), pos)
        need = _record_size(data, 0)
        if need is not None and need > len(data):
            data = os.pread(fd, min(need, size - pos), pos)
        off = 0
        while (rec := _decode(data, off)) is not None:
            item, end = rec
            yield item, pos + off, pos + end
            off = end
        if off == 0:
            return
        pos += off


@dataclass
class _Segment:
    id: int
    path: Path
    fd: int
    ack_fd: int
    size: int
    read_off: int
    ack_off: int
    unread: int
    unacked: int
    uncertain: bool = False
    dirty: bool = False
    ack_dirty: bool = False
    ends: dict[int, int] = field(default_factory=dict)  # read, not yet acked: start -> end
    acked: set[int] = field(default_factory=set)  # acked out of order, beyond ack_off

    def close(self) -> None:
        for fd in (self.fd, self.ack_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


class Spool:
    """A durable FIFO of (topic, key, value) records in ``directory/slot-<n>``. Thread-safe."""

    def __init__(
        self,
        directory: Path | str,
        *,
        fsync: FsyncPolicy = "interval",
        fsync_interval_s: float = 0.2,
        segment_bytes: int = 64 << 20,
        max_bytes: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.segment_bytes = segment_bytes
        self._lock = threading.RLock()
        self._segments: dict[int, _Segment] = {}
        self._last_sync = time.monotonic()
        self._closed = False
        self.truncated_bytes = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.path, self._lock_fd = self._take_slot()
            self._adopt_orphans()
            self._recover()
        except OSError as exc:
            raise SpoolError(f"cannot open spool in {self.directory}: {exc}") from exc

    # --- open / recovery --------------------------------------------------------------------

    def _take_slot(self) -> tuple[Path, int]:
        for n in range(_MAX_SLOTS):
            path = self.directory / f"slot-{n}"
            path.mkdir(exist_ok=True)
            fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return path, fd
        raise SpoolError(f"all {_MAX_SLOTS} spool slots in {self.directory} are held")

    def _adopt_orphans(self) -> None:
        """Move the segments of slots no live writer holds (a process that died while a second
        recorder held slot-0, say) in front of ours, so nothing waits for a slot to be reused."""
        own = [int(p.stem) - _ID_BIAS for p in self.path.glob("*.seg") if p.stem.isdigit()]
        next_id = min(own, default=0) - 1
        for other in sorted(self.directory.glob("slot-*")):
            if other == self.path or not any(other.glob("*.seg")):
                continue
            fd = os.open(other / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # alive
            try:
                segs = sorted(p for p in other.glob("*.seg") if p.stem.isdigit())
                for seg in reversed(segs):
                    target = self._seg_path(next_id)
                    ack = seg.with_suffix(".ack")
                    if ack.exists():
                        ack.replace(target.with_suffix(".ack"))
                    seg.replace(target)
                    next_id -= 1
                if segs:
                    log.info("spool %s: adopted %d segments from %s", self.path, len(segs), other)
            finally:
                os.close(fd)

    def _recover(self) -> None:
        for seg_path in sorted(self.path.glob("*.seg")):
            try:
                seg_id = int(seg_path.stem) - _ID_BIAS
            except ValueError:
                continue
            seg = self._open_segment(seg_id, create=False)
            self._scan(seg)
            self._segments[seg_id] = seg
            if seg.unacked == 0:
                self._drop_segment(seg)
        backlog = self.backlog
        if backlog:
            log.info("spool %s: %d records left by an earlier run", self.path, backlog)

    def _seg_path(self, seg_id: int) -> Path:
        return self.path / f"{seg_id + _ID_BIAS:016d}.seg"

    def _open_segment(self, seg_id: int, *, create: bool) -> _Segment:
        path = self._seg_path(seg_id)
        flags = os.O_RDWR | os.O_APPEND | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o644)
        if create:
            os.write(fd, MAGIC)
            self._sync_dir()
        ack_fd = os.open(path.with_suffix(".ack"), os.O_RDWR | os.O_CREAT, 0o644)
        raw = os.pread(ack_fd, _ACK.size, 0)
        ack_off = _ACK.unpack(raw)[0] if len(raw) == _ACK.size else len(MAGIC)
        size = os.fstat(fd).st_size
        ack_off = max(len(MAGIC), min(ack_off, size))
        return _Segment(seg_id, path, fd, ack_fd, size, ack_off, ack_off, 0, 0)

    def _scan(self, seg: _Segment) -> None:
        if os.pread(seg.fd, len(MAGIC), 0) != MAGIC:
            log.error("spool %s: not a spool segment, ignored", seg.path)
            seg.size = seg.read_off = seg.ack_off = len(MAGIC)
            return
        pos, count, uncertain = seg.ack_off, 0, False
        for item, _, end in _records(seg.fd, seg.ack_off, seg.size):
            pos = end
            count += 1
            uncertain = uncertain or item.uncertain
        if pos < seg.size:
            lost = seg.size - pos
            log.warning(
                "spool %s: %d torn/corrupt bytes at offset %d truncated", seg.path, lost, pos
            )
            os.ftruncate(seg.fd, pos)
            self.truncated_bytes += lost
            seg.size = pos
        seg.unread = seg.unacked = count
        seg.uncertain = uncertain

    def _sync_dir(self) -> None:
        if self.fsync == "never":
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # --- write ------------------------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """Records written and not yet acked."""
        with self._lock:
            return sum(s.unacked for s in self._segments.values())

    @property
    def unread(self) -> int:
        """Records not yet handed out by ``read``."""
        with self._lock:
            return sum(s.unread for s in self._segments.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of records written and not yet acknowledged (the segments past their ack)."""
        with self._lock:
            return sum(s.size - s.ack_off for s in self._segments.values())

    @property
    def full(self) -> bool:
        """Held bytes have reached ``max_bytes`` less a reserve (1/16 of it, at most 16 MiB):
        a service that stops taking work when the spool is full still has room for the events
        of the work it took before (``extend`` itself refuses only past ``max_bytes``)."""
        if self.max_bytes is None:
            return False
        reserve = min(self.max_bytes // 16, 16 << 20)
        return self.held_bytes >= self.max_bytes - reserve

    def append(self, item: SpoolItem) -> None:
        self.extend((item,))

    def extend(self, items: Iterable[SpoolItem]) -> None:
        """Write records at the tail, in order."""
        data = [_encode(item) for item in items]
        if not data:
            return
        with self._lock:
            self._check_open()
            if self.max_bytes is not None:
                need = sum(map(len, data))
                if self.held_bytes + need > self.max_bytes:
                    raise SpoolFull(
                        f"spool {self.path} holds {self.held_bytes} bytes; {need} more would "
                        f"pass its bound of {self.max_bytes} (spool_max_bytes)"
                    )
            tail = self._tail()
            try:
                os.write(tail.fd, b"".join(data))
            except OSError as exc:
                raise SpoolError(f"cannot write spool {tail.path}: {exc}") from exc
            tail.size += sum(map(len, data))
            tail.unread += len(data)
            tail.unacked += len(data)
            tail.dirty = True
            if self.fsync == "always":
                self._fsync(tail)

    def prepend(self, items: Iterable[SpoolItem]) -> None:
        """Write records in a new segment read before every record already spooled."""
        batch = list(items)
        if not batch:
            return
        with self._lock:
            self._check_open()
            seg_id = min(self._segments, default=0) - 1
            try:
                seg = self._open_segment(seg_id, create=True)
                data = b"".join(_encode(item) for item in batch)
                os.write(seg.fd, data)
            except OSError as exc:
                raise SpoolError(f"cannot write spool segment {seg_id}: {exc}") from exc
            seg.size += len(data)
            seg.unread = seg.unacked = len(batch)
            seg.uncertain = any(item.uncertain for item in batch)
            self._segments[seg_id] = seg
            if self.fsync != "never":
                self._fsync(seg)

    def _tail(self) -> _Segment:
        seg_id = max(self._segments, default=None)
        if seg_id is not None:
            seg = self._segments[seg_id]
            if seg.size < self.segment_bytes:
                return seg
            seg_id += 1
        else:
            seg_id = 0
        try:
            seg = self._open_segment(seg_id, create=True)
        except OSError as exc:
            raise SpoolError(f"cannot create spool segment in {self.path}: {exc}") from exc
        self._segments[seg_id] = seg
        return seg

    # --- read / ack -------------------------------------------------------------------------

    def read(self, max_records: int = 1000, max_bytes: int = 8 << 20) -> list[SpoolRecord]:
        """Up to ``max_records`` unread records, in order, from one segment."""
        with self._lock:
            self._check_open()
            seg = next((s for _, s in sorted(self._segments.items()) if s.unread), None)
            if seg is None:
                return []
            want = min(max_bytes, seg.size - seg.read_off)
            data = os.pread(seg.fd, want, seg.read_off)
            first = _record_size(data, 0)
            if first is not None and first > len(data):  # one record larger than max_bytes
                data = os.pread(seg.fd, first, seg.read_off)
            out: list[SpoolRecord] = []
            pos = 0
            while len(out) < max_records:
                rec = _decode(data, pos)
                if rec is None:
                    break
                item, end = rec
                start = seg.read_off + pos
                stop = seg.read_off + end
                out.append(
                    SpoolRecord(
                        item.topic,
                        item.key,
                        item.value,
                        item.ts_ms,
                        item.uncertain,
                        seg.id,
                        start,
                        stop,
                    )
                )
                seg.ends[start] = stop
                pos = end
            seg.read_off += pos
            seg.unread -= len(out)
            if not out and seg.unread:
                raise SpoolError(f"spool {seg.path} is corrupt at offset {seg.read_off}")
            return out

    def rewind(self, record: SpoolRecord) -> None:
        """Give back ``record`` and every record read after it from its segment."""
        with self._lock:
            seg = self._segments.get(record.segment)
            if seg is None or record.offset not in seg.ends:
                return
            back = [start for start in seg.ends if start >= record.offset]
            for start in back:
                del seg.ends[start]
            seg.unread += len(back)
            seg.read_off = record.offset

    def ack(self, record: SpoolRecord) -> None:
        """``record`` is delivered (or moved): it will not be read again, even after a restart."""
        with self._lock:
            seg = self._segments.get(record.segment)
            if seg is None or record.offset not in seg.ends:
                return
            seg.acked.add(record.offset)
            seg.unacked -= 1
            advanced = False
            while seg.ack_off in seg.acked:
                seg.acked.discard(seg.ack_off)
                seg.ack_off = seg.ends.pop(seg.ack_off)
                advanced = True
            if advanced:
                seg.ack_dirty = True
                if self.fsync == "always":
                    self._write_ack(seg)
            if seg.unacked == 0 and seg.read_off == seg.size and not seg.ends:
                is_tail = seg.id == max(self._segments)
                if not is_tail or len(self._segments) == 1:
                    self._drop_segment(seg)

    def uncertain(self) -> dict[str, tuple[int, set[bytes]]]:
        """Per topic: (earliest ts_ms, digests) of the unread records flagged uncertain."""
        with self._lock:
            self._check_open()
            out: dict[str, tuple[int, set[bytes]]] = {}
            for _, seg in sorted(self._segments.items()):
                if not seg.uncertain or not seg.unread:
                    continue
                for item, _, _ in _records(seg.fd, seg.read_off, seg.size):
                    if item.uncertain:
                        since, digests = out.get(item.topic, (item.ts_ms, set()))
                        digests.add(record_digest(item.topic, item.key, item.value))
                        out[item.topic] = (min(since, item.ts_ms), digests)
            return out

    def _drop_segment(self, seg: _Segment) -> None:
        seg.close()
        for path in (seg.path, seg.path.with_suffix(".ack")):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._segments.pop(seg.id, None)

    # --- durability -------------------------------------------------------------------------

    def _write_ack(self, seg: _Segment) -> None:
        os.pwrite(seg.ack_fd, _ACK.pack(seg.ack_off), 0)
        if self.fsync != "never":
            os.fsync(seg.ack_fd)
        seg.ack_dirty = False

    def _fsync(self, seg: _Segment) -> None:
        os.fsync(seg.fd)
        seg.dirty = False

    def sync(self) -> None:
        """Make every write and ack so far durable (fsync unless the policy is ``never``)."""
        with self._lock:
            if self._closed:
                return
            for seg in self._segments.values():
                if seg.ack_dirty:
                    self._write_ack(seg)
                if seg.dirty and self.fsync != "never":
                    self._fsync(seg)
            self._last_sync = time.monotonic()

    def sync_if_due(self) -> None:
        if time.monotonic() - self._last_sync >= self.fsync_interval_s:
            try:
                self.sync()
            except OSError as exc:
                log.error("spool %s: sync failed: %s", self.path, exc)

    def _check_open(self) -> None:
        if self._closed:
            raise SpoolError(f"spool {self.directory} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Persist acks, fsync, release the slot. Records read but not acked stay spooled."""
        with self._lock:
            if self._closed:
                return
            try:
                self.sync()
            finally:
                self._closed = True
                for seg in self._segments.values():
                    seg.close()
                self._segments.clear()
                with contextlib.suppress(OSError):
                    os.close(self._lock_fd)
