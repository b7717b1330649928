"""Weight-only quantization: drop-in ``nn.Linear`` replacements and a handler that rewrites a model.

Why weight-only: at the batch sizes a tier serves, a decoder step reads every weight once, so the
step costs about (bytes of weights) / (memory bandwidth). Storing weights in 8 or 4 bits cuts that
read 4x or 8x against fp32 while activations stay in bf16, which is what makes the lower tiers
measurably cheaper per token and good drafts for the tier above.

On the CPU both formats run fused kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``)
that take bf16 activations. Elsewhere the weight is dequantized per call: correct everywhere, fast
only where bandwidth is not the limit. At 16 rows a CPU step is no longer bound by reading the
weights but by the fp32 multiply-adds; int4 layers can opt into int8 activations (W4A8,
``Int4WeightOnlyLinear(int8_activations=True)``), whose integer dot products are ~2.5x cheaper.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from tiers.kernels.cpu import cpu_is_intel
from tiers.kernels.cpu import w8_linear_op as _w8_linear_op
from tiers.layers.fp32_packed import PackedFp32Linear, direct_call

__all__ = [
    "Int4WeightOnlyLinear",
    "Int8WeightOnlyLinear",
    "MixedHead",
    "QuantMethod",
    "cpu_is_intel",
    "direct_kernel",
    "pack_w4a8",
    "pack_w8a8",
    "quantize_model",
    "w4a8_reference",
    "w8a8_reference",
]

QuantMethod = Literal["none", "int8", "int4"]


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
            if not _w8a8_fits(linear, group_size):
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
        elif x.device.type == "cpu" and x.dtype == torch.bfloat16:
            op = _w8_linear_op() or torch._weight_int8pack_mm
            y = op(x2.contiguous(), self.weight_q, self.scale.to(x.dtype))
        else:
            y = x2 @ (self.weight_q.to(x.dtype) * self.scale.to(x.dtype)[:, None]).T
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)


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
        # The packed CPU kernel wants its own layout; other devices keep q as uint8 [out, in] and
        # dequantize per call. Quantize after the model is on its device.
        self._packed_cpu = linear.weight.device.type == "cpu"
        self._w4a8_packed = False
        if int8_activations:
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
        else:
            y = x2 @ self._dequantized(x.dtype, self.weight_q).T
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)


class MixedHead(nn.Module):
    """An output head in two precisions: rows ``[0, int8_rows)`` int8 (``Int8WeightOnlyLinear``),
    the rest int4 in groups of ``group_size`` (``Int4WeightOnlyLinear``); logits concatenated.

    A byte-level BPE vocabulary is numbered in merge order, so the low ids are the frequent tokens a
    greedy decode picks: int8 there and int4 in the long tail keeps the int8 head's greedy agreement
    at two thirds of its bytes, which a one-row decode step reads from memory. Both parts are
    batch-invariant, so the concatenation is (``benchmarks/mixed_head.py`` measures it)."""

    def __init__(self, linear: nn.Linear, int8_rows: int, group_size: int, *, int8_activations: bool) -> None:
        super().__init__()
        out_f, in_f = linear.weight.shape
        if not 0 < int8_rows < out_f or int8_rows % W8A8_ALIGN:
            raise ValueError(f"int8_rows must be a multiple of {W8A8_ALIGN} in (0, {out_f}), got {int8_rows}")
        self.in_features, self.out_features, self.int8_rows = in_f, out_f, int8_rows
        parts = []
        for rows in (slice(0, int8_rows), slice(int8_rows, out_f)):
            part = nn.Linear(in_f, rows.stop - rows.start, bias=linear.bias is not None, device="meta")
            part.weight = nn.Parameter(linear.weight.detach()[rows], requires_grad=False)
            if linear.bias is not None:
                part.bias = nn.Parameter(linear.bias.detach()[rows], requires_grad=False)
            parts.append(part)
        w8a8 = int8_activations and _w8a8_fits(linear, group_size)
        self.hot = Int8WeightOnlyLinear(parts[0], int8_activations=w8a8, group_size=group_size)
        self.cold = Int4WeightOnlyLinear(parts[1], group_size, int8_activations=int8_activations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hot = self.hot(x)
        return torch.cat([hot, self.cold(x).to(hot.dtype)], dim=-1)


def direct_kernel(mod: nn.Module, dtype: torch.dtype) -> Any:
    """``mod.forward`` as one kernel call on 2-D activations of ``dtype``, or ``mod.forward``.

    Why: a small model's decode step makes ~120 projection calls; for the packed int4 kernel the
    module's reshapes and no-op dtype casts around the one op are Python and dispatch work on
    every call. The fast path feeds 2-D activations of the model's dtype, so those steps are
    skipped - the same op on the same tensors, so the result is bitwise the module's. The same
    holds for the fp32 tier's oneDNN-packed linears: on the AMD EPYC Zen 1 VM the large tier's
    decode step went 60.2 -> 59.3 ms at 1 sequence and 138 -> 133 ms at 16 (in-process A/B)."""
    w4a8 = _w4a8_op() if isinstance(mod, Int4WeightOnlyLinear) and mod._w4a8_packed else None
    if w4a8 is not None and mod.bias is None and dtype == torch.bfloat16:
        w, gs, sz = mod.weight_q, mod.group_size, mod.scales_and_zeros
        return lambda x: w4a8(x.contiguous(), w, gs, sz)
    if (
        isinstance(mod, Int4WeightOnlyLinear)
        and mod._packed_cpu
        and mod.bias is None
        and dtype == torch.bfloat16
    ):
        return _int4_cpu_call(int(mod.out_features), mod.weight_q, mod.group_size, mod.scales_and_zeros)
    w8a8 = _w8a8_op() if isinstance(mod, Int8WeightOnlyLinear) and mod.w8a8_packed is not None else None
    if w8a8 is not None and mod.bias is None and dtype == torch.bfloat16:
        packed, group, s32 = mod.w8a8_packed, mod.group_size, mod.w8a8_scale.float()
        return lambda x: w8a8(x.contiguous(), packed, group, s32)
    w8 = _w8_linear_op() if isinstance(mod, Int8WeightOnlyLinear) and not mod.int8_activations else None
    if w8 is not None and mod.bias is None and dtype == torch.bfloat16 and mod.weight_q.device.type == "cpu":
        q, scale = mod.weight_q, mod.scale.to(torch.bfloat16)
        return lambda x: w8(x.contiguous(), q, scale)
    if isinstance(mod, PackedFp32Linear) and dtype == torch.float32:
        return direct_call(mod)
    return mod.forward


def _untie_head(model: Any) -> None:
    """Give the output head its own weight, so it can be rewritten without touching the embedding."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and head.weight is getattr(model.get_input_embeddings(), "weight", None):
        untied = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None)
        untied.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        model.lm_head = untied
        if hasattr(model, "config"):
            model.config.tie_word_embeddings = False


def _w8a8_fits(linear: nn.Linear, group_size: int) -> bool:
    return linear.in_features % group_size == 0 and group_size % 16 == 0 and group_size <= 1024


def quantize_model(
    model: nn.Module,
    method: QuantMethod,
    *,
    group_size: int = 32,
    int4_head: bool = False,
    int8_activations: bool = False,
    int8_head_rows: int = 0,
) -> nn.Module:
    """Rewrite every ``nn.Linear`` in place (the output head included, untied from the embedding).

    The output head gets int8 under ``int4`` unless ``int4_head``: it is one matrix but decides
    every token; an int4 head keeps its first ``int8_head_rows`` rows int8 (``MixedHead``; all of
    them when the vocabulary has no more). ``int8_activations``: the int4 linears use W4A8 numerics
    (``Int4WeightOnlyLinear``) and an int8 head W8A8 (``Int8WeightOnlyLinear``).
    """
    if method == "none":
        return model
    _untie_head(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            is_head = child is getattr(model, "lm_head", None)
            if is_head and method == "int4" and int4_head and 0 < int8_head_rows < child.out_features:
                mixed = MixedHead(child, int8_head_rows, group_size, int8_activations=int8_activations)
                setattr(parent, name, mixed)
            elif method == "int8" or (is_head and not (int4_head and int8_head_rows < child.out_features)):
                # A head beside W4A8 layers takes int8 activations too, in groups of the tier's
                # size where they divide its inputs (``Int8WeightOnlyLinear``).
                w8a8 = int8_activations and is_head and _w8a8_fits(child, group_size)
                setattr(
                    parent, name, Int8WeightOnlyLinear(child, int8_activations=w8a8, group_size=group_size)
                )
            elif child.in_features % group_size == 0:
                q4 = Int4WeightOnlyLinear(child, group_size, int8_activations=int8_activations)
                setattr(parent, name, q4)
            else:
                setattr(parent, name, Int8WeightOnlyLinear(child))
    return model
