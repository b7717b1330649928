"""int4 weights that stay packed on CUDA, checked on the CPU: the two-per-byte input of torch's
CUDA packer decoded and run through the same packing's CPU kernel against the dequantized
reference; the module's CUDA path (under fake CUDA tensors) packing into the tinygemm layout and
calling ``_weight_int4pack_mm`` with no per-call dequantization; the layout's shape rules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tiers.layers.quantization.int4 import (
    Int4WeightOnlyLinear,
    cuda_inner_k_tiles,
    int4_nibbles,
    pack_int4,
)


def test_cuda_nibbles_through_the_cpu_kernel_equal_the_dequantized_reference() -> None:
    # Catches the nibble order swapped (column 2j in the low nibble: every pair of inputs
    # exchanged), scales and zeros in the wrong layout for the packed kernels, and a zero point
    # off by the 8 they subtract.
    gen = torch.Generator().manual_seed(0)
    n, k, gs = 128, 256, 32
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale = torch.rand(k // gs, n, generator=gen) * 0.02 + 0.001
    zero = torch.randn(k // gs, n, generator=gen) * 0.02
    sz = torch.stack((scale, zero), dim=-1).to(torch.bfloat16)  # [K / G, N, 2]
    u = int4_nibbles(q)
    assert u.dtype == torch.uint8 and u.shape == (n, k // 2)
    decoded = torch.stack((u >> 4, u & 15), dim=-1).reshape(n, k).to(torch.int32)  # torch's convention
    assert torch.equal(decoded, q)
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16)
    got = torch._weight_int4pack_mm_for_cpu(x, pack_int4(decoded, gs), gs, sz).float()
    s, z = sz[..., 0].float().T.repeat_interleave(gs, 1), sz[..., 1].float().T.repeat_interleave(gs, 1)
    want = x.float() @ ((q.float() - 8.0) * s + z).T
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_cuda_packing_gives_the_layout_the_cuda_kernel_takes() -> None:
    # Catches a packed layout (or packer input dtype) the CUDA ops' shape checks refuse at load
    # time, and fused q/k/v parts that do not concatenate into one tinygemm weight. Fake CUDA
    # tensors run torch's own meta checks of both ops on this CPU-only build.
    from torch._subclasses.fake_tensor import FakeTensorMode

    # pack_int4's CUDA call on int4_nibbles' shape and dtype (bit ops have no fake-CUDA kernel;
    # the nibbles' values are checked above)
    shapes = [tuple(int4_nibbles(torch.zeros(n, 896, dtype=torch.int32)).shape) for n in (896, 128, 128)]
    with FakeTensorMode(allow_non_fake_inputs=True):
        host = [torch.zeros(s, dtype=torch.uint8, device="cuda") for s in shapes]
        parts = [torch._convert_weight_to_int4pack(u, cuda_inner_k_tiles(896)) for u in host]
        assert parts[0].dtype == torch.int32 and parts[0].device.type == "cuda"
        assert tuple(parts[0].shape) == (896 // 8, 896 // (8 * 16), 32, 4)  # 896 = 7 x 128: 8 tiles
        fused = torch.cat(parts)  # what fusion.fuse_linears does with the parts' weight_q
        x = torch.zeros(3, 896, dtype=torch.bfloat16, device="cuda")
        sz = torch.zeros(896 // 32, 1152, 2, dtype=torch.bfloat16, device="cuda")
        assert tuple(torch._weight_int4pack_mm(x, fused, 32, sz).shape) == (3, 1152)


def test_w4a8_is_refused_on_cuda_before_quantizing() -> None:
    # Catches W4A8 silently dequantizing every call on CUDA (no packed kernel there).
    class Weight:
        shape = (64, 64)
        device = torch.device("cuda")

        def detach(self) -> torch.Tensor:
            return torch.zeros(64, 64)

    with pytest.raises(ValueError, match="W4A8"):
        Int4WeightOnlyLinear(SimpleNamespace(weight=Weight(), bias=None), 32, int8_activations=True)  # type: ignore[arg-type]


def test_inner_k_tiles_and_refusals() -> None:
    # Catches an inner-K tiling that does not divide a Qwen2.5 shape's inputs (the packer raises on
    # the GPU at load time) and shapes the CUDA kernel cannot take accepted silently.
    for k in (896, 1536, 3584, 4864, 8960, 18944):  # Qwen2.5 0.5B/1.5B/7B hidden and MLP widths
        tiles = cuda_inner_k_tiles(k)
        assert tiles in (2, 4, 8) and k % (tiles * 16) == 0
        assert all(k % (t * 16) for t in (8, 4, 2) if t > tiles)
    with pytest.raises(ValueError, match="multiples of 32"):
        cuda_inner_k_tiles(48)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.zeros(12, 64, dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match="multiples of 8"):
            pack_int4(q, 32)
        with pytest.raises(ValueError, match="group size"):
            pack_int4(torch.zeros(16, 64, dtype=torch.int32, device="cuda"), 16)
