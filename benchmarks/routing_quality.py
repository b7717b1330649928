"""Routing quality: RouteLLM's APGR / CPT of the shipped score against prompt length and random.

    python -m benchmarks.routing_quality [--outcomes ../shared/data/routing/mmlu_outcomes.jsonl.gz]

On MMLU outcomes (Mixtral-8x7B-Instruct vs GPT-4-1106, from RouteLLM), for the routers:

* ``value``: the shipped outcome-trained score (``ComplexityClassifier.load().score().value``);
* ``complexity value``: the earlier complexity-taxonomy model (classifier/artifacts/complexity);
* ``prompt length``: characters, longest to the strong model first;
* ``random``: the mean over 50 random routers.

Two evaluations, both on subjects the model under test never saw:

1. **held-out subjects**: the 14 subjects (by hash) that the shipped artifact was trained without;
2. **subject-grouped 5-fold cross-validation**: every subject scored by a model retrained (same
   configuration, same proxy corpus) without it, pooled into one ranking: a wider, noisier
   check that the held-out figure is not luck of the draw.

Plus the classifier's latency on a 200-word prompt. Writes benchmarks/results/routing_quality.json
and routing_quality.png (PGR curves on the held-out subjects).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import plot_path, write_json
from classifier import ComplexityClassifier
from classifier.inference import COMPLEXITY_DIR
from classifier.outcome_train import (
    DROPPED_SUBJECTS,
    OUTCOME_CONFIG,
    PROXY_PATH,
    fit_outcomes,
    outcome_proba,
)
from classifier.outcomes import heldout_subjects, load_outcomes, plot_curves, random_apgr, routing_metrics
from classifier.selection import LATENCY_PROMPT

DEFAULT_OUTCOMES = Path(__file__).resolve().parents[2] / "shared/data/routing/mmlu_outcomes.jsonl.gz"
FOLDS = 5


def _summary(m: dict[str, Any]) -> dict[str, Any]:
    return {k: round(float(m[k]), 4) for k in ("apgr", "cpt_50", "cpt_80")}


def _routers(rows: list[dict[str, Any]], value: list[float], complexity: list[float]) -> dict[str, Any]:
    weak, strong = [r["weak"] for r in rows], [r["strong"] for r in rows]
    out = {
        "value": routing_metrics(value, weak, strong),
        "complexity value": routing_metrics(complexity, weak, strong),
        "prompt length": routing_metrics([len(r["prompt"]) for r in rows], weak, strong),
    }
    return out


def grouped_cv(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled out-of-fold APGR: folds of whole subjects, each scored by a model trained without them."""
    from sklearn.model_selection import GroupKFold

    proxy = load_outcomes(PROXY_PATH)
    subjects = np.array([r["subject"] for r in rows])
    oof = np.zeros(len(rows))
    for train_idx, test_idx in GroupKFold(n_splits=FOLDS).split(rows, groups=subjects):
        train = [rows[i] for i in train_idx] + proxy
        weights = [1.0] * len(train_idx) + [OUTCOME_CONFIG.proxy_weight] * len(proxy)
        pipeline = fit_outcomes(train, OUTCOME_CONFIG, weights)
        oof[test_idx] = outcome_proba(pipeline, [rows[i]["prompt"] for i in test_idx])
    weak, strong = [r["weak"] for r in rows], [r["strong"] for r in rows]
    return {
        "n": len(rows),
        "folds": FOLDS,
        "value": _summary(routing_metrics(oof, weak, strong)),
        "prompt length": _summary(routing_metrics([len(r["prompt"]) for r in rows], weak, strong)),
        "random": {"apgr": round(random_apgr(weak, strong), 4)},
    }


def latency(clf: ComplexityClassifier, runs: int = 2000) -> dict[str, float]:
    prompt = LATENCY_PROMPT + " Thank you!"
    for _ in range(200):
        clf.score(prompt)
    times = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        clf.score(prompt)
        times.append(time.perf_counter_ns() - start)
    ms = np.asarray(times) / 1e6
    return {
        "words": len(prompt.split()),
        "p50_ms": round(float(np.percentile(ms, 50)), 4),
        "p99_ms": round(float(np.percentile(ms, 99)), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing_quality", description=__doc__)
    parser.add_argument("--outcomes", default=str(DEFAULT_OUTCOMES))
    parser.add_argument("--no-cv", action="store_true", help="skip the cross-validation (a few seconds)")
    parser.add_argument(
        "--no-latency",
        action="store_true",
        help="skip the latency run (for a machine busy with other timing)",
    )
    args = parser.parse_args(argv)

    rows = load_outcomes(args.outcomes)
    held = set(heldout_subjects([r["subject"] for r in rows]))
    test = [r for r in rows if r["subject"] in held]
    clf, old = ComplexityClassifier.load(), ComplexityClassifier.load(COMPLEXITY_DIR)
    prompts = [r["prompt"] for r in test]
    value = [s.value for s in clf.score_batch(prompts)]
    complexity = [s.value for s in old.score_batch(prompts)]
    curves = _routers(test, value, complexity)
    weak, strong = [r["weak"] for r in test], [r["strong"] for r in test]
    per_subject = {}
    for subject in sorted(held):
        idx = [i for i, r in enumerate(test) if r["subject"] == subject]
        w, s = [weak[i] for i in idx], [strong[i] for i in idx]
        if sum(s) == sum(w):
            continue
        per_subject[subject] = {
            "n": len(idx),
            "value": round(routing_metrics([value[i] for i in idx], w, s)["apgr"], 4),
            "prompt length": round(routing_metrics([len(test[i]["prompt"]) for i in idx], w, s)["apgr"], 4),
        }
    result: dict[str, Any] = {
        "outcomes": Path(args.outcomes).name,
        "heldout": {
            "subjects": sorted(held),
            "n": len(test),
            "weak_performance": round(curves["value"]["weak_performance"], 4),
            "strong_performance": round(curves["value"]["strong_performance"], 4),
            **{name: _summary(m) for name, m in curves.items()},
            "random": {"apgr": round(random_apgr(weak, strong), 4)},
            "curves": {name: m["curve"] for name, m in curves.items()},
            "per_subject_apgr": per_subject,
        },
    }
    if not args.no_latency:
        result["latency_200_words"] = latency(clf)
    if not args.no_cv:
        kept = [r for r in rows if r["subject"] not in DROPPED_SUBJECTS]
        result["grouped_cv"] = grouped_cv(kept)
    plot_curves(
        curves, plot_path("routing_quality"), f"MMLU, {len(held)} held-out subjects ({len(test)} prompts)"
    )
    path = write_json("routing_quality", result)
    table = [("held-out subjects", result["heldout"])]
    if "grouped_cv" in result:
        table.append(("grouped 5-fold CV", result["grouped_cv"]))
    print("| evaluation | value | prompt length | random |")
    print("|---|---|---|---|")
    for name, r in table:
        print(f"| {name} | {r['value']['apgr']} | {r['prompt length']['apgr']} | {r['random']['apgr']} |")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
