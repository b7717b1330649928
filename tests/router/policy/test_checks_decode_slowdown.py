"""``tiers.<name>.max_decode_slowdown`` (router/policy/checks.py, schema.py): off (null) by
default, any value above 1 is accepted and 1 or less refused naming the field - a step
beside decodes cannot cost less than the decodes alone."""

from __future__ import annotations

import pytest

from router.errors import PolicyError
from router.policy.loader import parse_policy


def _policy(value: str | None) -> str:
    key = "" if value is None else f", max_decode_slowdown: {value}"
    return f"""
version: 1
tiers:
  small: {{model: m{key}}}
routing:
  rules: [{{name: d, tier: small}}]
"""


def test_the_default_and_the_values_accepted() -> None:
    assert parse_policy(_policy(None)).tiers["small"].max_decode_slowdown is None
    assert parse_policy(_policy("null")).tiers["small"].max_decode_slowdown is None
    assert parse_policy(_policy("2.5")).tiers["small"].max_decode_slowdown == 2.5
    assert parse_policy(_policy("1.01")).tiers["small"].max_decode_slowdown == 1.01
    assert parse_policy(_policy("6")).tiers["small"].max_decode_slowdown == 6


@pytest.mark.parametrize("value", ["1", "1.0", "0.5", "0", "-2"])
def test_a_slowdown_of_one_or_less_is_refused_by_name(value: str) -> None:
    """Bug it catches: ``>=`` for ``>`` - a slowdown of 1 leaves no room for any prompt beside a
    decode, and new prompts would crawl at the 16-token floor."""
    with pytest.raises(PolicyError) as err:
        parse_policy(_policy(value))
    assert "tiers.small.max_decode_slowdown" in str(err.value)
    assert "must be > 1" in str(err.value)
