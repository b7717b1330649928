"""Logit processing: penalties as OpenAI and HF define them, top-k/top-p masks, greedy one-hots."""

from __future__ import annotations

import torch

from tiers.core.sequence import SamplingParams, Sequence
from tiers.sample.logits_processors import apply_logit_bias, apply_penalties, probs_batch
from tiers.sample.sampler import _stacked, choose_tokens, draw, target_logits


def test_frequency_and_presence_penalties_follow_openai() -> None:
    logits = torch.zeros(1, 5)
    out = apply_penalties(
        logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [0], [1, 1, 3]
    )
    # token 1 seen twice: -(2*0.25 + 0.5); token 3 once: -(0.25 + 0.5); prompt token 0 untouched.
    assert torch.allclose(out[0], torch.tensor([0.0, -1.0, 0.0, -0.75, 0.0]))


def test_repetition_penalty_covers_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, 1.0]])
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0], [1])
    assert torch.allclose(out[0], torch.tensor([1.0, -4.0, 2.0, 1.0]))


def test_no_penalties_returns_the_same_tensor() -> None:
    logits = torch.randn(1, 10)
    assert apply_penalties(logits, SamplingParams(), [1], [2]) is logits


def test_top_k_keeps_k_tokens() -> None:
    probs = probs_batch(torch.tensor([[1.0, 4.0, 3.0, 2.0]]), [SamplingParams(temperature=1.0, top_k=2)])
    assert (probs[0] > 0).tolist() == [False, True, True, False]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = probs_batch(logits, [SamplingParams(temperature=1.0, top_p=0.8)])
    assert (probs[0] > 0).tolist() == [True, True, False, False]
    probs = probs_batch(logits, [SamplingParams(temperature=1.0, top_p=0.81)])
    assert (probs[0] > 0).tolist() == [True, True, True, False]


def test_greedy_is_a_one_hot_at_the_argmax() -> None:
    probs = probs_batch(torch.tensor([[0.1, 0.9, 0.3]]), [SamplingParams(temperature=0.0)])
    assert probs[0].tolist() == [0.0, 1.0, 0.0]


def test_seeded_draws_repeat_whatever_shares_the_batch() -> None:
    p = torch.full((3, 50), 1 / 50)
    shared = torch.Generator().manual_seed(1)
    a = [int(draw(p, [None, torch.Generator().manual_seed(7), None], shared)[1]) for _ in range(3)]
    b = int(draw(p[:1], [torch.Generator().manual_seed(7)], shared)[0])
    assert len(set(a)) == 1 and a[0] == b


def test_each_row_keeps_its_own_parameters_in_one_batch() -> None:
    """Vectorised processing: a greedy row, a top-k row, a top-p row and a min-p row side by side
    give what each gives alone."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.5),
    ]
    together = probs_batch(logits, params)
    for i, p in enumerate(params):
        assert torch.allclose(together[i], probs_batch(logits[i : i + 1], [p])[0])
    assert (together[3] > 0).tolist() == [True, True, False, False]  # 0.15 < 0.5 * 0.5


def test_draws_follow_the_distribution() -> None:
    from scipy.stats import chisquare

    p = torch.tensor([[0.6, 0.3, 0.1, 0.0]]).repeat(4000, 1)
    tokens = draw(p, [None] * 4000, torch.Generator().manual_seed(3))
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert counts[3] == 0
    assert chisquare(counts[:3], [2400, 1200, 400]).pvalue > 1e-3


def test_logit_bias_adds_to_the_named_tokens_only() -> None:
    logits = torch.zeros(2, 5)
    apply_logit_bias(logits, ((1, 100.0), (3, -100.0), (99, 5.0)))
    assert logits[0].tolist() == [0.0, 100.0, 0.0, -100.0, 0.0] and logits[1].tolist() == logits[0].tolist()


def test_unprocessed_rows_are_chosen_from_the_step_logits_without_copies() -> None:
    """Greedy rows without bias, penalties or grammar take their tokens from the runner's logits
    in place (a clone and a concatenation of [16, 49k] cost ~0.3 ms a step); a row that writes its
    logits still gets its own copy, so it never changes what another row reads."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)  # the runner's [M, V]; rows are views of it
    rows = [logits[i : i + 1] for i in range(4)]
    plain = Sequence([1, 2], SamplingParams(temperature=0))
    biased = Sequence([1, 2], SamplingParams(temperature=0, logit_bias=((7, 100.0),)))
    seqs = [plain, biased, plain, plain]
    chunks = [target_logits(s, r, None, frozenset()) for s, r in zip(seqs, rows, strict=True)]
    assert chunks[0].data_ptr() == logits.data_ptr() and chunks[1].data_ptr() != rows[1].data_ptr()
    assert logits[1, 7] < 100  # the bias went to the copy
    stacked = _stacked([chunks[0], rows[1], chunks[2], chunks[3]])
    assert stacked.data_ptr() == logits.data_ptr() and torch.equal(stacked, logits)  # a view, not a copy
    mixed = _stacked(chunks)  # the biased copy breaks the run: concatenated
    assert mixed.data_ptr() != logits.data_ptr() and torch.equal(mixed, torch.cat(chunks))
    assert torch.equal(_stacked([rows[2], rows[0]]), torch.cat([rows[2], rows[0]]))  # out of order
    picked = choose_tokens(seqs, chunks, [None] * 4, [None] * 4, torch.Generator())
    assert picked.tokens == [int(logits[0].argmax()), 7, int(logits[2].argmax()), int(logits[3].argmax())]
