"""A caller's limits (router/pipeline/limits.py) on a clock the test moves: the token bucket's
refill worked by hand (rpm / 60 per second, capped at rpm), the wait it reports, a cost past the
bucket's size allowed once and paid for by debt, refunds never past full; ``Guarded`` settles
once; the token charge counts the prompt plus n x max_tokens capped by what the context leaves,
refunds what was not generated, and the tenant's own limits win over the defaults."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import pytest

from router.errors import RateLimitError
from router.openai.request import CallContext
from router.pipeline.limits import (
    Guarded,
    TenantLimiter,
    TokenCharge,
    check_rate,
    check_tokens,
    identify,
    refunding,
)
from tiers.core.output import StepOutput


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr("router.pipeline.limits.time.monotonic", lambda: now[0])
    return now


def test_a_bucket_allows_its_rate_then_reports_the_wait_to_the_next_token(clock: list[float]) -> None:
    """60 a minute is one a second. Bugs it catches: ``<=`` for ``<`` (the last allowed request
    refused), the wait computed per minute instead of per second, the refill not capped."""
    limiter = TenantLimiter()
    assert [limiter.check("a", 60) for _ in range(60)] == [None] * 60
    wait = limiter.check("a", 60)
    assert wait == pytest.approx(1.0)
    clock[0] += 0.5
    assert limiter.check("a", 60) == pytest.approx(0.5)
    clock[0] += 0.5
    assert limiter.check("a", 60) is None  # exactly one token refilled: allowed
    clock[0] += 3600  # an hour idle refills to 60, not 3,600
    assert [limiter.check("a", 60) for _ in range(60)] == [None] * 60
    assert limiter.check("a", 60) is not None
    assert limiter.check("b", 60) is None  # another caller has its own bucket


def test_a_cost_past_the_size_passes_on_a_full_bucket_and_leaves_debt(clock: list[float]) -> None:
    limiter = TenantLimiter()
    assert limiter.check("t", 100, cost=250) is None  # full bucket: allowed, 150 in debt
    wait = limiter.check("t", 100, cost=1)
    assert wait == pytest.approx((1 + 150) * 60 / 100)
    clock[0] += 91  # 151.67 tokens back: the debt is paid and one more fits
    assert limiter.check("t", 100, cost=1) is None


def test_a_refund_gives_back_its_amount_but_never_past_full(clock: list[float]) -> None:
    limiter = TenantLimiter()
    assert limiter.check("r", 10, cost=8) is None
    limiter.refund("r", 10, 5)
    assert [limiter.check("r", 10) for _ in range(7)] == [None] * 7
    assert limiter.check("r", 10) is not None
    limiter.refund("r", 10, 1000)
    assert [limiter.check("r", 10) for _ in range(10)] == [None] * 10
    assert limiter.check("r", 10) is not None
    limiter.refund("unknown", 10, 5)  # no bucket: nothing to refund, nothing created
    assert "unknown" not in limiter._buckets


async def _outputs(*counts: int, index: int = 0) -> AsyncGenerator[StepOutput, None]:
    for n in counts:
        yield StepOutput("x", [1], num_output_tokens=n, index=index)


def _drain(it: Any) -> list[Any]:
    async def run() -> list[Any]:
        return [x async for x in it]

    return asyncio.run(run())


def test_guarded_settles_once_at_the_end_on_close_or_when_dropped_unstarted() -> None:
    ends: list[str] = []
    seen: list[int] = []
    g = Guarded(_outputs(1, 2), lambda: ends.append("end"), lambda out: seen.append(out.num_output_tokens))
    assert len(_drain(g)) == 2 and seen == [1, 2] and ends == ["end"]
    asyncio.run(g.aclose())
    assert ends == ["end"]
    closed: list[str] = []
    c = Guarded(_outputs(1), lambda: closed.append("c"))
    asyncio.run(c.aclose())
    assert closed == ["c"]
    dropped: list[str] = []
    d = Guarded(_outputs(1), lambda: dropped.append("d"))
    del d
    assert dropped == ["d"]


def test_refunding_gives_back_what_each_choice_did_not_generate(clock: list[float]) -> None:
    """Bugs it catches: the refund of one stream per choice counted n times, the last output's
    running count summed instead of taken, the single remote stream refunding one choice only."""
    limiter = TenantLimiter()
    charge = TokenCharge("k", 1000, per_choice=100, choices=2)
    assert limiter.check("k", 1000, cost=10 + 200) is None  # prompt 10 + 2 x 100
    streams = refunding(limiter, charge, [_outputs(3, 30), _outputs(50)])
    for s in streams:
        _drain(s)
    # 200 charged for output, 80 generated: 120 back -> 1000 - 210 + 120 = 910 left.
    assert limiter._buckets["k"][0] == pytest.approx(910)
    remote = TenantLimiter()
    assert remote.check("k", 1000, cost=200) is None

    async def interleaved() -> AsyncGenerator[StepOutput, None]:
        for index, n in ((0, 5), (1, 7), (0, 40), (1, 60)):
            yield StepOutput("x", [1], num_output_tokens=n, index=index)

    (only,) = refunding(remote, charge, [interleaved()])
    _drain(only)
    assert remote._buckets["k"][0] == pytest.approx(800 + 100)  # 200 charged, 100 generated


def _policy(tenants: dict[str, Any] | None = None, rpm: int | None = None, tpm: int | None = None) -> Any:
    auth = SimpleNamespace(rate_limit_rpm=rpm, rate_limit_tpm=tpm)
    return SimpleNamespace(tenants=tenants or {}, service=SimpleNamespace(auth=auth))


def _tenant(rpm: int | None = None, tpm: int | None = None) -> Any:
    return SimpleNamespace(rate_limit_rpm=rpm, rate_limit_tpm=tpm)


def _ctx(tenant: str | None = None, principal: str | None = None) -> CallContext:
    ctx = CallContext(headers={}, tenant=tenant, principal=principal)
    return ctx


def test_identify_labels_named_tenants_others_and_tenantless_callers() -> None:
    policy = _policy({"acme": _tenant()})
    for tenant, label in (("acme", "acme"), ("stranger", "other"), (None, "-")):
        ctx = _ctx(tenant)
        identify(ctx, policy)
        assert ctx.tenant_label == label
        assert ctx.principal == tenant
    keyed = _ctx(None, principal="key:ab12")
    identify(keyed, policy)
    assert keyed.principal == "key:ab12"


def test_the_tenants_own_rpm_then_the_default_tenants_then_the_services(clock: list[float]) -> None:
    """Bugs it catches: a tenant's own limit ignored for the service's, an unnamed tenant not
    given the ``default`` tenant's limit, a tenant-less key not limited at all."""
    policy = _policy({"acme": _tenant(rpm=2), "default": _tenant(rpm=1)}, rpm=3)
    limiter = TenantLimiter()

    def allowed(ctx: CallContext, times: int) -> int:
        ok, refused = 0, []
        for _ in range(times):
            try:
                check_rate(limiter, policy, ctx)
                ok += 1
            except RateLimitError as err:
                refused.append(err)
        assert all(e.retry_after is not None and e.retry_after >= 1.0 for e in refused)
        return ok

    assert allowed(_ctx("acme", "acme"), 5) == 2
    assert allowed(_ctx("stranger", "stranger"), 5) == 1
    assert allowed(_ctx(None, "key:1"), 5) == 3
    assert allowed(_ctx(None, None), 5) == 5  # an anonymous caller of an open server: no bucket
    unlimited = _policy({"acme": _tenant()})
    check_rate(limiter, unlimited, _ctx("acme", "fresh"))


def _gen(max_tokens: int | None, n: int = 1, best_of: int = 1) -> Any:
    return SimpleNamespace(
        output=SimpleNamespace(n=n, best_of=best_of), sampling=SimpleNamespace(max_tokens=max_tokens)
    )


def test_the_token_charge_is_prompt_plus_choices_times_max_tokens_capped_by_the_context(
    clock: list[float],
) -> None:
    """Bugs it catches: the tier's default charged when the caller set ``max_tokens``, ``best_of``
    ignored (n charged instead), the cap by the room the context window leaves missing."""
    policy = _policy({"acme": _tenant(tpm=10_000)})
    limiter = TenantLimiter()
    ctx = _ctx("acme", "acme")
    charge = check_tokens(limiter, policy, ctx, _gen(50, n=2, best_of=3), 100, default_max=400, context=1000)
    assert charge == TokenCharge("tokens\x00acme", 10_000, 50, 3)
    assert limiter._buckets["tokens\x00acme"][0] == pytest.approx(10_000 - (100 + 3 * 50))
    default = check_tokens(limiter, policy, ctx, _gen(None), 100, default_max=400, context=1000)
    assert default is not None and default.per_choice == 400
    capped = check_tokens(limiter, policy, ctx, _gen(10**9), 900, default_max=400, context=1000)
    assert capped is not None and capped.per_choice == 100
    full = check_tokens(limiter, policy, ctx, _gen(64), 1000, default_max=400, context=1000)
    assert full is not None and full.per_choice == 1  # a prompt filling the window is charged 1 more
    assert check_tokens(limiter, _policy(), ctx, _gen(50), 100, default_max=400, context=1000) is None
    assert (
        check_tokens(limiter, policy, _ctx(None, None), _gen(50), 100, default_max=400, context=1000) is None
    )


def test_a_request_past_the_token_budget_is_a_429_saying_its_cost(clock: list[float]) -> None:
    policy = _policy(tpm=1000)
    limiter = TenantLimiter()
    ctx = _ctx(None, "key:9")
    assert check_tokens(limiter, policy, ctx, _gen(400), 200, default_max=400, context=4096) is not None
    with pytest.raises(RateLimitError) as err:
        check_tokens(limiter, policy, ctx, _gen(400), 200, default_max=400, context=4096)
    assert err.value.code == "tokens_per_minute_exceeded"
    assert "costs 600 tokens" in err.value.message and "of 1000 a minute" in err.value.message
    assert err.value.retry_after is not None and err.value.retry_after >= 1.0
