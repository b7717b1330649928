"""The linear kernels a tier's step is made of, side by side at the batch sizes a step has.

SmolLM2-135M's projection shapes (fused QKV, fused gate/up, down, and the 49k-row output head),
each timed as the tiers run them: ``Int4WeightOnlyLinear`` (the small and medium tiers: torch's
int4 kernel below ``TILED_INT4_MIN_ROWS`` rows, ``tiered_router::int4_mm`` from there where built)
beside torch's int4 kernel at every row count (``int4_g64_torch``), ``Int8WeightOnlyLinear``
(medium's head), the large tier's fp32 three ways - plain ``F.linear`` (MKL, repacking the weight
on every call), MKL's packed GEMM and oneDNN's packed GEMM over a weight packed once (both timed at
every row count; ``PackedFp32Linear`` uses one of them, by CPU vendor) - and a plain bf16
``F.linear`` over the same weights for comparison (on CPUs with AMX oneDNN runs it on the tile
units). Rows: 1 (one stream decoding), 4 and 8 (a few streams, or one
stream verifying drafts), 16 (a full batch decoding) and 80 (a batch with a prompt chunk).

Two settings: ``hot`` calls one weight over and over (it stays in cache); ``model`` cycles through
30 copies of each per-layer weight, as a 30-layer step does, so each call reads its weight from
memory. Both put dense bf16 ahead of int4 from 5-6 rows on. What they do not show: a whole HF
SmolLM2 forward at 16 rows with every int4/int8 call of 5+ rows switched to a dense bf16 copy
measured no faster (50.9 ms int4 vs 51.9 ms, one run), and the service with that switch served
the peer workload's 16 streams 6.6 % faster (318 vs 298 tok/s) at +630 MB RSS, with c=1 TTFT worse
(oneDNN builds a kernel per new row count: ~1 ms on first use). So the switch is not in the tiers.

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
from tiers.layers.fp32_packed import PackedFp32Linear, fp32_gemm_backend
from tiers.layers.quantization.int4 import Int4WeightOnlyLinear
from tiers.layers.quantization.int8 import Int8WeightOnlyLinear

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
ROWS = (1, 4, 8, 16, 80)


def _time_us(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(max(3, repeats // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


LAYERS = 30
"""Copies of each per-layer weight in the ``model`` setting (SmolLM2-135M has 30 layers)."""

Call = Callable[[torch.Tensor], Any]


def _kernels(out_f: int, in_f: int, copies: int) -> dict[str, list[Call]]:
    kinds = ("int4_g64", "int4_g64_torch", "int8", "fp32_plain", "fp32_mkl_packed", "fp32_onednn_packed")
    made: dict[str, list[Call]] = {k: [] for k in (*kinds, "bf16_dense")}
    for _ in range(copies):
        linear = torch.nn.Linear(in_f, out_f, bias=False)
        q4 = Int4WeightOnlyLinear(linear, 64)
        made["int4_g64"].append(q4)
        made["int4_g64_torch"].append(
            lambda v, q=q4: torch._weight_int4pack_mm_for_cpu(v, q.weight_q, q.group_size, q.scales_and_zeros)
        )
        made["int8"].append(Int8WeightOnlyLinear(linear))
        fp32 = linear.weight.detach()
        made["fp32_plain"].append(lambda v, w=fp32: F.linear(v, w))
        # Both packed kernels at every row count (``PackedFp32Linear`` uses MKL's at 4-16 only).
        mkl = PackedFp32Linear(linear, "mkl")
        made["fp32_mkl_packed"].append(
            lambda v, p=mkl: torch.ops.mkl._mkl_linear(v, p.weight_packed, p.weight, None, v.shape[0])
        )
        made["fp32_onednn_packed"].append(PackedFp32Linear(linear, "onednn"))
        dense = linear.weight.detach().to(torch.bfloat16)
        made["bf16_dense"].append(lambda v, w=dense: F.linear(v, w))
    return made


def run(repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for setting in ("hot", "model"):
            out[setting] = {}
            for name, (out_f, in_f) in SHAPES.items():
                copies = 1 if setting == "hot" or name == "head" else LAYERS
                kernels = _kernels(out_f, in_f, copies)
                rows_out: dict[str, dict[str, float]] = {}
                for rows in ROWS:
                    x = torch.randn(rows, in_f)
                    xb = x.to(torch.bfloat16)
                    timings = {}
                    for k, mods in kernels.items():
                        v = x if k.startswith("fp32") else xb

                        def once(mods: list[Call] = mods, v: torch.Tensor = v) -> None:
                            for m in mods:
                                m(v)

                        calls = max(3, repeats // len(mods))
                        timings[k] = round(_time_us(once, calls) / len(mods), 1)
                    rows_out[str(rows)] = timings
                    print(setting, name, rows, timings, flush=True)
                out[setting][name] = rows_out
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    results = run(args.repeats)
    flags = vendor = ""
    try:
        with open("/proc/cpuinfo") as fh:
            lines = fh.readlines()
        flags = next((line for line in lines if line.startswith("flags")), "")
        vendor = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "")
    except OSError:
        pass
    write_json(
        "linear_kernels",
        {
            "unit": "microseconds per call",
            "shapes": {k: list(v) for k, v in SHAPES.items()},
            "cpu_vendor": vendor,
            "amx": "amx_bf16" in flags,
            "fp32_gemm_backend": fp32_gemm_backend(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "results": results,
        },
    )
    _plot(results)


def _plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(results)
    names = list(results[settings[0]])
    fig, axes = plt.subplots(len(settings), len(names), figsize=(4 * len(names), 3.4 * len(settings)))
    for i, setting in enumerate(settings):
        for ax, name in zip(axes[i], names, strict=True):
            by_rows = results[setting][name]
            for k in next(iter(by_rows.values())):
                ax.plot([int(r) for r in by_rows], [by_rows[r][k] for r in by_rows], marker="o", label=k)
            ax.set_title(f"{name} ({setting})")
            ax.set_xlabel("rows")
            ax.set_yscale("log")
        axes[i][0].set_ylabel("us per call")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plot_path("linear_kernels"), dpi=110)


if __name__ == "__main__":
    main()
