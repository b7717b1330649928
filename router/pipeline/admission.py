"""Admission by predicted wait: a request is only queued on a tier that can start answering it
within its deadline; otherwise the policy's fallback applies, else it is refused at once.

Each tier reports how long a request submitted now would wait for its first token
(``Engine.predicted_wait``: the prompt work queued ahead of this request and its own prompt, at
the measured cost of a token, plus a slot's wait when it must queue, ``tiers/core/sched/pacing.py``; 0 for
remote tiers, which queue on their side). The request's wait budget on a tier is the
tier's ``max_queue_wait_s``, lowered by the client's own deadline (``x-request-timeout``, seconds,
capped at ``service.max_request_timeout_s``). A tier refuses when its queue is full, its circuit is
open (remote) or its predicted wait exceeds the budget; ``decide()`` treats a refusing tier as
full, so the policy's ``routing.fallback`` picks a tier with headroom, and a request with no such
tier gets 429 (or 503 for an open circuit) with a ``Retry-After`` computed from the prediction,
instead of waiting past any realistic client timeout.

Priorities: a tenant's ``priority`` scales its budget (``low`` x0.5: shed first; ``high`` x2).

Fairness, in two layers. In the engine, batch slots are shared between callers (the scheduler's
fair queuing and fairness preemption, ``tiers/core/sched/scheduler.py``), and the predicted wait is the
caller's own: a light caller is admitted while a flood is refused. Here, ``FairShare`` keeps, per
tier, each caller's admitted requests (tenant, or key for keys without one). While several
callers have used a tier recently, none may hold more than an equal share of the tier's
``max_num_seqs + max_queue``; a caller at its share finds the tier full (the fallback applies,
else 429), so one tenant flooding a tier cannot starve the others. A caller alone on a tier may
use all of it.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.errors import BadRequestError, OverloadedError, RouterError, UnavailableError
from router.pipeline.limits import Guarded

if TYPE_CHECKING:
    from collections.abc import Mapping

    from router.backends.tierset import TierSet
    from router.policy.decide import Decision
    from router.policy.schema import Policy

__all__ = [
    "DEADLINE_HEADER",
    "Admission",
    "FairShare",
    "TierPressure",
    "assess",
    "client_deadline_s",
    "rejection",
    "tier_pressures",
]

DEADLINE_HEADER = "x-request-timeout"


@dataclass(frozen=True, slots=True)
class TierPressure:
    """One tier's admission state for one request; ``misses_deadline`` and ``refuses`` are
    worked out once, when it is built."""

    full: bool
    """Queue at its ``max_queue``."""
    wait_s: float
    """Predicted wait for the first token of a request submitted now."""
    budget_s: float
    """The most this request may wait on this tier."""
    circuit_open_s: float | None = None
    """Remote tiers: seconds until the open circuit lets a trial through."""
    over_share: bool = False
    """The caller already holds its fair share of this tier."""
    finish_s: float | None = None
    """A non-streaming request with a deadline: its predicted wait plus ``max_tokens`` at the
    tier's measured decode rate (None: not predicted)."""
    deadline_s: float | None = None
    misses_deadline: bool = field(init=False)
    """The whole answer cannot arrive before the client gives up (a non-streaming request
    sees nothing until the end, so generating it would only take capacity from others)."""
    refuses: bool = field(init=False)
    """The tier cannot take this request now: ``decide()`` treats it as full."""

    def __post_init__(self) -> None:
        misses = self.finish_s is not None and self.deadline_s is not None and self.finish_s > self.deadline_s
        refuses = (
            self.full
            or self.over_share
            or self.circuit_open_s is not None
            or self.wait_s > self.budget_s
            or misses
        )
        object.__setattr__(self, "misses_deadline", misses)
        object.__setattr__(self, "refuses", refuses)


@dataclass(frozen=True, slots=True)
class Admission:
    """What admission knows of one request before the decision: the client's deadline and each
    tier's pressure."""

    deadline_s: float | None
    """The client's deadline (``x-request-timeout``, capped by the policy), if it sent one."""
    pressures: dict[str, TierPressure]
    refusing: dict[str, bool]
    """Per tier, whether it refuses the request: the load ``decide()`` sees."""


class FairShare:
    """Per tier: admitted requests per caller, and which callers used the tier lately."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._held: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self._seen: defaultdict[str, dict[str, float]] = defaultdict(dict)

    def _active(self, tier: str, now: float) -> dict[str, float]:
        seen = self._seen[tier]
        for caller in [c for c, t in seen.items() if now - t > self.window_s and not self._held[tier][c]]:
            del seen[caller]
        return seen

    def note(self, tier: str, caller: str | None) -> None:
        """``caller`` wants ``tier`` (admitted or refused): it counts in the tier's share split."""
        if caller is not None:
            self._seen[tier][caller] = time.monotonic()

    def over_share(self, tier: str, caller: str | None, capacity: int) -> bool:
        """True when ``caller`` holds its share of ``tier`` already."""
        if caller is None:
            return False
        active = self._active(tier, time.monotonic())
        callers = len(active) + (caller not in active)
        return self._held[tier][caller] >= max(1, capacity // callers)

    def hold(
        self, tier: str, caller: str | None, source: AsyncIterator[Any], weight: int = 1
    ) -> AsyncIterator[Any]:
        """``source``, counted against ``caller`` on ``tier`` until it ends or is closed, as
        ``weight`` sequences (``n`` / ``best_of``: an n=16 request takes 16 slots, not one)."""
        if caller is None:
            return source
        self.note(tier, caller)
        held = self._held[tier]
        held[caller] += weight

        def release() -> None:
            held[caller] -= weight
            if held[caller] <= 0:
                del held[caller]

        return Guarded(source, release)


def client_deadline_s(headers: Mapping[str, str], policy: Policy) -> float | None:
    """The client's deadline in seconds (``x-request-timeout``), capped by the policy; None if absent."""
    raw = headers.get(DEADLINE_HEADER)
    if raw is None or not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise BadRequestError(
            f"Header '{DEADLINE_HEADER}' must be a positive number of seconds.",
            code="invalid_request_timeout",
        )
    return min(value, policy.service.max_request_timeout_s)


PRIORITY_FACTOR = {"low": 0.5, "normal": 1.0, "high": 2.0}


def priority_factor(policy: Policy, tenant: str | None) -> float:
    cfg = policy.tenants.get(tenant) if tenant is not None else None
    return PRIORITY_FACTOR[cfg.priority] if cfg is not None else 1.0


def tier_pressures(
    tiers: TierSet,
    policy: Policy,
    deadline_s: float | None,
    fair: FairShare | None = None,
    caller: str | None = None,
    tenant: str | None = None,
    prompt_tokens: int = 0,
    max_tokens: int | None = None,
) -> dict[str, TierPressure]:
    """Each tier's admission state for one request. ``max_tokens``: the output tokens of a
    non-streaming request (None for a stream, whose client sees tokens as they come)."""
    out: dict[str, TierPressure] = {}
    factor = priority_factor(policy, tenant)
    for name, backend in tiers.tiers.items():
        cfg = policy.tiers.get(name)
        if cfg is None:
            continue
        load = backend.engine.load(predicted=False) if hasattr(backend, "engine") else backend.load()
        allowed = cfg.max_queue_wait_s * factor
        budget = allowed if deadline_s is None else min(allowed, deadline_s)
        wait = float(getattr(load, "predicted_wait_s", 0.0) or 0.0)
        if hasattr(backend, "engine"):
            # The engine shares batch slots between callers, so the wait is this caller's (a light
            # caller is not refused for a heavy one's queue), and its prompt's own prefill counts.
            wait = backend.engine.predicted_wait(caller or "", prompt_tokens)
        finish = None
        if deadline_s is not None and max_tokens is not None and hasattr(backend, "engine"):
            finish = _predicted_finish(backend.engine, wait, min(max_tokens, cfg.max_model_len))
        out[name] = TierPressure(
            full=bool(load.is_full),
            wait_s=wait,
            budget_s=budget,
            circuit_open_s=getattr(load, "circuit_open_s", None),
            over_share=fair is not None and fair.over_share(name, caller, cfg.max_num_seqs + cfg.max_queue),
            finish_s=finish,
            deadline_s=deadline_s,
        )
    return out


def assess(
    tiers: TierSet | None,
    policy: Policy,
    headers: Mapping[str, str],
    fair: FairShare | None,
    caller: str | None,
    tenant: str | None,
    prompt_tokens: int,
    max_tokens: int | None,
) -> Admission:
    """The admission stage of one request, in one call: its deadline (a 400 when the header is
    not a positive number), then each tier's pressure (none without tiers)."""
    deadline = client_deadline_s(headers, policy)
    pressures = (
        tier_pressures(tiers, policy, deadline, fair, caller, tenant, prompt_tokens, max_tokens)
        if tiers is not None
        else {}
    )
    return Admission(deadline, pressures, {name: p.refuses for name, p in pressures.items()})


def _predicted_finish(engine: Any, wait_s: float, max_tokens: int) -> float | None:
    """Seconds until ``max_tokens`` are out: the first-token wait, then one decode round (at the
    batch this request joins) per ``tokens per row`` of that round; None before any measurement."""
    decode_round = getattr(engine, "decode_round", None)
    rnd = decode_round(1) if decode_round is not None else None
    if rnd is None:
        return None
    seconds, per_row = rnd
    if seconds <= 0 or per_row <= 0:
        return None
    return wait_s + max_tokens / per_row * seconds


def rejection(d: Decision, pressures: Mapping[str, TierPressure]) -> RouterError:
    """The error for a decision no tier could admit, with an honest ``Retry-After``."""
    p = pressures.get(d.tier)
    if p is not None and p.circuit_open_s is not None:
        return UnavailableError(
            f"Tier '{d.tier}' is unavailable (its upstream is failing) and no fallback tier is free.",
            code="tier_unavailable",
            retry_after=max(1.0, math.ceil(p.circuit_open_s)),
        )
    if p is not None and p.misses_deadline and not p.full and p.wait_s <= p.budget_s:
        assert p.finish_s is not None
        assert p.deadline_s is not None
        return OverloadedError(
            f"Tier '{d.tier}' would take about {p.finish_s:.1f}s to finish this answer at its current "
            f"rate, past the {p.deadline_s:.1f}s deadline (x-request-timeout); lower max_tokens, "
            "stream, or retry later.",
            code="deadline_unreachable",
            retry_after=max(1.0, math.ceil(p.finish_s - p.deadline_s)),
            spread_retries=True,
        )
    if p is not None and p.over_share and not p.full:
        return OverloadedError(
            f"Tier '{d.tier}' is busy and this caller already holds its fair share of it; retry shortly.",
            code="fair_share_exceeded",
            retry_after=max(1.0, math.ceil(p.wait_s)),
            spread_retries=True,
        )
    if p is not None and not p.full and p.wait_s > p.budget_s:
        # Retry when the queue ahead should have drained to within the budget.
        return OverloadedError(
            f"Tier '{d.tier}' would take about {p.wait_s:.1f}s to start answering, more than the "
            f"{p.budget_s:.1f}s allowed, and no fallback tier is free; retry later.",
            code="predicted_wait_exceeded",
            retry_after=max(1.0, math.ceil(p.wait_s - p.budget_s)),
            spread_retries=True,
        )
    wait = p.wait_s if p is not None else 0.0
    return OverloadedError(
        f"Tier '{d.tier}' is at capacity and no fallback tier is free; retry shortly.",
        retry_after=max(1.0, math.ceil(wait)),
        spread_retries=True,
    )
