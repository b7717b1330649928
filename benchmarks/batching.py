"""Continuous batching on the embedded default's largest tier (fp32), side by side in one process:

  (a) ``model.generate()`` per request, sequentially      - the naive server
  (b) transformers' own continuous batching (``generate_batch``)
  (c) the previous engine (dense KV slots), checked out of git at ``DENSE_REV`` into a temp package
  (d) this engine (paged KV blocks, one token budget per step)

Each request: one of 16 chat prompts, 64 new tokens, greedy, EOS ignored so every system
generates exactly the same number of tokens. Tokens/s at concurrency 1, 4, 16 and 64 (the dense
engine has 16 slots, so at 64 it queues; the paged engine runs 64 at once), plus peak RSS with 64
requests. Then a mixed load: long prompts arriving while 8 sequences decode, with inter-token
latency p99 of the decoders, paged (shared steps) vs dense (prefill/decode alternation).
Writes benchmarks/results/batching.{json,png}.

    python -m benchmarks.batching [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import Any

from benchmarks.common import PROMPTS, encode_chat, plot_path, rss_mb, write_json

NEW_TOKENS = 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 4 only")
    args = parser.parse_args()
    levels = [1, 4] if args.quick else [1, 4, 16, 64]

    from tiers.worker.device import DeviceWorker

    worker = DeviceWorker()
    loaded, engine, dense = worker.call(_setup)
    engine.attach(worker)
    # The dense engine steps on its own revision's worker: today's worker calls engine methods
    # (``share``, ``has_protected_prefill``) that engine predates.
    dense_worker = _old_worker()
    dense.attach(dense_worker)
    tok = loaded.tokenizer
    ids = encode_chat(tok, PROMPTS)

    rows: list[dict[str, Any]] = []
    for c in levels:
        batch = [ids[i % len(ids)] for i in range(c)]
        seq_tps = worker.call(lambda batch=batch: _hf_sequential(loaded, batch)) if c <= 16 else None
        gb_tps = worker.call(lambda batch=batch: _hf_generate_batch(loaded, batch))
        dense_tps = _engine(dense, batch)
        eng_tps = _engine(engine, batch)
        row = {
            "concurrency": c,
            "generate_sequential_tok_s": seq_tps,
            "generate_batch_tok_s": gb_tps,
            "dense_engine_tok_s": dense_tps,
            "engine_tok_s": eng_tps,
            "vs_sequential": eng_tps / seq_tps if seq_tps else None,
            "vs_generate_batch": eng_tps / gb_tps,
            "vs_dense_engine": eng_tps / dense_tps,
        }
        rows.append(row)
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)

    mixed = {"paged": _mixed(engine, ids, tok), "dense": _mixed(dense, ids, tok)}
    print("mixed", mixed, flush=True)
    memory = _queued_memory(engine, ids)
    print("memory", memory, flush=True)
    worker.stop()
    dense_worker.stop()
    data = {
        "model": "embedded:smollm2-135m-instruct (large tier: fp32, oneDNN linears)",
        "dense_engine_revision": DENSE_REV,
        "new_tokens": NEW_TOKENS,
        "rows": rows,
        "mixed_load": mixed,
        "memory_64": memory,
        "targets": {"vs_dense_engine_at_16": 1.0, "mixed_itl_p99_better_than_dense": True},
    }
    write_json("batching", data)
    _plot(rows)


DENSE_REV = "65ad204"
"""The last commit with the dense-slot engine."""


def _old_worker() -> Any:
    from benchmarks.common import load_tiers_at

    return load_tiers_at(DENSE_REV).device.DeviceWorker()


def _setup() -> tuple[Any, Any, Any]:
    from benchmarks.common import load_tiers_at
    from tiers.core.sched.scheduler import SchedulerConfig
    from tiers.engine.llm_engine import Engine
    from tiers.models.loading import load_model
    from tiers.worker.model_runner import ModelRunner

    loaded = load_model("embedded:smollm2-135m-instruct", quantization="none", dtype="float32")
    engine = Engine(
        "large",
        ModelRunner(loaded, num_blocks=8192 // 16, block_size=16, max_model_len=512),
        SchedulerConfig(max_num_seqs=64, max_model_len=512, max_num_batched_tokens=512, max_waiting=256),
    )
    engine.warmup()
    old = load_tiers_at(DENSE_REV)
    dense = old.engine.Engine(
        "dense",
        old.model_runner.ModelRunner(loaded, num_slots=16, max_model_len=512),
        old.scheduler.SchedulerConfig(
            max_num_seqs=16, max_model_len=512, max_num_batched_tokens=512, max_waiting=256
        ),
    )
    dense.warmup()
    return loaded, engine, dense


def _mixed(engine: Any, ids: list[list[int]], tok: Any) -> dict[str, float]:
    """8 chats decode 96 tokens while 4 long prompts (~450 tokens) arrive; inter-token gaps of the
    decoders, which long prefills stall when steps alternate."""
    from tiers.core.sequence import SamplingParams

    long_prompt = (tok.encode("Summarise the following text. " + "The river runs through the valley. " * 60))[
        :450
    ]

    async def run() -> list[float]:
        gaps: list[float] = []

        async def decoder(p: list[int]) -> None:
            last = None
            async for out in engine.submit(p, SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)):
                now = time.perf_counter()
                if last is not None and out.token_ids:
                    gaps.extend([(now - last) / len(out.token_ids)] * len(out.token_ids))
                last = now

        async def prefill(delay: float) -> None:
            await asyncio.sleep(delay)
            async for _ in engine.submit(
                long_prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            ):
                pass

        await asyncio.gather(
            *(decoder(ids[i]) for i in range(8)), *(prefill(0.5 + 0.7 * i) for i in range(4))
        )
        return gaps

    gaps = sorted(asyncio.run(run()))
    return {
        "itl_p50_ms": round(gaps[len(gaps) // 2] * 1000, 1),
        "itl_p99_ms": round(gaps[int(len(gaps) * 0.99)] * 1000, 1),
        "itl_max_ms": round(gaps[-1] * 1000, 1),
    }


def _hf_sequential(loaded: Any, batch: list[list[int]]) -> float:
    import torch

    model = loaded.model
    started = time.perf_counter()
    total = 0
    for ids in batch:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=loaded.tokenizer.pad_token_id,
        )
        total += out.shape[1] - len(ids)
    return total / (time.perf_counter() - started)


def _hf_generate_batch(loaded: Any, batch: list[list[int]]) -> float:
    import logging

    from transformers import GenerationConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=loaded.tokenizer.pad_token_id,
    )
    started = time.perf_counter()
    out = loaded.model.generate_batch(inputs=batch, generation_config=config, progress_bar=False)
    total = sum(len(v.generated_tokens) for v in out.values())
    return total / (time.perf_counter() - started)


def _engine(engine: Any, batch: list[list[int]]) -> float:
    from tiers.core.sequence import SamplingParams

    async def run() -> int:
        async def one(ids: list[int]) -> int:
            n = 0
            async for out in engine.submit(
                ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
            ):
                n += len(out.token_ids)
            return n

        return sum(await asyncio.gather(*(one(i) for i in batch)))

    started = time.perf_counter()
    total = asyncio.run(run())
    return total / (time.perf_counter() - started)


def _queued_memory(engine: Any, ids: list[list[int]]) -> dict[str, float]:
    """Submit 64 requests at once; sample RSS while they run."""
    from tiers.core.sequence import SamplingParams

    before = rss_mb()
    peak = before
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_mb())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()

    async def run() -> int:
        async def one(i: int) -> int:
            n = 0
            async for out in engine.submit(
                ids[i % len(ids)], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
            ):
                n += len(out.token_ids)
            return n

        return sum(await asyncio.gather(*(one(i) for i in range(64))))

    started = time.perf_counter()
    total = asyncio.run(run())
    elapsed = time.perf_counter() - started
    done.set()
    sampler.join()
    kv = engine.runner.kv_bytes / 2**20
    return {
        "rss_before_mb": round(before, 1),
        "rss_peak_mb": round(peak, 1),
        "growth_mb": round(peak - before, 1),
        "kv_pool_mb": round(kv, 1),
        "tokens": total,
        "seconds": round(elapsed, 2),
    }


def _plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(c, [r["engine_tok_s"] for r in rows], "o-", label="tiered-router engine (paged)")
    ax.plot(
        c, [r["dense_engine_tok_s"] for r in rows], "d-.", label=f"previous dense-slot engine ({DENSE_REV})"
    )
    ax.plot(c, [r["generate_batch_tok_s"] for r in rows], "s--", label="transformers generate_batch")
    seq = [(r["concurrency"], r["generate_sequential_tok_s"]) for r in rows if r["generate_sequential_tok_s"]]
    ax.plot([x for x, _ in seq], [y for _, y in seq], "^:", label="generate() per request")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens / s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(c, [str(x) for x in c])
    ax.set_title("Batching throughput, SmolLM2-135M fp32, 64 new tokens, greedy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot_path("batching"), dpi=120)


if __name__ == "__main__":
    main()
