"""int4 weights: asymmetric int4 linears in groups of input channels with bf16 activations or int8
activations per group (W4A8), torch's packed CPU layout and the tiled kernel's row threshold, the
W4A8 packing, and a bitwise torch reference.

On the CPU the packed kernels (``_weight_int4pack_mm_for_cpu``, ``tiered_router::int4_mm``,
``tiered_router::w4a8_mm``) run. On CUDA the weight stays packed in torch's tinygemm layout
(``_convert_weight_to_int4pack`` of two values per byte, ``_weight_int4pack_mm`` with bf16
activations, the same ``scales_and_zeros``): ``pack_int4`` is one function whose device is the only
difference. W4A8 has no CUDA kernel and is refused there; elsewhere the weight is dequantized per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tiers.kernels.cpu import cpu_is_intel
from tiers.layers.quantization.int8 import quantize_activations

__all__ = [
    "INT4_CPU_PACK_BLOCK",
    "TILED_INT4_MIN_ROWS",
    "Int4WeightOnlyLinear",
    "cuda_inner_k_tiles",
    "int4_direct_call",
    "int4_nibbles",
    "pack_int4",
    "pack_w4a8",
    "w4a8_reference",
]


INT4_CPU_PACK_BLOCK = 64
"""Output channels per block of ``_convert_weight_to_int4pack_for_cpu``'s layout on torch's AVX512
build (its AVX2 build packs blocks of 32): widths in whole multiples of 64 are whole blocks on
either, so only those are fused and handed to the tiled kernel."""


def _tiled_int4_min_rows() -> int:
    from tiers.kernels.cpu import host_isa

    if host_isa() == "AVX2":
        return 4
    return 5 if cpu_is_intel() else 32


TILED_INT4_MIN_ROWS = _tiled_int4_min_rows()
"""From this many rows the packed int4 projections run ``tiered_router::int4_mm`` (see
``tiers/kernels/cpu.py``) instead of torch's kernel. Same bits either way, so this is a speed
choice only, fixed per instruction set and CPU vendor (measured, not timed at each start):
- AVX512, Intel: from 5. On the 2-core Intel Xeon (two 512-bit FMA ports) VMs of earlier runs the
  tiled kernel measured 1.5-1.8x faster at 16 rows, about even at 4 and slower at 1-2 rows, where
  dequantizing into a tile does not pay.
- AVX512, AMD (Zen 4: 512-bit FMAs at half that rate): from 32. Both kernels are bound by the
  same multiply-adds and the tiled one's saving on dequantizing barely shows: per shape it
  measured 0.8-0.97x torch's at 16 rows, about even at 24-32 and 1.1-1.4x from 40; in-process the
  small tier's decode step at 16 sequences took 62 ms with it and 43 ms without.
- AVX2 (the 2-core AMD EPYC Zen 1 VM): from 4. torch's AVX2 build spends ~13 vector ops on
  dequantizing 32 weights against 4 multiply-adds per row, so sharing the dequantized tile pays
  early: SmolLM2's shapes measured 0.75-0.86x torch's at 1 row, 0.84-0.95x at 2, 1.0-1.66x at 4,
  1.6-1.8x at 16 and 2.1x at 64 (1 and 2 threads, 30 weight copies cycled)."""


def _tiled_int4_op(out_features: int) -> Any | None:
    """The tiled int4 kernel where it is built, applies on this CPU and takes this layer's shape
    (whole 64-channel blocks), else ``None``."""
    from tiers.kernels.cpu import int4_mm_op

    return int4_mm_op() if out_features % INT4_CPU_PACK_BLOCK == 0 else None


def _int4_cpu_call(out_features: int, wq: torch.Tensor, gs: int, sz: torch.Tensor) -> Any:
    """``f(x)`` for 2-D bf16 ``x`` and one packed CPU int4 weight: the tiled kernel from
    ``TILED_INT4_MIN_ROWS`` rows where it applies, torch's kernel otherwise."""
    torch_op, tiled = torch._weight_int4pack_mm_for_cpu, _tiled_int4_op(out_features)
    min_rows = TILED_INT4_MIN_ROWS
    if tiled is None:
        return lambda x: torch_op(x, wq, gs, sz)
    return lambda x: (tiled if x.shape[0] >= min_rows else torch_op)(x, wq, gs, sz)


INT4_CUDA_GROUP_SIZES = (32, 64, 128, 256)
"""Group sizes ``_weight_int4pack_mm`` takes on CUDA."""


def int4_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int4 values ``q: [N, K]`` (0..15) two per byte, as ``_convert_weight_to_int4pack`` takes them
    on CUDA: ``uint8 [N, K / 2]``, column ``2j`` in the high nibble and ``2j + 1`` in the low one."""
    q = q.to(torch.int32)
    return ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)


def cuda_inner_k_tiles(in_features: int) -> int:
    """The widest of the tinygemm layout's inner K tiles (8, 4 or 2, of 16 inputs each) that
    divides ``in_features``."""
    for tiles in (8, 4, 2):
        if in_features % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"int4 on CUDA needs in_features in multiples of 32 (got {in_features})")


def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """``q: int [N, K]`` (0..15) in the packed layout of ``q``'s device: the CPU's
    (``_convert_weight_to_int4pack_for_cpu``, one value per int32 in) or CUDA's tinygemm layout
    (``_convert_weight_to_int4pack`` of ``int4_nibbles``, ``cuda_inner_k_tiles`` wide)."""
    if q.device.type == "cpu":
        return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    n, k = q.shape
    if n % 8 or group_size not in INT4_CUDA_GROUP_SIZES:
        raise ValueError(
            f"int4 on CUDA needs out_features in multiples of 8 and a group size in "
            f"{INT4_CUDA_GROUP_SIZES} (got {n} outputs, group {group_size})"
        )
    return torch._convert_weight_to_int4pack(int4_nibbles(q), cuda_inner_k_tiles(k))


W4A8_BLOCK = 32
"""Output channels per block of ``pack_w4a8``'s layout: parts in whole blocks concatenate."""


def pack_w4a8(q: torch.Tensor) -> torch.Tensor:
    """int4 values ``q: [N, K]`` (0..15) in ``tiered_router::w4a8_mm``'s layout ``uint8 [N / 32, K / 4, 64]``:
    per block of 32 output channels and 4 inputs, byte ``4c + i`` holds ``q[32b + c, 4j + i]`` in
    its low nibble and ``q[32b + 16 + c, 4j + i]`` in its high one (w4a8_mm.cpp)."""
    n, k = q.shape
    v = q.to(torch.uint8).reshape(n // W4A8_BLOCK, 2, 16, k // 4, 4)
    return (v[:, 0] | (v[:, 1] << 4)).permute(0, 2, 1, 3).reshape(n // W4A8_BLOCK, k // 4, 64).contiguous()


def w4a8_reference(x: torch.Tensor, q: torch.Tensor, group_size: int, sz: torch.Tensor) -> torch.Tensor:
    """int4 weights times activations quantized to int8 per group, in torch ops: bitwise what
    ``tiered_router::w4a8_mm`` computes (see w4a8_mm.cpp for the arithmetic), on any device.

    ``x: [M, K]`` (rounded to bf16 first, as the kernel takes it), ``q: [N, K]`` int4 values,
    ``sz: bf16 [K / G, N, 2]`` (scale, zero). The integer dot products run as fp32 matmuls: every
    product and partial sum is an integer below 2^24, so they are exact in any summation order."""
    m = x.shape[0]
    n, g = q.shape[0], group_size
    groups = x.shape[1] // g
    xq, sa = quantize_activations(x, g)
    sa_sum = sa * xq.sum(-1)
    dots = torch.einsum("mgi,ngi->mgn", xq, q.float().reshape(n, groups, g))
    scale = sz[..., 0].float()
    zero8 = sz[..., 1].float() - scale * 8.0
    acc = torch.zeros(m, n, device=x.device)
    for j in range(groups):  # in group order, one rounding per op, as the kernel
        acc = acc + (dots[:, j] * (scale[j] * sa[:, j, None]) + zero8[j] * sa_sum[:, j, None])
    return acc.to(torch.bfloat16)


def _w4a8_op() -> Any | None:
    from tiers.kernels.cpu import w4a8_mm_op

    return w4a8_mm_op()


class Int4WeightOnlyLinear(nn.Module):
    """Asymmetric int4 weights in groups of ``group_size`` input channels.

    Dequantized weight: ``w = (q - 8) * scale + zero`` with q in [0, 15] and
    ``zero = min + 8 * scale`` per group (the layout the packed kernels expect).

    ``int8_activations``: the W4A8 numerics instead - each row's activations quantized to int8 per
    group at run time and integer dot products (``w4a8_reference``; ``tiered_router::w4a8_mm`` on
    the CPU where the kernels are built, 2.5x faster than the bf16 kernel at 16 rows on the Zen 4
    VM). Not the bf16 numbers: a tier opts in (``activation_quantization: int8``). The weights are
    then kept in the W4A8 kernel's layout, or as plain ``uint8 [out, in]`` for the torch path.
    """

    weight_q: torch.Tensor
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, group_size: int = 32, *, int8_activations: bool = False) -> None:
        super().__init__()
        out_f, in_f = linear.weight.shape
        if int8_activations and linear.weight.device.type == "cuda":
            raise ValueError(
                "int4 weights with int8 activations (W4A8) have no CUDA kernel here: it would "
                "dequantize every call; use activation_quantization: none (int4, packed) on CUDA"
            )
        if in_f % group_size:
            raise ValueError(f"in_features {in_f} is not a multiple of group_size {group_size}")
        w = linear.weight.detach().to(torch.float32).reshape(out_f, in_f // group_size, group_size)
        w_min = w.amin(dim=-1, keepdim=True)
        w_max = w.amax(dim=-1, keepdim=True)
        scale = ((w_max - w_min) / 15.0).clamp(min=1e-8)  # [out, groups, 1]
        zero = w_min + 8.0 * scale
        q = torch.clamp(torch.round((w - w_min) / scale), 0, 15).to(torch.int32).reshape(out_f, in_f)
        # scales_and_zeros: [groups, out, 2], the kernels' layout.
        sz = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.group_size = group_size
        self.in_features = in_f
        self.out_features = out_f
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.int8_activations = int8_activations
        # The packed kernels want their device's layout (pack_int4); other devices keep q as uint8
        # [out, in] and dequantize per call. Quantize after the model is on its device.
        device = linear.weight.device.type
        self._packed_cpu = device == "cpu"
        self._packed_cuda = device == "cuda" and not int8_activations
        self._w4a8_packed = False
        if self._packed_cuda:
            self.register_buffer("weight_q", pack_int4(q, group_size))
        elif int8_activations:
            fits = out_f % W4A8_BLOCK == 0 and group_size % 16 == 0
            self._w4a8_packed = self._packed_cpu and fits and _w4a8_op() is not None
            self._packed_cpu = False
            self.register_buffer("weight_q", pack_w4a8(q) if self._w4a8_packed else q.to(torch.uint8))
        elif self._packed_cpu:
            self.register_buffer("weight_q", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        else:
            self.register_buffer("weight_q", q.to(torch.uint8))

    def _dequantized(self, dtype: torch.dtype, q: torch.Tensor) -> torch.Tensor:
        g = self.in_features // self.group_size
        scale = self.scales_and_zeros[..., 0].transpose(0, 1).reshape(self.out_features, g, 1)
        zero = self.scales_and_zeros[..., 1].transpose(0, 1).reshape(self.out_features, g, 1)
        w = (q.reshape(self.out_features, g, self.group_size).to(torch.float32) - 8.0) * scale + zero
        return w.reshape(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.int8_activations:
            xb = x2.to(torch.bfloat16).contiguous()
            op = _w4a8_op() if self._w4a8_packed else None
            if op is not None:
                y = op(xb, self.weight_q, self.group_size, self.scales_and_zeros).to(x.dtype)
            else:
                y = w4a8_reference(xb, self.weight_q, self.group_size, self.scales_and_zeros).to(x.dtype)
        elif self._packed_cpu and x.device.type == "cpu":
            call = _int4_cpu_call(self.out_features, self.weight_q, self.group_size, self.scales_and_zeros)
            y = call(x2.to(torch.bfloat16)).to(x.dtype)
        elif self._packed_cuda:
            xb = x2.to(torch.bfloat16).contiguous()
            y = torch._weight_int4pack_mm(xb, self.weight_q, self.group_size, self.scales_and_zeros).to(
                x.dtype
            )
        else:
            y = x2 @ self._dequantized(x.dtype, self.weight_q).T
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)


def int4_direct_call(mod: Int4WeightOnlyLinear, dtype: torch.dtype) -> Callable[[torch.Tensor], Any] | None:
    """``mod``'s one kernel call on 2-D activations of ``dtype`` where a packed CPU kernel serves
    it without a bias (``rewrite.direct_kernel``), else ``None``."""
    if mod.bias is not None or dtype != torch.bfloat16:
        return None
    w4a8 = _w4a8_op() if mod._w4a8_packed else None
    if w4a8 is not None:
        w, gs, sz = mod.weight_q, mod.group_size, mod.scales_and_zeros
        return lambda x: w4a8(x.contiguous(), w, gs, sz)
    if mod._packed_cpu:
        return _int4_cpu_call(int(mod.out_features), mod.weight_q, mod.group_size, mod.scales_and_zeros)
    if getattr(mod, "_packed_cuda", False):
        w, gs, sz = mod.weight_q, mod.group_size, mod.scales_and_zeros
        return lambda x: torch._weight_int4pack_mm(x.contiguous(), w, gs, sz)
    return None
