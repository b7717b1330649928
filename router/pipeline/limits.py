"""How often a caller may ask: ``TenantLimiter`` keeps each caller's requests and tokens per
minute (a tenant's ``rate_limit_rpm`` / ``rate_limit_tpm``), checked before routing. What one
request may ask (policy ``service.limits``) is checked when its body is parsed
(``router.openai.bounds.check_limits``). ``identify`` / ``check_rate`` / ``check_tokens`` apply a
caller's limits as the service admits its request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.errors import RateLimitError

if TYPE_CHECKING:
    from router.openai.request import CallContext, Generation
    from router.policy.schema import Policy
    from tiers.core.output import StepOutput

__all__ = [
    "MAX_BUCKETS",
    "Guarded",
    "TenantLimiter",
    "TokenCharge",
    "check_rate",
    "check_tokens",
    "identify",
    "refunding",
]

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

    def refund(self, key: str, per_minute: int, amount: float) -> None:
        """Give back ``amount`` of a charge made with ``check`` (never past a full bucket)."""
        found = self._buckets.get(key)
        if found is not None:
            tokens, last = found
            self._buckets[key] = (min(float(per_minute), tokens + amount), last)

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


class Guarded:
    """An async iterator that runs ``on_end`` exactly once: at its end, on ``aclose()``, or when
    dropped unstarted (an async generator that never started runs no ``finally``); ``observe``
    sees each output on the way. Settles what an answer holds while it runs: a caller's share of
    a tier (``admission.FairShare.hold``), its token charge (``refunding``)."""

    def __init__(
        self,
        inner: AsyncIterator[Any],
        on_end: Callable[[], None],
        observe: Callable[[Any], None] | None = None,
    ) -> None:
        self._inner = inner
        self._on_end: Callable[[], None] | None = on_end
        self._observe = observe

    def _done(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()

    def __aiter__(self) -> Guarded:
        return self

    async def __anext__(self) -> Any:
        try:
            out = await anext(self._inner)
        except BaseException:
            self._done()
            raise
        if self._observe is not None:
            self._observe(out)
        return out

    async def aclose(self) -> None:
        self._done()
        close = getattr(self._inner, "aclose", None)
        if close is not None:
            await close()

    def __del__(self) -> None:
        self._done()


@dataclass(frozen=True, slots=True)
class TokenCharge:
    """What ``check_tokens`` charged a caller's token bucket for its output, to refund the unused
    part when the answer ends."""

    key: str
    per_minute: int
    per_choice: int
    choices: int


def refunding(
    limiter: TenantLimiter, charge: TokenCharge, sources: list[AsyncIterator[StepOutput]]
) -> list[AsyncIterator[StepOutput]]:
    """``sources`` (one stream per choice, or one stream carrying every choice: a remote tier),
    each refunding on its end the output tokens it was charged and did not produce."""
    carried = charge.choices if len(sources) == 1 else 1

    def guard(source: AsyncIterator[StepOutput]) -> AsyncIterator[StepOutput]:
        produced: dict[int, int] = {}

        def observe(out: StepOutput) -> None:
            produced[out.index] = out.num_output_tokens

        def on_end() -> None:
            unused = charge.per_choice * carried - sum(produced.values())
            if unused > 0:
                limiter.refund(charge.key, charge.per_minute, unused)

        return Guarded(source, on_end, observe)

    return [guard(s) for s in sources]


def identify(ctx: CallContext, policy: Policy) -> None:
    """Fill the caller's metric label and rate-limit identity from its (authenticated) tenant."""
    tenant = ctx.tenant
    if tenant is None:
        ctx.tenant_label = "-"
    else:
        ctx.tenant_label = tenant if tenant in policy.tenants else "other"
    if ctx.principal is None:
        ctx.principal = tenant


def check_rate(limiter: TenantLimiter, policy: Policy, ctx: CallContext) -> None:
    """Per caller: the tenant's own ``rate_limit_rpm``, else ``service.auth.rate_limit_rpm``
    for every other caller (a tenant the policy does not name, or a key without a tenant)."""
    if ctx.principal is None:
        return
    cfg = policy.tenants.get(ctx.tenant) if ctx.tenant is not None else None
    if cfg is None and ctx.tenant is not None:  # a tenant the policy does not name
        cfg = policy.tenants.get("default")
    rpm = cfg.rate_limit_rpm if cfg is not None and cfg.rate_limit_rpm is not None else None
    if rpm is None:
        rpm = policy.service.auth.rate_limit_rpm
    if rpm is None:
        return
    wait = limiter.check(ctx.principal, rpm)
    if wait is not None:
        who = f"tenant '{ctx.tenant}'" if ctx.tenant is not None else "this API key"
        raise RateLimitError(f"Rate limit reached for {who}.", retry_after=max(1.0, wait))


def check_tokens(
    limiter: TenantLimiter,
    policy: Policy,
    ctx: CallContext,
    gen: Generation,
    prompt_tokens: int,
    default_max: int,
    context: int,
) -> TokenCharge | None:
    """The caller's ``rate_limit_tpm``: prompt tokens plus n x max_tokens, charged at admission
    (after the cache: a hit costs nothing). Its own bucket, beside the requests'. ``max_tokens``
    counts at most what the tier's context window (``context``) leaves after the prompt: the
    engine stops there, so a huge ``max_tokens`` cannot drain the bucket past recovery."""
    if ctx.principal is None:
        return None
    cfg = policy.tenants.get(ctx.tenant) if ctx.tenant is not None else None
    if cfg is None and ctx.tenant is not None:
        cfg = policy.tenants.get("default")
    tpm = cfg.rate_limit_tpm if cfg is not None and cfg.rate_limit_tpm is not None else None
    if tpm is None:
        tpm = policy.service.auth.rate_limit_tpm
    if tpm is None:
        return None
    spec = gen.output
    choices = max(spec.n, spec.best_of) if spec is not None else 1
    asked = min(gen.sampling.max_tokens or default_max, max(1, context - prompt_tokens))
    cost = prompt_tokens + choices * asked
    key = "tokens\x00" + ctx.principal
    wait = limiter.check(key, tpm, cost)
    if wait is not None:
        who = f"tenant '{ctx.tenant}'" if ctx.tenant is not None else "this API key"
        raise RateLimitError(
            f"Token rate limit reached for {who}: this request costs {cost} tokens "
            f"(prompt + n x max_tokens) of {tpm} a minute.",
            code="tokens_per_minute_exceeded",
            retry_after=max(1.0, wait),
        )
    return TokenCharge(key, tpm, asked, choices)
