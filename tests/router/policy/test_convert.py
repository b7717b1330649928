"""router/policy/convert.py: the structural pass from YAML data to typed dataclasses - field paths
as text, the line an issue is reported at, each type's conversion and its error message,
unknown keys with a did-you-mean, required fields, and defaults that stand in for a bad value.

The reference is hand-worked: small dataclasses defined here with every kind of field the policy
schema uses, YAML texts whose line numbers are counted by hand, and the exact messages written out.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
import yaml

from router.errors import PolicyError
from router.policy.convert import (
    MISSING,
    FieldPath,
    Issues,
    convert_dataclass,
    describe,
    fmt_path,
    node_lines,
)
from router.policy.loader import parse_policy


@dataclass
class Inner:
    n: int = 1


@dataclass
class Sample:
    name: str
    label: str = "l"
    count: int = 3
    ratio: float = 0.5
    flag: bool = True
    mode: Literal["fast", "slow"] = "fast"
    tags: list[str] = field(default_factory=list)
    limits: dict[str, int] = field(default_factory=dict)
    maybe: int | None = 7
    choice: str | list[str] = "x"
    inner: Inner = field(default_factory=Inner)
    opt_inner: Inner | None = None
    not_: bool | None = field(default=None, metadata={"key": "not"})
    source: str = ""
    digest: str = ""


@dataclass
class Pair:
    left: Inner
    right: int


def convert(value: Any, cls: Any = Sample) -> tuple[Any, list[tuple[str, str]]]:
    ctx = Issues({})
    out = convert_dataclass(value, cls, (), ctx)
    return out, [(i.path, i.message) for i in ctx.issues]


def ok(**fields: Any) -> Sample:
    out, found = convert({"name": "a", **fields})
    assert found == [], found
    assert isinstance(out, Sample)
    return out


def errors(**fields: Any) -> tuple[Sample, list[tuple[str, str]]]:
    out, found = convert({"name": "a", **fields})
    assert isinstance(out, Sample)
    return out, found


# -- paths and lines -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "text"),
    [
        ((), "(top level)"),
        (("tiers",), "tiers"),
        (("tiers", "small", "draft"), "tiers.small.draft"),
        (("routing", "rules", 0, "when", "any_of", 1), "routing.rules[0].when.any_of[1]"),
        ((0,), "[0]"),
        ((0, "a", 2), "[0].a[2]"),
    ],
)
def test_fmt_path(path: FieldPath, text: str) -> None:
    """Bug it catches: a dot before the first key (``.tiers``), indices written as ``.0``, or the
    top level shown as an empty path."""
    assert fmt_path(path) == text


def test_an_issue_gets_the_line_of_its_nearest_known_ancestor() -> None:
    """Bug it catches: the ancestor walk starting one level up (a known line of the field itself
    ignored), stopping before the top level (``range(len, 0, -1)``), or going the wrong way."""
    ctx = Issues({(): 1, ("a",): 3, ("a", "b"): 5})
    ctx.error(("a", "b"), "m1")
    ctx.error(("a", "b", "c", 0), "m2")
    ctx.error(("a", "x"), "m3")
    ctx.error(("z",), "m4")
    assert [(i.path, i.message, i.line) for i in ctx.issues] == [
        ("a.b", "m1", 5),
        ("a.b.c[0]", "m2", 5),
        ("a.x", "m3", 3),
        ("z", "m4", 1),
    ]
    none = Issues({("a",): 2})
    none.error(("q",), "m")
    assert none.issues[0].line is None


def test_node_lines_records_keys_and_items_by_hand_counted_lines() -> None:
    """Bug it catches: 0-based lines (no ``+ 1``), a key's line overwritten by its value's (a
    block value starts on the next line), or sequence items not numbered."""
    text = textwrap.dedent(
        """\
        tiers:
          small:
            model: m
        routing:
          rules:
            - name: a
              tier: small

            - {name: b, tier: small}
        """
    )
    out: dict[FieldPath, int] = {}
    node = yaml.compose(text)
    assert node is not None
    node_lines(node, (), out)
    assert out[()] == 1
    assert out[("tiers",)] == 1
    assert out[("tiers", "small")] == 2
    assert out[("tiers", "small", "model")] == 3
    assert out[("routing",)] == 4
    assert out[("routing", "rules")] == 5
    assert out[("routing", "rules", 0)] == 6
    assert out[("routing", "rules", 0, "name")] == 6
    assert out[("routing", "rules", 0, "tier")] == 7
    assert out[("routing", "rules", 1)] == 9
    assert out[("routing", "rules", 1, "tier")] == 9


def test_parse_policy_reports_lines_from_the_yaml() -> None:
    """Bug it catches: lines not threaded through (``None`` everywhere) or taken from the wrong
    node: a missing required field is reported at its tier's line, a bad value at its key's."""
    text = textwrap.dedent(
        """\
        tiers:
          small:
            quantization: int4
          medium:
            model: m
            max_num_seqs: many
        routing:
          rules:
            - {name: d, tier: medium}
        """
    )
    with pytest.raises(PolicyError) as info:
        parse_policy(text)
    found = [(i.path, i.message, i.line) for i in info.value.issues]
    assert found == [
        ("tiers.small.model", "is required", 2),
        ("tiers.medium.max_num_seqs", "expected int, got str 'many'", 6),
    ]


# -- describe ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "null"),
        (True, "boolean True"),
        (False, "boolean False"),
        ({"a": 1}, "a mapping"),
        ([1], "a list"),
        (5, "int 5"),
        (1.5, "float 1.5"),
        ("abc", "str 'abc'"),
        ("x" * 37, "str '" + "x" * 37 + "'"),
        ("x" * 38, "str '" + "x" * 36 + "..."),
    ],
)
def test_describe(value: Any, text: str) -> None:
    """Bug it catches: a bool described as an int, the cut at 40 characters of repr moved (``<=``
    for ``<``: a 40-character repr shown whole) or cut to another length."""
    assert describe(value) == text


# -- scalar conversions --------------------------------------------------------------------------
def test_falsy_scalars_are_kept() -> None:
    """Bug it catches: a falsy value (0, 0.0, "", false, [], {}) treated as absent so the default
    stands in."""
    s = ok(count=0, ratio=0, flag=False, tags=[], limits={}, name="", maybe=0, choice="")
    assert (s.count, s.ratio, s.flag, s.tags, s.limits, s.name, s.maybe, s.choice) == (
        0,
        0.0,
        False,
        [],
        {},
        "",
        0,
        "",
    )
    assert isinstance(s.ratio, float)


def test_an_int_is_accepted_as_a_float_and_becomes_one() -> None:
    """Bug it catches: ``int`` refused for a float field (``timeout_s: 30`` in README refused) or
    kept as an int."""
    s = ok(ratio=2)
    assert s.ratio == 2.0 and type(s.ratio) is float


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("count", True, "expected int, got boolean True"),
        ("count", 1.5, "expected int, got float 1.5"),
        ("count", "3", "expected int, got str '3'"),
        ("ratio", False, "expected float, got boolean False"),
        ("ratio", "0.5", "expected float, got str '0.5'"),
        ("flag", 1, "expected bool, got int 1"),
        ("flag", "yes", "expected bool, got str 'yes'"),
        ("label", 5, "expected str, got int 5"),
        ("mode", "medium", "must be one of 'fast' | 'slow', got str 'medium'"),
        ("tags", "a", "expected a list, got str 'a'"),
        ("limits", [1], "expected a mapping, got a list"),
        ("inner", 3, "expected a mapping, got int 3"),
        ("maybe", "x", "expected int, got str 'x'"),
        ("choice", 5, "expected str or list of str, got int 5"),
    ],
)
def test_a_wrong_type_is_named_and_the_default_stands_in(key: str, value: Any, message: str) -> None:
    """Bug it catches: a bool passed as an int or a float (YAML ``true`` where a count is meant),
    an int as a bool, a type name wrong in the message, or the bad value kept (or the whole
    object dropped) instead of the field's default standing in so later checks still run."""
    out, found = errors(**{key: value})
    assert found == [(key, message)]
    assert getattr(out, key) == getattr(Sample(name="a"), key)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_floats_are_refused(value: float) -> None:
    """Bug it catches: the ``isfinite`` check dropped: ``.inf`` or ``.nan`` loads as a timeout or a
    threshold (every comparison with NaN is false)."""
    out, found = errors(ratio=value)
    assert found == [("ratio", "must be a finite number")]
    assert out.ratio == 0.5


def test_literal_accepts_each_option() -> None:
    """Bug it catches: a Literal check that refuses a listed option."""
    assert ok(mode="slow").mode == "slow"
    assert ok(mode="fast").mode == "fast"


# -- containers ----------------------------------------------------------------------------------
def test_list_items_are_converted_and_bad_ones_reported_by_index() -> None:
    """Bug it catches: a bad item dropping the whole list, the item's index missing from the path,
    or the bad item kept."""
    out, found = errors(tags=["a", 5, "c", None])
    assert out.tags == ["a", "c"]
    assert found == [("tags[1]", "expected str, got int 5"), ("tags[3]", "expected str, got null")]


def test_mapping_values_are_converted_and_bad_ones_reported_by_key() -> None:
    """Bug it catches: ``break`` for ``continue`` after a non-string key (the rest unchecked), a
    bad value kept, or its key missing from the path."""
    out, found = errors(limits={1: 2, "a": "x", "b": 0, "c": 4})
    assert out.limits == {"b": 0, "c": 4}
    assert found == [
        ("limits.1", "keys must be strings, got int 1"),
        ("limits.a", "expected int, got str 'x'"),
    ]


def test_nested_dataclass() -> None:
    """Bug it catches: a nested mapping not converted to its dataclass, or its errors reported
    without the nested path."""
    assert ok(inner={"n": 0}).inner == Inner(n=0)
    out, found = errors(inner={"n": "z"})
    assert found == [("inner.n", "expected int, got str 'z'")]
    assert out.inner == Inner()


# -- unions --------------------------------------------------------------------------------------
def test_null_is_kept_for_an_optional_field() -> None:
    """Bug it catches: ``null`` replaced by the default (``maybe: null`` read as 7) or refused."""
    assert ok(maybe=None).maybe is None
    assert ok(opt_inner=None).opt_inner is None
    assert ok(maybe=0).maybe == 0


def test_an_optional_dataclass_reports_its_own_nested_errors() -> None:
    """Bug it catches: ``X | None`` converted by trial, which would only say "expected mapping or
    null" about a mapping with one bad key deep inside."""
    assert ok(opt_inner={"n": 4}).opt_inner == Inner(n=4)
    _, found = errors(opt_inner={"n": "z", "m": 1})
    assert found == [
        ("opt_inner.m", "unknown key; allowed: n"),
        ("opt_inner.n", "expected int, got str 'z'"),
    ]


def test_a_union_takes_the_first_option_that_converts() -> None:
    """Bug it catches: the trial conversion's issues leaking into the real ones (an item error of
    the list option reported although the union as a whole is the problem), or an option skipped."""
    assert ok(choice="y").choice == "y"
    assert ok(choice=["y", "z"]).choice == ["y", "z"]
    out, found = errors(choice=["y", 5])
    assert found == [("choice", "expected str or list of str, got a list")]
    assert out.choice == "x"


def test_a_union_with_null_and_two_types() -> None:
    """Bug it catches: ``null`` refused for ``str | list[str] | None``, or its options' names
    missing from the message."""

    @dataclass
    class Headers:
        h: dict[str, str | list[str]] | None = None
        v: str | list[str] | None = "d"

    out, found = convert({"v": None, "h": {"x": ["a"], "y": "b"}}, Headers)
    assert found == [] and out == Headers(h={"x": ["a"], "y": "b"}, v=None)
    out, found = convert({"v": 1.5}, Headers)
    assert found == [("v", "expected str or list of str or null, got float 1.5")]


# -- dataclasses ---------------------------------------------------------------------------------
def test_a_null_section_is_all_defaults() -> None:
    """Bug it catches: ``inner: null`` (an empty YAML section) refused instead of read as ``{}``."""
    assert ok(inner=None).inner == Inner()
    out, found = convert(None, Inner)
    assert out == Inner() and found == []


def test_a_non_mapping_section_is_refused() -> None:
    """Bug it catches: a scalar or a list where a section is meant accepted or crashing."""
    assert convert(5, Inner) == (MISSING, [("(top level)", "expected a mapping, got int 5")])
    assert convert(["n"], Inner) == (MISSING, [("(top level)", "expected a mapping, got a list")])


def test_unknown_keys_get_a_did_you_mean_and_the_allowed_keys() -> None:
    """Bug it catches: unknown keys ignored, the suggestion or the allowed list dropped, or
    ``source`` / ``digest`` (set by the loader, not YAML keys) offered as keys."""
    out, found = errors(cuont=4, zzzzqq=1)
    allowed = "name, label, count, ratio, flag, mode, tags, limits, maybe, choice, inner, opt_inner, not"
    assert found == [
        ("cuont", f"unknown key (did you mean 'count'?); allowed: {allowed}"),
        ("zzzzqq", f"unknown key; allowed: {allowed}"),
    ]
    assert out.count == 3
    _, found = errors(source="s", digest="d")
    assert [p for p, _ in found] == ["source", "digest"]
    assert all(m.startswith("unknown key") for _, m in found)


def test_a_field_may_name_its_yaml_key_in_metadata() -> None:
    """Bug it catches: the metadata ``key`` ignored (``not`` unknown, ``not_`` accepted)."""
    assert ok(**{"not": True}).not_ is True
    _, found = errors(not_=True)
    assert found and found[0][0] == "not_" and found[0][1].startswith("unknown key")


def test_required_fields() -> None:
    """Bug it catches: a missing required field not reported, reported for a field with a default,
    or the object built anyway (a half-valid policy returned); all missing fields reported."""
    assert convert({}, Pair) == (MISSING, [("left", "is required"), ("right", "is required")])
    out, found = convert({}, Sample)
    assert out is MISSING and found == [("name", "is required")]
    assert convert({"left": {}, "right": 0}, Pair) == (Pair(Inner(), 0), [])


def test_a_required_field_with_a_bad_value_drops_the_object() -> None:
    """Bug it catches: ``ok`` left true when a required field failed to convert (``Pair(right=...)``
    missing an argument: a TypeError instead of an issue)."""
    out, found = convert({"left": {}, "right": "two"}, Pair)
    assert out is MISSING and found == [("right", "expected int, got str 'two'")]
    out, found = convert({"left": {"n": "x"}, "right": 2}, Pair)
    assert out == Pair(Inner(), 2) and found == [("left.n", "expected int, got str 'x'")]


def test_every_problem_is_reported_at_once() -> None:
    """Bug it catches: conversion stopping at the first bad field."""
    _, found = errors(count="a", ratio="b", flag=2, mode="x", bogus=1)
    assert [p for p, _ in found] == ["bogus", "count", "ratio", "flag", "mode"]


def test_union_messages_name_mapping_options() -> None:
    """Bug it catches: a mapping option named by its key type (``mapping of str``) instead of its
    value type, or a dataclass option named other than ``mapping``."""

    @dataclass
    class Mixed:
        counts: int | dict[str, int] = 0
        section: int | Inner = 0

    out, found = convert({"counts": {"a": 1}, "section": {"n": 2}}, Mixed)
    assert found == [] and out == Mixed(counts={"a": 1}, section=Inner(n=2))
    _, found = convert({"counts": "a", "section": "b"}, Mixed)
    assert found == [
        ("counts", "expected int or mapping of int, got str 'a'"),
        ("section", "expected int or mapping, got str 'b'"),
    ]
