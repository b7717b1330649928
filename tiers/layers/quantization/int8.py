"""int8 weights: per-output-channel symmetric int8 linears with bf16 activations (weight-only) or
int8 activations per group (W8A8), their packing for the CPU kernels, and bitwise torch references.

On the CPU with bf16 activations ``tiered_router::w8_linear`` runs where built (batch-invariant),
else torch's ``_weight_int8pack_mm``. On CUDA the weight-only layer runs ``_weight_int8pack_mm``
where this torch has a CUDA kernel for it (probed once) and is refused otherwise, as W8A8 is (no
CUDA kernel here: either would dequantize every call, more bytes than bf16); elsewhere the weight
is dequantized per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tiers.kernels.cpu import w8_linear_op as _w8_linear_op

__all__ = [
    "W8A8_ALIGN",
    "Int8WeightOnlyLinear",
    "int8_direct_call",
    "pack_w8a8",
    "quantize_activations",
    "w8a8_fits",
    "w8a8_reference",
]


class Int8WeightOnlyLinear(nn.Module):
    """Symmetric per-output-channel int8 weights; ``y = (x @ q.T) * scale``. On the CPU with bf16
    activations ``tiered_router::w8_linear`` where built (batch-invariant), else ``_weight_int8pack_mm``.

    ``int8_activations``: W8A8 numerics instead - each row's activations quantized to int8 per
    group of ``group_size`` inputs, exact integer dot products (``w8a8_reference``; the kernel
    ``tiered_router::w8a8_linear`` where built). For the output head of a tier whose int4 layers
    already take int8 activations (the medium tier): from 4 rows ``w8_linear`` is bound by its fp32
    multiply-add per weight per row, and the integer kernel runs the 49,152 x 576 head 2x (4 rows)
    to 3.3x (16) faster; at one row both read the same 28 MB at the memory's speed."""

    weight_q: torch.Tensor
    scale: torch.Tensor
    w8a8_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, *, int8_activations: bool = False, group_size: int = 32) -> None:
        super().__init__()
        if linear.weight.device.type == "cuda":
            _refuse_on_cuda(int8_activations)
        w = linear.weight.detach().to(torch.float32)
        # scale: [out] so that max |w| of each row maps to 127.
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.register_buffer("weight_q", torch.round(w / scale[:, None]).to(torch.int8))  # [out, in]
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.int8_activations = int8_activations
        self.group_size = group_size
        self.w8a8_packed: torch.Tensor | None = None
        if int8_activations:
            if not w8a8_fits(linear, group_size):
                raise ValueError(
                    f"W8A8 needs a group size dividing {self.in_features}, a multiple of 16, <= 1024"
                )
            # The scale the bf16-activation kernels apply (rounded to bf16), in fp32 for the kernel.
            self.register_buffer("w8a8_scale", scale.to(torch.bfloat16).float())
            fits = self.out_features % W8A8_ALIGN == 0 and self.in_features % 4 == 0
            if fits and linear.weight.device.type == "cpu" and _w8a8_op() is not None:
                self.w8a8_packed = pack_w8a8(self.weight_q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.int8_activations:
            op = _w8a8_op() if self.w8a8_packed is not None and x.device.type == "cpu" else None
            scale = self.w8a8_scale.float()  # a model-wide ``.to(bfloat16)`` rounds it losslessly
            if op is not None:
                y = op(x2.to(torch.bfloat16).contiguous(), self.w8a8_packed, self.group_size, scale)
            else:
                y = w8a8_reference(x2, self.weight_q, self.group_size, scale)
            y = y.to(x.dtype)
        elif x.device.type == "cuda":
            xb = x2.to(torch.bfloat16).contiguous()
            y = torch._weight_int8pack_mm(xb, self.weight_q, self.scale.to(torch.bfloat16)).to(x.dtype)
        elif x.device.type == "cpu" and x.dtype == torch.bfloat16:
            op = _w8_linear_op() or torch._weight_int8pack_mm
            y = op(x2.contiguous(), self.weight_q, self.scale.to(x.dtype))
        else:
            y = x2 @ (self.weight_q.to(x.dtype) * self.scale.to(x.dtype)[:, None]).T
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)


def _refuse_on_cuda(int8_activations: bool) -> None:
    """A clear error where int8 would dequantize every call on CUDA."""
    hint = "use int4 (packed on CUDA) or no quantization on this device"
    if int8_activations:
        raise ValueError(f"int8 weights with int8 activations (W8A8) have no CUDA kernel here: {hint}")
    try:
        w = torch.zeros((8, 32), dtype=torch.int8, device="cuda")
        torch._weight_int8pack_mm(
            torch.zeros((1, 32), dtype=torch.bfloat16, device="cuda"),
            w,
            torch.ones(8, device="cuda", dtype=torch.bfloat16),
        )
    except (NotImplementedError, RuntimeError) as e:
        raise ValueError(
            f"this torch has no CUDA kernel for int8 weight-only matmuls ({e}): {hint}"
        ) from None


W8A8_ALIGN = 64
"""Output channels ``tiered_router::w8a8_linear`` takes in whole multiples of (its widest task)."""


def pack_w8a8(q: torch.Tensor) -> torch.Tensor:
    """int8 values ``q: [N, K]`` in ``tiered_router::w8a8_linear``'s layout ``uint8 [N / 16, K / 4,
    64]``: per block of 16 output channels and 4 inputs, byte ``4c + i`` holds ``q[16b + c, 4j + i]
    + 128`` (w8a8_linear.cpp)."""
    n, k = q.shape
    u = (q.to(torch.int16) + 128).to(torch.uint8).reshape(n // 16, 16, k // 4, 4)
    return u.permute(0, 2, 1, 3).reshape(n // 16, k // 4, 64).contiguous()


def quantize_activations(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` as int8 values per group of ``group_size`` (quantize_rows.h's arithmetic):
    ``xq: [M, K / G, G]`` (integers in fp32) and ``sa: [M, K / G]``, the group's scale."""
    m, k = x.shape
    xf = x.to(torch.bfloat16).float().reshape(m, k // group_size, group_size)
    amax = xf.abs().amax(-1)
    # torch's ``127.0 / t`` is ``t.reciprocal() * 127`` (two roundings); the kernel divides once.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xf * inv[..., None]), amax / 127.0


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, group_size: int, scale: torch.Tensor) -> torch.Tensor:
    """int8 weights ``q: [N, K]`` with fp32 ``scale: [N]`` times activations quantized to int8 per
    group, in torch ops: bitwise what ``tiered_router::w8a8_linear`` computes, on any device. The
    integer dot products run as fp32 matmuls: every partial sum is an integer below 2^24 (G <= 1024),
    so they are exact in any summation order."""
    n, g = q.shape[0], group_size
    xq, sa = quantize_activations(x, g)
    dots = torch.einsum("mgi,ngi->mgn", xq, q.float().reshape(n, -1, g))
    acc = torch.zeros(x.shape[0], n, device=x.device)
    for j in range(xq.shape[1]):  # in group order, one rounding per op, as the kernel
        acc = acc + dots[:, j] * sa[:, j, None]
    return (acc * scale.float()).to(torch.bfloat16)


def _w8a8_op() -> Any | None:
    from tiers.kernels.cpu import w8a8_linear_op

    return w8a8_linear_op()


def w8a8_fits(linear: nn.Linear, group_size: int) -> bool:
    """Whether W8A8's groups of ``group_size`` inputs divide ``linear``'s and the kernel takes them."""
    return linear.in_features % group_size == 0 and group_size % 16 == 0 and group_size <= 1024


def int8_direct_call(mod: Int8WeightOnlyLinear, dtype: torch.dtype) -> Callable[[torch.Tensor], Any] | None:
    """``mod``'s one kernel call on 2-D activations of ``dtype`` where a packed CPU kernel serves
    it without a bias (``rewrite.direct_kernel``), else ``None``."""
    if mod.bias is not None or dtype != torch.bfloat16:
        return None
    w8a8 = _w8a8_op() if mod.w8a8_packed is not None else None
    if w8a8 is not None:
        packed, group, s32 = mod.w8a8_packed, mod.group_size, mod.w8a8_scale.float()
        return lambda x: w8a8(x.contiguous(), packed, group, s32)
    w8 = _w8_linear_op() if not mod.int8_activations else None
    if w8 is not None and mod.weight_q.device.type == "cpu":
        q, scale = mod.weight_q, mod.scale.to(torch.bfloat16)
        return lambda x: w8(x.contiguous(), q, scale)
    return None
