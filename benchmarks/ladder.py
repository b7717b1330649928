"""The default policy's three operating points, side by side: decode-step cost per token at batch
1, 4 and 16 (interleaved repetitions, medians) and greedy-token agreement with the fp32 large tier
(teacher-forced on the large tier's own greedy continuations of chat prompts).
Also candidates that were not chosen (int8 per channel, the medium body with a whole int8 head or
with bf16 activations); the tiers' settings are read from ``policies/default.yaml``.
Writes benchmarks/results/ladder.{json,png}.

    python -m benchmarks.ladder
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.common import greedy_agreement, plot_path, slots, tier_model, write_json

POINTS: dict[str, dict[str, Any]] = {
    "large: fp32": tier_model("large"),
    "medium: int4 g32, W4A8, 16,384 head rows int8": tier_model("medium"),
    "small: int4 g64 + int4 head, W4A8": tier_model("small"),
    "(candidate) int4 g32, W4A8, int8 head": {**tier_model("medium"), "int4_head": False},
    "(candidate) int4 g32, bf16 activations": {"quantization": "int4", "group_size": 32},
    "(candidate) int8": {"quantization": "int8"},
}
"""The default policy's tiers as it ships them, then candidates beside them."""


def main() -> None:
    from tiers.worker.device import DeviceWorker

    worker = DeviceWorker()
    data = worker.call(_measure)
    worker.stop()
    write_json("ladder", data)
    _plot(data)


def _measure() -> dict[str, Any]:
    from tiers.models.loading import load_model
    from tiers.worker.model_runner import ModelRunner, RowInput

    runners = {
        name: ModelRunner(
            load_model("embedded:smollm2-135m-instruct", **kw), num_blocks=544, max_model_len=512
        )
        for name, kw in POINTS.items()
    }
    # 16 fixed "slots" per runner: block tables of 512 tokens each (the agreement takes one more).
    held = {id(r): slots(r) for r in runners.values()}
    times: dict[str, dict[int, list[float]]] = {n: {1: [], 4: [], 16: []} for n in runners}
    ctx = list(range(100, 300))
    for r in runners.values():
        r.forward([RowInput(held[id(r)][i], 0, ctx, "none") for i in range(16)])
    for _ in range(5):
        for name, r in runners.items():
            for b in (1, 4, 16):
                rows = [RowInput(held[id(r)][i], len(ctx), [5], "last") for i in range(b)]
                r.forward(rows)
                started = time.perf_counter()
                for _ in range(5):
                    r.forward(rows)
                times[name][b].append((time.perf_counter() - started) / 5 * 1000)
    agree = greedy_agreement(runners)
    rows = []
    for name in runners:
        med = {b: statistics.median(times[name][b]) for b in (1, 4, 16)}
        rows.append(
            {
                "point": name,
                "step_ms": {str(b): round(v, 2) for b, v in med.items()},
                "ms_per_token": {str(b): round(v / b, 2) for b, v in med.items()},
                "greedy_agreement": round(agree[name], 3),
            }
        )
        print(rows[-1], flush=True)
    return {"model": "embedded:smollm2-135m-instruct", "context_tokens": len(ctx), "rows": rows}


def _plot(data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["point"] for r in data["rows"]]
    for b, style in (("1", "o-"), ("4", "s--"), ("16", "^:")):
        a1.plot(range(len(names)), [r["ms_per_token"][b] for r in data["rows"]], style, label=f"batch {b}")
    a1.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    a1.set_ylabel("ms per generated token")
    a1.set_title("Cost per token")
    a1.legend()
    a2.bar(range(len(names)), [r["greedy_agreement"] for r in data["rows"]])
    a2.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    a2.set_ylim(0, 1.05)
    a2.set_title("Greedy agreement with fp32")
    fig.tight_layout()
    fig.savefig(plot_path("ladder"), dpi=120)


if __name__ == "__main__":
    main()
