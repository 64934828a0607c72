"""ULIDs for events, rollouts and calls: ``new_ulid()`` (thread-safe, fork-safe, ~1 us).

48-bit ms time + 80 random bits in Crockford base32 (the strings python-ulid makes and parses),
monotonic within a process: in the same millisecond the next id is the last one's random part
+ 1, as ulid-py's monotonic factory does, so ids made in order sort in order. The time part is
encoded once per millisecond; random bits come from ``os.urandom`` 512 ids at a time (a
getrandom call per id cost more than all the rest) and are encoded by base64's base32
translated to Crockford's alphabet; the next id in the same millisecond only changes the last
character, unless the increment carries into the one before it. A forked child forgets the last
id and the random pool, so parent and child never hand out the same ids.
"""

from __future__ import annotations

import base64
import os
import threading
import time

__all__ = ["new_ulid"]

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_TO_CROCKFORD = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", _CROCKFORD.encode())
_RAND_MASK = (1 << 80) - 1
_POOL_IDS = 512


class _UlidSource:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()  # a lock held by another thread at fork time stays held
        self._ms, self._rand, self._prefix = -1, 0, ""
        self._pool, self._pos = b"", 0
        self._last = ""  # the last id handed out

    def __call__(self) -> str:
        ms = time.time_ns() // 1_000_000
        with self._lock:
            if ms <= self._ms:  # same ms (or the clock went back): the next id
                rand = self._rand = (self._rand + 1) & _RAND_MASK
                if rand & 31:  # no carry out of the last base32 digit: only it changes
                    last = self._last = self._last[:-1] + _CROCKFORD[rand & 31]
                    return last
            else:
                if self._pos >= len(self._pool):
                    self._pool, self._pos = os.urandom(10 * _POOL_IDS), 0
                pos = self._pos
                self._pos = pos + 10
                rand = self._rand = int.from_bytes(self._pool[pos : pos + 10])
                self._ms = ms
                self._prefix = "".join(_CROCKFORD[(ms >> s) & 31] for s in range(45, -1, -5))
            last = self._last = (
                self._prefix + base64.b32encode(rand.to_bytes(10)).translate(_TO_CROCKFORD).decode()
            )
        return last


new_ulid = _UlidSource()
