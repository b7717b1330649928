"""decide(): data in, decision out, for every rule kind and their order."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import pytest

from router.errors import ModelNotFoundError
from router.policy.decide import RouteRequest, decide
from router.policy.loader import parse_policy

POLICY = parse_policy(
    textwrap.dedent("""
    version: 1
    tiers:
      small: {model: m}
      medium: {model: m}
      large: {model: m}
    tenants:
      free: {allowed_tiers: [small, medium]}
      tiny: {allowed_tiers: [small]}
    routing:
      aliases: {fast: small, smart: large}
      rules:
        - name: vip-header
          when: {headers: {x-priority: [high, urgent]}}
          tier: large
        - name: alias-cheap
          when: {model: [cheap]}
          tier: small
        - name: acme-tenant
          when: {tenant: [acme]}
          tier: medium
        - name: long-prompt
          when: {prompt_tokens_above: 1000}
          tier: large
        - name: predicted-large
          when: {predicted: [large], score_at_least: 0.9}
          tier: large
        - name: score-small
          when: {score_below: 0.3}
          tier: small
        - name: score-medium
          when: {score_below: 0.7}
          tier: medium
        - name: default
          tier: large
      fallback: {small: medium, medium: large, large: null}
      escalation: {confidence_below: 0.5}
""")
)


@dataclass
class Score:
    value: float
    tier: str = "small"
    probabilities: dict[str, float] = field(
        default_factory=lambda: {"small": 0.9, "medium": 0.05, "large": 0.05}
    )


def d(score: float = 0.1, **kw: object):  # type: ignore[no-untyped-def]
    load = kw.pop("load", None)
    pol = kw.pop("policy", POLICY)
    s = kw.pop("score_obj", None) or Score(score)
    return decide(pol, RouteRequest(**kw), s, load)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("score", "tier", "rule"),
    [
        (0.0, "small", "score-small"),
        (0.29, "small", "score-small"),
        (0.3, "medium", "score-medium"),
        (0.69, "medium", "score-medium"),
        (0.7, "large", "default"),
        (1.0, "large", "default"),
    ],
)
def test_score_thresholds(score: float, tier: str, rule: str) -> None:
    r = d(score)
    assert (r.tier, r.rule, r.score) == (tier, rule, score)


def test_header_override_is_case_insensitive_by_name_and_matches_any_value() -> None:
    assert d(0.1, headers={"x-priority": "urgent"}).rule == "vip-header"
    assert d(0.1, headers={"x-priority": "low"}).rule == "score-small"


def test_model_condition_and_forced_models() -> None:
    r = d(0.9, model="cheap")  # named by a rule's when.model: routed by the rules, not forced
    assert (r.tier, r.rule) == ("small", "alias-cheap")
    assert "cheap" in POLICY.model_names


def test_forced_tier_and_alias_skip_the_rules() -> None:
    r = d(0.9, model="small", headers={"x-priority": "high"})
    assert (r.tier, r.rule) == ("small", "model:small")
    r = d(0.0, model="smart")
    assert (r.tier, r.rule) == ("large", "alias:smart")


def test_unknown_model_is_404_with_param() -> None:
    with pytest.raises(ModelNotFoundError) as info:
        d(0.1, model="gpt-5")
    assert info.value.param == "model" and info.value.status_code == 404


def test_tenant_and_prompt_length_rules() -> None:
    assert d(0.1, tenant="acme").rule == "acme-tenant"
    assert d(0.1, prompt_tokens=1001).rule == "long-prompt"
    assert d(0.1, prompt_tokens=1000).rule == "score-small"


def test_rule_order_first_match_wins() -> None:
    r = d(0.1, headers={"x-priority": "high"}, tenant="acme", prompt_tokens=5000)
    assert r.rule == "vip-header"


def test_predicted_class_rule() -> None:
    s = Score(0.95, tier="large", probabilities={"small": 0.0, "medium": 0.05, "large": 0.95})
    assert d(score_obj=s).rule == "predicted-large"


def test_low_confidence_escalates_one_tier() -> None:
    unsure = Score(0.2, tier="small", probabilities={"small": 0.4, "medium": 0.35, "large": 0.25})
    r = d(score_obj=unsure)
    assert (r.tier, r.escalated, r.rule) == ("medium", True, "score-small")
    assert "escalated" in r.reason


def test_escalation_only_for_score_rules() -> None:
    unsure = Score(0.2, probabilities={"small": 0.4, "medium": 0.35, "large": 0.25})
    assert d(score_obj=unsure, tenant="acme").escalated is False


def test_tenant_cap_lowers_to_the_highest_allowed_tier() -> None:
    r = d(0.9, tenant="free")
    assert (r.tier, r.capped) == ("medium", True)
    assert d(0.9, tenant="tiny").tier == "small"
    assert d(0.9, tenant="free", model="large").tier == "medium"  # forcing cannot bypass the cap


def test_full_tier_falls_back_along_the_chain() -> None:
    r = d(0.1, load={"small": True})
    assert (r.tier, r.fallback_from) == ("medium", "small")
    r = d(0.1, load={"small": True, "medium": True})
    assert r.tier == "large" and not r.rejected


def test_no_free_fallback_is_a_rejection() -> None:
    assert d(0.9, load={"large": True}).rejected
    assert d(0.1, load={"small": True, "medium": True, "large": True}).rejected


def test_fallback_respects_tenant_caps() -> None:
    r = d(0.1, tenant="tiny", load={"small": True})
    assert r.rejected  # medium is not allowed for this tenant


def test_decide_is_pure() -> None:
    a = d(0.5, headers={"x": "y"})
    b = d(0.5, headers={"x": "y"})
    assert a == b
