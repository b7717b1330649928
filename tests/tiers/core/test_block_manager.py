"""The block manager without a model: allocation, sharing, the prefix cache's naming and eviction."""

from __future__ import annotations

from tiers.core.block_manager import BlockManager, BlockTable, chain_hash, root_hash


def filled(bm: BlockManager, tokens: list[int], salt: str = "") -> BlockTable:
    t = BlockTable(salt)
    assert bm.allocate(t, len(tokens))
    bm.cache_full_blocks(t, tokens, len(tokens))
    return t


def test_allocation_is_a_return_value_and_changes_nothing_on_failure() -> None:
    bm = BlockManager(4, 4)
    a = BlockTable()
    assert bm.allocate(a, 12)  # 3 blocks
    b = BlockTable()
    assert not bm.allocate(b, 8)  # needs 2, 1 left
    assert b.blocks == [] and bm.num_free_blocks == 1
    assert bm.allocate(b, 4)


def test_a_freed_prefix_is_found_again_and_shared() -> None:
    bm = BlockManager(16, 4)
    prompt = list(range(10))
    a = filled(bm, prompt)
    blocks = list(a.blocks)
    bm.free(a)
    hit = bm.match_prefix([*prompt[:8], 99, 98], max_tokens=9)
    assert hit == blocks[:2]
    b = BlockTable()
    assert bm.allocate(b, 10, hit)
    assert b.blocks[:2] == hit and [bm.ref_counts[x] for x in hit] == [1, 1]
    c = BlockTable()
    assert bm.allocate(c, 10, bm.match_prefix(prompt, max_tokens=9))
    assert c.blocks[:2] == hit and [bm.ref_counts[x] for x in hit] == [2, 2]


def test_partitions_never_share_blocks() -> None:
    bm = BlockManager(16, 4)
    prompt = list(range(12))
    filled(bm, prompt, salt="tenant-a")
    assert bm.match_prefix(prompt, "tenant-b") == []
    assert len(bm.match_prefix(prompt, "tenant-a")) == 3


def test_eviction_cuts_chains_from_the_tail_so_prefixes_stay_reachable() -> None:
    """Regression: the dense design evicted a chain's first block first, stranding the rest."""
    bm = BlockManager(6, 2)
    chain = list(range(8))  # 4 blocks
    bm.free(filled(bm, chain))
    t = BlockTable()
    assert bm.allocate(t, 6)  # 3 new blocks: 2 unnamed free ones, then 1 eviction
    assert bm.num_evictions == 1
    assert len(bm.match_prefix(chain)) == 3  # blocks 0..2 still reachable, only the tail went


def test_unnamed_free_blocks_are_reused_before_cached_ones() -> None:
    bm = BlockManager(4, 2)
    named = filled(bm, [1, 2, 3, 4])
    scratch = BlockTable()
    assert bm.allocate(scratch, 3)  # 2 blocks; the last is partial, so never named
    bm.free(named)
    bm.free(scratch)
    t = BlockTable()
    assert bm.allocate(t, 4)
    assert bm.num_evictions == 0 and len(bm.match_prefix([1, 2, 3, 4])) == 2


def test_same_prefix_computed_twice_keeps_the_first_copy() -> None:
    bm = BlockManager(8, 2)
    a = filled(bm, [5, 6, 7, 8])
    b = filled(bm, [5, 6, 7, 8])
    assert bm.match_prefix([5, 6, 7, 8]) == a.blocks
    bm.free(b)  # b's duplicates were never named: freeing them drops nothing findable
    assert bm.match_prefix([5, 6, 7, 8]) == a.blocks


def test_fork_shares_full_blocks_only() -> None:
    bm = BlockManager(8, 4)
    parent = BlockTable()
    assert bm.allocate(parent, 10)  # blocks: full, full, partial
    child = bm.fork(parent, 10)
    assert child.blocks == parent.blocks[:2]
    assert [bm.ref_counts[b] for b in parent.blocks] == [2, 2, 1]
    bm.free(parent)
    assert [bm.ref_counts[b] for b in child.blocks] == [1, 1]


def test_truncate_returns_the_tail() -> None:
    bm = BlockManager(8, 4)
    t = BlockTable()
    assert bm.allocate(t, 16)
    bm.truncate(t, 5)
    assert t.num_blocks == 2 and bm.num_free_blocks == 6


def test_block_names_are_a_chain_over_salt_and_tokens() -> None:
    r = root_hash("")
    assert chain_hash(r, [1, 2]) != chain_hash(r, [2, 1])
    assert chain_hash(chain_hash(r, [1, 2]), [3, 4]) != chain_hash(chain_hash(r, [9, 9]), [3, 4])
    assert root_hash("a") != root_hash("b")
    # Token ids of any size are encoded unambiguously (no collisions from concatenated digits).
    assert chain_hash(r, [1, 23]) != chain_hash(r, [12, 3])


def test_first_uses_are_reported_once() -> None:
    bm = BlockManager(4, 2)
    t = BlockTable()
    assert bm.allocate(t, 4)
    assert sorted(bm.take_first_uses()) == sorted(t.blocks) and bm.take_first_uses() == []
    bm.free(t)
    again = BlockTable()
    assert bm.allocate(again, 8)  # two reused blocks, two never used
    assert len(bm.take_first_uses()) == 2


# -- partly filled blocks ---------------------------------------------------------------------------


class CopyLog:
    """Stands in for the pool: records the copies the manager asks for."""

    def __init__(self, bm: BlockManager) -> None:
        self.copies: list[tuple[int, int]] = []
        bm.copy_block = lambda src, dst: self.copies.append((src, dst))


def finished(bm: BlockManager, tokens: list[int], salt: str = "") -> BlockTable:
    """A sequence whose KV holds ``tokens``, freed the way the scheduler frees it."""
    t = filled(bm, tokens, salt)
    blocks = list(t.blocks)
    bm.free(t, tokens, len(tokens))
    t.blocks = blocks  # keep the ids for the test's assertions
    return t


def test_a_partly_filled_block_is_copied_for_a_prompt_that_continues_it() -> None:
    """Catches a partial block shared instead of copied (both sequences would write its free
    slots), a match longer than the tokens really held, and the prompt's last token served from
    the cache (its logits are needed)."""
    bm = BlockManager(16, 4)
    log = CopyLog(bm)
    done = finished(bm, list(range(10)))  # blocks: [0..3] [4..7] [8, 9]
    prompt = [*range(10), 50, 51]
    prefix = bm.match_prefix(prompt, max_tokens=len(prompt) - 1)
    assert prefix == done.blocks[:2]
    partial = bm.match_partial(prompt, prefix, max_tokens=len(prompt) - 1)
    assert partial == (done.blocks[2], 2)
    t = BlockTable()
    assert bm.allocate(t, len(prompt), prefix, partial)
    assert t.blocks[:2] == prefix and t.blocks[2] != done.blocks[2]
    assert log.copies == [(done.blocks[2], t.blocks[2])] and bm.num_partial_hits == 1
    # Diverging inside the block: only the common tokens; the last token is never served.
    assert bm.match_partial([*range(9), 77], prefix) == (done.blocks[2], 1)
    assert bm.match_partial(list(range(10)), prefix, max_tokens=9) == (done.blocks[2], 1)
    assert bm.match_partial([*range(8), 70, 71], prefix) is None


def test_partial_blocks_stay_in_their_partition_and_prefix() -> None:
    bm = BlockManager(16, 4)
    CopyLog(bm)
    finished(bm, [1, 2, 3], salt="a")  # no full block: the parent is the partition's root
    assert bm.match_partial([1, 2, 3, 4], [], "a") is not None
    assert bm.match_partial([1, 2, 3, 4], [], "b") is None
    finished(bm, [9, 9, 9, 9, 1, 2])
    other = filled(bm, [8, 8, 8, 8])  # same tokens after a different first block
    assert bm.match_partial([8, 8, 8, 8, 1, 2, 5], other.blocks[:1]) is None


def test_a_shared_or_unknown_tail_is_not_remembered() -> None:
    """A fork's partly filled block is written by both branches; without the tokens (draft
    pools, rollbacks) nothing is known about its content."""
    bm = BlockManager(16, 4)
    CopyLog(bm)
    parent = filled(bm, list(range(6)))
    child = BlockTable()
    child.blocks, child.hashes = list(parent.blocks), list(parent.hashes)
    for b in child.blocks:
        bm.ref_counts[b] += 1
    first = parent.blocks[:1]
    bm.free(parent, list(range(6)), 6)  # the tail is still the child's
    assert bm.match_partial([*range(6), 1], first) is None
    bm.free(child)  # no tokens given
    assert bm.match_partial([*range(6), 1], first) is None


def test_a_reused_partial_block_is_forgotten_and_the_source_can_be_the_copy() -> None:
    """Catches a stale entry pointing at a block now holding other KV."""
    bm = BlockManager(1, 4)
    log = CopyLog(bm)
    done = finished(bm, [1, 2, 3])
    prompt = [1, 2, 3, 9]
    partial = bm.match_partial(prompt, [], max_tokens=3)
    assert partial == (done.blocks[0], 3)
    t = BlockTable()
    # A one-block pool: the source itself is taken back, its KV already in place (no copy).
    assert bm.allocate(t, 4, (), partial)
    assert t.blocks == done.blocks and log.copies == [] and bm.num_partial_hits == 1
    bm.free(t)  # now holding other KV, unknown: nothing to find
    assert bm.match_partial(prompt, [], max_tokens=3) is None


def test_partials_per_prefix_are_bounded_oldest_first() -> None:
    bm = BlockManager(64, 4)
    CopyLog(bm)
    for i in range(BlockManager.MAX_PARTIALS_PER_KEY + 3):
        finished(bm, [7, 100 + i])
    hit = bm.match_partial([7, 100, 0], [])
    assert hit is not None and hit[1] == 1  # only the shared first token: the oldest was forgotten
    last = 100 + BlockManager.MAX_PARTIALS_PER_KEY + 2
    hit = bm.match_partial([7, last, 0], [])
    assert hit is not None and hit[1] == 2


def test_a_named_block_serves_the_start_of_a_repeated_prompt() -> None:
    """The same prompt again: its last token must be computed, so whole-block matching stops a
    block short (16 tokens recomputed when the prompt ends on a block boundary); the named block
    that holds those tokens serves all but the last, by copy. Catches the last token served."""
    bm = BlockManager(16, 4)
    log = CopyLog(bm)
    prompt = list(range(8))
    done = filled(bm, [*prompt, 40, 41])  # the prompt and two answer tokens: blocks 0, 1 named
    prefix = bm.match_prefix(prompt, max_tokens=7)
    assert prefix == done.blocks[:1]
    assert bm.match_partial(prompt, prefix, max_tokens=7) == (done.blocks[1], 3)
    t = BlockTable()
    assert bm.allocate(t, 8, prefix, (done.blocks[1], 3))
    assert log.copies == [(done.blocks[1], t.blocks[1])]  # in use by `done`: copied, not shared
    assert bm.ref_counts[done.blocks[1]] == 1


def test_without_a_copy_function_nothing_is_remembered() -> None:
    bm = BlockManager(8, 4)
    finished(bm, [1, 2, 3])
    assert bm.match_partial([1, 2, 3, 4], []) is None


# -- the pool's accounting under pressure ----------------------------------------------------------


def assert_pool_partitioned(bm: BlockManager, *tables: BlockTable) -> None:
    """Free and referenced blocks partition the pool, and refcounts are the tables holding a block."""
    free = list(bm._free)
    held = [0] * bm.num_blocks
    for t in tables:
        assert len(set(t.blocks)) == len(t.blocks), "a table holds a block twice"
        for b in t.blocks:
            held[b] += 1
    assert bm.ref_counts == held
    assert sorted(free) == [b for b in range(bm.num_blocks) if held[b] == 0], "free and referenced overlap"


def test_reviving_cached_blocks_counts_against_the_free_list() -> None:
    """Catches ``can_allocate`` forgetting the cached free blocks a prefix hit revives: the pool
    said yes, and ``allocate`` then popped from an empty free list (a crash under memory pressure)."""
    bm = BlockManager(3, 2)
    bm.free(filled(bm, [1, 2, 3, 4]))  # two named blocks, now free (cached)
    other = BlockTable()
    assert bm.allocate(other, 2)  # takes the unnamed free block: two cached ones left
    prefix = bm.match_prefix([1, 2, 3, 4, 5, 6], max_tokens=5)
    assert len(prefix) == 2
    t = BlockTable()
    # The prefix revives both free blocks and one more is needed for token 5: none is left.
    assert not bm.can_allocate(t, 6, prefix)
    assert not bm.allocate(t, 6, prefix)
    assert t.blocks == [] and bm.num_free_blocks == 2
    assert_pool_partitioned(bm, other)
    assert bm.allocate(t, 4, prefix)  # the two revived blocks alone fit
    assert t.blocks == prefix and bm.num_free_blocks == 0
    assert_pool_partitioned(bm, other, t)


def test_a_revived_block_leaves_the_free_list_and_is_never_handed_out_twice() -> None:
    """Catches ``_take`` leaving a revived cached block on the free list: the next fresh allocation
    handed the same block to a second sequence, and two live requests wrote one KV block (one
    tenant's KV served to another)."""
    bm = BlockManager(2, 2)
    bm.free(filled(bm, [1, 2]))  # block named [1, 2], free
    prefix = bm.match_prefix([1, 2, 3], max_tokens=2)
    assert len(prefix) == 1
    a = BlockTable()
    assert bm.allocate(a, 3, prefix)  # revives the named block and takes the last free one
    assert bm.num_free_blocks == 0
    assert_pool_partitioned(bm, a)
    b = BlockTable("tenant-b")
    assert not bm.allocate(b, 2)  # the pool is full: nothing may be handed out again
    assert set(a.blocks).isdisjoint(b.blocks)
    assert_pool_partitioned(bm, a, b)
