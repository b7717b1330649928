"""A model's batched forward over its paged KV pool (``kv_cache.py``): input preparation and the forward.

The inputs of a forward (token ids, positions, slots, block tables, starts, the logit rows) go to
the device in one staged copy (``staging.py``: pinned and non-blocking on CUDA); the logits stay
on the device, where the sampler reads them (``tiers/sample/``), so a step's only host sync is the
sampler's copy of the chosen tokens. Decode steps may replay CUDA graphs (``cuda_graphs.py``,
``cuda_graphs=True``).

A forward takes rows of ``(block table, start position, tokens)``. Two paths:

- Llama-family models (``models/llama.py``): all rows' tokens flattened into one ``[N, hidden]``
  stream, so the projections and MLP see no padding; attention runs once per group of rows with
  the same query length over K/V gathered from their blocks, GQA folded into the query axis.
- Any other HF decoder: a padded ``[B, T]`` forward through HF's own modules with a duck-typed
  cache whose ``update`` writes into the pool and returns the rows' gathered K/V, plus a 4D mask.

On CPU the gather (one ``index_select`` of whole blocks per layer and group) is the price of
paging: measured at batch 16 x 600 tokens it about doubles attention's own cost, which is small
next to the weight reads of a step, and buys memory that follows live tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from tiers.attention.flex import AttnGroup, PagedBlockMask
from tiers.core.block_manager import BlockTable
from tiers.models.llama import FastDecoder, supports_fast_path
from tiers.worker.cuda_graphs import DecodeGraphs, GraphLayout
from tiers.worker.kv_cache import KVPool, PagedCache
from tiers.worker.staging import HostStager

if TYPE_CHECKING:
    from tiers.models.loading import LoadedModel

__all__ = ["AttnGroup", "ModelRunner", "RowInput", "check_supported", "kv_bytes_per_token"]


@dataclass(slots=True)
class RowInput:
    block_table: list[int]
    start: int
    """Position of the first fed token (= tokens of this row already in its blocks)."""
    token_ids: list[int]
    logits: Literal["none", "last", "all"] = "last"


def kv_bytes_per_token(cfg: Any, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes across all layers of a model with config ``cfg``."""
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    kv_heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def check_supported(cfg: Any, max_model_len: int) -> None:
    """Refuse what the paged engine would compute wrongly: sliding-window attention narrower than
    the context (our masks are full-causal; Gemma 2/3 and windowed Mistral need per-layer windows)."""
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    window = getattr(text, "sliding_window", None)
    uses = getattr(text, "use_sliding_window", True)
    layer_types = getattr(text, "layer_types", None) or []
    if window and uses and int(window) < max_model_len:
        raise ValueError(
            f"model type '{text.model_type}' uses sliding-window attention ({window} tokens) and "
            f"max_model_len is {max_model_len}: the paged engine attends to the whole context, which would "
            f"change the model's output; set max_model_len <= {window} or use a remote tier (vLLM)"
        )
    if any(t == "sliding_attention" for t in layer_types) and window and int(window) < max_model_len:
        raise ValueError(f"model type '{text.model_type}' has sliding-window layers; see above")


class ModelRunner:
    """Batched forwards of one model over its own paged KV pool."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_model_len: int = 2048,
        enable_prefix_caching: bool = True,
        fast_path: bool = True,
        batch_invariant: bool = False,
        cuda_graphs: bool = False,
    ) -> None:
        """``batch_invariant``: the fast path's paged attention kernel serves every query length
        (``FastDecoder``), so a row's logits do not depend on how its prompt was chunked.
        ``cuda_graphs``: decode steps of the fast path replay CUDA graphs at bucketed batch sizes
        (``cuda_graphs.py``; on a CUDA device only, else ignored)."""
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = torch.device(loaded.device)
        self.dtype = loaded.dtype
        self.max_model_len = max_model_len
        cfg = self.model.config.get_text_config()
        check_supported(cfg, max_model_len)
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.pad_token_id = int(self.tokenizer.pad_token_id or 0)
        self.lm_head = self.model.get_output_embeddings()
        self.vocab_size = int(self.lm_head.out_features)
        """Width of the logits (may exceed the tokenizer's vocabulary)."""
        self.block_size = block_size
        self.stager = HostStager(self.device)
        self.pool = KVPool(
            num_layers=self.num_layers, num_blocks=num_blocks, block_size=block_size,
            kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype, device=self.device,
            enable_caching=enable_prefix_caching, to_device=self.stager.one,
        )  # fmt: skip
        self.blocks = self.pool.blocks
        self.scratch_block = self.pool.scratch_block
        self.kv = self.pool.kv
        self.base = self.model.base_model
        # Llama-family models skip HF's layer stack for a lean loop over the same modules.
        fast = fast_path and supports_fast_path(self.model)
        self.fast = FastDecoder(self.model, paged_every_query=batch_invariant) if fast else None
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and self.fast is not None and self.device.type == "cuda":
            self.graphs = DecodeGraphs(
                self._decode_body, self._graph_layout(), capture=True, to_device=self.stager.stage
            )

    @property
    def kv_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv.element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.block_size

    # -- inputs ---------------------------------------------------------------------------------
    def _block_idx(self, rows: list[RowInput], num_blocks: int) -> list[int]:
        flat: list[int] = []
        for r in rows:
            used = self.blocks.blocks_for(r.start + len(r.token_ids))
            flat += r.block_table[:used] + [self.scratch_block] * (num_blocks - used)
        return flat

    @staticmethod
    def _picks(rows: list[RowInput], offsets: list[int]) -> tuple[list[int], list[tuple[int, int] | None]]:
        """Stream positions whose logits the rows asked for, and each row's span of them;
        ``offsets[i]``: row i's first token in the stream."""
        picks: list[int] = []
        spans: list[tuple[int, int] | None] = []
        for r, first in zip(rows, offsets, strict=True):
            n = len(r.token_ids)
            if r.logits == "none":
                spans.append(None)
                continue
            cols = range(n - 1, n) if r.logits == "last" else range(n)
            spans.append((len(picks), len(picks) + len(cols)))
            picks += [first + c for c in cols]
        return picks, spans

    # -- forward --------------------------------------------------------------------------------
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end-of-sequence ids (its generation config's and the tokenizer's)."""
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, list | tuple):
                ids.update(int(x) for x in src)
        return frozenset(ids)

    def forward_scratch(self, token_rows: list[list[int]], start: int = 0) -> None:
        """A forward on temporary blocks (warm-up and profiling), freed before returning. Every
        row uses the same blocks: their KV is garbage nobody reads, and the pool's memory stays
        untouched (blocks are zeroed, so resident, on first use)."""
        table = BlockTable()
        if not self.blocks.allocate(table, start + max(len(t) for t in token_rows)):
            return
        try:
            self.forward([RowInput(table.blocks, start, toks) for toks in token_rows])
        finally:
            self.blocks.free(table)

    @torch.inference_mode()
    def forward(self, rows: list[RowInput]) -> list[torch.Tensor | None]:
        """Returns float32 logits per row, on the device: ``[1, V]`` for ``last``, ``[n, V]`` for
        ``all`` (one per fed token), ``None`` for ``none``."""
        if not rows:
            return []
        self.pool.zero_new_blocks()
        if self.fast is not None:
            if self.graphs is not None and self.graphs.serves(rows):
                return list(self.graphs.run(rows).split(1))
            return self._forward_flat(rows)
        return self._forward_padded(rows)

    def _attn_group(
        self, first: int, rows: int, q_len: int, block_idx: torch.Tensor, blocks: int, starts: torch.Tensor
    ) -> AttnGroup:
        """One group's attention inputs from its device tensors (mask and block mask built there)."""
        assert self.fast is not None
        bs, dev = self.block_size, self.device
        kv_len = blocks * bs
        additive: torch.Tensor | None = None
        flex = None
        if self.fast.uses_flex:
            flex = PagedBlockMask(block_idx.view(rows, blocks), starts, q_len, self.kv.shape[1], bs)
        elif not self.fast.paged_attention_serves(q_len):
            group = self.num_heads // self.num_kv_heads
            q_pos = starts[:, None] + torch.arange(q_len, device=dev)[None, :]  # [rows, q_len]
            # mask[r, 0, g*q_len + t, j]: query t of row r sees key j iff j <= its position.
            mask = torch.arange(kv_len, device=dev)[None, None, :] <= q_pos[:, :, None]  # [rows, q, kv_len]
            mask = mask[:, None].expand(rows, group, q_len, kv_len).reshape(rows, 1, group * q_len, kv_len)
            zeros = torch.zeros(mask.shape, dtype=self.dtype, device=dev)
            additive = zeros.masked_fill_(~mask, float("-inf"))
        return AttnGroup(first, rows, q_len, block_idx, kv_len, starts, additive, flex)

    def _forward_flat(self, rows: list[RowInput]) -> list[torch.Tensor | None]:
        assert self.fast is not None
        # Rows of equal query length side by side, so each attention group is one slice.
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].token_ids))
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets = [0] * len(rows)  # row -> index of its first token in the stream
        shapes: list[tuple[int, int, int, int]] = []  # (first, rows, q_len, num_blocks) per group
        tables: list[list[int]] = []
        starts: list[list[int]] = []
        i = 0
        while i < len(order):
            q_len = len(rows[order[i]].token_ids)
            j = i
            while j < len(order) and len(rows[order[j]].token_ids) == q_len:
                j += 1
            members = [rows[k] for k in order[i:j]]
            first = len(ids)
            for k in order[i:j]:
                r = rows[k]
                offsets[k] = len(ids)
                ids += r.token_ids
                positions += range(r.start, r.start + q_len)
                slots += self.pool.slots(r.block_table, r.start, q_len)
            num_blocks = max(self.blocks.blocks_for(r.start + q_len) for r in members)
            shapes.append((first, len(members), q_len, num_blocks))
            tables.append(self._block_idx(members, num_blocks))
            starts.append([r.start for r in members])
            i = j
        picks, spans = self._picks(rows, offsets)
        # One copy to the device for all of it (pinned and non-blocking on CUDA).
        staged = self.stager.stage([ids, positions, slots, picks, *tables, *starts])
        ids_t, pos_t, slots_t, picks_t = staged[:4]
        n = len(shapes)
        groups = [
            self._attn_group(first, num, q_len, staged[4 + g], nb, staged[4 + n + g])
            for g, (first, num, q_len, nb) in enumerate(shapes)
        ]
        hidden = self.fast(ids_t, pos_t, slots_t, groups, self.kv)  # [N, hidden]
        return self._logits(hidden, picks_t, spans)

    # -- CUDA graphs of decode steps (cuda_graphs.py) -----------------------------------------
    def _graph_layout(self) -> GraphLayout:
        return GraphLayout(
            max_blocks=self.blocks.blocks_for(self.max_model_len), block_size=self.block_size,
            scratch_block=self.scratch_block, pad_token_id=self.pad_token_id, device=self.device,
        )  # fmt: skip

    def _decode_body(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
        starts: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """A decode step of ``B`` rows from static device buffers (what a CUDA graph captures):
        ``tables: [B, max_blocks]``; returns ``[B, V]`` float32 logits."""
        assert self.fast is not None
        rows, width = tables.shape
        group = self._attn_group(0, rows, 1, tables.view(-1), width, starts)
        hidden = self.fast(ids, positions, slots, [group], self.kv)
        return self._head(hidden)

    def _forward_padded(self, rows: list[RowInput]) -> list[torch.Tensor | None]:
        dev = self.device
        bs = self.block_size
        num_rows = len(rows)
        width = max(len(r.token_ids) for r in rows)
        ids = torch.full((num_rows, width), self.pad_token_id, dtype=torch.long)
        positions = torch.zeros((num_rows, width), dtype=torch.long)
        slots = torch.full((num_rows, width), self.scratch_block * bs, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r.token_ids)
            ids[i, :n] = torch.tensor(r.token_ids, dtype=torch.long)
            positions[i, :n] = torch.arange(r.start, r.start + n)
            positions[i, n:] = r.start + n - 1  # padding: any valid position (its output is dropped)
            slots[i, :n] = torch.tensor(self.pool.slots(r.block_table, r.start, n), dtype=torch.long)
        num_blocks = max(self.blocks.blocks_for(r.start + len(r.token_ids)) for r in rows)
        kv_len = num_blocks * bs
        mask = torch.arange(kv_len)[None, None, None, :] <= positions[:, None, :, None]
        picks, spans = self._picks(rows, [i * width for i in range(num_rows)])
        block_idx, picks_t = self.stager.stage([self._block_idx(rows, num_blocks), picks])
        cache = PagedCache(self.kv, slots.view(-1).to(dev), block_idx, kv_len)
        out = self.base(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=positions.to(dev),
            cache=cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state.reshape(num_rows * width, -1)  # [B*T, hidden]
        return self._logits(hidden, picks_t, spans)

    def _head(self, selected: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(selected).float()  # [M, V]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _logits(
        self, hidden: torch.Tensor, picks: torch.Tensor, spans: list[tuple[int, int] | None]
    ) -> list[torch.Tensor | None]:
        """Logits (on the device) of the stream positions ``picks``; ``spans``: each row's part."""
        if not picks.numel():
            return [None] * len(spans)
        logits = self._head(hidden.index_select(0, picks))
        return [None if s is None else logits[s[0] : s[1]] for s in spans]
