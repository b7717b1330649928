"""Complexity classifier: single-prompt latency and per-class accuracy of the shipped artifact.

    python -m benchmarks.classifier [--repeat N]

Latency is the wall time of one ``ComplexityClassifier.score()`` call (cleaning, normalization and
the ONNX run; one intra-op thread), after a warm-up, for two prompt sets: ~200-word prompts (the
acceptance target: p50 <= 0.5 ms, p99 <= 1 ms) and the held-out prompts as they are. Batched
scoring is measured too, as a reference. Accuracy per class comes from the held-out split.
Writes benchmarks/results/classifier.json and classifier.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from classifier import ComplexityClassifier
from classifier.data import HELDOUT_PATH, LABELS, load_jsonl
from classifier.validation.evaluate import classification_metrics

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_P50_MS, TARGET_P99_MS = 0.5, 1.0
ROUTING_TARGET_P99_MS = 0.5
WORDS = 200


def long_prompts(prompts: Sequence[str], n: int = 50, words: int = WORDS) -> list[str]:
    """``n`` distinct ~``words``-word prompts, each a run of consecutive held-out prompts."""
    out: list[str] = []
    buffer: list[str] = []
    for prompt in prompts:
        buffer += prompt.split()
        if len(buffer) >= words:
            out.append(" ".join(buffer[:words]))
            buffer = []
            if len(out) == n:
                break
    return out


def latencies_ms(
    clf: ComplexityClassifier, prompts: Sequence[str], repeat: int
) -> tuple[np.ndarray, np.ndarray]:
    """Wall time and this thread's CPU time of each call, in ms.

    The targets are on wall time. CPU time leaves out the time the thread sat descheduled, so
    on a CPU shared with other jobs it shows what the scoring itself costs.
    """
    for prompt in prompts[:50]:
        clf.score(prompt)  # warm-up: first runs allocate
    wall, cpu = [], []
    for _ in range(repeat):
        for prompt in prompts:
            start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
            clf.score(prompt)
            cpu.append(time.thread_time_ns() - start_cpu)
            wall.append(time.perf_counter_ns() - start)
    return np.asarray(wall, dtype=np.float64) / 1e6, np.asarray(cpu, dtype=np.float64) / 1e6


def summary(ms: np.ndarray) -> dict[str, float]:
    return {
        "n": int(ms.size),
        "mean_ms": float(ms.mean()),
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
    }


def per_class(truth: Sequence[str], predicted: Sequence[str]) -> dict[str, dict[str, float]]:
    out = {}
    for label in LABELS:
        tp = sum(t == p == label for t, p in zip(truth, predicted, strict=True))
        support, guessed = truth.count(label), predicted.count(label)
        precision = tp / guessed if guessed else 0.0
        recall = tp / support if support else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        out[label] = {"precision": precision, "recall": recall, "f1": f1, "support": support}
    return out


def plot(
    path: Path, lat: dict[str, np.ndarray], classes: dict[str, dict[str, float]], confusion: Any
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    bins = np.logspace(np.log10(0.03), np.log10(5.0), 80)
    for name, ms in lat.items():
        ax.hist(
            np.clip(ms, bins[0], bins[-1]),
            bins=bins,
            alpha=0.55,
            label=f"{name} (p50 {np.median(ms):.3f} ms)",
        )
    ax.axvline(TARGET_P50_MS, color="k", linestyle="--", linewidth=1, label="p50 target")
    ax.axvline(TARGET_P99_MS, color="r", linestyle="--", linewidth=1, label="p99 target")
    ax.set_xscale("log")
    ax.set_xlabel("score() wall time per prompt (ms, log)")
    ax.set_ylabel("calls")
    ax.set_title("Single-prompt latency")
    ax.legend(fontsize=8)

    ax = axes[1]
    x = np.arange(len(LABELS))
    for i, metric in enumerate(("precision", "recall", "f1")):
        ax.bar(x + (i - 1) * 0.27, [classes[c][metric] for c in LABELS], width=0.27, label=metric)
    ax.set_xticks(x, LABELS)
    ax.set_ylim(0.5, 1.0)
    ax.set_title("Held-out, per class")
    ax.legend(fontsize=8)

    ax = axes[2]
    matrix = np.array([[confusion[t][p] for p in LABELS] for t in LABELS])
    ax.imshow(matrix, cmap="Blues")
    for i in range(len(LABELS)):
        for j in range(len(LABELS)):
            ax.text(j, i, str(matrix[i, j]), ha="center", va="center", color="black")
    ax.set_xticks(x, LABELS)
    ax.set_yticks(x, LABELS)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title("Held-out confusion")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.classifier", description=__doc__)
    parser.add_argument("--repeat", type=int, default=20, help="passes over the ~200-word prompts")
    parser.add_argument(
        "--model",
        help="model directory (default: the complexity model, whose labels this benchmark scores; "
        "the routing score is measured by benchmarks/routing_quality.py)",
    )
    args = parser.parse_args(argv)

    from classifier.inference import COMPLEXITY_DIR

    clf = ComplexityClassifier.load(args.model or COMPLEXITY_DIR)
    rows = load_jsonl(HELDOUT_PATH)
    prompts = [r["prompt"] for r in rows]
    long = long_prompts(prompts)
    routing = ComplexityClassifier.load()
    long_wall, long_cpu = latencies_ms(clf, long, args.repeat)
    held_wall, held_cpu = latencies_ms(clf, prompts, 3)
    route_wall, route_cpu = latencies_ms(routing, long, args.repeat)
    lat = {
        f"~{WORDS}-word prompts": long_wall,
        "held-out prompts": held_wall,
        f"routing score, ~{WORDS} words": route_wall,
    }
    batch = [prompts[i : i + 64] for i in range(0, len(prompts), 64)]
    start = time.perf_counter()
    scores = [s for chunk in batch for s in clf.score_batch(chunk)]
    batch_ms = (time.perf_counter() - start) * 1000 / len(prompts)

    truth = [r["label"] for r in rows]
    predicted = [s.tier for s in scores]
    metrics = classification_metrics(truth, predicted)
    classes = per_class(truth, predicted)
    words = [len(p.split()) for p in long]
    long_summary = summary(long_wall)
    result = {
        "machine": {
            "cpu": _cpu(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "onnxruntime_providers": clf.providers,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "model": {
            "path": str(clf.path),
            "version": clf.version,
            "size_bytes": Path(str(clf.path)).stat().st_size,
        },
        "latency": {
            "long_prompts": {
                "words_min": min(words),
                "words_max": max(words),
                "prompts": len(long),
                **long_summary,
                "cpu": summary(long_cpu),
            },
            "heldout_prompts": {**summary(held_wall), "cpu": summary(held_cpu)},
            "routing_score_long_prompts": {
                "model": str(routing.path),
                "version": routing.version,
                **summary(route_wall),
                "cpu": summary(route_cpu),
                "target_p99_ms": ROUTING_TARGET_P99_MS,
                "meets_target": summary(route_wall)["p99_ms"] <= ROUTING_TARGET_P99_MS,
            },
            "load_average_1_5_15": list(os.getloadavg()),
            "batched_64_ms_per_prompt": batch_ms,
            "targets_ms": {"p50": TARGET_P50_MS, "p99": TARGET_P99_MS},
            "meets_targets": long_summary["p50_ms"] <= TARGET_P50_MS
            and long_summary["p99_ms"] <= TARGET_P99_MS,
        },
        "heldout": {**metrics, "per_class": classes},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "classifier.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(RESULTS / "classifier.png", lat, classes, metrics["confusion"])
    print(json.dumps({"latency": result["latency"], "accuracy": metrics["accuracy"]}, indent=2))
    return 0


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
