"""Property tests: whatever YAML a platform team writes, the loader returns a Policy or a
PolicyError listing issues with field paths - never another exception."""

from __future__ import annotations

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from router.errors import PolicyError
from router.policy.loader import parse_policy
from tests.router.policy.test_loader import BASE

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.floats(allow_nan=True), st.text(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
keys = st.sampled_from(
    [
        "tiers",
        "routing",
        "version",
        "service",
        "tenants",
        "rules",
        "model",
        "draft",
        "when",
        "tier",
        "score_below",
        "aliases",
        "fallback",
        "cache",
        "auth",
        "bogus",
    ]
)


def check(text: str) -> None:
    error: PolicyError | None = None
    try:
        policy = parse_policy(text)
    except PolicyError as exc:
        error = exc
    if error is not None:
        assert error.issues
        assert all(issue.path and issue.message for issue in error.issues)
        return
    assert policy.tiers and policy.routing.rules


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(keys, values, max_size=6))
def test_arbitrary_documents_never_crash_the_loader(doc: dict[str, object]) -> None:
    check(yaml.safe_dump(doc))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["tiers", "routing", "service"]), keys, values), max_size=4))
def test_mutations_of_a_valid_policy_never_crash(mutations: list[tuple[str, str, object]]) -> None:
    doc = yaml.safe_load(BASE)
    for section, key, value in mutations:
        target = doc.setdefault(section, {})
        if isinstance(target, dict):
            target[key] = value
    check(yaml.safe_dump(doc))


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_never_crashes(text: str) -> None:
    check(text)
