"""The tiled int4 CPU kernel against torch's own int4 kernel (an independent implementation of the
same arithmetic): bit-for-bit at every row count, shape and group size the tiers use, and actually
serving the int4 projections from ``TILED_INT4_MIN_ROWS`` rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from tiers import cpu_kernels, quant
from tiers.quant import Int4WeightOnlyLinear

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512",
    reason="the tiled kernel reproduces torch's AVX512 int4 kernel and is used only where torch runs it",
)


@pytest.fixture(scope="module")
def op() -> object:
    got = cpu_kernels.int4_mm_op()
    # On an AVX512 host a missing build is a broken install, not a reason to skip.
    assert got is not None, f"tiled int4 kernel not built at {cpu_kernels.library_path()}: run `make kernels`"
    return got


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


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
    lin = packed(96, 64, 32)  # 96 channels: not whole 64-channel blocks of the packed layout
    with pytest.raises(RuntimeError, match="multiple of 64"):
        op(torch.zeros(8, 64, dtype=torch.bfloat16), lin.weight_q, 32, lin.scales_and_zeros)  # type: ignore[operator]
    assert quant._tiled_int4_op(96) is None  # so the layer keeps torch's kernel


def test_a_changed_source_never_loads_the_old_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's name hashes the source: an edited kernel gets a new path, so a stale .so
    from before the edit is not picked up."""
    before = cpu_kernels.library_path()
    src = tmp_path / "int4_mm.cpp"
    src.write_bytes(cpu_kernels._SOURCE.read_bytes() + b"\n// edited\n")
    monkeypatch.setattr(cpu_kernels, "_SOURCE", src)
    assert cpu_kernels.library_path().name != before.name


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
    direct = quant.direct_kernel(lin, torch.bfloat16)
    rows = quant.TILED_INT4_MIN_ROWS
    x_few, x_many = (torch.randn(r, 128).to(torch.bfloat16) for r in (rows - 1, rows + 11))
    with torch.no_grad():
        for fn in (lin, direct):
            keys_few = _profiled_keys(lambda fn=fn: fn(x_few))
            keys_many = _profiled_keys(lambda fn=fn: fn(x_many))
            assert "tiered_router::int4_mm" not in keys_few
            assert "aten::_weight_int4pack_mm_for_cpu" in keys_few
            assert "tiered_router::int4_mm" in keys_many
        tiled_out = lin(x_many)
        monkeypatch.setattr(quant, "_tiled_int4_op", lambda n: None)
        keys = _profiled_keys(lambda: lin(x_many))
        assert "tiered_router::int4_mm" not in keys
        assert torch.equal(lin(x_many), tiled_out)
