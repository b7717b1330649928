"""Accuracy, confusion and single-prompt latency of a model on a labeled JSONL file.

``confusion`` is a nested dict ``confusion[true_label][predicted_label] -> count`` over the labels
small, medium, large (in that order). ``severe_error_rate`` counts small<->large confusions over
``n``. Latency is the wall time of one ``score()`` call per prompt (cleaning, normalization and the
ONNX run), measured after a warm-up, in milliseconds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from classifier.data import LABELS, load_jsonl

__all__ = [
    "classification_metrics",
    "evaluate",
    "evaluate_outcomes",
    "format_families",
    "format_report",
]

WARMUP_CALLS = 50


def classification_metrics(
    truth: Sequence[str], predicted: Sequence[str], labels: Sequence[str] = LABELS
) -> dict[str, Any]:
    """``n``, ``accuracy``, ``macro_f1``, ``confusion`` and ``severe_error_rate`` (no latency)."""
    if len(truth) != len(predicted):
        raise ValueError("truth and predictions differ in length")
    n = len(truth)
    confusion = {t: {p: 0 for p in labels} for t in labels}
    for t, p in zip(truth, predicted, strict=True):
        confusion[t][p] += 1
    correct = sum(confusion[label][label] for label in labels)
    f1s = []
    for label in labels:
        tp = confusion[label][label]
        support = sum(confusion[label].values())
        predicted_n = sum(confusion[t][label] for t in labels)
        if support == 0 and predicted_n == 0:
            continue  # a class absent from both sides does not count (as in scikit-learn)
        f1s.append(2 * tp / (support + predicted_n))
    severe = 0
    if "small" in labels and "large" in labels:
        severe = confusion["small"]["large"] + confusion["large"]["small"]
    return {
        "n": n,
        "accuracy": correct / n if n else 0.0,
        "macro_f1": float(np.mean(f1s)) if f1s else 0.0,
        "confusion": confusion,
        "severe_error_rate": severe / n if n else 0.0,
    }


def evaluate(data_path: str | Path, model_path: str | Path | None = None) -> dict[str, Any]:
    """Score every labeled prompt one at a time; the DESIGN.md metrics dict."""
    from classifier.inference import ComplexityClassifier

    rows = load_jsonl(data_path)
    missing = [i for i, r in enumerate(rows) if r.get("label") is None]
    if missing:
        raise ValueError(f"{data_path}: {len(missing)} rows have no label (first: line {missing[0] + 1})")
    clf = ComplexityClassifier.load(model_path)
    prompts = [r["prompt"] for r in rows]
    for i in range(WARMUP_CALLS):
        clf.score(prompts[i % len(prompts)] if prompts else "warm-up")
    predicted: list[str] = []
    times_ns: list[int] = []
    for prompt in prompts:
        start = time.perf_counter_ns()
        result = clf.score(prompt)
        times_ns.append(time.perf_counter_ns() - start)
        predicted.append(result.tier)
    metrics = classification_metrics([r["label"] for r in rows], predicted)
    ms = np.asarray(times_ns, dtype=np.float64) / 1e6
    metrics["p50_ms"] = float(np.percentile(ms, 50)) if len(ms) else 0.0
    metrics["p99_ms"] = float(np.percentile(ms, 99)) if len(ms) else 0.0
    return metrics


def format_report(metrics: dict[str, Any]) -> str:
    """A readable table of an evaluate() dict."""
    lines = [
        f"n                  {metrics['n']}",
        f"accuracy           {metrics['accuracy']:.4f}",
        f"macro_f1           {metrics['macro_f1']:.4f}",
        f"severe_error_rate  {metrics['severe_error_rate']:.4f}   (small<->large / n)",
    ]
    if "p50_ms" in metrics:
        lines.append(f"latency            p50 {metrics['p50_ms']:.3f} ms   p99 {metrics['p99_ms']:.3f} ms")
    confusion = metrics["confusion"]
    labels = list(confusion)
    lines += [
        "",
        "confusion (rows: true, columns: predicted)",
        "".ljust(10) + "".join(p.rjust(9) for p in labels),
    ]
    lines += [t.ljust(10) + "".join(str(confusion[t][p]).rjust(9) for p in labels) for t in labels]
    return "\n".join(lines)


def evaluate_outcomes(
    data_path: str | Path,
    model_path: str | Path | None = None,
    subjects: str = "heldout",
    png: str | Path | None = None,
    latency_prompts: int = 500,
    pair: tuple[str, str] | None = None,
    compare: Sequence[str | Path] = (),
    draws: int = 200,
    lofo: Any = None,
) -> dict[str, Any]:
    """RouteLLM's routing metrics of ``value`` on an outcome file (:mod:`classifier.validation.outcomes`).

    ``subjects``: ``"heldout"`` scores only the subjects that outcome training keeps out (when
    rows carry subjects; every row otherwise), ``"all"`` every row. Baselines on the same rows:
    prompt length in characters and the mean of 50 random routers. ``png`` plots the curves.
    ``pair`` picks the (weak, strong) models of pass-rate files (difficulty_7b).

    ``families``: APGR per task family (and pooled) of this model, of every ``compare`` model
    (e.g. the previous artifact, side by side), of prompt length and random, with ``draws``
    bootstrap intervals, beside the oracle prior + length (:func:`oracle_prior_length`);
    ``worst_family``: where each model does worst against length/random; ``mixed``: the pooled
    families (the prior must order them) against length, random and the oracle; ``selection``:
    the worst of the mixed and the worst within-family margin (what model selection ranks).
    ``lofo``, a ``fit_without(family)`` (:func:`classifier.training.outcome_train.lofo_fitter`: the
    shipped training recipe), refits without each family and scores it: ``lofo.families`` (same
    table) and ``lofo.worst_family``. (Passed in, so evaluation never imports training.)
    """
    from classifier.inference import ComplexityClassifier
    from classifier.validation.families import (
        ORACLE,
        family_table,
        lofo_values,
        mixed_family,
        oracle_prior_length,
        selection_margin,
        worst_family,
    )
    from classifier.validation.outcomes import (
        heldout_subjects,
        load_outcomes,
        plot_curves,
        random_apgr,
        routing_metrics,
    )

    if subjects not in ("heldout", "all"):
        raise ValueError(f"subjects must be 'heldout' or 'all', not {subjects!r}")
    rows = load_outcomes(data_path, pair=pair)
    chosen: list[str] | None = None
    if subjects == "heldout" and any("subject" in r for r in rows):
        chosen = heldout_subjects([r["subject"] for r in rows if "subject" in r])
        keep = set(chosen)
        rows = [r for r in rows if r.get("subject") in keep]
    clf = ComplexityClassifier.load(model_path)
    prompts = [r["prompt"] for r in rows]
    weak, strong = [r["weak"] for r in rows], [r["strong"] for r in rows]
    values = [s.value for s in clf.score_batch(prompts)]
    result = routing_metrics(values, weak, strong)
    length = routing_metrics([len(p) for p in prompts], weak, strong)
    result["subjects"] = chosen if chosen is not None else "all"
    result["baselines"] = {
        "prompt_length": {k: length[k] for k in ("apgr", "cpt_50", "cpt_80")},
        "random": {"apgr": random_apgr(weak, strong)},
    }
    routers: dict[str, Any] = {"value": values}
    for other in compare:
        routers[f"value ({Path(other).name or other})"] = [
            s.value for s in ComplexityClassifier.load(other).score_batch(prompts)
        ]
    models = list(routers)
    routers[ORACLE] = oracle_prior_length(rows)
    result["families"] = family_table(rows, routers, draws)
    result["worst_family"] = {name: worst_family(result["families"], name) for name in models}
    result["mixed"] = {name: mixed_family(result["families"], name) for name in models}
    result["selection"] = {name: selection_margin({"this": result["families"]}, name) for name in models}
    if lofo is not None:
        held_out = lofo_values(rows, lofo)
        # No pooled row: each family is scored by another refit; their scores share no scale.
        table = family_table(rows, {"value": held_out}, draws, pooled=False)
        result["lofo"] = {"families": table, "worst_family": worst_family(table, "value")}
    sample = prompts[:latency_prompts]
    for i in range(WARMUP_CALLS):
        clf.score(sample[i % len(sample)])
    times_ns = []
    for prompt in sample:
        start = time.perf_counter_ns()
        clf.score(prompt)
        times_ns.append(time.perf_counter_ns() - start)
    ms = np.asarray(times_ns, dtype=np.float64) / 1e6
    result["p50_ms"], result["p99_ms"] = float(np.percentile(ms, 50)), float(np.percentile(ms, 99))
    if png is not None:
        plot_curves(
            {"value": result, "prompt length": length}, png, f"{Path(data_path).name}: {len(rows)} prompts"
        )
        result["png"] = str(png)
    return result


def format_families(table: dict[str, Any]) -> str:
    """One line per family: APGR [95 % interval] of every router in the table."""
    lines = []
    for family, entry in table.items():
        if not entry.get("judged"):
            lines.append(f"  {family:<22} n {entry['n']:>5}  gap {entry['gap']:+.3f}  (no gap: not judged)")
            continue
        cells = []
        for name, block in entry.items():
            if isinstance(block, dict) and "apgr" in block:
                ci = block.get("ci95")
                cells.append(f"{name} {block['apgr']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""))
        lines.append(f"  {family:<22} n {entry['n']:>5}  gap {entry['gap']:+.3f}  " + "  ".join(cells))
    return "\n".join(lines)
