"""Speculative decoding on the embedded default: the large tier (fp32) with and without its draft
(the medium tier's model, int4 weights in groups of 32, shared in memory), at batch 1, 4 and 16, side by side
with transformers' assisted generation (``assistant_model=``, batch 1 only) on the same two models.

Greedy, 96 new tokens per request, EOS ignored (every system generates the same tokens).
Writes benchmarks/results/speculative.{json,png}.

    python -m benchmarks.speculative
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.common import encode_chat, plot_path, write_json

NEW_TOKENS = 96
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works, part by part.",
    "Describe a day in the life of a honeybee.",
    "Write a letter to a friend about your trip to the mountains.",
    "Explain why the sky is blue to a curious child.",
    "Describe how to plant and care for a tomato garden.",
    "Write a story about a robot who wants to become a chef.",
    "Explain the history of the printing press.",
]


def main() -> None:
    from tiers.device import DeviceWorker

    worker = DeviceWorker()
    target, draft, plain, spec = worker.call(_setup)
    plain.attach(worker)
    spec.attach(worker)
    tok = target.tokenizer
    ids = encode_chat(tok, PROMPTS)
    rows = []
    for batch_size in (1, 4, 16):
        batch = [ids[i % len(ids)] for i in range(batch_size)]
        # This VM's speed drifts by +-15% between runs: interleave the two engines and keep the
        # best of each, so drift hits both sides alike.
        reps = 3 if batch_size == 1 else 2
        bases, runs = [], []
        for _ in range(reps):
            bases.append(_engine_tps(plain, batch)[0])
            runs.append(_engine_tps(spec, batch))
        base = max(bases)
        best = max(runs, key=lambda r: r[0])
        tps, drafted, accepted, rounds = best
        row: dict[str, Any] = {
            "batch": batch_size,
            "plain_tok_s": base,
            "spec_tok_s": tps,
            "speedup": tps / base,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_per_round": accepted / rounds if rounds else 0.0,
            "drafted": drafted,
            "accepted": accepted,
        }
        if batch_size == 1:
            hf = max(worker.call(lambda: _assisted(target, draft, ids[:4])) for _ in range(2))
            hf_plain = max(worker.call(lambda: _assisted(target, None, ids[:4])) for _ in range(2))
            row.update({"hf_assisted_tok_s": hf, "hf_plain_tok_s": hf_plain, "vs_hf_assisted": tps / hf})
        rows.append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    cost = {f"{b}x{t}": round(v * 1000, 1) for (b, t), v in sorted(spec.spec.target_cost.items())}
    dcost = {f"{b}x{t}": round(v * 1000, 1) for (b, t), v in sorted(spec.spec.draft_cost.items())}
    worker.stop()
    write_json(
        "speculative",
        {
            "target": "embedded:smollm2-135m-instruct fp32 (large tier)",
            "draft": "embedded:smollm2-135m-instruct int4/g32 weights (the medium tier's model)",
            "new_tokens": NEW_TOKENS,
            "rows": rows,
            "controller_cost_ms": {"target": cost, "draft": dcost},
            "targets": {"speedup_batch1": 1.6, "min_speedup_batch16": 0.95, "vs_hf_assisted_batch1": 1.0},
        },
    )
    _plot(rows)


def _setup() -> tuple[Any, Any, Any, Any]:
    from tiers.engine import Engine
    from tiers.loading import load_model
    from tiers.model_runner import ModelRunner
    from tiers.scheduler import SchedulerConfig

    target = load_model("embedded:smollm2-135m-instruct", quantization="none", dtype="float32")
    draft = load_model(
        "embedded:smollm2-135m-instruct", quantization="int4", group_size=32
    )  # the medium tier
    cfg = SchedulerConfig(max_num_seqs=16, max_model_len=512, max_num_batched_tokens=512)
    plain = Engine("plain", ModelRunner(target, num_blocks=512, max_model_len=512), cfg)
    spec = Engine(
        "spec",
        ModelRunner(target, num_blocks=512, max_model_len=512),
        cfg,
        draft_runner=ModelRunner(draft, num_blocks=512, max_model_len=512),
        speculative_tokens=4,
    )
    plain.warmup()
    spec.warmup()
    return target, draft, plain, spec


def _engine_tps(engine: Any, batch: list[list[int]]) -> tuple[float, int, int, int]:
    from tiers.sequence import SamplingParams

    async def run() -> list[Any]:
        async def one(ids: list[int]) -> Any:
            last = None
            async for out in engine.submit(
                ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
            ):
                last = out
            return last

        return await asyncio.gather(*(one(i) for i in batch))

    started = time.perf_counter()
    outs = asyncio.run(run())
    elapsed = time.perf_counter() - started
    drafted = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    tokens = sum(o.num_output_tokens for o in outs)
    rounds = sum(_rounds(o) for o in outs)
    return tokens / elapsed, drafted, accepted, rounds


def _rounds(out: Any) -> int:
    # Speculative rounds for one sequence: every decode step emits accepted+1 tokens.
    return max(1, out.num_output_tokens - 1 - out.num_accepted_tokens)


def _assisted(target: Any, draft: Any, prompts: list[list[int]]) -> float:
    import torch

    total = 0
    started = time.perf_counter()
    for ids in prompts:
        kwargs: dict[str, Any] = {
            "max_new_tokens": NEW_TOKENS,
            "min_new_tokens": NEW_TOKENS,
            "do_sample": False,
            "pad_token_id": target.tokenizer.pad_token_id,
        }
        if draft is not None:
            kwargs["assistant_model"] = draft.model
        out = target.model.generate(torch.tensor([ids]), **kwargs)
        total += out.shape[1] - len(ids)
    return total / (time.perf_counter() - started)


def _plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["batch"]) for r in rows]
    x = range(len(rows))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    w = 0.27
    ax.bar([i - w for i in x], [r["plain_tok_s"] for r in rows], w, label="large, no draft")
    ax.bar(list(x), [r["spec_tok_s"] for r in rows], w, label="large + medium draft (adaptive k)")
    ax.bar(
        [i + w for i in x],
        [r.get("hf_assisted_tok_s", 0) for r in rows],
        w,
        label="transformers assisted (batch 1)",
    )
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens / s")
    ax.legend(fontsize=8)
    ax.set_title("Throughput")
    ax2.plot(labels, [r["speedup"] for r in rows], "o-", label="speedup vs no draft")
    ax2.plot(labels, [r["acceptance_rate"] or 0 for r in rows], "s--", label="acceptance rate")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_xlabel("batch size")
    ax2.legend(fontsize=8)
    ax2.set_title("Speedup and acceptance")
    fig.suptitle("Speculative decoding, SmolLM2-135M: fp32 target, int4 draft")
    fig.tight_layout()
    fig.savefig(plot_path("speculative"), dpi=120)


if __name__ == "__main__":
    main()
