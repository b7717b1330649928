"""Prefix KV cache: reuse the KV of shared prompt prefixes (system prompts, few-shot examples,
earlier turns) across requests on the same tier.

Prompts are cut into blocks of ``block_size`` tokens; block i is named by a hash chained over
blocks 0..i (vLLM's scheme), so equal names mean equal prefixes. After a prompt's prefill the KV of
its full blocks is copied out of the sequence's slot into this store; a new request copies the
longest run of known blocks into its slot and starts computing after them. Copies are cheap next to
recomputing: a block's KV is read once, while a forward reads every weight of the model. Only the
tier's own KV is kept; a speculative draft catches up on the prompt lazily, when it first drafts.

Eviction is LRU under ``capacity_tokens``. The store lives on the engine thread; no locking.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tiers.model_runner import ModelRunner

__all__ = ["PrefixCache"]


@dataclass(slots=True)
class _Block:
    tokens: tuple[int, ...]  # checked on lookup, so a hash collision can never serve wrong KV
    kv: torch.Tensor  # [layers, 2, kv_heads, block_size, head_dim]


class PrefixCache:
    def __init__(self, capacity_tokens: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.capacity_blocks = max(0, capacity_tokens // block_size)
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self.hits = 0
        self.queries = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

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
        if not self.capacity_blocks:
            return 0
        max_blocks = (len(prompt_ids) - 1) // self.block_size
        n = 0
        for i, h in enumerate(self._hashes(prompt_ids, max_blocks)):
            block = self._blocks.get(h)
            start = i * self.block_size
            if block is None or block.tokens != tuple(prompt_ids[start : start + self.block_size]):
                break
            self._blocks.move_to_end(h)
            runner.write_kv(slot, start, block.kv)
            n += 1
        if n:
            self.hits += 1
            self.hit_tokens += n * self.block_size
        return n * self.block_size

    def store(self, slot: int, prompt_ids: Seq[int], runner: ModelRunner) -> None:
        """Save the full blocks of a prefilled prompt that the store does not hold yet."""
        if not self.capacity_blocks:
            return
        bs = self.block_size
        hashes = self._hashes(prompt_ids, len(prompt_ids) // bs)
        missing = [i for i, h in enumerate(hashes) if h not in self._blocks]
        if not missing:
            for h in hashes:
                self._blocks.move_to_end(h)
            return
        first = missing[0]
        kv = runner.read_kv(slot, first * bs, len(hashes) * bs)
        for i, h in enumerate(hashes):
            if i < first or h in self._blocks:
                if h in self._blocks:
                    self._blocks.move_to_end(h)
                continue
            j = (i - first) * bs
            self._blocks[h] = _Block(
                tuple(prompt_ids[i * bs : (i + 1) * bs]), kv[:, :, :, j : j + bs].clone()
            )
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
