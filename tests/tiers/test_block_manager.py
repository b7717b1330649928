"""The block manager without a model: allocation, sharing, the prefix cache's naming and eviction."""

from __future__ import annotations

from tiers.block_manager import BlockManager, BlockTable, chain_hash, root_hash


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
