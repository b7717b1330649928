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
    """Bug it catches: the TPM charge took ``max_tokens`` as sent, so ``n: 2 x 30,000`` put the
    caller's bucket 60,000 tokens in debt (six minutes of waiting at 10,000 a minute); the engine
    stops at the context window, so the charge is prompt + n x min(max_tokens, window - prompt)."""
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
        "max_tokens": 30_000,
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


def test_unused_output_tokens_are_refunded_when_each_stream_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bugs it catches: the TPM charge kept at n x max_tokens whatever the answer produced (a
    2-token answer to max_tokens 50 cost 50), a refund counted once per output instead of from
    the last cumulative count, a remote stream carrying every choice refunded as one choice, a
    stream dropped before it started never settled, a refund past a full bucket."""
    import asyncio
    from collections.abc import AsyncIterator

    from router.pipeline.limits import TokenCharge, refunding
    from tiers.core.output import StepOutput

    monkeypatch.setattr("router.pipeline.limits.time.monotonic", lambda: 0.0)

    async def outputs(counts: list[tuple[int, int]]) -> AsyncIterator[StepOutput]:
        for index, n in counts:
            yield StepOutput("t", [1], index=index, num_output_tokens=n)

    async def drain(streams: list[AsyncIterator[StepOutput]]) -> None:
        for s in streams:
            async for _ in s:
                pass

    limiter = TenantLimiter()
    charge = TokenCharge("tokens\x00k", 1000, per_choice=50, choices=2)
    assert limiter.check(charge.key, 1000, 10 + 2 * 50) is None  # 890 left
    local = refunding(limiter, charge, [outputs([(0, 1), (0, 2), (0, 10)]), outputs([(1, 50)])])
    asyncio.run(drain(local))
    assert limiter._buckets[charge.key][0] == pytest.approx(890 + 40)  # 50 - 10, and 50 - 50
    remote = refunding(limiter, charge, [outputs([(0, 5), (1, 3), (1, 7)])])
    assert limiter.check(charge.key, 1000, 100) is None  # 830
    asyncio.run(drain(remote))
    assert limiter._buckets[charge.key][0] == pytest.approx(830 + 100 - 12)
    unstarted = refunding(limiter, charge, [outputs([(0, 50)]), outputs([(1, 50)])])
    asyncio.run(unstarted[0].aclose())  # type: ignore[attr-defined]  # closed before any output
    del unstarted
    assert limiter._buckets[charge.key][0] == pytest.approx(1000)  # 918 + 2 x 50, capped full
