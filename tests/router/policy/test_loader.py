"""Policy validation: every error named with its field path and line, all of them at once."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from router.errors import PolicyError
from router.policy.loader import load_policy, parse_policy

BASE = """
version: 1
tiers:
  small: {model: embedded:smollm2-135m-instruct, quantization: int4}
  medium: {model: embedded:smollm2-135m-instruct, quantization: int8, draft: small}
  large: {model: embedded:smollm2-135m-instruct, draft: medium}
routing:
  rules:
    - {name: s, when: {score_below: 0.3}, tier: small}
    - {name: m, when: {score_below: 0.6}, tier: medium}
    - {name: default, tier: large}
"""


def issues(text: str) -> list[tuple[str, str, int | None]]:
    with pytest.raises(PolicyError) as info:
        parse_policy(textwrap.dedent(text), "p.yaml")
    return [(i.path, i.message, i.line) for i in info.value.issues]


def test_shipped_policies_are_valid() -> None:
    root = Path(__file__).resolve().parents[3] / "policies"
    files = [root / "default.yaml", *sorted((root / "examples").glob("*.yaml"))]
    assert len(files) >= 4
    for f in files:
        policy = load_policy(f)
        assert policy.tiers and policy.routing.rules


def test_base_is_valid_and_typed() -> None:
    p = parse_policy(BASE)
    assert p.tier_names == ["small", "medium", "large"]
    assert p.tiers["medium"].draft == "small" and p.tiers["small"].draft is None
    assert p.routing.rules[0].when is not None and p.routing.rules[0].when.score_below == 0.3
    assert len(p.digest) == 64


@pytest.mark.parametrize(
    ("edit", "path", "fragment"),
    [
        (("quantization: int4}", "quantization: int4, colour: red}"), "tiers.small.colour", "unknown key"),
        (("quantization: int4}", "quantization: int3}"), "tiers.small.quantization", "must be one of"),
        (
            ("quantization: int4}", "quantization: int4, max_num_seqs: many}"),
            "tiers.small.max_num_seqs",
            "expected int",
        ),
        (("quantization: int4}", "quantization: int4, max_num_seqs: 0}"), "tiers.small.max_num_seqs", ">= 1"),
        (("draft: small}", "draft: tiny}"), "tiers.medium.draft", "does not exist"),
        (("draft: small}", "draft: medium}"), "tiers.medium.draft", "itself"),
        (("quantization: int4}", "quantization: int4, draft: large}"), "tiers.small.draft", "draft cycle"),
        (("tier: medium}", "tier: huge}"), "routing.rules[1].tier", "does not exist"),
        (("score_below: 0.6", "score_below: 0.2"), "routing.rules[1].when.score_below", "out of order"),
        (("score_below: 0.6", "score_below: 1.5"), "routing.rules[1].when.score_below", "[0, 1]"),
        (("{name: m,", "{name: s,"), "routing.rules[1].name", "duplicate"),
        (("version: 1", "version: 9"), "version", "unsupported"),
        (
            ("quantization: int8, draft", "quantization: int8, activation_quantization: int8, draft"),
            "tiers.medium.activation_quantization",
            "needs quantization: int4, got int8",
        ),
        (
            ("quantization: int4}", "quantization: int4, activation_quantization: fp8}"),
            "tiers.small.activation_quantization",
            "must be one of",
        ),
        (("  small: {model", "  auto: {model"), "tiers.auto", "reserved"),
        (
            ("quantization: int4}", "quantization: int4, head_int8_tokens: 128}"),
            "tiers.small.head_int8_tokens",
            "needs quantization: int4 and quantize_head: true",
        ),
        (
            ("quantization: int4}", "quantization: int4, quantize_head: true, head_int8_tokens: 100}"),
            "tiers.small.head_int8_tokens",
            "multiple of 64",
        ),
    ],
)
def test_each_error_names_its_field(edit: tuple[str, str], path: str, fragment: str) -> None:
    found = issues(BASE.replace(*edit, 1))
    assert any(p == path and fragment in m for p, m, _ in found), found


def test_unreachable_rule_after_default() -> None:
    text = BASE + "    - {name: late, when: {headers: {x-a: b}}, tier: small}\n"
    found = issues(text)
    assert any(p == "routing.rules[3]" and "unreachable" in m for p, m, _ in found)
    assert any("last rule must have no 'when'" in m for _, m, _ in found)


def test_duplicate_conditions_are_unreachable() -> None:
    text = BASE.replace(
        "    - {name: m,", "    - {name: s2, when: {score_below: 0.3}, tier: medium}\n    - {name: m,"
    )
    found = issues(text)
    assert any("unreachable" in m or "out of order" in m for _, m, _ in found)


def test_missing_required_fields_and_line_numbers() -> None:
    text = """
    version: 1
    tiers:
      small: {quantization: int4}
    routing:
      rules: []
    """
    found = issues(text)
    assert ("tiers.small.model", "is required", 4) in found
    assert any(p == "routing.rules" and "at least one rule" in m for p, m, _ in found)


def test_all_errors_are_reported_together() -> None:
    text = (
        BASE.replace("draft: small}", "draft: tiny}")
        .replace("tier: medium}", "tier: huge}")
        .replace("version: 1", "version: 3")
    )
    assert len(issues(text)) >= 3


def test_remote_tier_cannot_draft() -> None:
    text = BASE.replace(
        "small: {model: embedded:smollm2-135m-instruct, quantization: int4}",
        "small: {model: 'http://vllm:8000/v1'}",
    )
    found = issues(text)
    assert any(p == "tiers.medium.draft" and "remote" in m for p, m, _ in found)


def test_alias_must_target_a_tier_and_not_shadow_one() -> None:
    text = BASE + "  aliases: {fast: tiny, small: large}\n"
    found = issues(text)
    assert any(p == "routing.aliases.fast" for p, _, _ in found)
    assert any(p == "routing.aliases.small" and "shadow" in m for p, m, _ in found)


def test_yaml_syntax_error_has_a_line() -> None:
    found = issues("tiers: {small: [unclosed\n")
    assert found[0][0] == "(syntax)" and found[0][2] is not None


def test_not_a_mapping() -> None:
    assert "mapping" in issues("- just\n- a list\n")[0][1]


def test_missing_file_is_a_policy_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "nope.yaml")


def test_ngram_draft_is_valid_and_the_name_is_reserved() -> None:
    """``draft: ngram`` drafts by n-gram lookup (no tier of that name needed); a tier may not be
    named ``ngram``, so the value never means two things."""
    p = parse_policy(BASE.replace("quantization: int4}", "quantization: int4, draft: ngram}"))
    assert p.tiers["small"].draft == "ngram"
    found = issues(BASE.replace("  small:", "  ngram:").replace("tier: small}", "tier: ngram}"))
    assert any(path == "tiers.ngram" and "reserved" in msg for path, msg, _ in found), found


@pytest.mark.parametrize(
    ("limits", "path", "fragment"),
    [
        ("{max_tools: -1}", "service.limits.max_tools", ">= 1, got -1"),
        ("{max_prompts: 0}", "service.limits.max_prompts", ">= 1, got 0"),
        ("{max_logit_bias: -5}", "service.limits.max_logit_bias", ">= 0, got -5"),
        ("{max_schema_depth: 0}", "service.limits.max_schema_depth", ">= 1"),
        ("{grammar_timeout_s: 0}", "service.limits.grammar_timeout_s", "> 0"),
    ],
)
def test_a_limit_that_would_refuse_every_request_is_named(limits: str, path: str, fragment: str) -> None:
    """Bug it guards: a negative or zero bound loaded silently and every request with a tool (or a
    list of prompts) got a 400 naming a limit the operator never meant to set."""
    found = issues(BASE + f"service:\n  limits: {limits}\n")
    assert any(p == path and fragment in m for p, m, _ in found), found
    lowest = parse_policy(BASE + "service:\n  limits: {max_logit_bias: 0, max_prompts: 1}\n")
    assert lowest.service.limits.max_prompts == 1
