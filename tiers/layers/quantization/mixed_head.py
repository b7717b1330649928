"""An output head in two precisions: the frequent tokens' rows int8, the long tail int4."""

from __future__ import annotations

import torch
from torch import nn

from tiers.layers.quantization.int4 import Int4WeightOnlyLinear
from tiers.layers.quantization.int8 import W8A8_ALIGN, Int8WeightOnlyLinear, w8a8_fits

__all__ = ["MixedHead"]


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
        w8a8 = int8_activations and w8a8_fits(linear, group_size)
        self.hot = Int8WeightOnlyLinear(parts[0], int8_activations=w8a8, group_size=group_size)
        self.cold = Int4WeightOnlyLinear(parts[1], group_size, int8_activations=int8_activations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hot = self.hot(x)
        return torch.cat([hot, self.cold(x).to(hot.dtype)], dim=-1)
