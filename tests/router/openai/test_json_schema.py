"""The schema rules applied before a grammar is built (router/openai/json_schema.py), against
OpenAI's documented strict-mode rules and JSON Schema's own semantics: strict schemas need
``additionalProperties: false`` and every property required at every depth, with the error
naming where; closing objects adds ``additionalProperties: false`` only where JSON Schema would
admit any extra key (so every output of the closed schema is one of the original's), at every
depth, and leaves data (enum, const, default, property names) and explicit choices alone."""

from __future__ import annotations

from typing import Any

import pytest

from router.errors import BadRequestError
from router.openai.json_schema import check_strict_schema, close_objects


def _strict(props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
        **extra,
    }


def test_a_strict_schema_passes_at_every_depth() -> None:
    schema = _strict(
        {
            "name": {"type": "string"},
            "tags": {"type": "array", "items": _strict({"k": {"type": "string"}})},
            "alt": {"anyOf": [{"type": "null"}, _strict({"x": {"type": "integer"}})]},
        },
        **{"$defs": {"Node": _strict({"v": {"type": "number"}})}},
    )
    check_strict_schema(schema, "answer")
    check_strict_schema({"type": "string"}, "answer")  # no object: nothing to check


@pytest.mark.parametrize(
    ("schema", "where", "why"),
    [
        ({"type": "object", "properties": {"a": {}}, "required": ["a"]}, "", "'additionalProperties'"),
        (
            {
                "type": "object",
                "properties": {"a": {}, "b": {}},
                "required": ["a"],
                "additionalProperties": False,
            },
            "",
            "Missing 'b'",
        ),
        (
            _strict({"items": {"type": "array", "items": {"type": "object", "properties": {"z": {}}}}}),
            "'properties', 'items', 'items'",
            "'additionalProperties'",
        ),
        (
            _strict({"a": {"type": ["object", "null"], "properties": {}}}),
            "'properties', 'a'",
            "'additionalProperties'",
        ),
        (
            _strict({}, **{"$defs": {"D": {"properties": {"q": {}}, "additionalProperties": False}}}),
            "'$defs', 'D'",
            "Missing 'q'",
        ),
        (
            _strict(
                {
                    "u": {
                        "oneOf": [
                            {"type": "string"},
                            {"type": "object", "properties": {"p": {}}, "additionalProperties": True},
                        ]
                    }
                }
            ),
            "'properties', 'u', 'oneOf', '1'",
            "'additionalProperties'",
        ),
    ],
)
def test_each_strict_rule_is_enforced_and_names_where(schema: dict[str, Any], where: str, why: str) -> None:
    """Bugs it catches: a nested object (array items, anyOf branches, $defs, a nullable object)
    not checked, ``additionalProperties: true`` taken for false, a missing key not reported."""
    with pytest.raises(BadRequestError) as err:
        check_strict_schema(schema, "answer")
    assert err.value.param == "response_format.json_schema.schema" and err.value.code == "invalid_json_schema"
    assert f"context=({where})" in err.value.message and why in err.value.message
    assert "'answer'" in err.value.message


def test_closing_forbids_invented_keys_at_every_depth_and_keeps_the_rest() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string", "default": {"x": 1}}}},
            "properties": {"type": "string"},  # a property named "properties" is a name, not a schema
            "e": {"enum": [{"k": 1}]},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "pat": {"type": "object", "properties": {"p": {}}, "patternProperties": {"^x": {}}},
        },
        "required": ["a"],
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["a"]["properties"]["b"]["default"] == {"x": 1}
    assert closed["properties"]["properties"] == {"type": "string"}
    assert closed["properties"]["e"] == {"enum": [{"k": 1}]}
    assert closed["properties"]["open"]["additionalProperties"] is True  # an explicit choice stays
    assert "additionalProperties" not in closed["properties"]["pat"]  # patternProperties decide
    assert closed["required"] == ["a"]
    assert "additionalProperties" not in schema  # a copy: the caller's schema is untouched


def test_closing_reaches_lists_and_leaves_scalars() -> None:
    closed = close_objects({"anyOf": [{"properties": {"a": {}}}, {"type": "string"}]})
    assert closed == {"anyOf": [{"properties": {"a": {}}, "additionalProperties": False}, {"type": "string"}]}
    assert close_objects(True) is True and close_objects([1, "x"]) == [1, "x"]
