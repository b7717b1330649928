"""KV block bookkeeping, torch-free: which pool blocks hold which sequence's tokens.

A tier's KV pool (``model_runner.py``) is ``num_blocks`` fixed-size blocks of ``block_size``
tokens. A sequence owns a *block table*: the pool blocks holding its tokens in order. Blocks are
reference-counted, so sequences with the same prompt prefix (and the ``n > 1`` branches of one
request) share them.

The prefix cache is the pool itself (vLLM's design): a block that fills up is named by a hash
chained over its parent's name, the cache partition's salt and its tokens, and stays findable by
that name after its last owner frees it. Free blocks wait in one LRU queue; a cached free block is
revived by a later request with the same prefix, or evicted (its name dropped) when the queue's
head is needed for new tokens. A sequence frees its blocks tail first, so eviction cuts chains from
the end and a cached prefix stays reachable from its first block for as long as any of it lives.

Past the last whole block a prompt shares with the cache, a block can still serve part of it: a
named block whose first tokens are the prompt's next ones (the same prompt again: the block also
holds the previous answer's first tokens, or the prompt's own last token that must be computed),
or a block that was only partly filled when its last owner freed it (a finished answer's tail,
remembered under its parent's name and its tokens). The new sequence gets a *copy* of it - it will
write the block's remaining slots, so it cannot share it - and skips recomputing up to
``block_size - 1`` tokens (llama.cpp's slots and SGLang's radix cache reuse a prefix to the token;
whole-block matching alone recomputes up to 15 of them on every hit, 16 when a prompt ends on a
block boundary). The copy itself is the pool's business: ``copy_block`` is set by the model
runner, so this module stays torch-free.

"Can't allocate" is a ``False`` return value: the scheduler decides whom to preempt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

__all__ = ["BlockManager", "BlockTable", "chain_hash", "root_hash"]


def chain_hash(parent: bytes, tokens: Seq[int]) -> bytes:
    """Name of a full block: a keyed-free, collision-resistant hash (blake2b-128) of the parent's
    name and the block's token ids. Python's ``hash`` is neither (it is seeded per process and
    collides by construction on crafted inputs), and a collision would serve one prompt's KV to
    another."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def root_hash(salt: str) -> bytes:
    """The parent of a chain's first block: separates cache partitions (tenants) completely."""
    return hashlib.blake2b(b"tiered-router/kv/" + salt.encode(), digest_size=16).digest()


@dataclass(slots=True)
class BlockTable:
    """One sequence's blocks in one pool."""

    salt: str = ""
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    """Names of the first ``len(hashes)`` blocks (the full, cached ones)."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        """Blocks with no owner, least recently used first; cached ones keep their name until evicted."""
        self._cached: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self.num_queries = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0
        self._ever_used = bytearray(num_blocks)
        self._first_uses: list[int] = []
        self._by_first: dict[tuple[bytes, int], OrderedDict[int, tuple[int, ...]]] = {}
        """Named blocks and free partly filled ones by (parent's name, first token): block -> the
        tokens whose KV it holds (``match_partial``)."""
        self._indexed: dict[int, tuple[bytes, int]] = {}
        self.copy_block: Callable[[int, int], None] | None = None
        """Copies one block's KV to another in the pool (set by the model runner); partly filled
        blocks are reused only where it is set."""
        self.num_partial_hits = 0

    # -- figures ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------
    def match_prefix(
        self, token_ids: Seq[int], salt: str = "", *, max_tokens: int | None = None
    ) -> list[int]:
        """The longest run of cached full blocks that ``token_ids`` starts with (block ids, no refs
        taken). ``max_tokens`` caps the match (a prompt's last token must still be computed: its
        logits give the first output token)."""
        self.num_queries += 1
        if not self.enable_caching:
            return []
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        bs = self.block_size
        found: list[int] = []
        h = root_hash(salt)
        for i in range(limit // bs):
            h = chain_hash(h, token_ids[i * bs : (i + 1) * bs])
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        self.num_hit_tokens += len(found) * bs
        return found

    def match_partial(
        self, token_ids: Seq[int], prefix: Seq[int], salt: str = "", *, max_tokens: int | None = None
    ) -> tuple[int, int] | None:
        """After the full ``prefix`` blocks (from ``match_prefix``): a block whose first tokens
        continue that prefix as ``token_ids`` does (see the module docstring), as ``(block, tokens
        it serves)`` - the longest such run, capped by ``max_tokens`` like the prefix - or None.
        Nothing is taken; ``allocate(..., partial=...)`` copies it."""
        if not self.enable_caching or self.copy_block is None:
            return None
        start = len(prefix) * self.block_size
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        if limit <= start:
            return None
        parent = self._name_of[prefix[-1]] if prefix else root_hash(salt)
        entries = self._by_first.get((parent, token_ids[start]))
        if not entries:
            return None
        want = token_ids[start:limit]
        best: tuple[int, int] | None = None
        for block, tokens in entries.items():
            n = 0
            for a, b in zip(tokens, want, strict=False):
                if a != b:
                    break
                n += 1
            if best is None or n > best[1]:
                best = (block, n)
        if best is None or best[1] == 0:
            return None
        self.num_hit_tokens += best[1]
        return best

    # -- allocation ---------------------------------------------------------------------------
    def can_allocate(self, table: BlockTable, num_tokens: int, prefix: Seq[int] = ()) -> bool:
        need = self.blocks_for(num_tokens) - table.num_blocks - len(prefix)
        revived = sum(1 for b in prefix if self.ref_counts[b] == 0)
        return need + revived <= len(self._free)

    def allocate(
        self,
        table: BlockTable,
        num_tokens: int,
        prefix: Seq[int] = (),
        partial: tuple[int, int] | None = None,
    ) -> bool:
        """Grow ``table`` to hold ``num_tokens`` tokens, starting with the cached ``prefix`` blocks
        (from ``match_prefix``, only on an empty table) and, with ``partial`` (from
        ``match_partial``), a fresh block holding a copy of that partly filled one. False, with
        nothing changed, when the pool cannot supply the blocks."""
        assert not prefix or not table.blocks, "a prefix is only attached to an empty table"
        assert partial is None or not table.blocks, "a partial block only follows a fresh prefix"
        if not self.can_allocate(table, num_tokens, prefix):
            return False
        for b in prefix:
            self._take(b)
            table.blocks.append(b)
            table.hashes.append(self._name_of[b])
        for i in range(self.blocks_for(num_tokens) - table.num_blocks):
            b = self._take_fresh()
            table.blocks.append(b)
            if i == 0 and partial is not None and self.copy_block is not None:
                # Before any other block is taken: until now the source is free but intact (or it
                # is this very block, taken back with its contents, and the copy is a no-op).
                if partial[0] != b:
                    self.copy_block(partial[0], b)
                self.num_partial_hits += 1
        return True

    def fork(self, parent: BlockTable, num_tokens: int) -> BlockTable:
        """A table sharing ``parent``'s blocks that hold its first ``num_tokens`` tokens (``n > 1``).

        Only *full* blocks may be shared: a partial block will be written by both branches. The
        caller allocates the rest (the parent's partial last block is recomputed by the child)."""
        shared = num_tokens // self.block_size
        child = BlockTable(parent.salt, list(parent.blocks[:shared]), list(parent.hashes[:shared]))
        for b in child.blocks:
            self.ref_counts[b] += 1
        return child

    def free(self, table: BlockTable, token_ids: Seq[int] = (), num_computed: int = 0) -> None:
        """Release every block of ``table``, tail first (see the module docstring). With the
        sequence's ``token_ids`` and how many of them have KV (``num_computed``), a partly filled
        last block that nobody else holds is remembered for ``match_partial``."""
        self._remember_partial(table, token_ids, num_computed)
        for b in reversed(table.blocks):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0
            if self.ref_counts[b] == 0:
                if b not in self._name_of and b not in self._indexed:
                    # An unnamed block is worthless once free: reuse it before any cached one.
                    self._free[b] = None
                    self._free.move_to_end(b, last=False)
                else:
                    self._free[b] = None
        table.blocks.clear()
        table.hashes.clear()

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Drop blocks past ``num_tokens`` tokens (preemption keeps none; rollback keeps the rest)."""
        keep = self.blocks_for(num_tokens)
        tail = BlockTable(table.salt, table.blocks[keep:], [])
        del table.blocks[keep:]
        del table.hashes[min(keep, len(table.hashes)) :]
        self.free(tail)

    def cache_full_blocks(self, table: BlockTable, token_ids: Seq[int], num_computed: int) -> None:
        """Name the blocks that ``num_computed`` tokens have filled since the last call, so later
        requests find them. A block whose name already points at another block (two sequences
        computed the same prefix at once) stays unnamed; the first copy serves future hits."""
        if not self.enable_caching:
            return
        bs = self.block_size
        full = min(num_computed // bs, table.num_blocks)
        h = table.hashes[-1] if table.hashes else root_hash(table.salt)
        for i in range(len(table.hashes), full):
            parent, tokens = h, token_ids[i * bs : (i + 1) * bs]
            h = chain_hash(parent, tokens)
            table.hashes.append(h)
            b = table.blocks[i]
            if h not in self._cached and b not in self._name_of:
                self._cached[h] = b
                self._name_of[b] = h
                self._index(b, parent, tokens)

    # -- internals ----------------------------------------------------------------------------
    MAX_PARTIALS_PER_KEY = 16
    """Blocks indexed per (parent, first token), most recent kept: bounds the scan in
    ``match_partial`` when many prompts share a prefix (one system prompt, many users)."""

    def _remember_partial(self, table: BlockTable, token_ids: Seq[int], num_computed: int) -> None:
        bs = self.block_size
        full, used = divmod(min(num_computed, len(token_ids)), bs)
        if not self.enable_caching or self.copy_block is None or used == 0:
            return
        if full >= table.num_blocks or len(table.hashes) < full:
            return
        b = table.blocks[full]
        if self.ref_counts[b] != 1 or b in self._name_of or b in self._indexed:
            return  # shared (a fork writes it too) or already known
        parent = table.hashes[full - 1] if full else root_hash(table.salt)
        self._index(b, parent, token_ids[full * bs : full * bs + used])

    def _index(self, b: int, parent: bytes, tokens: Seq[int]) -> None:
        if self.copy_block is None:
            return
        key = (parent, tokens[0])
        entries = self._by_first.setdefault(key, OrderedDict())
        entries[b] = tuple(tokens)
        self._indexed[b] = key
        while len(entries) > self.MAX_PARTIALS_PER_KEY:
            old, _ = entries.popitem(last=False)
            del self._indexed[old]
            if self.ref_counts[old] == 0 and old not in self._name_of:
                self._free.move_to_end(old, last=False)  # now as worthless as any unnamed block

    def _unindex(self, b: int) -> None:
        key = self._indexed.pop(b, None)
        if key is not None:
            entries = self._by_first[key]
            del entries[b]
            if not entries:
                del self._by_first[key]

    def _take(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            del self._free[b]
        self.ref_counts[b] += 1

    def take_first_uses(self) -> list[int]:
        """Blocks handed out for the first time since the last call: the pool must initialise
        their memory (it was never written) before a forward reads them."""
        out, self._first_uses = self._first_uses, []
        return out

    def _take_fresh(self) -> int:
        b, _ = self._free.popitem(last=False)
        if not self._ever_used[b]:
            self._ever_used[b] = 1
            self._first_uses.append(b)
        name = self._name_of.pop(b, None)
        if name is not None:
            del self._cached[name]
            self.num_evictions += 1
        self._unindex(b)
        self.ref_counts[b] = 1
        return b
