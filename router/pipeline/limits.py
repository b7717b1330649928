"""How often a caller may ask: ``TenantLimiter`` keeps each caller's requests and tokens per
minute (a tenant's ``rate_limit_rpm`` / ``rate_limit_tpm``), checked before routing. What one
request may ask (policy ``service.limits``) is checked when its body is parsed
(``router.openai.bounds.check_limits``).
"""

from __future__ import annotations

import time

__all__ = ["MAX_BUCKETS", "TenantLimiter"]

MAX_BUCKETS = 100_000
"""Callers whose buckets are kept at most (a few MB); beyond, refilled and idle ones are dropped."""


class TenantLimiter:
    """Per-caller token buckets: requests (``rate_limit_rpm``) and tokens (``rate_limit_tpm``)."""

    def __init__(self, max_buckets: int = MAX_BUCKETS) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}
        self._rates: dict[str, int] = {}
        self.max_buckets = max_buckets

    def _prune(self, now: float) -> None:
        """Past ``max_buckets`` callers, forget every bucket that has refilled (the same as no
        entry: a new one starts full), then the longest idle ones: memory stays bounded however
        many distinct callers (or tenant names behind a gateway key) come and go."""
        full = [
            k
            for k, (tokens, last) in self._buckets.items()
            if tokens + (now - last) * self._rates[k] / 60.0 >= self._rates[k]
        ]
        for k in full:
            del self._buckets[k], self._rates[k]
        if len(self._buckets) > self.max_buckets // 2:
            idle = sorted(self._buckets, key=lambda k: self._buckets[k][1])
            for k in idle[: len(self._buckets) - self.max_buckets // 2]:
                del self._buckets[k], self._rates[k]

    def check(self, key: str, per_minute: int, cost: float = 1.0) -> float | None:
        """None when allowed (``cost`` is charged); otherwise the seconds until it would be.

        A cost above the bucket's size passes once the bucket is full and leaves it in debt, so a
        large request is possible but paid for by the wait of the next ones."""
        t = time.monotonic()
        if key not in self._buckets and len(self._buckets) >= self.max_buckets:
            self._prune(t)
        self._rates[key] = per_minute
        tokens, last = self._buckets.get(key, (float(per_minute), t))
        tokens = min(float(per_minute), tokens + (t - last) * per_minute / 60.0)
        need = min(cost, float(per_minute))
        if tokens < need:
            self._buckets[key] = (tokens, t)
            return (need - tokens) * 60.0 / per_minute
        self._buckets[key] = (tokens - cost, t)
        return None
