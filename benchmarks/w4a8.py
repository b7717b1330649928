"""W4A8 (int4 weights, int8 activations) against the bf16-activation int4 path, in one process.

The default policy's small tier (int4 in groups of 64, int4 head) built twice on the embedded model:
``activation_quantization: none`` (bf16 activations: torch's int4 kernel, the tiled one from
``TILED_INT4_MIN_ROWS`` rows) and ``int8`` (``tiered_router::w4a8_mm``). Measured, interleaved,
medians, on the device thread as the service runs them:
- the decode step at 1, 4 and 16 sequences over 40-100 tokens of context, and a 128-token prefill;
- what it costs in quality: teacher-forced perplexity and top-1 agreement with the fp32 model on
  a fixed English text (this repository's README, first 2,048 tokens; its hash is recorded).

Writes benchmarks/results/w4a8.{json,png}; exits 2 where the kernels are not built.

    flock /tmp/bench.lock python -m benchmarks.w4a8 [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
from pathlib import Path
from typing import Any

from benchmarks.common import interleaved_forward_ms, kernels_missing, plot_path, slots, write_json

SHAPES = ("1", "4", "16", "prefill 128")
VARIANTS = {"bf16 activations": False, "int8 activations (W4A8)": True}
TEXT = Path(__file__).resolve().parents[1] / "README.md"


def _runner(int8: bool) -> Any:
    from tiers.models.loading import load_model
    from tiers.worker.model_runner import ModelRunner

    loaded = load_model(
        "embedded:smollm2-135m-instruct",
        quantization="int4",
        group_size=64,
        int4_head=True,
        int8_activations=int8,
    )
    return ModelRunner(loaded, num_blocks=640, max_model_len=512)


def _speed(repeats: int) -> dict[str, dict[str, float]]:
    from tiers.worker.model_runner import RowInput

    runners = {name: _runner(int8) for name, int8 in VARIANTS.items()}
    rng = random.Random(0)
    ctx = [rng.randint(40, 100) for _ in range(16)]
    tables: dict[str, list[list[int]]] = {}
    prefill: dict[str, list[int]] = {}
    for name, r in runners.items():
        *tables[name], prefill[name] = slots(r, 17)
        for t, c in zip(tables[name], ctx, strict=True):
            r.forward([RowInput(t, 0, list(range(100, 100 + c)), "none")])

    def rows(name: str, shape: str) -> list[Any]:
        if shape == "prefill 128":
            return [RowInput(prefill[name], 0, list(range(200, 328)), "last")]
        return [RowInput(tables[name][i], ctx[i], [5], "last") for i in range(int(shape))]

    return interleaved_forward_ms(runners, SHAPES, rows, repeats)


def _quality() -> dict[str, Any]:
    import torch

    from tiers.models.loading import load_model

    text = TEXT.read_text()
    out: dict[str, Any] = {
        "text": f"{TEXT.name}, first 2048 tokens",
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
    logits: dict[str, torch.Tensor] = {}
    ids = None
    kinds = {"fp32": {"quantization": "none"}}
    for name, int8 in VARIANTS.items():
        kinds[name] = {"quantization": "int4", "group_size": 64, "int4_head": True, "int8_activations": int8}
    for name, kw in kinds.items():
        lm = load_model("embedded:smollm2-135m-instruct", **kw)
        ids = lm.tokenizer(text, return_tensors="pt").input_ids[:, :2048]
        with torch.inference_mode():
            logits[name] = lm.model(ids).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits[name], ids[0, 1:]).item()
        out[name] = {"perplexity": round(math.exp(nll), 3)}
    ref = logits["fp32"].argmax(-1)
    for name in VARIANTS:
        out[name]["top1_agreement_with_fp32"] = round(
            (logits[name].argmax(-1) == ref).float().mean().item(), 4
        )
    a, b = (logits[n].argmax(-1) for n in VARIANTS)
    out["top1_agreement_between_them"] = round((a == b).float().mean().item(), 4)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from tiers.kernels import cpu as cpu_kernels
    from tiers.worker.device import DeviceWorker

    if kernels_missing(cpu_kernels.w4a8_mm_op()):
        return 2
    worker = DeviceWorker()  # the thread the service's tiers run on
    step_ms = worker.call(lambda: _speed(args.repeats))
    quality = worker.call(_quality)
    worker.stop()
    base, w4a8 = (step_ms[n] for n in VARIANTS)
    data = {
        "isa": cpu_kernels.host_isa(),
        "step_ms": step_ms,
        "speedup": {s: round(base[s] / w4a8[s], 2) for s in SHAPES},
        "quality": quality,
    }
    print(data)
    write_json("w4a8", data)
    _plot(data)
    return 0


def _plot(data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = range(len(SHAPES))
    for off, name in zip((-0.2, 0.2), VARIANTS, strict=True):
        ax.bar([x + off for x in xs], [data["step_ms"][name][s] for s in SHAPES], 0.4, label=name)
    base = next(iter(VARIANTS))
    for x, s in zip(xs, SHAPES, strict=True):
        ax.text(x, data["step_ms"][base][s], f"{data['speedup'][s]}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"{s} seq" if s.isdigit() else s for s in SHAPES])
    ax.set_ylabel("ms per step")
    q = data["quality"]
    ppl = ", ".join(f"{n.split(' (')[0]} {q[n]['perplexity']}" for n in VARIANTS)
    ax.set_title(
        f"small tier: W4A8 vs bf16 activations ({data['isa']})\n"
        f"perplexity {ppl}, fp32 {q['fp32']['perplexity']}",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot_path("w4a8"), dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
