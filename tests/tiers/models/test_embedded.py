"""The real embedded default (SmolLM2-135M-Instruct): loading, coherent text, batching and drafting."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tiers.core.sequence import SamplingParams
from tiers.engine.llm_engine import Engine
from tiers.worker.device import DeviceWorker

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "hi",
    "List three fruits.",
    "What is 2+2?",
    "Translate 'good morning' to Spanish.",
    "Give me a tip for learning Python.",
]


def build(
    worker: DeviceWorker,
    embedded_model_dir: Path,
    quantization: str,
    draft: str | None = None,
    **load_kw: Any,
) -> Engine:
    from tiers.core.sched.scheduler import SchedulerConfig
    from tiers.models.loading import load_model
    from tiers.worker.model_runner import ModelRunner

    def make() -> Engine:
        target = load_model("embedded:smollm2-135m-instruct", quantization=quantization, **load_kw)  # type: ignore[arg-type]
        draft_runner = None
        if draft is not None:
            d = load_model("embedded:smollm2-135m-instruct", quantization=draft)  # type: ignore[arg-type]
            draft_runner = ModelRunner(d, num_blocks=512, block_size=16, max_model_len=512)
        eng = Engine(
            f"real-{quantization}",
            ModelRunner(target, num_blocks=512, block_size=16, max_model_len=512),
            SchedulerConfig(max_num_seqs=16, max_model_len=512, max_num_batched_tokens=256),
            draft_runner=draft_runner,
            speculative_tokens=4 if draft else 0,
        )
        eng.warmup()
        return eng

    eng = worker.call(make)
    eng.attach(worker)
    return eng


@pytest.fixture(scope="module")
def large(worker: DeviceWorker, embedded_model_dir: Path) -> Engine:
    return build(worker, embedded_model_dir, "none", draft="int8")


def encode(engine: Engine, question: str) -> list[int]:
    out = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


async def run(engine: Engine, ids: list[int], max_tokens: int) -> tuple[list[int], str, Any]:
    toks: list[int] = []
    text = ""
    last = None
    async for out in engine.submit(ids, SamplingParams(max_tokens=max_tokens, temperature=0)):
        toks += out.token_ids
        text += out.text
        last = out
    return toks, text, last


def test_materialized_cache_loads_fast(embedded_model_dir: Path) -> None:
    import time

    from tiers.models.loading import materialize_embedded

    assert (embedded_model_dir / "model.safetensors").is_file()
    started = time.monotonic()
    assert materialize_embedded("smollm2-135m-instruct") == embedded_model_dir
    assert time.monotonic() - started < 1.0


async def test_capital_of_france(large: Engine) -> None:
    _, text, last = await run(large, encode(large, "What is the capital of France?"), 30)
    assert "Paris" in text and last.finish_reason == "stop"


async def test_batch_of_16_equals_alone_on_the_real_model(large: Engine) -> None:
    """Greedy, mixed lengths, with speculation left to the controller. Batched fp32 matmuls may
    round differently from single-row ones; on this model and these prompts no token flips."""
    ids = [encode(large, q) for q in QUESTIONS] * 2
    lengths = [8 + 3 * (i % 6) for i in range(16)]
    alone = [await run(large, p, n) for p, n in zip(ids, lengths, strict=True)]
    together = await asyncio.gather(*(run(large, p, n) for p, n in zip(ids, lengths, strict=True)))
    assert [t[0] for t in together] == [a[0] for a in alone]


async def test_prefix_hits_and_drafts_keep_greedy_output(large: Engine) -> None:
    """A shared system prompt: later requests hit the prefix cache (target and draft pools) and
    still produce exactly the cold run's tokens, drafting or not."""
    system = "You are a careful assistant. " * 12

    def chat(q: str) -> list[int]:
        out = large.tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
        )
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    cold = await run(large, chat(QUESTIONS[0]), 16)
    large.spec.fixed_k = 4
    try:
        warm = await asyncio.gather(*(run(large, chat(q), 16) for q in QUESTIONS[:4]))
    finally:
        large.spec.fixed_k = None
    assert warm[0][0] == cold[0]
    a, b = chat(QUESTIONS[0]), chat(QUESTIONS[1])
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared >= 64
    # Served to the token: whole blocks, then a copy of the cold run's block for the rest of the
    # common prefix (all but the last token for the same question).
    for q, w in zip(QUESTIONS[:4], warm, strict=True):
        ids = chat(q)
        common = next((i for i, (x, y) in enumerate(zip(a, ids, strict=False)) if x != y), len(ids))
        assert w[2].num_cached_tokens == min(common, len(ids) - 1) > shared // 16 * 16
    assert sum(w[2].num_draft_tokens for w in warm) > 0


async def test_drafting_is_lossless_on_the_real_model(
    worker: DeviceWorker, embedded_model_dir: Path, large: Engine
) -> None:
    plain = build(worker, embedded_model_dir, "none")
    ids = [encode(large, q) for q in QUESTIONS]
    large.spec.fixed_k = 4
    try:
        spec_out = await asyncio.gather(*(run(large, p, 24) for p in ids))
    finally:
        large.spec.fixed_k = None
    plain_out = await asyncio.gather(*(run(plain, p, 24) for p in ids))
    assert [s[0] for s in spec_out] == [p[0] for p in plain_out]
    assert sum(s[2].num_accepted_tokens for s in spec_out) > 0


async def test_w4a8_small_tier_is_coherent_batch_invariant_and_runs_the_kernel(
    worker: DeviceWorker, embedded_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default small tier's operating point (int4 g64, int4 head, int8 activations): the W4A8
    kernel serves its projections (counted), it answers sensibly, and 16 greedy requests together
    give exactly their tokens alone - each row's activation scales are its own, so unlike a
    batched float GEMM nothing may differ with the batch."""
    from tiers.kernels import cpu as cpu_kernels
    from tiers.layers.quantization import int4

    op = cpu_kernels.w4a8_mm_op()
    if op is None:
        pytest.skip("kernels not built for this host: the torch path is tested in test_quant.py")
    calls = [0]

    def counting(*args: Any) -> Any:
        calls[0] += 1
        return op(*args)

    monkeypatch.setattr(int4, "_w4a8_op", lambda: counting)
    small = build(worker, embedded_model_dir, "int4", group_size=64, int4_head=True, int8_activations=True)
    try:
        calls[0] = 0  # warm-up's forwards aside
        toks, text, _ = await run(small, encode(small, "What is the capital of France?"), 30)
        assert "Paris" in text
        assert calls[0] >= len(toks) * (30 * 4 + 1)  # 4 fused projections a layer, 30 layers, the head
        ids = [encode(small, q) for q in QUESTIONS] * 2
        lengths = [8 + 3 * (i % 6) for i in range(16)]
        alone = [await run(small, p, n) for p, n in zip(ids, lengths, strict=True)]
        together = await asyncio.gather(*(run(small, p, n) for p, n in zip(ids, lengths, strict=True)))
        assert [t[0] for t in together] == [a[0] for a in alone]
    finally:
        worker.remove_engine(small)
