"""Speculative decoding: lossless for greedy, distribution-preserving for sampling, adaptive k."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.fixtures import make_engine
from tests.tiers.engine.test_llm_engine import collect, greedy, prompts
from tiers.core.sequence import SamplingParams
from tiers.engine.llm_engine import Engine
from tiers.sample.rejection import accept_batch
from tiers.spec_decode.controller import EXPLORE_STEPS, SpecController
from tiers.spec_decode.ngram import NgramProposer
from tiers.worker.device import DeviceWorker


@pytest.fixture(scope="module")
def plain(worker: DeviceWorker, tiny_model_dir: Path) -> Engine:
    return make_engine(worker, tiny_model_dir, name="plain")  # type: ignore[return-value]


@pytest.fixture(scope="module")
def spec(worker: DeviceWorker, tiny_model_dir: Path) -> Engine:
    eng = make_engine(worker, tiny_model_dir, draft_quantization="int8", speculative_tokens=4, name="spec")
    assert isinstance(eng, Engine)
    return eng


async def test_greedy_with_draft_equals_greedy_without(plain: Engine, spec: Engine) -> None:
    # Mixed lengths: rows leave mid-flight, and k is capped per row by its remaining tokens.
    ps = prompts(12, seed=11)
    lengths = [5 + 3 * (i % 5) for i in range(12)]
    want = await asyncio.gather(*(collect(plain, p, greedy(n)) for p, n in zip(ps, lengths, strict=True)))
    spec.spec.fixed_k = 4
    try:
        got = await asyncio.gather(*(collect(spec, p, greedy(n)) for p, n in zip(ps, lengths, strict=True)))
    finally:
        spec.spec.fixed_k = None
    assert [g[0] for g in got] == [w[0] for w in want]
    assert sum(g[3].num_draft_tokens for g in got) > 0  # drafting happened


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


def _accept_one(draft: list[int], p: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> list[int]:
    """One row through the batched rule, then the next token drawn from its law."""
    k = len(draft)
    num, dist = accept_batch(
        torch.tensor([draft]), torch.tensor([k]), p[None], q[None], torch.rand((1, k), generator=gen)
    )
    a = int(num[0])
    return [*draft[:a], int(torch.multinomial(dist[0], 1, generator=gen))]


def test_accept_batch_preserves_the_target_distribution() -> None:
    """Empirical law of the first emitted token equals q, whatever p drafted it (chi-square)."""
    from scipy.stats import chisquare

    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])  # target at positions 0, 1
    p = torch.tensor([[0.1, 0.6, 0.1, 0.2]])  # the draft's law at position 0
    counts: Counter[int] = Counter()
    n = 20000
    rejected = 0
    for _ in range(n):
        x = int(torch.multinomial(p[0], 1, generator=gen))
        out = _accept_one([x], p, q, gen)
        rejected += len(out) == 1
        counts[out[0]] += 1
    assert rejected > n // 4  # the residual path ran
    observed = [counts[i] for i in range(4)]
    assert chisquare(observed, (q[0] * n).tolist()).pvalue > 1e-3, observed


# A Markov-chain "model" over 4 tokens: the target prefers repeating its last token, the draft
# prefers the next one, so drafts are rejected often and at every position of a round.
TARGET_CHAIN = torch.tensor(
    [[0.55, 0.15, 0.15, 0.15], [0.15, 0.55, 0.15, 0.15], [0.15, 0.15, 0.55, 0.15], [0.15, 0.15, 0.15, 0.55]]
)
DRAFT_CHAIN = torch.tensor(
    [[0.05, 0.8, 0.1, 0.05], [0.05, 0.05, 0.8, 0.1], [0.1, 0.05, 0.05, 0.8], [0.8, 0.1, 0.05, 0.05]]
)


def _speculate_chains(rows: int, length: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """``rows`` sequences of ``length`` tokens from token 0, each round drafting ``k`` tokens from
    DRAFT_CHAIN and verifying them against TARGET_CHAIN with ``accept_batch``. Returns the tokens
    and, per draft position, how often a round's first rejection fell there."""
    out = torch.full((rows, length + k + 1), -1)
    done = torch.zeros(rows, dtype=torch.long)
    last = torch.zeros(rows, dtype=torch.long)
    rejected_at = [0] * k
    r = torch.arange(rows)
    while bool((done < length).any()):
        prev, drafts, draft_probs = last, [], []
        for _ in range(k):
            p = DRAFT_CHAIN[prev]
            prev = torch.multinomial(p, 1, generator=gen)[:, 0]
            drafts.append(prev)
            draft_probs.append(p)
        x = torch.stack(drafts, 1)
        target = torch.stack([TARGET_CHAIN[last]] + [TARGET_CHAIN[x[:, j]] for j in range(k)], 1)
        num, dist = accept_batch(
            x,
            torch.full((rows,), k),
            torch.stack(draft_probs, 1),
            target,
            torch.rand((rows, k), generator=gen),
        )
        nxt = torch.multinomial(dist, 1, generator=gen)[:, 0]
        emitted = torch.cat([x, torch.zeros(rows, 1, dtype=torch.long)], 1)
        emitted[r, num] = nxt
        for j in range(k + 1):
            write = (j <= num) & (done + j < out.shape[1])
            out[r[write], (done + j)[write]] = emitted[r[write], j]
        active = done < length
        for j in range(k):
            rejected_at[j] += int(((num == j) & active).sum())
        done += num + 1
        last = nxt
    return out[:, :length], rejected_at


def test_accept_batch_keeps_the_targets_law_at_every_position() -> None:
    """Speculation with k = 3 and a draft that disagrees at every position: each emitted
    position's token, and the joint law of the first three, follow the target chain's exact law
    (powers of its matrix). Catches a residual taken at the wrong position (always position 0's
    draft law, say): the first emitted token - all the single-token test sees - stays right, but
    the token after a rejection at position 1 or 2 does not."""
    from scipy.stats import chisquare

    gen = torch.Generator().manual_seed(5)
    n, length, k = 20000, 6, 3
    tokens, rejected_at = _speculate_chains(n, length, k, gen)
    assert min(rejected_at) > n // 10, rejected_at  # rejections at every draft position
    law = torch.nn.functional.one_hot(torch.tensor(0), 4).double()
    chain = TARGET_CHAIN.double() / TARGET_CHAIN.double().sum(-1, keepdim=True)
    for t in range(length):
        law = law @ chain
        observed = torch.bincount(tokens[:, t], minlength=4).tolist()
        assert chisquare(observed, (law / law.sum() * n).tolist()).pvalue > 1e-3, (t, observed)
    # The joint law of positions 0..2 (64 cells): catches errors that keep every marginal.
    joint = chain[0][:, None, None] * chain[:, :, None] * chain[None, :, :]
    cells = tokens[:, 0] * 16 + tokens[:, 1] * 4 + tokens[:, 2]
    observed = torch.bincount(cells, minlength=64).tolist()
    assert chisquare(observed, (joint.flatten() / joint.sum() * n).tolist()).pvalue > 1e-3


def test_accept_batch_greedy_case_is_argmax_agreement() -> None:
    one_hot = lambda i: torch.nn.functional.one_hot(torch.tensor(i), 5).float()  # noqa: E731
    q = torch.stack([torch.stack([one_hot(2), one_hot(3), one_hot(1)])] * 2)
    p = torch.stack([torch.stack([one_hot(2), one_hot(4)]), torch.stack([one_hot(2), one_hot(3)])])
    num, dist = accept_batch(torch.tensor([[2, 4], [2, 3]]), torch.tensor([2, 2]), p, q, torch.zeros(2, 2))
    assert num.tolist() == [1, 2]  # row 0: second draft rejected; row 1: all accepted
    assert dist.argmax(-1).tolist() == [3, 1]  # the target's token instead / the bonus token


def test_accept_batch_honours_each_rows_own_draft_count() -> None:
    one_hot = lambda i: torch.nn.functional.one_hot(torch.tensor(i), 5).float()  # noqa: E731
    q = torch.stack([torch.stack([one_hot(1), one_hot(2), one_hot(3)])] * 2)
    p = torch.stack([torch.stack([one_hot(1), one_hot(2)])] * 2)
    num, dist = accept_batch(torch.tensor([[1, 2], [1, 2]]), torch.tensor([2, 1]), p, q, torch.zeros(2, 2))
    assert num.tolist() == [2, 1]
    assert dist.argmax(-1).tolist() == [3, 2]  # row 1 drafted one token: its bonus is position 1


async def test_sampled_output_follows_the_targets_exact_law(
    worker: DeviceWorker, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The second output token (the first decided by a speculative step) follows the target's law,
    computed independently with HF's model, while a *different* model drafts (many rejections)."""
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    from tests.fixtures import build_tiny_model

    other = build_tiny_model(tmp_path_factory.mktemp("tiny-other"), seed=7)
    eng = make_engine(worker, tiny_model_dir, draft_dir=other, speculative_tokens=2, name="spec-other")
    assert isinstance(eng, Engine)
    eng.spec.fixed_k = 2
    ids = prompts(1, seed=13)[0]
    params = SamplingParams(max_tokens=2, temperature=1.0, top_k=4, ignore_eos=True)
    counts: Counter[int] = Counter()
    drafted = accepted = 0
    n = 600
    for start in range(0, n, 50):
        outs = await asyncio.gather(*(collect(eng, ids, params) for _ in range(start, start + 50)))
        counts.update(o[0][1] for o in outs)
        drafted += sum(o[3].num_draft_tokens for o in outs)
        accepted += sum(o[3].num_accepted_tokens for o in outs)
    assert drafted > 0 and accepted < drafted  # drafting ran, and the residual path too
    # Exact law of token 2: sum over token 1 of P(t1) P(t2 | t1), top-4 at temperature 1.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():

        def top4(seq: list[int]) -> torch.Tensor:
            logits = model(torch.tensor([seq])).logits[0, -1]
            kth = torch.topk(logits, 4).values[-1]
            return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)

        first = top4(ids)
        law = torch.zeros_like(first)
        for t1 in torch.nonzero(first).flatten().tolist():
            law += first[t1] * top4([*ids, t1])
    support = torch.nonzero(law > 0).flatten().tolist()
    assert set(counts) <= set(support)
    observed = [counts[t] for t in support]
    expected = [float(law[t]) * n for t in support]
    scale = sum(observed) / sum(expected)
    assert chisquare(observed, [e * scale for e in expected]).pvalue > 1e-3, (observed, expected)


def test_controller_covers_batch_sizes_between_profiled_ones() -> None:
    """Profiled at 8 and 16 only, a batch of 12 must still get a cost estimate and turn
    speculation off where it does not pay (it used to count as unprofiled and always speculate)."""
    c = SpecController(max_k=4, acceptance=0.9)
    for b in (8, 16):
        c.record_target(b, 1, 0.010 * b)
        c.record_target(b, 5, 0.040 * b)
        c.record_draft(b, 1, 0.008 * b)
    assert c.expected_rate(4, 12) is not None
    assert c.choose_k(12) == 0


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
    ks = [c.choose_k(1) for _ in range(3)]
    assert ks[:2] == [0, 0] and ks[2] > 0
    # The exploration goes on until a drafting round reports (its first step may only catch the
    # idle draft up)...
    assert c.choose_k(1) > 0 and c.choose_k(1) > 0
    c.record_acceptance(2, 0)
    assert c.choose_k(1) == 0  # ...and then plain decoding is chosen again.
    # An exploration in which no row ever drafts ends after EXPLORE_STEPS steps.
    ks = [c.choose_k(1) for _ in range(1 + EXPLORE_STEPS + 1)]  # the 3rd plain step explores
    assert ks == [0] + [ks[1]] * EXPLORE_STEPS + [0] and ks[1] > 0
    # ...but not while the draft would first re-read a long backlog.
    assert all(c.choose_k(1, draft_lag=500) == 0 for _ in range(6))


def test_controller_never_explores_where_even_a_perfect_draft_loses() -> None:
    c = SpecController(max_k=2, acceptance=0.1, explore_every=1)
    c.record_target(16, 1, 0.05)
    c.record_target(16, 3, 0.2)
    c.record_draft(16, 1, 0.05)
    assert all(c.choose_k(16) == 0 for _ in range(10))


async def test_seeded_sampled_requests_do_not_speculate_and_repeat(spec: Engine) -> None:
    """The documented contract: a seed reproduces a sampled request's output on a speculating tier
    (whatever the load-dependent k); such requests run without drafting, greedy ones still draft."""
    ids = prompts(1, seed=14)[0]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=77, ignore_eos=True)
    spec.spec.fixed_k = 3
    try:
        alone = await collect(spec, ids, seeded)
        crowd = await asyncio.gather(
            collect(spec, ids, seeded), *(collect(spec, p, greedy(16)) for p in prompts(4, seed=15))
        )
    finally:
        spec.spec.fixed_k = None
    assert crowd[0][0] == alone[0]
    assert alone[3].num_draft_tokens == 0 and crowd[0][3].num_draft_tokens == 0
    assert sum(c[3].num_draft_tokens for c in crowd[1:]) > 0


async def test_a_draft_with_a_narrower_head_is_padded_and_lossless(
    worker: DeviceWorker, tiny_model_dir: Path, plain: Engine
) -> None:
    """Qwen2.5-1.5B drafts for 7B with 151,936 vs 152,064 logits: the engine pads the draft's
    logits and never proposes ids it cannot produce; greedy output is unchanged."""
    from tiers.core.sched.scheduler import SchedulerConfig
    from tiers.engine.llm_engine import Engine as _Engine
    from tiers.models.loading import load_model
    from tiers.worker.model_runner import ModelRunner

    def build() -> _Engine:
        target = load_model(str(tiny_model_dir), device="cpu")
        draft = load_model(str(tiny_model_dir), device="cpu")
        head = draft.model.lm_head
        narrow = torch.nn.Linear(head.in_features, head.out_features - 16, bias=False)
        with torch.no_grad():
            narrow.weight.copy_(target.model.lm_head.weight[: head.out_features - 16])
        draft.model.lm_head = narrow
        runner = ModelRunner(target, num_blocks=1024, block_size=4, max_model_len=256)
        eng = _Engine(
            "narrow",
            runner,
            SchedulerConfig(max_num_seqs=16, max_model_len=256),
            draft_runner=ModelRunner(draft, num_blocks=1024, block_size=4, max_model_len=256),
            speculative_tokens=3,
        )
        eng.warmup()
        return eng

    eng = worker.call(build)
    eng.attach(worker)
    eng.spec.fixed_k = 3
    ps = prompts(6, seed=16)
    got = await asyncio.gather(*(collect(eng, p, greedy(12)) for p in ps))
    want = await asyncio.gather(*(collect(plain, p, greedy(12)) for p in ps))
    assert [g[0] for g in got] == [w[0] for w in want]
    assert sum(g[3].num_draft_tokens for g in got) > 0


async def test_draft_prefill_is_deferred_past_the_first_token(plain: Engine, spec: Engine) -> None:
    # The step that gives a prompt its first token runs the target alone (TTFT never pays for the
    # draft's prefill); the draft catches up in the first decode step and drafts after that.
    assert spec.draft is not None
    events: list[tuple[str, list[int]]] = []
    real_forward = spec.draft.forward

    def counting(rows: list) -> list:  # type: ignore[type-arg]
        events.append(("draft", [len(r.token_ids) for r in rows]))
        return real_forward(rows)

    ps = prompts(3, seed=21)
    want = [await collect(plain, p, greedy(16)) for p in ps]
    spec.spec.fixed_k = 3
    spec.draft.forward = counting  # type: ignore[method-assign]
    spec.step_hook = lambda batch: events.append(("step", list(batch.num_new_tokens)))
    deferred = spec.num_deferred_draft_feeds
    try:
        got = []
        for p in ps:
            events.clear()
            got.append(await collect(spec, p, greedy(16)))
            steps = [i for i, e in enumerate(events) if e[0] == "step"]
            assert events[steps[0]][1] == [len(p)]  # the prompt in one chunk (tiny prompts, no prefix hit)
            assert steps[1] == steps[0] + 1  # ...and no draft forward in that step
            assert any(n == len(p) for n in events[steps[1] + 1][1])  # the draft's prefill: in the next
    finally:
        spec.draft.forward = real_forward  # type: ignore[method-assign]
        spec.step_hook = None
        spec.spec.fixed_k = None
    assert spec.num_deferred_draft_feeds >= deferred + 3
    assert [g[0] for g in got] == [w[0] for w in want]
    assert all(g[3].num_draft_tokens > 0 and g[3].num_accepted_tokens > 0 for g in got)


# -- n-gram lookup drafting (``draft: ngram``) ------------------------------------------------


def _latest_match(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The reference lookup, by brute force: longest n first, latest earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_proposer_matches_a_brute_force_scan() -> None:
    """The incremental index against a full rescan at every length, across rollbacks (a failed
    step drops tokens, and the engine forgets the index) and a small alphabet, so matches of every
    n occur."""
    import random

    from tiers.spec_decode.ngram import NgramProposer

    rng = random.Random(3)
    ngram = NgramProposer(16, 4, min_n=1, max_n=3)
    proposed = 0
    for seq_id in range(20):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 8))]
        for _ in range(60):
            k = rng.randrange(0, 5)
            got = ngram.propose(seq_id, tokens, k)
            assert got == _latest_match(tokens, k, 1, 3), (tokens, k)
            proposed += bool(got)
            if rng.random() < 0.1 and len(tokens) > 3:
                del tokens[-rng.randrange(1, 3) :]
                ngram.forget(seq_id)  # what the engine does when it rolls a failed step back
            else:
                tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        ngram.forget(seq_id)
    assert proposed > 100


@pytest.fixture(scope="module")
def ngram_engine(worker: DeviceWorker, tiny_model_dir: Path) -> Engine:
    eng = make_engine(worker, tiny_model_dir, ngram=True, speculative_tokens=4, name="ngram")
    assert isinstance(eng, Engine)
    return eng


async def test_greedy_with_ngram_drafts_equals_hfs_greedy_decoding(
    ngram_engine: Engine, tiny_model_dir: Path
) -> None:
    """Greedy output with n-gram drafts (k pinned, so every lookup that matches is verified), in one
    batch of mixed lengths, is token for token plain greedy decoding with HF's model; drafts were proposed
    and some accepted and some rejected (the tiny model's greedy output falls into loops now and
    then), so both paths of the verification ran."""
    from transformers import AutoModelForCausalLM

    ps = prompts(16, seed=5)
    lengths = [24 + 4 * (i % 5) for i in range(16)]
    ngram_engine.spec.fixed_k = 4
    try:
        got = await asyncio.gather(
            *(collect(ngram_engine, p, greedy(n)) for p, n in zip(ps, lengths, strict=True))
        )
    finally:
        ngram_engine.spec.fixed_k = None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for p, n, g in zip(ps, lengths, got, strict=True):
        seq = list(p)
        with torch.no_grad():  # plain greedy decoding, EOS a token like any other (ignore_eos)
            for _ in range(n):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert g[0] == seq[len(p) :]
    drafted = sum(g[3].num_draft_tokens for g in got)
    accepted = sum(g[3].num_accepted_tokens for g in got)
    assert 0 < accepted < drafted


async def test_sampled_output_with_ngram_drafts_follows_the_targets_exact_law(
    ngram_engine: Engine, tiny_model_dir: Path
) -> None:
    """A sampled row verifies a lookup's proposal with a one-hot draft law: the second output token
    (decided by a speculative step whenever the first one continues the prompt's repeated phrase)
    follows the target's law, computed independently with HF's model."""
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    def top4(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1]
        kth = torch.topk(logits, 4).values[-1]
        return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)

    # A prompt that starts with (its last token, a likely next token t, a likely token w after t):
    # whenever the first output token is t, the lookup proposes w, which the target sometimes takes.
    def likely(ids: list[int]) -> bool:
        return float(top4(ids)[ids[1]]) > 0.1 and 0.05 < float(top4([*ids, ids[1]])[ids[2]]) < 0.95

    ids: list[int] = []
    for seed in range(17, 57):
        base = prompts(1, seed=seed)[0]
        ids = base
        for _ in range(6):
            t = int(top4(ids).argmax())
            ids = [base[-1], t, int(top4([*ids, t]).argmax()), *base]
            if likely(ids):
                break
        if likely(ids):
            break
    assert likely(ids)
    first = top4(ids)
    law = torch.zeros_like(first)
    for t1 in torch.nonzero(first).flatten().tolist():
        law += first[t1] * top4([*ids, t1])
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)  # 2 left: k = 1
    counts: Counter[int] = Counter()
    drafted = accepted = 0
    n = 600
    ngram_engine.spec.fixed_k = 2
    try:
        for start in range(0, n, 50):
            outs = await asyncio.gather(
                *(collect(ngram_engine, ids, params) for _ in range(start, start + 50))
            )
            counts.update(o[0][1] for o in outs)
            drafted += sum(o[3].num_draft_tokens for o in outs)
            accepted += sum(o[3].num_accepted_tokens for o in outs)
    finally:
        ngram_engine.spec.fixed_k = None
    assert drafted > 0 and 0 < accepted < drafted  # lookups ran, accepted and rejected
    support = torch.nonzero(law > 0).flatten().tolist()
    assert set(counts) <= set(support)
    observed = [counts[t] for t in support]
    expected = [float(law[t]) * n for t in support]
    scale = sum(observed) / sum(expected)
    assert chisquare(observed, [e * scale for e in expected]).pvalue > 1e-3, (observed, expected)


def test_ngram_drafting_turns_itself_off_where_verifying_does_not_pay(ngram_engine: Engine) -> None:
    """The controller prices a lookup's proposal by the target's measured cost over k + 1 tokens
    (profiled at warm-up for every k): with a cost linear in tokens (a compute-bound batch) no k
    pays even at 80% acceptance; with the extra tokens nearly free at batch 1, it drafts."""
    c = SpecController(max_k=4, acceptance=0.8)
    for t in range(1, 6):
        c.record_target(16, t, 0.040 * t)
        c.record_target(1, t, 0.012 + 0.001 * (t - 1))
        c.record_draft(16, 1, 1e-5)
        c.record_draft(1, 1, 1e-6)
    assert c.choose_k(16) == 0
    assert c.choose_k(1) > 0
    assert ngram_engine.spec.target_cost.keys() >= {(1, t) for t in range(1, 6)}


async def test_the_draft_is_not_fed_while_speculation_does_not_pay(plain: Engine, spec: Engine) -> None:
    """With speculation off (k pinned to 0) a long prompt's chunks never reach the draft (it
    used to prefill every prompt it would never draft for); once speculation is back on, the
    draft catches up on those tokens and drafts, and the output is still plain greedy's."""
    import random

    draft = spec.draft
    assert draft is not None and not isinstance(draft, NgramProposer)
    fed: list[int] = []
    real_forward = draft.forward

    def counting(rows: list) -> list:  # type: ignore[type-arg]
        fed.append(sum(len(r.token_ids) for r in rows))
        return real_forward(rows)

    rng = random.Random(31)
    ids = [rng.randrange(3, 380) for _ in range(200)]  # two chunks of the 128-token budget
    want = await collect(plain, ids, greedy(24))
    draft.forward = counting  # type: ignore[method-assign]
    try:
        spec.spec.fixed_k = 0
        off = await collect(spec, ids, greedy(24))
        assert fed == [] and off[3].num_draft_tokens == 0
        assert off[0] == want[0]
        spec.spec.fixed_k = 3
        on = await collect(spec, [*ids[:150], 7, *ids[150:]], greedy(24))
        on_plain = await collect(plain, [*ids[:150], 7, *ids[150:]], greedy(24))
    finally:
        draft.forward = real_forward  # type: ignore[method-assign]
        spec.spec.fixed_k = None
    assert sum(fed) >= 200 and on[3].num_draft_tokens > 0 and on[3].num_accepted_tokens > 0
    assert on[0] == on_plain[0]


async def test_the_controller_sees_the_drafts_backlog(
    spec: Engine, ngram_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine tells the controller how far the draft is behind (``choose_k``'s ``draft_lag``,
    and ``draft_backlog`` for all rows together): a model draft is not fed while k is 0, so every
    plain step adds a token it must first read, and a new prompt's draft has read nothing. Behind
    such a backlog the controller resumes only on a clear margin and explores only now and then.
    Catches the engine passing the default lag of 1 (it did: with speculation off, the medium tier
    explored every 64 steps with its draft behind by the whole context, each exploration a
    catch-up forward of that length on the small model, and from outside ran at 0.6-0.7x its
    plain speed). An n-gram lookup has nothing to read."""
    ids = prompts(1, seed=21)[0][:40]
    lags: list[int] = []
    backlogs: list[int | None] = []

    def pinned(
        _self: SpecController,
        batch_size: int,
        draft_lag: int = 1,
        acceptance: float | None = None,
        draft_backlog: int | None = None,
    ) -> int:
        lags.append(draft_lag)
        backlogs.append(draft_backlog)
        return 0

    monkeypatch.setattr(SpecController, "choose_k", pinned)
    await collect(spec, ids, greedy(12))
    model_lags, lags[:] = list(lags), []
    await collect(ngram_engine, ids, greedy(12))
    monkeypatch.undo()
    assert model_lags[0] == len(ids)  # the waiting prompt: none of it read by the draft
    assert model_lags[-1] >= len(ids) + 10 and model_lags == sorted(model_lags)
    assert backlogs[: len(model_lags)] == model_lags  # one row: all rows' backlog is its lag
    assert set(lags) == {1} and set(backlogs[len(model_lags) :]) == {0}


def test_a_k_not_in_use_is_priced_against_the_plain_steps_current_cost() -> None:
    """Profiled at a short context, a 2-token step cost 2x a plain one and speculation did not
    pay. Contexts grow, plain steps (the only ones run) measure 2x more: the 2-token step, never
    re-measured, is priced at its ratio to today's plain step (it used to keep its old absolute
    time, which made speculation look 1.7x faster than plain and switched it on)."""
    c = SpecController(max_k=1, acceptance=0.9)
    c.record_target(16, 1, 0.050)
    c.record_target(16, 2, 0.100)
    c.record_draft(16, 1, 0.010)
    assert c.choose_k(16) == 0
    for _ in range(100):
        c.record_target(16, 1, 0.100)
    assert c.target_cost[(16, 2)] == pytest.approx(0.100)  # the stale absolute figure
    rate = c.expected_rate(1, 16)
    assert rate is not None and rate == pytest.approx(1.9 / (0.200 + 0.020), rel=1e-3)
    assert all(c.choose_k(16) == 0 for _ in range(10))


async def test_a_prompt_served_to_the_token_still_gets_its_first_token_without_the_draft(
    worker: DeviceWorker, tiny_model_dir: Path, plain: Engine
) -> None:
    """A repeated prompt's last chunk is one token (the prefix cache serves the rest): that step
    too runs the target alone. Catches the deferral keyed on chunks of several tokens only (the
    draft's catch-up then lands in the time to first token)."""
    eng = make_engine(
        worker,
        tiny_model_dir,
        draft_quantization="int8",
        speculative_tokens=4,
        prefix_caching=True,
        name="spec-ptt",
    )
    assert isinstance(eng, Engine) and eng.draft is not None
    p = prompts(1, seed=23)[0] * 2
    first = await collect(eng, p, greedy(12))
    events: list[tuple[str, list[int]]] = []
    real_forward = eng.draft.forward

    def counting(rows: list) -> list:  # type: ignore[type-arg]
        events.append(("draft", [len(r.token_ids) for r in rows]))
        return real_forward(rows)

    eng.spec.fixed_k = 3
    eng.draft.forward = counting  # type: ignore[method-assign]
    eng.step_hook = lambda batch: events.append(("step", list(batch.num_new_tokens)))
    deferred = eng.num_deferred_draft_feeds
    try:
        again = await collect(eng, p, greedy(12))
    finally:
        eng.draft.forward = real_forward  # type: ignore[method-assign]
        eng.step_hook = None
        eng.spec.fixed_k = None
    assert again[3].num_cached_tokens == len(p) - 1
    steps = [i for i, e in enumerate(events) if e[0] == "step"]
    assert events[steps[0]][1] == [1] and steps[1] == steps[0] + 1  # the target alone
    assert eng.num_deferred_draft_feeds == deferred + 1
    assert again[0] == first[0] == (await collect(plain, p, greedy(12)))[0]
    assert again[3].num_draft_tokens > 0
