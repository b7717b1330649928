"""The routing decision: data in, decision out. Pure - no I/O, no clocks, no globals.

Order of evaluation:
1. ``model`` other than ``auto``: a tier name forces that tier, an alias forces its tier; a name
   that a rule's ``when.model`` lists goes through the rules like ``auto``; anything else is an
   unknown model (404).
2. Otherwise the rules, by descending ``priority`` then file order; the first whose conditions
   all hold picks the tier.
3. Escalation: a score-based pick with low classifier confidence moves one tier up.
   Load (``routing.mode: load_aware``, once the device holds ``min_device_rows`` sequences in
   all, now or recently; below that the rule's tier stands): the rule's tier is a floor; among
   it and the tiers above with a free batch slot (the tenant's, not full), the highest whose
   batch is running (``batches``: the request joins work the device does anyway, and the tiers
   below drain instead of taking turns with it) - an idle tier counts as running when it is
   likely to run anyway (``TierBatch.busy`` of at least ``BUSY_JOIN``); when none is, the one
   whose ``costs`` (the request's predicted completion plus the delay it adds to others on the
   shared device, ``tiers/core/sched/pacing.py``) are lowest - a higher one while within ``up_tolerance``
   of the lowest. The rule becomes ``load:<rule>`` when it moved.
4. Session: a follow-up of a conversation that had a tier (``session``, see router/pipeline/session.py)
   never goes below it (``floor``), or stays on it (``pin``). Not for tiers forced by name.
5. Tenant cap: a tier the tenant may not use becomes the highest allowed tier below it.
6. Load: a full tier falls back along ``routing.fallback`` (within the tenant's tiers); when the
   chain ends, the decision is a rejection (429).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from router.errors import ModelNotFoundError
from router.policy.schema import Condition, Policy
from router.policy.signals import detect_language, matches_keywords

__all__ = [
    "BUSY_JOIN",
    "Decision",
    "RouteRequest",
    "ScoreLike",
    "TierBatch",
    "decide",
    "fallback_after_failure",
    "unknown_tenant_tiers",
]

BUSY_JOIN = 0.5
"""Load-aware routing joins an idle tier's batch as if it ran once it is at least this likely to
run in the coming rounds anyway (``TierBatch.busy``)."""


class TierBatch(NamedTuple):
    """A local tier's batch as load-aware routing sees it."""

    held: int
    """Sequences it holds: running, waiting, and decided but not yet submitted."""
    slots: int
    """Its ``max_num_seqs``."""
    busy: float = 0.0
    """How likely it runs in the coming rounds without this request: 1 while it holds work;
    for an idle tier, the chance that another request in flight on the device lands there
    (``TierSet.batches``). An idle tier's first row pays its whole step (a large tier's is many
    cheap tiers' rows), but not when the next request would start it anyway: a burst arriving
    on an idle device otherwise split by its first few requests' floors, and the split stayed."""


class ScoreLike(Protocol):
    @property
    def tier(self) -> str: ...
    @property
    def value(self) -> float: ...
    @property
    def probabilities(self) -> Mapping[str, float]: ...


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str = "auto"
    headers: Mapping[str, str] = field(default_factory=dict)
    """Lower-cased names."""
    tenant: str | None = None
    prompt_tokens: int = 0
    text: str = ""
    """The last user turn (the prompt of a completion): what ``keywords`` and ``language`` test."""
    turns: int = 1
    """User turns in the conversation."""
    has_tools: bool = False
    response_format: str = "text"
    """``response_format.type``; ``text`` when absent."""
    logprobs: bool = False
    session: str | None = None
    """The tier this conversation had before (router/pipeline/session.py), if any."""


@dataclass(frozen=True, slots=True)
class Decision:
    tier: str
    rule: str
    reason: str
    score: float
    escalated: bool = False
    capped: bool = False
    fallback_from: str | None = None
    rejected: bool = False
    """True when every candidate tier was full: answer 429."""
    session: str | None = None
    """The conversation's earlier tier when it changed this decision (``rule`` is then ``session:<rule>``)."""


def _matches(w: Condition, req: RouteRequest, score: ScoreLike) -> bool:
    if w.score_below is not None and not score.value < w.score_below:
        return False
    if w.score_at_least is not None and not score.value >= w.score_at_least:
        return False
    if w.predicted is not None and score.tier not in w.predicted:
        return False
    if (
        w.confidence_below is not None
        and not max(score.probabilities.values(), default=1.0) < w.confidence_below
    ):
        return False
    if w.prompt_tokens_above is not None and not req.prompt_tokens > w.prompt_tokens_above:
        return False
    if w.prompt_tokens_at_most is not None and not req.prompt_tokens <= w.prompt_tokens_at_most:
        return False
    if w.headers is not None:
        for name, expected in w.headers.items():
            got = req.headers.get(name.lower())
            allowed = [expected] if isinstance(expected, str) else expected
            if got is None or got not in allowed:
                return False
    if w.model is not None and req.model not in w.model:
        return False
    if w.tenant is not None and req.tenant not in w.tenant:
        return False
    if w.has_tools is not None and req.has_tools != w.has_tools:
        return False
    if w.response_format is not None and req.response_format not in w.response_format:
        return False
    if w.logprobs is not None and req.logprobs != w.logprobs:
        return False
    if w.turns_at_least is not None and req.turns < w.turns_at_least:
        return False
    if w.turns_at_most is not None and req.turns > w.turns_at_most:
        return False
    if w.keywords is not None and not matches_keywords(req.text, w.keywords):
        return False
    if w.language is not None and detect_language(req.text) not in w.language:
        return False
    if w.all_of is not None and not all(_matches(c, req, score) for c in w.all_of):
        return False
    if w.any_of is not None and not any(_matches(c, req, score) for c in w.any_of):
        return False
    return not (w.not_ is not None and _matches(w.not_, req, score))


def unknown_tenant_tiers(policy: Policy) -> list[str] | None:
    """The tiers of a tenant the policy does not name (a key file's typo must not fail open):
    ``tenants.default``'s, else the tiers every named tenant with ``allowed_tiers`` may use."""
    default = policy.tenants.get("default")
    if default is not None:
        return default.allowed_tiers
    lists = [set(t.allowed_tiers) for t in policy.tenants.values() if t.allowed_tiers is not None]
    if not lists:
        return None
    common = set.intersection(*lists)
    return [t for t in policy.tier_names if t in common] or [policy.tier_names[0]]


def _cap(policy: Policy, tier: str, tenant: str | None) -> tuple[str, bool]:
    cfg = policy.tenants.get(tenant) if tenant is not None else None
    allowed = cfg.allowed_tiers if cfg is not None else None
    if cfg is None and tenant is not None:
        allowed = unknown_tenant_tiers(policy)
    if allowed is None or tier in allowed:
        return tier, False
    order = policy.tier_names
    ordered = [t for t in order if t in allowed]
    below = [t for t in ordered if order.index(t) < order.index(tier)]
    return (below[-1] if below else ordered[0]), True


def _load_aware(
    policy: Policy,
    tier: str,
    tenant: str | None,
    costs: Mapping[str, float],
    full: Mapping[str, bool],
    batches: Mapping[str, tuple[int, int] | TierBatch],
) -> tuple[str, str]:
    """The acceptable tier at or above ``tier`` that the load picks, and the reason's words."""
    order = policy.tier_names
    held = {t: TierBatch(*b) for t, b in batches.items()}
    # Above the floor only tiers with a free batch slot: a request moved up into a tier's queue
    # takes the place of one whose score allows nothing lower (at 48 clients, large-scored
    # requests were refused until their clients gave up).
    candidates = [
        t
        for t in order[order.index(tier) :]
        if t in costs
        and not full.get(t, False)
        and not _cap(policy, t, tenant)[1]
        and (t == tier or t not in held or held[t].held < held[t].slots)
    ]
    if not candidates or candidates == [tier]:
        return tier, ""  # nothing to choose: a full floor falls back along routing.fallback
    if policy.routing.load_aware.join_running:
        room = [(t, held[t]) for t in candidates if t in held]
        running = [(t, b) for t, b in room if b.held < b.slots and (b.held > 0 or b.busy >= BUSY_JOIN)]
        if running:
            pick, b = running[-1]
            if b.held:
                return pick, f"; load-aware: joins the running batch of '{pick}' ({b.held}/{b.slots} rows)"
            return pick, f"; load-aware: joins '{pick}', idle now but likely to run anyway (p {b.busy:.2f})"
    cheapest = min(costs[t] for t in candidates)
    tolerance = policy.routing.load_aware.up_tolerance
    pick = [t for t in candidates if costs[t] <= cheapest * (1 + tolerance)][-1]
    priced = ", ".join(f"{t} {costs[t]:.3g}s" for t in candidates)
    return pick, f"; load-aware ({priced}): '{pick}'"


def _device_rows(batches: Mapping[str, tuple[int, int] | TierBatch] | None) -> int:
    """Sequences held on the device in all (the sum of ``TierBatch.held``)."""
    return sum(b[0] for b in (batches or {}).values())


def _load_eligible(policy: Policy, rule: str, used_score: bool) -> bool:
    names = policy.routing.load_aware.rules
    return used_score if names is None else rule in names


def decide(
    policy: Policy,
    request: RouteRequest,
    score: ScoreLike,
    tier_load: Mapping[str, bool] | None = None,
    costs: Mapping[str, float] | None = None,
    batches: Mapping[str, tuple[int, int] | TierBatch] | None = None,
    device_rows: float | None = None,
) -> Decision:
    """Route one request. ``tier_load`` maps tier -> "queue full"; absent tiers count as free.
    ``costs`` maps tier -> the price of this request there now (seconds; ``load_aware`` mode only,
    tiers without one are not candidates); ``batches`` maps tier -> ``TierBatch`` (sequences it
    holds, batch slots, how likely it runs anyway), for ``load_aware``'s preference for a running
    batch with room; ``device_rows`` the device's load for the ``min_device_rows`` guard (the
    caller's recent peak, ``TierSet.observe``; ``None``: the sequences ``batches`` hold)."""
    full = tier_load or {}
    escalated = False
    session_changed: str | None = None
    if request.model != "auto" and request.model not in policy.rule_models:
        if request.model in policy.tiers:
            tier, rule, reason = request.model, f"model:{request.model}", "tier requested by name"
        elif request.model in policy.routing.aliases:
            tier = policy.routing.aliases[request.model]
            rule, reason = f"alias:{request.model}", f"alias '{request.model}' maps to '{tier}'"
        else:
            known = ", ".join(policy.model_names)
            raise ModelNotFoundError(
                f"The model '{request.model}' does not exist. Available: {known}.", param="model"
            )
    else:
        for _, r in policy.routing.ordered_rules:
            if r.when is None or _matches(r.when, request, score):
                tier, rule = r.tier, r.name
                reason = f"rule '{r.name}' matched" if r.when is not None else f"default rule '{r.name}'"
                used_score = r.when is not None and r.when.uses_score
                break
        else:  # unreachable with a validated policy (its last rule has no 'when')
            tier, rule, reason, used_score = (
                policy.tier_names[-1],
                "implicit-default",
                "no rule matched",
                False,
            )
        threshold = policy.routing.escalation.confidence_below
        confidence = max(score.probabilities.values(), default=1.0)
        if used_score and threshold is not None and confidence < threshold:
            above = policy.tier_above(tier)
            if above is not None:
                reason += f"; escalated {tier} -> {above} (confidence {confidence:.2f} < {threshold})"
                tier, escalated = above, True
        if (
            policy.routing.mode == "load_aware"
            and costs
            and _load_eligible(policy, rule, used_score)
            and (_device_rows(batches) if device_rows is None else device_rows)
            >= policy.routing.load_aware.min_device_rows
        ):
            picked, why = _load_aware(policy, tier, request.tenant, costs, full, batches or {})
            reason += why
            if picked != tier:
                tier, rule = picked, f"load:{rule}"
        session = request.session
        if session is not None and session in policy.tiers and session != tier:
            order = policy.tier_names
            pin = policy.routing.sessions.mode == "pin"
            if pin or order.index(session) > order.index(tier):
                reason += f"; session: conversation was on '{session}' (rule picked '{tier}')"
                tier, rule, session_changed = session, f"session:{rule}", session
    tier, capped = _cap(policy, tier, request.tenant)
    if capped:
        reason += f"; capped to '{tier}' for tenant '{request.tenant}'"
    fallback_from = None
    seen = {tier}
    while full.get(tier, False):
        nxt = policy.routing.fallback.get(tier)
        if nxt is not None:
            nxt, _ = _cap(policy, nxt, request.tenant)
        if nxt is None or nxt in seen:
            return Decision(
                tier,
                rule,
                reason + f"; '{tier}' is full and has no free fallback",
                score.value,
                escalated,
                capped,
                fallback_from,
                rejected=True,
                session=session_changed,
            )
        fallback_from = fallback_from or tier
        reason += f"; '{tier}' full, fell back to '{nxt}'"
        tier = nxt
        seen.add(tier)
    return Decision(
        tier, rule, reason, score.value, escalated, capped, fallback_from, session=session_changed
    )


def fallback_after_failure(policy: Policy, d: Decision, why: str, tenant: str | None) -> Decision | None:
    """Where a request goes when its tier failed before sending anything (a remote tier's connect
    error or 5xx): the next tier along ``routing.fallback`` within the tenant's tiers, as a full
    tier falls back; None when there is none (the failure is the answer)."""
    nxt = policy.routing.fallback.get(d.tier)
    if nxt is None:
        return None
    nxt, _ = _cap(policy, nxt, tenant)
    if nxt in (d.tier, d.fallback_from):
        return None
    return replace(
        d,
        tier=nxt,
        fallback_from=d.fallback_from or d.tier,
        reason=d.reason + f"; '{d.tier}' failed before its first byte ({why}), fell back to '{nxt}'",
    )
