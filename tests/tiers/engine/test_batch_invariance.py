"""Batch invariance (issue 34): a temperature-0 prompt gets the same answer whatever else runs.

Two levels. The runner: a row's logits, bitwise, alone vs beside 7 decodes vs beside a prompt
chunk, and a prompt fed whole vs in two chunks, with each GEMM and attention path the code can
pick forced in turn (and counted, so the forced path is the one that ran). The engine: the three
tiers of the default policy over the tiny model (small: int4 g64 W4A8 with n-gram drafts, medium:
int4 g32 W4A8 drafting with small, large: fp32 drafting with medium), drafting forced on and off,
8 prompts sharing a system prompt, alone vs inside a burst of 32 mixed requests (max_tokens 1, 24,
fillers) vs after it (prefix-cache hits), with a small token budget (chunked prompts).

What the runner-level tests pin on this code: every quantized path (int8, int4 on torch's kernel
or the tiled one, W4A8) and the fp32 packed linears the policy's ``batch_invariant`` builds (one
packed GEMM at every row count, the library checked on this CPU: ``tiers.layers.fp32_packed``) are
bitwise invariant to the batch; with the paged attention kernel at every query length (what
``batch_invariant``, on by default, selects) also to chunk boundaries. What does not hold,
measured: gather + SDPA at every length is batch-invariant but not chunk-invariant on an Intel
AVX512 VM (its GEMMs reblock by query count: a prompt whole vs in 40 + 40 differs), and without
``batch_invariant`` the attention switch at ``PAGED_ATTENTION_MAX_Q_LEN`` query tokens makes a
prompt chunk of 65+ tokens and the same tokens in smaller chunks differ (bf16 tiers: ~0.1 in the
logits; fp32: ~1e-5); fp32 through torch's own GEMM (unpacked ``nn.Linear``, MKL's packed GEMM
at 4-16 rows only, HF's generic forward) gives a decode row 3e-6 to 5e-5 apart alone vs batched.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiers.attention import selector
from tiers.core.block_manager import BlockTable
from tiers.core.sched.scheduler import SchedulerConfig
from tiers.core.sequence import SamplingParams
from tiers.engine.llm_engine import Engine
from tiers.kernels import cpu as cpu_kernels
from tiers.layers import fp32_packed
from tiers.layers.quantization import int4, mixed_head
from tiers.models import llama as fast_forward
from tiers.models.loading import load_model
from tiers.spec_decode.ngram import NgramProposer
from tiers.worker.device import DeviceWorker
from tiers.worker.model_runner import ModelRunner, RowInput

# -- the runner: logits, bitwise ----------------------------------------------------------------


def _runner(model_dir: Path, quantization: str, **kw: Any) -> ModelRunner:
    loaded = load_model(str(model_dir), device="cpu", quantization=quantization, **kw)  # type: ignore[arg-type]
    return ModelRunner(loaded, num_blocks=512, block_size=4, max_model_len=256, enable_prefix_caching=False)


def _forward(runner: ModelRunner, rows: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Each row: ``(context, fed)``: the context is written first (a forward of its own), then
    every row's ``fed`` tokens run in one forward; returns each row's logits at every fed token."""
    tables = []
    inputs = []
    try:
        for context, fed in rows:
            table = BlockTable()
            assert runner.blocks.allocate(table, len(context) + len(fed))
            tables.append(table)
            if context:
                runner.forward([RowInput(table.blocks, 0, context, "none")])
            inputs.append(RowInput(table.blocks, len(context), fed, "all"))
        out = runner.forward(inputs)
        return [o for o in out if o is not None]
    finally:
        for table in tables:
            runner.blocks.free(table)


def _counting(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """Wrap ``owner.name`` (a function returning a kernel, or None) so the kernel's calls count."""
    calls = [0]
    real = getattr(owner, name)

    def factory(*args: Any) -> Any:
        op = real(*args)
        if op is None:
            return None

        def counted(*a: Any) -> Any:
            calls[0] += 1
            return op(*a)

        return counted

    monkeypatch.setattr(owner, name, factory)
    return calls


def _ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 380) for _ in range(n)]


GEMMS: dict[str, dict[str, Any]] = {
    "int8": {"quantization": "int8"},
    "int4-torch": {"quantization": "int4"},
    "int4-tiled": {"quantization": "int4"},
    "w4a8": {"quantization": "int4", "int8_activations": True},
    "fp32-mkl": {"quantization": "none", "batch_invariant": True},
    "fp32-onednn": {"quantization": "none", "batch_invariant": True},
}
"""The fp32 entries load as the policy's ``batch_invariant`` does, with one library preferred;
each linear keeps it where it passes ``fp32_packed.is_batch_invariant`` on this CPU, else takes
the other."""


@pytest.fixture(params=["paged", "sdpa"])
def one_attention_kernel(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, list[int]]]:
    """Every query length on one attention kernel: the CPU paged kernel, or gather + SDPA.
    Yields the kernel's name and the count of its calls."""
    if request.param == "paged":
        if cpu_kernels.paged_attention_op() is None:
            pytest.skip("the paged attention kernel is not built on this host")
        monkeypatch.setattr(selector, "PAGED_ATTENTION_MAX_Q_LEN", 1 << 30)
        yield "paged", _counting(monkeypatch, cpu_kernels, "paged_attention_op")
    else:
        monkeypatch.setattr(selector, "PAGED_ATTENTION_MAX_Q_LEN", 0)
        calls = [0]
        real = fast_forward.F.scaled_dot_product_attention

        def sdpa(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            return real(*a, **k)

        monkeypatch.setattr(fast_forward.F, "scaled_dot_product_attention", sdpa)
        yield "sdpa", calls


def _force_gemm(path: str, monkeypatch: pytest.MonkeyPatch) -> list[int] | None:
    """Force ``path``'s GEMM; returns the count of its custom kernel's calls where it has one."""
    if path == "int4-torch":
        monkeypatch.setattr(int4, "TILED_INT4_MIN_ROWS", 1 << 30)
    elif path == "int4-tiled":
        if cpu_kernels.int4_mm_op() is None:
            pytest.skip("the tiled int4 kernel is not built on this host")
        monkeypatch.setattr(int4, "TILED_INT4_MIN_ROWS", 1)
        return _counting(monkeypatch, int4, "_tiled_int4_op")
    elif path == "w4a8":
        if cpu_kernels.w4a8_mm_op() is None:
            pytest.skip("the W4A8 kernel is not built on this host")
        return _counting(monkeypatch, int4, "_w4a8_op")
    elif path.startswith("fp32-"):
        preferred = path.removeprefix("fp32-")
        if not fp32_packed._supported(preferred):  # type: ignore[arg-type]
            pytest.skip(f"{preferred}'s packed fp32 linear is not available")
        monkeypatch.setattr(fp32_packed, "PACKED_MIN_WEIGHT_ELEMENTS", 0)
        monkeypatch.setattr(fp32_packed, "fp32_gemm_backend", lambda: preferred)
        # The one/two-row GEMV where built, as on an AVX512 AMD host: invariance must turn it off.
        monkeypatch.setattr(fp32_packed, "F32_GEMV_MAX_ROWS", 2)
        return _counting(monkeypatch, fp32_packed, "_f32_gemv_op")
    return None


@pytest.mark.parametrize("path", list(GEMMS))
def test_a_rows_logits_do_not_depend_on_the_batch_or_the_chunking(
    path: str,
    one_attention_kernel: tuple[str, list[int]],
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches a GEMM or attention kernel whose result for one row depends on the other rows of
    its call (a blocking chosen by row count, a reduction split by batch) or on where a prompt's
    chunks start: bitwise, a decode row alone = beside 7 decodes = beside a 40-token chunk, a prompt
    alone = beside 7 decodes, and an 80-token prompt fed whole = fed 40 + 40."""
    kernel_calls = _force_gemm(path, monkeypatch)
    runner = _runner(tiny_model_dir, **GEMMS[path])
    if path.startswith("fp32-"):
        head = runner.model.lm_head
        assert isinstance(head, fp32_packed.PackedFp32Linear) and head.invariant
        assert head.packed_rows is fp32_packed.PackedFp32Linear.EVERY_ROW_COUNT
    rng = random.Random(34)
    context, prompt = _ids(30, rng), _ids(80, rng)
    decodes = [(_ids(20, rng), _ids(1, rng)) for _ in range(7)]
    attention, calls = one_attention_kernel
    calls[0] = 0
    alone = _forward(runner, [(context, context[-1:])])[0]
    beside_decodes = _forward(runner, [(context, context[-1:]), *decodes])[0]
    beside_chunk = _forward(runner, [(context, context[-1:]), ([], _ids(40, rng)), *decodes[:3]])[0]
    assert torch.equal(alone, beside_decodes)
    assert torch.equal(alone, beside_chunk)
    whole = _forward(runner, [([], prompt)])[0]
    assert torch.equal(whole, _forward(runner, [([], prompt), *decodes])[0])
    if attention == "paged":
        assert torch.equal(whole[40:], _forward(runner, [(prompt[:40], prompt[40:])])[0])
    assert calls[0] > 0  # the forced attention kernel served these forwards
    if kernel_calls is not None:
        assert kernel_calls[0] == 0 if path.startswith("fp32-") else kernel_calls[0] > 0


# -- the engine: tokens, the default policy's three tiers ----------------------------------------

SYSTEM = list(range(40, 64))
"""A system prompt every request shares (24 tokens: six full blocks, cache hits after the first)."""


def _tier(model_dir: Path, quantization: str, batch_invariant: bool = False, **kw: Any) -> ModelRunner:
    loaded = load_model(str(model_dir), device="cpu", quantization=quantization, **kw)  # type: ignore[arg-type]
    return ModelRunner(
        loaded,
        num_blocks=1024,
        block_size=4,
        max_model_len=256,
        enable_prefix_caching=True,
        batch_invariant=batch_invariant,
    )


def _build_tiers(
    worker: DeviceWorker, model_dir: Path, budget: int, batch_invariant: bool = False
) -> dict[str, Engine]:
    """The default policy's tiers over the tiny model: small (int4 g64, int4 head, W4A8, n-gram
    drafts), medium (int4 g32, W4A8, a head int8 on its first rows and int4 on the rest, drafts
    with small's runner), large (fp32, drafts with medium's), each stepping at most ``budget``
    tokens (prompts run in chunks of it, and of half of it while others decode or wait)."""

    def build() -> dict[str, Engine]:
        inv = batch_invariant
        small = _tier(model_dir, "int4", inv, group_size=64, int4_head=True, int8_activations=True)
        medium = _tier(
            model_dir, "int4", inv, group_size=32, int4_head=True, int8_head_rows=128, int8_activations=True
        )
        assert isinstance(medium.lm_head, mixed_head.MixedHead)
        large = _tier(model_dir, "none", inv)
        config = SchedulerConfig(
            max_num_seqs=16, max_model_len=256, max_num_batched_tokens=budget, max_waiting=64
        )
        ngram = NgramProposer(2 * small.blocks.num_blocks, small.block_size)
        drafts: list[tuple[str, ModelRunner, ModelRunner | NgramProposer]] = [
            ("small", small, ngram),
            ("medium", medium, small),
            ("large", large, medium),
        ]
        engines = {}
        for name, runner, draft in drafts:
            engine = Engine(name, runner, config, draft_runner=draft, speculative_tokens=4)
            engine.warmup()
            engines[name] = engine
        return engines

    engines = worker.call(build)
    for engine in engines.values():
        engine.attach(worker)
    return engines


@pytest.fixture(scope="module")
def tiers(worker: DeviceWorker, tiny_model_dir: Path) -> dict[str, Engine]:
    """A 32-token budget: every chunk stays within the paged attention kernel's query lengths."""
    return _build_tiers(worker, tiny_model_dir, 32)


@pytest.fixture(scope="module")
def wide_tiers(worker: DeviceWorker, tiny_model_dir: Path) -> dict[str, Engine]:
    """A 128-token budget: a long prompt alone runs as one chunk of more than 64 tokens, inside a
    burst as chunks of at most 64; the runners as the policy's ``batch_invariant`` (the default)
    builds them."""
    return _build_tiers(worker, tiny_model_dir, 128, batch_invariant=True)


async def _answer(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], int, int]:
    """Greedy tokens, the prompt tokens served from the prefix cache, and the tokens drafted."""
    tokens: list[int] = []
    last = None
    async for out in engine.submit(
        prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ):
        tokens += out.token_ids
        last = out
    assert last is not None and last.finish_reason == "length"
    return tokens, last.num_cached_tokens, last.num_draft_tokens


async def _alone_burst_after(
    engine: Engine, rng: random.Random, prompt_lens: tuple[int, int], drafting: bool
) -> None:
    """8 prompts sharing ``SYSTEM`` (and ``prompt_lens`` more tokens each) answered alone, inside a
    burst of 32 mixed requests, and after it: token for token the same answers."""
    prompts = [SYSTEM + _ids(rng.randrange(*prompt_lens), rng) for _ in range(8)]
    fillers = [(_ids(rng.randrange(3, 60), rng), rng.choice([1, 24])) for _ in range(24)]
    engine.spec.fixed_k = 4 if drafting else 0
    try:
        alone = [await _answer(engine, p, 16) for p in prompts]
        burst = [(p, 16) for p in prompts] + fillers
        order = list(range(len(burst)))
        rng.shuffle(order)
        results = await asyncio.gather(*(_answer(engine, *burst[i]) for i in order))
        together = [results[order.index(i)] for i in range(len(prompts))]
        after = [await _answer(engine, p, 16) for p in prompts]
    finally:
        engine.spec.fixed_k = None
    assert [r[0] for r in together] == [r[0] for r in alone]
    assert [r[0] for r in after] == [r[0] for r in alone]
    assert all(cached >= len(SYSTEM) for _, cached, _ in after)  # the prefix cache served them
    drafted = sum(r[2] for r in [*alone, *results, *after])
    assert drafted > 0 if drafting else drafted == 0


TIERS = ["small", "medium", "large"]


@pytest.mark.parametrize("drafting", [True, False], ids=["drafting", "plain"])
@pytest.mark.parametrize("tier", TIERS)
async def test_a_greedy_answer_is_the_same_alone_inside_a_burst_and_after_it(
    tiers: dict[str, Engine], tier: str, drafting: bool
) -> None:
    """Catches an answer that depends on other traffic: 8 prompts sharing a system prompt get,
    token for token, the same answer alone, inside a burst of 32 mixed requests (1-token and
    24-token answers, other prompts: other batch sizes, chunk boundaries and k) and after it
    (their prompts then mostly prefix-cache hits); with drafting forced on (k = 4, and drafts
    were verified) and off (no draft token at all)."""
    rng = random.Random(34 + 2 * TIERS.index(tier) + drafting)
    await _alone_burst_after(tiers[tier], rng, (4, 30), drafting)


@pytest.mark.parametrize("drafting", [True, False], ids=["drafting", "plain"])
@pytest.mark.parametrize("tier", TIERS)
async def test_long_prompts_answer_the_same_however_chunked_with_one_attention_kernel(
    wide_tiers: dict[str, Engine], tier: str, drafting: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of 74-113 tokens: alone one chunk of more than 64 queries, in a burst chunks of at
    most 64. With ``batch_invariant`` (the policy default) the paged attention kernel serves every
    query length and the answers stay the same. (Without it, gather + SDPA past 64 queries, they
    do not: measured, all 4 small and medium cases differ on the tiny model; large held.) Catches
    the flag not reaching the runner, and any other source of chunk dependence."""
    if cpu_kernels.paged_attention_op() is None:
        pytest.skip("the paged attention kernel is not built on this host")
    sdpa_calls = [0]
    real = fast_forward.F.scaled_dot_product_attention

    def sdpa(*a: Any, **k: Any) -> Any:
        sdpa_calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(fast_forward.F, "scaled_dot_product_attention", sdpa)
    rng = random.Random(340 + 2 * TIERS.index(tier) + drafting)
    await _alone_burst_after(wide_tiers[tier], rng, (50, 90), drafting)
    assert sdpa_calls[0] == 0  # the paged kernel served every chunk, the long ones included
