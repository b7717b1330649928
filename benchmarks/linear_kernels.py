"""The linear kernels a tier's step is made of, side by side at the batch sizes a step has.

SmolLM2-135M's projection shapes (fused QKV, fused gate/up, down, and the 49k-row output head),
each timed as the tiers run them: ``Int4WeightOnlyLinear`` (the small and medium tiers; the packed
CPU kernel), ``Int8WeightOnlyLinear`` (medium's head), ``OneDnnLinear`` (the large tier's fp32),
and a plain bf16 ``F.linear`` over the same weights for comparison (on CPUs with AMX oneDNN runs it
on the tile units). Rows: 1 (one stream decoding), 16 (a full batch decoding) and 80 (a batch with a
prompt chunk). The question it answers: which kernel is cheapest at which batch, not whether a
step is fast.

    python -m benchmarks.linear_kernels [--repeats 100]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import plot_path, write_json
from tiers.quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear, OneDnnLinear

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
ROWS = (1, 16, 80)


def _time_us(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(max(3, repeats // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def run(repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for name, (out_f, in_f) in SHAPES.items():
            linear = torch.nn.Linear(in_f, out_f, bias=False)
            kernels = {
                "int4_g64": Int4WeightOnlyLinear(linear, 64),
                "int8": Int8WeightOnlyLinear(linear),
                "fp32_onednn": OneDnnLinear(linear),
            }
            dense_bf16 = linear.weight.detach().to(torch.bfloat16)
            rows_out: dict[str, dict[str, float]] = {}
            for rows in ROWS:
                x = torch.randn(rows, in_f)
                xb = x.to(torch.bfloat16)
                timings = {
                    k: round(_time_us(lambda m=m, v=(x if k == "fp32_onednn" else xb): m(v), repeats), 1)
                    for k, m in kernels.items()
                }
                timings["bf16_dense"] = round(_time_us(lambda v=xb, w=dense_bf16: F.linear(v, w), repeats), 1)
                rows_out[str(rows)] = timings
                print(name, rows, timings, flush=True)
            out[name] = rows_out
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    results = run(args.repeats)
    flags = ""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        pass
    write_json(
        "linear_kernels",
        {
            "unit": "microseconds per call",
            "shapes": {k: list(v) for k, v in SHAPES.items()},
            "amx": "amx_bf16" in flags,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "results": results,
        },
    )
    _plot(results)


def _plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.6))
    for ax, (name, by_rows) in zip(axes, results.items(), strict=True):
        kernels = list(next(iter(by_rows.values())))
        for k in kernels:
            ax.plot([int(r) for r in by_rows], [by_rows[r][k] for r in by_rows], marker="o", label=k)
        ax.set_title(name)
        ax.set_xlabel("rows")
        ax.set_yscale("log")
    axes[0].set_ylabel("µs per call")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plot_path("linear_kernels"), dpi=110)


if __name__ == "__main__":
    main()
