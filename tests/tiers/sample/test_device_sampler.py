"""The device sampler (``tiers/sample/sampler.py``, run where the logits are) against the CPU
sampler it replaced (``reference_cpu_sampler.py``, that code verbatim): the same law (chi-square
over many draws), on the CPU the very same tokens for greedy, sampled and seeded rows given the
same generator states, and the same processed logits (penalties, bias, min_tokens, grammar)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from scipy.stats import chisquare

from tests.tiers.sample import reference_cpu_sampler as ref
from tiers.core.sequence import SamplingParams, Sequence
from tiers.sample.sampler import Draft, choose_tokens, sample_rows, target_logits

V = 12

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.1, top_p=0.85),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.9, min_p=0.02, seed=11),
    SamplingParams(
        temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
        logit_bias=((3, 2.0), (7, -1.5)),
    ),
]  # fmt: skip


def _seq(p: SamplingParams) -> Sequence:
    seq = Sequence([1, 2, 3, 4], p)
    seq.token_ids += [3, 3, 5]  # three output tokens, for the penalties
    return seq


def _clone(g: torch.Generator | None) -> torch.Generator | None:
    if g is None:
        return None
    out = torch.Generator()
    out.set_state(g.get_state())
    return out


def _draft(rng: np.random.Generator, n: int, greedy: bool) -> Draft:
    tokens = rng.integers(0, V, n).tolist()
    if greedy:
        return Draft(tokens)
    laws = [torch.tensor(rng.dirichlet(np.ones(V)), dtype=torch.float32) for _ in range(n)]
    for t, law in zip(tokens, laws, strict=True):
        law[t] += 0.2  # drafted tokens carry mass under their own law
    return Draft(tokens, [law / law.sum() for law in laws])


def test_tokens_equal_the_cpu_samplers_for_greedy_sampled_seeded_and_speculating_rows() -> None:
    """Catches any change of law or of draw order in the device rewrite (a different index
    order for the shared noise block, rand drawn after the race, a seeded row drawing from the
    shared generator, greedy acceptance past a disagreement, a penalty or bias applied twice):
    from clones of the same generators, every row's accepted count and token equal the old CPU
    sampler's, over 60 random batches of every kind of row, with and without drafts."""
    rng = np.random.default_rng(3)
    for it in range(60):
        params = [PARAMS[i] for i in rng.integers(0, len(PARAMS), 7)]
        seqs = [_seq(p) for p in params]
        drafts = [
            _draft(rng, int(rng.integers(1, 4)), p.is_greedy) if rng.random() < 0.5 else None for p in params
        ]
        raws = [
            torch.tensor(rng.normal(0, 2.0, ((len(d.tokens) + 1) if d else 1, V)), dtype=torch.float32)
            for d in drafts
        ]
        for d, raw in zip(drafts, raws, strict=True):  # greedy drafts agreeing for a while
            if d is not None and not d.probs and rng.random() < 0.6:
                best = raw.argmax(dim=-1).tolist()
                d.tokens[: int(rng.integers(1, len(d.tokens) + 1))] = best[: len(d.tokens)][
                    : int(rng.integers(1, len(d.tokens) + 1))
                ]
        eos = frozenset({0})
        got_chunks = [target_logits(s, r, d, eos) for s, r, d in zip(seqs, raws, drafts, strict=True)]
        ref_chunks = [ref.target_logits(s, r, d, eos) for s, r, d in zip(seqs, raws, drafts, strict=True)]
        for a, b in zip(got_chunks, ref_chunks, strict=True):
            assert torch.equal(a, b), it  # the processed logits, bitwise
        gens = [torch.Generator().manual_seed(100 + it) if p.seed is not None else None for p in params]
        ref_gens = [_clone(g) for g in gens]
        shared = torch.Generator().manual_seed(it)
        ref_shared = _clone(shared)
        assert ref_shared is not None
        got = choose_tokens(seqs, got_chunks, drafts, gens, shared)
        want = ref.choose_tokens(seqs, ref_chunks, drafts, ref_gens, ref_shared)
        assert (got.accepted, got.tokens) == (want.accepted, want.tokens), it
        assert torch.equal(shared.get_state(), ref_shared.get_state())  # the same draws consumed


def test_the_law_of_each_row_is_the_cpu_samplers_chi_square() -> None:
    """Empirical frequencies of 4000 device-sampler draws per parameter set, against the law the
    old CPU sampler computes for the same processed logits (its ``probs_batch``): catches a
    changed temperature, top-k/top-p/min-p cut, penalty or bias, and a biased draw. Rows that the
    law gives no mass must never be drawn."""
    rng = np.random.default_rng(5)
    raw = torch.tensor(rng.normal(0, 1.5, (1, V)), dtype=torch.float32)
    pvalues = []
    for setting in PARAMS[1:]:
        p = dataclasses.replace(setting, seed=None)
        rows = 500
        seqs = [_seq(p) for _ in range(rows)]
        counts = np.zeros(V)
        shared = torch.Generator().manual_seed(9)
        for _ in range(8):
            out = sample_rows(seqs, [raw] * rows, [None] * rows, [None] * rows, shared, frozenset({0}))
            for o in out:
                assert o is not None
                counts[o.tokens[0]] += 1
        law = ref.probs_batch(ref.target_logits(seqs[0], raw, None, frozenset({0})), [p])[0].double().numpy()
        assert counts[law == 0].sum() == 0, p
        live = law > 0
        expected = law[live] / law[live].sum() * counts.sum()
        pvalues.append(float(chisquare(counts[live], expected).pvalue))
    assert min(pvalues) > 1e-3, pvalues
    print("chi-square p-values:", [round(x, 3) for x in pvalues])
