"""The paged FlexAttention compiled through inductor (its C++ template on the CPU, the same graph
Triton builds on CUDA): equal to gather + SDPA on the runner's block-table layout, with a bounded
count of compiled graphs over a workload of mixed row counts and query lengths; and the Triton
tile rule (``flex_kernel_options``) against inductor's own default tiles and divisibility check."""

from __future__ import annotations

import inspect
import random
from typing import Any

import pytest
import torch

from tiers.attention.flex import (
    AttnGroup,
    PagedBlockMask,
    bucket_q_len,
    bucket_rows,
    flex_kernel_options,
    flex_paged_attention,
)
from tiers.attention.selector import AttentionBackend, flex_attention_fn, gather_sdpa_attention
from tiers.core.block_manager import BlockManager, BlockTable

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")

BLOCKS, BS, KV_HEADS, HEADS, DIM = 512, 16, 2, 8, 64


def gather_reference(
    q: torch.Tensor, pool: torch.Tensor, tables: list[list[int]], starts: list[int], q_len: int, scratch: int
) -> torch.Tensor:
    """Gather + SDPA as the runner lays it out: each row's blocks padded with the scratch block to
    the group's widest row, an additive causal mask in GQA-folded query order."""
    rows = len(tables)
    width = max(-(-(s + q_len) // BS) for s in starts)
    flat: list[int] = []
    for t, s in zip(tables, starts, strict=True):
        used = -(-(s + q_len) // BS)
        flat += t[:used] + [scratch] * (width - used)
    block_idx = torch.tensor(flat)
    kv_len, group = width * BS, HEADS // KV_HEADS
    q_pos = torch.tensor(starts)[:, None] + torch.arange(q_len)[None, :]
    allowed = torch.arange(kv_len)[None, None, :] <= q_pos[:, :, None]
    allowed = allowed[:, None].expand(rows, group, q_len, kv_len).reshape(rows, 1, group * q_len, kv_len)
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    g = AttnGroup(0, rows, q_len, block_idx, kv_len, torch.tensor(starts), mask)
    be = AttentionBackend(None, None, DIM**-0.5, HEADS, KV_HEADS, DIM)
    return gather_sdpa_attention(q, pool, g, be)


def workload_case(
    manager: BlockManager, rng: random.Random, rows: int, q_len: int
) -> tuple[list[list[int]], list[int], list[BlockTable]]:
    """``rows`` sequences of random lengths allocated by the block manager (its free-list order:
    block ids scattered over the pool), each about to feed ``q_len`` tokens."""
    tables, starts, owned = [], [], []
    for _ in range(rows):
        start = rng.randrange(0, 100)
        t = BlockTable()
        assert manager.allocate(t, start + q_len)
        tables.append(list(t.blocks))
        starts.append(start)
        owned.append(t)
    return tables, starts, owned


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setenv("TIERED_ROUTER_ATTENTION", "flex-compile")
    torch._dynamo.reset()
    return flex_attention_fn(torch.device("cpu"))


def test_compiled_flex_equals_gather_with_bounded_graphs(compiled: object) -> None:
    # Catches: the compiled kernel reading the wrong slots of a padded bucket (padded rows or
    # queries leaking into real ones), a causally trimmed tile dropping a visible block, block ids
    # past the first row's mapped wrongly, and a shape that is not bucketed (one graph per batch
    # or chunk length: past Dynamo's recompile limit the CUDA path would run eager flex, which
    # materialises the score matrix).
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    manager = BlockManager(BLOCKS, BS, enable_caching=False)
    pool = torch.randn(BLOCKS + 1, BS, 2, KV_HEADS, DIM, generator=gen)  # + the scratch block
    # (rows, queries per row): decode at batch 1-64, verification of 4 drafts, prefill chunks.
    workload = [(1, 1), (3, 1), (4, 5), (13, 1), (16, 1), (64, 1), (1, 37), (2, 200)]
    buckets = {(bucket_rows(r), bucket_q_len(t)) for r, t in workload}
    counters.clear()
    worst = 0.0
    for rows, q_len in [*workload, (2, 1), (11, 3), (40, 1), (1, 50)]:  # the second part: no new bucket
        tables, starts, owned = workload_case(manager, rng, rows, q_len)
        width = max(len(t) for t in tables) + 1
        padded = [t + [t[0]] * (width - len(t)) for t in tables]  # the group's width, any block
        mask = PagedBlockMask(torch.tensor(padded), torch.tensor(starts), q_len, BLOCKS + 1, BS)
        q = torch.randn(rows * q_len, HEADS, DIM, generator=gen)
        got = flex_paged_attention(q, pool, mask, q_len, DIM**-0.5, compiled=compiled)
        want = gather_reference(q, pool, tables, starts, q_len, BLOCKS)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        worst = max(worst, float((got - want).abs().max()))
        for t in owned:
            manager.free(t)
    graphs = counters["stats"]["unique_graphs"]
    print(f"compiled flex: {graphs} graphs for {len(buckets)} buckets, max |diff| {worst:.2e}")
    assert graphs <= len(buckets) + 1, f"{graphs} graphs for {len(buckets)} shape buckets: a shape recompiles"


def test_block_mask_is_built_without_host_syncs() -> None:
    # Catches a boolean-mask index, nonzero or a scalar read in the mask's construction: each
    # blocks the host on CUDA (the step's one sync is the sampled tokens' copy).
    from torch.utils._python_dispatch import TorchDispatchMode

    blocking = {"nonzero", "_local_scalar_dense", "item", "masked_select", "index.Tensor"}
    seen: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = func.overloadpacket.__name__
            if name in blocking or (
                name == "index" and any(a is not None and a.dtype == torch.bool for a in args[1])
            ):
                seen.append(name)
            return func(*args, **(kwargs or {}))

    tables = torch.tensor([[5, 9, 2, 2], [7, 1, 3, 4], [8, 8, 8, 8]])
    with Count():
        PagedBlockMask(tables, torch.tensor([20, 50, 3]), 5, BLOCKS + 1, BS)
    assert seen == []


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0)])
def test_tiles_divide_the_block_mask_where_inductors_defaults_do_not(
    head_dim: int, capability: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches tiles that inductor refuses ("Q and KV block size must be divisible by BLOCK_M and
    # BLOCK_N") at the first CUDA forward, and tiles larger than inductor's tuned defaults.
    from torch._inductor.kernel.flex import flex_attention as lowering
    from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic

    src = inspect.getsource(lowering)
    assert '["SPARSE_KV_BLOCK_SIZE"] % cur_kernel_options["BLOCK_N"]' in src  # the check we follow
    assert '["SPARSE_Q_BLOCK_SIZE"] % cur_kernel_options["BLOCK_M"]' in src
    assert 'cur_kernel_options.setdefault("BLOCK_M", conf.block_m)' in src  # ours take precedence
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    default = CUDAConfigHeuristic().get_flex_attn_fwd_configs(head_dim, torch.bfloat16)[-1]
    refused = 0
    for block_size in (16, 32, 64, 128):
        for q_len in (1, 5, 16, 37, 128, 200, 8192):
            mask = PagedBlockMask(torch.zeros((1, 1), dtype=torch.long), torch.zeros(1), q_len, 8, block_size)
            q_block, kv_block = mask.block_mask.BLOCK_SIZE
            opts = flex_kernel_options(q_block, kv_block, head_dim)
            assert q_block % opts["BLOCK_M"] == 0 and kv_block % opts["BLOCK_N"] == 0
            assert 16 <= opts["BLOCK_M"] <= default.block_m and 16 <= opts["BLOCK_N"] <= default.block_n
            refused += q_block % default.block_m != 0 or kv_block % default.block_n != 0
    assert refused > 0  # without kernel_options the defaults are refused (the bug this fixes)
    with pytest.raises(ValueError, match="multiples of 16"):
        flex_kernel_options(16, 4, head_dim)  # a CPU test's block size cannot run on Triton
