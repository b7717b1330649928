"""Log-probabilities reported to the caller: a position's chosen token with its top alternatives,
and the prompt's own logprobs split off the rows that asked for them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from tiers.core.output import TokenLogprob

if TYPE_CHECKING:
    from tiers.core.sequence import Sequence

__all__ = ["split_prompt_logprobs", "token_logprob"]


def split_prompt_logprobs(
    seqs: Seq[Sequence], logits: list[torch.Tensor | None], num_new_tokens: Seq[int]
) -> dict[int, list[tuple[int, TokenLogprob]]]:
    """Rows of requests that asked for prompt logprobs carry logits at every position of their
    prompt chunk (``Proposal.target_rows``): each position's log-softmax gives the logprob of the
    prompt token after it - the model's own distribution, before any sampling setting, as vLLM
    reports prompt logprobs. Returns ``{seq_id: [(prompt position, logprob), ...]}`` and leaves
    in ``logits`` what the sampler expects: the last position once the prompt is all fed, else
    nothing."""
    found: dict[int, list[tuple[int, TokenLogprob]]] = {}
    for i, seq in enumerate(seqs):
        raw = logits[i]
        if raw is None or not seq.prompt_logprobs_pending:
            continue
        top = seq.params.prompt_logprobs or 0
        start, n = seq.num_computed_tokens, num_new_tokens[i]
        rows = torch.log_softmax(raw[:n].float(), dim=-1)
        found[seq.seq_id] = [
            (start + j + 1, token_logprob(rows[j], seq.token_ids[start + j + 1], top))
            for j in range(n)
            if start + j + 1 < seq.num_prompt_tokens
        ]
        logits[i] = raw[n - 1 : n] if start + n == seq.num_tokens else None
    return found


def token_logprob(row: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``row``: log-softmax over the processed logits at one position ``[V]``."""
    alternatives: list[tuple[int, float]] = []
    if top:
        values, ids = torch.topk(row, top)
        alternatives = [(int(t), float(v)) for t, v in zip(ids, values, strict=True)]
    return TokenLogprob(token, float(row[token]), alternatives)
