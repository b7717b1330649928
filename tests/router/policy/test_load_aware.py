"""decide() in ``routing.mode: load_aware``: the rule's tier is a floor, the price picks among it
and the tiers above (the prices are given here; tests/router/backends/test_tierset_load_aware.py derives
them from engine loads)."""

from __future__ import annotations

import textwrap

import pytest

from router.errors import PolicyError
from router.policy.decide import RouteRequest, decide
from router.policy.loader import parse_policy
from tests.router.policy.test_decide import Score

YAML = """
version: 1
tiers:
  small: {model: m}
  medium: {model: m}
  large: {model: m}
tenants:
  free: {allowed_tiers: [small, medium]}
routing:
  mode: MODE
  load_aware: {up_tolerance: 0.1, min_device_rows: 0}
  aliases: {fast: small}
  rules:
    - name: tools
      when: {has_tools: true}
      tier: small
    - name: score-small
      when: {score_below: 0.3}
      tier: small
    - name: score-medium
      when: {score_below: 0.7}
      tier: medium
    - name: default
      tier: large
  fallback: {small: medium, medium: large, large: null}
"""
LOAD_AWARE = parse_policy(textwrap.dedent(YAML.replace("MODE", "load_aware")))
STATIC = parse_policy(textwrap.dedent(YAML.replace("MODE", "static")))


def route(costs: dict[str, float], score: float = 0.1, policy=LOAD_AWARE, load=None, **kw):  # type: ignore[no-untyped-def]
    return decide(policy, RouteRequest(**kw), Score(score), load, costs)


def test_the_cheapest_acceptable_tier_wins_and_the_rule_says_load_raised_it() -> None:
    d = route({"small": 2.0, "medium": 1.0, "large": 3.0})
    assert (d.tier, d.rule) == ("medium", "load:score-small")
    assert "load-aware" in d.reason and "medium" in d.reason


def test_the_rules_tier_is_kept_when_it_is_cheapest_and_the_rule_is_unchanged() -> None:
    d = route({"small": 1.0, "medium": 2.0, "large": 3.0})
    assert (d.tier, d.rule) == ("small", "score-small")


def test_never_below_the_rules_tier() -> None:
    # A medium-scored prompt never goes to small, however cheap small is.
    d = route({"small": 0.01, "medium": 2.0, "large": 3.0}, score=0.5)
    assert (d.tier, d.rule) == ("medium", "score-medium")


def test_a_higher_tier_within_the_tolerance_is_preferred() -> None:
    d = route({"small": 1.0, "medium": 1.5, "large": 1.09})
    assert (d.tier, d.rule) == ("large", "load:score-small")
    d = route({"small": 1.0, "medium": 1.5, "large": 1.11})
    assert d.tier == "small"


def test_full_tiers_are_not_candidates_and_a_full_floor_moves_up() -> None:
    d = route({"small": 1.0, "medium": 2.0, "large": 0.5}, load={"large": True})
    assert d.tier == "small"
    d = route({"small": 1.0, "medium": 2.0, "large": 3.0}, load={"small": True})
    assert (d.tier, d.rule, d.rejected) == ("medium", "load:score-small", False)


def test_the_tenants_tiers_bound_the_choice() -> None:
    d = route({"small": 2.0, "medium": 3.0, "large": 0.5}, tenant="free")
    assert (d.tier, d.capped) == ("small", False)


def test_static_mode_forced_names_and_rules_without_the_score_ignore_prices() -> None:
    cheap_large = {"small": 5.0, "medium": 5.0, "large": 0.1}
    assert route(cheap_large, policy=STATIC).tier == "small"
    assert route(cheap_large, model="small").tier == "small"
    assert route(cheap_large, model="fast").tier == "small"
    assert route(cheap_large, has_tools=True).rule == "tools"  # not a score rule
    # Tiers without a price (remote, unmeasured) are no candidates.
    assert route({"small": 5.0}).tier == "small"


def test_listed_rules_may_move_even_without_the_score() -> None:
    policy = parse_policy(
        textwrap.dedent(
            YAML.replace("MODE", "load_aware").replace(
                "{up_tolerance: 0.1, min_device_rows: 0}", "{rules: [tools], min_device_rows: 0}"
            )
        )
    )
    assert route({"small": 5.0, "large": 0.1}, policy=policy, has_tools=True).tier == "large"
    assert route({"small": 5.0, "large": 0.1}, policy=policy).tier == "small"  # score-small not listed


def test_load_aware_settings_are_validated_with_their_field_path() -> None:
    bad = YAML.replace("MODE", "load_aware").replace(
        "{up_tolerance: 0.1, min_device_rows: 0}", "{rules: [nope], up_tolerance: -1, min_device_rows: -1}"
    )
    with pytest.raises(PolicyError) as err:
        parse_policy(textwrap.dedent(bad))
    text = str(err.value)
    assert "routing.load_aware.rules[0]" in text and "nope" in text
    assert "routing.load_aware.up_tolerance" in text
    assert "routing.load_aware.min_device_rows" in text
    with pytest.raises(PolicyError, match=r"routing\.mode"):
        parse_policy(textwrap.dedent(YAML.replace("MODE", "fastest")))


# -- a running batch with room takes the request before any pricing -------------------------------


def joined(
    costs: dict[str, float],
    batches: dict[str, tuple[int, int]],
    score: float = 0.1,
    policy=LOAD_AWARE,
    load=None,
    device_rows=None,
    **kw,
):  # type: ignore[no-untyped-def]
    return decide(policy, RouteRequest(**kw), Score(score), load, costs, batches, device_rows)


PRICES = {"small": 1.0, "medium": 1.5, "large": 2.0}  # pricing alone keeps the floor


def test_the_highest_running_batch_with_room_takes_the_request() -> None:
    # Catches: the lowest running batch picked (a split device stays split), or batches ignored.
    d = joined(PRICES, {"small": (5, 16), "medium": (0, 16), "large": (3, 16)})
    assert (d.tier, d.rule) == ("large", "load:score-small")
    assert "joins the running batch of 'large' (3/16 rows)" in d.reason
    assert route(PRICES).tier == "small"  # the same prices without batches: the floor


def test_a_batch_without_a_free_slot_is_not_joined() -> None:
    d = joined(PRICES, {"small": (5, 16), "large": (16, 16)})
    assert (d.tier, d.rule) == ("small", "score-small")
    assert "joins the running batch of 'small'" in d.reason
    # No batch running anywhere acceptable: the prices decide.
    d = joined({"small": 2.0, "medium": 1.0, "large": 3.0}, {"small": (0, 16), "large": (16, 16)})
    assert (d.tier, d.rule) == ("medium", "load:score-small")


def test_a_tier_above_the_floor_without_a_free_slot_is_no_candidate_even_when_priced_cheapest() -> None:
    # Catches: load moving a request into the queue of a tier whose batch is full, where it takes
    # the place of a request whose score allows nothing lower (routing_gain at 48 clients:
    # large-scored requests were refused until 2-3 of 72 clients gave up). The floor itself stays
    # a candidate however full, and a tier with no batch listed (remote) is priced as before.
    cheap_large = {"small": 2.0, "medium": 3.0, "large": 1.0}
    d = joined(cheap_large, {"small": (0, 16), "medium": (0, 16), "large": (16, 16)})
    assert (d.tier, d.rule) == ("small", "score-small")
    assert "load-aware (small 2s, medium 3s): 'small'" in d.reason  # large was not priced
    d = joined(cheap_large, {"small": (0, 16), "medium": (0, 16), "large": (15, 16)})
    assert (d.tier, d.rule) == ("large", "load:score-small")
    d = joined(cheap_large, {"small": (16, 16), "medium": (16, 16), "large": (16, 16)})
    assert d.tier == "small"  # the floor, full as it is
    d = joined(cheap_large, {"small": (0, 16), "medium": (0, 16)})
    assert d.tier == "large"


def test_a_running_batch_below_the_floor_or_outside_the_tenants_tiers_is_not_joined() -> None:
    # Medium-scored: small's running batch is no candidate, so the prices pick among medium/large.
    d = joined(PRICES, {"small": (5, 16)}, score=0.5)
    assert (d.tier, d.rule) == ("medium", "score-medium")
    # The 'free' tenant may not use large: its running batch is not joined.
    d = joined(PRICES, {"large": (3, 16)}, tenant="free")
    assert (d.tier, d.capped) == ("small", False)
    # A full queue is no candidate either.
    d = joined(PRICES, {"large": (3, 16)}, load={"large": True})
    assert d.tier == "small"


def test_join_running_off_leaves_the_choice_to_the_prices() -> None:
    policy = parse_policy(
        textwrap.dedent(
            YAML.replace("MODE", "load_aware").replace(
                "{up_tolerance: 0.1, min_device_rows: 0}", "{join_running: false, min_device_rows: 0}"
            )
        )
    )
    d = joined(PRICES, {"large": (3, 16)}, policy=policy)
    assert (d.tier, d.rule) == ("small", "score-small")
    # Static mode never joins either.
    assert joined(PRICES, {"large": (3, 16)}, policy=STATIC).tier == "small"


def test_below_min_device_rows_the_rules_tier_stands() -> None:
    """Catches the light-load guard ignored (at 4 clients consolidating onto large measured 0.97x
    always-large where the rules' split was 1.22x) or counted from one tier instead of the whole
    device: 7 rows held in all keep the floor, 8 let load join large's batch."""
    policy = parse_policy(
        textwrap.dedent(
            YAML.replace("MODE", "load_aware").replace("min_device_rows: 0", "min_device_rows: 8")
        )
    )
    d = joined(PRICES, {"small": (4, 16), "medium": (0, 16), "large": (3, 16)}, policy=policy)
    assert (d.tier, d.rule) == ("small", "score-small") and "load-aware" not in d.reason
    d = joined(PRICES, {"small": (4, 16), "medium": (1, 16), "large": (3, 16)}, policy=policy)
    assert (d.tier, d.rule) == ("large", "load:score-small")
    # The caller's recent peak (device_rows) replaces the rows held now, both ways: a wave's
    # first arrival on a nearly empty device still joins large after a busy spell ...
    light = {"small": (1, 16), "medium": (0, 16), "large": (1, 16)}
    assert joined(PRICES, light, policy=policy).tier == "small"
    d = joined(PRICES, light, policy=policy, device_rows=12.5)
    assert (d.tier, d.rule) == ("large", "load:score-small")
    # ... and a faded peak below the guard keeps the floor even with the rows listed.
    busy = {"small": (4, 16), "medium": (1, 16), "large": (3, 16)}
    assert joined(PRICES, busy, policy=policy, device_rows=7.9).tier == "small"
    # Unset, the guard is the documented 4.
    assert (
        parse_policy(
            "version: 1\ntiers: {small: {model: m}}\nrouting: {rules: [{name: d, tier: small}]}"
        ).routing.load_aware.min_device_rows
        == 4
    )
