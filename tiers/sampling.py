"""Logit processing and token sampling, with per-request parameters in one batch.

Order (as vLLM and HF do it): penalties on raw logits -> greedy argmax, or temperature -> top-k ->
top-p -> softmax -> draw with the request's own generator (so ``seed`` reproduces a request's output
whatever else shares its batch).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from tiers.sequence import SamplingParams

__all__ = ["apply_penalties", "probs_from_logits", "sample_rows"]


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


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits: [n, V]`` -> the distribution a sampled request draws from, ``[n, V]`` (rows sum to 1).

    Greedy requests get a one-hot at the argmax, which keeps the speculative acceptance rule exact
    for them too.
    """
    if params.is_greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return out
    x = logits / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = sorted_x.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first always stays).
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= params.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    return x.softmax(dim=-1)


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of ``probs: [n, V]`` -> ``[n]``."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
