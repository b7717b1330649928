"""The model rewrite: every ``nn.Linear`` replaced by its quantized format, and the direct kernel call
the fast path makes per projection.

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

from tiers.layers.fp32_packed import PackedFp32Linear, direct_call
from tiers.layers.quantization.int4 import Int4WeightOnlyLinear, int4_direct_call
from tiers.layers.quantization.int8 import Int8WeightOnlyLinear, int8_direct_call, w8a8_fits
from tiers.layers.quantization.mixed_head import MixedHead

__all__ = ["QuantMethod", "direct_kernel", "quantize_model"]

QuantMethod = Literal["none", "int8", "int4"]


def direct_kernel(mod: nn.Module, dtype: torch.dtype) -> Any:
    """``mod.forward`` as one kernel call on 2-D activations of ``dtype``, or ``mod.forward``.

    Why: a small model's decode step makes ~120 projection calls; for the packed int4 kernel the
    module's reshapes and no-op dtype casts around the one op are Python and dispatch work on
    every call. The fast path feeds 2-D activations of the model's dtype, so those steps are
    skipped - the same op on the same tensors, so the result is bitwise the module's. The same
    holds for the fp32 tier's oneDNN-packed linears: on the AMD EPYC Zen 1 VM the large tier's
    decode step went 60.2 -> 59.3 ms at 1 sequence and 138 -> 133 ms at 16 (in-process A/B)."""
    call = None
    if isinstance(mod, Int4WeightOnlyLinear):
        call = int4_direct_call(mod, dtype)
    elif isinstance(mod, Int8WeightOnlyLinear):
        call = int8_direct_call(mod, dtype)
    elif isinstance(mod, PackedFp32Linear) and dtype == torch.float32:
        call = direct_call(mod)
    if call is not None:
        return call
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
                w8a8 = int8_activations and is_head and w8a8_fits(child, group_size)
                setattr(
                    parent, name, Int8WeightOnlyLinear(child, int8_activations=w8a8, group_size=group_size)
                )
            elif child.in_features % group_size == 0:
                q4 = Int4WeightOnlyLinear(child, group_size, int8_activations=int8_activations)
                setattr(parent, name, q4)
            else:
                setattr(parent, name, Int8WeightOnlyLinear(child))
    return model
