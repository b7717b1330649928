"""Model-free tests of ``tiers/sample/sampler.py`` against an independent float64 reference.

Torch tensors only, no model: every check builds logits by hand and compares what the module
decides with a plain numpy re-implementation of the same law - the sampling law (temperature,
top-k, top-p, min-p, greedy one-hots), the logit processing (penalties, ``logit_bias``, grammar
masks), and the speculative acceptance rule of Leviathan et al. (accept a draft x with
probability ``min(1, q(x) / p(x))``, else draw from ``norm(max(0, q - p))``, a bonus token from
the next position's law when every draft is accepted). The exact tests replay the same random
numbers from clones of the generators (one ``[S, K]`` uniform block for the speculating rows, then
one exponential race per row), so a changed rule, a changed row or a changed draw order shows as a
different token; the chi-square test checks the law itself at every drafted position.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tiers.core.output import TokenLogprob
from tiers.core.sequence import SamplingParams, Sequence
from tiers.sample.logits_processors import apply_logit_bias, apply_penalties, mask_row, probs_batch
from tiers.sample.logprobs import token_logprob
from tiers.sample.sampler import (
    Draft,
    _stacked,
    choose_tokens,
    draw,
    propose_tokens,
    sample_rows,
    target_logits,
)

V = 12


# -- the reference ---------------------------------------------------------------------------


def ref_law(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution one row of processed logits ``[V]`` draws from, in float64."""
    vocab = logits.shape[0]
    if p.temperature == 0.0 or p.top_k == 1:
        out = np.zeros(vocab)
        out[int(np.argmax(logits))] = 1.0
        return out
    x = logits.astype(np.float64) / p.temperature
    keep = np.isfinite(x)
    order = np.argsort(-x, kind="stable")
    if 0 < p.top_k < vocab:
        keep[order[p.top_k :]] = False
    if p.top_p < 1.0:
        w = np.where(keep, np.exp(x - x[keep].max()), 0.0)
        w /= w.sum()
        before = 0.0
        for t in order:
            if before >= p.top_p:
                keep[t] = False
            before += w[t]
    probs = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    probs /= probs.sum()
    if p.min_p > 0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


def ref_penalized(raw: np.ndarray, p: SamplingParams, prompt: Seq[int], output: Seq[int]) -> np.ndarray:
    out = raw.astype(np.float64).copy()
    vocab = out.shape[-1]
    for t in set(output):
        if t < vocab:
            out[:, t] -= p.frequency_penalty * list(output).count(t) + p.presence_penalty
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            if t < vocab:
                col = out[:, t]
                out[:, t] = np.where(col > 0, col / p.repetition_penalty, col * p.repetition_penalty)
    return out


def ref_processed(seq: Sequence, raw: np.ndarray, draft: Draft | None, eos: Seq[int]) -> np.ndarray:
    """``target_logits`` by hand: penalties, the verifying positions, bias, grammar masks."""
    p = seq.params
    lg = ref_penalized(raw, p, seq.prompt_token_ids, seq.output_token_ids)
    if draft is not None and draft.tokens:
        lg = lg[lg.shape[0] - len(draft.tokens) - 1 :]
    vocab = lg.shape[-1]
    for t, b in p.logit_bias:
        if 0 <= t < vocab:
            lg[:, t] += b
    if p.constraint is not None:
        masks = [m.numpy() for m in draft.masks] if draft is not None else []
        for j, m in enumerate(masks):
            lg[j, ~m] = -np.inf
        allowed = np.zeros(vocab, dtype=bool)
        for t in p.constraint.allowed:  # type: ignore[attr-defined]
            if t < vocab:
                allowed[t] = True
        if not allowed.any():
            allowed[[t for t in eos if t < vocab]] = True
        lg[len(masks), ~allowed] = -np.inf
    return lg


@dataclass
class RefStep:
    accepted: list[int]
    tokens: list[int]


def ref_choose(
    params: Seq[SamplingParams],
    chunks: Seq[np.ndarray],
    drafts: Seq[Draft | None],
    gen_states: Seq[torch.Tensor | None],
    shared_state: torch.Tensor,
) -> RefStep:
    """The step by hand, replaying the module's random numbers from clones of its generators: one
    ``[S, K]`` uniform block for the S speculating rows, then one exponential race per sampled row
    (the unseeded rows' block from the shared generator, each seeded row from its own)."""
    g = torch.Generator()
    g.set_state(shared_state)
    sampled = [r for r, p in enumerate(params) if not p.is_greedy]
    spec = [r for r in sampled if (d := drafts[r]) is not None and d.tokens]
    k = max((len(drafts[r].tokens) for r in spec), default=0)  # type: ignore[union-attr]
    uniform = torch.rand((len(spec), k), generator=g).double().numpy() if spec else None
    unseeded = [r for r in sampled if gen_states[r] is None]
    shared_noise = (
        torch.empty((len(unseeded), V)).exponential_(generator=g).double().numpy() if unseeded else None
    )
    accepted, tokens = [0] * len(params), [0] * len(params)
    for r, p in enumerate(params):
        d = drafts[r]
        if p.is_greedy:
            best = [int(np.argmax(row)) for row in chunks[r]]
            m = 0
            while d is not None and m < len(d.tokens) and d.tokens[m] == best[m]:
                m += 1
            accepted[r], tokens[r] = m, best[m]
            continue
        laws = [ref_law(row, p) for row in chunks[r]]
        dist = laws[0]
        if r in spec:
            assert d is not None and uniform is not None
            u = uniform[spec.index(r)]
            a = 0
            while a < len(d.tokens):
                x, pj, qj = d.tokens[a], d.probs[a].double().numpy(), laws[a]
                if not (u[a] * pj[x] <= qj[x] and pj[x] > 0 and qj[x] > 0):
                    break
                a += 1
            accepted[r] = a
            dist = laws[a]
            if a < len(d.tokens):
                residual = np.maximum(laws[a] - d.probs[a].double().numpy(), 0.0)
                if residual.sum() > 0:
                    dist = residual / residual.sum()
        state = gen_states[r]
        if state is None:
            assert shared_noise is not None
            noise = shared_noise[unseeded.index(r)]
        else:
            own = torch.Generator()
            own.set_state(state)
            noise = torch.empty(V).exponential_(generator=own).double().numpy()
        tokens[r] = int(np.argmax(dist / np.maximum(noise, 1e-20)))
    return RefStep(accepted, tokens)


class Allow:
    """A grammar that allows a fixed set of ids (ids past the row's width stay False)."""

    def __init__(self, allowed: Seq[int]) -> None:
        self.allowed = list(allowed)
        self.filled = 0

    def fill_mask(self, mask: torch.Tensor) -> None:
        self.filled += 1
        for t in self.allowed:
            if t < mask.shape[0]:
                mask[t] = True

    def accept(self, token_id: int) -> bool:
        return token_id in self.allowed

    def rollback(self, num_tokens: int) -> None:
        pass

    @property
    def is_terminated(self) -> bool:
        return False


def _law(rng: np.random.Generator, spread: float = 2.0) -> torch.Tensor:
    x = torch.tensor(rng.normal(0.0, spread, V), dtype=torch.float32)
    return x.softmax(dim=-1)


def _draft(rng: np.random.Generator, n: int, targets: np.ndarray | None = None) -> Draft:
    """n tokens, each drawn from its own law (a disagreeing draft); with ``targets``, the laws are
    the target's own at those positions (every token accepted)."""
    d = Draft()
    for j in range(n):
        law = torch.tensor(targets[j], dtype=torch.float32) if targets is not None else _law(rng)
        d.tokens.append(int(rng.choice(V, p=law.double().numpy() / law.double().sum().item())))
        d.probs.append(law)
    return d


def _state(g: torch.Generator | None) -> torch.Tensor | None:
    return None if g is None else g.get_state()


# -- the speculative step, exactly -----------------------------------------------------------


def test_choose_tokens_matches_the_reference_step_over_a_mixed_batch() -> None:
    """Greedy rows with and without drafts, sampled rows drafting 3, 1, 0 and 2 tokens (padded to
    one [S, 3] block), a seeded row and a row whose draft is the target's own law, side by side:
    every row's accepted count and token equal the float64 reference's. Catches a changed
    acceptance test (``<`` for ``<=``, q/p swapped, a missing ``p > 0``), a residual taken at the
    wrong position or from the wrong law, the bonus token taken from q_0 instead of q_k, rows or
    positions misaligned in the padded block (offsets, ``local``, ``n + 1``), a changed draw
    (generator, order, shape), and greedy acceptance that runs past a disagreement."""
    rng = np.random.default_rng(7)
    seen_accepts: set[tuple[int, int]] = set()
    for it in range(40):
        params = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.8, top_k=6),
            SamplingParams(temperature=1.0, top_p=0.9, seed=5),
            SamplingParams(temperature=1.2, min_p=0.05),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.9),
            SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.7, logprobs=0 if it % 2 else None),
        ]
        lengths = [1, 4, 4, 1, 2, 3, 1, 3, 4]
        chunks = [torch.tensor(rng.normal(0, 2.0, (m, V)), dtype=torch.float32) for m in lengths]
        best1 = chunks[1].argmax(dim=-1).tolist()
        best5 = chunks[5].argmax(dim=-1).tolist()
        law7 = np.stack([ref_law(row.double().numpy(), params[7]) for row in chunks[7]])
        drafts: list[Draft | None] = [
            None,
            Draft(tokens=[best1[0], best1[1], (best1[2] + 1) % V]),  # agrees twice, then not
            _draft(rng, 3),
            None,
            _draft(rng, 1),
            Draft(tokens=best5[:2]),  # agrees everywhere: the bonus token
            Draft(),  # drafting nothing is not speculating
            _draft(rng, 2, targets=law7),
            _draft(rng, 3),
        ]
        gens: list[torch.Generator | None] = [None] * len(params)
        gens[3] = torch.Generator().manual_seed(100 + it)
        shared = torch.Generator().manual_seed(it)
        expect = ref_choose(
            params,
            [c.double().numpy() for c in chunks],
            drafts,
            [_state(g) for g in gens],
            shared.get_state(),
        )
        seqs = [Sequence([1, 2, 3], p) for p in params]
        got = choose_tokens(seqs, chunks, drafts, gens, shared)
        assert got.accepted == expect.accepted, it
        assert got.tokens == expect.tokens, it
        assert got.offsets == [0, *np.cumsum(lengths).tolist()]
        if it % 2:
            assert got.logprobs is not None
            assert torch.allclose(got.logprobs, torch.cat(chunks).log_softmax(dim=-1))
        else:
            assert got.logprobs is None
        assert got.accepted[1] == 2 and got.accepted[5] == 2 and got.accepted[7] == 2
        seen_accepts |= {(r, got.accepted[r]) for r in (2, 4, 8)}
    # The mechanism ran: sampled drafts were rejected at the first, a middle and no position.
    assert {(2, 0), (2, 1), (8, 0)} <= seen_accepts
    assert {(4, 0), (4, 1)} <= seen_accepts


def test_a_draft_token_the_draft_could_not_draw_is_rejected_and_the_target_law_kept() -> None:
    """p(x) = 0 rejects x whatever q(x) (the draft did not draw it from that law), and with q = p
    the residual is empty, so the next token comes from q itself: a rule that accepted x, or drew
    from an all-zero residual, fails."""
    q = torch.tensor([[0.0, 5.0, 1.0, 0.0] + [-1.0] * (V - 4)] * 2)
    law = q[0].softmax(dim=-1)
    law[0] = 0.0
    law = law / law.sum()
    draft = Draft(tokens=[0], probs=[law])
    for seed in range(20):
        shared = torch.Generator().manual_seed(seed)
        params = SamplingParams(temperature=1.0)
        expect = ref_choose([params], [q.double().numpy()], [draft], [None], shared.get_state())
        got = choose_tokens([Sequence([1], params)], [q], [draft], [None], shared)
        assert got.accepted == [0] == expect.accepted
        assert got.tokens == expect.tokens


def test_the_speculative_law_holds_at_every_drafted_position() -> None:
    """3 drafted tokens from laws that disagree with the target's, 1500 rows in one step: the token
    emitted at each position j (accepted draft or the replacement after a rejection there) follows
    the target's law q_j, by chi-square. Catches a residual built from another position's law (the
    issue's bug: position 0's law after every rejection), a bonus token from the wrong position,
    and drafts accepted without the q/p test; the same counts against q_0 fail by a wide margin."""
    n, vocab = 1500, 6
    rng = np.random.default_rng(11)
    q_logits = torch.tensor(rng.normal(0, 1.5, (4, vocab)), dtype=torch.float32)
    q_logits[1] = torch.tensor([3.0, -2.0, 0.0, 1.0, -1.0, 0.5])
    q = q_logits.softmax(dim=-1)
    p = torch.stack([q[j].roll(2) * 0.5 + torch.full((vocab,), 0.5 / vocab) for j in range(3)])
    p = p / p.sum(dim=-1, keepdim=True)
    params = SamplingParams(temperature=1.0)
    seqs = [Sequence([1], params) for _ in range(n)]
    drafts: list[Draft | None] = []
    cdf = np.cumsum(p.double().numpy(), axis=-1)
    picks = (rng.random((n, 3, 1)) > cdf[None, :, :-1]).sum(axis=-1)  # [n, 3] draws from p_j
    for toks in picks.tolist():
        drafts.append(Draft(tokens=toks, probs=[p[0], p[1], p[2]]))
    chunks = [q_logits] * n
    got = choose_tokens(seqs, chunks, drafts, [None] * n, torch.Generator().manual_seed(3))
    assert set(got.accepted) == {0, 1, 2, 3}  # every outcome occurred
    for j in range(4):
        emitted = []
        for r in range(n):
            m = got.accepted[r]
            if m > j:
                emitted.append(drafts[r].tokens[j])  # type: ignore[union-attr]
            elif m == j:
                emitted.append(got.tokens[r])
        counts = np.bincount(emitted, minlength=vocab)
        law = q[j].double().numpy()
        expected = law / law.sum() * len(emitted)
        assert chisquare(counts, expected).pvalue > 1e-3, (j, counts, expected)
        if j:
            wrong = q[0].double().numpy() / q[0].double().sum().item() * len(emitted)
            assert chisquare(counts, wrong).pvalue < 1e-6, j


def test_greedy_rows_accept_while_the_argmax_agrees_and_never_build_laws() -> None:
    """Greedy speculation: accepted = the leading run of agreement, the token the target's argmax
    just after it (the bonus position when all agree); a greedy batch consumes no randomness."""
    chunks = [torch.tensor(np.eye(V, dtype=np.float32)[[3, 5, 7, 1]] * 4.0)]
    shared = torch.Generator().manual_seed(0)
    before = shared.get_state()
    for draft, acc, tok in [
        (Draft(tokens=[3, 5, 7]), 3, 1),
        (Draft(tokens=[3, 6, 7]), 1, 5),
        (Draft(tokens=[4, 5, 7]), 0, 3),
    ]:
        got = choose_tokens([Sequence([1], SamplingParams(temperature=0))], chunks, [draft], [None], shared)
        assert (got.accepted, got.tokens) == ([acc], [tok])
    assert torch.equal(shared.get_state(), before)


# -- processing the target's logits, sample_rows ---------------------------------------------


def test_sample_rows_matches_the_reference_pipeline() -> None:
    """Penalties, logit_bias and grammar masks (the draft's per-position masks, the grammar's own
    at the last position) on the verifying positions only, then the step: the RowOutputs (tokens =
    accepted drafts + the new token, drafted/accepted counts, logprobs of every emitted token with
    their top alternatives) equal the reference's, a row whose prompt chunk chose nothing gets None
    and the raw logits are never written. Catches penalties reading the wrong token lists, a
    misplaced slice of the verifying positions, bias or masks dropped or inverted, masks applied
    to the wrong positions, logprobs from another row or position."""
    rng = np.random.default_rng(5)
    eos = frozenset({V - 1, V + 3})
    for it in range(12):
        masks = [torch.tensor(rng.random(V) < 0.6) for _ in range(2)]
        for m in masks:
            m[int(rng.integers(V))] = True
        allowed = [] if it % 3 == 0 else [int(t) for t in rng.choice(V, 5, replace=False)]
        params = [
            SamplingParams(temperature=0.0, logit_bias=((0, 3.0), (4, -2.5), (V, 9.0)), logprobs=2),
            SamplingParams(temperature=0.9, repetition_penalty=1.6, frequency_penalty=0.4, logprobs=1),
            SamplingParams(temperature=1.1, constraint=Allow(allowed), logit_bias=((2, 1.5),), logprobs=3),
            SamplingParams(temperature=0.0, presence_penalty=0.7, constraint=Allow(allowed)),
            SamplingParams(temperature=1.0),
        ]
        seqs = [Sequence([int(t) for t in rng.integers(0, V + 2, 4)], p) for p in params]
        for s in seqs:
            s.token_ids += [int(t) for t in rng.integers(0, V, 3)]
        raws: list[torch.Tensor | None] = [
            torch.tensor(rng.normal(0, 2, (5, V)), dtype=torch.float32),
            torch.tensor(rng.normal(0, 2, (1, V)), dtype=torch.float32),
            torch.tensor(rng.normal(0, 2, (4, V)), dtype=torch.float32),
            torch.tensor(rng.normal(0, 2, (3, V)), dtype=torch.float32),
            None,
        ]
        originals = [r.clone() for r in raws if r is not None]
        drafts: list[Draft | None] = [
            Draft(tokens=[int(t) for t in rng.integers(0, V, 2)]),
            None,
            Draft(tokens=[int(t) for t in rng.integers(0, V, 2)], probs=[_law(rng), _law(rng)], masks=masks),
            Draft(tokens=[int(t) for t in rng.integers(0, V, 2)], masks=masks),
            None,
        ]
        drafts[2].tokens = [int(rng.choice(np.flatnonzero(m.numpy()))) for m in masks]  # type: ignore[union-attr]
        shared = torch.Generator().manual_seed(it)
        processed = [
            ref_processed(seqs[i], raws[i].double().numpy(), drafts[i], sorted(eos))  # type: ignore[union-attr]
            for i in range(4)
        ]
        expect = ref_choose(params[:4], processed, drafts[:4], [None] * 4, shared.get_state())
        out = sample_rows(seqs, raws, drafts, [None] * 5, shared, eos)
        assert out[4] is None
        assert all(
            torch.equal(a, b) for a, b in zip(originals, [r for r in raws if r is not None], strict=True)
        )
        for i in range(4):
            row = out[i]
            assert row is not None
            d = drafts[i]
            acc = expect.accepted[i]
            emitted = (d.tokens[:acc] if d is not None else []) + [expect.tokens[i]]
            assert row.tokens == emitted, (it, i)
            assert (row.num_drafted, row.num_accepted) == (len(d.tokens) if d else 0, acc)
            top = params[i].logprobs
            if top is None:
                assert row.logprobs is None
                continue
            assert row.logprobs is not None and len(row.logprobs) == len(emitted)
            for j, (lp, t) in enumerate(zip(row.logprobs, emitted, strict=True)):
                z = processed[i][j]
                logz = z - (np.log(np.exp(z - z.max()).sum()) + z.max())
                assert lp.token_id == t and lp.logprob == pytest.approx(logz[t], abs=1e-4)
                assert len(lp.top) == top
                assert [v for _, v in lp.top] == pytest.approx(np.sort(logz)[::-1][:top].tolist(), abs=1e-4)
                assert [logz[a] for a, _ in lp.top] == pytest.approx([v for _, v in lp.top], abs=1e-4)
        if not allowed:  # the grammar allowed nothing: only end-of-sequence ids within the row
            last = target_logits(seqs[3], raws[3], drafts[3], eos)[-1]  # type: ignore[arg-type]
            assert torch.isfinite(last).tolist() == [t == V - 1 for t in range(V)]
    assert params[2].constraint.filled > 0  # type: ignore[union-attr]


def test_target_logits_slices_the_verifying_positions_and_masks_each() -> None:
    """With a draft of n tokens the last n + 1 positions are returned, the draft's masks on the
    first n and the grammar's on the last; without a draft (or an empty one) every position."""
    raw = torch.arange(5 * V, dtype=torch.float32).reshape(5, V)
    plain = Sequence([1], SamplingParams(temperature=0))
    assert torch.equal(target_logits(plain, raw, None, frozenset()), raw)
    assert torch.equal(target_logits(plain, raw, Draft(), frozenset()), raw)
    assert torch.equal(target_logits(plain, raw, Draft(tokens=[1, 2]), frozenset()), raw[2:])
    allow = Allow([3, 4])
    m0 = torch.zeros(V, dtype=torch.bool)
    m0[[1, 2]] = True
    m1 = torch.zeros(V, dtype=torch.bool)
    m1[5] = True
    seq = Sequence([1], SamplingParams(temperature=0, constraint=allow))
    got = target_logits(seq, raw, Draft(tokens=[1, 5], masks=[m0, m1]), frozenset())
    assert torch.isfinite(got).tolist() == [m0.tolist(), m1.tolist(), [t in (3, 4) for t in range(V)]]
    assert torch.equal(got[torch.isfinite(got)], raw[2:][torch.isfinite(got)])
    assert bool(torch.isfinite(raw).all())  # the step's logits untouched


# -- drafting --------------------------------------------------------------------------------


def test_propose_tokens_matches_the_reference_draft() -> None:
    """The draft's logits, narrower than the target's, are padded with -inf, biased and masked as
    the target's will be; greedy rows take the argmax, sampled rows one batched exponential race
    from the shared generator, and their laws are returned by row. Catches a draft law computed
    without the bias or mask (the acceptance rule would compare different laws), a pad that lets
    the draft propose ids it cannot produce, laws keyed to the wrong rows."""
    rng = np.random.default_rng(3)
    narrow = V - 3
    for it in range(20):
        params = [
            SamplingParams(temperature=0.0, logit_bias=((narrow - 1, 4.0), (V - 1, 50.0))),
            SamplingParams(temperature=0.8, top_k=4, logit_bias=((0, 2.0),)),
            SamplingParams(temperature=0.0, constraint=Allow([2, 5])),
            SamplingParams(temperature=1.3, constraint=Allow([] if it % 2 else [1, 3, 6]), top_p=0.9),
        ]
        seqs = [Sequence([1], p) for p in params]
        logits = torch.tensor(rng.normal(0, 2, (4, narrow)), dtype=torch.float32)
        shared = torch.Generator().manual_seed(it)
        g = torch.Generator()
        g.set_state(shared.get_state())
        eos = frozenset({4, V + 1})
        processed = []
        for r, s in enumerate(seqs):
            row = np.concatenate([logits[r].double().numpy(), np.full(V - narrow, -np.inf)])
            processed.append(ref_processed(s, row[None, :], None, sorted(eos))[0])
        laws = {r: ref_law(processed[r], params[r]) for r in (1, 3)}
        noise = torch.empty((2, V)).exponential_(generator=g).double().numpy()
        expect = [int(np.argmax(processed[r])) for r in range(4)]
        for j, r in enumerate((1, 3)):
            expect[r] = int(np.argmax(laws[r] / noise[j]))
        tokens, got_laws, masks = propose_tokens(seqs, logits, V, eos, shared)
        assert tokens == expect
        assert sorted(got_laws) == [1, 3]
        for r in (1, 3):
            assert got_laws[r].shape == (V,)
            assert np.allclose(got_laws[r].double().numpy(), laws[r], atol=1e-6)
        assert masks[0] is None and masks[1] is None
        assert masks[2] is not None and masks[2].tolist() == [t in (2, 5) for t in range(V)]
        assert masks[3] is not None
        assert masks[3].tolist() == [t in ((4,) if it % 2 else (1, 3, 6)) for t in range(V)]
        assert tokens[0] < narrow  # the bias on an id the draft cannot produce is not a proposal


# -- the pieces ------------------------------------------------------------------------------


def test_mask_row_keeps_the_allowed_ids_and_falls_back_to_eos() -> None:
    row = torch.zeros(V)
    assert mask_row(None, row, frozenset({1})) is None and bool(torch.isfinite(row).all())
    mask = mask_row(Allow([2, 7, V + 5]), row, frozenset({1}))
    assert mask is not None and mask.dtype == torch.bool
    assert mask.tolist() == [t in (2, 7) for t in range(V)]
    assert torch.isfinite(row).tolist() == mask.tolist() and row[2] == 0.0
    row = torch.zeros(V)
    mask = mask_row(Allow([]), row, frozenset({0, V - 2, V, V + 4}))
    assert mask is not None and torch.isfinite(row).tolist() == [t in (0, V - 2) for t in range(V)]


def test_token_logprob_reports_the_token_and_its_top_alternatives() -> None:
    row = torch.tensor([-3.0, -0.5, -1.0, -2.0, -0.7])
    assert token_logprob(row, 3, 0) == TokenLogprob(3, -2.0, [])
    got = token_logprob(row, 3, 2)
    assert got.token_id == 3 and got.logprob == -2.0
    assert got.top == [(1, -0.5), (4, pytest.approx(-0.7))]
    assert isinstance(got.top[0][0], int) and isinstance(got.top[0][1], float)


def test_probs_batch_matches_the_reference_law_row_by_row() -> None:
    """Random logits under random mixes of temperature, top-k, top-p and min-p (greedy rows too),
    one batch: each row equals the float64 reference law, support included. Catches temperature
    multiplied or ignored, top-p taken over the mass before top-k renormalised, min-p without
    renormalising, greedy one-hots placed in the wrong row."""
    rng = np.random.default_rng(1)
    for _ in range(30):
        params = []
        for _ in range(8):
            kind = int(rng.integers(5))
            params.append(
                SamplingParams(
                    temperature=0.0 if kind == 0 else float(rng.choice([0.5, 0.8, 1.0, 1.7])),
                    top_k=int(rng.choice([0, 0, 3, 5, V, V + 4])),
                    top_p=float(rng.choice([1.0, 0.95, 0.6, 0.3])),
                    min_p=float(rng.choice([0.0, 0.0, 0.1, 0.4])),
                )
            )
        logits = torch.tensor(rng.normal(0, 2, (8, V)), dtype=torch.float32)
        got = probs_batch(logits, params)
        for i, p in enumerate(params):
            want = ref_law(logits[i].double().numpy(), p)
            assert np.allclose(got[i].double().numpy(), want, atol=1e-6), (i, p)
            assert (got[i] > 0).tolist() == (want > 0).tolist(), (i, p)


def test_probs_batch_edges() -> None:
    """Exact boundaries: top-p counts the mass strictly before a token (uniform quarters, p = 0.5
    keeps two, 0.25 one); top_p = 1 keeps a token however unlikely, beside a top-p row too (it
    dropped the tail once its cumulated mass rounded to 1: a row's law depended on its batch);
    min_p = 1 keeps the argmax; a temperature at float64 is applied at float64; several greedy
    rows each get their own one-hot."""
    uniform = torch.zeros(1, 4)
    for top_p, kept in [(0.5, 2), (0.25, 1), (0.75, 3)]:
        probs = probs_batch(uniform, [SamplingParams(top_p=top_p)])
        assert int((probs > 0).sum()) == kept and torch.allclose(probs[probs > 0], torch.tensor(1 / kept))
    tiny = torch.tensor([[0.0, -30.0], [0.0, -1.0]])
    probs = probs_batch(tiny, [SamplingParams(), SamplingParams(top_p=0.5)])
    assert probs[0, 1] > 0 and probs[1].tolist() == [1.0, 0.0]
    probs = probs_batch(torch.tensor([[1.0, 3.0, 3.0, 2.0]]), [SamplingParams(min_p=1.0)])
    assert probs[0].tolist() == [0.0, 0.5, 0.5, 0.0]
    x64 = torch.tensor([[0.3, -1.2, 2.0, 0.7]], dtype=torch.float64)
    probs = probs_batch(x64, [SamplingParams(temperature=0.7, min_p=0.3)])
    assert probs.dtype == torch.float64
    assert np.allclose(
        probs[0].numpy(),
        ref_law(x64[0].numpy(), SamplingParams(temperature=0.7, min_p=0.3)),
        rtol=1e-12,
        atol=0,
    )
    greedy = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 1.0], [0.0, 1.0, 3.0]])
    probs = probs_batch(
        greedy, [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(top_k=1)]
    )
    assert probs[0].tolist() == [0.0, 1.0, 0.0] and probs[2].tolist() == [0.0, 0.0, 1.0]
    assert torch.allclose(probs[1], greedy[1].softmax(dim=-1))


def test_draw_is_an_exponential_race_from_the_named_generators() -> None:
    """argmax(p / E) with E from the shared generator (one block for the unseeded rows, at the
    probabilities' dtype) and from each seeded row's own generator: replayed exactly from clones.
    Catches noise from the global generator, a changed dtype of the shared block, rows swapped."""
    rng = np.random.default_rng(2)
    probs = torch.tensor(rng.dirichlet(np.ones(V), 5), dtype=torch.float64)
    torch.manual_seed(123)  # the global generator must not matter
    shared = torch.Generator().manual_seed(9)
    own = torch.Generator().manual_seed(4)
    g, o = torch.Generator(), torch.Generator()
    g.set_state(shared.get_state())
    o.set_state(own.get_state())
    block = torch.empty((4, V), dtype=torch.float64).exponential_(generator=g)
    noise = torch.cat(
        [block[:2], torch.empty((1, V), dtype=torch.float64).exponential_(generator=o), block[2:]]
    )
    want = (probs / noise).argmax(dim=-1)
    torch.manual_seed(321)
    assert torch.equal(draw(probs, [None, None, own, None, None], shared), want)


def test_penalties_and_bias_edges() -> None:
    """No generated tokens yet: presence/frequency change nothing (and do not fail on an empty
    list); ids past the vocabulary are ignored (prompt and output); a positive logit below 1 is
    divided; presence alone applies; the bias adds (not assigns), reaches id 0, ignores negative
    ids and the id equal to the width, and is added at the logits' precision."""
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    same = apply_penalties(logits, SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), [0], [])
    assert torch.equal(same, logits) and same is not logits
    got = apply_penalties(logits, SamplingParams(presence_penalty=1.0), [9], [2, 2, 4, 7])
    assert got[0].tolist() == [0.5, -1.0, 1.0, 0.0]
    got = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0, 4], [1, 4])
    assert got[0].tolist() == [0.25, -2.0, 2.0, 0.0]
    assert logits[0].tolist() == [0.5, -1.0, 2.0, 0.0]  # a copy was penalized
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    apply_logit_bias(x, ((0, 0.1), (-1, 50.0), (4, 50.0), (2, -0.3)))
    assert x[0].tolist() == [1.0 + 0.1, 1.0, 1.0 - 0.3, 1.0]


def test_stacked_copies_what_is_not_one_contiguous_run() -> None:
    """A strided chunk (a column slice of a wider tensor) and chunks in separate storages that
    happen to lie back to back are concatenated, never reinterpreted; chunks of different widths
    are refused rather than read as one tensor."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    strided = base[0:2, :3]
    assert torch.equal(_stacked([strided]), strided)
    buf = np.arange(8, dtype=np.float32)
    a, b = torch.from_numpy(buf[:4]).view(1, 4), torch.from_numpy(buf[4:]).view(1, 4)
    assert a.data_ptr() + 16 == b.data_ptr()
    joined = _stacked([a, b])
    assert torch.equal(joined, torch.cat([a, b]))
    flat = torch.arange(24, dtype=torch.float32)  # room for a [4, 4] misreading
    with pytest.raises(RuntimeError):
        _stacked([flat[:8].view(2, 4), flat[8:14].view(2, 3)])
    run = base.view(-1)[:12].view(2, 6), base.view(-1)[12:].view(2, 6)
    view = _stacked(list(run))
    assert view.data_ptr() == base.data_ptr() and torch.equal(view, base)
    assert (
        torch.equal(_stacked([base[1:3], base[3:4]]), base[1:4])
        and _stacked([base[1:3], base[3:4]]).storage_offset() == 6
    )


def test_a_greedy_draft_batch_returns_no_laws_and_a_plain_constrained_row_masks_its_last_position() -> None:
    """All-greedy drafting returns an empty law table (not None: the engine looks rows up in it);
    a constrained row verifying no draft is masked by the grammar at its one position."""
    seqs = [Sequence([1], SamplingParams(temperature=0)), Sequence([1], SamplingParams(top_k=1))]
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    tokens, laws, masks = propose_tokens(seqs, logits, 3, frozenset(), torch.Generator())
    assert (tokens, laws, masks) == ([1, 0], {}, [None, None])
    seq = Sequence([1], SamplingParams(constraint=Allow([2])))
    raw = torch.zeros(1, V)
    got = target_logits(seq, raw, None, frozenset())
    assert torch.isfinite(got).tolist() == [[t == 2 for t in range(V)]]
    assert bool(torch.isfinite(raw).all())
