"""Proposers (``tiers/spec_decode/proposers.py``): what a proposal leaves behind when its step fails, and
what it
reports instead of writing sequences."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.fixtures import make_engine
from tests.tiers.engine.test_llm_engine import AllowList, collect, greedy, prompts
from tiers.core.sched.batch import ScheduledBatch
from tiers.core.sequence import SamplingParams, Sequence
from tiers.engine.llm_engine import Engine
from tiers.sample.sampler import Draft
from tiers.spec_decode.controller import SpecController
from tiers.spec_decode.ngram import NgramProposer
from tiers.spec_decode.proposers import NgramDraft
from tiers.worker.device import DeviceWorker
from tiers.worker.model_runner import RowInput


async def test_a_step_failing_after_drafting_rolls_the_grammar_back_and_the_retry_answers_the_same(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    """The draft advances a constrained row's matcher over its proposals before the target runs;
    when the target's forward then raises, the step is undone and each row retried alone
    (``isolation.py``). Catches the proposer not undoing those grammar steps (``forget``): the
    matcher would stay ahead by the drafts and the retried answer would end early and differ.
    Reference: the same two requests on the same engine without the fault."""
    eng = make_engine(worker, tiny_model_dir, draft_quantization="int8", speculative_tokens=3, name="faulty")
    assert isinstance(eng, Engine)
    ids, other = prompts(2, seed=34)
    real_forward = eng.runner.forward
    faults = [0]

    def failing_once(rows: list[RowInput]) -> Any:
        if not faults[0] and any(r.logits == "all" for r in rows):  # a step verifying drafts
            faults[0] += 1
            raise RuntimeError("injected fault after drafting")
        return real_forward(rows)

    async def both(c: AllowList) -> tuple[Any, Any]:
        params = SamplingParams(max_tokens=50, temperature=0.0, constraint=c)
        return await asyncio.gather(collect(eng, ids, params), collect(eng, other, greedy(12)))

    eng.spec.fixed_k = 3
    try:
        ref_c = AllowList([40, 41, 42, 43], length=9)
        ref, ref_other = await both(ref_c)
        c = AllowList([40, 41, 42, 43], length=9)
        eng.runner.forward = failing_once  # type: ignore[method-assign]
        got, got_other = await both(c)
    finally:
        eng.runner.forward = real_forward  # type: ignore[method-assign]
        eng.spec.fixed_k = None
    assert faults[0] == 1  # the fault fired, in a step whose drafts had advanced the matcher
    assert ref[2] == got[2] == "stop" and ref[3].num_draft_tokens > 0
    assert got[0] == ref[0] == c.accepted == ref_c.accepted and len(got[0]) == 9
    assert c.rollbacks > 0  # the undo went through the matcher
    assert got_other[0] == ref_other[0]


def test_an_ngram_proposal_reports_its_feed_and_writes_no_sequence() -> None:
    """Catches a proposer writing sequence state (the scheduler is its one writer): after
    ``propose`` every row's computed counts are as they were, ``fed`` says how far each row's draft
    position must move (to its tokens: a lookup has no KV), only rows given speculative tokens
    propose, constrained rows never do, and a sampled row's proposal carries a one-hot law."""
    ngram = NgramProposer(64, 4)
    draft = NgramDraft(ngram, SpecController(max_k=3), vocab_size=16)
    history = [1, 2, 3, 4, 1, 2, 3]  # "1 2 3" was followed by 4: the lookup proposes 4, 1, 2
    seqs = [Sequence(list(history), SamplingParams(max_tokens=20, temperature=t)) for t in (0.0, 0.0, 1.0)]
    seqs.append(Sequence(list(history), SamplingParams(max_tokens=20, constraint=AllowList([4], 9))))
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
        s.num_draft_computed_tokens = 2
    batch = ScheduledBatch(seqs, [1] * 4, [3, 0, 3, 3], [0] * 4)
    before = [(s.num_computed_tokens, s.num_draft_computed_tokens, list(s.token_ids)) for s in seqs]
    proposal = draft.propose(batch, 3)
    assert [(s.num_computed_tokens, s.num_draft_computed_tokens, s.token_ids) for s in seqs] == before
    assert proposal.fed == [len(history) - 2] * 4
    drafts = proposal.drafts
    assert isinstance(drafts[0], Draft) and drafts[0].tokens == [4, 1, 2] and not drafts[0].probs
    assert drafts[1] is None and drafts[3] is None  # no speculative tokens; a grammar
    assert isinstance(drafts[2], Draft) and drafts[2].tokens == [4, 1, 2]
    assert [int(p.argmax()) for p in drafts[2].probs] == [4, 1, 2]
    assert all(float(p.sum()) == 1.0 for p in drafts[2].probs)


def test_an_ngram_row_drafts_only_as_far_as_its_own_record_pays() -> None:
    """Catches per-row pricing not applied in ``propose`` (or applied to rows without a record):
    three rows with the same lookup and the same budget; the one whose drafts kept failing
    proposes nothing, the one whose drafts were all accepted proposes the best k for its record,
    a new row proposes what the step allows. The engine's k is priced at the best row."""
    spec = SpecController(max_k=3, acceptance=0.5)
    for tokens, ms in ((1, 20), (2, 29), (3, 32), (4, 45)):
        spec.record_target(1, tokens, ms / 1000)
    spec.record_draft(1, 1, 0.0)
    draft = NgramDraft(NgramProposer(64, 4), spec, vocab_size=16)
    history = [1, 2, 3, 4, 1, 2, 3]
    seqs = [Sequence(list(history), SamplingParams(max_tokens=20)) for _ in range(3)]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    seqs[0].num_draft_tokens, seqs[0].num_accepted_tokens = 12, 0
    seqs[1].num_draft_tokens, seqs[1].num_accepted_tokens = 12, 12
    batch = ScheduledBatch(seqs, [1] * 3, [3] * 3, [0] * 3)
    drafts = draft.propose(batch, 3).drafts
    assert drafts[0] is None
    best = spec.row_k(3, 3, spec.row_acceptance(12, 12))
    assert best > 0 and drafts[1] is not None and drafts[1].tokens == [4, 1, 2][:best]
    assert drafts[2] is not None and drafts[2].tokens == [4, 1, 2]
    assert draft.acceptance(seqs) == spec.row_acceptance(12, 12)
    assert draft.acceptance([]) is None
