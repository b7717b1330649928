"""Logits processors, vectorised over a step's rows: repetition/frequency/presence penalties and
``logit_bias`` on raw logits, a grammar's token mask, and the sampling law a row's parameters give
(temperature -> top-k -> top-p -> min-p -> softmax), in vLLM's and HF's order.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from tiers.core.sequence import SamplingParams

if TYPE_CHECKING:
    from tiers.core.constraint import TokenConstraint

__all__ = ["apply_logit_bias", "apply_penalties", "mask_row", "probs_batch"]


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: Seq[int], output_ids: Seq[int]
) -> torch.Tensor:
    """``logits: [n, V]`` for consecutive positions of one sequence; returns a penalized copy.

    OpenAI presence/frequency penalties count *generated* tokens; the repetition penalty (CTRL,
    as in HF and vLLM) covers prompt and output.
    """
    if not params.has_penalties:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    if params.presence_penalty or params.frequency_penalty:
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab].to(
            logits.dtype
        )
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        ids = torch.tensor(list(prompt_ids) + list(output_ids), dtype=torch.long)
        seen[ids[ids < vocab]] = True
        penalized = torch.where(
            logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty
        )
        logits = torch.where(seen, penalized, logits)
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: Seq[tuple[int, float]]) -> None:
    """OpenAI ``logit_bias``, in place on ``logits: [n, V]``; ids past the logits are ignored."""
    vocab = logits.shape[-1]
    ids = [t for t, _ in bias if 0 <= t < vocab]
    if ids:
        values = torch.tensor([b for t, b in bias if 0 <= t < vocab], dtype=logits.dtype)
        logits[:, ids] += values


def probs_batch(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """``logits: [M, V]``, one ``params`` per row -> the distribution each row draws from.

    Greedy rows get a one-hot at the argmax, which keeps the speculative acceptance rule exact
    for them too."""
    vocab = logits.shape[1]
    greedy = torch.tensor([p.is_greedy for p in params])
    temps = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params], dtype=logits.dtype)
    x = logits / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab and not p.is_greedy else 0 for p in params]
    top_p = [p.top_p if not p.is_greedy else 1.0 for p in params]
    if any(top_k) or any(tp < 1.0 for tp in top_p):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)
        if any(top_k):
            ks = torch.tensor([k or vocab for k in top_k])
            drop |= torch.arange(vocab)[None, :] >= ks[:, None]
        if any(tp < 1.0 for tp in top_p):
            sorted_p = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Drop a token when the mass strictly before it already reaches top_p (the first stays);
            # rows at top_p = 1 drop nothing (their cumulated mass can round to 1 before the tail).
            tp = torch.tensor(top_p, dtype=x.dtype)[:, None]
            drop |= ((sorted_p.cumsum(dim=-1) - sorted_p) >= tp) & (tp < 1.0)
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(dim=-1)
    min_p = torch.tensor([p.min_p if not p.is_greedy else 0.0 for p in params], dtype=probs.dtype)
    if bool((min_p > 0).any()):
        keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def mask_row(
    constraint: TokenConstraint | None, row: torch.Tensor, eos_ids: frozenset[int]
) -> torch.Tensor | None:
    """Apply a grammar to one logits row ``[V]`` in place; returns the mask (None: unconstrained).
    A grammar that allows nothing leaves only end-of-sequence tokens."""
    if constraint is None:
        return None
    mask = torch.zeros(row.shape[0], dtype=torch.bool)
    constraint.fill_mask(mask)
    if not bool(mask.any()):
        for t in eos_ids:
            if t < mask.shape[0]:
                mask[t] = True
    row.masked_fill_(~mask, float("-inf"))
    return mask
