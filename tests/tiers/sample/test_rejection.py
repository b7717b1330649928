"""``tiers/spec_decode/controller.py`` without a model: the acceptance rule row by row against a plain-Python
reference (given the same uniforms, the same accepted count and the same next law), and who may
draft at all (``spec_budget``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiers.core.sequence import SamplingParams, Sequence
from tiers.sample.rejection import accept_batch
from tiers.spec_decode.controller import spec_budget
from tiers.spec_decode.ngram import NgramProposer


def ref_accept(
    tokens: list[int], n: int, p: np.ndarray, q: np.ndarray, u: np.ndarray
) -> tuple[int, np.ndarray]:
    """Leviathan et al. for one row: accept x_j while u_j * p_j(x_j) <= q_j(x_j) (p_j(x_j) > 0 and
    q_j(x_j) > 0), then the residual norm(max(0, q_a - p_a)) after a rejection (q_a itself when
    the residual is empty) or the bonus law q_n when every draft was accepted."""
    a = 0
    while a < n:
        x = tokens[a]
        if not (u[a] * p[a, x] <= q[a, x] and p[a, x] > 0 and q[a, x] > 0):
            break
        a += 1
    if a == n:
        return a, q[a]
    residual = np.maximum(q[a] - p[a], 0.0)
    return a, residual / residual.sum() if residual.sum() > 0 else q[a]


def _laws(rng: np.random.Generator, shape: tuple[int, ...], zeros: float) -> torch.Tensor:
    w = rng.gamma(0.6, size=shape) * (rng.random(shape) >= zeros)
    w[..., 0] += 1e-3  # never an all-zero law
    return torch.tensor(w / w.sum(axis=-1, keepdims=True), dtype=torch.float32)


def test_accept_batch_matches_the_reference_row_by_row() -> None:
    """Rows drafting 0..K tokens side by side (padding past each row's count holds garbage), laws
    with zeros (drafted tokens the draft could not draw, or the target never would), uniforms
    given: the accepted counts and next laws equal the reference's. Catches a changed comparison,
    a missing p > 0 or q > 0 guard, the padding counted, the residual not clamped at 0 or not
    normalised, taken at another position, or used after a full acceptance; the bonus law taken
    from the last draft position instead of the one after it."""
    rng = np.random.default_rng(0)
    r_rows, k, vocab = 7, 4, 6
    seen = set()
    for _ in range(60):
        tokens = torch.tensor(rng.integers(0, vocab, (r_rows, k)))
        num = torch.tensor([0, 1, 2, 3, 4, 4, int(rng.integers(0, k + 1))])
        p = _laws(rng, (r_rows, k, vocab), zeros=0.3)
        q = _laws(rng, (r_rows, k + 1, vocab), zeros=0.3)
        q[5] = torch.cat([p[5], q[5, k:]])  # a draft with the target's own laws: all accepted
        tokens[5] = p[5].argmax(dim=-1)
        u = torch.rand((r_rows, k), generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
        got_num, got_dist = accept_batch(tokens, num, p, q, u)
        for row in range(r_rows):
            a, dist = ref_accept(
                tokens[row].tolist(),
                int(num[row]),
                p[row].double().numpy(),
                q[row].double().numpy(),
                u[row].double().numpy(),
            )
            assert int(got_num[row]) == a, row
            assert np.allclose(got_dist[row].double().numpy(), dist, atol=1e-6), row
            seen.add((int(num[row]), a))
    assert int(got_num[5]) == 4
    # The mechanism ran: rejections at each position and full acceptances.
    assert {(4, 0), (4, 1), (4, 2), (4, 3), (4, 4), (0, 0)} <= seen


def test_accept_batch_accepts_at_the_boundary_and_keeps_q_when_nothing_is_left() -> None:
    """u * p(x) = q(x) accepts (the rule is ``<=``: probability q/p, u drawn from [0, 1)); a draft
    token the target never emits is rejected even at u = 0; a rejected token whose residual is
    empty (q = p, x drawn with p(x) = 0) leaves q as the next law, never a 0/0."""
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0]]])
    q = torch.tensor([[[0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]]])
    num, dist = accept_batch(torch.tensor([[0]]), torch.tensor([1]), p, q, torch.tensor([[0.5]]))
    assert num.tolist() == [1] and dist[0].tolist() == q[0, 1].tolist()
    num, dist = accept_batch(torch.tensor([[0]]), torch.tensor([1]), p, q, torch.tensor([[0.5001]]))
    assert num.tolist() == [0] and torch.allclose(dist[0], torch.tensor([0.0, 0.0, 0.5, 0.5]))
    q0 = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]]])
    num, dist = accept_batch(torch.tensor([[0]]), torch.tensor([1]), p, q0, torch.tensor([[0.0]]))
    assert num.tolist() == [0]
    same = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]]])
    num, dist = accept_batch(torch.tensor([[3]]), torch.tensor([1]), same[:, :1], same, torch.tensor([[0.0]]))
    assert num.tolist() == [0] and dist[0].tolist() == same[0, 0].tolist()


def test_accept_batch_without_drafts_returns_the_first_law() -> None:
    q = torch.tensor([[[0.1, 0.9]], [[0.7, 0.3]]])
    num, dist = accept_batch(
        torch.zeros((2, 0), dtype=torch.long),
        torch.zeros(2, dtype=torch.long),
        torch.zeros((2, 0, 2)),
        q,
        torch.zeros((2, 0)),
    )
    assert num.tolist() == [0, 0] and torch.equal(dist, q[:, 0])


def _seq(prompt: int, output: int, **params: object) -> Sequence:
    s = Sequence(list(range(1, prompt + 1)), SamplingParams(**params))  # type: ignore[arg-type]
    s.token_ids += [7] * output
    return s


def test_spec_budget_names_who_may_draft_and_how_far() -> None:
    """Nothing at k = 0, for penalized requests or seeded sampled ones (a seed must reproduce the
    output whatever the load); a seeded greedy request drafts; never past max_tokens (the last
    token is the target's own) or the context, and never negative."""
    assert spec_budget(_seq(4, 0, max_tokens=50), 3, 100) == 3
    assert spec_budget(_seq(4, 0, max_tokens=50), 0, 100) == 0
    for penalty in ({"presence_penalty": 0.5}, {"frequency_penalty": -0.5}, {"repetition_penalty": 1.2}):
        assert spec_budget(_seq(4, 0, max_tokens=50, **penalty), 3, 100) == 0
    assert spec_budget(_seq(4, 0, max_tokens=50, seed=1, temperature=1.0), 3, 100) == 0
    assert spec_budget(_seq(4, 0, max_tokens=50, seed=1, temperature=0.0), 3, 100) == 3
    assert spec_budget(_seq(4, 2, max_tokens=5), 4, 100) == 2  # 3 remaining: 2 drafts + 1
    assert spec_budget(_seq(4, 2, max_tokens=50), 4, 9) == 2  # 6 tokens, context 9
    assert spec_budget(_seq(4, 4, max_tokens=5), 4, 100) == 0  # the last token: no room
    assert spec_budget(_seq(4, 5, max_tokens=5), 4, 100) == 0  # past it: still not negative
    assert spec_budget(_seq(8, 0, max_tokens=50), 4, 8) == 0


def test_ngram_proposer_edges() -> None:
    """Bounds are checked; k <= 0 proposes nothing; the longest n wins over a shorter, later match;
    tokens rolled back re-index from scratch; forget drops the index; a proposal stops at k."""
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(4, 4, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="need 1 <= min_n"):
        NgramProposer(4, 4, min_n=0, max_n=2)
    prop = NgramProposer(4, 4, min_n=1, max_n=3)
    assert prop.propose(1, [1, 2, 3, 1, 2], 0) == []
    assert prop.propose(1, [1, 2, 3, 1, 2], -1) == []
    # [1, 2] last seen at 0..1 (followed by 3); [2] alone last seen there too.
    assert prop.propose(1, [1, 2, 3, 1, 2], 2) == [3, 1]
    # [9, 2] matches nowhere at n = 2; n = 1 finds [2] at position 4 (followed by 9).
    assert prop.propose(1, [1, 2, 3, 1, 2, 9, 2], 3) == [9, 2]
    assert prop.propose(1, [5, 6, 5], 3) == [6, 5]  # shorter than indexed: a fresh index
    prop.forget(1)
    prop.forget(1)  # forgetting twice is fine
    assert prop.propose(1, [4, 4], 2) == [4]
    assert prop.blocks.block_size == 4 and prop.blocks.num_blocks == 4
