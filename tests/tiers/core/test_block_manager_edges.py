"""Edges of the block manager that the scenario and property tests do not reach.

Each test names the broken code it catches; they were written against the survivors of
``make mutation`` on ``tiers/core/block_manager.py`` (benchmarks/results/mutation.json). Expected
values come from counting blocks and tokens by hand, not from the manager itself.
"""

from __future__ import annotations

import pytest

from tiers.core.block_manager import BlockManager, BlockTable


def _copying(num_blocks: int, block_size: int, *, enable_caching: bool = True) -> BlockManager:
    """A manager that reuses partly filled blocks (the model runner sets ``copy_block``)."""
    bm = BlockManager(num_blocks, block_size, enable_caching=enable_caching)
    bm.copy_block = lambda src, dst: None
    return bm


def _cached_sequence(bm: BlockManager, tokens: list[int], salt: str = "") -> BlockTable:
    table = BlockTable(salt)
    assert bm.allocate(table, len(tokens))
    bm.cache_full_blocks(table, tokens, len(tokens))
    return table


def test_constructor_errors_name_the_argument() -> None:
    """Catches a garbled or missing message on a bad pool size (the policy error names it)."""
    with pytest.raises(ValueError, match=r"^num_blocks must be >= 1$"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match=r"^block_size must be >= 1$"):
        BlockManager(4, 0)


def test_cache_figures_count_from_zero_and_accumulate() -> None:
    """Catches the hit-rate figures (/metrics prefix-cache hit rate) starting at 1, being
    overwritten instead of summed, or counting blocks instead of tokens."""
    bm = _copying(8, 4)
    assert (bm.num_queries, bm.num_hit_tokens, bm.num_evictions, bm.num_partial_hits) == (0, 0, 0, 0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    first = _cached_sequence(bm, prompt)
    assert bm.match_prefix(prompt) == first.blocks[:2]  # two full blocks = 8 tokens
    assert bm.match_prefix(prompt[:5]) == first.blocks[:1]  # one full block = 4 tokens
    assert bm.num_queries == 2
    assert bm.num_hit_tokens == 8 + 4
    bm.free(first, prompt, len(prompt))  # its third block holds 1 token: remembered
    hit = bm.match_partial(prompt, bm.match_prefix(prompt))
    assert hit is not None and hit[1] == 1
    assert bm.num_queries == 3 and bm.num_hit_tokens == 8 + 4 + 8 + 1


def test_evictions_and_partial_hits_are_counted_each_time() -> None:
    """Catches num_evictions / num_partial_hits set to 1 instead of incremented."""
    bm = _copying(2, 2)
    for tokens in ([1, 2], [3, 4]):
        bm.free(_cached_sequence(bm, tokens))
    # Both blocks are cached and free; a new 4-token sequence needs both: two evictions.
    other = BlockTable("")
    assert bm.allocate(other, 4)
    assert bm.num_evictions == 2
    bm.free(other)

    bm = _copying(8, 4)
    for _ in range(2):
        seq = _cached_sequence(bm, [5, 6, 7, 8, 9])
        bm.free(seq, [5, 6, 7, 8, 9], 5)
        prompt = [5, 6, 7, 8, 9, 10]
        prefix = bm.match_prefix(prompt)
        partial = bm.match_partial(prompt, prefix)
        assert partial is not None
        table = BlockTable("")
        assert bm.allocate(table, len(prompt), prefix, partial)
        bm.free(table)
    assert bm.num_partial_hits == 2


def test_can_allocate_counts_the_blocks_a_table_already_has() -> None:
    """Catches ``need = blocks_for(n) + table.num_blocks``: growing a table would ask for its own
    blocks again and refuse a request that fits (a false preemption every decode step)."""
    bm = BlockManager(4, 4)
    table = BlockTable("")
    assert bm.allocate(table, 8)  # 2 blocks taken, 2 free
    assert bm.can_allocate(table, 16)  # 2 more: exactly the free ones
    assert not bm.can_allocate(table, 17)


def test_allocate_counts_a_shared_prefix_as_already_there() -> None:
    """Catches allocate() checking capacity without the prefix: a request whose prefix blocks are
    held by a live sequence needs only its own blocks and must fit."""
    bm = BlockManager(4, 2)
    live = _cached_sequence(bm, [1, 2, 3, 4])  # 2 named blocks, held
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    prefix = bm.match_prefix(prompt)
    assert prefix == live.blocks
    table = BlockTable("")
    assert bm.allocate(table, len(prompt), prefix)  # 2 shared + 2 fresh = the whole pool
    assert table.blocks[:2] == live.blocks and bm.num_free_blocks == 0


def test_attached_prefix_keeps_its_names_so_caching_continues_the_chain() -> None:
    """Catches allocate() recording no name for prefix blocks, and cache_full_blocks restarting
    the chain at the root on a later call: the third block of a shared prompt must be findable."""
    bm = BlockManager(8, 2)
    first = _cached_sequence(bm, [1, 2, 3, 4])
    prompt = [1, 2, 3, 4, 5, 6]
    prefix = bm.match_prefix(prompt)
    table = BlockTable("")
    assert bm.allocate(table, len(prompt), prefix)
    assert table.hashes == first.hashes
    bm.cache_full_blocks(table, prompt, len(prompt))
    assert bm.match_prefix([*prompt, 7]) == table.blocks


def test_incremental_caching_names_each_block_once() -> None:
    """Catches cache_full_blocks re-hashing blocks it named before (``range(full)``), which grows
    ``hashes`` past ``blocks`` and breaks every later index into it."""
    bm = BlockManager(8, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    table = BlockTable("")
    assert bm.allocate(table, 6)
    for computed in (2, 4, 6):
        bm.cache_full_blocks(table, tokens, computed)
        assert len(table.hashes) == computed // 2
    assert bm.match_prefix([*tokens, 0]) == table.blocks


def test_fork_shares_the_names_of_the_shared_blocks() -> None:
    """Catches a forked table without its blocks' names (``hashes[i]`` must name ``blocks[i]``)."""
    bm = BlockManager(8, 2)
    parent = _cached_sequence(bm, [1, 2, 3, 4, 5])
    child = bm.fork(parent, 5)
    assert child.blocks == parent.blocks[:2]
    assert child.hashes == parent.hashes[:2] and len(child.hashes) == 2


def test_free_without_a_count_remembers_no_partial_block() -> None:
    """Catches free()'s num_computed defaulting to 1: a block whose KV was never computed would be
    offered as holding its first token."""
    bm = _copying(4, 4)
    table = BlockTable("")
    assert bm.allocate(table, 3)
    bm.free(table, [1, 2, 3])
    assert bm.match_partial([1, 2, 3, 4], []) is None


def test_partial_lookup_of_a_prompt_that_ends_on_a_block_boundary() -> None:
    """Catches ``limit < start``: a prompt covered by whole cached blocks has no next token to
    look up, and the lookup must say None rather than index past the prompt."""
    bm = _copying(4, 4)
    bm.free(_cached_sequence(bm, [1, 2, 3, 4]))
    prompt = [1, 2, 3, 4]
    prefix = bm.match_prefix(prompt)
    assert len(prefix) == 1
    assert bm.match_partial(prompt, prefix) is None


def test_without_caching_a_freed_partial_block_is_reused_first() -> None:
    """Catches _remember_partial indexing blocks while caching is off: the freed block would be
    kept as if it were worth something and the pool would hand out a colder one."""
    bm = _copying(4, 4, enable_caching=False)
    table = BlockTable("")
    assert bm.allocate(table, 3)
    used = table.blocks[0]
    bm.free(table, [1, 2, 3], 3)
    again = BlockTable("")
    assert bm.allocate(again, 1)
    assert again.blocks == [used]


@pytest.mark.parametrize("computed", [6, 9])
def test_free_of_a_table_without_names_or_slot_for_the_tail(computed: int) -> None:
    """Catches _remember_partial reading a name or a block that is not there: a table never
    cached (no names) or shorter than its tokens (the last token has no slot yet) frees cleanly
    and indexes nothing."""
    bm = _copying(4, 4)
    table = BlockTable("")
    assert bm.allocate(table, 8)
    tokens = list(range(1, 10))
    if computed == 9:
        bm.cache_full_blocks(table, tokens, 8)  # named, but token 9 has no block
    bm.free(table, tokens, computed)
    assert bm.num_free_blocks == 4
    assert bm.match_partial([5, 6, 7, 8, 9, 10], []) is None


def test_partial_index_keeps_the_most_recent_blocks_per_key() -> None:
    """Catches an off-by-one bound on the blocks kept per (parent, first token) and an emptied key
    left behind or a live key dropped on unindexing."""
    bm = _copying(64, 2)
    cap = BlockManager.MAX_PARTIALS_PER_KEY
    blocks = []
    for i in range(cap):
        seq = _cached_sequence(bm, [7, 100 + i])
        blocks.append(seq.blocks[0])
        bm.free(seq)
    # Exactly `cap` blocks under (root, 7): the oldest still serves both of its tokens.
    assert bm.match_partial([7, 100], []) == (blocks[0], 2)
    seq = _cached_sequence(bm, [7, 100 + cap])
    bm.free(seq)
    # One more pushes the oldest out of the partial index (its name still finds it whole).
    hit = bm.match_partial([7, 100], [])
    assert hit is not None and hit[1] == 1
    assert bm.match_partial([7, 101], []) == (blocks[1], 2)
    assert bm.match_prefix([7, 100, 0]) == [blocks[0]]


def test_a_named_block_pushed_out_of_the_partial_index_keeps_its_lru_place() -> None:
    """Catches a named free block being sent to the front of the free queue when it leaves the
    partial index: its name still serves prefix hits, so it must not be the next one reused."""
    bm = _copying(64, 2)
    cap = BlockManager.MAX_PARTIALS_PER_KEY
    first = None
    for i in range(cap + 1):
        seq = _cached_sequence(bm, [7, 100 + i])
        first = seq.blocks[0] if first is None else first
        bm.free(seq)
    fresh = BlockTable("")
    assert bm.allocate(fresh, 1)
    assert fresh.blocks != [first]
    assert bm.match_prefix([7, 100, 0]) == [first]


def test_an_unnamed_partial_block_pushed_out_of_the_index_is_reused_first() -> None:
    """Catches the evicted partial block staying at the back of the free queue (move_to_end
    without ``last=False``): it no longer serves anything and must be the next one reused."""
    bm = _copying(64, 4)
    cap = BlockManager.MAX_PARTIALS_PER_KEY
    first = None
    for i in range(cap + 1):
        table = BlockTable("")
        assert bm.allocate(table, 2)
        first = table.blocks[0] if first is None else first
        bm.free(table, [9, 200 + i], 2)  # half-filled block: remembered, unnamed
    fresh = BlockTable("")
    assert bm.allocate(fresh, 1)
    assert fresh.blocks == [first]


def test_unindexing_one_block_keeps_its_siblings_findable() -> None:
    """Catches _unindex deleting the whole (parent, first token) entry while blocks remain in it."""
    bm = _copying(3, 4)
    remembered = []
    for tail in (201, 202):
        table = BlockTable("")
        assert bm.allocate(table, 2)
        remembered.append(table.blocks[0])
        bm.free(table, [9, tail], 2)
    # The third block is unused; taking two fresh blocks reuses it and the oldest remembered one.
    taker = BlockTable("")
    assert bm.allocate(taker, 8)
    assert remembered[0] in taker.blocks and remembered[1] not in taker.blocks
    assert bm.match_partial([9, 202, 5], []) == (remembered[1], 2)


def test_allocate_refuses_prefix_or_partial_on_a_started_table() -> None:
    """Catches the guards' messages being lost (they name the caller's mistake)."""
    bm = _copying(8, 2)
    cached = _cached_sequence(bm, [1, 2])
    table = BlockTable("")
    assert bm.allocate(table, 2)
    with pytest.raises(AssertionError, match=r"^a prefix is only attached to an empty table$"):
        bm.allocate(table, 4, prefix=cached.blocks)
    with pytest.raises(AssertionError, match=r"^a partial block only follows a fresh prefix$"):
        bm.allocate(table, 4, partial=(cached.blocks[0], 1))
