"""Outcome data and RouteLLM's routing metrics (APGR, CPT), in plain Python + numpy.

An *outcome row* says how well the cheap and the strong tier answered one prompt. Accepted JSONL
lines (``.jsonl`` or ``.jsonl.gz``):

* ``{"prompt": ..., "weak": 0|1|score, "strong": 0|1|score}`` (RouteLLM's and our MMLU file's
  shape; booleans count as 0/1);
* ``{"prompt": ..., "outcomes": {"small": s, "large": s, ...}}``: per-tier scores, as the shadow
  log and ``POST /v1/feedback`` write them; the cheapest tier present is "weak", the strongest
  "strong". Rows naming a single tier carry no comparison and are skipped;
* ``{"prompt": ..., "source": ..., "scores": {model: pass rate}}`` (``difficulty_7b``: several
  models' pass rates): read with ``pair=(weak model, strong model)``;
* optional ``subject`` (used for subject-held-out splits) and ``contaminated`` (dropped, as
  RouteLLM's own evaluation drops them).

Every row gets a ``family`` (its task family, for per-family and leave-one-family-out
validation, :mod:`classifier.validation.families`): the row's own ``family``, else its ``source`` (with the
two HumanEval splits as one ``python`` family), else the MMLU category of its ``subject`` (STEM,
humanities, social sciences, other, as Hendrycks et al. group them), else its ``subject``.

Routing metrics follow RouteLLM (Ong et al., 2024, "RouteLLM: Learning to Route LLMs with
Preference Data"): a router sends the prompts with the highest scores to the strong model. At a
share ``c`` of strong calls, performance is the mean of the chosen model's outcome, and

    PGR(c) = (perf(c) - perf_weak) / (perf_strong - perf_weak)

APGR is the area under PGR(c) for c in [0, 1] (a random router scores 0.5 in expectation).
RouteLLM samples the curve at 10 % steps; this module integrates the exact curve through every
operating point (the trapezoid over all n + 1 cut points), so small benchmarks are not at the
mercy of where 10 % falls. Tied scores are treated as one step (the expected result of breaking
the tie at random), so a router cannot gain from the order rows happen to be in.
CPT(x) is the smallest share of strong calls at which PGR reaches x.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "MMLU_CATEGORIES",
    "OutcomeRow",
    "family_of",
    "heldout_subjects",
    "load_outcomes",
    "merge_by_id",
    "parse_outcome",
    "plot_curves",
    "random_apgr",
    "routing_curve",
    "routing_metrics",
    "split_by_subject",
]

OutcomeRow = dict[str, Any]
TIER_ORDER = ("small", "medium", "large")
# Share of subjects held out for evaluation: whole subjects, chosen by hash (no cherry-picking).
HELDOUT_SUBJECT_FRACTION = 0.25
SUBJECT_SALT = "routing-heldout-v1"


# Hendrycks et al.'s grouping of the 57 MMLU subjects (their categories.py), as task families.
_MMLU_GROUPS = {
    "stem": "abstract_algebra astronomy college_biology college_chemistry college_computer_science "
    "college_mathematics college_physics computer_security conceptual_physics electrical_engineering "
    "elementary_mathematics high_school_biology high_school_chemistry high_school_computer_science "
    "high_school_mathematics high_school_physics high_school_statistics machine_learning",
    "humanities": "formal_logic high_school_european_history high_school_us_history "
    "high_school_world_history international_law jurisprudence logical_fallacies moral_disputes "
    "moral_scenarios philosophy prehistory professional_law world_religions",
    "social_sciences": "econometrics high_school_geography high_school_government_and_politics "
    "high_school_macroeconomics high_school_microeconomics high_school_psychology human_sexuality "
    "professional_psychology public_relations security_studies sociology us_foreign_policy",
    "other": "anatomy business_ethics clinical_knowledge college_medicine global_facts human_aging "
    "management marketing medical_genetics miscellaneous nutrition professional_accounting "
    "professional_medicine virology",
}
MMLU_CATEGORIES: dict[str, str] = {
    subject: f"mmlu_{group}" for group, names in _MMLU_GROUPS.items() for subject in names.split()
}
# difficulty_7b sources -> task families (HumanEval's train and test splits are one task).
SOURCE_FAMILIES = {
    "gsm8k-train": "gsm8k",
    "MATH_prealgebra": "math_prealgebra",
    "humaneval_train": "python",
    "humaneval_test": "python",
    "javascript": "javascript",
}


def family_of(row: Mapping[str, Any]) -> str:
    """The task family of a raw or parsed row (see the module docstring); "all" when nothing says."""
    for key in ("family", "source"):
        value = row.get(key)
        if isinstance(value, str) and value:
            return SOURCE_FAMILIES.get(value, value) if key == "source" else value
    subject = row.get("subject")
    if isinstance(subject, str) and subject:
        return MMLU_CATEGORIES.get(subject, subject)
    return "all"


def _score(value: Any, where: str) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and np.isfinite(value):
        return float(value)
    raise ValueError(f"{where}: outcome {value!r} is not a number or boolean")


def parse_outcome(
    row: Mapping[str, Any], where: str = "row", pair: tuple[str, str] | None = None
) -> OutcomeRow | None:
    """One normalized row ``{"prompt", "weak", "strong", "family", "subject"?}``, or None when it
    has no pair. ``pair`` names the (weak, strong) models of rows that carry ``scores``."""
    prompt = row.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: expected a string 'prompt'")
    if "scores" in row and "weak" not in row:
        scores = row["scores"]
        if pair is None:
            raise ValueError(f"{where}: rows with per-model 'scores' need a (weak, strong) model pair")
        if not isinstance(scores, Mapping) or any(m not in scores for m in pair):
            models = sorted(scores) if isinstance(scores, Mapping) else []
            raise ValueError(f"{where}: no scores for {list(pair)} (models: {models})")
        weak, strong = _score(scores[pair[0]], where), _score(scores[pair[1]], where)
    elif "outcomes" in row:
        outcomes = row["outcomes"]
        if not isinstance(outcomes, Mapping):
            raise ValueError(f"{where}: 'outcomes' must map tier names to scores")
        known = {k: v for k, v in outcomes.items() if v is not None}
        ranked = sorted(known, key=lambda t: (TIER_ORDER.index(t) if t in TIER_ORDER else -1, t))
        unknown = [t for t in ranked if t not in TIER_ORDER]
        if unknown:
            raise ValueError(f"{where}: unknown tier(s) {unknown} in 'outcomes' (use {TIER_ORDER})")
        if len(ranked) < 2:
            return None
        weak, strong = _score(known[ranked[0]], where), _score(known[ranked[-1]], where)
    elif "weak" in row and "strong" in row:
        weak, strong = _score(row["weak"], where), _score(row["strong"], where)
    else:
        raise ValueError(f"{where}: expected 'weak' and 'strong', or 'outcomes'")
    out: OutcomeRow = {"prompt": prompt, "weak": weak, "strong": strong, "family": family_of(row)}
    if isinstance(row.get("subject"), str):
        out["subject"] = row["subject"]
    return out


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return path.open(encoding="utf-8")


def _raw_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    out = []
    with _open_text(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            raw = json.loads(line)
            if not isinstance(raw, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            out.append((f"{path}:{lineno}", raw))
    return out


def merge_by_id(rows: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """Join the rows that share an ``id`` and carry ``outcomes`` (shadow and feedback logs).

    A shadow line judged for its shadow tier and a feedback line for the served tier become one
    row with both tiers' outcomes (a later line wins for a tier both name); the prompt comes
    from whichever line has one. Other rows pass through unchanged, in order.
    """
    merged: dict[str, dict[str, Any]] = {}
    order: list[tuple[str, dict[str, Any]] | str] = []
    for where, raw in rows:
        rid = raw.get("id")
        if not isinstance(rid, str) or not isinstance(raw.get("outcomes"), Mapping):
            order.append((where, raw))
            continue
        if rid not in merged:
            merged[rid] = {"id": rid, "outcomes": {}, "_where": where}
            order.append(rid)
        target = merged[rid]
        target["outcomes"].update({k: v for k, v in raw["outcomes"].items() if v is not None})
        if isinstance(raw.get("prompt"), str) and "prompt" not in target:
            target["prompt"] = raw["prompt"]
    out: list[tuple[str, dict[str, Any]]] = []
    for item in order:
        if isinstance(item, str):
            row = merged[item]
            if "prompt" in row:  # a line logged without content cannot train
                out.append((row.pop("_where"), row))
        else:
            out.append(item)
    return out


def load_outcomes(
    path: str | Path | Sequence[str | Path],
    keep_contaminated: bool = False,
    pair: tuple[str, str] | None = None,
) -> list[OutcomeRow]:
    """Read outcome JSONL(.gz) file(s); see the module docstring for the accepted shapes.

    Several files are read as one: shadow and feedback lines about one answer (same ``id``) are
    merged first (:func:`merge_by_id`).
    """
    paths = [Path(path)] if isinstance(path, str | Path) else [Path(p) for p in path]
    raws = merge_by_id([item for p in paths for item in _raw_rows(p)])
    rows: list[OutcomeRow] = []
    for where, raw in raws:
        if raw.get("contaminated") and not keep_contaminated:
            continue
        row = parse_outcome(raw, where, pair)
        if row is not None:
            rows.append(row)
    if not rows:
        raise ValueError(f"{', '.join(map(str, paths))}: no rows with both a weak and a strong outcome")
    return rows


def heldout_subjects(subjects: Iterable[str], fraction: float = HELDOUT_SUBJECT_FRACTION) -> list[str]:
    """The ``round(fraction * k)`` subjects with the smallest salted SHA-256: stable, not chosen."""
    unique = sorted(set(subjects))
    ranked = sorted(unique, key=lambda s: hashlib.sha256(f"{SUBJECT_SALT}\x00{s}".encode()).hexdigest())
    return sorted(ranked[: round(fraction * len(unique))])


def split_by_subject(
    rows: Sequence[OutcomeRow], fraction: float = HELDOUT_SUBJECT_FRACTION
) -> tuple[list[OutcomeRow], list[OutcomeRow]]:
    """``(train, heldout)`` with whole subjects on each side (rows without a subject train)."""
    held = set(heldout_subjects([r["subject"] for r in rows if "subject" in r], fraction))
    train = [r for r in rows if r.get("subject") not in held]
    test = [r for r in rows if r.get("subject") in held]
    return train, test


def routing_curve(scores: ArrayLike, weak: ArrayLike, strong: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """``(strong_share, performance)`` at every cut, from all-weak (0) to all-strong (1).

    Prompts are sent to the strong model from the highest score down; a group of tied scores
    moves in one step, so the points between are its random-tie-break expectation.
    """
    s = np.asarray(scores, dtype=np.float64)
    w = np.asarray(weak, dtype=np.float64)
    g = np.asarray(strong, dtype=np.float64) - w
    n = len(s)
    if n == 0 or not (len(w) == len(g) == n):
        raise ValueError("scores, weak and strong must be non-empty and of one length")
    order = np.argsort(-s, kind="stable")
    s_sorted, gain = s[order], g[order]
    # Indices where a new score value starts, plus the end: the cut points between tie groups.
    starts = np.flatnonzero(np.r_[True, s_sorted[1:] != s_sorted[:-1]])
    cuts = np.r_[starts, n]
    cum = np.r_[0.0, np.cumsum(gain)]
    share = cuts / n
    perf = (w.sum() + cum[cuts]) / n
    return share, perf


def _pgr(perf: np.ndarray, weak_perf: float, strong_perf: float) -> np.ndarray:
    gap = strong_perf - weak_perf
    if abs(gap) < 1e-12:
        raise ValueError("the weak and strong models perform the same here: PGR is undefined")
    return np.asarray((perf - weak_perf) / gap)


def _cpt(share: np.ndarray, pgr: np.ndarray, target: float) -> float:
    """Smallest strong share at which the (piecewise-linear) PGR curve reaches ``target``."""
    above = np.flatnonzero(pgr >= target - 1e-12)
    if len(above) == 0:
        return 1.0
    i = int(above[0])
    if i == 0:
        return float(share[0])
    x0, x1, y0, y1 = share[i - 1], share[i], pgr[i - 1], pgr[i]
    return float(x0 + (target - y0) * (x1 - x0) / (y1 - y0)) if y1 != y0 else float(x1)


def routing_metrics(
    scores: ArrayLike, weak: ArrayLike, strong: ArrayLike, curve_points: int = 21
) -> dict[str, Any]:
    """APGR, CPT(50 %), CPT(80 %), the curve sampled at ``curve_points`` shares, and the baselines."""
    share, perf = routing_curve(scores, weak, strong)
    weak_perf, strong_perf = float(perf[0]), float(perf[-1])
    pgr = _pgr(perf, weak_perf, strong_perf)
    apgr = float(np.sum((share[1:] - share[:-1]) * (pgr[1:] + pgr[:-1]) / 2.0))
    grid = np.linspace(0.0, 1.0, curve_points)
    return {
        "n": int(np.asarray(scores).size),
        "weak_performance": weak_perf,
        "strong_performance": strong_perf,
        "apgr": apgr,
        "cpt_50": _cpt(share, pgr, 0.5),
        "cpt_80": _cpt(share, pgr, 0.8),
        "curve": {
            "strong_share": [round(float(x), 4) for x in grid],
            "pgr": [round(float(y), 4) for y in np.interp(grid, share, pgr)],
        },
    }


def random_apgr(weak: Sequence[float], strong: Sequence[float], seed: int = 0, draws: int = 50) -> float:
    """Mean APGR of ``draws`` random routers (0.5 in expectation; the noise floor of a benchmark)."""
    rng = np.random.default_rng(seed)
    return float(
        np.mean([routing_metrics(rng.random(len(weak)), weak, strong)["apgr"] for _ in range(draws)])
    )


def plot_curves(curves: Mapping[str, Mapping[str, Any]], path: str | Path, title: str) -> None:
    """PGR against the share of strong calls, one line per router (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    for name, m in curves.items():
        ax.plot(
            m["curve"]["strong_share"], m["curve"]["pgr"], marker=".", label=f"{name} (APGR {m['apgr']:.3f})"
        )
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1, label="random (0.5)")
    ax.set_xlabel("share of calls to the strong model")
    ax.set_ylabel("performance gap recovered")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
