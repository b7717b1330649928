"""Issue 55: the rate limiter's memory is bounded. Bug: ``TenantLimiter._buckets`` never evicted,
so a client cycling caller names (tenant values behind a gateway key, fresh keys) grew it forever.
Dropping a refilled bucket must not change a decision (it equals a new, full one), and a caller in
debt keeps its debt while it is not the oldest idle."""

from __future__ import annotations

import pytest

from router.pipeline.limits import TenantLimiter


def test_buckets_stay_bounded_and_a_busy_caller_keeps_its_debt(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("router.pipeline.limits.time.monotonic", lambda: now[0])
    limiter = TenantLimiter(max_buckets=100)
    assert all(limiter.check("victim", 10) is None for _ in range(10))
    assert limiter.check("victim", 10) is not None  # at its limit
    for i in range(5000):  # an attacker's stream of new caller names, one request each
        now[0] += 0.001
        assert limiter.check(f"name-{i}", 10) is None
        limiter.check("victim", 10)  # the victim keeps asking: never the longest idle
        assert len(limiter._buckets) <= 100
    assert limiter.check("victim", 10) is not None  # still limited: its bucket was not forgotten


def test_a_refilled_bucket_dropped_is_the_same_as_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches pruning that forgets a bucket still in debt (a limited caller would be let through):
    bursts past the limit, a minute apart, decide the same with 4 buckets kept as with 10,000."""
    now = [0.0]
    monkeypatch.setattr("router.pipeline.limits.time.monotonic", lambda: now[0])
    small, big = TenantLimiter(max_buckets=4), TenantLimiter(max_buckets=10_000)
    refused = 0
    for burst in range(60):
        key = f"c{burst % 9}"
        for _ in range(5):  # 3 per minute allowed: 2 of 5 refused
            a, b = small.check(key, 3), big.check(key, 3)
            assert (a is None) == (b is None), burst
            refused += a is not None
        assert len(small._buckets) <= 4
        now[0] += 61.0  # every earlier bucket has refilled by the next burst
    assert refused == 60 * 2
