"""Validation that sees transfer: APGR per task family, leave-one-family-out, bootstrap intervals.

Every model selection on one task family (MMLU) hid that inside another family (maths word
problems, code) a score can route worse than prompt length. This module scores a router
family by family, beside prompt length and random, with percentile bootstrap intervals, and
refits a training recipe without each family to score that family (leave-one-family-out, LOFO):
the honest estimate for a family the score has never seen. Model selection reads the **worst**
family (:func:`worst_family`), not the mean.

Families come from :func:`classifier.validation.outcomes.family_of` (a row's ``family``, its ``source``, or
its MMLU subject's category).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from classifier.validation.outcomes import OutcomeRow, random_apgr, routing_metrics

__all__ = [
    "LENGTH",
    "ORACLE",
    "RANDOM",
    "bootstrap_apgr",
    "family_table",
    "lofo_values",
    "mixed_family",
    "oracle_prior_length",
    "paired_worst_margins",
    "prompt_length",
    "select_worst_family",
    "selection_margin",
    "worst_family",
]

LENGTH = "prompt length"
RANDOM = "random"
ORACLE = "oracle (family gap + length)"
# A family whose weak and strong models differ by less than this has no gap to recover: its
# APGR divides by ~0 and says nothing, so it is reported but not judged.
MIN_GAP = 0.02


def prompt_length(rows: Sequence[OutcomeRow]) -> np.ndarray:
    """The baseline router: characters, longest to the strong model first."""
    return np.array([len(r["prompt"]) for r in rows], dtype=np.float64)


def bootstrap_apgr(
    scores: ArrayLike,
    weak: ArrayLike,
    strong: ArrayLike,
    draws: int = 200,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap interval of APGR: rows resampled with replacement, ``draws`` times.

    Draws whose resample has no gap between the models (APGR undefined) are skipped.
    """
    s, w, g = (np.asarray(a, dtype=np.float64) for a in (scores, weak, strong))
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(draws):
        idx = rng.integers(0, len(s), len(s))
        if abs(g[idx].sum() - w[idx].sum()) < 1e-9:
            continue
        values.append(routing_metrics(s[idx], w[idx], g[idx])["apgr"])
    if not values:
        return float("nan"), float("nan")
    tail = (1.0 - level) / 2.0 * 100.0
    lo, hi = np.percentile(values, [tail, 100.0 - tail])
    return round(float(lo), 4), round(float(hi), 4)


def _block(
    scores: ArrayLike, weak: Sequence[float], strong: Sequence[float], draws: int, seed: int
) -> dict[str, Any]:
    m = routing_metrics(scores, weak, strong)
    out: dict[str, Any] = {"apgr": round(float(m["apgr"]), 4)}
    if draws > 0:
        out["ci95"] = list(bootstrap_apgr(scores, weak, strong, draws, seed))
    return out


def family_table(
    rows: Sequence[OutcomeRow],
    routers: Mapping[str, ArrayLike],
    draws: int = 200,
    seed: int = 0,
    pooled: bool = True,
) -> dict[str, Any]:
    """``{family: {"n", "gap", router: {"apgr", "ci95"}, "prompt length": ..., "random": ...}}``.

    ``routers`` maps a name to one score per row (higher = send to the strong model first);
    prompt length and the mean of 50 random routers are added. With ``pooled`` the table has an
    ``"all"`` entry over every row as well (when there is more than one family). A family with a
    gap under :data:`MIN_GAP` gets ``"judged": false`` and no APGR.
    """
    families = sorted({r["family"] for r in rows})
    groups: dict[str, np.ndarray] = {f: np.flatnonzero([r["family"] == f for r in rows]) for f in families}
    if pooled and len(families) > 1:
        groups["all"] = np.arange(len(rows))
    length = prompt_length(rows)
    scored = {name: np.asarray(v, dtype=np.float64) for name, v in routers.items()}
    weak_all = np.array([r["weak"] for r in rows], dtype=np.float64)
    strong_all = np.array([r["strong"] for r in rows], dtype=np.float64)
    table: dict[str, Any] = {}
    for family, idx in groups.items():
        weak, strong = weak_all[idx].tolist(), strong_all[idx].tolist()
        gap = float(np.mean(strong) - np.mean(weak))
        entry: dict[str, Any] = {"n": len(idx), "gap": round(gap, 4), "judged": abs(gap) >= MIN_GAP}
        if entry["judged"]:
            for name, values in scored.items():
                entry[name] = _block(values[idx], weak, strong, draws, seed)
            entry[LENGTH] = _block(length[idx], weak, strong, draws, seed)
            entry[RANDOM] = {"apgr": round(random_apgr(weak, strong, seed), 4)}
        table[family] = entry
    return table


def worst_family(table: Mapping[str, Any], router: str) -> dict[str, Any]:
    """The judged family where ``router`` does worst against prompt length (and its margins).

    ``margin_length`` = router APGR - length APGR, ``margin_random`` = router APGR - random;
    the minimum over families of ``min(margin_length, margin_random)`` is what selection ranks.
    """
    worst: dict[str, Any] | None = None
    for family, entry in table.items():
        if family == "all" or not entry.get("judged") or router not in entry:
            continue
        apgr = entry[router]["apgr"]
        margins = {
            "margin_length": round(apgr - entry[LENGTH]["apgr"], 4),
            "margin_random": round(apgr - entry[RANDOM]["apgr"], 4),
        }
        key = min(margins.values())
        if worst is None or key < worst["margin"]:
            worst = {"family": family, "apgr": apgr, "margin": round(key, 4), **margins}
    return worst or {}


def paired_worst_margins(
    sets: Mapping[str, Sequence[OutcomeRow]],
    candidates: Mapping[str, Mapping[str, ArrayLike]],
    tables: Mapping[str, Mapping[str, Any]],
    draws: int = 200,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Each candidate's worst-family margin (:func:`worst_family`'s ``margin``) under ``draws``
    paired resamples: one draw resamples every judged family's rows with replacement, the same
    rows for every candidate and for prompt length, so the difference between two candidates'
    draws is the noise of that difference, not of each family's (often wide) APGR.

    ``candidates`` maps a name to ``{set: one score per row of sets[set]}``; ``tables`` are
    :func:`family_table` outputs per set (which families are judged, and their random APGR, which
    is held fixed: its mean of 50 routers barely moves under resampling).
    """
    rng = np.random.default_rng(seed)
    out = {name: np.full(draws, np.inf) for name in candidates}
    for set_name, rows in sets.items():
        family = np.array([r["family"] for r in rows])
        weak = np.array([r["weak"] for r in rows], dtype=np.float64)
        strong = np.array([r["strong"] for r in rows], dtype=np.float64)
        length = prompt_length(rows)
        scores = {name: np.asarray(v[set_name], dtype=np.float64) for name, v in candidates.items()}
        for fam, entry in tables[set_name].items():
            if fam == "all" or not entry.get("judged"):
                continue
            idx = np.flatnonzero(family == fam)
            chance = entry[RANDOM]["apgr"]
            for d in range(draws):
                pick = idx[rng.integers(0, len(idx), len(idx))]
                if abs(strong[pick].sum() - weak[pick].sum()) < 1e-9:
                    continue
                base = routing_metrics(length[pick], weak[pick], strong[pick])["apgr"]
                for name, values in scores.items():
                    apgr = routing_metrics(values[pick], weak[pick], strong[pick])["apgr"]
                    out[name][d] = min(out[name][d], apgr - base, apgr - chance)
    return out


def select_worst_family(
    worst: Mapping[str, Mapping[str, Any]],
    draws: Mapping[str, np.ndarray],
    tie_break: Mapping[str, float],
    level: float = 0.95,
) -> dict[str, Any]:
    """Model selection on the worst family, with its noise: the leader has the largest point
    ``margin`` (``worst[name]``, from :func:`worst_family`); a candidate whose paired interval of
    ``leader margin - its margin`` (from :func:`paired_worst_margins`) reaches 0 is tied with it.
    The tied candidate with the largest ``tie_break`` value wins (the first listed on equal values).

    A worst family is often a small one with a small gap, whose APGR interval is half a unit wide;
    ranking candidates by its point estimate alone picks noise.
    """
    leader = max(worst, key=lambda n: worst[n]["margin"])
    tail = (1.0 - level) / 2.0 * 100.0
    difference: dict[str, list[float]] = {}
    tied = []
    for name in worst:
        if name == leader:
            tied.append(name)
            continue
        diff = draws[leader] - draws[name]
        diff = diff[np.isfinite(diff)]
        lo, hi = np.percentile(diff, [tail, 100.0 - tail])
        difference[name] = [round(float(lo), 4), round(float(hi), 4)]
        if lo <= 0.0:
            tied.append(name)
    best = max(tied, key=lambda n: tie_break[n])
    return {
        "worst_family": dict(worst),
        "leader": leader,
        "leader_minus_ci95": difference,
        "tied_with_leader": tied,
        "tie_break": dict(tie_break),
        "selected": best,
    }


def lofo_values(
    rows: Sequence[OutcomeRow],
    fit_without: Callable[[str], Callable[[Sequence[str]], np.ndarray]],
) -> np.ndarray:
    """Leave-one-family-out scores: each family's rows scored by ``fit_without(family)``.

    ``fit_without(family)`` trains the recipe under test on its training data minus every row of
    that family and returns a scorer (prompts -> values).
    """
    values = np.zeros(len(rows), dtype=np.float64)
    for family in sorted({r["family"] for r in rows}):
        idx = [i for i, r in enumerate(rows) if r["family"] == family]
        scorer = fit_without(family)
        values[idx] = scorer([rows[i]["prompt"] for i in idx])
    return values


def oracle_prior_length(rows: Sequence[OutcomeRow]) -> np.ndarray:
    """The mixed-family reference (issue 56): each family's mean gap (strong - weak) as its prior,
    prompt length's rank inside the family below it. Not a router (it reads the outcomes), the
    ceiling that a category prior plus within-family length can reach on pooled families."""
    family = np.array([r["family"] for r in rows])
    gain = np.array([r["strong"] - r["weak"] for r in rows], dtype=np.float64)
    length = prompt_length(rows)
    out = np.zeros(len(rows), dtype=np.float64)
    for fam in sorted(set(family.tolist())):
        idx = np.flatnonzero(family == fam)
        rank = np.argsort(np.argsort(length[idx], kind="stable"), kind="stable")
        out[idx] = 2.0 * gain[idx].mean() + rank / (2.0 * len(idx))  # rank in [0, 0.5): gaps order first
    return out


def mixed_family(table: Mapping[str, Any], router: str) -> dict[str, Any]:
    """The mixed-family check: on every family pooled (``table["all"]``, from :func:`family_table`
    with the oracle of :func:`oracle_prior_length` among its routers, named ``ORACLE``), the router
    against prompt length, random and the oracle. ``margin`` = router APGR - max(length, random)."""
    entry = table.get("all")
    if not entry or not entry.get("judged") or router not in entry:
        return {}
    apgr = entry[router]["apgr"]
    out: dict[str, Any] = {
        "n": entry["n"],
        "apgr": apgr,
        "ci95": entry[router].get("ci95"),
        "length": entry[LENGTH]["apgr"],
        "random": entry[RANDOM]["apgr"],
        "margin": round(apgr - max(entry[LENGTH]["apgr"], entry[RANDOM]["apgr"]), 4),
    }
    if ORACLE in entry:
        out["oracle"] = entry[ORACLE]["apgr"]
    return out


def selection_margin(tables: Mapping[str, Mapping[str, Any]], router: str) -> dict[str, Any]:
    """What selection ranks (issue 56): the worst of the mixed-family margins (pooled sets) and the
    worst within-family margin (:func:`worst_family`) over every set, not either one alone."""
    parts: list[dict[str, Any]] = []
    for name, table in tables.items():
        mixed = mixed_family(table, router)
        if mixed:
            parts.append({"set": name, "check": "mixed", "margin": mixed["margin"]})
        worst = worst_family(table, router)
        if worst:
            parts.append({"set": name, "check": f"within {worst['family']}", "margin": worst["margin"]})
    if not parts:
        return {}
    return {**min(parts, key=lambda p: p["margin"]), "checks": parts}
