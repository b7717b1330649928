"""The block manager under random operation sequences (Hypothesis), against a model of the pool.

After every operation: free and referenced blocks partition the pool; a block's refcount is the
number of tables holding it; no table holds a block twice; a named block is findable exactly
while it holds the tokens its name was computed from (a name is dropped when, and only when, the
block is handed out fresh); and every live sequence's computed tokens sit, in its own blocks, as
KV of exactly those tokens in exactly that context and partition - the property whose violation
serves one request's KV to another. The model tracks what each block's memory holds (a copy for a
partial hit copies it), independently of the manager's bookkeeping.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from tiers.core.block_manager import BlockManager, BlockTable, chain_hash, root_hash

# Prompts share these starts (one system prompt, many users), so the prefix cache is hit often.
STARTS = ([], [1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [7, 7, 7, 7, 7])


@dataclass
class Content:
    """What one block's memory holds: KV of ``written`` tokens after ``before``, in ``salt``."""

    salt: str
    before: tuple[int, ...]
    written: list[int] = field(default_factory=list)


@dataclass(eq=False)
class Seq:
    salt: str
    tokens: list[int]
    table: BlockTable
    computed: int = 0


def name_of(content: Content, block_size: int) -> bytes:
    """The name a full block holding ``content`` must carry, computed from the model alone."""
    h = root_hash(content.salt)
    for i in range(len(content.before) // block_size):
        h = chain_hash(h, content.before[i * block_size : (i + 1) * block_size])
    return chain_hash(h, content.written)


class PoolMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(1, 1)
        self.live: list[Seq] = []
        self.content: dict[int, Content] = {}
        self.named: dict[int, bytes] = {}
        """Names the model expects: given when the manager names a block, dropped on a fresh take."""
        self._copies: list[tuple[int, Content | None]] = []

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), copies=st.booleans())
    def pool(self, num_blocks: int, block_size: int, copies: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        if copies:
            self.bm.copy_block = self._copy

    def _copy(self, src: int, dst: int) -> None:
        held = self.content.get(src)
        snapshot = None if held is None else Content(held.salt, held.before, list(held.written))
        self._copies.append((dst, snapshot))

    # -- helpers ----------------------------------------------------------------------------------
    def _allocate(self, s: Seq, num_tokens: int, prefix: list[int], partial: tuple[int, int] | None) -> bool:
        before_blocks = len(s.table.blocks)
        free_before, refs_before = list(self.bm._free), list(self.bm.ref_counts)
        self._copies.clear()
        ok = self.bm.allocate(s.table, num_tokens, prefix, partial)
        if not ok:
            assert len(s.table.blocks) == before_blocks, "a failed allocation changed the table"
            assert list(self.bm._free) == free_before and self.bm.ref_counts == refs_before
            return False
        for b in s.table.blocks[before_blocks + len(prefix) :]:  # handed out fresh: its name goes
            self.named.pop(b, None)  # (its memory stays as it was until written)
        for dst, snapshot in self._copies:
            assert dst in s.table.blocks[before_blocks + len(prefix) :], "copied into a block not fresh"
            if snapshot is not None:
                self.content[dst] = snapshot
        return True

    def _write(self, s: Seq, end: int) -> None:
        """The forward: KV for tokens ``computed..end`` lands in the sequence's blocks."""
        bs = self.bm.block_size
        for pos in range(s.computed, end):
            i, off = divmod(pos, bs)
            b = s.table.blocks[i]
            assert self.bm.ref_counts[b] == 1, f"writing into block {b} that another table holds"
            start = i * bs
            held = self.content.get(b)
            if held is None or off == 0:
                held = Content(s.salt, tuple(s.tokens[:start]))
                self.content[b] = held
            # The slots before ``off`` must already hold this context's KV (computed, or copied).
            assert (held.salt, held.before) == (s.salt, tuple(s.tokens[:start]))
            assert held.written[:off] == s.tokens[start:pos]
            del held.written[off:]
            held.written.append(s.tokens[pos])
        s.computed = end
        known = dict(self.bm._name_of)
        self.bm.cache_full_blocks(s.table, s.tokens, s.computed)
        for b, h in self.bm._name_of.items():
            if b not in known:
                self.named[b] = h

    def _admit(self, salt: str, tokens: list[int]) -> Seq | None:
        """The scheduler's admission: the cached prefix, a partial block, then fresh blocks."""
        s = Seq(salt, list(tokens), BlockTable(salt))
        limit = len(tokens) - 1
        prefix = self.bm.match_prefix(tokens, salt, max_tokens=limit)
        self._check_prefix(salt, tokens, prefix)
        partial = self.bm.match_partial(tokens, prefix, salt, max_tokens=limit)
        cached = len(prefix) * self.bm.block_size
        if partial is not None:
            self._check_partial(salt, tokens, cached, partial)
            cached += partial[1]
        if not self._allocate(s, len(tokens), prefix, partial):
            return None
        s.computed = cached
        self.live.append(s)
        return s

    def _check_prefix(self, salt: str, tokens: list[int], prefix: list[int]) -> None:
        bs = self.bm.block_size
        for i, b in enumerate(prefix):
            held = self.content[b]
            assert (held.salt, held.before) == (salt, tuple(tokens[: i * bs])), "prefix hit, wrong context"
            assert held.written == tokens[i * bs : (i + 1) * bs], "prefix hit, wrong tokens"

    def _check_partial(self, salt: str, tokens: list[int], start: int, partial: tuple[int, int]) -> None:
        b, n = partial
        held = self.content[b]
        assert 0 < n < len(tokens) - start + 1
        assert (held.salt, held.before) == (salt, tuple(tokens[:start])), "partial hit, wrong context"
        assert held.written[:n] == tokens[start : start + n], "partial hit, wrong tokens"

    # -- operations -------------------------------------------------------------------------------
    @rule(
        target=seqs,
        salt=st.sampled_from(["", "tenant-b"]),
        start=st.sampled_from(STARTS),
        tail=st.lists(st.integers(1, 9), max_size=7),
    )
    def admit(self, salt: str, start: list[int], tail: list[int]) -> Seq | None:
        tokens = [*start, *tail] or [1]
        return self._admit(salt, tokens)

    @rule(s=seqs, k=st.integers(1, 9))
    def compute(self, s: Seq | None, k: int) -> None:
        assume(s is not None and s in self.live)
        assert s is not None
        end = min(len(s.tokens), s.computed + k)
        if end > s.table.num_blocks * self.bm.block_size and not self._allocate(s, end, [], None):
            return
        self._write(s, end)

    @rule(s=seqs, token=st.integers(1, 9))
    def append(self, s: Seq | None, token: int) -> None:
        """A sampled token (the sequence has computed everything before it)."""
        assume(s is not None and s in self.live and s.computed == len(s.tokens))
        assert s is not None
        s.tokens.append(token)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent: Seq | None) -> Seq | None:
        """An ``n > 1`` branch: shares the parent's full computed blocks, recomputes the rest."""
        assume(parent is not None and parent in self.live and len(parent.tokens) > 1)
        assert parent is not None
        table = self.bm.fork(parent.table, min(parent.computed, len(parent.tokens) - 1))
        child = Seq(parent.salt, list(parent.tokens), table, table.num_blocks * self.bm.block_size)
        if not self._allocate(child, len(child.tokens), [], None):
            self.bm.free(table)  # the shared refs (what the scheduler does)
            return None
        self.live.append(child)
        return child

    @rule(s=consumes(seqs))
    def free(self, s: Seq | None) -> None:
        assume(s is not None and s in self.live)
        assert s is not None
        self.bm.free(s.table, s.tokens, s.computed)
        self.live.remove(s)

    @rule(target=seqs, s=consumes(seqs))
    def preempt(self, s: Seq | None) -> Seq | None:
        """Preemption by recompute: freed, then admitted again with its tokens (mostly cache hits)."""
        assume(s is not None and s in self.live)
        assert s is not None
        self.bm.free(s.table, s.tokens, s.computed)
        self.live.remove(s)
        return self._admit(s.salt, s.tokens)

    @rule(s=seqs, keep=st.integers(0, 12))
    def truncate(self, s: Seq | None, keep: int) -> None:
        """A rollback to a block boundary: the tokens after it are dropped and recomputed later."""
        assume(s is not None and s in self.live)
        assert s is not None
        keep = min(keep * self.bm.block_size, s.computed)
        keep -= keep % self.bm.block_size
        self.bm.truncate(s.table, keep)
        s.computed = keep
        del s.tokens[max(keep, 1) :]
        s.computed = min(s.computed, len(s.tokens))

    @rule(
        salt=st.sampled_from(["", "tenant-b"]),
        start=st.sampled_from(STARTS),
        tail=st.lists(st.integers(1, 9)),
    )
    def lookup(self, salt: str, start: list[int], tail: list[int]) -> None:
        tokens = [*start, *tail]
        prefix = self.bm.match_prefix(tokens, salt)
        self._check_prefix(salt, tokens, prefix)
        if tokens:
            partial = self.bm.match_partial(tokens, prefix, salt)
            if partial is not None:
                self._check_partial(salt, tokens, len(prefix) * self.bm.block_size, partial)

    # -- invariants -------------------------------------------------------------------------------
    @invariant()
    def pool_is_partitioned(self) -> None:
        free = list(self.bm._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        referenced = {b for b in range(self.bm.num_blocks) if self.bm.ref_counts[b] > 0}
        assert not referenced & set(free), "a block is both free and referenced"
        assert referenced | set(free) == set(range(self.bm.num_blocks)), "a block is neither"
        assert self.bm.num_free_blocks + len(referenced) == self.bm.num_blocks

    @invariant()
    def refcounts_count_the_tables(self) -> None:
        held = [0] * self.bm.num_blocks
        for s in self.live:
            assert len(s.table.blocks) == len(set(s.table.blocks)), "a table holds a block twice"
            for b in s.table.blocks:
                held[b] += 1
        assert self.bm.ref_counts == held

    @invariant()
    def names_are_exactly_the_blocks_holding_their_tokens(self) -> None:
        assert {b: h for h, b in self.bm._cached.items()} == self.bm._name_of, "names not a bijection"
        assert self.bm._name_of == self.named, "a name dropped early or kept past a fresh take"
        for b, h in self.bm._name_of.items():
            held = self.content[b]
            assert len(held.written) == self.bm.block_size and name_of(held, self.bm.block_size) == h

    @invariant()
    def every_computed_token_is_in_its_own_context(self) -> None:
        bs = self.bm.block_size
        for s in self.live:
            assert s.table.num_blocks * bs >= s.computed
            for i in range(-(-s.computed // bs)):
                held = self.content[s.table.blocks[i]]
                assert (held.salt, held.before) == (s.salt, tuple(s.tokens[: i * bs]))
                end = min(s.computed, (i + 1) * bs)
                assert held.written[: end - i * bs] == s.tokens[i * bs : end]


PoolMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("TIERED_ROUTER_PROPERTY_EXAMPLES", "150")),
    # Fixed examples where a count is given (make mutation: every mutant meets the same ones).
    derandomize="TIERED_ROUTER_PROPERTY_EXAMPLES" in os.environ,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
    # No shrinking: on these machines it ran five minutes per failure; the failing steps print anyway.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
test_block_manager_under_random_operations = PoolMachine.TestCase
