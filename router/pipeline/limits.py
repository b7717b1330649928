"""How often a caller may ask: ``TenantLimiter`` keeps each caller's requests and tokens per
minute (a tenant's ``rate_limit_rpm`` / ``rate_limit_tpm``), checked before routing. What one
request may ask (policy ``service.limits``) is checked when its body is parsed
(``router.openai.request.check_limits``).
"""

from __future__ import annotations

import time

__all__ = ["TenantLimiter"]


class TenantLimiter:
    """Per-caller token buckets: requests (``rate_limit_rpm``) and tokens (``rate_limit_tpm``)."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}

    def check(self, key: str, per_minute: int, cost: float = 1.0) -> float | None:
        """None when allowed (``cost`` is charged); otherwise the seconds until it would be.

        A cost above the bucket's size passes once the bucket is full and leaves it in debt, so a
        large request is possible but paid for by the wait of the next ones."""
        t = time.monotonic()
        tokens, last = self._buckets.get(key, (float(per_minute), t))
        tokens = min(float(per_minute), tokens + (t - last) * per_minute / 60.0)
        need = min(cost, float(per_minute))
        if tokens < need:
            self._buckets[key] = (tokens, t)
            return (need - tokens) * 60.0 / per_minute
        self._buckets[key] = (tokens - cost, t)
        return None
