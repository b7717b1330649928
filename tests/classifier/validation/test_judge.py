"""Judging a shadow log against references (classifier/validation/judge.py): the three scorers on
hand-picked answers, references found by id before prompt, a person's outcome kept over the
scorer's, lines without two answers or without a reference counted and skipped, and malformed
reference files refused with their line number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from classifier.validation.judge import (
    contains_match,
    exact_match,
    judge_rows,
    judge_shadow_log,
    load_references,
    normalize,
    number_match,
)


def test_normalize_folds_case_width_spaces_and_edge_punctuation() -> None:
    assert normalize("  Ｐａｒｉｓ,\n\tFrance!! ") == "paris, france"
    assert normalize("__x__") == "x"
    assert normalize("") == ""


@pytest.mark.parametrize(
    ("scorer", "answer", "reference", "score"),
    [
        (exact_match, "Paris.", "paris", 1.0),
        (exact_match, "Paris, France", "paris", 0.0),
        (number_match, "so the total is 1,234.", "1234", 1.0),
        (number_match, "first 3 then 4", "3", 0.0),  # the last number counts
        (number_match, "it is -2.50", "-2.5", 1.0),
        (number_match, "no digits", "4", 0.0),
        (number_match, "4", "four", 0.0),
        (contains_match, "The capital is Paris, of course", "paris", 1.0),
        (contains_match, "Lyon", "paris", 0.0),
        (contains_match, "anything", "  ...  ", 0.0),  # an empty reference matches nothing
    ],
)
def test_scorers(scorer: object, answer: str, reference: str, score: float) -> None:
    assert scorer(answer, reference) == score  # type: ignore[operator]


def _row(rid: str | None, prompt: object, answers: object, outcomes: object = None) -> dict[str, object]:
    row: dict[str, object] = {"prompt": prompt, "answers": answers, "tier": "small"}
    if rid is not None:
        row["id"] = rid
    if outcomes is not None:
        row["outcomes"] = outcomes
    return row


def test_judge_rows_scores_every_tier_and_keeps_a_persons_judgement() -> None:
    """Bugs it catches: the prompt's reference used although the id has one, a given outcome
    overwritten by the scorer's, a line with one answer judged (nothing to compare)."""
    rows = [
        _row("a", "q1", {"small": "4", "large": "5"}),
        _row(None, "q2", {"small": "x", "large": "y"}, outcomes={"large": 1, "small": "bad"}),
        _row("zz", "q1", {"small": "5", "large": "5"}),  # unknown id: falls back to the prompt
        _row("b", "q3", {"small": "only one"}),
        _row("c", "q4", {"small": "a", "large": "b"}),  # no reference at all
        _row("d", 7, {"small": "a", "large": "b"}),
        _row("e", "q5", "not a mapping"),
    ]
    judged, summary = judge_rows(rows, exact_match, {"a": "4"}, {"q1": "5", "q2": "x"})
    assert summary == {"lines": 7, "judged": 3, "no_reference": 1, "no_content": 3}
    first, second, third = judged
    assert first["outcomes"] == {"small": 1.0, "large": 0.0} and first["judge"] == "reference by id"
    assert second["outcomes"] == {"small": 1.0, "large": 1.0}  # the person's 1 for large kept
    assert second["judge"] == "reference by prompt"
    assert third["outcomes"] == {"small": 1.0, "large": 1.0} and third["judge"] == "reference by prompt"
    assert all("answers" not in j for j in judged)
    assert first["id"] == "a" and first["prompt"] == "q1" and first["tier"] == "small"


def test_load_references_by_id_and_prompt_and_refuses_bad_lines(tmp_path: Path) -> None:
    good = tmp_path / "refs.jsonl"
    good.write_text(
        '{"id": "a", "reference": "4"}\n\n{"prompt": "p", "reference": "x"}\n'
        '{"id": "b", "prompt": "q", "reference": "y"}\n'
    )
    assert load_references(good) == ({"a": "4", "b": "y"}, {"p": "x", "q": "y"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "reference": "4"}\n{"id": "b", "reference": 4}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a string 'reference'"):
        load_references(bad)
    orphan = tmp_path / "orphan.jsonl"
    orphan.write_text('{"reference": "4"}\n')
    with pytest.raises(ValueError, match=r"orphan.jsonl:1: a reference needs an 'id' or a 'prompt'"):
        load_references(orphan)


def test_judge_shadow_log_writes_the_judged_rows(tmp_path: Path) -> None:
    log = tmp_path / "shadow.jsonl"
    log.write_text(json.dumps(_row("a", "2+2?", {"small": "The answer is 4", "large": "4"})) + "\n\n")
    refs = tmp_path / "refs.jsonl"
    refs.write_text('{"id": "a", "reference": "4"}\n')
    out = tmp_path / "out" / "judged.jsonl"
    summary = judge_shadow_log(log, refs, out, scorer="number")
    assert summary["judged"] == 1
    (line,) = out.read_text().splitlines()
    assert json.loads(line)["outcomes"] == {"small": 1.0, "large": 1.0}
