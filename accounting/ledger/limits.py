"""Token buckets that keep one tenant, or one token key id, from taking a ledger server's time from the others.

Pure bookkeeping over a clock (time.monotonic by default, any callable in
tests); the server decides what a request costs and whom it is charged to.
Each server keeps its own buckets: N servers of one database let a tenant
through N times as fast.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable

from accounting.ledger.errors import RateLimited
from accounting.ledger.validation import MAX_PLAN_MECHANISMS

# A tenant's costly requests (Ledger._charge_curves): one unit is one RDP curve computed for a mechanism the
# server has not seen (milliseconds of CPU, up to some 0.2 s at a small noise multiplier), one more for a Fits. A full
# bucket holds a Fits of MAX_PLAN_MECHANISMS new mechanisms; then 2 a second, a few percent of one core per tenant.
CURVE_RATE_PER_SECOND = 2.0
CURVE_BURST = float(MAX_PLAN_MECHANISMS + 1)
# A commit costs one unit per this many steps, which its budget's PLD composes (caches.PLD_MAX_STEPS at most): a
# job's commits of 10**2 to 10**4 steps cost next to nothing, one of MAX_PLAN_STEPS most of a full bucket.
COMPOSED_STEPS_PER_UNIT = 100_000
# Failed authentications per token key id (of a tenant or of none): 20 at once, then one a second.
AUTH_FAILURE_RATE_PER_SECOND = 1.0
AUTH_FAILURE_BURST = 20.0
# Buckets kept at most; the fullest (idlest) are forgotten first, which forgives nothing still owed.
_MAX_BUCKETS = 100_000


@dataclass
class _Bucket:
    level: float
    updated: float


class TokenBuckets:
    """One token bucket per key: `burst` tokens at most, refilled at `rate_per_second`.

    `take(key, cost)` spends `cost` tokens or raises RateLimited saying when
    they will be there; `owes(key)` tells without spending whether the key's
    bucket is empty.
    """

    def __init__(
        self, rate_per_second: float, burst: float, what: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not (math.isfinite(rate_per_second) and rate_per_second > 0):
            raise ValueError(f"a rate limit must be a positive number per second (got {rate_per_second})")
        if not (math.isfinite(burst) and burst >= 1):
            raise ValueError(f"a burst must be at least 1 (got {burst})")
        self.rate_per_second = rate_per_second
        self.burst = burst
        self._what = what
        self._clock = clock
        self._buckets: dict[Hashable, _Bucket] = {}
        self._lock = threading.Lock()

    def _refilled(self, key: Hashable, now: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= _MAX_BUCKETS:
                self._forget_full(now)
            bucket = self._buckets[key] = _Bucket(self.burst, now)
        bucket.level = min(self.burst, bucket.level + (now - bucket.updated) * self.rate_per_second)
        bucket.updated = now
        return bucket

    def _forget_full(self, now: float) -> None:
        for key, bucket in list(self._buckets.items()):
            if bucket.level + (now - bucket.updated) * self.rate_per_second >= self.burst:
                del self._buckets[key]

    def take(self, key: Hashable, cost: float = 1.0) -> None:
        """Spend `cost` tokens of `key`'s bucket (a cost above the burst needs a full bucket), or raise RateLimited."""
        if cost <= 0:
            return
        with self._lock:
            now = self._clock()
            bucket = self._refilled(key, now)
            needed = min(cost, self.burst)
            if bucket.level < needed:
                wait = (needed - bucket.level) / self.rate_per_second
                raise RateLimited(
                    f"{self._what} for {key}: at most {self.burst:g} at once, then {self.rate_per_second:g} a second "
                    f"(this request counts {cost:g}); retry in {wait:.1f} s",
                    wait,
                )
            bucket.level -= needed

    def owes(self, key: Hashable) -> float:
        """Seconds until `key`'s bucket holds one token again (0 when it holds one now); spends nothing."""
        with self._lock:
            bucket = self._refilled(key, self._clock())
            return max(0.0, (1.0 - bucket.level) / self.rate_per_second)
