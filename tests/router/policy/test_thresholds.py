"""router/policy/thresholds.py: ``write_thresholds`` puts calibrated ``score_below`` values into a
policy file in place.

The reference is its documented contract, worked by hand on small policy files: only the
``score_below`` of rules routing to a tier in ``thresholds`` whose ``when`` holds nothing else
changes, rounded to 4 places; every other character (comments, order, layout) stays; the result
is validated before the file is replaced, and nothing is left behind either way.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from router.errors import PolicyError
from router.policy.loader import load_policy
from router.policy.thresholds import write_thresholds

POLICY = """\
# calibrated by hand
tiers:
  small: {model: 'embedded:smollm2-135m-instruct'}
  medium: {model: 'embedded:smollm2-135m-instruct'}
  large: {model: 'embedded:smollm2-135m-instruct'}
routing:
  rules:
    - name: vip                 # tenant rule: never touched
      when: {tenant: [vip], score_below: 0.9}
      tier: small
    - {name: score-small, when: {score_below: 0.3}, tier: small}   # flow style
    - name: score-medium
      when:
        score_below: 0.6        # block style
      tier: medium
    - name: hard
      when: {score_at_least: 0.95}
      tier: large
    - name: big
      when: {score_below: 0.99}
      tier: large
    - name: default
      tier: large
"""


def write(tmp_path: Path, text: str = POLICY) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_only_the_score_rules_numbers_change(tmp_path: Path) -> None:
    """Bug it catches: a rule with more than ``score_below`` edited (the tenant rule), a tier not in
    ``thresholds`` edited (``and`` for ``or`` in the skip test), the wrong characters replaced, or
    a comment / layout lost."""
    path = write(tmp_path)
    result = write_thresholds(path, {"small": 0.25, "medium": 0.5})
    assert result == {"score-small": 0.25, "score-medium": 0.5}
    expected = POLICY.replace("score_below: 0.3}", "score_below: 0.25}").replace(
        "score_below: 0.6 ", "score_below: 0.5 "
    )
    assert path.read_text(encoding="utf-8") == expected
    p = load_policy(path)
    by_name = {r.name: r.when for r in p.routing.rules}
    assert by_name["score-small"] is not None and by_name["score-small"].score_below == 0.25
    assert by_name["vip"] is not None and by_name["vip"].score_below == 0.9


def test_values_are_rounded_to_four_places(tmp_path: Path) -> None:
    """Bug it catches: the rounding dropped or to another number of places (``round(x, 3)``): the
    file would carry 0.123456789 or 0.123 where calibrate proposed 0.1235."""
    path = write(tmp_path)
    result = write_thresholds(path, {"small": 0.123456789, "medium": 0.56789})
    assert result == {"score-small": 0.1235, "score-medium": 0.5679}
    text = path.read_text(encoding="utf-8")
    assert "score_below: 0.1235}" in text and "score_below: 0.5679 " in text


def test_edits_of_different_lengths_land_in_place(tmp_path: Path) -> None:
    """Bug it catches: edits applied front to back (``sorted`` without ``reverse``): the first,
    longer number shifts the text and the second edit overwrites the wrong characters."""
    text = POLICY.replace("score_below: 0.3}", "score_below: 0.3}  ")
    path = write(tmp_path, text)
    write_thresholds(path, {"small": 0.2345, "medium": 0.7})
    expected = text.replace("score_below: 0.3}", "score_below: 0.2345}").replace(
        "score_below: 0.6 ", "score_below: 0.7 "
    )
    assert path.read_text(encoding="utf-8") == expected


def test_only_one_tier_given(tmp_path: Path) -> None:
    """Bug it catches: a tier missing from ``thresholds`` treated as present (KeyError) or its
    rule edited anyway."""
    path = write(tmp_path)
    assert write_thresholds(path, {"medium": 0.4}) == {"score-medium": 0.4}
    assert path.read_text(encoding="utf-8") == POLICY.replace("score_below: 0.6 ", "score_below: 0.4 ")


def test_a_large_threshold_is_written_when_asked(tmp_path: Path) -> None:
    """Bug it catches: the tier test hard-coded to small/medium instead of ``thresholds``' keys,
    or a ``score_at_least`` rule (``when`` with another key) edited."""
    path = write(tmp_path)
    assert write_thresholds(path, {"large": 0.97}) == {"big": 0.97}
    assert "score_at_least: 0.95}" in path.read_text(encoding="utf-8")


def test_no_score_rules_is_an_error_and_the_file_is_kept(tmp_path: Path) -> None:
    """Bug it catches: the empty-edit check dropped (the file rewritten with nothing changed and a
    success reported) or the message not naming the file."""
    text = POLICY.replace("score_below: 0.3}", "score_below: 0.3, tenant: [a]}")
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=r"policy\.yaml: no score rules"):
        write_thresholds(path, {"small": 0.2})
    assert path.read_text(encoding="utf-8") == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.yaml"]


def test_rules_without_a_mapping_when_are_skipped(tmp_path: Path) -> None:
    """Bug it catches: the ``isinstance(when, MappingNode)`` guard dropped (``when: null`` on the
    default rule crashes), or a rule without ``tier`` crashing the walk."""
    text = POLICY.replace(
        "    - name: default\n      tier: large\n",
        "    - name: default\n      when: null\n      tier: large\n",
    )
    path = write(tmp_path, text)
    assert write_thresholds(path, {"small": 0.2, "large": 0.98}) == {"score-small": 0.2, "big": 0.98}


def test_an_invalid_result_is_refused_and_the_file_is_kept(tmp_path: Path) -> None:
    """Bug it catches: the file replaced before (or without) validation: thresholds out of order
    (small above medium) written into a policy that then fails to load; or the temporary file left
    behind."""
    path = write(tmp_path)
    with pytest.raises(PolicyError):
        write_thresholds(path, {"small": 0.7, "medium": 0.4})
    assert path.read_text(encoding="utf-8") == POLICY
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.yaml"]


def test_no_temporary_file_is_left_after_success(tmp_path: Path) -> None:
    """Bug it catches: the temporary ``.calibrate.tmp`` copy kept beside the policy."""
    path = write(tmp_path)
    write_thresholds(str(path), {"small": 0.2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.yaml"]
