"""decide() at the edges: each condition at its boundary, sessions, caps, fallback chains and
rejections, unknown tenants, escalation and the load-aware reason.

Written against the survivors of ``make mutation`` on ``router/policy/decide.py``
(benchmarks/results/mutation.json): every test names the broken code it catches, and the expected
tiers and reasons are stated by hand from the policy text, not computed by the router.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

import pytest

from router.errors import ModelNotFoundError
from router.policy.decide import Decision, RouteRequest, decide, unknown_tenant_tiers
from router.policy.loader import parse_policy
from router.policy.schema import Policy

TIERS = """
version: 1
tiers:
  small: {model: m}
  medium: {model: m}
  large: {model: m}
"""


@dataclass
class Score:
    value: float = 0.5
    tier: str = "small"
    probabilities: dict[str, float] = field(
        default_factory=lambda: {"small": 0.9, "medium": 0.05, "large": 0.05}
    )


def _policy(body: str) -> Policy:
    return parse_policy(textwrap.dedent(TIERS) + textwrap.dedent(body))


def _one_rule(when: str) -> Policy:
    """``hit`` sends a matching request to large; everything else takes the default (small)."""
    return _policy(f"""
    routing:
      rules:
        - name: hit
          when: {when}
          tier: large
        - name: default
          tier: small
    """)


def _tier(policy: Policy, score: Score | None = None, **request: Any) -> str:
    return decide(policy, RouteRequest(**request), score or Score()).tier


# -- conditions at their boundaries --------------------------------------------------------------
CASES: list[tuple[str, dict[str, Any], Score | None, bool]] = [
    # (when, request fields, score, expected to match)
    ("{score_at_least: 0.6}", {}, Score(0.6), True),
    ("{score_at_least: 0.6}", {}, Score(0.59), False),
    ("{score_below: 0.3}", {}, Score(0.29), True),
    ("{score_below: 0.3}", {}, Score(0.3), False),
    ("{confidence_below: 0.6}", {}, Score(probabilities={"small": 0.59, "large": 0.41}), True),
    ("{confidence_below: 0.6}", {}, Score(probabilities={"small": 0.6, "large": 0.4}), False),
    ("{confidence_below: 0.6}", {}, Score(probabilities={}), False),  # no probabilities: confident
    ("{prompt_tokens_above: 100}", {"prompt_tokens": 101}, None, True),
    ("{prompt_tokens_above: 100}", {"prompt_tokens": 100}, None, False),
    ("{prompt_tokens_at_most: 100}", {"prompt_tokens": 100}, None, True),
    ("{prompt_tokens_at_most: 100}", {"prompt_tokens": 101}, None, False),
    ("{headers: {x-plan: gold}}", {"headers": {"x-plan": "gold"}}, None, True),
    ("{headers: {x-plan: gold}}", {"headers": {"x-plan": "old"}}, None, False),  # not a substring test
    ("{headers: {x-plan: [gold, platinum]}}", {"headers": {"x-plan": "platinum"}}, None, True),
    ("{headers: {x-plan: gold}}", {}, None, False),
    ("{response_format: [json_schema]}", {"response_format": "json_schema"}, None, True),
    ("{response_format: [json_schema]}", {"response_format": "text"}, None, False),
    ("{logprobs: true}", {"logprobs": True}, None, True),
    ("{logprobs: true}", {"logprobs": False}, None, False),
    ("{has_tools: true}", {"has_tools": True}, None, True),
    ("{has_tools: true}", {"has_tools": False}, None, False),
    ("{turns_at_least: 3}", {"turns": 3}, None, True),
    ("{turns_at_least: 3}", {"turns": 2}, None, False),
    ("{turns_at_most: 2}", {"turns": 2}, None, True),
    ("{turns_at_most: 2}", {"turns": 3}, None, False),
    ("{keywords: [refund]}", {"text": "I want a refund now"}, None, True),
    ("{keywords: [refund]}", {"text": "I want a pizza now"}, None, False),
    ("{language: [de]}", {"text": "Ich habe eine Frage und das ist nicht einfach für mich"}, None, True),
    ("{language: [de]}", {"text": "I have a question and it is not easy for me"}, None, False),
    ("{predicted: [large]}", {}, Score(tier="large"), True),
    ("{predicted: [large]}", {}, Score(tier="medium"), False),
    ("{tenant: [acme]}", {"tenant": "acme"}, None, True),
    ("{tenant: [acme]}", {"tenant": "other"}, None, False),
    ("{all_of: [{turns_at_least: 2}, {logprobs: true}]}", {"turns": 2, "logprobs": True}, None, True),
    ("{all_of: [{turns_at_least: 2}, {logprobs: true}]}", {"turns": 2, "logprobs": False}, None, False),
    ("{all_of: [{score_below: 0.5}, {turns_at_least: 1}]}", {}, Score(0.4), True),
    ("{all_of: [{score_below: 0.5}, {turns_at_least: 1}]}", {}, Score(0.6), False),
    ("{any_of: [{turns_at_least: 5}, {logprobs: true}]}", {"turns": 1, "logprobs": True}, None, True),
    ("{any_of: [{turns_at_least: 5}, {logprobs: true}]}", {"turns": 1, "logprobs": False}, None, False),
    ("{not: {logprobs: true}}", {"logprobs": False}, None, True),
    ("{not: {logprobs: true}}", {"logprobs": True}, None, False),
    ("{not: {any_of: [{turns_at_least: 5}, {score_below: 0.2}]}}", {"turns": 1}, Score(0.1), False),
]


@pytest.mark.parametrize(("when", "request_fields", "score", "matches"), CASES)
def test_each_condition_at_its_boundary(
    when: str, request_fields: dict[str, Any], score: Score | None, matches: bool
) -> None:
    """Catches a comparison flipped or made inclusive/exclusive, a negation dropped, and a nested
    condition evaluated against the wrong request or score."""
    assert _tier(_one_rule(when), score, **request_fields) == ("large" if matches else "small")


# -- names, aliases, rules -----------------------------------------------------------------------
def test_reasons_say_which_path_decided() -> None:
    """Catches garbled reasons (they are what /v1/route and the span show an operator)."""
    policy = _policy("""
    routing:
      aliases: {fast: small}
      rules:
        - name: tools
          when: {has_tools: true}
          tier: medium
        - name: default
          tier: large
    """)
    by_name = decide(policy, RouteRequest(model="medium"), Score())
    assert (by_name.tier, by_name.rule, by_name.reason) == (
        "medium",
        "model:medium",
        "tier requested by name",
    )
    alias = decide(policy, RouteRequest(model="fast"), Score())
    assert (alias.tier, alias.rule, alias.reason) == ("small", "alias:fast", "alias 'fast' maps to 'small'")
    ruled = decide(policy, RouteRequest(has_tools=True), Score())
    assert (ruled.rule, ruled.reason) == ("tools", "rule 'tools' matched")
    fallthrough = decide(policy, RouteRequest(), Score())
    assert (fallthrough.rule, fallthrough.reason) == ("default", "default rule 'default'")
    assert (fallthrough.escalated, fallthrough.capped, fallthrough.fallback_from) == (False, False, None)
    assert (fallthrough.rejected, fallthrough.session) == (False, None)


def test_unknown_model_lists_the_names_a_client_can_use() -> None:
    """Catches a 404 that names no alternatives or the wrong parameter."""
    policy = _policy("""
    routing:
      aliases: {fast: small}
      rules: [{name: default, tier: large}]
    """)
    with pytest.raises(ModelNotFoundError) as err:
        decide(policy, RouteRequest(model="gpt-9"), Score())
    message = str(err.value)
    assert "The model 'gpt-9' does not exist. Available: " in message
    assert all(f"{name}, " in message or message.endswith(f"{name}.") for name in ("small", "large", "fast"))
    assert err.value.param == "model"


# -- escalation ----------------------------------------------------------------------------------
def test_escalation_below_the_confidence_threshold_only() -> None:
    """Catches ``<=`` for ``<`` on the threshold, a crash on a score without probabilities, and an
    escalation note that replaces the reason instead of adding to it."""
    policy = _policy("""
    routing:
      rules:
        - name: cheap
          when: {score_below: 0.5}
          tier: small
        - name: default
          tier: large
      escalation: {confidence_below: 0.5}
    """)
    unsure = decide(
        policy, RouteRequest(), Score(0.1, probabilities={"small": 0.49, "medium": 0.3, "large": 0.21})
    )
    assert (unsure.tier, unsure.escalated) == ("medium", True)
    assert unsure.reason == "rule 'cheap' matched; escalated small -> medium (confidence 0.49 < 0.5)"
    at_threshold = decide(policy, RouteRequest(), Score(0.1, probabilities={"small": 0.5, "large": 0.5}))
    assert (at_threshold.tier, at_threshold.escalated) == ("small", False)
    no_probabilities = decide(policy, RouteRequest(), Score(0.1, probabilities={}))
    assert (no_probabilities.tier, no_probabilities.escalated) == ("small", False)


# -- sessions ------------------------------------------------------------------------------------
def _sessions(mode: str) -> Policy:
    return _policy(f"""
    routing:
      sessions: {{mode: {mode}}}
      rules:
        - name: cheap
          when: {{score_below: 0.5}}
          tier: small
        - name: mid
          when: {{score_below: 0.8}}
          tier: medium
        - name: default
          tier: large
    """)


def test_session_floor_keeps_a_conversation_from_going_down_only() -> None:
    """Catches the floor applied the wrong way round, to unknown tiers, or without its rule name,
    reason or ``session`` field."""
    policy = _sessions("floor")
    up = decide(policy, RouteRequest(session="large"), Score(0.1))
    assert (up.tier, up.rule, up.session) == ("large", "session:cheap", "large")
    assert up.reason == "rule 'cheap' matched; session: conversation was on 'large' (rule picked 'small')"
    down = decide(policy, RouteRequest(session="small"), Score(0.6))
    assert (down.tier, down.rule, down.session) == ("medium", "mid", None)
    same = decide(policy, RouteRequest(session="medium"), Score(0.6))
    assert (same.tier, same.rule, same.session) == ("medium", "mid", None)
    stale = decide(policy, RouteRequest(session="xl-retired"), Score(0.1))
    assert (stale.tier, stale.rule, stale.session) == ("small", "cheap", None)


def test_session_pin_holds_a_conversation_on_its_tier_both_ways() -> None:
    """Catches ``pin`` read as ``floor`` (a pinned conversation moving up or down)."""
    policy = _sessions("pin")
    down = decide(policy, RouteRequest(session="small"), Score(0.9))
    assert (down.tier, down.rule, down.session) == ("small", "session:default", "small")
    up = decide(policy, RouteRequest(session="large"), Score(0.1))
    assert (up.tier, up.session) == ("large", "large")


def test_a_full_session_tier_still_reports_the_session_on_rejection() -> None:
    """Catches the rejected Decision dropping its fields (tier, rule, score, flags, session)."""
    policy = _policy("""
    routing:
      sessions: {mode: pin}
      rules:
        - name: cheap
          when: {score_below: 0.5}
          tier: small
        - name: default
          tier: large
      fallback: {small: null, medium: null, large: null}
    """)
    d = decide(policy, RouteRequest(session="large"), Score(0.25), {"large": True})
    assert d == Decision(
        "large",
        "session:cheap",
        "rule 'cheap' matched; session: conversation was on 'large' (rule picked 'small')"
        "; 'large' is full and has no free fallback",
        0.25,
        False,
        False,
        None,
        rejected=True,
        session="large",
    )


# -- tenants: caps and unknown tenants -----------------------------------------------------------
def test_cap_picks_the_highest_allowed_tier_below_else_the_lowest_allowed() -> None:
    """Catches caps ignored, the wrong neighbour picked, and a cap note that replaces the reason."""
    policy = _policy("""
    tenants:
      free: {allowed_tiers: [small, medium]}
      upper: {allowed_tiers: [medium, large]}
      mid: {allowed_tiers: [medium]}
    routing:
      rules:
        - name: cheap
          when: {score_below: 0.5}
          tier: small
        - name: default
          tier: large
    """)
    free = decide(policy, RouteRequest(tenant="free"), Score(0.9))
    assert (free.tier, free.capped) == ("medium", True)
    assert free.reason == "default rule 'default'; capped to 'medium' for tenant 'free'"
    upper = decide(policy, RouteRequest(tenant="upper"), Score(0.1))  # nothing below small
    assert (upper.tier, upper.capped) == ("medium", True)
    mid = decide(policy, RouteRequest(tenant="mid"), Score(0.1))
    assert (mid.tier, mid.capped) == ("medium", True)
    allowed = decide(policy, RouteRequest(tenant="upper"), Score(0.9))
    assert (allowed.tier, allowed.capped) == ("large", False)


def test_unknown_tenants_get_the_default_tenants_tiers_or_what_every_tenant_may_use() -> None:
    """Catches unknown_tenant_tiers failing open (None), ignoring ``tenants.default``, taking the
    union or the complement, or falling back to the wrong tier when the lists share nothing."""
    with_default = _policy("""
    tenants:
      default: {allowed_tiers: [large]}
      a: {allowed_tiers: [small, medium]}
    routing: {rules: [{name: default, tier: large}]}
    """)
    assert unknown_tenant_tiers(with_default) == ["large"]  # not the named tenants' [small, medium]
    overlap = _policy("""
    tenants:
      a: {allowed_tiers: [small, medium]}
      b: {allowed_tiers: [medium, large]}
      open: {}
    routing: {rules: [{name: default, tier: large}]}
    """)
    assert unknown_tenant_tiers(overlap) == ["medium"]
    assert decide(overlap, RouteRequest(tenant="typo"), Score()).tier == "medium"
    disjoint = _policy("""
    tenants:
      a: {allowed_tiers: [medium]}
      b: {allowed_tiers: [large]}
    routing: {rules: [{name: default, tier: large}]}
    """)
    assert unknown_tenant_tiers(disjoint) == ["small"]
    unlimited = _policy("""
    tenants:
      open: {}
    routing: {rules: [{name: default, tier: large}]}
    """)
    assert unknown_tenant_tiers(unlimited) is None


# -- fallback and rejection ----------------------------------------------------------------------
FALLBACK = """
tenants:
  free: {allowed_tiers: [small, medium]}
routing:
  rules:
    - name: cheap
      when: {score_below: 0.5}
      tier: small
    - name: default
      tier: large
  fallback: {small: medium, medium: large, large: null}
"""


def test_fallback_chain_records_where_it_started() -> None:
    """Catches ``fallback_from`` reset along a chain (or not None when nothing was full) and a
    fallback note that replaces the reason."""
    policy = _policy(FALLBACK)
    calm = decide(policy, RouteRequest(), Score(0.1), {"small": False})
    assert (calm.tier, calm.fallback_from) == ("small", None)
    chain = decide(policy, RouteRequest(), Score(0.1), {"small": True, "medium": True})
    assert (chain.tier, chain.fallback_from, chain.rejected) == ("large", "small", False)
    assert chain.reason == (
        "rule 'cheap' matched; 'small' full, fell back to 'medium'; 'medium' full, fell back to 'large'"
    )


def test_a_capped_fallback_that_comes_back_to_a_full_tier_is_a_rejection() -> None:
    """Catches the visited set not recording the tiers walked: medium's fallback (large) is capped
    back to medium for this tenant, which must end in a 429, not loop forever."""
    policy = _policy(FALLBACK)
    d = decide(policy, RouteRequest(tenant="free"), Score(0.1), {"small": True, "medium": True})
    assert d.rejected and (d.tier, d.fallback_from) == ("medium", "small")
    assert d.reason.endswith("; 'medium' is full and has no free fallback")


# -- load-aware reason ---------------------------------------------------------------------------
LOAD = """
routing:
  mode: load_aware
  load_aware: {up_tolerance: 0.25, min_device_rows: 0}
  rules:
    - name: cheap
      when: {score_below: 0.5}
      tier: small
    - name: mid
      when: {score_below: 0.8}
      tier: medium
    - name: top
      when: {score_at_least: 0.8}
      tier: large
    - name: default
      tier: large
"""


def test_load_aware_reason_lists_every_candidates_price() -> None:
    """Catches the price list garbled or dropped from the reason (/v1/route explains the pick)."""
    policy = _policy(LOAD)
    d = decide(policy, RouteRequest(), Score(0.1), None, {"small": 1.0, "medium": 2.0, "large": 3.0})
    assert (d.tier, d.rule) == ("small", "cheap")
    assert d.reason == "rule 'cheap' matched; load-aware (small 1s, medium 2s, large 3s): 'small'"


def test_load_aware_tolerance_is_inclusive_and_a_lone_floor_adds_nothing() -> None:
    """Catches ``<`` for ``<=`` on up_tolerance (a tier priced exactly at the tolerance goes up)
    and a reason written when the floor was the only candidate (or nothing was)."""
    policy = _policy(LOAD)
    edge = 1.0 * (1 + 0.25)
    d = decide(policy, RouteRequest(), Score(0.1), None, {"small": 1.0, "medium": edge, "large": 9.0})
    assert (d.tier, d.rule) == ("medium", "load:cheap")
    lone = decide(policy, RouteRequest(), Score(0.9), None, {"small": 1.0, "medium": 1.0, "large": 2.0})
    assert (lone.tier, lone.reason) == ("large", "rule 'top' matched")
    none = decide(policy, RouteRequest(), Score(0.6), {"medium": True, "large": True}, {"small": 1.0})
    assert none.reason.startswith("rule 'mid' matched; ") and "load-aware" not in none.reason
