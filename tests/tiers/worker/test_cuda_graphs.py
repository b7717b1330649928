"""The bucketing and padding of CUDA-graph decode steps (``tiers/worker/cuda_graphs.py``), on the
CPU: the same static buffers and padding as a captured graph, run eagerly (``capture=False``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiers.core.block_manager import BlockTable
from tiers.models.loading import load_model
from tiers.worker.cuda_graphs import BUCKETS, DecodeGraphs, bucket_for, pad_decode
from tiers.worker.model_runner import ModelRunner, RowInput


def test_bucket_for_picks_the_smallest_bucket_holding_the_rows() -> None:
    """Catches an off-by-one at a bucket's edge and a batch past the largest bucket graphed."""
    assert BUCKETS == (1, 2, 4, 8, 16, 32, 64)
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 64, 64]
    assert bucket_for(0) is None and bucket_for(65) is None


def _runner(model_dir: Path) -> ModelRunner:
    loaded = load_model(str(model_dir), device="cpu")
    return ModelRunner(loaded, num_blocks=64, block_size=4, max_model_len=64)


def _graphed(r: ModelRunner) -> DecodeGraphs:
    g = DecodeGraphs(r._decode_body, r._graph_layout(), capture=False, to_device=r.stager.stage)
    r.graphs = g
    return g


def test_padded_rows_touch_only_the_scratch_block(tiny_model_dir: Path) -> None:
    """``pad_decode`` at bucket 8 for 3 rows: the padded rows' slots, tables and starts point at the
    scratch block alone, the real rows' at their own blocks (catches a padded row given a real
    row's table or slot, which would overwrite that row's KV)."""
    r = _runner(tiny_model_dir)
    layout = r._graph_layout()
    rows = []
    for n in (5, 9, 2):
        t = BlockTable()
        assert r.blocks.allocate(t, n + 1)
        rows.append(RowInput(t.blocks, n, [7], "last"))
    p = pad_decode(rows, 8, layout)
    bs, scratch, width = layout.block_size, layout.scratch_block, layout.max_blocks
    assert len(p.ids) == len(p.slots) == len(p.starts) == 8 and len(p.tables) == 8 * width
    for i, row in enumerate(rows):
        assert p.slots[i] == row.block_table[row.start // bs] * bs + row.start % bs
        assert p.tables[i * width : i * width + row.start // bs + 1] == row.block_table[: row.start // bs + 1]
    assert all(s // bs == scratch for s in p.slots[3:])
    assert set(p.tables[3 * width :]) == {scratch} and p.starts[3:] == [0] * 5


@pytest.mark.parametrize("num_rows", [1, 3, 6])
def test_a_graphed_decode_step_equals_the_plain_one_and_leaves_other_blocks_alone(
    tiny_model_dir: Path, num_rows: int
) -> None:
    """A decode step through the bucket's static buffers (padded to 1, 4 and 8 rows) against the
    plain forward of the same rows on an identical runner: the logits agree, the bucket ran, and
    every block but the scratch block holds the same KV - padded rows wrote nothing a sequence
    owns. Catches outputs not sliced to the real rows, rows misordered in the static buffers, and
    padding that writes into real blocks."""
    plain, graphed = _runner(tiny_model_dir), _runner(tiny_model_dir)
    g = _graphed(graphed)
    out, kv = [], []
    for r in (plain, graphed):
        rows = []
        for i in range(num_rows):
            t = BlockTable()
            assert r.blocks.allocate(t, 12 + 3 * i)
            ids = list(range(3 + i, 14 + 4 * i))
            r.forward([RowInput(t.blocks, 0, ids[:-1], "none")])
            rows.append(RowInput(t.blocks, len(ids) - 1, ids[-1:], "last"))
        kv.append(r.kv.clone())
        out.append(r.forward(rows))
    assert g.replays == {bucket_for(num_rows): 1}
    for a, b in zip(*out, strict=True):
        assert a is not None and b is not None and b.shape == a.shape == (1, plain.vocab_size)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    bs = graphed.block_size
    written = {row.block_table[row.start // bs] * bs + row.start % bs for row in rows}
    flat_before = kv[1].flatten(1, 2)  # [layers, slots, 2, kv_heads, dim]
    changed = (graphed.kv.flatten(1, 2) != flat_before).flatten(2).any(dim=2).any(dim=0)
    touched = {int(i) for i in changed.nonzero().flatten()}
    assert touched - written <= set(range(graphed.scratch_block * bs, (graphed.scratch_block + 1) * bs))
    assert written <= touched  # the real rows' own K/V did land


def test_graphs_serve_decode_steps_only(tiny_model_dir: Path) -> None:
    """Prompt chunks, rows asking for every position's logits and batches past the largest bucket
    take the plain path."""
    g = _graphed(_runner(tiny_model_dir))
    one = RowInput([0, 1], 5, [3], "last")
    assert g.serves([one] * 64)
    assert not g.serves([one] * 65)
    assert not g.serves([RowInput([0, 1], 5, [3, 4], "all")])
    assert not g.serves([RowInput([0, 1], 5, [3], "none")])
