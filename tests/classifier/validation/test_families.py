"""Per-family validation (classifier/validation.py): the worst family decides, not the mean."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from classifier.validation.families import (
    LENGTH,
    RANDOM,
    bootstrap_apgr,
    family_table,
    lofo_values,
    paired_worst_margins,
    select_worst_family,
    worst_family,
)
from classifier.validation.outcomes import routing_metrics


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


def _selection(candidates: dict[str, np.ndarray], tie_break: dict[str, float]) -> dict[str, Any]:
    rows = _rows(300, seed=2)
    table = family_table(rows, candidates, draws=0)
    worst = {name: worst_family(table, name) for name in candidates}
    draws = paired_worst_margins({"s": rows}, {n: {"s": v} for n, v in candidates.items()}, {"s": table}, 100)
    return select_worst_family(worst, draws, tie_break)


def test_a_clearly_better_worst_family_wins_whatever_the_tie_break() -> None:
    """The bug this catches: a tie rule that ignores the paired interval (every candidate tied),
    so the tie-break alone picks a router that ranks a family backwards."""
    rows = _rows(300, seed=2)
    gain = np.array([r["strong"] - r["weak"] for r in rows])
    fam = np.array([r["family"] for r in rows])
    good = gain + 0.01 * np.arange(len(rows))
    bad = np.where(fam == "b", -gain, gain)  # backwards inside family b
    out = _selection({"good": good, "bad": bad}, {"good": 0.0, "bad": 1.0})
    assert out["leader"] == "good" and out["worst_family"]["bad"]["family"] == "b"
    assert out["leader_minus_ci95"]["bad"][0] > 0.3  # the paired difference excludes 0 by far
    assert out["tied_with_leader"] == ["good"] and out["selected"] == "good"


def test_candidates_within_paired_noise_tie_and_the_tie_break_decides() -> None:
    """The bug this catches: selection on the worst family's point estimate, which picks
    whichever of two near-identical routers drew the luckier noise."""
    rows = _rows(300, seed=2)
    length = np.array([len(r["prompt"]) for r in rows], dtype=np.float64)
    rng = np.random.default_rng(5)
    twin = length + rng.normal(0.0, 3.0, len(rows))  # length with a few neighbours swapped
    out = _selection({"length": length, "twin": twin}, {"length": 0.6, "twin": 0.7})
    lo, hi = out["leader_minus_ci95"]["twin" if out["leader"] == "length" else "length"]
    assert lo <= 0.0 <= hi + 1e-9
    assert out["leader"] == "length"  # the point estimate alone would keep length
    assert sorted(out["tied_with_leader"]) == ["length", "twin"] and out["selected"] == "twin"
    draws = paired_worst_margins(
        {"s": rows}, {"length": {"s": length}}, {"s": family_table(rows, {"length": length}, draws=0)}, 20
    )
    # Length against itself: the margin to length is 0 in every draw, so only random can be lower.
    assert np.all(draws["length"] <= 1e-12)
