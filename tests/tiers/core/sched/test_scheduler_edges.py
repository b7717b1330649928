"""The scheduler's counters and boundaries, each at the exact value where a one-character slip
(``+=`` for ``=``, ``>`` for ``>=``, ``- 2`` for ``- 1``, a dropped salt) changes the outcome.
Model-free: the scheduler and the block manager are torch-free. Each expected value is worked out
by hand from the rule in ``tiers/core/sched/scheduler.py``'s docstrings, not read back from the code."""

from __future__ import annotations

import pytest

from tiers.core.block_manager import BlockManager
from tiers.core.sched.batch import ModelOutput, RowOutput, ScheduledBatch, SchedulerConfig
from tiers.core.sched.pacing import queue_backlog
from tiers.core.sched.scheduler import Scheduler
from tiers.core.sequence import SamplingParams, Sequence, SequenceStatus


def seq(n: int, start: int = 1, **kw: object) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=64), **kw)  # type: ignore[arg-type]


def make(num_blocks: int = 64, block_size: int = 4, **cfg: int) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size))


def run(sched: Scheduler, batch: ScheduledBatch | None, sampled: int = 7) -> ScheduledBatch:
    """What the engine does after a forward: advance, name blocks, append a token where one is due."""
    assert batch is not None
    for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(sampled)
        sched.cache_blocks(s)
    return batch


class Sink:
    def __init__(self) -> None:
        self.delivered: list[list[int]] = []

    def on_accept(self, seq: Sequence, num_accepted: int) -> None:
        pass

    def deliver(self, seq: Sequence, tokens: list[int], logprobs: object) -> None:
        self.delivered.append(list(tokens))

    def fail(self, seq: Sequence, message: str) -> None:
        raise AssertionError(message)


# -- update_from_output: counters that start at 0 ----------------------------------------------


def test_draft_and_acceptance_counts_add_up_over_two_steps() -> None:
    """Catches ``+=`` -> ``=`` on ``num_draft_tokens`` / ``num_accepted_tokens`` (one step from 0
    cannot tell them apart) and on the returned totals: two drafting steps of one sequence must sum
    to the reference (3 + 2 drafted, 2 + 0 accepted), and two drafting rows in one step too."""
    sched = Scheduler(SchedulerConfig(), BlockManager(32, 4), BlockManager(32, 4))
    a, b = seq(5), seq(5, start=20)
    for s in (a, b):
        s.status = SequenceStatus.RUNNING
        sched.running.append(s)
        assert sched.blocks.allocate(s.block_table, 16)
        s.num_computed_tokens = s.num_draft_computed_tokens = 4
    steps = [  # (a's drafted, accepted), (b's drafted, accepted)
        ((3, 2), (2, 1)),
        ((2, 0), (4, 4)),
    ]
    want_totals = [(5, 3), (6, 4)]
    ref = {a.seq_id: [0, 0], b.seq_id: [0, 0]}
    for ((da, ma), (db, mb)), totals in zip(steps, want_totals, strict=True):
        batch = ScheduledBatch([a, b], [1, 1], [da, db], [0, 0])
        out = ModelOutput(
            rows=[
                RowOutput(list(range(100, 101 + ma)), num_drafted=da, num_accepted=ma),
                RowOutput(list(range(200, 201 + mb)), num_drafted=db, num_accepted=mb),
            ],
            draft_fed=[0, 0],
        )
        sink = Sink()
        assert sched.update_from_output(batch, out, sink) == totals
        for s, (d, m) in ((a, (da, ma)), (b, (db, mb))):
            ref[s.seq_id][0] += d
            ref[s.seq_id][1] += m
            assert [s.num_draft_tokens, s.num_accepted_tokens] == ref[s.seq_id]
        for s, toks in zip((a, b), sink.delivered, strict=True):
            sched.append_tokens(s, toks)
    assert ref == {a.seq_id: [5, 2], b.seq_id: [6, 5]}


def test_the_draft_position_adds_what_it_was_fed_on_every_step() -> None:
    """Catches ``num_draft_computed_tokens += fed`` -> ``=``: a draft fed 3 then 2 tokens of a
    prompt chunk from 0 stands at 5, not at the last step's 2."""
    sched = Scheduler(SchedulerConfig(), BlockManager(32, 4), BlockManager(32, 4))
    s = seq(12)
    s.status = SequenceStatus.RUNNING
    sched.running.append(s)
    assert sched.blocks.allocate(s.block_table, 12)
    assert sched.draft_blocks is not None and sched.draft_blocks.allocate(s.draft_table, 12)
    for fed, want in ((3, 3), (2, 5)):
        batch = ScheduledBatch([s], [fed], [0], [fed])
        sched.update_from_output(batch, ModelOutput(rows=[None], draft_fed=[fed]), Sink())
        assert (s.num_computed_tokens, s.num_draft_computed_tokens) == (want, want)


# -- _preempt: counters ------------------------------------------------------------------------


def test_preemptions_are_counted_per_sequence_and_per_scheduler_each_time() -> None:
    """Catches ``num_preemptions += 1`` -> ``= 1`` (or ``+= 2``) on the sequence or the scheduler:
    a sequence preempted, readmitted and preempted again has been preempted twice, and the
    scheduler counts every preemption of every sequence (3 here)."""
    sched = make()
    a, b = seq(6), seq(6, start=40)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())
    counted = 0
    for victim in (a, b, a):
        batch = ScheduledBatch([], [], [], [])
        sched._preempt(victim, batch)
        counted += 1
        assert batch.preempted == [victim] and victim.status == SequenceStatus.WAITING
        assert victim.num_computed_tokens == 0 and sched.waiting[0] is victim
        readmit = run(sched, sched.schedule())
        assert victim in readmit.admitted
    assert (a.num_preemptions, b.num_preemptions) == (2, 1)
    assert sched.num_preemptions == counted == 3


def test_a_recompute_after_preemption_keeps_the_first_admissions_cache_hit() -> None:
    """``num_cached_tokens`` is the prefix-cache hit of the request as it arrived; catches the
    guard ``num_preemptions == 0`` turned around (``!= 0`` / ``== 1``), which would overwrite it
    with the recompute's hit on the sequence's own freed blocks."""
    sched = make()
    first = seq(9)
    sched.add(first)
    run(sched, sched.schedule())
    sched.finish(first, SequenceStatus.FINISHED_STOPPED, "stop")
    again = seq(13)  # shares the first 8 tokens (2 named blocks of 4)
    sched.add(again)
    run(sched, sched.schedule())
    assert again.num_cached_tokens == 8 and again.num_tokens == 14
    sched._preempt(again, ScheduledBatch([], [], [], []))
    batch = run(sched, sched.schedule())
    assert again in batch.admitted and again.num_computed_tokens > 8  # the recompute hit more
    assert again.num_cached_tokens == 8


# -- _chunk: the half-budget cap ---------------------------------------------------------------


def test_a_contended_prompt_chunk_is_capped_at_half_the_budget_exactly() -> None:
    """Catches the cap's divisor or floor changed (``// 3``, ``max(2, ...)``) and the cap skipped
    for a 2-token remainder (``n > 2``): with a budget of 8 a contended prompt feeds 4, and with a
    budget of 3 a 2-token prompt beside a decode feeds 1 (3 // 2), not 2."""
    sched = make(max_num_batched_tokens=8, max_num_seqs=4)
    a = seq(3)
    sched.add(a)
    run(sched, sched.schedule())
    long = seq(20, start=100)
    sched.add(long)
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [a, long] and batch.num_new_tokens == [1, 4]

    sched = make(max_num_batched_tokens=3, max_num_seqs=2)
    a = seq(3)
    sched.add(a)
    run(sched, sched.schedule())
    two = seq(2, start=100)
    sched.add(two)
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [a, two] and batch.num_new_tokens == [1, 1]
    run(sched, batch)
    batch = sched.schedule()
    assert batch is not None and batch.num_new_tokens == [1, 1]  # its second prompt token
    assert two.num_computed_tokens == 1


# -- _may_fork / the fork's blocks -----------------------------------------------------------


def test_a_branch_forks_once_its_leader_has_all_but_the_last_prompt_token() -> None:
    """The leader's progress at exactly ``prompt - 1`` is enough (the last token is computed by
    every branch); ``prompt - 2`` is not. Catches ``>=`` -> ``>`` (the branch waits a step longer)
    and ``- 1`` -> ``- 2`` (it forks one token early). A 10-token leader fed in halves of the
    budget while its branch waits: 16 -> 8 (branch waits), 18 -> 9 (branch joins next step)."""
    for budget, first_chunk, joins in ((16, 8, False), (18, 9, True)):
        sched = make(max_num_batched_tokens=budget, max_num_seqs=4)
        leader = seq(10)
        branch = seq(10, fork_of=leader)
        sched.add(leader)
        sched.add(branch)
        batch = sched.schedule()
        assert batch is not None and batch.seqs == [leader] and batch.num_new_tokens == [first_chunk]
        run(sched, batch)
        assert leader.num_computed_tokens == first_chunk
        batch = sched.schedule()
        assert batch is not None
        assert (branch in batch.seqs) is joins
        if joins:
            assert branch.block_table.blocks[:2] == leader.block_table.blocks[:2]
            assert branch.num_computed_tokens == 8 and branch.fork_of is None


def test_a_branch_shares_every_full_block_up_to_its_own_last_token() -> None:
    """Blocks of 4, the leader's prompt fully computed. 13 tokens: the branch may share the blocks
    of its first 12 (3 blocks) and feeds 1; 16 tokens: the blocks of its first 15 (3 blocks, the
    4th would hold its last token) and feeds 4. Catches the fork length taken as
    ``num_tokens - 2`` (13: 2 blocks shared, 5 fed) or ``num_tokens`` / ``+ 1`` (16: all 4 blocks
    shared, nothing left to feed, the branch never admitted)."""
    for n, shared, fed in ((13, 3, 1), (16, 3, 4)):
        sched = make(max_num_batched_tokens=64)
        leader = seq(n)
        sched.add(leader)
        run(sched, sched.schedule())
        assert leader.num_computed_tokens == n
        branch = seq(n, fork_of=leader)
        sched.add(branch)
        batch = sched.schedule()
        assert batch is not None and branch in batch.seqs, n
        assert branch.num_computed_tokens == 4 * shared, n
        assert batch.num_new_tokens[batch.seqs.index(branch)] == fed, n
        assert branch.block_table.blocks[:shared] == leader.block_table.blocks[:shared]
        assert sched.blocks.ref_counts[leader.block_table.blocks[0]] == 2
        assert branch.block_table.blocks[shared] not in leader.block_table.blocks


def test_a_branch_whose_leader_finished_prefills_on_its_own() -> None:
    """A finished leader has nothing to share: the branch drops ``fork_of`` and is admitted from
    the prefix cache (the leader's named blocks, taken off the free list); a preempted (waiting)
    leader makes it wait. Catches ``fork_of`` kept for a finished leader (the branch forks the
    freed table: its blocks referenced while still on the free list) and the checks turned around."""
    sched = make(max_num_seqs=1)
    leader = seq(10)
    branch = seq(10, fork_of=leader)
    sched.add(leader)
    sched.add(branch)
    run(sched, sched.schedule())
    sched._preempt(leader, ScheduledBatch([], [], [], []))
    sched.waiting.remove(leader)  # keep the leader waiting but out of this step's admission
    assert sched.schedule() is None and branch.fork_of is leader
    sched.finish(leader, SequenceStatus.FINISHED_ABORTED, "abort")
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [branch] and branch.fork_of is None
    assert branch.num_cached_tokens == 8  # the leader's two named blocks
    assert set(branch.block_table.blocks).isdisjoint(sched.blocks._free)
    assert all(sched.blocks.ref_counts[b] == 1 for b in branch.block_table.blocks)


# -- _allocate_new: the prefix cache's bounds and scope --------------------------------------


def test_a_prefix_hit_takes_every_full_block_before_the_last_token() -> None:
    """Blocks of 4, the first request's blocks named. 13 tokens: 12 are cached (3 blocks), 1 is
    fed; 16 tokens: 15 may be served, so 3 blocks (12) hit and 4 are fed - the last token must be
    computed to give the next one. Catches the limit ``num_tokens - 2`` (13: 2 blocks hit) and
    ``num_tokens`` (16: all 4 blocks hit, nothing fed, the request never admitted)."""
    for n, hit in ((13, 12), (16, 12)):
        sched = make()
        first = seq(n)
        sched.add(first)
        run(sched, sched.schedule())
        same = seq(n)
        sched.add(same)
        batch = sched.schedule()
        assert batch is not None and same in batch.seqs, n
        assert same.num_cached_tokens == hit and batch.num_new_tokens[batch.seqs.index(same)] == n - hit
        assert same.block_table.blocks[: hit // 4] == first.block_table.blocks[: hit // 4]


def test_two_cache_salts_never_share_a_block() -> None:
    """Catches the salt dropped from ``match_prefix`` or ``match_partial`` (the default salt ``""``
    for ``seq.cache_salt``): a prompt cached under the default salt is hit by the same prompt under
    that salt only - another salt hits neither its full blocks nor its remembered partial block,
    and never holds a block id a live sequence of the first salt holds."""
    copies: list[tuple[int, int]] = []
    sched = make()
    sched.blocks.copy_block = lambda src, dst: copies.append((src, dst))
    first = seq(10)  # salt ""
    sched.add(first)
    run(sched, sched.schedule())
    other = seq(10, cache_salt="tenant-b")
    sched.add(other)
    run(sched, sched.schedule())
    assert other.num_cached_tokens == 0
    assert set(first.block_table.blocks).isdisjoint(other.block_table.blocks)
    same = seq(10)
    sched.add(same)
    run(sched, sched.schedule())
    assert same.num_cached_tokens == 8  # the reference: same salt, two full blocks of 4
    assert same.block_table.blocks[:2] == first.block_table.blocks[:2]
    # A prompt shorter than a block: only a remembered partial block can serve it.
    short = seq(3, start=50)
    sched.add(short)
    run(sched, sched.schedule())
    sched.finish(short, SequenceStatus.FINISHED_STOPPED, "stop")  # tokens 50..52 remembered
    short_other = Sequence([50, 51, 52, 99], SamplingParams(), cache_salt="tenant-b")
    sched.add(short_other)
    run(sched, sched.schedule())
    assert short_other.num_cached_tokens == 0 and copies == []
    short_same = Sequence([50, 51, 52, 99], SamplingParams())
    sched.add(short_same)
    run(sched, sched.schedule())
    assert short_same.num_cached_tokens == 3 and len(copies) == 1


# -- the step's shape: kind, budget boundaries, intake -----------------------------------------


def test_a_steps_kind_names_decode_prefill_and_mixed_batches() -> None:
    """A prompt alone is a "prefill" step, decodes alone a "decode" step, both a "mixed" one - and
    a prompt chunk of one token that is not the prompt's end counts as prefill. Catches the decode
    count broken (``None``, counted twice, a 1-token chunk counted as a decode) and the kinds'
    tests or names changed (the engine and its metrics read them)."""
    sched = make(max_num_batched_tokens=16)
    a = seq(3)
    sched.add(a)
    assert run(sched, sched.schedule()).kind == "prefill"
    assert run(sched, sched.schedule()).kind == "decode"
    sched.add(seq(5, start=50))
    assert run(sched, sched.schedule()).kind == "mixed"
    assert run(sched, sched.schedule()).kind == "decode"
    sched = make(max_num_batched_tokens=3, max_num_seqs=2)
    sched.add(seq(3))
    run(sched, sched.schedule())
    sched.add(seq(2, start=100))
    batch = sched.schedule()
    assert batch is not None and batch.num_new_tokens == [1, 1] and batch.kind == "mixed"


def test_the_last_token_of_budget_still_runs_a_decode_or_admits_a_prompt() -> None:
    """A budget of 2: two decodes both run, and one decode leaves exactly 1 token, enough to
    admit a waiting prompt's first token. Catches ``budget <= 0`` -> ``<= 1`` (running) and
    ``budget > 0`` -> ``> 1`` (waiting)."""
    sched = make(max_num_batched_tokens=2, max_num_seqs=2)
    a, b = seq(2), seq(2, start=50)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())
    run(sched, sched.schedule())
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [a, b] and batch.num_new_tokens == [1, 1]
    sched = make(max_num_batched_tokens=2, max_num_seqs=2)
    sched.add(a := seq(2))
    run(sched, sched.schedule())
    run(sched, sched.schedule())
    late = seq(4, start=50)
    sched.add(late)
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [a, late] and batch.num_new_tokens == [1, 1]


def test_a_sequence_finished_while_waiting_is_dropped_and_the_next_admitted() -> None:
    """A request aborted from outside the scheduler (its status set, still queued) is removed
    when its turn comes, and admission goes on with the next one. Catches ``continue`` ->
    ``break`` there (the next request waits a step for nothing) and the wrong entry removed."""
    sched = make()
    gone, next_one = seq(3), seq(3, start=50)
    sched.add(gone)
    sched.add(next_one)
    gone.finish(SequenceStatus.FINISHED_ABORTED, "abort")
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [next_one]
    assert list(sched.waiting) == [] and sched.running == [next_one]


def test_has_work_while_anything_runs_or_waits() -> None:
    """Catches ``or`` -> ``and`` (an engine with only queued or only running work would idle)."""
    sched = make(max_num_seqs=1)
    assert not sched.has_work()
    a, b = seq(3), seq(3, start=50)
    sched.add(a)
    assert sched.has_work()  # waiting only
    run(sched, sched.schedule())
    assert sched.has_work()  # running only
    sched.add(b)
    sched.finish(a, SequenceStatus.FINISHED_STOPPED, "stop")
    assert a.finish_reason == "stop"  # the reason is the one given
    sched.finish(b, SequenceStatus.FINISHED_ABORTED, "abort")
    assert not sched.has_work() and b.finish_reason == "abort"


def test_an_output_with_a_row_missing_is_refused() -> None:
    """The engine's output must have one row (and one draft feed) per scheduled sequence: a short
    one raises instead of leaving the last sequences silently un-advanced. Catches ``strict=True``
    dropped from either zip."""
    sched = Scheduler(SchedulerConfig(), BlockManager(32, 4), BlockManager(32, 4))
    a, b = seq(5), seq(5, start=20)
    for s in (a, b):
        s.status = SequenceStatus.RUNNING
        sched.running.append(s)
        assert sched.blocks.allocate(s.block_table, 8)
        s.num_computed_tokens = 4
    batch = ScheduledBatch([a, b], [1, 1], [0, 0], [0, 0])
    with pytest.raises(ValueError, match="shorter"):
        sched.update_from_output(
            batch, ModelOutput(rows=[RowOutput([7]), RowOutput([8])], draft_fed=[0]), Sink()
        )
    with pytest.raises(ValueError, match="shorter"):
        sched.update_from_output(batch, ModelOutput(rows=[RowOutput([7])], draft_fed=[0, 0]), Sink())


def test_backlog_passes_every_argument_and_default_through() -> None:
    """``Scheduler.backlog`` is ``pacing.queue_backlog`` over a snapshot: compared with a direct
    call, with defaults and with each argument given. Catches a default changed (``inbox_tokens``
    1, ``expected_len`` 33) or an argument not passed on."""
    sched = make(max_num_batched_tokens=8, max_num_seqs=2)
    for i, caller in enumerate(("a", "a", "b", "c")):
        sched.add(seq(6 + 3 * i, start=100 * i + 1, caller=caller))
    run(sched, sched.schedule())

    def direct(*args: object, **kw: int) -> object:
        return queue_backlog(list(sched.running), list(sched.waiting), 2, 8, *args, **kw)  # type: ignore[arg-type]

    assert sched.backlog("c") == direct("c", 0, 0, 32.0)
    assert sched.backlog("c") != direct("c", 0, 40, 32.0)
    assert sched.backlog("c", 3, 40, 100.0) == direct("c", 3, 40, 100.0)
    assert sched.backlog("c", 3, 40, 100.0) != direct("c", 3, 40, 32.0)
    assert sched.backlog("a", 3, 40, 16.0, inbox_mine=2, inbox_mine_tokens=30) == direct(
        "a", 3, 40, 16.0, inbox_mine=2, inbox_mine_tokens=30
    )


# -- speculation in the step -------------------------------------------------------------------


def spec_sched(budget: int = 3) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=16),
        BlockManager(64, 4),
        BlockManager(64, 4),
        spec_budget=lambda s: budget,
    )


def test_a_running_prompt_chunk_never_gets_speculative_tokens() -> None:
    """Drafting is for decodes: a prompt's second chunk (running, not decoding) gets none, though
    the budget has room. Catches a non-decode's wanted drafts set to 1 instead of 0."""
    sched = spec_sched()
    s = seq(24)
    sched.add(s)
    first = run(sched, sched.schedule())
    s.num_draft_computed_tokens += first.num_draft_tokens[0]  # the engine's draft feed: caught up
    assert s.num_draft_computed_tokens == s.num_computed_tokens == 16
    batch = sched.schedule()
    assert batch is not None and batch.num_new_tokens == [8] and batch.num_spec_tokens == [0]


def test_a_draft_at_most_eight_tokens_behind_speculates_and_nine_does_not() -> None:
    """MAX_DRAFT_CATCHUP = 8 is inclusive: a draft 8 tokens behind catches up and drafts in the
    same step; 9 behind is caught up without drafting first. Catches ``<=`` -> ``<`` and the lag
    test dropped."""
    for behind, k in ((8, 3), (9, 0)):
        sched = spec_sched()
        s = seq(12)
        sched.add(s)
        run(sched, sched.schedule())
        assert s.num_tokens == 13
        s.num_draft_computed_tokens = 13 - behind
        batch = sched.schedule()
        assert batch is not None and batch.num_new_tokens == [1] and batch.num_spec_tokens == [k], behind


def test_a_preempted_sequence_forgets_its_draft_position() -> None:
    """Preemption frees the draft's blocks too, so its computed count goes back to 0. Catches it
    reset to 1 (the draft would skip recomputing the first token)."""
    sched = spec_sched()
    s = seq(6)
    sched.add(s)
    run(sched, sched.schedule())
    s.num_draft_computed_tokens = 5
    sched._preempt(s, ScheduledBatch([], [], [], []))
    assert (s.num_computed_tokens, s.num_draft_computed_tokens) == (0, 0)
