"""Packed fp32 linears: the packed GEMMs against fp64, the fast path's direct calls, and batch
invariance (one GEMM at every row count, from a library checked invariant on this CPU)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from tiers.layers import fp32_packed
from tiers.layers.fp32_packed import PackedFp32Linear

_PACKED_OPS = {"mkl": "mkl::_mkl_linear", "onednn": "mkldnn::_linear_pointwise"}


def _ran_packed_gemm(fn: Any, backend: str) -> bool:
    return _ran(fn, _PACKED_OPS[backend])


def _ran(fn: Any, op: str) -> bool:
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return any(op in e.key for e in prof.key_averages())


def _gemv_rows() -> int:
    """Rows the memory-speed fp32 kernel serves on this host (0 where it is off or not built)."""
    return fp32_packed.F32_GEMV_MAX_ROWS if fp32_packed._f32_gemv_op() is not None else 0


@pytest.mark.parametrize("backend", ["mkl", "onednn"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_fp32_linear_matches_fp64_at_every_row_count(bias: bool, backend: str) -> None:
    """The packed weight is made once (for 16 rows) and used at every row count it serves (MKL's
    4-16, oneDNN's all): catches a packed layout that depends on the row count (garbage), a wrong
    bias, or rows outside MKL's 4-16 sent to its packed kernel (where it measured slower) - and
    checks the packed kernel ran."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 384, bias=bias)
    packed = PackedFp32Linear(lin, backend)  # type: ignore[arg-type]
    # oneDNN's packed GEMM serves every row count except the few the fp32 GEMV kernel takes.
    expected_rows = range(4, 17) if backend == "mkl" else range(_gemv_rows() + 1, 34)
    ref_w = lin.weight.detach().double()
    for rows in range(1, 34):
        x = torch.randn(rows, 256)
        ref = x.double() @ ref_w.T + (lin.bias.detach().double() if bias else 0)
        with torch.no_grad():
            got = packed(x)
        assert (got.double() - ref).abs().max() < 1e-4, rows
        assert _ran_packed_gemm(lambda x=x: packed(x), backend) == (rows in expected_rows), rows
        gemv = backend == "onednn" and rows <= _gemv_rows()
        assert _ran(lambda x=x: packed(x), "tiered_router::f32_linear") == gemv, rows
    x3 = torch.randn(2, 3, 256)  # leading dims flatten to 6 rows
    assert torch.allclose(packed(x3), lin(x3), atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_direct_call_of_a_onednn_packed_linear_is_the_modules_op(bias: bool) -> None:
    """The fast path calls oneDNN's packed GEMM without the module: catches a direct call that
    drops the bias, reads a stale or unpacked weight, or is silently the module's forward again
    (then the Python it exists to skip comes back)."""
    from tiers.layers.quantization.rewrite import direct_kernel

    torch.manual_seed(0)
    packed = PackedFp32Linear(nn.Linear(256, 384, bias=bias), "onednn")
    direct = direct_kernel(packed, torch.float32)
    assert direct != packed.forward
    for rows in (1, 4, 16, 33):
        x = torch.randn(rows, 256)
        with torch.no_grad():
            assert torch.equal(direct(x), packed(x)), rows
            assert torch.equal(direct(x.t().contiguous().t()), packed(x)), rows  # column-major input
        assert _ran_packed_gemm(lambda x=x: direct(x), "onednn") == (rows > _gemv_rows())
        assert _ran(lambda x=x: direct(x), "tiered_router::f32_linear") == (rows <= _gemv_rows())
    mkl = PackedFp32Linear(nn.Linear(256, 384), "mkl")  # picks its kernel by row count: keeps forward
    assert direct_kernel(mkl, torch.float32) == mkl.forward
    mkl = PackedFp32Linear(nn.Linear(256, 384), "mkl", invariant=True)  # one kernel: a direct call
    direct = direct_kernel(mkl, torch.float32)
    assert direct != mkl.forward
    for rows in (1, 4, 33):
        x = torch.randn(rows, 256)
        with torch.no_grad():
            assert torch.equal(direct(x), mkl(x)), rows
        assert _ran_packed_gemm(lambda x=x: direct(x), "mkl"), rows


SHAPES = [(1536, 576), (576, 1536)]
"""SmolLM2-135M's up and down projections: the down projection's K = 1536 is where oneDNN's packed
GEMM measured not invariant on an Intel AVX512 VM, and plain ``F.linear`` is not on any shape there."""


@pytest.mark.parametrize("preferred", ["mkl", "onednn"])
@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
def test_an_invariant_linear_gives_each_row_the_same_bits_in_any_batch(
    preferred: str, out_f: int, in_f: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a batch-invariant linear that switches kernels by row count (MKL's packed range
    4-16 with the plain call around it, the one/two-row GEMV, here forced on) or keeps a library
    whose blocking changes a row's sums with the batch: every row of batches of 1-100 rows,
    bitwise, against the same row alone - and a packed GEMM served one row and 100 rows."""
    monkeypatch.setattr(fp32_packed, "fp32_gemm_backend", lambda: preferred)
    monkeypatch.setattr(fp32_packed, "F32_GEMV_MAX_ROWS", 2)
    if not fp32_packed._supported(preferred):  # type: ignore[arg-type]
        pytest.skip(f"{preferred}'s packed GEMM is not in this torch build")
    torch.manual_seed(1)
    with torch.no_grad():
        mod = PackedFp32Linear(nn.Linear(in_f, out_f, bias=False), invariant=True)
        x = torch.randn(100, in_f)
        alone = torch.cat([mod(x[i : i + 1]) for i in range(100)])
        for rows in (2, 3, 4, 7, 16, 17, 40, 65, 100):
            assert torch.equal(mod(x[:rows]), alone[:rows]), rows
        ref = x.double() @ mod.weight.detach().double().T
        assert (alone.double() - ref).abs().max() < 1e-3
    if not fp32_packed.is_batch_invariant(mod):
        return
    if mod.backend == "kernel":  # both libraries failed the check on this CPU: the fallback
        assert _ran(lambda: mod(x[:1]), "tiered_router::f32_linear")
        assert _ran(lambda: mod(x), "tiered_router::f32_linear")
    else:
        assert _ran_packed_gemm(lambda: mod(x[:1]), mod.backend)
        assert _ran_packed_gemm(lambda: mod(x), mod.backend)
        assert not _ran(lambda: mod(x[:1]), "tiered_router::f32_linear")


def test_the_invariance_check_catches_a_row_count_switch() -> None:
    """Catches a check that cannot fail: a linear planted to change its last bit from 17 rows on
    (as a GEMM that reblocks past a row count would) is not invariant; the same linear unchanged
    is; the verdict is cached per library and shape."""

    class Reblocking(PackedFp32Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = super().forward(x)
            return torch.nextafter(y, y + 1) if x.shape[0] >= 17 else y

    backend = fp32_packed.fp32_gemm_backend()
    if not fp32_packed._supported(backend):
        pytest.skip("no packed fp32 GEMM in this torch build")
    fp32_packed._invariance_seen.clear()
    plain = PackedFp32Linear(nn.Linear(96, 80), backend, invariant=True)
    planted = Reblocking(nn.Linear(96, 88), backend, invariant=True)
    assert not fp32_packed.is_batch_invariant(planted)
    assert fp32_packed._invariance_seen == {(backend, 88, 96, True): False}
    verdict = fp32_packed.is_batch_invariant(plain)
    assert fp32_packed._invariance_seen[(backend, 80, 96, True)] == verdict


def test_a_linear_whose_library_fails_the_check_takes_the_next_or_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The library is chosen by the check, not by vendor: catches a linear that keeps a
    non-invariant preferred library when the other passes, skips the project's GEMV as the last
    resort, or stays silent when nothing passes."""
    if not (fp32_packed._supported("mkl") and fp32_packed._supported("onednn")):
        pytest.skip("both packed GEMMs are needed")
    monkeypatch.setattr(fp32_packed, "fp32_gemm_backend", lambda: "mkl")
    verdicts = {"mkl": False, "onednn": True, "kernel": True}
    monkeypatch.setattr(fp32_packed, "is_batch_invariant", lambda m: verdicts[m.backend])
    assert PackedFp32Linear(nn.Linear(64, 64), invariant=True).backend == "onednn"
    assert PackedFp32Linear(nn.Linear(64, 64)).backend == "mkl"  # not invariant: no check
    verdicts["onednn"] = False
    if fp32_packed._supported("kernel"):
        mod = PackedFp32Linear(nn.Linear(64, 64), invariant=True)
        assert mod.backend == "kernel" and mod.weight_packed is None
    verdicts["kernel"] = False
    with caplog.at_level(logging.WARNING, logger="tiers.layers.fp32_packed"):
        mod = PackedFp32Linear(nn.Linear(64, 64), invariant=True)
    assert mod.backend == "mkl" and mod.packed_rows is PackedFp32Linear.EVERY_ROW_COUNT
    assert "may depend on other traffic" in caplog.text


def test_the_last_resort_runs_the_gemv_at_every_row_count() -> None:
    """``kernel``: ``tiered_router::f32_linear`` for every row count, through the module and the
    fast path's direct call - batch-invariant bit for bit, within fp32 rounding of fp64, and no
    packed copy held. Catches a fallback that still routes some row counts to a library."""
    from tiers.layers.quantization.rewrite import direct_kernel

    if not fp32_packed._supported("kernel"):
        pytest.skip("the CPU kernels are not built on this host")
    torch.manual_seed(2)
    lin = nn.Linear(576, 192, bias=True)
    mod = PackedFp32Linear(lin, "kernel", invariant=True)
    direct = direct_kernel(mod, torch.float32)
    x = torch.randn(70, 576)
    with torch.no_grad():
        alone = torch.cat([mod(x[i : i + 1]) for i in range(70)])
        for rows in (2, 5, 17, 70):
            assert torch.equal(mod(x[:rows]), alone[:rows]), rows
            assert torch.equal(direct(x[:rows]), alone[:rows]), rows
        ref = x.double() @ lin.weight.detach().double().T + lin.bias.detach().double()
        assert (alone.double() - ref).abs().max() < 1e-4
    assert _ran(lambda: mod(x), "tiered_router::f32_linear")
    assert not _ran_packed_gemm(lambda: mod(x), "mkl") and not _ran_packed_gemm(lambda: mod(x), "onednn")
