"""Decode first (tiers/core/sched/scheduler.py given the engine's ``Pace``, and
tiers/core/sched/pacing.py's ``prefill_cap``): beside running decodes, the prompt chunks of a step
- running prompts and newly admitted ones together - feed at most the cap, while every decode
keeps its token; with no decode running a prompt takes the budget as before; the cap follows the
measured costs as worked by hand, ``(slowdown - 1) x decode step / token cost``."""

from __future__ import annotations

import pytest

from tiers.core.block_manager import BlockManager
from tiers.core.sched.batch import SchedulerConfig
from tiers.core.sched.pacing import MIN_PREFILL_CHUNK, Pace, prefill_cap
from tiers.core.sched.scheduler import ScheduledBatch, Scheduler
from tiers.core.sequence import SamplingParams, Sequence


def _seq(n: int, start: int) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=64))


def _run(sched: Scheduler, batch: ScheduledBatch) -> None:
    for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
        sched.cache_blocks(s)


def _scheduler(cap: int | None, budget: int = 256) -> Scheduler:
    """Costs measured so that ``prefill_cap`` is ``cap``: a 40 ms decode step, slowdown 2, and a
    prompt token costing 40 ms / cap; ``cap=None``: no slowdown bound."""
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=budget, max_decode_slowdown=None if cap is None else 2.0
    )
    pace = Pace(max_num_seqs=8, budget_tokens=budget)
    pace.seed(token_cost=0.040 / (cap or 1), decode_cost=0.040)
    sched = Scheduler(config, BlockManager(512, 4), pace=pace)
    assert cap is None or prefill_cap(pace, 2.0) == cap
    return sched


def _decoding(sched: Scheduler, count: int) -> list[Sequence]:
    seqs = [_seq(3, 1000 + 10 * i) for i in range(count)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch is not None
    _run(sched, batch)
    assert all(s.is_decoding for s in seqs)
    return seqs


def test_beside_decodes_a_prompt_feeds_at_most_the_cap_per_step_until_done() -> None:
    """Bug it catches: the cap not applied (a 200-token prompt fed in one step, every running
    stream's next token waiting behind it) or applied to the decodes' own tokens."""
    sched = _scheduler(cap=40)
    decodes = _decoding(sched, 2)
    prompt = _seq(200, 1)
    sched.add(prompt)
    chunks = []
    while not prompt.is_decoding:
        batch = sched.schedule()
        assert batch is not None
        rows = dict(zip((s.seq_id for s in batch.seqs), batch.num_new_tokens, strict=True))
        assert all(rows[d.seq_id] == 1 for d in decodes)
        chunks.append(rows.get(prompt.seq_id, 0))
        _run(sched, batch)
    assert chunks == [40, 40, 40, 40, 40]


def test_the_cap_bounds_every_prompt_of_the_step_together() -> None:
    """Bug it catches: each prompt capped on its own - two prompts beside the decodes feed twice
    the cap, and the step costs what the cap was meant to prevent."""
    sched = _scheduler(cap=40)
    _decoding(sched, 1)
    first, second = _seq(30, 1), _seq(30, 500)
    sched.add(first)
    sched.add(second)
    batch = sched.schedule()
    assert batch is not None
    fed = dict(zip((s.seq_id for s in batch.seqs), batch.num_new_tokens, strict=True))
    assert fed[first.seq_id] == 30 and fed[second.seq_id] == 10
    assert sum(batch.num_new_tokens) == 1 + 40
    _run(sched, batch)
    nxt = sched.schedule()
    assert nxt is not None
    fed = dict(zip((s.seq_id for s in nxt.seqs), nxt.num_new_tokens, strict=True))
    assert fed[second.seq_id] == 20  # the running prompt continues within the cap


def test_a_spent_cap_admits_no_new_prompt_but_the_decodes_run() -> None:
    sched = _scheduler(cap=16)
    decodes = _decoding(sched, 3)
    long, late = _seq(100, 1), _seq(8, 500)
    sched.add(long)
    sched.add(late)
    batch = sched.schedule()
    assert batch is not None
    assert batch.seqs == [*decodes, long] and batch.num_new_tokens == [1, 1, 1, 16]
    assert late in sched.waiting


def test_without_decodes_a_prompt_takes_the_budget() -> None:
    """The cap protects running streams; with none, a prompt computes at full speed."""
    sched = _scheduler(cap=16)
    prompt = _seq(100, 1)
    sched.add(prompt)
    batch = sched.schedule()
    assert batch is not None and batch.num_new_tokens == [100]


def test_no_cap_keeps_the_half_budget_rule() -> None:
    sched = _scheduler(cap=None, budget=64)
    _decoding(sched, 1)
    prompt = _seq(100, 1)
    sched.add(prompt)
    batch = sched.schedule()
    assert batch is not None and batch.num_new_tokens == [1, 32]


def test_the_cap_from_measured_costs() -> None:
    """A decode step of 40 ms, 2 ms a prompt token: slowdown 2.5 leaves 1.5 x 40 ms = 60 ms for a
    chunk, 30 tokens. Bugs it catches: ``slowdown`` for ``slowdown - 1`` (the step then costs a
    decode step more than allowed), the inverse ratio, no floor."""
    pace = Pace(max_num_seqs=8, budget_tokens=512)
    assert prefill_cap(pace, 2.5) is None  # nothing measured yet
    pace.seed(token_cost=0.002, decode_cost=0.040)
    assert prefill_cap(pace, 2.5) == 30
    assert prefill_cap(pace, 3.0) == 40
    assert prefill_cap(pace, None) is None
    assert prefill_cap(pace, 1.01) == MIN_PREFILL_CHUNK


def test_only_steps_of_decodes_alone_move_the_decode_step() -> None:
    """Bug it catches: mixed steps (decodes plus a capped chunk) counted as decode steps - the
    measured decode step grows with the chunk, the cap with it, and the cap runs away."""
    pace = Pace(max_num_seqs=8, budget_tokens=512)
    pace.seed(token_cost=0.002, decode_cost=0.040)
    for _ in range(50):
        pace.on_step(1.0, 0.100, 31, 2, True, "mixed")  # decodes + a 30-token chunk
    assert pace.decode_step == pytest.approx(0.040)
    for _ in range(50):
        pace.on_step(1.0, 0.020, 2, 2, True, "decode")
    assert pace.decode_step == pytest.approx(0.020, rel=0.02)
    assert prefill_cap(pace, 2.5) == MIN_PREFILL_CHUNK  # 1.5 x 20 ms / 2 ms = 15, under the floor


def test_the_slowdown_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="max_decode_slowdown"):
        SchedulerConfig(max_decode_slowdown=1.0)
    assert SchedulerConfig(max_decode_slowdown=None).max_decode_slowdown is None
    assert SchedulerConfig(max_decode_slowdown=1.5).max_decode_slowdown == 1.5


def test_decodes_on_another_engine_cap_this_engines_prompt_too() -> None:
    """Bug it catches: the cap applied only beside this engine's own decodes - a tier with no
    stream of its own runs a whole prompt in one step while another tier's streams wait."""
    sched = _scheduler(cap=40)
    prompt = _seq(100, 1)
    sched.add(prompt)
    batch = sched.schedule(decodes_elsewhere=True)
    assert batch is not None and batch.num_new_tokens == [40]
    _run(sched, batch)
    alone = sched.schedule()
    assert alone is not None and alone.num_new_tokens == [60]  # nobody decodes: the rest at once
