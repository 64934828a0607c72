"""Token buckets per key, with a bounded number of buckets (pure; no I/O, the clock injected):
the proxy's rate limit per rollout token.

    limiter = RateLimiter(rate=20.0, burst=40, clock=time.monotonic)
    wait = limiter.take(rollout_id)   # 0.0: allowed, one token taken
                                      # > 0: refused, seconds until a token is there
    retry_after(wait)                 # the Retry-After header of a refusal: whole seconds, >= 1

Each key has a bucket that holds at most ``burst`` tokens and refills at ``rate`` tokens per
second; a request takes one token, and a request that finds less than one is refused without
taking anything (a client that waits the answered time gets through). A key never seen starts
with a full bucket.

Memory: at most ``max_buckets`` buckets, in least-recently-used order. A bucket idle for
``burst / rate`` seconds is full again, which is the same as having no bucket, so each ``take``
drops up to two such buckets from the old end of the order (amortised O(1); idle keys cost
nothing after a while). Past ``max_buckets`` the least recently used bucket is dropped even if it
is not full: that key starts again with a full bucket, so a full table makes the limit more
lenient, never stricter, and never grows. A clock that goes backwards refills nothing.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from rollstream.producers.errors import ProxyConfigError

__all__ = ["MAX_BUCKETS", "RateLimiter", "retry_after"]

MAX_BUCKETS: Final = 65_536  # keys remembered at once (one bucket: ~150 bytes)


@dataclass(slots=True)
class _Bucket:
    tokens: float  # what was left at ``stamp``
    stamp: float  # clock reading of the last take


def retry_after(wait_s: float) -> int:
    """``Retry-After`` for a refusal that must wait ``wait_s`` seconds: whole seconds, at least
    1 (rounded up, so a client that waits that long finds a token)."""
    return max(1, math.ceil(wait_s))


class RateLimiter:
    """Token buckets by key: ``take(key)`` is 0.0 (allowed) or the seconds to wait. ``limited``
    counts the refusals; ``len()`` is the number of buckets held."""

    def __init__(
        self,
        rate: float,
        burst: float,
        *,
        clock: Callable[[], float],
        max_buckets: int = MAX_BUCKETS,
    ) -> None:
        if not (math.isfinite(rate) and rate > 0):
            raise ProxyConfigError(f"rate must be a positive number of tokens per second: {rate}")
        if not (math.isfinite(burst) and burst >= 1):
            raise ProxyConfigError(f"burst must be a number >= 1: {burst}")
        if max_buckets < 1:
            raise ProxyConfigError(f"max_buckets must be >= 1: {max_buckets}")
        self.rate, self.burst, self.max_buckets = float(rate), float(burst), max_buckets
        self._clock = clock
        self._full_after = self.burst / self.rate  # idle seconds after which a bucket is full
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self.limited = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str) -> float:
        """Take a token from ``key``'s bucket: 0.0 when there was one, else the seconds until
        there will be one (nothing taken)."""
        now = self._clock()
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            bucket = _Bucket(self.burst, now)
        elif now > bucket.stamp:
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.stamp) * self.rate)
            bucket.stamp = now
        wait = 0.0
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
        else:
            wait = (1.0 - bucket.tokens) / self.rate
            self.limited += 1
        self._buckets[key] = bucket  # the most recently used end
        self._evict(now)
        return wait

    def _evict(self, now: float) -> None:
        buckets = self._buckets
        while len(buckets) > self.max_buckets:
            buckets.popitem(last=False)
        for _ in range(2):  # idle ones at the old end: full again, the same as absent
            oldest = next(iter(buckets.values()))  # never the one just used: its stamp is now
            if now - oldest.stamp < self._full_after:
                return
            buckets.popitem(last=False)
