"""Logit processing: penalties as OpenAI and HF define them, top-k/top-p masks, greedy one-hots."""

from __future__ import annotations

import torch

from tiers.sampling import apply_penalties, probs_from_logits, sample_rows
from tiers.sequence import SamplingParams


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
    probs = probs_from_logits(torch.tensor([[1.0, 4.0, 3.0, 2.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, True, False]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert (probs[0] > 0).tolist() == [True, True, False, False]
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert (probs[0] > 0).tolist() == [True, True, True, False]


def test_greedy_is_a_one_hot_at_the_argmax() -> None:
    probs = probs_from_logits(torch.tensor([[0.1, 0.9, 0.3]]), SamplingParams(temperature=0.0))
    assert probs[0].tolist() == [0.0, 1.0, 0.0]


def test_seeded_draws_repeat() -> None:
    p = torch.full((1, 50), 1 / 50)
    a = [int(sample_rows(p, torch.Generator().manual_seed(7))[0]) for _ in range(3)]
    assert len(set(a)) == 1
