"""The default policy's three operating points, side by side: decode-step cost per token at batch
1, 4 and 16 (interleaved repetitions, medians) and greedy-token agreement with the fp32 large tier
(teacher-forced on the large tier's own greedy continuations of chat prompts).
Also the candidates that were not chosen (int8 per channel, int4/g32 with an int4 head).
Writes benchmarks/results/ladder.{json,png}.

    python -m benchmarks.ladder
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.common import PROMPTS, plot_path, slots, write_json

POINTS: dict[str, dict[str, Any]] = {
    "large: fp32": {"quantization": "none", "dtype": "float32"},
    "medium: int4 g32, W4A8": {"quantization": "int4", "group_size": 32, "int8_activations": True},
    "small: int4 g64 + int4 head, W4A8": {
        "quantization": "int4",
        "group_size": 64,
        "int4_head": True,
        "int8_activations": True,
    },
    "(candidate) int4 g32, bf16 activations": {"quantization": "int4", "group_size": 32},
    "(candidate) int8": {"quantization": "int8"},
    "(candidate) int4 g32 + int4 head": {"quantization": "int4", "group_size": 32, "int4_head": True},
}


def main() -> None:
    from tiers.device import DeviceWorker

    worker = DeviceWorker()
    data = worker.call(_measure)
    worker.stop()
    write_json("ladder", data)
    _plot(data)


def _measure() -> dict[str, Any]:
    import torch

    from tiers.loading import load_model
    from tiers.model_runner import ModelRunner, RowInput

    runners = {
        name: ModelRunner(
            load_model("embedded:smollm2-135m-instruct", **kw), num_blocks=512, max_model_len=512
        )
        for name, kw in POINTS.items()
    }
    # 16 fixed "slots" per runner: block tables of 512 tokens each (the whole pool).
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
    ref = runners["large: fp32"]
    tok = ref.tokenizer
    agree = {n: [0, 0] for n in runners}
    with torch.inference_mode():
        for prompt in PROMPTS[:8]:
            ids = list(
                tok.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
                )["input_ids"]
            )
            toks = list(ids)
            logits = ref.forward([RowInput(held[id(ref)][0], 0, toks, "last")])[0]
            gen = []
            for _ in range(64):
                assert logits is not None
                t = int(logits[-1].argmax())
                gen.append(t)
                logits = ref.forward([RowInput(held[id(ref)][0], len(toks), [t], "last")])[0]
                toks.append(t)
            for name, r in runners.items():
                out = r.forward([RowInput(held[id(r)][1], 0, toks, "all")])[0]
                assert out is not None
                pred = out[len(ids) - 1 : len(ids) - 1 + 64].argmax(-1).tolist()
                agree[name][0] += sum(a == b for a, b in zip(pred, gen, strict=True))
                agree[name][1] += 64
    rows = []
    for name in runners:
        med = {b: statistics.median(times[name][b]) for b in (1, 4, 16)}
        rows.append(
            {
                "point": name,
                "step_ms": {str(b): round(v, 2) for b, v in med.items()},
                "ms_per_token": {str(b): round(v / b, 2) for b, v in med.items()},
                "greedy_agreement": round(agree[name][0] / agree[name][1], 3),
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
