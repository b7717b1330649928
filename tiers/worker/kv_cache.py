"""The paged KV pool of one model, and the duck-typed HF cache the generic path writes through.

Layout: one tensor ``kv: [layers, num_blocks + 1, block_size, 2, kv_heads, head_dim]`` (vLLM's
token-major block layout, K and V side by side so each layer's new keys and values land in one
``index_copy_``). Block ``num_blocks`` is a scratch block no sequence owns: padded positions (the
generic path's padding, a CUDA graph's padded rows) write there. Which block holds which token is
the ``BlockManager``'s business (``block_manager.py``, owned here so a tier and the tier it drafts
for share one pool).

The pool is allocated with ``torch.empty`` and each block is zeroed the first time a forward uses
it: resident memory follows the blocks actually used (the budget is an upper bound), and attention
never reads uninitialised memory - positions past a row's length are masked, but a NaN there would
still poison ``softmax(QK) @ V`` (0 x NaN = NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tiers.core.block_manager import BlockManager

__all__ = ["KVPool", "PagedCache"]


class KVPool:
    """The pool tensor, its block manager and the scratch block; zeroes blocks on first use."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        enable_caching: bool,
        to_device: Callable[[list[int]], torch.Tensor],
    ) -> None:
        """``to_device``: a host list of ints to a device tensor (the runner's staging)."""
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size, enable_caching=enable_caching)
        self.scratch_block = num_blocks
        shape = (num_layers, num_blocks + 1, block_size, 2, kv_heads, head_dim)
        self.kv = torch.empty(shape, dtype=dtype, device=device)
        self.kv[:, self.scratch_block].zero_()
        self._to_device = to_device
        self.blocks.copy_block = self.copy_block

    @property
    def scratch_slot(self) -> int:
        """A pool slot no sequence owns (the scratch block's first)."""
        return self.scratch_block * self.block_size

    def copy_block(self, src: int, dst: int) -> None:
        """One block's KV, every layer, into a fresh one: a prefix hit past the last whole block
        (block_manager.py)."""
        self.zero_new_blocks()  # dst may be new: its pending zeroing must not come after the copy
        self.kv[:, dst] = self.kv[:, src]

    def zero_new_blocks(self) -> None:
        fresh = self.blocks.take_first_uses()
        if fresh:
            # The block ids go over in the step's staged copy (no blocking host-to-device copy).
            self.kv.index_fill_(1, self._to_device(fresh), 0)

    def slots(self, table: list[int], start: int, n: int) -> list[int]:
        """Pool slots of positions ``start .. start + n - 1`` of a row with block table ``table``."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]


class PagedCache:
    """Duck-typed HF cache for one padded forward (generic path)."""

    def __init__(self, kv: torch.Tensor, slots: torch.Tensor, block_idx: torch.Tensor, kv_len: int) -> None:
        self.kv = kv
        self.slots = slots  # [B * T] pool slot of every padded token (scratch for padding)
        self.block_idx = block_idx  # [B * num_blocks]
        self.kv_len = kv_len

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [B, kv_heads, T, head_dim] -> flat tokens [B*T, kv_heads, head_dim]
        b, h, t, d = key_states.shape
        pool = self.kv[layer_idx]
        new = torch.stack((key_states.transpose(1, 2), value_states.transpose(1, 2)), dim=2)
        pool.view(-1, 2, h, d).index_copy_(0, self.slots, new.reshape(b * t, 2, h, d).to(pool.dtype))
        kv = pool.index_select(0, self.block_idx).view(b, self.kv_len, 2, h, d)
        return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    @property
    def is_compileable(self) -> bool:
        return False
