"""The medium tier's int8 output head on ``tiered_router::w8_linear`` against torch's
``_weight_int8pack_mm``, in one process.

The default policy's medium tier (int4 in groups of 32, W4A8 body, int8 head) built twice on the
embedded model; the only difference is the kernel behind the head (49,152 x 576, a third of the
tier's one-stream step with torch's kernel). Measured, interleaved, medians, on the device thread
as the service runs them:
- the decode step at 1, 4 and 16 sequences over 40-100 tokens of context;
- the head alone at the same row counts (30 calls cycled over two weight copies, so it is read from
  memory as in a step);
- what changes in the numbers: both heads on the same hidden states of a fixed English text (this
  repository's README, first 1,024 tokens) - top-1 agreement and the largest logit difference.

Writes benchmarks/results/int8_head.{json,png}; exits 2 where the kernels are not built.

    flock /tmp/bench.lock python -m benchmarks.int8_head [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import interleaved_forward_ms, kernels_missing, plot_path, write_json

SHAPES = ("1", "4", "16")
VARIANTS = ("torch _weight_int8pack_mm", "w8_linear")
TEXT = Path(__file__).resolve().parents[1] / "README.md"


def _torch_head(head: Any) -> Any:
    """``head`` (an ``Int8WeightOnlyLinear``) through torch's kernel whatever is built."""
    import torch

    q, scale = head.weight_q, head.scale.to(torch.bfloat16)
    return lambda x: torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), q, scale)


def _runners() -> dict[str, Any]:
    from tiers.loading import load_model
    from tiers.model_runner import ModelRunner

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
        if name == VARIANTS[0]:
            runner.lm_head = _torch_head(runner.lm_head)
        made[name] = runner
    return made


def _steps(runners: dict[str, Any], repeats: int) -> dict[str, dict[str, float]]:
    import random

    from tiers.block_manager import BlockTable
    from tiers.model_runner import RowInput

    rng = random.Random(0)
    ctx = [rng.randint(40, 100) for _ in range(16)]
    tables: dict[str, list[list[int]]] = {}
    for name, r in runners.items():
        made = [BlockTable() for _ in range(16)]
        for t in made:
            assert r.blocks.allocate(t, 512)
        tables[name] = [t.blocks for t in made]
        for t, c in zip(tables[name], ctx, strict=True):
            r.forward([RowInput(t, 0, list(range(100, 100 + c)), "none")])

    def rows(name: str, shape: str) -> list[Any]:
        return [RowInput(tables[name][i], ctx[i], [5], "last") for i in range(int(shape))]

    return interleaved_forward_ms(runners, SHAPES, rows, repeats)


def _head_alone(runners: dict[str, Any], repeats: int) -> dict[str, dict[str, float]]:
    import torch

    heads = {name: r.lm_head for name, r in runners.items()}
    # A second copy of each head's weights: alternating between them, every call reads from memory.
    from tiers.quant import Int8WeightOnlyLinear

    w8 = runners[VARIANTS[1]].lm_head
    twin = Int8WeightOnlyLinear.__new__(Int8WeightOnlyLinear)
    torch.nn.Module.__init__(twin)
    for key in ("weight_q", "scale", "bias"):
        value = getattr(w8, key)
        twin.register_buffer(key, None if value is None else value.clone())
    twin.in_features, twin.out_features = w8.in_features, w8.out_features
    copies = {VARIANTS[0]: (heads[VARIANTS[0]], _torch_head(twin)), VARIANTS[1]: (w8, twin)}
    times: dict[str, dict[str, list[float]]] = {n: {s: [] for s in SHAPES} for n in VARIANTS}
    with torch.inference_mode():
        for _ in range(repeats):
            for name in VARIANTS:
                for shape in SHAPES:
                    x = torch.randn(int(shape), w8.in_features).to(torch.bfloat16)
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
    runner = runners[VARIANTS[1]]
    ids = runner.tokenizer(TEXT.read_text(), return_tensors="pt").input_ids[:, :1024]
    with torch.inference_mode():
        hidden = runner.model.model(ids).last_hidden_state[0].to(torch.bfloat16)
        a = runners[VARIANTS[0]].lm_head(hidden).float()
        b = runners[VARIANTS[1]].lm_head(hidden).float()
    return {
        "tokens": int(hidden.shape[0]),
        "top1_agreement": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 4),
        "max_abs_logit_difference": round((a - b).abs().max().item(), 4),
        "max_abs_logit": round(a.abs().max().item(), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from tiers import cpu_kernels
    from tiers.device import DeviceWorker

    if kernels_missing(cpu_kernels.w8_linear_op()):
        return 2
    worker = DeviceWorker()  # the thread the service's tiers run on
    runners = worker.call(_runners)
    step_ms = worker.call(lambda: _steps(runners, args.repeats))
    head_ms = worker.call(lambda: _head_alone(runners, args.repeats))
    numbers = worker.call(lambda: _numbers(runners))
    worker.stop()
    base, new = VARIANTS
    data = {
        "isa": cpu_kernels.host_isa(),
        "step_ms": step_ms,
        "step_speedup": {s: round(step_ms[base][s] / step_ms[new][s], 2) for s in SHAPES},
        "head_ms": head_ms,
        "head_speedup": {s: round(head_ms[base][s] / head_ms[new][s], 2) for s in SHAPES},
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

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    xs = range(len(SHAPES))
    for ax, key, title in (
        (axes[0], "step", "medium tier decode step"),
        (axes[1], "head", "output head alone"),
    ):
        for off, name in zip((-0.2, 0.2), VARIANTS, strict=True):
            ax.bar([x + off for x in xs], [data[f"{key}_ms"][name][s] for s in SHAPES], 0.4, label=name)
        for x, s in zip(xs, SHAPES, strict=True):
            top = data[f"{key}_ms"][VARIANTS[0]][s]
            ax.text(x, top, f"{data[f'{key}_speedup'][s]}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [f"{s} seq" for s in SHAPES])
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    n = data["numbers"]
    fig.suptitle(
        f"int8 head: w8_linear vs torch ({data['isa']}); top-1 agreement {n['top1_agreement']:.2%} "
        f"on {n['tokens']} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(plot_path("int8_head"), dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
