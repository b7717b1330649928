"""Attention over the paged KV pool with PyTorch's FlexAttention: the keys and values are read in
place from the pool's blocks, with no gathered copy and no dense mask.

Why FlexAttention: it is PyTorch's own maintained kernel generator (Triton on CUDA, C++ through
inductor on the CPU), it ships with torch itself (the GPU image has no FlashInfer or vLLM), and
it takes block sparsity as data: a ``BlockMask`` that lists, per row, which KV blocks to visit.
The pool's blocks are exactly such blocks, so each row's block table becomes its list of
physical KV blocks (PyTorch documents paged attention this way:
``torch.nn.attention.experimental._paged_attention``). The other candidate, SDPA over gathered
blocks with an additive mask (the generic path in ``tiers/models/llama.py``), copies every row's
blocks for every layer and step and keeps SDPA off its flash kernels.

Layout: all rows of a group (equal query length ``q_len``) form the query batch
``[rows, heads, q_len, dim]``; the whole pool of one layer is a single KV sequence
``[1, kv_heads, blocks * block_size, dim]`` that every row shares (a view: no copy). Row ``r``
visits the blocks of its table that hold positions ``< starts[r] + q_len`` (``kv_num_blocks``,
``kv_indices``), and inside them the mask maps a physical slot back to its logical position
(``logical_of[r, block] * block_size + offset``) to apply causality: query ``i`` of row ``r`` sits
at position ``starts[r] + i`` and sees positions up to it. GQA is FlexAttention's own
(``enable_gqa``): K/V are read once per KV head.

Eager calls run FlexAttention's reference implementation (it materialises scores: fine for tests
on the CPU, which check it against the gather path); the engine compiles it on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AttnGroup", "PagedBlockMask", "flex_paged_attention"]


class PagedBlockMask:
    """The ``BlockMask`` of one attention group for one forward (shared by every layer).

    ``tables``: ``[rows, max_blocks]`` physical block ids (rows padded with any valid block);
    ``starts``: ``[rows]`` position of each row's first query token; ``q_len``: queries per row;
    ``num_blocks``: blocks in the pool; ``block_size``: tokens per block."""

    def __init__(
        self, tables: torch.Tensor, starts: torch.Tensor, q_len: int, num_blocks: int, block_size: int
    ) -> None:
        from torch.nn.attention.flex_attention import BlockMask

        device = tables.device
        rows, max_blocks = tables.shape
        starts = starts.to(device=device, dtype=torch.int64)
        tables = tables.to(torch.int64)
        # Blocks each row visits: those holding positions < starts + q_len (the rest is padding).
        used = ((starts + q_len + block_size - 1) // block_size).clamp(max=max_blocks)
        # Physical -> logical block per row; -1 where the block is not the row's (or padding).
        logical_of = torch.full((rows, num_blocks), -1, dtype=torch.int64, device=device)
        logical = torch.arange(max_blocks, device=device).expand(rows, -1)
        live = logical < used[:, None]
        logical_of[torch.arange(rows, device=device)[:, None].expand(-1, max_blocks)[live], tables[live]] = (
            logical[live]
        )
        self.logical_of, self.starts, self.block_size = logical_of, starts, block_size

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            block = self.logical_of[b, kv_idx // self.block_size]
            pos = block * self.block_size + kv_idx % self.block_size
            return (block >= 0) & (pos <= self.starts[b] + q_idx)

        # One query block per row: q_len queries, padded up to a multiple of 16 for the kernels.
        # The index list is as wide as the pool: BlockMask derives its transpose (which query
        # blocks visit a KV block) over that many columns.
        q_block = max(16, -(-q_len // 16) * 16)
        kv_indices = torch.zeros((rows, 1, 1, max(num_blocks, max_blocks)), dtype=torch.int32, device=device)
        kv_indices[:, 0, 0, :max_blocks] = tables.to(torch.int32)
        self.block_mask = BlockMask.from_kv_blocks(
            used.to(torch.int32).view(rows, 1, 1),
            kv_indices,
            BLOCK_SIZE=(q_block, block_size),
            mask_mod=mask_mod,
            seq_lengths=(q_len, num_blocks * block_size),
        )


def flex_paged_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    mask: PagedBlockMask,
    q_len: int,
    scale: float,
    *,
    compiled: Any = None,
) -> torch.Tensor:
    """Causal attention of ``q`` (``[rows * q_len, heads, dim]``, row-major) over one layer's
    ``pool`` (``[blocks, block_size, 2, kv_heads, dim]``), read in place; returns
    ``[rows * q_len, heads, dim]``. ``compiled``: ``torch.compile(flex_attention)`` (CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = compiled or flex_attention
    n, heads, dim = q.shape
    rows = n // q_len
    blocks, block_size, _, kv_heads, _ = pool.shape
    kv = pool.view(blocks * block_size, 2, kv_heads, dim)
    keys = kv[:, 0].permute(1, 0, 2).unsqueeze(0).to(q.dtype)  # [1, kv_heads, S, dim]
    values = kv[:, 1].permute(1, 0, 2).unsqueeze(0).to(q.dtype)
    qb = q.view(rows, q_len, heads, dim).transpose(1, 2)  # [rows, heads, q_len, dim]
    out = fn(qb, keys, values, block_mask=mask.block_mask, scale=scale, enable_gqa=heads != kv_heads)
    return out.transpose(1, 2).reshape(n, heads, dim)


@dataclass(slots=True)
class AttnGroup:
    """Rows with the same query length, contiguous in the flattened token stream."""

    first: int
    """Index of the group's first token in the flattened stream."""
    num_rows: int
    q_len: int
    block_idx: torch.Tensor
    """``[num_rows * num_blocks]``: pool blocks to gather, row-major (padded with the scratch block)."""
    kv_len: int
    """Gathered positions per row (``num_blocks * block_size``)."""
    starts: torch.Tensor
    """``[num_rows]`` int64 (CPU): position of each row's first query token."""
    mask: torch.Tensor | None
    """``[num_rows, 1, group * q_len, kv_len]`` additive (0 / -inf, the activations' dtype), query
    axis in GQA-folded order. Built once per forward: a bool mask would be turned into this inside
    every layer's attention call (the same values, so the same result). ``None`` where the paged
    attention kernel serves the group: it derives causality from ``starts``."""
    flex: PagedBlockMask | None = None
    """FlexAttention's block mask of the group (``FastDecoder.uses_flex``): its rows' blocks read
    in place, no gathered copy, no dense mask."""
