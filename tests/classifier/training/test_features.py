"""The routing score's training-side features (classifier/training/features.py) on small groups
whose counts are worked by hand: ``TokenCounts`` is ``log1p`` of each group's count with the gated
groups zeroed from the gate's threshold on; ``FamilyCounts`` is ``[log1p(length), one-hot family,
flags]`` - the family the domain group with most hits (first on ties, none without hits), an
override taking its family when every part of its rule holds (the first firing one winning),
flags at their threshold and only inside their scope; and every misconfiguration names itself."""

from __future__ import annotations

import math

import numpy as np
import pytest

from classifier.training.features import FamilyCounts, TokenCounts

GROUPS = (
    ("tokens", ()),
    ("maths", ("solve", "equation")),
    ("code", ("def", "return")),
    ("exam", ("answer",)),
    ("money", ("$",)),
)


def _log(*counts: float) -> list[float]:
    return [math.log1p(c) for c in counts]


def test_token_counts_are_log1p_of_each_groups_hits() -> None:
    text = "solve the equation and solve it $ 5"  # 8 tokens; maths 3, code 0, exam 0, money 1
    out = TokenCounts(GROUPS).fit([text]).transform([text, "def f return x"])
    np.testing.assert_allclose(out[0], _log(8, 3, 0, 0, 1), rtol=1e-6)
    np.testing.assert_allclose(out[1], _log(4, 0, 2, 0, 0), rtol=1e-6)
    assert out.dtype == np.float32
    assert list(TokenCounts(GROUPS).get_feature_names_out()) == [f"count_{g}" for g, _ in GROUPS]


def test_gated_groups_count_only_below_the_gates_threshold() -> None:
    """Bugs it catches: ``<=`` for ``<`` at the gate (a prompt with exactly ``gate_at`` hits still
    counting its cues), the gate zeroing the ungated columns too."""
    counts = TokenCounts(GROUPS, gate="exam", gated=("maths",), gate_at=2)
    counts.fit(["x"])
    one = counts.transform(["answer : solve solve"])[0]  # exam 1 < 2: maths kept
    two = counts.transform(["answer answer solve solve"])[0]  # exam 2: maths zeroed
    np.testing.assert_allclose(one, _log(4, 2, 0, 1, 0), rtol=1e-6)
    np.testing.assert_allclose(two, _log(4, 0, 0, 2, 0), rtol=1e-6)
    with pytest.raises(ValueError, match="unknown count groups"):
        TokenCounts(GROUPS, gate="nope").fit(["x"]).transform(["x"])


def _family(**kwargs: object) -> FamilyCounts:
    return FamilyCounts(GROUPS, domains=("maths", "code"), **kwargs).fit(["x"])  # type: ignore[arg-type]


def test_the_family_is_the_domain_with_most_hits_first_on_ties_none_without() -> None:
    f = _family()
    rows = f.transform(["solve def return", "solve def", "nothing here", "solve equation def"])
    np.testing.assert_allclose(rows[:, 1:], [[0, 1], [1, 0], [0, 0], [1, 0]])
    np.testing.assert_allclose(rows[:, 0], _log(3, 2, 2, 3), rtol=1e-6)
    assert list(f.get_feature_names_out()) == ["length", "family_maths", "family_code"]


def test_an_override_takes_its_family_when_its_whole_rule_holds_and_the_first_wins() -> None:
    """Bugs it catches: an override firing on part of its rule (``any`` for ``all``), ``>`` for
    ``>=`` at a rule's count, the last firing override winning instead of the first."""
    f = _family(overrides=(("code", (("money", 1), ("exam", 1))), ("maths", (("money", 2),))))
    rows = f.transform(
        [
            "solve solve $ answer",  # code's rule holds: code, although maths has the hits
            "solve solve $",  # only half of code's rule: the hits decide (maths)
            "def def $ $",  # maths' rule holds: maths
            "def $ $ answer",  # both rules hold: the first (code) wins
        ]
    )
    np.testing.assert_allclose(rows[:, 1:], [[0, 1], [1, 0], [1, 0], [0, 1]])


def test_flags_mark_their_threshold_and_only_inside_their_scope() -> None:
    f = _family(flags=(("money", 2),))
    rows = f.transform(["$ $", "$", "$ $ $"])
    np.testing.assert_allclose(rows[:, -1], [1, 0, 1])
    scoped = _family(flags=(("money", 1),), flag_scope=("exam", 1))
    rows = scoped.transform(["$ answer", "$ solve"])
    np.testing.assert_allclose(rows[:, -1], [1, 0])
    assert list(scoped.get_feature_names_out())[-1] == "flag_money_1"


def test_the_length_is_in_tokens_or_characters() -> None:
    text = "solve it now"
    tokens = _family().transform([text])[0, 0]
    chars = _family(length_unit="chars").transform([text])[0, 0]
    assert tokens == pytest.approx(math.log1p(3)) and chars == pytest.approx(math.log1p(len(text)))


def test_a_gated_domain_loses_its_family_on_an_exam_question() -> None:
    f = _family(gate="exam", gated=("maths",), gate_at=1)
    rows = f.transform(["solve equation answer", "solve equation"])
    np.testing.assert_allclose(rows[:, 1:], [[0, 0], [1, 0]])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"domains": ()}, "no domain groups"),
        ({"domains": ("maths", "nope")}, "unknown count groups"),
        ({"domains": ("maths",), "flags": (("nope", 1),)}, "unknown count groups"),
        ({"domains": ("maths",), "overrides": (("code", (("money", 1),)),)}, "is not a domain"),
        ({"domains": ("maths",), "length_unit": "bytes"}, "length_unit"),
    ],
)
def test_each_misconfiguration_is_refused_by_name(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FamilyCounts(GROUPS, **kwargs).fit(["x"])  # type: ignore[arg-type]
