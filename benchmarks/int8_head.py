"""The medium tier's int8 output head on three kernels, in one process: torch's
``_weight_int8pack_mm`` and ``tiered_router::w8_linear`` (bf16 activations) and
``tiered_router::w8a8_linear`` (activations quantized to int8 per group of 32, as the tier's W4A8
layers take them: the default).

The default policy's medium tier (int4 in groups of 32, W4A8 body, int8 head) built three times on
the embedded model; the only difference is the head (49,152 x 576). Measured, interleaved,
medians, on the device thread as the service runs them:
- the decode step at 1, 4 and 16 sequences over 40-100 tokens of context;
- the head alone at the same row counts (30 calls cycled over two weight copies, so it is read from
  memory as in a step);
- what changes in the numbers: the heads on the same hidden states of a fixed English text (this
  repository's README, first 1,024 tokens) - top-1 agreement with torch's head and the largest logit
  difference; and greedy agreement with the fp32 tier, teacher-forced on its own continuations of 8
  chat prompts x 64 tokens (the ladder's measure: ``benchmarks/ladder.py``).

Writes benchmarks/results/int8_head.{json,png}; exits 2 where the kernels are not built.

    flock /tmp/bench.lock python -m benchmarks.int8_head [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    greedy_agreement,
    interleaved_forward_ms,
    kernels_missing,
    plot_path,
    slots,
    write_json,
)

SHAPES = ("1", "4", "16")
VARIANTS = ("torch _weight_int8pack_mm", "w8_linear", "w8a8_linear (default)")
TEXT = Path(__file__).resolve().parents[1] / "README.md"


def _bf16_head(head: Any, op: Any) -> Any:
    """``head`` (an ``Int8WeightOnlyLinear``) on bf16 activations through ``op``."""
    import torch

    q, scale = head.weight_q, head.scale.to(torch.bfloat16)
    return lambda x: op(x.to(torch.bfloat16).contiguous(), q, scale)


def _heads(head: Any) -> dict[str, Any]:
    import torch

    from tiers.kernels import cpu as cpu_kernels

    return {
        VARIANTS[0]: _bf16_head(head, torch._weight_int8pack_mm),
        VARIANTS[1]: _bf16_head(head, cpu_kernels.w8_linear_op()),
        VARIANTS[2]: head,
    }


def _runners() -> dict[str, Any]:
    from tiers.models.loading import load_model
    from tiers.worker.model_runner import ModelRunner

    made = {}
    for name in VARIANTS:
        loaded = load_model(
            "embedded:smollm2-135m-instruct",
            quantization="int4",
            group_size=32,
            int4_head=False,
            int8_activations=True,
        )
        runner = ModelRunner(loaded, num_blocks=640, max_model_len=512)
        assert runner.lm_head.w8a8_packed is not None  # the default head: W8A8 on the kernel
        runner.lm_head = _heads(runner.lm_head)[name]
        made[name] = runner
    return made


def _steps(runners: dict[str, Any], repeats: int) -> dict[str, dict[str, float]]:
    import random

    from tiers.worker.model_runner import RowInput

    rng = random.Random(0)
    ctx = [rng.randint(40, 100) for _ in range(16)]
    tables: dict[str, list[list[int]]] = {}
    for name, r in runners.items():
        tables[name] = slots(r)
        for t, c in zip(tables[name], ctx, strict=True):
            r.forward([RowInput(t, 0, list(range(100, 100 + c)), "none")])

    def rows(name: str, shape: str) -> list[Any]:
        return [RowInput(tables[name][i], ctx[i], [5], "last") for i in range(int(shape))]

    return interleaved_forward_ms(runners, SHAPES, rows, repeats)


def _head_alone(runners: dict[str, Any], repeats: int) -> dict[str, dict[str, float]]:
    import torch

    from tiers.layers.quantization.int8 import Int8WeightOnlyLinear

    # A second copy of the head: alternating between them, every call reads from memory.
    default = runners[VARIANTS[2]].model.get_output_embeddings()
    twin = Int8WeightOnlyLinear.__new__(Int8WeightOnlyLinear)
    torch.nn.Module.__init__(twin)
    for key in ("weight_q", "scale", "w8a8_scale"):
        twin.register_buffer(key, getattr(default, key).clone())
    twin.bias, twin.in_features, twin.out_features = None, default.in_features, default.out_features
    twin.int8_activations, twin.group_size = True, default.group_size
    twin.w8a8_packed = default.w8a8_packed.clone()
    copies = {name: (_heads(default)[name], _heads(twin)[name]) for name in VARIANTS}
    times: dict[str, dict[str, list[float]]] = {n: {s: [] for s in SHAPES} for n in VARIANTS}
    with torch.inference_mode():
        for _ in range(repeats):
            for name in VARIANTS:
                for shape in SHAPES:
                    x = torch.randn(int(shape), default.in_features).to(torch.bfloat16)
                    for f in copies[name]:
                        f(x)
                    started = time.perf_counter()
                    for i in range(30):
                        copies[name][i % 2](x)
                    times[name][shape].append((time.perf_counter() - started) / 30 * 1000)
    return {n: {s: round(statistics.median(v), 2) for s, v in t.items()} for n, t in times.items()}


def _numbers(runners: dict[str, Any]) -> dict[str, Any]:
    import torch

    # The hidden states from the runners' own model (HF's forward over the same quantized body).
    runner = runners[VARIANTS[0]]
    ids = runner.tokenizer(TEXT.read_text(), return_tensors="pt").input_ids[:, :1024]
    with torch.inference_mode():
        hidden = runner.model.model(ids).last_hidden_state[0].to(torch.bfloat16)
        logits = {n: r.lm_head(hidden).float() for n, r in runners.items()}
    base = logits[VARIANTS[0]]
    return {
        "tokens": int(hidden.shape[0]),
        "max_abs_logit": round(base.abs().max().item(), 2),
        "vs_torch": {
            n: {
                "top1_agreement": round((base.argmax(-1) == v.argmax(-1)).float().mean().item(), 4),
                "max_abs_logit_difference": round((base - v).abs().max().item(), 4),
            }
            for n, v in logits.items()
            if n != VARIANTS[0]
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from tiers.kernels import cpu as cpu_kernels
    from tiers.worker.device import DeviceWorker

    if kernels_missing(cpu_kernels.w8a8_linear_op()):
        return 2
    worker = DeviceWorker()  # the thread the service's tiers run on
    runners = worker.call(_runners)
    step_ms = worker.call(lambda: _steps(runners, args.repeats))
    head_ms = worker.call(lambda: _head_alone(runners, args.repeats))
    numbers = worker.call(lambda: _numbers(runners))
    numbers["greedy_agreement_with_fp32"] = worker.call(lambda: greedy_agreement(runners))
    worker.stop()
    base = VARIANTS[0]
    data = {
        "isa": cpu_kernels.host_isa(),
        "step_ms": step_ms,
        "step_speedup_vs_torch": {
            n: {s: round(step_ms[base][s] / step_ms[n][s], 2) for s in SHAPES} for n in VARIANTS[1:]
        },
        "head_ms": head_ms,
        "head_speedup_vs_torch": {
            n: {s: round(head_ms[base][s] / head_ms[n][s], 2) for s in SHAPES} for n in VARIANTS[1:]
        },
        "numbers": numbers,
    }
    print(data)
    write_json("int8_head", data)
    _plot(data)
    return 0


def _plot(data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    xs = range(len(SHAPES))
    width = 0.27
    for ax, key, title in (
        (axes[0], "step", "medium tier decode step"),
        (axes[1], "head", "output head alone"),
    ):
        for i, name in enumerate(VARIANTS):
            off = (i - 1) * width
            ax.bar([x + off for x in xs], [data[f"{key}_ms"][name][s] for s in SHAPES], width, label=name)
            if i:
                for x, s in zip(xs, SHAPES, strict=True):
                    speed = data[f"{key}_speedup_vs_torch"][name][s]
                    ax.text(
                        x + off, data[f"{key}_ms"][name][s], f"{speed}x", ha="center", va="bottom", fontsize=7
                    )
        ax.set_xticks(list(xs), [f"{s} seq" for s in SHAPES])
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    agree = data["numbers"]["greedy_agreement_with_fp32"]
    fig.suptitle(
        f"medium tier's int8 head ({data['isa']}); greedy agreement with fp32: "
        + ", ".join(f"{n.split()[0]} {a:.1%}" for n, a in agree.items()),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(plot_path("int8_head"), dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
