"""Model selection: measure candidate configurations on a validation split carved from train.jsonl.

``python -m classifier.training.selection [--seed N] [--only NAME ...]`` prints one JSON line per candidate
and a Markdown table (the one in classifier/README.md). The held-out split is never touched here.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from classifier.data import LABELS, TRAIN_PATH, load_jsonl, stable_split
from classifier.validation.evaluate import classification_metrics

__all__ = ["compare", "markdown_table", "measure_candidate", "validation_metrics", "validation_rows"]

# ~200 words with code, numbers and constraints: the latency probe of the acceptance targets.
LATENCY_PROMPT = (
    "I run a small online bakery and need help planning next quarter. We sell bread, cakes and "
    "seasonal pastries through our website and two farmers markets. Revenue last quarter was "
    "$48,000 with a 31% gross margin, but delivery costs rose 12% and two staff members are "
    "leaving in March. Please write a plan that covers pricing changes, a hiring timeline, a "
    "delivery-zone redesign and a marketing calendar for Easter and Mother's Day. Each section "
    "must include concrete numbers, owners and deadlines, and the whole plan should fit on two "
    "pages. Also add a short Python function `forecast(sales: list[float]) -> float` that "
    "projects next month's revenue with a 3-month moving average, and explain any assumptions "
    "you make about seasonality. Finally, compare two options for the delivery redesign: "
    "partnering with a courier service or hiring a part-time driver, with a table of costs, "
    "risks and benefits for each option over six months. Keep the tone practical and avoid "
    "jargon, since I will share this with my business partner who is not a finance person. If "
    "anything in my numbers looks inconsistent, point it out before you start and tell me which "
    "figures you would need to make the forecast more reliable."
)


def _latency_ms(model: Any, prompt: str = LATENCY_PROMPT, runs: int = 1000) -> tuple[float, float]:
    """p50/p99 of one single-prompt run through the inference class (cleaning included)."""
    import onnxruntime as ort

    from classifier.inference import ComplexityClassifier

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    labels = json.loads({p.key: p.value for p in model.metadata_props}["labels"])
    clf = ComplexityClassifier(session, {"labels": labels})
    for _ in range(100):
        clf.score(prompt)
    times = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        clf.score(prompt)
        times.append(time.perf_counter_ns() - start)
    ms = np.asarray(times) / 1e6
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def measure_candidate(
    config: Any, fit_rows: Sequence[dict[str, Any]], val_rows: Sequence[dict[str, Any]], seed: int = 0
) -> dict[str, Any]:
    """Validation metrics, ONNX size and latency of one candidate configuration."""
    from classifier.training.train import export_onnx, fit, predict_proba

    start = time.perf_counter()
    pipeline = fit([r["prompt"] for r in fit_rows], [r["label"] for r in fit_rows], config, seed)
    fit_s = time.perf_counter() - start
    probs = predict_proba(pipeline, [r["prompt"] for r in val_rows])
    metrics = validation_metrics([r["label"] for r in val_rows], probs)
    model = export_onnx(pipeline, {"labels": json.dumps([str(c) for c in pipeline.classes_])})
    p50, p99 = _latency_ms(model)
    return {
        "name": config.name,
        "accuracy": round(metrics["accuracy"], 4),
        "macro_f1": round(metrics["macro_f1"], 4),
        "severe_error_rate": round(metrics["severe_error_rate"], 4),
        "log_loss": round(metrics["log_loss"], 4),
        "ece": round(metrics["ece"], 4),
        "onnx_kb": round(len(model.SerializeToString()) / 1024),
        "p50_ms": round(p50, 3),
        "p99_ms": round(p99, 3),
        "fit_s": round(fit_s, 1),
        "n_fit": len(fit_rows),
        "n_val": len(val_rows),
    }


def validation_metrics(truth: Sequence[str], probs: np.ndarray) -> dict[str, Any]:
    """Classification metrics plus log loss and expected calibration error (10 bins, top class)."""
    predicted = [LABELS[i] for i in probs.argmax(axis=1)]
    metrics = classification_metrics(truth, predicted)
    idx = np.array([LABELS.index(t) for t in truth])
    metrics["log_loss"] = float(-np.log(np.clip(probs[np.arange(len(idx)), idx], 1e-12, 1)).mean())
    conf, hit = probs.max(axis=1), probs.argmax(axis=1) == idx
    bins = np.minimum((conf * 10).astype(int), 9)
    metrics["ece"] = float(
        sum(
            abs(hit[bins == b].mean() - conf[bins == b].mean()) * (bins == b).mean()
            for b in range(10)
            if (bins == b).any()
        )
    )
    return metrics


def validation_rows(data_path: str | Path = TRAIN_PATH) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(fit_rows, val_rows)``: 20 % of train.jsonl, hash-stratified by part and label."""
    rows = [r for r in load_jsonl(data_path) if r.get("label") is not None]
    strata = ("part", "label") if all("part" in r for r in rows) else ("label",)
    return stable_split(rows, 0.2, salt="validation", strata=strata)


def compare(
    data_path: str | Path = TRAIN_PATH, seed: int = 0, configs: Sequence[Any] | None = None
) -> Iterator[dict[str, Any]]:
    """Fit each candidate on train minus the validation split and measure it there (lazily)."""
    from classifier.training.train import CANDIDATES

    fit_rows, val_rows = validation_rows(data_path)
    for config in configs or list(CANDIDATES.values()):
        yield measure_candidate(config, fit_rows, val_rows, seed)


def markdown_table(results: Sequence[dict[str, Any]]) -> str:
    cols = [
        "name",
        "accuracy",
        "macro_f1",
        "severe_error_rate",
        "log_loss",
        "ece",
        "onnx_kb",
        "p50_ms",
        "p99_ms",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in results]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from classifier.training.train import CANDIDATES

    parser = argparse.ArgumentParser(prog="python -m classifier.training.selection", description=__doc__)
    parser.add_argument("--data", default=str(TRAIN_PATH))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only", nargs="*", choices=sorted(CANDIDATES), help="candidates to run (default: all)"
    )
    args = parser.parse_args(argv)
    configs = [CANDIDATES[n] for n in args.only] if args.only else None
    results = []
    for result in compare(args.data, args.seed, configs):
        print(json.dumps(result), flush=True)
        results.append(result)
    print(markdown_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
