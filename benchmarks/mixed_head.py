"""The medium tier's output head at four precisions, beside the small tier, in one process.

The default policy's medium tier (int4 in groups of 32, W4A8) built with an int8 head (W8A8), with
the mixed head of the default (``tiers.layers.quantization.mixed_head.MixedHead``: the first 16,384 token ids
int8, the rest
int4), with 8,192 int8 rows, and with an all-int4 head; and the small tier (int4 g64 body and head)
that a medium step is compared with. Measured, interleaved, on the device thread:

- the decode step at 1, 4 and 16 sequences over 40-100 tokens of context, and small's step over
  each variant's, per repetition (paired ratios, median): the speed the medium tier gives up;
- the head's own share of that step (timed inside it, where the body has just evicted it);
- greedy agreement with the fp32 tier, teacher-forced on its own continuations of 16 chat
  prompts x 64 tokens (the ladder's measure: ``benchmarks/ladder.py``).

Writes benchmarks/results/mixed_head.{json,png}.

    flock /tmp/bench.lock python -m benchmarks.mixed_head [--repeats 15]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from benchmarks.common import greedy_agreement, machine, plot_path, slots, write_json

SHAPES = ("1", "4", "16")
SMALL = "small (int4 g64, int4 head)"
MEDIUM = "int4 g32 W4A8 + "
VARIANTS: dict[str, dict[str, Any]] = {
    MEDIUM + "int8 head": {"group_size": 32, "int4_head": False},
    MEDIUM + "16,384 rows int8 (default)": {"group_size": 32, "int4_head": True, "int8_head_rows": 16384},
    MEDIUM + "8,192 rows int8": {"group_size": 32, "int4_head": True, "int8_head_rows": 8192},
    MEDIUM + "int4 head": {"group_size": 32, "int4_head": True},
    SMALL: {"group_size": 64, "int4_head": True},
}


class _Timed:
    """The head, timing each call (the step calls it once)."""

    def __init__(self, head: Any) -> None:
        self.head, self.seconds = head, 0.0

    def __call__(self, x: Any) -> Any:
        started = time.perf_counter()
        y = self.head(x)
        self.seconds += time.perf_counter() - started
        return y


def _runners() -> dict[str, Any]:
    from tiers.models.loading import load_model
    from tiers.worker.model_runner import ModelRunner

    made = {}
    for name, kw in VARIANTS.items():
        loaded = load_model(
            "embedded:smollm2-135m-instruct", quantization="int4", int8_activations=True, **kw
        )
        made[name] = ModelRunner(loaded, num_blocks=640, max_model_len=512)
    return made


def _steps(runners: dict[str, Any], repeats: int) -> dict[str, Any]:
    from tiers.worker.model_runner import RowInput

    rng = random.Random(0)
    ctx = [rng.randint(40, 100) for _ in range(16)]
    tables = {}
    for name, r in runners.items():
        tables[name] = slots(r)
        for t, c in zip(tables[name], ctx, strict=True):
            r.forward([RowInput(t, 0, list(range(100, 100 + c)), "none")])
        r.lm_head = _Timed(r.lm_head)
    step: dict[str, dict[str, list[float]]] = {n: {s: [] for s in SHAPES} for n in runners}
    head: dict[str, dict[str, list[float]]] = {n: {s: [] for s in SHAPES} for n in runners}
    calls = 5
    for _ in range(repeats):
        for shape in SHAPES:
            for name, r in runners.items():
                rows = [RowInput(tables[name][i], ctx[i], [5], "last") for i in range(int(shape))]
                r.forward(rows)
                r.lm_head.seconds = 0.0
                started = time.perf_counter()
                for _ in range(calls):
                    r.forward(rows)
                step[name][shape].append((time.perf_counter() - started) / calls * 1000)
                head[name][shape].append(r.lm_head.seconds / calls * 1000)
    for r in runners.values():
        r.lm_head = r.lm_head.head
    return {
        "step_ms": {n: {s: round(statistics.median(v), 3) for s, v in t.items()} for n, t in step.items()},
        "head_in_step_ms": {
            n: {s: round(statistics.median(v), 3) for s, v in t.items()} for n, t in head.items()
        },
        "small_over_this": {
            n: {
                s: round(statistics.median(a / b for a, b in zip(step[SMALL][s], t[s], strict=True)), 3)
                for s in SHAPES
            }
            for n, t in step.items()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    from tiers.worker.device import DeviceWorker

    worker = DeviceWorker()  # the thread the service's tiers run on
    runners = worker.call(_runners)
    data: dict[str, Any] = {"machine": machine(), "repeats": args.repeats}
    data.update(worker.call(lambda: _steps(runners, args.repeats)))
    data["greedy_agreement_with_fp32"] = worker.call(lambda: greedy_agreement(runners, prompts=16))
    worker.stop()
    print(data)
    write_json("mixed_head", data)
    _plot(data)
    return 0


def _plot(data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(VARIANTS)
    labels = [n.replace(MEDIUM, "medium: ") for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    width = 0.8 / len(SHAPES)
    for i, s in enumerate(SHAPES):
        xs = [x + (i - 1) * width for x in range(len(names))]
        axes[0].bar(xs, [data["small_over_this"][n][s] for n in names], width, label=f"{s} seq")
    axes[0].axhline(0.9, color="grey", lw=0.8, ls="--")
    axes[0].set_ylabel("small's step / this step (paired medians)")
    axes[0].set_ylim(0.6, 1.05)
    agree = data["greedy_agreement_with_fp32"]
    axes[1].bar(range(len(names)), [agree[n] for n in names], color="tab:green")
    axes[1].axhline(0.95, color="grey", lw=0.8, ls="--")
    axes[1].set_ylim(0.6, 1.0)
    axes[1].set_ylabel("greedy agreement with fp32")
    for ax in axes:
        ax.set_xticks(range(len(names)), labels, rotation=20, ha="right", fontsize=7)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"medium tier's output head ({data['machine']['cpu']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(plot_path("mixed_head"), dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
