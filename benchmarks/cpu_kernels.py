"""The project's CPU kernels against torch's ops, per tier, in one process: each tier of the default
policy built twice on the embedded model - once with ``tiers/kernels/csrc``'s kernels where they apply
(``int4_mm`` from ``TILED_INT4_MIN_ROWS`` rows, ``add_rms_norm``, ``paged_attention``,
``rope_kv_write``, ``f32_linear`` up to ``F32_GEMV_MAX_ROWS`` rows), once with torch's ops only -
and the decode step timed at 1, 4 and 16 sequences over 120 tokens of context,
plus a 20-token prompt chunk after that context, interleaved repetitions, medians. The baseline is
the same model and fast path with the kernels switched off, so the ratio is the kernels' alone.
Also checks the two give the same greedy tokens (argmax) on a 16-row decode step.

Writes benchmarks/results/cpu_kernels.{json,png}; exits 2 where no kernel build applies (torch
dispatches neither AVX512 nor AVX2, or ``make kernels`` was not run).

    flock /tmp/bench.lock python -m benchmarks.cpu_kernels [--repeats 5]
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import interleaved_forward_ms, kernels_missing, plot_path, slots, write_json

TIERS: dict[str, dict[str, Any]] = {
    "small (int4 g64, int4 head)": {"quantization": "int4", "group_size": 64, "int4_head": True},
    "medium (int4 g32)": {"quantization": "int4", "group_size": 32},
    "large (fp32)": {"quantization": "none", "dtype": "float32"},
}
SHAPES = ("1", "4", "16", "prefill 20")
CONTEXT = 120


def _runner(kernels: bool, kw: dict[str, Any]) -> Any:
    from tiers.kernels import cpu as cpu_kernels
    from tiers.models.loading import load_model
    from tiers.worker.model_runner import ModelRunner

    names = ("int4_mm_op", "add_rms_norm_op", "paged_attention_op", "rope_kv_write_op", "f32_linear_op")
    saved = [getattr(cpu_kernels, n) for n in names]
    if not kernels:  # the fast path asks for each op when it is built: None keeps torch's
        for n in names:
            setattr(cpu_kernels, n, lambda: None)
    try:
        return ModelRunner(
            load_model("embedded:smollm2-135m-instruct", **kw), num_blocks=512, max_model_len=512
        )
    finally:
        for n, op in zip(names, saved, strict=True):
            setattr(cpu_kernels, n, op)


def _measure_tier(kw: dict[str, Any], repeats: int) -> dict[str, Any]:
    import torch

    from tiers.worker.model_runner import RowInput

    runners = {"kernels": _runner(True, kw), "torch": _runner(False, kw)}
    tables: dict[str, list[list[int]]] = {}
    for name, r in runners.items():
        tables[name] = slots(r)
        r.forward([RowInput(tables[name][i], 0, list(range(100, 100 + CONTEXT)), "none") for i in range(16)])

    def rows(name: str, shape: str) -> list[Any]:
        if shape == "prefill 20":
            return [RowInput(tables[name][0], CONTEXT, list(range(300, 320)), "last")]
        return [RowInput(tables[name][i], CONTEXT, [5], "last") for i in range(int(shape))]

    med = interleaved_forward_ms(runners, SHAPES, rows, repeats)
    logits = {
        n: r.forward([RowInput(tables[n][i], CONTEXT, [7], "last") for i in range(16)])
        for n, r in runners.items()
    }
    same = all(
        torch.equal(a.argmax(-1), b.argmax(-1))
        for a, b in zip(logits["kernels"], logits["torch"], strict=True)
    )
    return {
        "step_ms": med,
        "speedup": {s: round(med["torch"][s] / med["kernels"][s], 2) for s in SHAPES},
        "greedy_equal": same,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from tiers.kernels import cpu as cpu_kernels
    from tiers.layers.quantization.int4 import TILED_INT4_MIN_ROWS
    from tiers.worker.device import DeviceWorker

    if kernels_missing(cpu_kernels.int4_mm_op()):
        return 2
    worker = DeviceWorker()  # the thread the service's tiers run on
    rows = []
    for tier, kw in TIERS.items():
        row = {"tier": tier, **worker.call(lambda kw=kw: _measure_tier(kw, args.repeats))}
        print(row, flush=True)
        rows.append(row)
    worker.stop()
    data = {
        "isa": cpu_kernels.host_isa(),
        "tiled_int4_min_rows": TILED_INT4_MIN_ROWS,
        "context": CONTEXT,
        "rows": rows,
    }
    write_json("cpu_kernels", data)
    _plot(data)
    return 0


def _plot(data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data["rows"]), figsize=(5 * len(data["rows"]), 4.2), squeeze=False)
    for ax, row in zip(axes[0], data["rows"], strict=True):
        xs = range(len(SHAPES))
        ax.bar([x - 0.2 for x in xs], [row["step_ms"]["torch"][s] for s in SHAPES], 0.4, label="torch's ops")
        ax.bar(
            [x + 0.2 for x in xs],
            [row["step_ms"]["kernels"][s] for s in SHAPES],
            0.4,
            label="tiers/kernels/csrc kernels",
        )
        for x, s in zip(xs, SHAPES, strict=True):
            ax.text(
                x, row["step_ms"]["torch"][s], f"{row['speedup'][s]}x", ha="center", va="bottom", fontsize=8
            )
        ax.set_xticks(list(xs), [f"{s} seq" if s.isdigit() else s for s in SHAPES])
        ax.set_ylabel("ms per step")
        ax.set_title(row["tier"], fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"CPU kernels vs torch's ops ({data['isa']}, {data['context']} tokens of context)")
    fig.tight_layout()
    fig.savefig(plot_path("cpu_kernels"), dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
