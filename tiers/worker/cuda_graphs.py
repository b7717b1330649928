"""CUDA graphs of decode steps at bucketed batch sizes, over static device buffers.

A decode step of ``n`` rows (one token each, logits of it) runs as the captured graph of the
smallest bucket ``B >= n`` (``BUCKETS``): the rows' inputs are copied into that bucket's static
buffers, rows ``n .. B - 1`` are padding, and the graph replays the whole forward - embedding,
layers, attention's block mask, LM head - as one launch, no per-op launch cost on the host.

Padding never touches a sequence's KV: a padded row's token is written at a slot of the scratch
block (``kv_cache.KVPool``: a block no sequence owns), its block table is the scratch block alone
and it starts at position 0, so its attention reads only the scratch block. Its logits are
sliced off.

Capture (CUDA only, ``capture=True``) warms each bucket on a side stream, then records it into one
memory pool shared by every bucket (largest first). With ``capture=False`` the same static buffers
and padding run eagerly: how the CPU tests check the bucketing and padding without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["BUCKETS", "DecodeGraphs", "GraphLayout", "PaddedDecode", "bucket_for", "pad_decode"]

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class RowInput(Protocol):
    """A row of a forward (``model_runner.RowInput``)."""

    @property
    def block_table(self) -> list[int]: ...
    @property
    def start(self) -> int: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def logits(self) -> str: ...


def bucket_for(n: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket holding ``n`` rows (``None``: more rows than the largest)."""
    return next((b for b in buckets if b >= n), None) if n > 0 else None


@dataclass(frozen=True, slots=True)
class GraphLayout:
    max_blocks: int
    """Block-table width of every row (the blocks of ``max_model_len``)."""
    block_size: int
    scratch_block: int
    pad_token_id: int
    device: torch.device


@dataclass(slots=True)
class PaddedDecode:
    """One decode step's inputs padded to ``bucket`` rows (host lists, row-major)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[int]
    """``[bucket * max_blocks]``: each row's block table, padded with the scratch block."""
    starts: list[int]


def pad_decode(rows: Sequence[RowInput], bucket: int, layout: GraphLayout) -> PaddedDecode:
    """The step's inputs at ``bucket`` rows; padded rows write and read the scratch block only."""
    bs, width, scratch = layout.block_size, layout.max_blocks, layout.scratch_block
    out = PaddedDecode([], [], [], [], [])
    for r in rows:
        p = r.start
        used = p // bs + 1
        out.ids.append(r.token_ids[0])
        out.positions.append(p)
        out.slots.append(r.block_table[p // bs] * bs + p % bs)
        out.tables += r.block_table[:used] + [scratch] * (width - used)
        out.starts.append(p)
    pad = bucket - len(rows)
    out.ids += [layout.pad_token_id] * pad
    out.positions += [0] * pad
    out.slots += [scratch * bs] * pad
    out.tables += [scratch] * (width * pad)
    out.starts += [0] * pad
    return out


Body = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(ids [B], positions [B], slots [B], tables [B, max_blocks], starts [B]) -> logits [B, V]``."""


class DecodeGraphs:
    def __init__(
        self,
        body: Body,
        layout: GraphLayout,
        *,
        capture: bool,
        to_device: Callable[[Sequence[Sequence[int]]], list[torch.Tensor]] | None = None,
        buckets: Sequence[int] = BUCKETS,
    ) -> None:
        self.body = body
        self.layout = layout
        self.capture = capture and torch.cuda.is_available() and layout.device.type == "cuda"
        self.buckets = tuple(buckets)
        self._to_device = to_device or self._plain_copy
        self._static: dict[int, tuple[torch.Tensor, ...]] = {}
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self._pool: Any = None
        self.replays: dict[int, int] = {}
        """Steps run per bucket (tests and telemetry)."""

    def _plain_copy(self, parts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        return [torch.tensor(list(p), dtype=torch.long, device=self.layout.device) for p in parts]

    def serves(self, rows: Sequence[RowInput]) -> bool:
        """A decode step the graphs cover: one token and its logits per row, within a bucket and
        within the block-table width."""
        limit = self.layout.max_blocks * self.layout.block_size
        return bucket_for(len(rows), self.buckets) is not None and all(
            len(r.token_ids) == 1 and r.logits == "last" and r.start < limit for r in rows
        )

    def _buffers(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The bucket's static inputs, first filled with padding (what warm-up and capture see)."""
        if bucket not in self._static:
            filled = pad_decode([], bucket, self.layout)
            ids, pos, slots, tables, starts = self._plain_copy(
                [filled.ids, filled.positions, filled.slots, filled.tables, filled.starts]
            )
            self._static[bucket] = (ids, pos, slots, tables.view(bucket, self.layout.max_blocks), starts)
        return self._static[bucket]

    def capture_all(self) -> None:
        """Record every bucket's graph (largest first, one memory pool); CUDA only."""
        for b in sorted(self.buckets, reverse=True):
            self._graph(b)

    def _graph(self, bucket: int) -> tuple[Any, torch.Tensor]:
        if bucket not in self._graphs:
            static = self._buffers(bucket)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles, autotunes and fills the allocator outside capture
                    self.body(*static)
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.body(*static)
            self._graphs[bucket] = (graph, out)
        return self._graphs[bucket]

    def run(self, rows: Sequence[RowInput]) -> torch.Tensor:
        """Logits ``[n, V]`` of the ``n`` rows' decode step (a copy: the graph's output buffer is
        rewritten by the next replay)."""
        n = len(rows)
        bucket = bucket_for(n, self.buckets)
        assert bucket is not None
        p = pad_decode(rows, bucket, self.layout)
        staged = self._to_device([p.ids, p.positions, p.slots, p.tables, p.starts])
        static = self._buffers(bucket)
        for dst, src in zip(static, staged, strict=True):
            dst.view(-1).copy_(src, non_blocking=True)
        self.replays[bucket] = self.replays.get(bucket, 0) + 1
        if not self.capture:
            return self.body(*static)[:n]
        graph, out = self._graph(bucket)
        graph.replay()
        return out[:n].clone()
