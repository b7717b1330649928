"""Pieces of the request pipeline that need no server."""

from __future__ import annotations

import pytest

from router.pipeline.limits import TenantLimiter


def test_tenant_token_bucket_allows_the_rate_then_asks_to_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("router.pipeline.limits.time.monotonic", lambda: now[0])
    limiter = TenantLimiter()
    assert all(limiter.check("t", 60) is None for _ in range(60))  # a full minute's burst
    wait = limiter.check("t", 60)
    assert wait is not None and 0.9 <= wait <= 1.1
    now[0] += 1.0  # one request's worth refills per second at 60 rpm
    assert limiter.check("t", 60) is None
    assert limiter.check("other", 60) is None  # buckets are per tenant
