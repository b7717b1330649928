"""The project's CPU kernels against independent implementations of the same arithmetic.

The tiled int4 GEMM against torch's own int4 kernel: bit-for-bit at every row count, shape and group
size the tiers use, and actually serving the int4 projections from ``TILED_INT4_MIN_ROWS`` rows.
The fp32 GEMV against an fp64 reference, and batch-invariant bit for bit.
The fused residual add + RMSNorm against HF's ``LlamaRMSNorm`` and torch's add: bit-for-bit. The
paged attention kernel against an fp64 reference (it is not bitwise torch's flash kernel)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tiers.kernels import cpu as cpu_kernels
from tiers.layers import fp32_packed
from tiers.layers.quantization import int4, int8, rewrite
from tiers.layers.quantization.int4 import Int4WeightOnlyLinear

pytestmark = pytest.mark.skipif(
    cpu_kernels.host_isa() is None,
    reason="the kernels reproduce torch's AVX512 or AVX2 kernels and are used only where torch runs one",
)


@pytest.fixture(scope="module")
def op() -> object:
    got = cpu_kernels.int4_mm_op()
    # On an AVX512 or AVX2 host a missing build is a broken install, not a reason to skip.
    assert got is not None, f"tiled int4 kernel not built at {cpu_kernels.library_path()}: run `make kernels`"
    return got


def packed(n: int, k: int, group: int, seed: int = 0) -> Int4WeightOnlyLinear:
    torch.manual_seed(seed)
    return Int4WeightOnlyLinear(nn.Linear(k, n, bias=False), group)


# SmolLM2-135M's fused qkv, o, gate_up and down shapes; group sizes of the small (64) and medium
# (32) tiers; a 128 group and a K that is one group.
@pytest.mark.parametrize(
    ("n", "k", "group"),
    [(960, 576, 64), (576, 576, 32), (3072, 576, 64), (576, 1536, 32), (128, 256, 128), (64, 64, 64)],
)
def test_bitwise_equal_to_torchs_kernel_at_every_row_count(
    op: object, threads: int, n: int, k: int, group: int
) -> None:
    """Catches a wrong nibble-to-channel map, scales paired with the wrong channels, a changed
    accumulation order or rounding, and lost rows at the tile tails (12 rows per tile)."""
    lin = packed(n, k, group)
    for m in (1, 3, 5, 11, 12, 13, 16, 24, 25, 40):
        x = (torch.randn(m, k) * 3).to(torch.bfloat16)
        ref = torch._weight_int4pack_mm_for_cpu(x, lin.weight_q, group, lin.scales_and_zeros)
        got = op(x, lin.weight_q, group, lin.scales_and_zeros)  # type: ignore[operator]
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), f"m={m}"


def test_shapes_it_cannot_take_are_refused_with_the_reason(op: object) -> None:
    # 48 channels: not whole blocks of either packed layout (64 channels on AVX512, 32 on AVX2)
    lin = packed(48, 64, 32)
    with pytest.raises(RuntimeError, match="N=48 is not a multiple of"):
        op(torch.zeros(8, 64, dtype=torch.bfloat16), lin.weight_q, 32, lin.scales_and_zeros)  # type: ignore[operator]
    assert int4._tiled_int4_op(48) is None  # so the layer keeps torch's kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("width", [1, 7, 8, 12, 20, 64, 100, 576, 1536, 5000, 40000])
def test_fused_add_rms_norm_is_bitwise_hfs(threads: int, dtype: torch.dtype, width: int) -> None:
    """Catches a changed summation order of the mean of squares (torch's 4-way cascade over
    8-lane vectors, the scalar tail and lane fold; widths cover rows shorter than a vector, tails
    and the cascade's higher levels), a missing rounding of the normed row to bf16 before the
    weight, a residual sum not rounded to the activation dtype, and rows lost between threads."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    op = cpu_kernels.add_rms_norm_op()
    assert op is not None, f"CPU kernels not built at {cpu_kernels.library_path()}: run `make kernels`"
    g = torch.Generator().manual_seed(width)
    norm = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_((torch.rand(width, generator=g) + 0.5).to(dtype))
        for rows in (1, 5, 16, 33) if width < 40000 else (1, 3):
            h = (torch.randn(rows, width, generator=g) * 3).to(dtype)
            delta = torch.randn(rows, width, generator=g).to(dtype)
            none_out, y0 = op(h, None, norm.weight, norm.variance_epsilon)
            assert none_out is None  # h is unchanged without a delta, so it is not returned
            assert torch.equal(y0, norm(h)), f"rows={rows}, no delta"
            h2, y = op(h, delta, norm.weight, norm.variance_epsilon)
            assert torch.equal(h2, h + delta) and torch.equal(y, norm(h + delta)), f"rows={rows}"
            strided = torch.cat((h, h), dim=1)[:, :width]  # not contiguous: copied, same bits
            assert torch.equal(op(strided, delta, norm.weight, norm.variance_epsilon)[1], y)


def test_fused_add_rms_norm_refuses_mixed_dtypes_with_the_reason() -> None:
    op = cpu_kernels.add_rms_norm_op()
    assert op is not None
    h = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight must be"):
        op(h, None, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="delta must match"):
        op(h, torch.zeros(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5)


def test_a_changed_source_never_loads_the_old_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's name hashes every source and header: editing any one gets a new path, so a stale
    .so from before the edit is not picked up."""
    before = cpu_kernels.library_path()
    sources = sorted([*cpu_kernels._SOURCE_DIR.glob("*.cpp"), *cpu_kernels._SOURCE_DIR.glob("*.h")])
    assert sources, "no kernel sources found"
    for src in sources:
        (tmp_path / src.name).write_bytes(src.read_bytes())
    monkeypatch.setattr(cpu_kernels, "_SOURCE_DIR", tmp_path)
    assert cpu_kernels.library_path().name == before.name  # same bytes, same build
    for src in sources:
        edited = tmp_path / src.name
        original = edited.read_bytes()
        edited.write_bytes(original + b"\n// edited\n")
        assert cpu_kernels.library_path().name != before.name, src.name
        edited.write_bytes(original)


def test_each_instruction_set_has_its_own_build() -> None:
    """The AVX512 and AVX2 builds differ in packed int4 layout and arithmetic: a host must never
    load the other's library (an AVX2 host would fault on AVX512 code; an AVX512 host would read
    torch's 64-channel packing as 32-channel blocks). The name carries the ISA and the flags' hash."""
    paths = {isa: cpu_kernels.library_path(isa) for isa in cpu_kernels.ISA_FLAGS}
    assert len({p.name for p in paths.values()}) == len(paths)
    for isa, path in paths.items():
        assert f"-{isa.lower()}-" in path.name
    assert cpu_kernels.library_path() == paths[cpu_kernels.host_isa()]  # type: ignore[index]


def _profiled_keys(fn: object) -> set[str]:
    from torch.profiler import profile

    with profile() as prof:
        fn()  # type: ignore[operator]
    return {e.key for e in prof.key_averages()}


def test_int4_layers_switch_to_it_from_the_row_threshold_with_the_same_bits(
    op: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the module and the fast path's direct call: below the threshold torch's kernel
    runs, from it the tiled one does (profiled), and the outputs equal the torch-only path."""
    lin = packed(192, 128, 64)
    direct = rewrite.direct_kernel(lin, torch.bfloat16)
    rows = int4.TILED_INT4_MIN_ROWS
    x_few, x_many = (torch.randn(r, 128).to(torch.bfloat16) for r in (rows - 1, rows + 11))
    with torch.no_grad():
        for fn in (lin, direct):
            keys_few = _profiled_keys(lambda fn=fn: fn(x_few))
            keys_many = _profiled_keys(lambda fn=fn: fn(x_many))
            assert "tiered_router::int4_mm" not in keys_few
            assert "aten::_weight_int4pack_mm_for_cpu" in keys_few
            assert "tiered_router::int4_mm" in keys_many
        tiled_out = lin(x_many)
        monkeypatch.setattr(int4, "_tiled_int4_op", lambda n: None)
        keys = _profiled_keys(lambda: lin(x_many))
        assert "tiered_router::int4_mm" not in keys
        assert torch.equal(lin(x_many), tiled_out)


def _attention_fp64(
    q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, starts: torch.Tensor, q_len: int, scale: float
) -> torch.Tensor:
    """Causal GQA attention in fp64, one query at a time, keys looked up position by position: an
    independent reading of the block table (no gather of whole blocks, no mask tensor)."""
    bs, kv_heads, heads = pool.shape[1], pool.shape[3], q.shape[1]
    out = []
    for r in range(table.shape[0]):
        for t in range(q_len):
            pos = torch.arange(int(starts[r]) + t + 1)
            kv = pool[table[r][pos // bs], pos % bs].double()  # [visible, 2, kv_heads, dim]
            k = kv[:, 0].repeat_interleave(heads // kv_heads, dim=1)  # [visible, heads, dim]
            v = kv[:, 1].repeat_interleave(heads // kv_heads, dim=1)
            p = (torch.einsum("hd,jhd->hj", q[r * q_len + t].double(), k) * scale).softmax(-1)
            out.append(torch.einsum("hj,jhd->hd", p, v))
    return torch.stack(out)


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
    ids=["bf16", "fp32", "bf16-q-fp32-kv"],
)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 16), (8, 1, 128), (4, 4, 32)])
@pytest.mark.parametrize("q_len", [1, 5, 40])
def test_paged_attention_matches_an_fp64_reference(
    threads: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int, dim: int, q_len: int
) -> None:
    """Rows of different lengths (0 to 150 earlier positions) over shuffled blocks, NaN in every
    pool slot a query must not see. Catches a wrong block/offset lookup, a query seeing a later
    token or a padded slot (NaN), a GQA head paired with the wrong KV head, and a lost tail of the
    vectorised exp (lengths not multiples of 16)."""
    op = cpu_kernels.paged_attention_op()
    assert op is not None
    torch.manual_seed(q_len * 131 + dim)
    bs, starts = 16, torch.tensor([0, 150, 17, 33])
    per_row = [(int(s) + q_len + bs - 1) // bs for s in starts]
    width = max(per_row)
    pool = torch.full((sum(per_row) + 3, bs, 2, kv_heads, dim), float("nan"))
    order = torch.randperm(pool.shape[0])
    table = torch.zeros(len(starts), width, dtype=torch.long)
    used = 0
    for r, n in enumerate(per_row):
        table[r, :n] = order[used : used + n]
        used += n
        visible = int(starts[r]) + q_len
        for j in range(visible):  # only the slots some query of this row sees hold data
            pool[table[r, j // bs], j % bs] = torch.randn(2, kv_heads, dim) * 4
    pool = pool.to(kv_dtype)
    # A strided view of a [tokens, heads + kv_heads, dim] tensor, as the fast path passes q.
    q = (torch.randn(len(starts) * q_len, heads + kv_heads, dim) * 4).to(q_dtype)[:, :heads]
    got = op(q, pool, table, starts, q_len, dim**-0.5)
    want = _attention_fp64(q, pool, table, starts, q_len, dim**-0.5)
    assert got.dtype == q_dtype and not torch.isnan(got).any()
    # fp32 scores of magnitude ~50 carry ~1e-5 absolute error into exp; bf16 adds one final rounding.
    atol, rtol = (5e-5, 1e-4) if q_dtype == torch.float32 else (8e-3, 8e-3)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


def test_paged_attention_refuses_inputs_it_would_misread_with_the_reason() -> None:
    """A block index outside the pool would read foreign memory; a row longer than its table, a
    token count that is not rows * q_len or an unsupported head size would be misread silently."""
    op = cpu_kernels.paged_attention_op()
    assert op is not None
    pool = torch.zeros(4, 16, 2, 2, 64)
    q = torch.zeros(2, 4, 64)
    table = torch.tensor([[0, 1], [2, 3]])
    op(q, pool, table, torch.tensor([5, 31]), 1, 0.125)  # the valid call runs
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(q, pool, torch.tensor([[0, 1], [2, 9]]), torch.tensor([5, 31]), 1, 0.125)
    with pytest.raises(RuntimeError, match="past its block table"):
        op(q, pool, table, torch.tensor([5, 32]), 1, 0.125)
    with pytest.raises(RuntimeError, match="rows \\* q_len"):
        op(q, pool, table, torch.tensor([5, 31]), 2, 0.125)
    with pytest.raises(RuntimeError, match="head_dim"):
        op(torch.zeros(2, 4, 48), torch.zeros(4, 16, 2, 2, 48), table, torch.tensor([5, 31]), 1, 0.125)


def _rope_kv_torch(
    y: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """The fast path's torch ops, written out independently: rotate_half by cat, per-op roundings."""
    n, kv_heads, dim = y.shape[0], pool.shape[3], pool.shape[4]
    x = y[:, : (heads + kv_heads) * dim].reshape(n, heads + kv_heads, dim)
    half = dim // 2
    qk = x * cos[:, None] + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin[:, None]
    v = y[:, (heads + kv_heads) * dim :].reshape(n, kv_heads, dim)
    pool.view(-1, 2, kv_heads, dim)[slots] = torch.stack((qk[:, heads:], v), dim=1)
    return qk[:, :heads]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "n"), [(9, 3, 64, 1), (9, 3, 64, 40), (4, 2, 16, 5), (8, 1, 128, 3)]
)
def test_rope_kv_write_is_bitwise_the_torch_ops(
    threads: int, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, n: int
) -> None:
    """q and every pool slot after the write equal the torch ops bit for bit. Catches rotate_half's
    halves swapped or its sign lost, a missing rounding of either product to bf16 (or an FMA in
    fp32), K written rotated into V's place or V rotated, a wrong slot, and a write that touches
    any other slot (the rest of the pool is compared too)."""
    op = cpu_kernels.rope_kv_write_op()
    assert op is not None
    g = torch.Generator().manual_seed(n * dim)
    y = (torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype)
    angles = torch.randint(0, 2000, (n, 1), generator=g).float() * torch.rand(dim // 2, generator=g)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    signed_sin = torch.cat((-sin[:, : dim // 2], sin[:, dim // 2 :]), dim=-1)
    pool = (torch.randn(6, 16, 2, kv_heads, dim, generator=g)).to(dtype)
    want_pool = pool.clone()
    slots = torch.randperm(96, generator=g)[:n]
    got_q = op(y, cos, signed_sin, pool, slots, heads, kv_heads)
    want_q = _rope_kv_torch(y, cos, signed_sin, want_pool, slots, heads)
    assert got_q.shape == (n, heads, dim)
    assert torch.equal(got_q, want_q)
    assert torch.equal(pool, want_pool)


def test_rope_kv_write_refuses_what_it_would_misread_with_the_reason() -> None:
    op = cpu_kernels.rope_kv_write_op()
    assert op is not None
    y, cs = torch.zeros(2, 5 * 16), torch.zeros(2, 16)
    pool = torch.zeros(2, 4, 2, 2, 16)  # 8 positions
    op(y, cs, cs, pool, torch.tensor([0, 7]), 1, 2)  # the valid call runs
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(y, cs, cs, pool, torch.tensor([0, 8]), 1, 2)
    with pytest.raises(RuntimeError, match="heads \\+ 2 kv_heads"):
        op(y, cs, cs, pool, torch.tensor([0, 1]), 2, 2)
    with pytest.raises(RuntimeError, match="dtype"):
        op(y, cs.to(torch.bfloat16), cs, pool, torch.tensor([0, 1]), 1, 2)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_batch_and_thread_invariant(fn: Any, x: torch.Tensor) -> None:
    """``fn(rows)`` gives each row bit for bit what it gives the row alone on one thread, for
    every leading slice of ``x`` and for ``x`` reversed, on two threads."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])
        torch.set_num_threads(2)
        for m in range(1, x.shape[0] + 1):
            assert torch.equal(_bits(fn(x[:m])), _bits(alone[:m])), m
        assert torch.equal(_bits(fn(x.flip(0))), _bits(alone.flip(0)))
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def f32_linear() -> object:
    got = cpu_kernels.f32_linear_op()
    assert got is not None, f"CPU kernels not built at {cpu_kernels.library_path()}: run `make kernels`"
    return got


# SmolLM2-135M's fused qkv, o, gate_up and down shapes; inputs that leave a tail of a vector
# (37, 100 on either lane count) and outputs that leave groups unfilled (13, 577, 7).
F32_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (13, 37), (577, 100), (7, 8)]


@pytest.mark.parametrize(("n", "k"), F32_SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_f32_linear_matches_an_fp64_reference(
    f32_linear: Any, threads: int, n: int, k: int, bias: bool
) -> None:
    """Catches a weight row paired with the wrong output, a dropped or doubled K tail, outputs left
    unwritten after the last whole group, rows past a pass (1-17 rows cross every pass size), a
    missing bias, and a thread split that skips or repeats groups."""
    torch.manual_seed(n * 7 + k)
    w = torch.randn(n, k) / k**0.5
    b = torch.randn(n) if bias else None
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 12, 17):
        x = torch.randn(m, k)
        ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
        got = f32_linear(x, w, b)
        assert got.shape == (m, n) and got.dtype == torch.float32
        # fp32 rounding of a k-term dot product of O(1) terms, far below one wrong term's size
        assert (got.double() - ref).abs().max() < 2e-5 * k**0.5, (m, n, k)


def test_f32_linear_is_batch_and_thread_invariant(f32_linear: Any) -> None:
    """Each output is one fixed chain of operations: a row's result does not depend on how many
    rows came with it, where it sat, or how many threads ran. Catches a pass size or group width
    that changes the accumulation (e.g. a different tail or reduction for some rows)."""
    torch.manual_seed(0)
    w, b = torch.randn(577, 100), torch.randn(577)
    assert_batch_and_thread_invariant(lambda x: f32_linear(x, w, b), torch.randn(17, 100))


def test_f32_linear_refuses_what_it_would_misread_with_the_reason(f32_linear: Any) -> None:
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="float32 only"):
        f32_linear(torch.randn(1, 16).to(torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="inputs"):
        f32_linear(torch.randn(1, 15), w, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        f32_linear(torch.randn(16, 2).t(), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        f32_linear(torch.randn(1, 16), w, torch.randn(7))


def test_fp32_layers_use_it_up_to_the_row_threshold(f32_linear: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the oneDNN-packed module and the fast path's direct call: up to
    ``F32_GEMV_MAX_ROWS`` rows the kernel runs (profiled), above it oneDNN's packed GEMM does, and
    both agree with the module's oneDNN output to fp32 noise. On a host where the threshold is 0 the
    wiring is checked at 2."""
    if fp32_packed.F32_GEMV_MAX_ROWS == 0:
        monkeypatch.setattr(fp32_packed, "F32_GEMV_MAX_ROWS", 2)
    limit = fp32_packed.F32_GEMV_MAX_ROWS
    torch.manual_seed(0)
    lin = fp32_packed.PackedFp32Linear(nn.Linear(256, 384), "onednn")
    direct = rewrite.direct_kernel(lin, torch.float32)
    for rows in (1, limit, limit + 1, 9):
        x = torch.randn(rows, 256)
        with torch.no_grad():
            onednn = torch.ops.mkldnn._linear_pointwise(x, lin.weight_packed, lin.bias, "none", [], "")
            for fn in (lin, direct):
                keys = _profiled_keys(lambda fn=fn, x=x: fn(x))
                assert ("tiered_router::f32_linear" in keys) == (rows <= limit), rows
                assert ("mkldnn::_linear_pointwise" in keys) == (rows > limit), rows
                torch.testing.assert_close(fn(x), onednn, atol=1e-5, rtol=1e-5)


# -- W4A8: int4 weights x int8 activations -------------------------------------------------------


@pytest.fixture(scope="module")
def w4a8() -> Any:
    got = cpu_kernels.w4a8_mm_op()
    assert got is not None, f"kernels not built at {cpu_kernels.library_path()}: run `make kernels`"
    return got


def w4a8_case(n: int, k: int, group: int, m: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    sz = torch.stack(
        [torch.rand(k // group, n, generator=g) * 0.02, torch.randn(k // group, n, generator=g) * 0.01], -1
    ).to(torch.bfloat16)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    x[0, :group] = 0  # a group of zeros: scale 0, every product 0
    if m > 1:
        x[1, group : 2 * group] = torch.linspace(-2, 2, group)  # ties at .5 after scaling (63.5 -> 64)
    return x, q, sz


# SmolLM2-135M's fused qkv, o, gate_up, down and head shapes at the small tier's group (64), the
# medium tier's (32) and 128.
@pytest.mark.parametrize(
    ("n", "k", "group"),
    [
        (960, 576, 64),
        (576, 576, 32),
        (3072, 576, 64),
        (576, 1536, 32),
        (128, 256, 128),
        (49152, 576, 64),
        (64, 96, 16),
        (96, 192, 48),
    ],
)
@pytest.mark.parametrize("vnni", [True, False], ids=["vnni-if-any", "maddubs"])
def test_w4a8_kernel_is_bitwise_the_torch_reference_at_every_row_count(
    w4a8: Any, threads: int, n: int, k: int, group: int, vnni: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a wrong nibble-to-channel map, scales paired with the wrong channels or groups, an
    activation rounding other than half-to-even, an FMA where the definition has a multiply and an
    add, lost rows at the register-tile tails (8 rows a tile on AVX512, 2 on AVX2), and a one-row
    path (AVX512: every group in registers, split dot-product chains) that drifts from the
    per-group one (m = 1, 9, 17, 33 run it). Equality
    at every row count is also the batch invariance: a row's output never depends on the others.
    Both integer paths of an AVX512 build: VNNI where the CPU has it, and vpmaddubsw + vpmaddwd."""
    if not vnni:
        monkeypatch.setenv("TIERED_ROUTER_NO_VNNI", "1")
    for m in (1, 2, 7, 8, 9, 16, 17, 33) if n < 10000 else (1, 16):
        x, q, sz = w4a8_case(n, k, group, m)
        ref = int4.w4a8_reference(x, q, group, sz)
        got = w4a8(x, int4.pack_w4a8(q), group, sz)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), f"m={m}"


@pytest.mark.parametrize("group", [64, 128])
def test_w4a8_one_row_sums_at_the_16_bit_bound_exactly(w4a8: Any, group: int) -> None:
    """The one-row path adds the u8 x s8 pair sums of 8 k-quads in 16 bits: every weight 15 against
    activations all quantized to -127 puts each 16-bit lane at -30480, the most it may hold. Catches
    a chunk of more quads (it wraps past -32768) and a saturating add that would clip it."""
    n, k = 64, 2 * group
    q = torch.full((n, k), 15)
    sz = torch.stack([torch.full((k // group, n), 0.01), torch.zeros(k // group, n)], -1).to(torch.bfloat16)
    x = torch.full((1, k), -3.0).to(torch.bfloat16)
    x[0, group:] = 2.5
    ref = int4.w4a8_reference(x, q, group, sz)
    got = w4a8(x, int4.pack_w4a8(q), group, sz)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


def test_w4a8_kernel_refuses_what_it_would_misread_with_the_reason(w4a8: Any) -> None:
    x, q, sz = w4a8_case(64, 96, 32, 2)
    with pytest.raises(RuntimeError, match="group_size 24 must divide K=96 and be a multiple of 16"):
        w4a8(x, int4.pack_w4a8(q), 24, sz)
    with pytest.raises(RuntimeError, match="W holds 64 inputs, A has 96"):
        w4a8(x, int4.pack_w4a8(q[:, :64]), 32, sz)
    with pytest.raises(RuntimeError, match="A must be 2-D bf16"):
        w4a8(x.float(), int4.pack_w4a8(q), 32, sz)


def test_w4a8_layers_run_the_kernel_and_equal_the_torch_path(
    w4a8: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the module and the fast path's direct call: the kernel runs (profiled) and gives the
    bits of the layer built without it (plain weights, torch ops)."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 192, bias=False)
    lin = Int4WeightOnlyLinear(linear, 64, int8_activations=True)
    assert lin._w4a8_packed and lin.weight_q.shape == (192 // 32, 256 // 4, 64)
    x = (torch.randn(5, 256) * 2).to(torch.bfloat16)
    with torch.no_grad():
        for fn in (lin, rewrite.direct_kernel(lin, torch.bfloat16)):
            assert "tiered_router::w4a8_mm" in _profiled_keys(lambda fn=fn: fn(x))
        got = lin(x)
        monkeypatch.setattr(int4, "_w4a8_op", lambda: None)
        plain = Int4WeightOnlyLinear(linear, 64, int8_activations=True)
        assert not plain._w4a8_packed and plain.weight_q.shape == (192, 256)
        assert "tiered_router::w4a8_mm" not in _profiled_keys(lambda: plain(x))
        assert torch.equal(plain(x).view(torch.int16), got.view(torch.int16))


@pytest.fixture(scope="module")
def w8_linear() -> Any:
    got = cpu_kernels.w8_linear_op()
    assert got is not None, f"kernels not built at {cpu_kernels.library_path()}: run `make kernels`"
    return got


def w8_case(n: int, k: int, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return x, q, scale


# SmolLM2-135M's output head and fused shapes; inputs that leave a tail of a vector on either lane
# count (37, 100) and outputs that leave a group of 3 or 4 channels unfilled (577, 13, 7).
W8_SHAPES = [(49152, 576), (960, 576), (576, 1536), (577, 100), (13, 37), (7, 8)]


@pytest.mark.parametrize(("n", "k"), W8_SHAPES)
def test_w8_linear_matches_an_fp64_reference(w8_linear: Any, threads: int, n: int, k: int) -> None:
    """Catches a weight row paired with the wrong output or scale, a K tail dropped or read past
    the row, outputs left unwritten after the last whole group, rows lost at the pass tails (1-17
    rows cross every pass size on both builds), and a thread split that skips or repeats groups."""
    for m in (1, 2, 3, 4, 5, 6, 7, 9, 13, 17) if n < 10000 else (1, 5):
        x, q, scale = w8_case(n, k, m, seed=n + k + m)
        ref = (x.double() @ q.double().T) * scale.double()
        got = w8_linear(x, q, scale)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        # one bf16 rounding of the result (2^-9 relative) plus fp32 noise of a k-term sum, far below
        # one wrong product (~|x| * 64 * scale)
        noise = 1e-6 * (x.double().abs() @ q.double().abs().T) * scale.double()
        bound = ref.abs() * 2.0**-8 + noise
        assert ((got.double() - ref).abs() <= bound).all(), (m, n, k)


def test_w8_linear_is_batch_and_thread_invariant(w8_linear: Any) -> None:
    """A row's output does not depend on how many rows came with it, where it sat, or how many
    threads ran: what keeps greedy answers of the int8-head tier independent of other traffic.
    Catches a pass size or group width that changes a row's accumulation."""
    x, q, scale = w8_case(577, 100, 17)
    assert_batch_and_thread_invariant(lambda rows: w8_linear(rows, q, scale), x)


def test_w8_linear_refuses_what_it_would_misread_with_the_reason(w8_linear: Any) -> None:
    x, q, scale = w8_case(8, 16, 2)
    with pytest.raises(RuntimeError, match="x must be 2-D bf16"):
        w8_linear(x.float(), q, scale)
    with pytest.raises(RuntimeError, match="weight must be int8"):
        w8_linear(x, q.to(torch.uint8), scale)
    with pytest.raises(RuntimeError, match="x has 15 inputs, weight 16"):
        w8_linear(x[:, :15].contiguous(), q, scale)
    with pytest.raises(RuntimeError, match="scale must be"):
        w8_linear(x, q, scale[:7])


def test_int8_layers_run_the_kernel_and_agree_with_torchs(
    w8_linear: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the module (the int8 output head of the medium tier) and the fast path's direct
    call: the kernel runs (profiled) and agrees with torch's ``_weight_int8pack_mm`` to one bf16
    rounding; without the build the layer falls back to torch's op."""
    torch.manual_seed(0)
    lin = int8.Int8WeightOnlyLinear(nn.Linear(192, 320, bias=False))
    x = torch.randn(5, 192).to(torch.bfloat16)
    torch_y = torch._weight_int8pack_mm(x, lin.weight_q, lin.scale.to(torch.bfloat16)).double()
    with torch.no_grad():
        for fn in (lin, rewrite.direct_kernel(lin, torch.bfloat16)):
            assert "tiered_router::w8_linear" in _profiled_keys(lambda fn=fn: fn(x))
            assert ((fn(x).double() - torch_y).abs() <= torch_y.abs() * 2.0**-7 + 1e-4).all()
        monkeypatch.setattr(int8, "_w8_linear_op", lambda: None)
        keys = _profiled_keys(lambda: lin(x))
        assert "tiered_router::w8_linear" not in keys and "aten::_weight_int8pack_mm" in keys


# -- shipping: the kernels build from an installed package, and no compiler is no failure ----------


def test_no_compiler_is_a_warning_and_torchs_ops_not_a_failed_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Catches: `make install` stopping on FileNotFoundError in an image without g++ (the module
    # promises torch's ops as the fallback).
    monkeypatch.setattr(cpu_kernels, "_BUILD_DIR", tmp_path / "build")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_kernels.main([]) == 0
    assert "no C++ compiler" in capsys.readouterr().err
    assert not (tmp_path / "build").exists()
    with pytest.raises(FileNotFoundError):
        cpu_kernels.build()


@pytest.mark.slow
def test_the_wheel_carries_every_source_the_build_hashes_and_includes(tmp_path: Path) -> None:
    # Catches: package data listing only csrc/*.cpp - an installed (non-editable) package then
    # cannot compile, since the sources include bf16.h and simd.h.
    import shutil
    import subprocess
    import sys
    import zipfile

    root = Path(cpu_kernels.__file__).resolve().parents[2]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    for pkg in ("router", "classifier", "tiers"):
        shutil.copytree(root / pkg, src / pkg, ignore=shutil.ignore_patterns("build", "__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=src,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("tiered_router-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {Path(n).name for n in zf.namelist() if n.startswith("tiers/kernels/csrc/")}
        zf.extractall(tmp_path / "site")
    needed = {p.name for p in [*cpu_kernels._SOURCE_DIR.glob("*.cpp"), *cpu_kernels._SOURCE_DIR.glob("*.h")]}
    assert needed <= shipped, f"missing from the wheel: {sorted(needed - shipped)}"
    # Every local header a shipped source includes is shipped beside it (read from the unpacked
    # wheel's own files, not from the glob that chose them).
    import re

    csrc = tmp_path / "site" / "tiers" / "csrc"
    for source in [*csrc.glob("*.cpp"), *csrc.glob("*.h")]:
        for header in re.findall(r'^#include "([^"]+)"', source.read_text(), flags=re.MULTILINE):
            assert (csrc / header).is_file(), f"{source.name} includes {header}, which the wheel lacks"
