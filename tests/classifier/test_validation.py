"""Per-family validation (classifier/validation.py): the worst family decides, not the mean."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from classifier.outcomes import routing_metrics
from classifier.validation import LENGTH, RANDOM, bootstrap_apgr, family_table, lofo_values, worst_family


def _rows(n: int = 200, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    rows = []
    for family in ("a", "b"):
        for i in range(n):
            gain = rng.random() < 0.4
            rows.append(
                {"prompt": "x" * (i + 1), "weak": 0.0 if gain else 1.0, "strong": 1.0, "family": family}
            )
    rows.append({"prompt": "flat", "weak": 1.0, "strong": 1.0, "family": "flat"})
    return rows


def test_a_router_good_on_average_but_inverse_in_one_family_is_caught() -> None:
    """The bug this catches: model selection on a pooled or mean APGR, where a family the router
    ranks backwards hides behind one it ranks well; worst_family must name the bad family."""
    rows = _rows()
    gain = np.array([r["strong"] - r["weak"] for r in rows])
    fam = np.array([r["family"] for r in rows])
    router = np.where(fam == "a", gain, -gain) + np.where(fam == "a", 10.0, 0.0)  # "a" first, then inverse
    table = family_table(rows, {"router": router}, draws=50)
    assert table["flat"] == {"n": 1, "gap": 0.0, "judged": False}  # no gap: reported, not judged
    idx_b = fam == "b"
    expected_b = routing_metrics(router[idx_b], gain[idx_b] * 0, gain[idx_b])["apgr"]
    assert table["b"]["router"]["apgr"] == round(expected_b, 4) < 0.3
    assert table["a"]["router"]["apgr"] > 0.7 and "router" in table["all"]  # pooled row as well
    worst = worst_family(table, "router")
    assert worst["family"] == "b" and worst["margin"] < -0.2
    assert worst["margin_length"] == round(table["b"]["router"]["apgr"] - table["b"][LENGTH]["apgr"], 4)
    assert abs(table["b"][RANDOM]["apgr"] - 0.5) < 0.05


def test_bootstrap_interval_brackets_the_estimate_and_is_seeded() -> None:
    rows = _rows(300, seed=1)
    s = np.array([len(str(r["prompt"])) for r in rows if r["family"] == "a"], dtype=float)
    w = [r["weak"] for r in rows if r["family"] == "a"]
    g = [r["strong"] for r in rows if r["family"] == "a"]
    point = routing_metrics(s, w, g)["apgr"]
    lo, hi = bootstrap_apgr(s, w, g, draws=100, seed=3)
    assert lo < point < hi and hi - lo < 0.3
    assert bootstrap_apgr(s, w, g, draws=100, seed=3) == (lo, hi)


def test_lofo_scores_each_family_with_a_model_fitted_without_it() -> None:
    rows = _rows(20)
    calls: list[str] = []

    def fit_without(family: str) -> Callable[[Sequence[str]], np.ndarray]:
        calls.append(family)

        def score(prompts: Sequence[str]) -> np.ndarray:
            return np.full(len(prompts), float(len(calls)))  # which fit scored the row

        return score

    values = lofo_values(rows, fit_without)
    assert calls == ["a", "b", "flat"]
    fam = [r["family"] for r in rows]
    assert {values[i] for i, f in enumerate(fam) if f == "a"} == {1.0}
    assert {values[i] for i, f in enumerate(fam) if f == "b"} == {2.0}
