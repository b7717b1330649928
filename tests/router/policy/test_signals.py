"""Request-shape signals, keywords, language, combinators, priority and sessions in decide()
(router/policy/decide.py, router/policy/signals.py)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import pytest

from router.policy.decide import RouteRequest, decide
from router.policy.loader import parse_policy
from router.policy.signals import detect_language, matches_keywords

POLICY = parse_policy(
    textwrap.dedent("""
    tiers:
      small: {model: m}
      medium: {model: m}
      large: {model: m}
    tenants:
      free: {allowed_tiers: [small, medium]}
    routing:
      rules:
        - name: tools
          when: {has_tools: true}
          tier: large
        - name: json-out
          when: {response_format: [json_object, json_schema]}
          tier: medium
        - name: logprobs
          when: {logprobs: true}
          tier: medium
        - name: long-chat
          when: {turns_at_least: 6}
          tier: large
        - name: code-words
          when: {keywords: [stack trace, segfault, "O(n)"]}
          tier: large
        - name: german
          when: {language: [de]}
          tier: medium
        - name: easy-but-not-vip
          when:
            all_of:
              - {score_below: 0.3}
              - any_of: [{tenant: [free]}, {turns_at_most: 1}]
            not: {headers: {x-priority: high}}
          tier: small
        - name: urgent-first
          priority: 10
          when: {headers: {x-priority: urgent}}
          tier: large
        - name: default
          tier: medium
""")
)


@dataclass
class Score:
    value: float
    tier: str = "small"
    probabilities: dict[str, float] = field(
        default_factory=lambda: {"small": 1.0, "medium": 0.0, "large": 0.0}
    )


def d(value: float = 0.5, **kw: object) -> tuple[str, str]:
    decision = decide(POLICY, RouteRequest(**kw), Score(value))  # type: ignore[arg-type]
    return decision.tier, decision.rule


def test_request_shape_signals() -> None:
    assert d(has_tools=True) == ("large", "tools")
    assert d(response_format="json_schema") == ("medium", "json-out")
    assert d(response_format="text") == ("medium", "default")
    assert d(logprobs=True) == ("medium", "logprobs")
    assert d(turns=6) == ("large", "long-chat")
    assert d(turns=5) == ("medium", "default")


def test_keywords_are_whole_words_and_case_insensitive() -> None:
    assert d(text="Why does this SEGFAULT on exit?") == ("large", "code-words")
    assert d(text="here is the stack   trace:") == ("large", "code-words")  # any spacing
    assert d(text="segfaults happen") == ("medium", "default")  # a whole word, not a prefix
    assert d(text="make it O(n) please") == ("large", "code-words")  # punctuation kept literal
    assert matches_keywords("is it O(n)?", ["O(n)"])
    assert not matches_keywords("O(n2)", ["O(n)"])


def test_language() -> None:
    assert d(text="Wie kann ich das Problem mit dem Drucker lösen? Es ist nicht einfach.") == (
        "medium",
        "german",
    )
    assert detect_language("What is the capital of France, and why is it there?") == "en"
    assert detect_language("¿Cuál es la capital de Francia y por qué está en el norte?") == "es"
    assert detect_language("東京で一番高いビルはどれですか") == "ja"
    assert detect_language("北京的天气怎么样") == "zh"
    assert detect_language("Привет, как дела?") == "ru"
    assert detect_language("12345 !!!") == "und"
    assert detect_language("ok") == "und"  # no stop words: unsure


def test_combinators() -> None:
    assert d(0.1, turns=1) == ("small", "easy-but-not-vip")
    assert d(0.1, turns=3) == ("medium", "default")  # any_of fails: not free, not one turn
    assert d(0.1, turns=3, tenant="free") == ("small", "easy-but-not-vip")
    assert d(0.1, turns=1, headers={"x-priority": "high"}) == ("medium", "default")  # the `not`
    assert d(0.5, turns=1) == ("medium", "default")  # all_of fails on the score


def test_priority_orders_rules_before_file_order() -> None:
    # urgent-first is written after `tools` but has priority 10, so it wins.
    assert d(has_tools=True, headers={"x-priority": "urgent"}) == ("large", "urgent-first")
    assert [r.name for _, r in POLICY.routing.ordered_rules][:2] == ["urgent-first", "tools"]


SESSIONS = parse_policy(
    textwrap.dedent("""
    tiers: {small: {model: m}, medium: {model: m}, large: {model: m}}
    tenants: {free: {allowed_tiers: [small, medium]}}
    routing:
      fallback: {large: medium}
      rules:
        - {name: cheap, when: {score_below: 0.5}, tier: small}
        - {name: default, tier: medium}
    """)
)


def s(session: str | None, value: float = 0.1, policy: object = SESSIONS, **kw: object) -> object:
    return decide(policy, RouteRequest(session=session, **kw), Score(value))  # type: ignore[arg-type]


def test_session_floor_raises_never_lowers() -> None:
    up = s("large")
    assert (up.tier, up.rule, up.session) == ("large", "session:cheap", "large")  # type: ignore[attr-defined]
    same = s("small")
    assert (same.tier, same.rule, same.session) == ("small", "cheap", None)  # type: ignore[attr-defined]
    lower = s("small", value=0.9)  # the prompt itself wants medium: floors never pull down
    assert (lower.tier, lower.rule) == ("medium", "default")  # type: ignore[attr-defined]
    assert s("gone-tier").tier == "small"  # type: ignore[attr-defined]  # a tier a reload removed


def test_session_pin_mode_holds_the_tier_both_ways() -> None:
    pinned = parse_policy(
        textwrap.dedent("""
        tiers: {small: {model: m}, medium: {model: m}, large: {model: m}}
        routing:
          sessions: {mode: pin}
          rules:
            - {name: cheap, when: {score_below: 0.5}, tier: small}
            - {name: default, tier: medium}
        """)
    )
    down = s("small", value=0.9, policy=pinned)
    assert (down.tier, down.rule) == ("small", "session:default")  # type: ignore[attr-defined]


def test_session_respects_forced_tiers_caps_and_load() -> None:
    forced = s("large", model="small")
    assert (forced.tier, forced.rule) == ("small", "model:small")  # type: ignore[attr-defined]
    capped = s("large", tenant="free")
    assert capped.tier == "medium" and capped.capped  # type: ignore[attr-defined]
    full = decide(SESSIONS, RouteRequest(session="large"), Score(0.1), {"large": True})
    assert full.tier == "medium" and full.fallback_from == "large" and full.rule == "session:cheap"


@pytest.mark.parametrize(
    ("when", "path", "message"),
    [
        ("{has_tools: maybe}", "routing.rules[0].when.has_tools", "expected bool"),
        ("{response_format: [xml]}", "routing.rules[0].when.response_format[0]", "must be one of"),
        ("{turns_at_least: 3, turns_at_most: 2}", "routing.rules[0].when.turns_at_least", "at most"),
        ("{keywords: []}", "routing.rules[0].when.keywords", "empty list"),
        ("{keywords: ['  ']}", "routing.rules[0].when.keywords[0]", "blank"),
        ("{language: [english]}", "routing.rules[0].when.language[0]", "ISO 639-1"),
        ("{any_of: [{score_below: 2}]}", "routing.rules[0].when.any_of[0].score_below", "[0, 1]"),
        ("{not: {tenant: 3}}", "routing.rules[0].when.not.tenant", "expected a list"),
        ("{nott: {tenant: [a]}}", "routing.rules[0].when.nott", "did you mean 'not'"),
    ],
)
def test_new_keys_are_validated_with_path_and_line(when: str, path: str, message: str) -> None:
    from router.errors import PolicyError

    text = (
        "tiers: {small: {model: m}}\nrouting:\n  rules:\n    - name: r\n"
        f"      when: {when}\n      tier: small\n    - {{name: d, tier: small}}\n"
    )
    with pytest.raises(PolicyError) as err:
        parse_policy(text)
    issues = [i for i in err.value.issues if i.path == path]
    assert issues, [(i.path, i.message) for i in err.value.issues]
    assert message in issues[0].message and issues[0].line == 5


def _issues(rules: str) -> list[tuple[str, str]]:
    from router.errors import PolicyError

    text = "tiers: {small: {model: m}, large: {model: m}}\nrouting:\n  rules:\n" + textwrap.indent(
        textwrap.dedent(rules), "    "
    )
    try:
        parse_policy(text)
    except PolicyError as err:
        return [(i.path, i.message) for i in err.issues]
    return []


def test_policy_check_flags_rules_an_earlier_rule_covers() -> None:
    issues = _issues("""
        - {name: teams, when: {tenant: [a, b]}, tier: large}
        - {name: team-a-easy, when: {tenant: [a], score_below: 0.5}, tier: small}
        - {name: words, when: {keywords: [proof, lemma]}, tier: large}
        - {name: proof, when: {keywords: [Proof], has_tools: false}, tier: small}
        - {name: default, tier: small}
    """)
    flagged = {path: msg for path, msg in issues}
    assert "rules[0] ('teams') comes first and matches every request" in flagged["routing.rules[1]"]
    assert "rules[2] ('words')" in flagged["routing.rules[3]"]
    assert len(issues) == 2


def test_policy_check_keeps_rules_that_can_still_fire() -> None:
    assert not _issues("""
        - {name: team-a-easy, when: {tenant: [a], score_below: 0.5}, tier: small}
        - {name: teams, when: {tenant: [a, b]}, tier: large}
        - {name: tools-json, when: {has_tools: true, response_format: [json_object]}, tier: large}
        - {name: tools, when: {has_tools: true}, tier: small}
        - {name: either, when: {any_of: [{tenant: [c]}, {turns_at_least: 3}]}, tier: large}
        - {name: default, tier: small}
    """)


def test_priority_cannot_put_a_rule_after_the_default() -> None:
    issues = _issues("""
        - {name: default, priority: 5, tier: small}
        - {name: later, when: {tenant: [a]}, tier: large}
    """)
    assert (
        "routing.rules[1]",
        "unreachable: rules[0] ('default') has no 'when' and matches everything",
    ) in issues
    assert any(path == "routing.rules[1]" and "last rule" in msg for path, msg in issues)
