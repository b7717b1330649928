"""What batch invariance costs per tier: each tier of the default policy built twice on the
embedded model in one process - with the policy's ``batch_invariant`` (the default: the paged
attention kernel at every query length, fp32 linears on one packed GEMM at every row count, the
library checked invariant on this CPU) and without it (SDPA for prompt chunks over 64 tokens,
fp32 kernels switched by row count where that measured faster) - and the step timed at 1, 4 and
16 decoding sequences over 120 tokens of context and for prompt chunks of 20 and 128 tokens,
interleaved repetitions, medians. Also records, for each build, whether a decode row's logits
are bitwise the same alone and beside 7 other decodes (the property the cost buys).

Writes benchmarks/results/invariance_cost.{json,png}.

    flock /tmp/bench.lock python -m benchmarks.invariance_cost [--repeats 7]
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import interleaved_forward_ms, machine, plot_path, slots, tier_model, write_json

TIERS: dict[str, dict[str, Any]] = {
    "small (int4 g64 W4A8)": tier_model("small"),
    "medium (int4 g32 W4A8)": tier_model("medium"),
    "large (fp32)": tier_model("large"),
}
"""The default policy's tiers; each is built both ways (``batch_invariant`` on and off)."""
SHAPES = ("1", "4", "16", "prefill 20", "prefill 128")
CONTEXT = 120


def _runner(invariant: bool, kw: dict[str, Any]) -> Any:
    from tiers.models.loading import load_model
    from tiers.worker.model_runner import ModelRunner

    loaded = load_model("embedded:smollm2-135m-instruct", **{**kw, "batch_invariant": invariant})
    return ModelRunner(loaded, num_blocks=1024, max_model_len=512, batch_invariant=invariant)


def _measure_tier(kw: dict[str, Any], repeats: int) -> dict[str, Any]:
    import torch

    from tiers.worker.model_runner import RowInput

    runners = {"invariant": _runner(True, kw), "switching": _runner(False, kw)}
    tables: dict[str, list[list[int]]] = {}
    for name, r in runners.items():
        tables[name] = slots(r)
        r.forward([RowInput(tables[name][i], 0, list(range(100, 100 + CONTEXT)), "none") for i in range(16)])

    def rows(name: str, shape: str) -> list[Any]:
        if shape.startswith("prefill"):
            n = int(shape.split()[1])
            return [RowInput(tables[name][0], CONTEXT, list(range(300, 300 + n)), "last")]
        return [RowInput(tables[name][i], CONTEXT, [5], "last") for i in range(int(shape))]

    # One unrecorded round first: the first runner of a process measured 1.44x slower than an
    # identical second one through a whole 7-repetition run without it.
    interleaved_forward_ms(runners, SHAPES, rows, 1)
    med = interleaved_forward_ms(runners, SHAPES, rows, repeats)
    same: dict[str, bool] = {}
    for name, r in runners.items():
        alone = r.forward([RowInput(tables[name][0], CONTEXT, [7], "last")])[0]
        batched = r.forward([RowInput(tables[name][i], CONTEXT, [7 + i], "last") for i in range(8)])[0]
        same[name] = bool(torch.equal(alone, batched))
    return {
        "step_ms": med,
        "cost": {s: round(med["invariant"][s] / med["switching"][s], 3) for s in SHAPES},
        "row_alone_equals_batched": same,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from tiers.kernels import cpu as cpu_kernels
    from tiers.worker.device import DeviceWorker

    worker = DeviceWorker()  # the thread the service's tiers run on
    rows = []
    for tier, kw in TIERS.items():
        row = {"tier": tier, **worker.call(lambda kw=kw: _measure_tier(kw, args.repeats))}
        print(row, flush=True)
        rows.append(row)
    worker.stop()
    data = {"machine": machine(), "isa": cpu_kernels.host_isa(), "context": CONTEXT, "rows": rows}
    write_json("invariance_cost", data)
    _plot(data)
    return 0


def _plot(data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data["rows"]), figsize=(5 * len(data["rows"]), 4.2), squeeze=False)
    for ax, row in zip(axes[0], data["rows"], strict=True):
        xs = range(len(SHAPES))
        ax.bar(
            [x - 0.2 for x in xs], [row["step_ms"]["switching"][s] for s in SHAPES], 0.4, label="switching"
        )
        ax.bar(
            [x + 0.2 for x in xs], [row["step_ms"]["invariant"][s] for s in SHAPES], 0.4, label="invariant"
        )
        for x, s in zip(xs, SHAPES, strict=True):
            top = max(row["step_ms"]["switching"][s], row["step_ms"]["invariant"][s])
            ax.text(x, top, f"{row['cost'][s]}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [f"{s} seq" if s.isdigit() else s for s in SHAPES], fontsize=8)
        ax.set_ylabel("ms per step")
        inv = row["row_alone_equals_batched"]
        ax.set_title(
            f"{row['tier']}\nrow alone = batched: invariant {inv['invariant']}, switching {inv['switching']}",
            fontsize=9,
        )
        ax.legend(fontsize=8)
    fig.suptitle(f"Cost of batch invariance ({data['isa']}, {data['context']} tokens of context)")
    fig.tight_layout()
    fig.savefig(plot_path("invariance_cost"), dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
