"""Metrics and the acceptance targets of the shipped artifact (classifier/evaluate.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sklearn.metrics import accuracy_score, f1_score

from classifier.data import HELDOUT_PATH
from classifier.inference import COMPLEXITY_DIR
from classifier.validation.evaluate import classification_metrics, evaluate, format_report

DESIGN_KEYS = {"n", "accuracy", "macro_f1", "confusion", "severe_error_rate", "p50_ms", "p99_ms"}


@pytest.fixture(scope="module")
def heldout_metrics() -> dict[str, Any]:
    # The taxonomy targets belong to the complexity model; the shipped routing score is checked
    # against outcomes in test_outcome_train.py.
    return evaluate(HELDOUT_PATH, COMPLEXITY_DIR)


def test_shipped_artifact_meets_heldout_targets(heldout_metrics: dict[str, Any]) -> None:
    assert set(heldout_metrics) == DESIGN_KEYS
    assert heldout_metrics["n"] == sum(1 for line in HELDOUT_PATH.open() if line.strip())
    assert heldout_metrics["accuracy"] >= 0.85
    assert heldout_metrics["severe_error_rate"] <= 0.02


def test_latency_fields_are_sane(heldout_metrics: dict[str, Any]) -> None:
    p50, p99 = heldout_metrics["p50_ms"], heldout_metrics["p99_ms"]
    assert isinstance(p50, float)
    assert isinstance(p99, float)
    assert 0.0 < p50 <= p99 < float("inf")  # ordered percentiles; the figures are a benchmark's


def test_metrics_are_json_and_match_the_shipped_metadata(heldout_metrics: dict[str, Any]) -> None:
    json.dumps(heldout_metrics)
    meta = json.loads((COMPLEXITY_DIR / "metadata.json").read_text())
    shipped = meta["metrics"]["heldout"]
    for key in ("n", "accuracy", "macro_f1", "confusion", "severe_error_rate"):
        assert heldout_metrics[key] == shipped[key], key


def test_classification_metrics_against_scikit_learn() -> None:
    truth = ["small", "small", "medium", "large", "large", "medium", "small", "large"]
    predicted = ["small", "large", "medium", "small", "large", "small", "small", "medium"]
    m = classification_metrics(truth, predicted)
    assert m["n"] == 8
    assert m["accuracy"] == pytest.approx(accuracy_score(truth, predicted))
    assert m["macro_f1"] == pytest.approx(f1_score(truth, predicted, average="macro"))
    assert m["confusion"]["small"] == {"small": 2, "medium": 0, "large": 1}
    assert m["confusion"]["large"] == {"small": 1, "medium": 1, "large": 1}
    assert m["severe_error_rate"] == pytest.approx(2 / 8)


def test_classification_metrics_edge_cases() -> None:
    assert classification_metrics([], [])["accuracy"] == 0.0
    perfect = classification_metrics(["small"], ["small"])
    assert perfect["accuracy"] == perfect["macro_f1"] == 1.0
    with pytest.raises(ValueError, match="differ"):
        classification_metrics(["small"], [])


def test_evaluate_rejects_unlabeled_rows(tmp_path: Path) -> None:
    data = tmp_path / "unlabeled.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match="no label"):
        evaluate(data)


def test_format_report(heldout_metrics: dict[str, Any]) -> None:
    report = format_report(heldout_metrics)
    for needle in ("accuracy", "p99", "confusion"):
        assert needle in report
