"""Prompt-lookup drafting: the proposal is what followed the latest earlier occurrence of the
sequence's last n tokens (vLLM's ``ngram`` speculative method, llama.cpp's lookup decoding).
``tiers.spec_decode.proposers.NgramDraft`` puts it behind the engine's proposer interface; the target verifies
its proposal with ``tiers.sample.rejection.accept_batch`` like a draft model's."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiers.core.block_manager import BlockManager

__all__ = ["NgramProposer"]


@dataclass(slots=True)
class _NgramIndex:
    length: int = 0
    """Tokens of the sequence indexed so far (its n-grams ending before ``length - 1``)."""
    last: list[dict[tuple[int, ...], int]] = field(default_factory=list)
    """Per n (``min_n + i``): n-gram -> position of its last token, latest occurrence that has a
    token after it."""


class NgramProposer:
    """Prompt-lookup drafting (vLLM's ``ngram`` speculative method, llama.cpp's lookup decoding):
    the tokens that followed the latest earlier occurrence of the sequence's last n tokens, longest
    n first (``max_n`` down to ``min_n``), are the proposal. No model, no KV: the target verifies
    the proposal as it verifies a draft model's, so greedy output is unchanged, and a sampled
    row's acceptance rule sees a one-hot draft law (accept x with probability q(x), else draw from
    the target's law with x removed), which keeps the target's distribution.

    ``blocks`` is bookkeeping only (the scheduler grows a draft table for every speculating row):
    no tensor stands behind it. Each sequence's n-grams are indexed incrementally, so a lookup
    costs O(max_n - min_n) dictionary probes whatever the context length.
    """

    def __init__(self, num_blocks: int, block_size: int, *, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.blocks = BlockManager(num_blocks, block_size, enable_caching=False)
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[int, _NgramIndex] = {}

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens`` (the sequence's prompt and output so far).
        Between calls a sequence's tokens may only grow; after dropping any, ``forget`` it."""
        if k <= 0:
            return []
        idx = self._index.get(seq_id)
        if idx is None or idx.length > len(tokens):  # new, or tokens were rolled back
            idx = self._index[seq_id] = _NgramIndex(0, [{} for _ in range(self.max_n - self.min_n + 1)])
        # Index every n-gram that ends at e <= len - 2 (it has a continuation).
        end = len(tokens) - 1
        for e in range(max(0, idx.length - 1), end):
            for i, table in enumerate(idx.last):
                n = self.min_n + i
                if e + 1 >= n:
                    table[tuple(tokens[e + 1 - n : e + 1])] = e
        idx.length = len(tokens)
        for i in range(len(idx.last) - 1, -1, -1):
            n = self.min_n + i
            if len(tokens) < n:
                continue
            at = idx.last[i].get(tuple(tokens[len(tokens) - n :]))
            if at is not None:
                return tokens[at + 1 : at + 1 + k]
        return []

    def forget(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)
