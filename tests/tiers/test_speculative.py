"""Speculative decoding: lossless for greedy, distribution-preserving for sampling, adaptive k."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.fixtures import make_engine
from tests.tiers.test_engine import collect, greedy, prompts
from tiers.device import DeviceWorker
from tiers.engine import Engine
from tiers.sequence import SamplingParams
from tiers.speculative import SpecController, accept_draft


@pytest.fixture(scope="module")
def plain(worker: DeviceWorker, tiny_model_dir: Path) -> Engine:
    return make_engine(worker, tiny_model_dir, name="plain")  # type: ignore[return-value]


@pytest.fixture(scope="module")
def spec(worker: DeviceWorker, tiny_model_dir: Path) -> Engine:
    eng = make_engine(worker, tiny_model_dir, draft_quantization="int8", speculative_tokens=4, name="spec")
    assert isinstance(eng, Engine)
    return eng


async def test_greedy_with_draft_equals_greedy_without(plain: Engine, spec: Engine) -> None:
    ps = prompts(12, seed=11)
    lengths = [5 + 3 * (i % 5) for i in range(12)]
    want = await asyncio.gather(*(collect(plain, p, greedy(n)) for p, n in zip(ps, lengths, strict=True)))
    got = await asyncio.gather(*(collect(spec, p, greedy(n)) for p, n in zip(ps, lengths, strict=True)))
    assert [g[0] for g in got] == [w[0] for w in want]  # whatever k the controller picked


async def test_forced_speculation_every_step_is_still_exact(plain: Engine, spec: Engine) -> None:
    # An always-speculating controller: k never drops to 0.
    spec.spec.fixed_k = 3
    try:
        ps = prompts(6, seed=12)
        want = await asyncio.gather(*(collect(plain, p, greedy(20)) for p in ps))
        got = await asyncio.gather(*(collect(spec, p, greedy(20)) for p in ps))
    finally:
        spec.spec.fixed_k = None
    assert [g[0] for g in got] == [w[0] for w in want]
    drafted = sum(g[3].num_draft_tokens for g in got)
    accepted = sum(g[3].num_accepted_tokens for g in got)
    assert drafted > 0 and 0 < accepted <= drafted


def test_accept_draft_preserves_the_target_distribution() -> None:
    """Empirical law of the first emitted token equals q, whatever p drafted it."""
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])  # target at positions 0, 1
    p = torch.tensor([[0.1, 0.6, 0.1, 0.2]])  # the draft's law at position 0
    counts: Counter[int] = Counter()
    n = 20000
    for _ in range(n):
        x = int(torch.multinomial(p[0], 1, generator=gen))
        out = accept_draft([x], p, q, gen)
        counts[out[0]] += 1
        assert 1 <= len(out) <= 2
    empirical = torch.tensor([counts[i] / n for i in range(4)])
    assert torch.allclose(empirical, q[0], atol=0.015), empirical


def test_accept_draft_greedy_case_is_argmax_agreement() -> None:
    one_hot = lambda i: torch.nn.functional.one_hot(torch.tensor(i), 5).float()  # noqa: E731
    q = torch.stack([one_hot(2), one_hot(3), one_hot(1)])
    p = torch.stack([one_hot(2), one_hot(4)])
    assert accept_draft([2, 4], p, q, None) == [2, 3]  # second draft rejected, target's token instead
    p_all = torch.stack([one_hot(2), one_hot(3)])
    assert accept_draft([2, 3], p_all, q, None) == [2, 3, 1]  # all accepted + bonus


async def test_sampled_output_distribution_matches_without_draft(plain: Engine, spec: Engine) -> None:
    """Second-token distribution (the first one produced by a speculative step) with and without a draft."""
    ids = prompts(1, seed=13)[0]
    spec.spec.fixed_k = 2
    try:

        async def second_tokens(engine: Engine, n: int) -> Counter[int]:
            counts: Counter[int] = Counter()
            for start in range(0, n, 50):  # within the engine's queue bound
                outs = await asyncio.gather(
                    *(
                        collect(
                            engine,
                            ids,
                            SamplingParams(max_tokens=2, temperature=1.0, seed=1000 + i, ignore_eos=True),
                        )
                        for i in range(start, min(n, start + 50))
                    )
                )
                counts.update(o[0][1] for o in outs)
            return counts

        n = 400
        a = await second_tokens(plain, n)
        b = await second_tokens(spec, n)
    finally:
        spec.spec.fixed_k = None
    support = set(a) | set(b)
    tv = 0.5 * sum(abs(a[t] / n - b[t] / n) for t in support)
    assert tv < 0.15, tv


def test_controller_turns_speculation_off_when_it_does_not_pay() -> None:
    c = SpecController(max_k=4, acceptance=0.9)
    # batch 1: target step 60 ms, verify of 5 tokens 70 ms, draft 15 ms -> speculate.
    c.record_target(1, 1, 0.060)
    c.record_target(1, 5, 0.070)
    c.record_draft(1, 1, 0.015)
    # batch 16: compute-bound, verifying 5 tokens costs ~3x one -> never speculate.
    c.record_target(16, 1, 0.100)
    c.record_target(16, 5, 0.300)
    c.record_draft(16, 1, 0.070)
    assert c.choose_k(1) >= 2
    assert c.choose_k(16) == 0


def test_controller_explores_after_many_plain_steps() -> None:
    # Low measured acceptance makes k = 0 best, but a good draft could win here: explore now and then.
    c = SpecController(max_k=2, acceptance=0.1, explore_every=3)
    c.record_target(1, 1, 0.05)
    c.record_target(1, 3, 0.06)
    c.record_draft(1, 1, 0.02)
    ks = [c.choose_k(1) for _ in range(6)]
    assert ks.count(0) == 4 and max(ks) > 0
    # ...but not while the draft would first re-read a long backlog.
    assert all(c.choose_k(1, draft_lag=500) == 0 for _ in range(6))


def test_controller_never_explores_where_even_a_perfect_draft_loses() -> None:
    c = SpecController(max_k=2, acceptance=0.1, explore_every=1)
    c.record_target(16, 1, 0.05)
    c.record_target(16, 3, 0.2)
    c.record_draft(16, 1, 0.05)
    assert all(c.choose_k(16) == 0 for _ in range(10))
