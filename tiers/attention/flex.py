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

Shapes that compile once (``tiers/attention/selector.py`` compiles with static shapes): the
query batch is padded to a few buckets (rows to a power of two, queries per row to a power of two
of at least 16, ``bucket_rows``/``bucket_q_len``); padded rows and query tiles past a row's
queries visit no KV block, so on CUDA they cost no memory traffic. The block mask has one query
block per ``Q_TILE`` queries, each visiting only the blocks its last query can see (causal
trimming), and it is built on the device by scatter and arithmetic (no boolean indexing, no
``nonzero``: no host sync). ``flex_kernel_options`` picks Triton tiles that divide its sizes
(inductor refuses a block mask its tiles do not divide).

Eager calls run FlexAttention's reference implementation (it materialises scores: fine for tests
on the CPU, which check it against the gather path); the engine compiles it on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Q_TILE",
    "AttnGroup",
    "PagedBlockMask",
    "bucket_q_len",
    "bucket_rows",
    "flex_kernel_options",
    "flex_paged_attention",
]

Q_TILE = 128
"""Queries per sparse query block (a tile of the block mask): each visits the KV blocks its last
query can see, so a long prompt chunk skips the blocks causality hides from its early tiles."""

# Inductor's default forward tiles (BLOCK_M, BLOCK_N) for bf16/fp16 at head_dim 64 and 128 are
# 128 x 128 or 128 x 64 (``torch/_inductor/template_heuristics/triton.py``: Ampere, Hopper,
# Blackwell): ours are the largest powers of two at most 128 x 64 that divide the block mask's
# sizes (within every one of those tuned shared-memory budgets).
_TILE_CAP = (128, 64)
_MIN_TILE = 16  # Triton's tl.dot needs 16 rows and columns


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``cap``."""
    return min(n & -n, cap)


def bucket_rows(rows: int) -> int:
    """Rows of the padded query batch: the next power of two (1, 2, 4, ... 64, ...)."""
    return 1 << max(rows - 1, 0).bit_length()


def bucket_q_len(q_len: int) -> int:
    """Queries per row of the padded batch: a power of two, at least 16 (one Triton tile)."""
    return max(_MIN_TILE, 1 << max(q_len - 1, 0).bit_length())


def flex_kernel_options(q_block: int, kv_block: int, head_dim: int) -> dict[str, Any]:
    """Triton ``kernel_options`` for a block mask of ``(q_block, kv_block)`` tiles: ``BLOCK_M``
    divides ``q_block`` and ``BLOCK_N`` divides ``kv_block`` (inductor's check, ``kernel/flex/
    flex_attention.py``: "Q and KV block size must be divisible by BLOCK_M and BLOCK_N"), each at
    most inductor's default for ``head_dim``. ``FORCE_USE_FLEX_ATTENTION``: the decode kernel
    (eligible only for power-of-two GQA ratios and static batches) tiles queries by ``q_len * group``
    and would refuse other ``q_block``s; one kernel family keeps the rule exact."""
    if q_block % _MIN_TILE or kv_block % _MIN_TILE:
        raise ValueError(
            f"FlexAttention on CUDA needs query and KV blocks in multiples of {_MIN_TILE} "
            f"(got {q_block} x {kv_block}): choose a KV block size of 16, 32, 64 or 128"
        )
    cap_m, cap_n = _TILE_CAP if head_dim <= 128 else (64, 32)
    return {
        "BLOCK_M": _pow2_divisor(q_block, cap_m),
        "BLOCK_N": _pow2_divisor(kv_block, cap_n),
        "FORCE_USE_FLEX_ATTENTION": True,
    }


def _paged_mask_mod(logical_of: torch.Tensor, starts: torch.Tensor, block_size: int) -> Any:
    """Causality over physical slots: a slot of row ``b``'s block maps back to its logical
    position; slots of blocks not the row's are masked. A closure over tensors only (Dynamo lifts
    them as graph inputs: a new mask per forward reuses the compiled graph)."""

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        block = logical_of[b, kv_idx // block_size]
        pos = block * block_size + kv_idx % block_size
        return (block >= 0) & (pos <= starts[b] + q_idx)

    return mask_mod


class PagedBlockMask:
    """The ``BlockMask`` of one attention group for one forward (shared by every layer).

    ``tables``: ``[rows, max_blocks]`` physical block ids (rows padded with any valid block);
    ``starts``: ``[rows]`` position of each row's first query token; ``q_len``: queries per row;
    ``num_blocks``: blocks in the pool; ``block_size``: tokens per block. Padded to
    ``bucket_rows(rows)`` rows of ``bucket_q_len(q_len)`` queries (``padded_rows``, ``padded_q``)."""

    def __init__(
        self, tables: torch.Tensor, starts: torch.Tensor, q_len: int, num_blocks: int, block_size: int
    ) -> None:
        from torch.nn.attention.flex_attention import BlockMask

        device = tables.device
        rows, max_blocks = tables.shape
        width = max(num_blocks, max_blocks)
        big_rows, big_q = bucket_rows(rows), bucket_q_len(q_len)
        q_block = min(big_q, Q_TILE)
        tiles = big_q // q_block
        self.rows, self.q_len, self.padded_rows, self.padded_q = rows, q_len, big_rows, big_q
        self.q_block, self.block_size = q_block, block_size
        # Padded rows start at 0 and visit nothing; all shapes below depend on the buckets only.
        start = torch.zeros(big_rows, dtype=torch.int64, device=device)
        start[:rows] = starts.to(device=device, dtype=torch.int64)
        table = torch.zeros((big_rows, width), dtype=torch.int64, device=device)
        table[:rows, :max_blocks] = tables.to(torch.int64)
        real = (torch.arange(big_rows, device=device) < rows)[:, None]  # [R, 1]
        # Blocks each tile visits: those holding positions up to its last real query.
        tile_end = (torch.arange(1, tiles + 1, device=device) * q_block).clamp(max=q_len)  # [T]
        live_tile = torch.arange(tiles, device=device) * q_block < q_len
        used = (start[:, None] + tile_end[None, :] + block_size - 1) // block_size  # [R, T]
        used = used.clamp(max=max_blocks) * (real & live_tile[None, :])
        # Physical -> logical block per row (-1: not the row's), by a scatter whose dead entries
        # (padding, blocks past the row's last) land in an extra column that is then dropped.
        logical = torch.arange(width, device=device).expand(big_rows, -1)
        live = logical < used.amax(dim=1, keepdim=True)
        dest = torch.where(live, table, width)
        logical_of = torch.full((big_rows, width + 1), -1, dtype=torch.int64, device=device)
        logical_of.scatter_(1, dest, torch.where(live, logical, -1))
        self.logical_of, self.starts = logical_of[:, :width].contiguous(), start
        kv_indices = table.to(torch.int32)[:, None, None, :].expand(big_rows, 1, tiles, width).contiguous()
        self.block_mask = BlockMask.from_kv_blocks(
            used.to(torch.int32).view(big_rows, 1, tiles),
            kv_indices,
            BLOCK_SIZE=(q_block, block_size),
            mask_mod=_paged_mask_mod(self.logical_of, start, block_size),
            seq_lengths=(big_q, width * block_size),
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
    ``[rows * q_len, heads, dim]``. ``compiled``: ``torch.compile(flex_attention)`` (selector.py);
    on CUDA it is given tiles that divide the mask's blocks (``flex_kernel_options``)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = compiled or flex_attention
    n, heads, dim = q.shape
    rows = n // q_len
    blocks, block_size, _, kv_heads, _ = pool.shape
    kv = pool.view(blocks * block_size, 2, kv_heads, dim)
    keys = kv[:, 0].permute(1, 0, 2).unsqueeze(0).to(q.dtype)  # [1, kv_heads, S, dim]
    values = kv[:, 1].permute(1, 0, 2).unsqueeze(0).to(q.dtype)
    qb = q.view(rows, q_len, heads, dim).transpose(1, 2)  # [rows, heads, q_len, dim]
    big_rows, big_q = mask.padded_rows, mask.padded_q
    if (big_rows, big_q) != (rows, q_len):
        padded = q.new_zeros((big_rows, heads, big_q, dim))
        padded[:rows, :, :q_len] = qb
        qb = padded
    options: Any = flex_kernel_options(mask.q_block, block_size, dim) if q.is_cuda else None
    out = fn(
        qb,
        keys,
        values,
        block_mask=mask.block_mask,
        scale=scale,
        enable_gqa=heads != kv_heads,
        kernel_options=options,
    )
    return out[:rows, :, :q_len].transpose(1, 2).reshape(n, heads, dim)


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
