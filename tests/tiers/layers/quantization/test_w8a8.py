"""W8A8: int8 weights x int8 activations (``tiered_router::w8a8_linear`` and ``int8.w8a8_reference``),
the medium tier's output head beside its W4A8 layers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tiers.kernels import cpu as cpu_kernels
from tiers.layers.quantization import int8, rewrite
from tiers.layers.quantization.int8 import Int8WeightOnlyLinear


@pytest.fixture(scope="module")
def w8a8() -> Any:
    got = cpu_kernels.w8a8_linear_op()
    # On an AVX512 or AVX2 host a missing build is a broken install, not a reason to skip.
    assert got is not None, f"kernels not built at {cpu_kernels.library_path()}: run `make kernels`"
    return got


def case(
    n: int, k: int, group: int, m: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q[0] = 127  # a channel of extremes: 255 as the VNNI path's u8
    q[1] = -127
    scale = (torch.rand(n, generator=g) * 0.01 + 1e-3).to(torch.bfloat16).float()
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    x[0, :group] = 0  # a group of zeros: scale 0, every product 0
    if m > 1:
        x[1, :group] = torch.linspace(-2, 2, group)  # ties at .5 after scaling
    return x, q, scale


def test_the_reference_is_its_definition_and_close_to_the_float_product() -> None:
    """Catches a reference that is not what w8a8_linear.cpp documents: the integer dot products
    recomputed in int64 from the quantized activations, scaled per group in order, equal it; and
    the result stays within activation-quantization error of the bf16 product (a wrong scale, a
    transposed weight or a group paired with the wrong scale would not)."""
    x, q, scale = case(128, 192, 64, 5)
    got = int8.w8a8_reference(x, q, 64, scale)
    xq, sa = int8.quantize_activations(x, 64)
    assert xq.abs().max() <= 127 and torch.equal(xq, xq.round())
    dots = torch.einsum("mgi,ngi->mgn", xq.long(), q.long().reshape(128, 3, 64))  # exact integers
    acc = torch.zeros(5, 128)
    for j in range(3):
        acc = acc + dots[:, j].float() * sa[:, j, None]
    assert torch.equal(got, (acc * scale).to(torch.bfloat16))
    exact = x.double() @ (q.double() * scale.double()[:, None]).T
    err = (got.double() - exact).abs().max() / exact.abs().max()
    assert 0 < err < 0.02


W8A8_SHAPES = [(49152, 576, 32), (128, 576, 576), (192, 576, 64), (64, 1536, 32), (64, 96, 16), (128, 48, 48)]
"""The medium tier's head at its group size, one group per row, the small tier's group, the down
projection's K, and the smallest group and a group of 48 (not a power of two)."""


@pytest.mark.parametrize(("n", "k", "group"), W8A8_SHAPES)
@pytest.mark.parametrize("vnni", [True, False], ids=["vnni-if-any", "maddubs"])
def test_the_kernel_is_bitwise_the_reference_at_every_row_count(
    w8a8: Any, threads: int, n: int, k: int, group: int, vnni: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a wrong byte-to-channel map, the VNNI offset (128 x the activation sum) subtracted
    wrongly or not at all, a sign lost on the maddubs path, groups paired with the wrong scale, an
    FMA where the definition has a multiply and an add, and rows lost at the tile tails (4 rows a
    tile on AVX512, 2 on AVX2). Equality at every row count and thread count is also the batch
    invariance. Both integer paths of an AVX512 build: VNNI where the CPU has it, and maddubs."""
    if not vnni:
        monkeypatch.setenv("TIERED_ROUTER_NO_VNNI", "1")
    packed = int8.pack_w8a8(q := case(n, k, group, 1)[1])
    for m in (1, 2, 3, 4, 5, 9, 17) if n < 10000 else (1, 6):
        x, q, scale = case(n, k, group, m)
        ref = int8.w8a8_reference(x, q, group, scale)
        got = w8a8(x, packed, group, scale)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), f"m={m}"


def test_the_kernel_refuses_what_it_would_misread_with_the_reason(w8a8: Any) -> None:
    x, q, scale = case(64, 64, 32, 2)
    packed = int8.pack_w8a8(q)
    with pytest.raises(RuntimeError, match="A must be 2-D bf16"):
        w8a8(x.float(), packed, 32, scale)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        w8a8(x, packed, 24, scale)
    with pytest.raises(RuntimeError, match="scale must be fp32"):
        w8a8(x, packed, 32, scale.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="not a multiple of 64"):
        w8a8(torch.zeros(1, 64, dtype=torch.bfloat16), int8.pack_w8a8(case(32, 64, 32, 1)[1]), 32, scale[:32])


def test_a_w8a8_layer_runs_the_kernel_and_equals_the_layer_without_it(
    w8a8: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the module and the fast path's direct call the kernel runs (profiled) and gives the
    bits of the layer built without it (the torch reference: what a host without a compiler
    serves); a width the kernel does not take keeps the reference."""
    from torch.profiler import profile

    def ran(fn: Any) -> bool:
        with profile() as prof:
            fn()
        return any("tiered_router::w8a8_linear" in e.key for e in prof.key_averages())

    torch.manual_seed(0)
    linear = nn.Linear(192, 320, bias=False)
    lin = Int8WeightOnlyLinear(linear, int8_activations=True, group_size=64)
    assert lin.w8a8_packed is not None
    x = (torch.randn(3, 192) * 2).to(torch.bfloat16)
    with torch.no_grad():
        direct = rewrite.direct_kernel(lin, torch.bfloat16)
        for fn in (lin, direct):
            assert ran(lambda fn=fn: fn(x))
        got = lin(x)
        assert torch.equal(direct(x).view(torch.int16), got.view(torch.int16))
        monkeypatch.setattr(int8, "_w8a8_op", lambda: None)
        plain = Int8WeightOnlyLinear(linear, int8_activations=True, group_size=64)
        assert plain.w8a8_packed is None and not ran(lambda: plain(x))
        assert torch.equal(plain(x).view(torch.int16), got.view(torch.int16))
        odd = Int8WeightOnlyLinear(nn.Linear(192, 100, bias=False), int8_activations=True, group_size=64)
        assert odd.w8a8_packed is None
    with pytest.raises(ValueError, match="group size"):
        Int8WeightOnlyLinear(linear, int8_activations=True, group_size=40)
