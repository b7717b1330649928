"""The only engine file that touches torch: the KV slot pool and the batched forward.

KV design (chosen by measurement, see benchmarks/batching.py): a preallocated pool per layer,
``k[layer]: [num_slots, kv_heads, max_model_len, head_dim]``, one slot per running sequence. Each
forward writes the new keys/values at per-row positions and hands attention a view of the first
``kv_len`` positions of the batch's slots, with a ``[B, 1, T, kv_len]`` boolean mask that encodes
per-row causality and length. This works for any Hugging Face decoder-only model whose attention
calls ``cache.update(...)`` (Llama, Qwen2, Mistral, Gemma...), with no model code of our own.

We measured the alternative, TGI-style per-sequence caches concatenated and filtered each step:
``torch.cat`` of every layer's cache per step cost more than the matmuls at batch 16. A paged pool
with block tables would need a gather per layer per step for HF's attention, which the dense-slot
layout avoids (the scheduler keeps slots dense so a decode batch is a contiguous view).

Rollback (rejected speculative tokens) is free: positions past ``num_computed_tokens`` are simply
masked out and overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from tiers.fast_forward import FastDecoder, supports_fast_path

if TYPE_CHECKING:
    from tiers.loading import LoadedModel

__all__ = ["ModelRunner", "RowInput"]


@dataclass(slots=True)
class RowInput:
    slot: int
    start: int
    """Position of the first fed token (= tokens already in this slot's cache)."""
    token_ids: list[int]
    logits: Literal["none", "last", "all"] = "last"


class _StepCache:
    """Duck-typed HF cache for one forward: writes new K/V into the slots, returns the batch's view."""

    def __init__(
        self, runner: ModelRunner, slots: torch.Tensor, positions: torch.Tensor, kv_len: int
    ) -> None:
        self.runner = runner
        self.slots_col = slots[:, None]  # [B, 1]
        self.positions = positions  # [B, T]
        self.kv_len = kv_len
        first = int(slots[0])
        n = slots.numel()
        contiguous = bool(torch.equal(slots, torch.arange(first, first + n, device=slots.device)))
        self.view = slice(first, first + n) if contiguous else None
        self.slots = slots

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [B, kv_heads, T, head_dim] -> the pool wants [B, T, kv_heads, head_dim] at (slot, pos).
        k_pool = self.runner.k[layer_idx]
        v_pool = self.runner.v[layer_idx]
        k_pool[self.slots_col, :, self.positions] = key_states.transpose(1, 2).to(k_pool.dtype)
        v_pool[self.slots_col, :, self.positions] = value_states.transpose(1, 2).to(v_pool.dtype)
        if self.view is not None:
            return k_pool[self.view, :, : self.kv_len], v_pool[self.view, :, : self.kv_len]
        return k_pool[self.slots, :, : self.kv_len], v_pool[self.slots, :, : self.kv_len]

    # Some model code asks these of any cache object.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    @property
    def is_compileable(self) -> bool:
        return False


class ModelRunner:
    """Runs batched forwards of one model over its own KV slot pool."""

    def __init__(
        self, loaded: LoadedModel, *, num_slots: int, max_model_len: int, fast_path: bool = True
    ) -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        cfg = self.model.config.get_text_config()
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.vocab_size = int(cfg.vocab_size)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.pad_token_id = int(self.tokenizer.pad_token_id or 0)
        shape = (num_slots, self.num_kv_heads, max_model_len, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.base = self.model.base_model
        self.lm_head = self.model.get_output_embeddings()
        # Llama-family models skip HF's layer stack for a lean loop over the same modules.
        self.fast = FastDecoder(self.model) if fast_path and supports_fast_path(self.model) else None

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k[0].element_size()

    @torch.inference_mode()
    def forward(self, rows: list[RowInput]) -> list[torch.Tensor | None]:
        """One padded ``[B, T]`` forward. Returns float32 logits per row: ``[1, V]`` for ``last``,
        ``[n, V]`` for ``all`` (one per fed token), ``None`` for ``none``."""
        if not rows:
            return []
        dev = self.device
        num_rows = len(rows)
        width = max(len(r.token_ids) for r in rows)
        ids = torch.full((num_rows, width), self.pad_token_id, dtype=torch.long)
        starts = torch.tensor([r.start for r in rows], dtype=torch.long)
        lengths = torch.tensor([len(r.token_ids) for r in rows], dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r.token_ids)] = torch.tensor(r.token_ids, dtype=torch.long)
        offsets = torch.arange(width, dtype=torch.long)
        # positions: [B, T]; padding positions clamp inside the slot (their K/V is garbage past the
        # row's end, masked now and overwritten when the row gets there).
        positions = (starts[:, None] + offsets[None, :]).clamp(max=self.max_model_len - 1)
        kv_len = int((starts + lengths).max())
        # mask[b, 0, t, j]: query t of row b sees key j iff j <= start_b + t (causal within the slot).
        keys = torch.arange(kv_len, dtype=torch.long)
        mask = keys[None, None, None, :] <= positions[:, None, :, None]
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
        cache = _StepCache(self, slots.to(dev), positions.to(dev), kv_len)
        if self.fast is not None:
            hidden = self.fast(ids.to(dev), mask.to(dev), positions.to(dev), cache)
        else:
            out = self.base(
                input_ids=ids.to(dev),
                attention_mask=mask.to(dev),
                position_ids=positions.to(dev),
                cache=cache,
                use_cache=True,
            )
            hidden = out.last_hidden_state  # [B, T, hidden]
        pick_rows: list[int] = []
        pick_cols: list[int] = []
        spans: list[tuple[int, int] | None] = []
        for i, r in enumerate(rows):
            n = len(r.token_ids)
            if r.logits == "none":
                spans.append(None)
                continue
            cols = range(n - 1, n) if r.logits == "last" else range(n)
            spans.append((len(pick_rows), len(pick_rows) + len(cols)))
            pick_rows.extend([i] * len(cols))
            pick_cols.extend(cols)
        if not pick_rows:
            return [None] * num_rows
        selected = hidden[torch.tensor(pick_rows, device=dev), torch.tensor(pick_cols, device=dev)]
        logits = self.lm_head(selected).float()  # [N, V]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        logits = logits.cpu()
        return [None if s is None else logits[s[0] : s[1]] for s in spans]

    @torch.inference_mode()
    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into ``dst`` (slot compaction)."""
        if length <= 0:
            return
        for pool in (self.k, self.v):
            for t in pool:
                t[dst, :, :length] = t[src, :, :length]

    @torch.inference_mode()
    def read_kv(self, slot: int, start: int, end: int) -> torch.Tensor:
        """KV of positions ``[start, end)``: ``[layers, 2, kv_heads, end - start, head_dim]`` (a copy)."""
        return torch.stack(
            [
                torch.stack([self.k[i][slot, :, start:end], self.v[i][slot, :, start:end]])
                for i in range(self.num_layers)
            ]
        ).clone()

    @torch.inference_mode()
    def write_kv(self, slot: int, start: int, kv: torch.Tensor) -> None:
        """Inverse of ``read_kv``."""
        end = start + kv.shape[3]
        for i in range(self.num_layers):
            self.k[i][slot, :, start:end] = kv[i, 0]
            self.v[i][slot, :, start:end] = kv[i, 1]
