"""The mixed-family check and the category prior (issue 56).

``mixed_family`` scores families pooled: a score whose prior does not order the families loses
there even when it ranks each family by length. The open-prompt set (``classifier/data/
open_prompts.jsonl``, written for this, not copied from a benchmark) checks that the shipped prior
puts open writing, role-play, humanities and STEM explanations (where weak models do well) below
maths, reasoning and code (where they fall behind). It is a sanity check, never training data.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from classifier.data import DATA_DIR
from classifier.validation.families import (
    LENGTH,
    ORACLE,
    family_table,
    mixed_family,
    oracle_prior_length,
    selection_margin,
)
from classifier.validation.outcomes import routing_metrics

OPEN = DATA_DIR / "open_prompts.jsonl"
LOW = ("writing", "roleplay", "humanities", "stem")
HIGH = ("math", "reasoning", "code")


def _rows() -> list[dict[str, Any]]:
    """Two families: "easy" (gap 0.2, longer prompts) and "hard" (gap 0.8, shorter prompts); inside
    each, the longer prompt is the one the strong model wins."""
    rows = []
    for i in range(10):
        rows.append({"prompt": "e" * (100 + i), "weak": float(i < 8), "strong": 1.0, "family": "easy"})
        rows.append({"prompt": "h" * (10 + i), "weak": float(i < 2), "strong": 1.0, "family": "hard"})
    return rows


def test_oracle_orders_families_by_gap_then_length() -> None:
    """Catches an oracle that lets length cross families: every hard row above every easy row,
    and inside a family the longer prompt first (checked against a plain sort)."""
    rows = _rows()
    score = oracle_prior_length(rows)
    hard = [s for s, r in zip(score, rows, strict=True) if r["family"] == "hard"]
    easy = [s for s, r in zip(score, rows, strict=True) if r["family"] == "easy"]
    assert min(hard) > max(easy)
    for fam in ("easy", "hard"):
        idx = [i for i, r in enumerate(rows) if r["family"] == fam]
        assert sorted(idx, key=lambda i: score[i]) == sorted(idx, key=lambda i: len(rows[i]["prompt"]))


def test_mixed_check_catches_a_score_that_ranks_by_length_alone() -> None:
    """Catches the regression of issue 56: length alone puts the long easy family first and loses
    on the pooled set; the oracle's APGR matches routing_metrics computed by hand."""
    rows = _rows()
    weak, strong = [r["weak"] for r in rows], [r["strong"] for r in rows]
    oracle = oracle_prior_length(rows)
    table = family_table(rows, {"value": oracle, ORACLE: oracle}, draws=20)
    mixed = mixed_family(table, "value")
    assert mixed["apgr"] == pytest.approx(routing_metrics(oracle, weak, strong)["apgr"], abs=1e-4)
    assert mixed["length"] == table["all"][LENGTH]["apgr"] < 0.5 < mixed["apgr"]
    assert mixed["margin"] > 0.2 and len(mixed["ci95"]) == 2
    lengthy = family_table(rows, {"value": [len(r["prompt"]) for r in rows]}, draws=0)
    assert mixed_family(lengthy, "value")["margin"] <= 0.0


def test_selection_takes_the_worse_of_mixed_and_within() -> None:
    """Catches a selection rule that reads one check alone: a score equal to length inside each
    family but reversed across them is judged by its mixed margin (negative), and the oracle
    (equal to length within, far above it pooled) by its within-family margin (0)."""
    rows = _rows()
    length = np.array([len(r["prompt"]) for r in rows], dtype=float)
    reversed_prior = length + np.array([1000.0 if r["family"] == "easy" else 0.0 for r in rows])
    table = family_table(rows, {"bad": reversed_prior, "oracle": oracle_prior_length(rows)}, draws=0)
    bad, good = selection_margin({"s": table}, "bad"), selection_margin({"s": table}, "oracle")
    assert bad["check"] == "mixed" and bad["margin"] < 0
    assert good["check"].startswith("within") and good["margin"] == pytest.approx(0.0, abs=1e-3)


def _open() -> list[dict[str, str]]:
    return [json.loads(line) for line in OPEN.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_open_prompt_set_is_small_labelled_and_multi_category() -> None:
    rows = _open()
    counts = {c: sum(r["category"] == c for r in rows) for c in {r["category"] for r in rows}}
    assert set(counts) == {*LOW, *HIGH, "extraction"} and min(counts.values()) >= 4
    assert len({r["prompt"] for r in rows}) == len(rows)


def test_shipped_prior_puts_open_writing_below_maths_reasoning_and_code(shipped: Any) -> None:
    """Catches a prior that lost the categories (3.2 sent history and science questions with a
    "why" to the reasoning prior): every low-gap category's mean score is below every high-gap
    one's, and the score separates the two groups far better than prompt length does."""
    rows = _open()
    values = np.array([s.value for s in shipped.score_batch([r["prompt"] for r in rows])])
    mean = {c: float(values[[r["category"] == c for r in rows]].mean()) for c in (*LOW, *HIGH)}
    assert max(mean[c] for c in LOW) < min(mean[c] for c in HIGH), mean

    def auc(scores: np.ndarray) -> float:
        hi = scores[[r["category"] in HIGH for r in rows]]
        lo = scores[[r["category"] in LOW for r in rows]]
        return float(np.mean([[(a > b) + 0.5 * (a == b) for b in lo] for a in hi]))

    length = np.array([len(r["prompt"]) for r in rows], dtype=float)
    assert auc(values) >= 0.9 and auc(values) > auc(length) + 0.2, (auc(values), auc(length))
