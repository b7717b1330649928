"""The scheduler and block manager inside an engine whose KV pool is just large enough: prefix
hits revive cached free blocks, eviction and preemption are routine, and greedy answers must still
be, token for token, those of an engine with a pool too large to ever reuse a block. A block
handed to two live sequences, a revived block left on the free list, or a cached block named for
tokens it no longer holds changes some answer here (the engine tests' default pools are large
enough that a revived block is never handed out again)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.fixtures import make_engine
from tests.tiers.engine.test_llm_engine import collect, greedy
from tiers.engine.llm_engine import Engine
from tiers.worker.device import DeviceWorker

SYSTEM = [(7 * i) % 300 + 3 for i in range(24)]  # six 4-token blocks every request starts with


def workload() -> list[list[int]]:
    """Rounds of requests sharing the system prompt, some repeated (whole-prompt hits)."""
    tails = [
        [11, 12, 13],
        [21, 22, 23, 24, 25],
        [11, 12, 13],
        [31],
        [41, 42, 43, 44, 45, 46, 47],
        [21, 22, 23, 24, 25],
    ]
    return [[*SYSTEM, *t] for t in tails]


@pytest.fixture(scope="module")
def roomy(worker: DeviceWorker, tiny_model_dir: Path) -> Engine:
    eng = make_engine(worker, tiny_model_dir, kv_tokens=8192, name="roomy")
    assert isinstance(eng, Engine)
    return eng


@pytest.fixture(scope="module")
def tight(worker: DeviceWorker, tiny_model_dir: Path) -> Engine:
    # 20 blocks of 4: one request needs up to 11; four at once cannot all hold their own.
    eng = make_engine(
        worker,
        tiny_model_dir,
        kv_tokens=80,
        max_model_len=64,
        prefix_caching=True,
        max_num_seqs=4,
        name="tight",
    )
    assert isinstance(eng, Engine)
    return eng


async def test_a_pool_just_large_enough_for_its_prefix_hits_answers_like_a_roomy_one(
    roomy: Engine, tight: Engine
) -> None:
    ps = workload()
    want = [(await collect(roomy, p, greedy(10)))[0] for p in ps]
    blocks = tight.scheduler.blocks
    for _ in range(2):  # the second round starts from a pool full of cached, evictable blocks
        # Bounded: a block handed out twice can also wedge the engine (a planted bug hung here).
        got = await asyncio.wait_for(asyncio.gather(*(collect(tight, p, greedy(10)) for p in ps)), 120)
        assert [g[0] for g in got] == want
    # The mechanisms ran: prefix hits (revived blocks), evictions, and preemption for blocks.
    assert sum(g[3].num_cached_tokens for g in got) >= 4 * len(SYSTEM)
    assert blocks.num_evictions > 0 and tight.scheduler.num_preemptions > 0
    # Idle again: every block free (cached or not), none referenced.
    assert blocks.num_free_blocks == blocks.num_blocks and not any(blocks.ref_counts)
    assert sorted(blocks._free) == list(range(blocks.num_blocks))
