"""The only engine file that touches torch: the paged KV pool and the batched forward.

KV layout: one tensor ``kv: [layers, num_blocks + 1, block_size, 2, kv_heads, head_dim]`` (vLLM's
token-major block layout, K and V side by side so each layer's new keys and values land in one
``index_copy_``). Block ``num_blocks`` is a scratch block no sequence owns: padded positions of the
generic path write there. Which block holds which token is the ``BlockManager``'s business
(``block_manager.py``, owned here so a tier and the tier it drafts for share one pool).

The pool is allocated with ``torch.empty`` and each block is zeroed the first time a forward
uses it: resident memory follows the blocks actually used (the budget is an upper bound), and
attention never reads uninitialised memory - positions past a row's length are masked, but a NaN
there would still poison ``softmax(QK) @ V`` (0 x NaN = NaN).

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
from tiers.core.block_manager import BlockManager, BlockTable
from tiers.models.llama import FastDecoder, supports_fast_path

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


class _PagedCache:
    """Duck-typed HF cache for one padded forward (generic path)."""

    def __init__(
        self, runner: ModelRunner, slots: torch.Tensor, block_idx: torch.Tensor, kv_len: int
    ) -> None:
        self.runner = runner
        self.slots = slots  # [B * T] pool slot of every padded token (scratch for padding)
        self.block_idx = block_idx  # [B * num_blocks]
        self.kv_len = kv_len

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [B, kv_heads, T, head_dim] -> flat tokens [B*T, kv_heads, head_dim]
        b, h, t, d = key_states.shape
        pool = self.runner.kv[layer_idx]
        new = torch.stack((key_states.transpose(1, 2), value_states.transpose(1, 2)), dim=2)
        pool.view(-1, 2, h, d).index_copy_(0, self.slots, new.reshape(b * t, 2, h, d).to(pool.dtype))
        kv = pool.index_select(0, self.block_idx).view(b, self.kv_len, 2, h, d)
        return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    @property
    def is_compileable(self) -> bool:
        return False


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
    ) -> None:
        """``batch_invariant``: the fast path's paged attention kernel serves every query length
        (``FastDecoder``), so a row's logits do not depend on how its prompt was chunked."""
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
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
        self.blocks = BlockManager(num_blocks, block_size, enable_caching=enable_prefix_caching)
        self.scratch_block = num_blocks
        shape = (self.num_layers, num_blocks + 1, block_size, 2, self.num_kv_heads, self.head_dim)
        self.kv = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.kv[:, self.scratch_block].zero_()
        self.blocks.copy_block = self._copy_block
        self.base = self.model.base_model
        # Llama-family models skip HF's layer stack for a lean loop over the same modules.
        fast = fast_path and supports_fast_path(self.model)
        self.fast = FastDecoder(self.model, paged_every_query=batch_invariant) if fast else None

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
    def _slots(self, row: RowInput, n: int) -> list[int]:
        bs = self.block_size
        table = row.block_table
        return [table[p // bs] * bs + p % bs for p in range(row.start, row.start + n)]

    def _block_idx(self, rows: list[RowInput], num_blocks: int) -> torch.Tensor:
        flat: list[int] = []
        for r in rows:
            used = self.blocks.blocks_for(r.start + len(r.token_ids))
            flat += r.block_table[:used] + [self.scratch_block] * (num_blocks - used)
        return torch.tensor(flat, dtype=torch.long)

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
        """Returns float32 logits per row: ``[1, V]`` for ``last``, ``[n, V]`` for ``all`` (one
        per fed token), ``None`` for ``none``."""
        if not rows:
            return []
        self._zero_new_blocks()
        if self.fast is not None:
            return self._forward_flat(rows)
        return self._forward_padded(rows)

    def _copy_block(self, src: int, dst: int) -> None:
        """One block's KV, every layer, into a fresh one: a prefix hit past the last whole block
        (block_manager.py)."""
        self._zero_new_blocks()  # dst may be new: its pending zeroing must not come after the copy
        self.kv[:, dst] = self.kv[:, src]

    def _zero_new_blocks(self) -> None:
        fresh = self.blocks.take_first_uses()
        if fresh:
            self.kv[:, fresh] = 0

    def _forward_flat(self, rows: list[RowInput]) -> list[torch.Tensor | None]:
        assert self.fast is not None
        bs = self.block_size
        # Rows of equal query length side by side, so each attention group is one slice.
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].token_ids))
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets = [0] * len(rows)  # row -> index of its first token in the stream
        groups: list[AttnGroup] = []
        group = self.num_heads // self.num_kv_heads
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
                slots += self._slots(r, q_len)
            num_blocks = max(self.blocks.blocks_for(r.start + q_len) for r in members)
            kv_len = num_blocks * bs
            starts = torch.tensor([r.start for r in members], dtype=torch.long)
            additive: torch.Tensor | None = None
            block_idx = self._block_idx(members, num_blocks).to(self.device)
            flex = None
            if self.fast.uses_flex:
                flex = PagedBlockMask(
                    block_idx.view(len(members), num_blocks), starts, q_len, self.kv.shape[1], bs
                )
            elif not self.fast.paged_attention_serves(q_len):
                q_pos = starts[:, None] + torch.arange(q_len)[None, :]  # [rows, q_len]
                # mask[r, 0, g*q_len + t, j]: query t of row r sees key j iff j <= its position.
                mask = torch.arange(kv_len)[None, None, :] <= q_pos[:, :, None]  # [rows, q_len, kv_len]
                mask = (
                    mask[:, None]
                    .expand(len(members), group, q_len, kv_len)
                    .reshape(len(members), 1, group * q_len, kv_len)
                )
                zeros = torch.zeros(mask.shape, dtype=self.dtype)
                additive = zeros.masked_fill_(~mask, float("-inf")).to(self.device)
            groups.append(
                AttnGroup(
                    first,
                    len(members),
                    q_len,
                    block_idx,
                    kv_len,
                    starts,
                    additive,
                    flex,
                )
            )
            i = j
        dev = self.device
        hidden = self.fast(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            torch.tensor(slots, dtype=torch.long, device=dev),
            groups,
            self.kv,
        )  # [N, hidden]
        return self._logits(hidden, rows, offsets)

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
            slots[i, :n] = torch.tensor(self._slots(r, n), dtype=torch.long)
        num_blocks = max(self.blocks.blocks_for(r.start + len(r.token_ids)) for r in rows)
        kv_len = num_blocks * bs
        mask = torch.arange(kv_len)[None, None, None, :] <= positions[:, None, :, None]
        cache = _PagedCache(self, slots.view(-1).to(dev), self._block_idx(rows, num_blocks).to(dev), kv_len)
        out = self.base(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=positions.to(dev),
            cache=cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state.reshape(num_rows * width, -1)  # [B*T, hidden]
        return self._logits(hidden, rows, [i * width for i in range(num_rows)])

    def _logits(
        self, hidden: torch.Tensor, rows: list[RowInput], offsets: list[int]
    ) -> list[torch.Tensor | None]:
        """Logits of the positions each row asked for; ``offsets[i]``: row i's first token in ``hidden``."""
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
        if not picks:
            return [None] * len(spans)
        selected = hidden.index_select(0, torch.tensor(picks, dtype=torch.long, device=hidden.device))
        logits = self.lm_head(selected).float()  # [M, V]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        logits = logits.cpu()
        return [None if s is None else logits[s[0] : s[1]] for s in spans]
