"""Reference: the CPU sampler as it was before the device sampler (commit 1b94860), verbatim:
the device sampler must draw from the same law and, on the CPU, the same tokens."""

# ruff: noqa
# mypy: ignore-errors
from __future__ import annotations

from collections.abc import Sequence as Seq
import torch
from tiers.sample.rejection import accept_batch
from tiers.sample.sampler import Draft, StepTokens, _stacked


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


def draw(
    probs: torch.Tensor, generators: Seq[torch.Generator | None], shared: torch.Generator
) -> torch.Tensor:
    """One token per row of ``probs: [M, V]`` -> ``[M]``: row i uses ``generators[i]`` when set,
    else the shared generator (one batched draw for all such rows)."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        block = torch.empty((len(unseeded), probs.shape[1]), dtype=probs.dtype).exponential_(generator=shared)
        noise[unseeded] = block
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)


def target_logits(
    seq: Sequence, raw: torch.Tensor, draft: Draft | None, eos_ids: frozenset[int]
) -> torch.Tensor:
    """The positions of ``raw`` that choose tokens (the last one, or the k + 1 verifying a draft),
    with penalties, bias and grammar masks applied (the matcher is past every draft by now)."""
    lg = apply_penalties(raw, seq.params, seq.prompt_token_ids, seq.output_token_ids)
    # Rows choosing output tokens before min_tokens: row j chooses output token num_output + j.
    short = seq.params.min_tokens - seq.num_output_tokens
    if lg is raw and (seq.params.logit_bias or seq.params.constraint is not None or short > 0):
        lg = raw.clone()  # written below; ``raw`` is a view of the step's shared logits
    if draft is not None and draft.tokens:
        lg = lg[-(len(draft.tokens) + 1) :]
    if short > 0:
        ends = sorted({*eos_ids, *seq.eos_token_ids, *seq.params.stop_token_ids})
        lg[:short, [t for t in ends if t < lg.shape[-1]]] = float("-inf")
    if seq.params.logit_bias:
        apply_logit_bias(lg, seq.params.logit_bias)
    if seq.params.constraint is not None:
        masks = draft.masks if draft is not None else []
        for j, m in enumerate(masks):
            lg[j].masked_fill_(~m, float("-inf"))
        mask_row(seq.params.constraint, lg[len(masks)], eos_ids)
    return lg


def choose_tokens(
    seqs: Seq[Sequence],
    chunks: Seq[torch.Tensor],
    drafts: Seq[Draft | None],
    generators: Seq[torch.Generator | None],
    shared: torch.Generator,
) -> StepTokens:
    """Every row's accepted drafts and next token from its processed logits ``chunks[r]: [m, V]``.

    Greedy rows accept while the target's argmax agrees and take its argmax: no vocabulary-sized
    tensor is built for them. Sampled rows get their laws in one batched pass, the acceptance rule
    over all speculating rows at once, then one batched draw."""
    flat = _stacked(chunks)  # [M, V]
    offsets = [0]
    for c in chunks:
        offsets.append(offsets[-1] + c.shape[0])
    logprobs = torch.log_softmax(flat, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
    argmax = flat.argmax(dim=-1).tolist()
    accepted = [0] * len(seqs)
    tokens = [0] * len(seqs)
    sampled: list[int] = []
    for r, seq in enumerate(seqs):
        if not seq.params.is_greedy:
            sampled.append(r)
            continue
        best = argmax[offsets[r] : offsets[r + 1]]
        d = drafts[r]
        m = 0
        if d is not None:
            while m < len(d.tokens) and d.tokens[m] == best[m]:
                m += 1
        accepted[r], tokens[r] = m, best[m]
    if sampled:
        rows = [j for r in sampled for j in range(offsets[r], offsets[r + 1])]
        probs = probs_batch(flat[rows], [seqs[r].params for r in sampled for _ in range(chunks[r].shape[0])])
        local = {}  # row -> its first position in probs
        at = 0
        for r in sampled:
            local[r] = at
            at += chunks[r].shape[0]
        next_dist = [probs[local[r]] for r in sampled]
        spec = [j for j, r in enumerate(sampled) if drafts[r] is not None and drafts[r].tokens]  # type: ignore[union-attr]
        if spec:
            k = max(len(drafts[sampled[j]].tokens) for j in spec)  # type: ignore[union-attr]
            vocab = probs.shape[1]
            d_tok = torch.zeros((len(spec), k), dtype=torch.long)
            d_num = torch.zeros(len(spec), dtype=torch.long)
            p = torch.zeros((len(spec), k, vocab))
            q = torch.zeros((len(spec), k + 1, vocab))
            for row, j in enumerate(spec):
                r = sampled[j]
                d = drafts[r]
                assert d is not None
                n = len(d.tokens)
                d_tok[row, :n] = torch.tensor(d.tokens)
                d_num[row] = n
                p[row, :n] = torch.stack(d.probs)
                q[row, : n + 1] = probs[local[r] : local[r] + n + 1]
            num_acc, dist = accept_batch(d_tok, d_num, p, q, torch.rand((len(spec), k), generator=shared))
            for row, j in enumerate(spec):
                accepted[sampled[j]] = int(num_acc[row])
                next_dist[j] = dist[row]
        drawn = draw(torch.stack(next_dist), [generators[r] for r in sampled], shared).tolist()
        for j, r in enumerate(sampled):
            tokens[r] = int(drawn[j])
    return StepTokens(accepted, tokens, offsets, logprobs)
