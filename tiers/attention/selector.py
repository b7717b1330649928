"""Which attention a Llama-family forward runs over the paged pool, in one place.

Three backends, per group of rows with equal query length (``AttnGroup``):

- FlexAttention over the pool in place (``flex.py``): on CUDA, compiled (Triton), for every
  query length; on the CPU only with ``TIERED_ROUTER_ATTENTION=flex`` (eager: the tests run the
  GPU path's Python) or ``flex-compile`` (compiled through inductor's C++ template, static shapes:
  its dynamic-shape template does not build on the CPU).
- The CPU paged attention kernel (``tiers/kernels/csrc/paged_attention.cpp``): AVX2/AVX512 CPUs,
  bf16 or fp32 pools, short query groups (``PAGED_ATTENTION_MAX_Q_LEN``) or every group
  (``batch_invariant``).
- Gather + SDPA: the rows' blocks copied out and attended with an additive mask, as HF's SDPA
  integration does it (GQA folded into the query axis); the generic path.

Compiled FlexAttention sees bucketed static shapes (``flex.bucket_rows``/``bucket_q_len``), so its
graphs are bounded by the buckets: the recompile limit is raised to that bound, no further.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tiers.attention.flex import flex_paged_attention

if TYPE_CHECKING:
    from tiers.attention.flex import AttnGroup

__all__ = [
    "GRAPHS_PER_MODEL",
    "PAGED_ATTENTION_MAX_Q_LEN",
    "AttentionBackend",
    "attend",
    "flex_attention_fn",
    "gather_sdpa_attention",
    "paged_attention_op",
    "paged_attention_serves",
]

# Query tokens per row up to which the paged attention kernel replaces gather + SDPA: decode (1),
# speculative verification (k + 1) and short prefill chunks. Its per-key dot products beat the flash
# kernel's setup for these; long prefills, where SDPA's blocked GEMMs pay, keep SDPA.
PAGED_ATTENTION_MAX_Q_LEN = 64

GRAPHS_PER_MODEL = 2 * 10 * 11
"""Bound on compiled FlexAttention graphs per model: row buckets up to 512 (10) x query buckets
16 .. 16384 (11), two graphs each at most (Dynamo's first frame and its static specialisation)."""

_compiled_models = 0


def _raise_recompile_limit(models: int) -> None:
    """Dynamo falls back to eager past ``recompile_limit`` graphs of one code object (and eager
    FlexAttention materialises the score matrix): every model shares ``flex_attention``'s, so the
    limit follows the bounded count of graphs of the models compiled in this process."""
    cfg = torch._dynamo.config
    need = models * GRAPHS_PER_MODEL
    for name in (
        "recompile_limit",
        "cache_size_limit",
        "accumulated_recompile_limit",
        "accumulated_cache_size_limit",
    ):
        if hasattr(cfg, name) and getattr(cfg, name) < need:
            setattr(cfg, name, need)


def flex_attention_fn(device: torch.device) -> Any | None:
    """FlexAttention for a model on ``device``, or ``None`` (the CPU kernel or gather + SDPA).
    ``TIERED_ROUTER_ATTENTION``: ``auto`` (compiled on CUDA, off on the CPU), ``sdpa`` (off),
    ``flex`` (compiled on CUDA, eager on the CPU), ``flex-compile`` (compiled anywhere)."""
    global _compiled_models
    choice = os.environ.get("TIERED_ROUTER_ATTENTION", "auto")
    on_cuda = device.type == "cuda"
    if choice == "sdpa" or (choice == "auto" and not on_cuda):
        return None
    from torch.nn.attention.flex_attention import flex_attention

    if not on_cuda and choice != "flex-compile":
        return flex_attention
    # Static shapes: the block mask pads rows and queries to buckets, so each bucket is one graph
    # (dynamic=True also fails to build in inductor's CPU template).
    _compiled_models += 1
    _raise_recompile_limit(_compiled_models)
    return torch.compile(flex_attention, dynamic=False)


def paged_attention_op(device: torch.device, head_dim: int, group: int, dtype: torch.dtype) -> Any | None:
    """The paged attention kernel where it applies: a CPU pool of bf16 or fp32 (the pool has the
    model's dtype), head sizes and GQA groups it is built for."""
    from tiers.kernels import cpu as cpu_kernels

    op = cpu_kernels.paged_attention_op()
    if op is None or device.type != "cpu":
        return None
    if head_dim not in (16, 32, 64, 128) or group > 8:
        return None
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    return op


def paged_attention_serves(op: Any | None, q_len: int, every_query: bool) -> bool:
    """Whether a group with ``q_len`` queries per row runs the paged kernel ``op`` (then it needs
    no mask and no gathered copy of its blocks)."""
    return op is not None and (every_query or q_len <= PAGED_ATTENTION_MAX_Q_LEN)


@dataclass(slots=True)
class AttentionBackend:
    """One model's attention choices and head layout."""

    flex: Any | None
    """FlexAttention (compiled or eager) serving every group, or ``None``."""
    paged: Any | None
    """The CPU paged kernel for the groups without a mask, or ``None``."""
    scale: float
    num_heads: int
    num_kv_heads: int
    head_dim: int


def gather_sdpa_attention(
    q: torch.Tensor, pool: torch.Tensor, g: AttnGroup, be: AttentionBackend
) -> torch.Tensor:
    """Gather + SDPA: the group's blocks copied out of ``pool``, GQA folded into the query axis
    (``[rows, kv_heads, group * q_len, dim]``, so K/V are read once, never repeated per head)."""
    rows, t, heads, kv_heads, dim = g.num_rows, g.q_len, be.num_heads, be.num_kv_heads, be.head_dim
    group = heads // kv_heads
    kv = pool.index_select(0, g.block_idx).view(rows, g.kv_len, 2, kv_heads, dim)
    keys = kv[:, :, 0].transpose(1, 2).to(q.dtype)  # [rows, kv_heads, kv_len, dim]
    values = kv[:, :, 1].transpose(1, 2).to(q.dtype)
    qg = q.view(rows, t, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(rows, kv_heads, group * t, dim)
    attn = F.scaled_dot_product_attention(qg, keys, values, attn_mask=g.mask, scale=be.scale)
    return attn.view(rows, kv_heads, group, t, dim).permute(0, 3, 1, 2, 4).reshape(rows * t, heads, dim)


def attend(q: torch.Tensor, pool: torch.Tensor, g: AttnGroup, be: AttentionBackend) -> torch.Tensor:
    """Attention of one group's queries ``q`` (``[rows * q_len, heads, dim]``) over one layer's
    ``pool``: FlexAttention where the group has a block mask, the paged kernel where it has no
    additive mask, else gather + SDPA."""
    if g.flex is not None:  # FlexAttention reads the pool in place (flex.py)
        return flex_paged_attention(q, pool, g.flex, g.q_len, be.scale, compiled=be.flex)
    if g.mask is None:  # the paged kernel reads the pool in place (paged_attention_serves)
        assert be.paged is not None
        return be.paged(q, pool, g.block_idx.view(g.num_rows, -1), g.starts, g.q_len, be.scale)
    return gather_sdpa_attention(q, pool, g, be)
