"""The paged runner against independent references: HF's own forward, garbage in fresh memory,
and the fast path against the generic HF path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiers.core.block_manager import BlockTable
from tiers.kernels import cpu as cpu_kernels
from tiers.models.loading import load_model
from tiers.worker.model_runner import ModelRunner, RowInput

# The project's CPU kernels (tiers/kernels/csrc) are built for, and used only on, AVX512 hosts.
cpu_kernels_built = pytest.mark.skipif(
    cpu_kernels.host_isa() is None, reason="the CPU kernels are built for AVX512 and AVX2 hosts"
)


def runner(
    model_dir: Path, *, fast_path: bool = True, num_blocks: int = 64, quantization: str = "none"
) -> ModelRunner:
    return ModelRunner(
        load_model(str(model_dir), device="cpu", quantization=quantization),  # type: ignore[arg-type]
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=256,
        fast_path=fast_path,
    )


def table(r: ModelRunner, n: int) -> list[int]:
    t = BlockTable()
    assert r.blocks.allocate(t, n)
    return t.blocks


@pytest.mark.parametrize("fast_path", [True, False])
def test_chunked_paged_forward_matches_hfs_full_forward(tiny_model_dir: Path, fast_path: bool) -> None:
    """Prefill in two chunks, then one decode token, in a batch with an unrelated row: the logits
    equal HF's plain full-sequence forward (an independent reference)."""
    from transformers import AutoModelForCausalLM

    r = runner(tiny_model_dir, fast_path=fast_path)
    assert (r.fast is not None) == fast_path
    ids = list(range(5, 30))
    other = list(range(40, 51))
    blocks, blocks2 = table(r, 32), table(r, 16)
    r.forward([RowInput(blocks, 0, ids[:13], "none"), RowInput(blocks2, 0, other, "none")])
    got = r.forward([RowInput(blocks, 13, ids[13:24], "all"), RowInput(blocks2, 11, [7], "last")])
    last = r.forward([RowInput(blocks, 24, ids[24:], "last")])[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
        ref2 = model(torch.tensor([[*other, 7]])).logits[0, -1].float()
    assert got[0] is not None and got[1] is not None and last is not None
    torch.testing.assert_close(got[0], ref[13:24], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1][0], ref2, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last[0], ref[24], atol=1e-4, rtol=1e-4)


def test_garbage_in_fresh_pool_memory_never_reaches_attention(tiny_model_dir: Path) -> None:
    """Regression: an uninitialised pool (reused heap memory) held NaNs; masked positions of a
    gathered block still poisoned softmax(QK) @ V. Blocks are zeroed on first use."""
    clean = runner(tiny_model_dir)
    dirty = runner(tiny_model_dir)
    dirty.kv.fill_(float("nan"))
    dirty.kv[:, dirty.scratch_block].zero_()
    ids = list(range(5, 15))  # 10 tokens: the last block is half empty
    a = clean.forward([RowInput(table(clean, 10), 0, ids, "all")])[0]
    b = dirty.forward([RowInput(table(dirty, 10), 0, ids, "all")])[0]
    assert a is not None and b is not None and not torch.isnan(b).any()
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_fast_and_generic_paths_agree(tiny_model_dir: Path, quantization: str) -> None:
    """The lean path against HF's own modules. Under int4 the lean path calls the packed kernel
    directly (no module wrapper), and the tiny model's 32-wide k/v projections cannot be fused in
    the packed layout: catches a projection bound to the wrong weights, or a fused packed weight
    whose channels were scrambled (it did: logits unrelated to HF's, 0 % argmax agreement)."""
    fast = runner(tiny_model_dir, quantization=quantization)
    generic = runner(tiny_model_dir, fast_path=False, quantization=quantization)
    assert fast.fast is not None
    # Attention as HF computes it (SDPA), so a 1e-5 bound isolates the projections' wiring; the
    # paged attention kernel has its own tests against an fp64 reference and against this path.
    fast.fast._paged_attention = None
    calls = [
        c
        for layer in fast.fast.layers
        for i in (2, 4, 7, 9)
        for c in (layer[i] if isinstance(layer[i], list) else [layer[i]])
    ]
    bound = [getattr(c, "__self__", None) for c in calls]
    # Under int4 every projection is a direct kernel call (not a module's bound forward).
    assert all(b is None for b in bound) == (quantization == "int4") and bound

    def rows(r: ModelRunner) -> list[RowInput]:
        return [
            RowInput(table(r, 20), 0, list(range(3, 23)), "all"),
            RowInput(table(r, 7), 0, [9] * 7, "all"),
        ]

    a, b = fast.forward(rows(fast)), generic.forward(rows(generic))
    for x, y in zip(a, b, strict=True):
        assert x is not None and y is not None
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        assert torch.equal(x.argmax(-1), y.argmax(-1))


@cpu_kernels_built
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_fused_residual_norm_serves_the_fast_path_with_the_same_logits(
    tiny_model_dir: Path, quantization: str
) -> None:
    """The fast path's norms run the fused add + RMSNorm kernel (profiled: every norm of every
    layer, not just some), and its logits are the bits of the torch ops it replaces. Catches a
    residual add skipped or applied twice (the kernel now owns it), and the fast path silently
    falling back to the torch ops."""
    from torch.profiler import profile

    fast = runner(tiny_model_dir, quantization=quantization)
    assert fast.fast is not None and fast.fast._fused_norm is not None, "run `make kernels`"
    ids = list(range(3, 23))
    with profile() as prof:
        a = fast.forward([RowInput(table(fast, 20), 0, ids, "all")])[0]
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("tiered_router::add_rms_norm") == 2 * len(fast.fast.layers) + 1
    fast.fast._fused_norm = None
    b = fast.forward([RowInput(table(fast, 20), 0, ids, "all")])[0]
    assert a is not None and b is not None
    assert torch.equal(a, b)


@cpu_kernels_built
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_rope_kv_kernel_serves_every_layer_with_the_same_logits_and_cache(
    tiny_model_dir: Path, quantization: str
) -> None:
    """Every layer's RoPE + K/V write runs the fused kernel (profiled), and a prefill then a decode
    step give the bits of the torch ops, logits and KV pool alike. Catches the kernel fed the
    unsigned sin or another layer's pool, K/V written at the wrong slots (the decode step reads
    them back), and the fast path silently falling back to the torch ops."""
    from torch.profiler import profile

    def run(kernel: bool) -> tuple[list[torch.Tensor | None], torch.Tensor]:
        r = runner(tiny_model_dir, quantization=quantization)
        assert r.fast is not None and r.fast._rope_kv is not None, "run `make kernels`"
        if not kernel:
            r.fast._rope_kv = None
        t = table(r, 24)
        with profile() as prof:
            out = r.forward([RowInput(t, 0, list(range(3, 23)), "all")])
            out += r.forward([RowInput(t, 20, [7], "last")])
        calls = {e.key: e.count for e in prof.key_averages()}
        assert calls.get("tiered_router::rope_kv_write", 0) == (2 * len(r.fast.layers) if kernel else 0)
        return out, r.kv[:, t].clone()  # the row's blocks (the rest of the pool is never written)

    (a, pool_a), (b, pool_b) = run(True), run(False)
    for x, y in zip(a, b, strict=True):
        assert x is not None and y is not None and torch.equal(x, y)
    assert torch.equal(pool_a, pool_b)


@cpu_kernels_built
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_paged_attention_kernel_serves_short_queries_and_agrees_with_sdpa(
    tiny_model_dir: Path, quantization: str
) -> None:
    """Decode rows and short chunks run the paged kernel in every layer (profiled, no SDPA
    call), a prefill longer than PAGED_ATTENTION_MAX_Q_LEN keeps SDPA, and the logits agree
    with the SDPA path (fp32: to float noise; bf16 activations: within bf16 noise, same argmax).
    Catches the kernel wired to the wrong layer's pool or block table, rows of a mixed batch
    attending to each other's blocks, and the fast path silently falling back to SDPA."""
    from torch.profiler import profile

    from tiers.attention import selector

    fast = runner(tiny_model_dir, quantization=quantization, num_blocks=128)
    assert fast.fast is not None and fast.fast._paged_attention is not None, "run `make kernels`"
    layers = len(fast.fast.layers)
    long_q = selector.PAGED_ATTENTION_MAX_Q_LEN + 1
    t1, t2, t3 = table(fast, 40), table(fast, 12), table(fast, long_q)

    def step(r: ModelRunner, prefill: bool) -> list[torch.Tensor | None]:
        if prefill:
            return r.forward([RowInput(t1, 0, list(range(3, 39)), "all"), RowInput(t2, 0, [9] * 11, "all")])
        return r.forward([RowInput(t1, 36, [5], "last"), RowInput(t2, 11, [7], "last")])

    with profile() as prof:
        a_prefill, a_decode = step(fast, True), step(fast, False)
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("tiered_router::paged_attention") == 3 * layers  # two groups (q_len 36, 11), then one
    assert "aten::scaled_dot_product_attention" not in calls
    with profile() as prof:
        fast.forward([RowInput(t3, 0, list(range(long_q)), "last")])
    calls = {e.key: e.count for e in prof.key_averages()}
    assert "tiered_router::paged_attention" not in calls
    assert calls["aten::scaled_dot_product_attention"] == layers

    sdpa = runner(tiny_model_dir, quantization=quantization, num_blocks=128)
    assert sdpa.fast is not None
    sdpa.fast._paged_attention = None
    t1, t2 = table(sdpa, 40), table(sdpa, 12)
    b_prefill, b_decode = step(sdpa, True), step(sdpa, False)
    tol = 1e-5 if quantization == "none" else 0.15  # bf16: a few ulps of logits of magnitude ~5
    for x, y in zip([*a_prefill, *a_decode], [*b_prefill, *b_decode], strict=True):
        assert x is not None and y is not None
        torch.testing.assert_close(x, y, atol=tol, rtol=tol)
        assert torch.equal(x.argmax(-1), y.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_norm_and_rope_are_bitwise_hfs(dtype: torch.dtype) -> None:
    """The fast path's RMSNorm (one F.rms_norm) and RoPE (sign folded into sin) against HF's
    own LlamaRMSNorm and apply_rotary_pos_emb: the same bits, not just close."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from tiers.models.llama import FastDecoder

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=g).to(dtype) * 3
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g).to(dtype))
        assert torch.equal(FastDecoder._rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
    heads, dim = 5, 64
    q = torch.randn(7, heads, dim, generator=g).to(dtype)
    angles = torch.rand(7, 1, dim // 2, generator=g) * 100
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    hf_q = q.transpose(0, 1)[None]  # HF's [batch, heads, seq, dim], cos/sin [batch, seq, dim]
    ref, _ = apply_rotary_pos_emb(hf_q, hf_q, cos[None, :, 0], sin[None, :, 0], unsqueeze_dim=1)
    signed = torch.cat((-sin[..., : dim // 2], sin[..., dim // 2 :]), -1)
    assert torch.equal(FastDecoder._rotate(q, cos, signed), ref[0].transpose(0, 1))


def test_sliding_window_models_are_refused_with_a_clear_error() -> None:
    from transformers import MistralConfig

    from tiers.worker.model_runner import check_supported

    with pytest.raises(ValueError, match="sliding-window"):
        check_supported(MistralConfig(sliding_window=128), max_model_len=4096)
    check_supported(MistralConfig(sliding_window=8192), max_model_len=4096)  # wider than the context
