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


def test_a_huge_max_tokens_is_charged_what_the_context_window_leaves() -> None:
    """Bug it catches: the TPM charge took ``max_tokens`` as sent, so ``2**31 - 1`` put the caller's
    bucket at -4e9 (refilled after years); the engine stops at the context window, so the charge is
    prompt + n x min(max_tokens, max_model_len - prompt)."""
    import msgspec

    from router.errors import RateLimitError
    from router.openai.request import CallContext, parse_chat
    from router.openai.schemas import ChatCompletionRequest
    from router.pipeline.limits import check_tokens
    from router.policy.loader import parse_policy
    from router.policy.schema import LimitsConfig

    policy = parse_policy(
        "version: 1\ntiers: {small: {model: m}}\nrouting: {rules: [{name: all, tier: small}]}\n"
        "service: {auth: {rate_limit_tpm: 10000}}\n"
    )
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2**31 - 1,
        "n": 2,
    }
    gen = parse_chat(msgspec.convert(body, ChatCompletionRequest), LimitsConfig())
    limiter = TenantLimiter()
    ctx = CallContext(headers={}, tenant=None, principal="k")
    check_tokens(limiter, policy, ctx, gen, 100, 256, 1024)  # 100 + 2 x 924 = 1948
    tokens, _ = limiter._buckets["tokens\x00k"]
    assert tokens == pytest.approx(10_000 - 1948, abs=1.0)
    for _ in range(4):  # 5 x 1948 = 9740 fit in 10,000; the sixth does not
        check_tokens(limiter, policy, ctx, gen, 100, 256, 1024)
    with pytest.raises(RateLimitError, match="costs 1948 tokens"):
        check_tokens(limiter, policy, ctx, gen, 100, 256, 1024)
