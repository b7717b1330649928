"""Prefix KV cache: reuse the KV of shared prompt prefixes (system prompts, few-shot examples,
earlier turns) across requests on the same tier.

Prompts are cut into blocks of ``block_size`` tokens; block i is named by a hash chained over
blocks 0..i (vLLM's scheme), so equal names mean equal prefixes. After a prompt's prefill the KV of
its full blocks is copied out of the sequence's slot into this store; a new request copies the
longest run of known blocks into its slot and starts computing after them. Copies are cheap next to
recomputing: a block's KV is read once, while a forward reads every weight of the model. Only the
tier's own KV is kept; a speculative draft catches up on the prompt lazily, when it first drafts.

Storage is one preallocated pool of ``capacity_tokens // block_size`` blocks, allocated (and
touched) when the engine is built: memory is flat from the first request on, and eviction (LRU)
only recycles block indices.

The store lives on the device thread; no locking.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tiers.model_runner import ModelRunner

__all__ = ["PrefixCache"]


class PrefixCache:
    def __init__(self, capacity_tokens: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.capacity_blocks = max(0, capacity_tokens // block_size)
        # hash -> (pool index, the block's tokens: checked on lookup, so a collision never serves wrong KV)
        self._index: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._free: list[int] = []
        self._pool: torch.Tensor | None = None  # [blocks, layers, 2, kv_heads, block_size, head_dim]
        self.hits = 0
        self.queries = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._index)

    def allocate(self, runner: ModelRunner) -> None:
        """Reserve the pool in the runner's layout and dtype (call once, at engine build)."""
        if self._pool is not None or not self.capacity_blocks:
            return
        shape = (
            self.capacity_blocks,
            runner.num_layers,
            2,
            runner.num_kv_heads,
            self.block_size,
            runner.head_dim,
        )
        self._pool = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
        self._free = list(range(self.capacity_blocks - 1, -1, -1))

    @property
    def pool_bytes(self) -> int:
        return 0 if self._pool is None else self._pool.numel() * self._pool.element_size()

    def _hashes(self, token_ids: Seq[int], num_blocks: int) -> list[int]:
        out, h = [], 0
        bs = self.block_size
        for i in range(num_blocks):
            h = hash((h, tuple(token_ids[i * bs : (i + 1) * bs])))
            out.append(h)
        return out

    def load(self, slot: int, prompt_ids: Seq[int], runner: ModelRunner) -> int:
        """Copy the longest cached prefix of ``prompt_ids`` into ``slot``; return its length in tokens.

        At least one prompt token is always left to compute: its logits give the first output token.
        """
        self.queries += 1
        if self._pool is None:
            return 0
        bs = self.block_size
        max_blocks = (len(prompt_ids) - 1) // bs
        n = 0
        for i, h in enumerate(self._hashes(prompt_ids, max_blocks)):
            entry = self._index.get(h)
            if entry is None or entry[1] != tuple(prompt_ids[i * bs : (i + 1) * bs]):
                break
            self._index.move_to_end(h)
            runner.write_kv(slot, i * bs, self._pool[entry[0]])
            n += 1
        if n:
            self.hits += 1
            self.hit_tokens += n * bs
        return n * bs

    def store(self, slot: int, prompt_ids: Seq[int], runner: ModelRunner) -> None:
        """Save the full blocks of a prefilled prompt that the store does not hold yet."""
        if self._pool is None:
            return
        bs = self.block_size
        hashes = self._hashes(prompt_ids, len(prompt_ids) // bs)
        missing = [i for i, h in enumerate(hashes) if h not in self._index]
        for h in hashes:
            if h in self._index:
                self._index.move_to_end(h)
        if not missing:
            return
        first = missing[0]
        kv = runner.read_kv(slot, first * bs, len(hashes) * bs)  # [layers, 2, kv_heads, n, head_dim]
        for i in missing:
            if not self._free:
                _, (victim, _) = self._index.popitem(last=False)
                self._free.append(victim)
            idx = self._free.pop()
            j = (i - first) * bs
            self._pool[idx].copy_(kv[:, :, :, j : j + bs])
            self._index[hashes[i]] = (idx, tuple(prompt_ids[i * bs : (i + 1) * bs]))
