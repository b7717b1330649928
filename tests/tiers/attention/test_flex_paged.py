"""FlexAttention over the paged pool (tiers/attention/flex.py), the GPU tiers' attention, run on the
CPU through the same Python: against an independent fp64 reference on random block tables (GQA,
shared prefix blocks, forks, ragged starts), and through the runner against the gather + SDPA
path on a tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tiers.attention.flex import PagedBlockMask, flex_paged_attention
from tiers.core.block_manager import BlockTable
from tiers.models.loading import load_model
from tiers.worker.model_runner import ModelRunner, RowInput

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")


def reference(
    q: torch.Tensor, pool: torch.Tensor, tables: list[list[int]], starts: list[int], q_len: int
) -> torch.Tensor:
    """Causal attention in fp64, one query at a time, keys read block by block from the table."""
    _, bs, _, kv_heads, dim = pool.shape
    heads = q.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, (table, start) in enumerate(zip(tables, starts, strict=True)):
        kv = pool[table].reshape(len(table) * bs, 2, kv_heads, dim).double()
        for i in range(q_len):
            seen = kv[: start + i + 1]
            for h in range(heads):
                g = h // (heads // kv_heads)
                scores = seen[:, 0, g] @ q[r * q_len + i, h].double() / math.sqrt(dim)
                out[r * q_len + i, h] = torch.softmax(scores, 0) @ seen[:, 1, g]
    return out


@pytest.mark.parametrize(("q_len", "heads", "kv_heads"), [(1, 4, 4), (5, 6, 2), (17, 8, 1)])
def test_equals_an_fp64_reference_on_random_tables(q_len: int, heads: int, kv_heads: int) -> None:
    # Catches: a row reading another row's blocks, a physical slot mapped to the wrong logical
    # position (prefix blocks shared between rows, a fork's copied tail), causality off by one,
    # GQA heads paired with the wrong KV head, padding blocks attended to.
    gen = torch.Generator().manual_seed(q_len)
    blocks, bs, dim = 48, 4, 16
    pool = torch.randn(blocks, bs, 2, kv_heads, dim, generator=gen)
    perm = torch.randperm(blocks, generator=gen).tolist()
    shared = perm[:3]  # a prefix-cache hit: three blocks in two rows' tables
    starts = [0, 12, 13, 7]
    tables: list[list[int]] = []
    free = iter(perm[3:])
    for r, start in enumerate(starts):
        need = -(-(start + q_len) // bs)
        prefix = shared[: min(need, 3)] if r in (1, 2) else []  # rows 1 and 2: a fork of one prompt
        tables.append(prefix + [next(free) for _ in range(need - len(prefix))])
    width = max(len(t) for t in tables) + 1
    padded = torch.tensor([t + [perm[3]] * (width - len(t)) for t in tables])  # padding: any block
    q = torch.randn(len(starts) * q_len, heads, dim, generator=gen)
    mask = PagedBlockMask(padded, torch.tensor(starts), q_len, blocks, bs)
    got = flex_paged_attention(q, pool, mask, q_len, 1 / math.sqrt(dim))
    torch.testing.assert_close(got.double(), reference(q, pool, tables, starts, q_len), atol=1e-5, rtol=1e-5)


def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(
        load_model(str(model_dir), device="cpu"),  # type: ignore[arg-type]
        num_blocks=64,
        block_size=4,
        max_model_len=256,
    )


def test_the_runner_on_flex_gives_the_gather_paths_logits(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GPU path's Python on the CPU: prefill of two rows of different lengths, a prefix hit
    # (a row starting past blocks another row wrote), then decode, every layer through
    # FlexAttention (counted), against gather + SDPA.
    monkeypatch.setenv("TIERED_ROUTER_ATTENTION", "flex")
    flex = runner(tiny_model_dir)
    monkeypatch.setenv("TIERED_ROUTER_ATTENTION", "sdpa")
    sdpa = runner(tiny_model_dir)
    assert flex.fast is not None and flex.fast.uses_flex
    assert sdpa.fast is not None and not sdpa.fast.uses_flex
    sdpa.fast._paged_attention = None  # the gather path, not the CPU kernel
    calls = 0
    inner = flex.fast.flex_attention

    def counting(*args: object, **kw: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return inner(*args, **kw)  # type: ignore[misc]

    flex.fast.flex_attention = counting
    layers = len(flex.fast.layers)

    def run(r: ModelRunner) -> list[torch.Tensor | None]:
        a, b = BlockTable(), BlockTable()
        assert r.blocks.allocate(a, 40) and r.blocks.allocate(b, 12)
        prompt = list(range(3, 39))
        out = r.forward([RowInput(a.blocks, 0, prompt, "all"), RowInput(b.blocks, 0, [9] * 11, "all")])
        # A second sequence sharing a's first 8 tokens' blocks, starting after them.
        c = r.blocks.fork(a, 8)
        assert c.blocks == a.blocks[:2] and r.blocks.allocate(c, 20)
        out += r.forward([RowInput(c.blocks, 8, prompt[8:16], "all")])
        out += r.forward([RowInput(a.blocks, 36, [5], "last"), RowInput(b.blocks, 11, [7], "last")])
        return out

    got, want = run(flex), run(sdpa)
    assert calls == 4 * layers  # two prefill groups, the prefix-hit row, one decode group
    for x, y in zip(got, want, strict=True):
        assert x is not None and y is not None
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        assert torch.equal(x.argmax(-1), y.argmax(-1))
