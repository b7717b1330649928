"""Token sampling, vectorised over every row of a step: drafts, verification and plain decoding.

Order (as vLLM and HF do it): penalties and ``logit_bias`` on raw logits -> grammar masks ->
greedy argmax, or temperature -> top-k -> top-p -> min-p -> softmax -> draw. Rows carry their own
parameters; one batched pass serves them all.

Draws use the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)`` per token is an exact
sample from ``p``): the noise of a seeded request comes from its own generator, one ``[V]`` draw
per sampled token, so ``seed`` reproduces a request's output whatever else shares its batch;
everything else shares one batched draw from the engine's generator.

Everything runs where the logits are (the runner's device): the rows' parameters and drafts go
over in small non-blocking copies, every decision about the rows is taken from what the host
already knows (parameters, draft lengths), and the step's outcome - accepted counts and chosen
tokens - comes back in one copy (``choose_tokens``): the step's only host sync (rows asking for
logprobs aside, whose values are read back too).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tiers.core.sched.batch import RowOutput
from tiers.sample.logits_processors import apply_logit_bias, apply_penalties, mask_row, probs_batch
from tiers.sample.logprobs import token_logprob
from tiers.sample.rejection import accept_batch
from tiers.worker.staging import to_device

if TYPE_CHECKING:
    from tiers.core.sequence import Sequence

__all__ = [
    "Draft",
    "StepTokens",
    "choose_tokens",
    "draw",
    "propose_tokens",
    "sample_rows",
    "target_logits",
]


def draw(
    probs: torch.Tensor, generators: Seq[torch.Generator | None], shared: torch.Generator
) -> torch.Tensor:
    """One token per row of ``probs: [M, V]`` -> ``[M]``: row i uses ``generators[i]`` when set,
    else the shared generator (one batched draw for all such rows)."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        block = torch.empty((len(unseeded), probs.shape[1]), dtype=probs.dtype, device=probs.device)
        block.exponential_(generator=shared)
        if len(unseeded) == len(generators):
            noise = block
        else:
            noise.index_copy_(0, to_device(unseeded, torch.long, probs.device), block)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)


# -- one step's rows ---------------------------------------------------------------------------


@dataclass(slots=True)
class Draft:
    """One row's speculative proposal this step."""

    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    """``[V]`` each: the law each token was drawn from (sampled rows only; greedy needs none)."""
    masks: list[torch.Tensor] = field(default_factory=list)
    """``[V]`` bool each: the grammar's mask at each proposal (constrained rows)."""


@dataclass(slots=True)
class StepTokens:
    """What the target's logits decided, per row: accepted drafts, then one new token."""

    accepted: list[int]
    tokens: list[int]
    offsets: list[int]
    """Row r's positions are ``offsets[r]:offsets[r + 1]`` of ``logprobs``."""
    logprobs: torch.Tensor | None
    """``[M, V]`` log-softmax of the processed logits, when any row asked for logprobs."""


def propose_tokens(
    seqs: Seq[Sequence], logits: torch.Tensor, vocab: int, eos_ids: frozenset[int], shared: torch.Generator
) -> tuple[list[int], dict[int, torch.Tensor], list[torch.Tensor | None]]:
    """Draft tokens from the draft's logits ``[R, V_draft]``, processed as the target's will be
    (bias, grammar mask, temperature...) so the acceptance rule compares the same laws.

    Returns the tokens, the laws of sampled rows (by row) and each row's grammar mask. A draft head
    narrower than the target's is padded with -inf: it never proposes ids it cannot produce."""
    if logits.shape[1] < vocab:
        pad = torch.full((logits.shape[0], vocab - logits.shape[1]), float("-inf"), device=logits.device)
        logits = torch.cat([logits, pad], dim=1)
    masks = []
    for r, seq in enumerate(seqs):
        if seq.params.logit_bias:
            apply_logit_bias(logits[r : r + 1], seq.params.logit_bias)
        masks.append(mask_row(seq.params.constraint, logits[r], eos_ids))
    tokens = logits.argmax(dim=-1)
    sampled = [r for r, s in enumerate(seqs) if not s.params.is_greedy]
    laws: dict[int, torch.Tensor] = {}
    if sampled:
        idx = to_device(sampled, torch.long, logits.device)
        p = probs_batch(logits.index_select(0, idx), [seqs[r].params for r in sampled])
        tokens.index_copy_(0, idx, draw(p, [None] * len(sampled), shared))
        laws = {r: p[j] for j, r in enumerate(sampled)}
    return tokens.tolist(), laws, masks


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
        lg[:short, to_device([t for t in ends if t < lg.shape[-1]], torch.long, lg.device)] = float("-inf")
    if seq.params.logit_bias:
        apply_logit_bias(lg, seq.params.logit_bias)
    if seq.params.constraint is not None:
        masks = draft.masks if draft is not None else []
        for j, m in enumerate(masks):
            lg[j].masked_fill_(~m, float("-inf"))
        mask_row(seq.params.constraint, lg[len(masks)], eos_ids)
    return lg


def _stacked(chunks: Seq[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(chunks)``, without the copy when the chunks already lie back to back in one
    tensor: unprocessed rows are consecutive slices of the runner's ``[M, V]`` logits (a 3 MB copy
    at 16 rows of a 49k vocabulary, every step)."""
    first = chunks[0]
    width = first.shape[-1]
    nxt = first.data_ptr()
    for c in chunks:
        if not c.is_contiguous() or c.dim() != 2 or c.shape[-1] != width or c.data_ptr() != nxt:
            return torch.cat(list(chunks))
        if c.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return torch.cat(list(chunks))
        nxt += c.numel() * c.element_size()
    total = sum(c.shape[0] for c in chunks)
    return first.as_strided((total, width), (width, 1), first.storage_offset())


def _greedy_outcome(
    argmax: torch.Tensor, offsets: list[int], drafts: Seq[Draft | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows on the device: accepted = the leading run of drafts equal to the target's argmax,
    token = the argmax after it. ``drafts[j]``: row j's (``offsets[j]``: its first position)."""
    k = max((len(d.tokens) for d in drafts if d is not None), default=0)
    pos: list[int] = []
    tok: list[int] = []
    for first, d in zip(offsets, drafts, strict=True):
        n = len(d.tokens) if d is not None else 0
        pos += [first + min(j, n) for j in range(k + 1)]
        tok += (d.tokens if d is not None else []) + [-1] * (k - n)  # -1: never an argmax
    pos_t, tok_t = to_device(pos + tok, torch.long, argmax.device).split([len(pos), len(tok)])
    best = argmax[pos_t].view(len(drafts), k + 1)
    if not k:
        return torch.zeros(len(drafts), dtype=torch.long, device=argmax.device), best[:, 0]
    agree = best[:, :k] == tok_t.view(len(drafts), k)
    m = torch.cumprod(agree.to(torch.long), dim=1).sum(dim=1)
    return m, best.gather(1, m[:, None])[:, 0]


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
    over all speculating rows at once, then one batched draw. All of it on the logits' device; the
    outcome comes back in one copy."""
    flat = _stacked(chunks)  # [M, V]
    dev = flat.device
    offsets = [0]
    for c in chunks:
        offsets.append(offsets[-1] + c.shape[0])
    logprobs = torch.log_softmax(flat, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
    outcome = torch.zeros((2, len(seqs)), dtype=torch.long, device=dev)  # accepted, token
    greedy = [r for r, seq in enumerate(seqs) if seq.params.is_greedy]
    sampled = [r for r, seq in enumerate(seqs) if not seq.params.is_greedy]
    if greedy:
        m, tok = _greedy_outcome(
            flat.argmax(dim=-1), [offsets[r] for r in greedy], [drafts[r] for r in greedy]
        )
        if len(greedy) == len(seqs):
            outcome = torch.stack((m, tok))
        else:
            outcome.index_copy_(1, to_device(greedy, torch.long, dev), torch.stack((m, tok)))
    if sampled:
        rows = [j for r in sampled for j in range(offsets[r], offsets[r + 1])]
        picked = (
            flat if len(rows) == flat.shape[0] else flat.index_select(0, to_device(rows, torch.long, dev))
        )
        probs = probs_batch(picked, [seqs[r].params for r in sampled for _ in range(chunks[r].shape[0])])
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
            d_tok: list[int] = []
            d_num: list[int] = []
            p = torch.zeros((len(spec), k, vocab), device=dev)
            q = torch.zeros((len(spec), k + 1, vocab), device=dev)
            for row, j in enumerate(spec):
                r = sampled[j]
                d = drafts[r]
                assert d is not None
                n = len(d.tokens)
                d_tok += d.tokens + [0] * (k - n)
                d_num.append(n)
                p[row, :n] = torch.stack(d.probs)
                q[row, : n + 1] = probs[local[r] : local[r] + n + 1]
            tok_t, num_t = to_device(d_tok + d_num, torch.long, dev).split([len(d_tok), len(d_num)])
            uniform = torch.rand((len(spec), k), generator=shared, device=dev)
            num_acc, dist = accept_batch(tok_t.view(len(spec), k), num_t, p, q, uniform)
            outcome[0].index_copy_(0, to_device([sampled[j] for j in spec], torch.long, dev), num_acc)
            for row, j in enumerate(spec):
                next_dist[j] = dist[row]
        drawn = draw(torch.stack(next_dist), [generators[r] for r in sampled], shared)
        outcome[1].index_copy_(0, to_device(sampled, torch.long, dev), drawn)
    accepted, tokens = outcome.tolist()  # the step's one copy back to the host
    return StepTokens(accepted, tokens, offsets, logprobs)


def sample_rows(
    seqs: Seq[Sequence],
    logits: Seq[torch.Tensor | None],
    drafts: Seq[Draft | None],
    generators: Seq[torch.Generator | None],
    shared: torch.Generator,
    eos_ids: frozenset[int],
) -> list[RowOutput | None]:
    """Every row's outcome from the target's logits (``None`` where a prompt chunk short of the
    prompt's end chose nothing): logits processed (penalties, bias, grammar), drafts accepted or
    rejected and the next token chosen, vectorised over the rows. Reads sequences, writes none of
    them (``Scheduler.update_from_output`` applies the outcome)."""
    owners = [i for i, raw in enumerate(logits) if raw is not None]
    out: list[RowOutput | None] = [None] * len(seqs)
    if not owners:
        return out
    chunks = [target_logits(seqs[i], logits[i], drafts[i], eos_ids) for i in owners]  # type: ignore[arg-type]
    chosen = choose_tokens(
        [seqs[i] for i in owners],
        chunks,
        [drafts[i] for i in owners],
        [generators[i] for i in owners],
        shared,
    )
    for r, i in enumerate(owners):
        d, m = drafts[i], chosen.accepted[r]
        tokens = (d.tokens[:m] if d is not None else []) + [chosen.tokens[r]]
        top = seqs[i].params.logprobs
        lps = None
        if chosen.logprobs is not None and top is not None:
            lps = [
                token_logprob(chosen.logprobs[chosen.offsets[r] + j], t, top) for j, t in enumerate(tokens)
            ]
        out[i] = RowOutput(tokens, len(d.tokens) if d is not None else 0, m, lps)
    return out
