"""Logits processors, vectorised over a step's rows: repetition/frequency/presence penalties and
``logit_bias`` on raw logits, a grammar's token mask, and the sampling law a row's parameters give
(temperature -> top-k -> top-p -> min-p -> softmax), in vLLM's and HF's order.

Device code: the logits stay where the runner left them, the rows' parameters go over in small
non-blocking copies (``staging.to_device``), and no decision reads a device tensor back (each is
taken from the parameters on the host), so none of this blocks the host on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from tiers.core.sequence import SamplingParams
from tiers.worker.staging import to_device

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
    vocab, dev = logits.shape[-1], logits.device
    if params.presence_penalty or params.frequency_penalty:
        # Counts by scatter-add, not bincount (which reads its input's max back on CUDA).
        out = to_device([t for t in output_ids if t < vocab], torch.long, dev)
        counts = torch.zeros(vocab, dtype=logits.dtype, device=dev).index_add_(
            0, out, torch.ones(out.shape, dtype=logits.dtype, device=dev)
        )
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    if params.repetition_penalty != 1.0:
        ids = to_device([t for t in (*prompt_ids, *output_ids) if t < vocab], torch.long, dev)
        seen = torch.zeros(vocab, dtype=torch.bool, device=dev).index_fill_(0, ids, True)
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
        values = to_device([b for t, b in bias if 0 <= t < vocab], logits.dtype, logits.device)
        logits[:, to_device(ids, torch.long, logits.device)] += values


def probs_batch(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """``logits: [M, V]``, one ``params`` per row -> the distribution each row draws from.

    Greedy rows get a one-hot at the argmax, which keeps the speculative acceptance rule exact
    for them too."""
    vocab, dev = logits.shape[1], logits.device
    temps = to_device([p.temperature if not p.is_greedy else 1.0 for p in params], logits.dtype, dev)
    x = logits / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab and not p.is_greedy else 0 for p in params]
    top_p = [p.top_p if not p.is_greedy else 1.0 for p in params]
    if any(top_k) or any(tp < 1.0 for tp in top_p):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)
        if any(top_k):
            ks = to_device([k or vocab for k in top_k], torch.long, dev)
            drop |= torch.arange(vocab, device=dev)[None, :] >= ks[:, None]
        if any(tp < 1.0 for tp in top_p):
            sorted_p = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Drop a token when the mass strictly before it already reaches top_p (the first stays);
            # rows at top_p = 1 drop nothing (their cumulated mass can round to 1 before the tail).
            tp = to_device(top_p, x.dtype, dev)[:, None]
            drop |= ((sorted_p.cumsum(dim=-1) - sorted_p) >= tp) & (tp < 1.0)
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(dim=-1)
    min_p = [p.min_p if not p.is_greedy else 0.0 for p in params]
    if any(m > 0 for m in min_p):
        keep = probs >= to_device(min_p, probs.dtype, dev)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    greedy = [p.is_greedy for p in params]
    if any(greedy):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(to_device(greedy, torch.bool, dev)[:, None], onehot, probs)
    return probs


def mask_row(
    constraint: TokenConstraint | None, row: torch.Tensor, eos_ids: frozenset[int]
) -> torch.Tensor | None:
    """Apply a grammar to one logits row ``[V]`` in place; returns the mask, on the row's device
    (None: unconstrained). A grammar that allows nothing leaves only end-of-sequence tokens.

    The matcher fills a host mask (it runs on the host); the check that it allows anything reads
    that host array (numpy: no device read), and the mask goes over in one non-blocking copy."""
    if constraint is None:
        return None
    mask = torch.zeros(row.shape[0], dtype=torch.bool)
    constraint.fill_mask(mask)
    if not mask.numpy().any():
        for t in eos_ids:
            if t < mask.shape[0]:
                mask[t] = True
    if row.device.type != "cpu":
        mask = mask.pin_memory().to(row.device, non_blocking=True)
    row.masked_fill_(~mask, float("-inf"))
    return mask
