"""Admission by predicted wait: a request is only queued on a tier that can start answering it
within its deadline; otherwise the policy's fallback applies, else it is refused at once.

Each tier reports how long a request submitted now would wait for its first token
(``EngineLoad.predicted_wait_s``: the engine's estimate from its queue, batch and measured step
times; 0 for remote tiers, which queue on their side). The request's wait budget on a tier is the
tier's ``max_queue_wait_s``, lowered by the client's own deadline (``x-request-timeout``, seconds,
capped at ``service.max_request_timeout_s``). A tier refuses when its queue is full, its circuit is
open (remote) or its predicted wait exceeds the budget; ``decide()`` treats a refusing tier as
full, so the policy's ``routing.fallback`` picks a tier with headroom, and a request with no such
tier gets 429 (or 503 for an open circuit) with a ``Retry-After`` computed from the prediction,
instead of waiting past any realistic client timeout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.errors import BadRequestError, OverloadedError, RouterError, UnavailableError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from router.backends import TierSet
    from router.policy.decide import Decision
    from router.policy.schema import Policy

__all__ = ["DEADLINE_HEADER", "TierPressure", "client_deadline_s", "rejection", "tier_pressures"]

DEADLINE_HEADER = "x-request-timeout"


@dataclass(frozen=True, slots=True)
class TierPressure:
    full: bool
    """Queue at its ``max_queue``."""
    wait_s: float
    """Predicted wait for the first token of a request submitted now."""
    budget_s: float
    """The most this request may wait on this tier."""
    circuit_open_s: float | None = None
    """Remote tiers: seconds until the open circuit lets a trial through."""

    @property
    def refuses(self) -> bool:
        return self.full or self.circuit_open_s is not None or self.wait_s > self.budget_s


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


def tier_pressures(tiers: TierSet, policy: Policy, deadline_s: float | None) -> dict[str, TierPressure]:
    out: dict[str, TierPressure] = {}
    for name, backend in tiers.tiers.items():
        cfg = policy.tiers.get(name)
        if cfg is None:
            continue
        load = backend.engine.load() if hasattr(backend, "engine") else backend.client.load()
        budget = cfg.max_queue_wait_s if deadline_s is None else min(cfg.max_queue_wait_s, deadline_s)
        out[name] = TierPressure(
            full=bool(load.is_full),
            wait_s=float(getattr(load, "predicted_wait_s", 0.0) or 0.0),
            budget_s=budget,
            circuit_open_s=getattr(load, "circuit_open_s", None),
        )
    return out


def rejection(d: Decision, pressures: Mapping[str, TierPressure]) -> RouterError:
    """The error for a decision no tier could admit, with an honest ``Retry-After``."""
    p = pressures.get(d.tier)
    if p is not None and p.circuit_open_s is not None:
        return UnavailableError(
            f"Tier '{d.tier}' is unavailable (its upstream is failing) and no fallback tier is free.",
            code="tier_unavailable",
            retry_after=max(1.0, math.ceil(p.circuit_open_s)),
        )
    if p is not None and not p.full and p.wait_s > p.budget_s:
        # Retry when the queue ahead should have drained to within the budget.
        return OverloadedError(
            f"Tier '{d.tier}' would take about {p.wait_s:.1f}s to start answering, more than the "
            f"{p.budget_s:.1f}s allowed, and no fallback tier is free; retry later.",
            code="predicted_wait_exceeded",
            retry_after=max(1.0, math.ceil(p.wait_s - p.budget_s)),
        )
    wait = p.wait_s if p is not None else 0.0
    return OverloadedError(
        f"Tier '{d.tier}' is at capacity and no fallback tier is free; retry shortly.",
        retry_after=max(1.0, math.ceil(wait)),
    )
