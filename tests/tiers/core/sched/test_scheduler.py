"""The scheduler without a model: one token budget, admission, prefix hits, preemption, drafts, forks."""

from __future__ import annotations

import pytest

from tiers.core.block_manager import BlockManager
from tiers.core.sched.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tiers.core.sequence import SamplingParams, Sequence, SequenceStatus


def seq(n: int, start: int = 1, **kw: object) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=64), **kw)  # type: ignore[arg-type]


def run(sched: Scheduler, batch: ScheduledBatch, sampled: int = 7) -> None:
    """What the engine does after a forward: advance, name blocks, append a token where one is due."""
    for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(sampled)
        sched.cache_blocks(s)


def queue(sched: Scheduler, caller: str, n: int, start: int = 1) -> list[Sequence]:
    """``n`` three-token requests from ``caller``, added in order."""
    seqs = [seq(3, start=start + 10 * i, caller=caller) for i in range(n)]
    for s in seqs:
        sched.add(s)
    return seqs


def make(num_blocks: int = 64, block_size: int = 4, **cfg: int) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size))


def test_decodes_and_a_prefill_chunk_share_one_step_under_the_budget() -> None:
    sched = make(max_num_batched_tokens=16)
    a, b = seq(6), seq(6, start=50)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    long = seq(40, start=100)
    sched.add(long)
    batch = sched.schedule()
    assert batch is not None
    assert batch.seqs == [a, b, long] and batch.num_new_tokens == [1, 1, 8]
    assert batch.kind == "mixed" and batch.num_tokens == 10


def test_a_long_prompt_progresses_in_budget_sized_chunks() -> None:
    sched = make(max_num_batched_tokens=8, max_num_seqs=4)
    s = seq(20)
    sched.add(s)
    chunks = []
    while s.num_computed_tokens < 20:
        batch = sched.schedule()
        assert batch is not None
        chunks.append(batch.num_new_tokens[0])
        run(sched, batch)
    assert chunks == [8, 8, 4]


def test_batch_size_is_bounded_by_max_num_seqs() -> None:
    sched = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(3, start=10 * i + 1))
    batch = sched.schedule()
    assert batch is not None and batch.num_seqs == 2 and sched.num_waiting == 1


def test_prefix_hit_starts_after_the_cached_blocks_and_leaves_one_token() -> None:
    sched = make()
    first = seq(12)
    sched.add(first)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    same = seq(12)
    sched.add(same)
    batch = sched.schedule()
    assert batch is not None
    i = batch.seqs.index(same)
    # 12 tokens = 3 full blocks, but the last token must be computed: 2 blocks hit, 4 tokens fed.
    assert same.num_cached_tokens == 8 and batch.num_new_tokens[i] == 4
    assert same.block_table.blocks[:2] == first.block_table.blocks[:2]


def test_out_of_blocks_preempts_the_newest_and_requeues_it_first() -> None:
    sched = make(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    old, new = seq(11), seq(11, start=30)  # 3 blocks each: the pool is full
    sched.add(old)
    sched.add(new)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    run(sched, sched.schedule())  # type: ignore[arg-type]  # 13 tokens: both need a 4th block
    batch = sched.schedule()
    assert batch is not None
    assert batch.preempted == [new] and batch.seqs == [old]
    assert new.status == SequenceStatus.WAITING and sched.waiting[0] is new
    assert new.num_computed_tokens == 0 and new.num_output_tokens == 2  # keeps its tokens
    sched.finish(old, SequenceStatus.FINISHED_STOPPED, "stop")
    again = sched.schedule()
    assert again is not None and again.seqs == [new]
    assert new.num_computed_tokens > 0  # its freed blocks were still named: recompute skipped them


def test_a_sequence_alone_is_never_preempted_by_itself_while_it_fits() -> None:
    sched = make(num_blocks=4, block_size=4, max_model_len=16, max_num_batched_tokens=64)
    s = seq(10)
    sched.add(s)
    for _ in range(5):
        batch = sched.schedule()
        assert batch is not None and not batch.preempted
        run(sched, batch)
    assert s.num_tokens == 15


def test_finish_frees_blocks_at_once() -> None:
    sched = make(num_blocks=8)
    s = seq(9)
    sched.add(s)
    sched.schedule()
    assert sched.blocks.num_used_blocks == 3
    sched.finish(s, SequenceStatus.FINISHED_ABORTED, "abort")
    assert sched.blocks.num_used_blocks == 0 and not sched.has_work()


def test_speculative_tokens_count_against_the_budget_and_need_blocks() -> None:
    draft = BlockManager(64, 4)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16), BlockManager(64, 4), draft, spec_budget=lambda s: 3
    )
    a = seq(5)
    sched.add(a)
    first = sched.schedule()
    assert first is not None and first.num_spec_tokens == [0]
    assert first.num_draft_tokens == [4]  # the draft prefills alongside, up to the last token
    run(sched, first)
    a.num_draft_computed_tokens = 4
    batch = sched.schedule()
    assert batch is not None
    assert batch.num_new_tokens == [1] and batch.num_spec_tokens == [3]
    assert batch.num_draft_tokens == [2]  # its backlog: tokens 4 and 5
    assert a.block_table.num_blocks == 3  # 6 computed + 3 lookahead = 9 tokens -> 3 blocks
    assert a.draft_table.num_blocks == 2  # 4 + 2 fed + 2 proposals fed = 8 tokens


def test_a_tier_not_speculating_holds_none_of_the_lower_tiers_pool() -> None:
    # Catches: every prompt chunk of a drafting tier reserving draft blocks in the lower tier's
    # pool even while speculation is off - an upper request held 15/16 of that pool for its whole
    # life, and the lower tier's own request could not be admitted until it finished.
    lower_pool = BlockManager(16, 4)
    lower = Scheduler(SchedulerConfig(max_num_batched_tokens=64), lower_pool)
    speculating = False
    upper = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64),
        BlockManager(64, 4),
        lower_pool,
        spec_budget=lambda s: 3 if speculating else 0,
    )
    big = seq(40)  # 10 of the lower pool's 16 blocks once its draft is fed
    upper.add(big)
    for _ in range(3):  # its prompt in one chunk, then two decodes
        run(upper, upper.schedule())  # type: ignore[arg-type]
    assert lower_pool.num_used_blocks == 0
    mine = seq(20, start=500)  # the lower tier's own request: 5 of its 16 blocks
    lower.add(mine)
    batch = lower.schedule()
    assert batch is not None and batch.seqs == [mine] and not batch.preempted
    run(lower, batch)
    lower.finish(mine, SequenceStatus.FINISHED_STOPPED, "stop")  # it completes meanwhile
    # Speculation resumes: the draft is caught up in chunks, then drafts.
    speculating = True
    for _ in range(10):
        batch = upper.schedule()
        assert batch is not None
        i = batch.seqs.index(big)
        if batch.num_spec_tokens[i]:
            break
        assert batch.num_draft_tokens[i] > 0
        big.num_draft_computed_tokens += batch.num_draft_tokens[i]  # the engine's catch-up feed
        upper.cache_blocks(big)
        run(upper, batch)
    assert batch.num_spec_tokens[i] == 3 and big.draft_table.num_blocks > 0
    used_with_draft = lower_pool.num_used_blocks
    run(upper, batch)
    big.num_draft_computed_tokens = big.num_tokens - 1
    upper.cache_blocks(big)
    # Off again: its draft blocks go back to the lower tier's pool, named.
    speculating = False
    run(upper, upper.schedule())  # type: ignore[arg-type]
    assert big.draft_table.num_blocks == 0 and big.num_draft_computed_tokens == 0
    assert lower_pool.num_used_blocks < used_with_draft
    # Back on: its named blocks are found again, not recomputed from the start.
    speculating = True
    batch = upper.schedule()
    assert batch is not None
    assert big.num_draft_computed_tokens >= 40


def test_a_draft_out_of_blocks_just_does_not_speculate() -> None:
    draft = BlockManager(1, 4)
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4), draft, spec_budget=lambda s: 3)
    a = seq(9)
    sched.add(a)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    batch = sched.schedule()
    assert batch is not None and batch.num_spec_tokens == [0] and not batch.preempted


def test_n_branches_wait_for_the_first_and_fork_its_blocks() -> None:
    sched = make(block_size=4)
    leader = seq(10)
    child = seq(10, fork_of=leader)
    sched.add(leader)
    sched.add(child)
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [leader]
    run(sched, batch)
    batch = sched.schedule()
    assert batch is not None and child in batch.seqs
    assert child.block_table.blocks[:2] == leader.block_table.blocks[:2]
    assert child.num_computed_tokens == 8 and batch.num_new_tokens[batch.seqs.index(child)] == 2


def test_branches_waiting_for_their_leader_never_block_other_callers() -> None:
    # Catches: admission stopping at the first branch that cannot fork yet (it `break`s), so a
    # 4-token request waited for the whole 2,000-token prompt of an n=4 leader: 64 steps with
    # five free slots.
    sched = make(
        num_blocks=1024, block_size=16, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=4096
    )
    busy = [seq(3, start=3000 + 10 * i, caller="b") for i in range(2)]  # b runs more than a does
    leader = seq(2000, caller="a")
    branches = [seq(2000, fork_of=leader, caller="a") for _ in range(3)]
    for s in [*busy, leader, *branches]:
        sched.add(s)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    small = seq(4, start=5000, caller="b")
    sched.add(small)
    admitted_at = None
    for step in range(1, 4):
        batch = sched.schedule()
        assert batch is not None
        if small in batch.seqs:
            admitted_at = step
            break
        run(sched, batch)
    assert admitted_at is not None and admitted_at <= 2
    assert not any(b in batch.seqs for b in branches)  # still waiting for the leader's prompt
    assert leader.num_computed_tokens < leader.num_prompt_tokens - 1


def test_aborted_waiting_sequences_are_skipped() -> None:
    sched = make()
    s = seq(3)
    sched.add(s)
    sched.finish(s, SequenceStatus.FINISHED_ABORTED, "abort")
    assert sched.schedule() is None


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "max_model_len"])
def test_config_names_the_bad_field(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: 0})


def test_the_token_budget_must_cover_a_token_per_running_sequence() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)


def test_a_long_prefill_admitted_first_never_starves_later_decodes() -> None:
    sched = make(num_blocks=256, max_num_batched_tokens=16)
    long = seq(100, start=200)
    sched.add(long)
    run(sched, sched.schedule())  # type: ignore[arg-type]  # long takes the whole budget
    short = seq(4)
    sched.add(short)
    for _ in range(3):
        batch = sched.schedule()
        assert batch is not None
        run(sched, batch)
    batch = sched.schedule()
    assert batch is not None and batch.seqs[0] is short and batch.num_new_tokens[0] == 1
    assert batch.num_new_tokens[1] == 8  # the chunk: at most half the budget beside a decode


def test_a_long_prefill_leaves_room_for_admissions() -> None:
    sched = make(num_blocks=256, max_num_batched_tokens=16)
    long = seq(100, start=200)
    sched.add(long)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    short = seq(4)
    sched.add(short)
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [long, short] and batch.num_new_tokens == [8, 4]


def test_a_lone_long_prompt_uses_the_whole_budget() -> None:
    sched = make(max_num_batched_tokens=16)
    s = seq(40)
    sched.add(s)
    batch = sched.schedule()
    assert batch is not None and batch.num_new_tokens == [16]


def test_a_callers_requests_keep_their_arrival_order() -> None:
    # Catches queue reordering within one caller (the old per-request priority let a caller's later
    # request overtake its earlier ones, so admitted requests waited far past their predicted wait).
    sched = make(max_num_seqs=1)
    first = seq(3, caller="a")
    sched.add(first)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    queued = queue(sched, "a", 4, start=20)
    order = []
    while len(order) < 4:
        sched.finish(sched.running[0], SequenceStatus.FINISHED_STOPPED, "stop")
        batch = sched.schedule()
        assert batch is not None
        order.extend(batch.admitted)
        run(sched, batch)
    assert order == queued


def test_free_slots_go_to_the_caller_with_the_fewest_running() -> None:
    sched = make(max_num_seqs=3)
    heavy = [seq(3, start=10 * i + 1, caller="heavy") for i in range(4)]
    for s in heavy[:2]:
        sched.add(s)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    sched.add(heavy[2])
    light = seq(3, start=90, caller="light")
    sched.add(light)  # arrives after heavy[2], yet light has nothing running
    batch = sched.schedule()
    assert batch is not None and batch.admitted == [light]
    assert list(sched.waiting) == [heavy[2]]


def test_a_caller_below_its_share_preempts_the_newest_of_the_caller_over_it() -> None:
    sched = make(max_num_seqs=4)
    heavy = queue(sched, "heavy", 4)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    assert len(sched.running) == 4
    lights = queue(sched, "light", 3, start=100)
    batch = sched.schedule()
    assert batch is not None
    # Share is 4 // 2 = 2: two of heavy's (its newest) give way, the third light request waits.
    assert batch.preempted == [heavy[3], heavy[2]]
    assert batch.admitted == lights[:2]
    assert [s.caller for s in sched.running].count("light") == 2
    assert heavy[3].status == SequenceStatus.WAITING and heavy[3].num_computed_tokens == 0
    assert lights[2] in sched.waiting and sched.num_preemptions == 2


def test_no_fairness_preemption_for_one_caller_or_a_caller_at_its_share() -> None:
    sched = make(max_num_seqs=2)
    a = queue(sched, "a", 3)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    batch = sched.schedule()  # a's own third request waits for a free slot
    assert batch is not None and not batch.preempted and a[2] in sched.waiting
    b1 = seq(3, start=60, caller="b")
    sched.add(b1)
    batch = sched.schedule()  # share is 1: b takes one of a's two slots
    assert batch is not None and batch.preempted == [a[1]] and batch.admitted == [b1]
    run(sched, batch)
    b2 = seq(3, start=70, caller="b")
    sched.add(b2)
    batch = sched.schedule()  # b holds its share now: no more preemption
    assert batch is not None and not batch.preempted and b2 in sched.waiting


def test_backlog_counts_the_prompt_work_ahead_of_a_new_request() -> None:
    """What the predicted wait is built from: a request over its share waits for every prompt
    token not yet computed (running chunks, the queue, the inbox) and for a slot once the batch is
    full; a caller below its share only for the running prefills of callers no heavier than it
    (theirs go first)."""
    sched = make(num_blocks=256, max_num_seqs=2, max_num_batched_tokens=16)
    a, b, c = seq(40, caller="heavy"), seq(30, start=100, caller="heavy"), seq(20, start=200, caller="heavy")
    for s in (a, b, c):
        sched.add(s)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    assert [s.num_computed_tokens for s in (a, b)] == [8, 8] and c.num_computed_tokens == 0
    heavy = sched.backlog("heavy", inbox=1, inbox_tokens=50)
    assert heavy.prefill_tokens == (40 - 8) + (30 - 8) + 20 + 50
    assert heavy.slots_ahead == 2 + 1 + 1 + 1 - 2 and heavy.decoding == 0
    light = sched.backlog("light")
    assert light.prefill_tokens == 0 and light.slots_ahead == 0  # heavy runs 2: light goes first
    assert light.protected and not heavy.protected
    # A flood's requests not yet handed over count against the flood, not the light caller.
    assert sched.backlog("light", inbox=5, inbox_tokens=500, inbox_mine=0).slots_ahead == 0
    assert sched.backlog("light", inbox=5, inbox_tokens=500, inbox_mine=1).slots_ahead > 0


def test_a_lighter_caller_at_its_share_queues_ahead_of_a_heavier_callers_queue() -> None:
    sched = make(num_blocks=256, max_num_seqs=3, max_num_batched_tokens=64)
    heavy = queue(sched, "heavy", 4)
    light = seq(3, start=500, caller="light")
    sched.add(light)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    assert [s.caller for s in sched.running].count("heavy") == 2 and light in sched.running
    # Share is 3 // 2 = 1: light holds it, so its next request queues - but a freed slot goes to
    # it before heavy's two waiting ones (it runs fewer), so only the slot itself is ahead.
    assert sched.backlog("light").slots_ahead == 1
    assert sched.backlog("heavy").slots_ahead == 3 and sched.backlog(None).slots_ahead == 3
    assert [s for s in heavy if s in sched.waiting] == heavy[2:]


def test_a_light_caller_is_admitted_before_a_floods_prompts_take_the_budget() -> None:
    """Under a flood every step's budget went to the flood's running prompts first, so a light
    caller's request could not even be admitted (admission only takes budget left over)."""
    sched = make(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=16)
    heavy = [seq(40, start=1 + 100 * i, caller="heavy") for i in range(3)]
    for s in heavy:
        sched.add(s)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    assert len(sched.running) == 2  # the budget is spent on two of the flood's prompts
    light = seq(40, start=900, caller="light")
    sched.add(light)
    batch = sched.schedule()
    assert batch is not None and batch.admitted == [light] and batch.seqs[0] is light
    assert heavy[2] in sched.waiting  # the flood's own next request still waits its turn
    run(sched, batch)
    # Once running, its chunks still go before the flood's (light runs 1, heavy 2).
    batch = sched.schedule()
    assert batch is not None and batch.seqs[0] is light


def test_a_queued_request_waits_until_the_shortest_running_sequences_end() -> None:
    """A burst's sequences all started together: the first slot frees when the shortest of them
    ends, not after 1/max_num_seqs of a lifetime (what the first estimate assumed)."""
    sched = make(num_blocks=256, max_num_seqs=2, max_num_batched_tokens=16)
    short = Sequence(list(range(1, 5)), SamplingParams(max_tokens=6))
    long = Sequence(list(range(50, 54)), SamplingParams(max_tokens=40))
    for s in (short, long):
        sched.add(s)
    run(sched, sched.schedule())  # type: ignore[arg-type]  # both prefilled, one token each
    assert sched.backlog(None, expected_len=32).slot_steps == 6 - 1
    assert sched.backlog(None, inbox=1, expected_len=32).slot_steps == 32 - 1  # the second slot
    assert sched.backlog(None, inbox=2, expected_len=32).slot_steps == 6 - 1 + 32  # a lap later


def test_a_protected_caller_waits_for_its_own_earlier_requests() -> None:
    """A caller's requests keep their order, so a protected request's prompt runs after the
    caller's own queued and not-yet-handed-over prompts (a burst from one light caller was
    predicted as if each request were alone)."""
    sched = make(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=16)
    sched.add(seq(3, caller="heavy"))
    mine = seq(30, start=100, caller="light")
    sched.add(mine)
    assert sched.backlog("light").prefill_tokens == 30
    handed_over_later = sched.backlog("light", inbox=2, inbox_tokens=90, inbox_mine=1, inbox_mine_tokens=40)
    assert handed_over_later.prefill_tokens == 30 + 40
    assert sched.backlog("light").protected


def test_a_lone_caller_is_not_protected() -> None:
    """Alone, a caller below its share can still be pushed back by any caller arriving after it
    (lighter, so first); counting its requests as protected let a flood's stretched waits set
    the protected calibration that a light tenant's requests are then judged by."""
    sched = make(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    queue(sched, "heavy", 2)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    assert not sched.backlog("heavy").protected
    assert sched.backlog("light").protected  # a second caller below its share is
    sched.add(seq(3, start=500, caller="light"))
    assert sched.backlog("heavy").protected  # two callers now: heavy, running 2, is below 8 // 2


def test_a_burst_on_an_idle_engine_waits_for_the_slots_it_fills() -> None:
    """Requests queued before any runs will hold every slot for their whole lives: a request
    beyond the batch waits for them (a 70-request burst on an idle tier was all admitted as if
    slots were free, and the last waited 24 s)."""
    sched = make(num_blocks=256, max_num_seqs=2, max_num_batched_tokens=16)
    sched.add(seq(4))
    assert sched.backlog(None, expected_len=32).slots_ahead == 0
    ahead = sched.backlog(None, inbox=1, expected_len=32)  # the waiting one and the inbox's fill both
    assert ahead.slots_ahead == 1 and ahead.slot_steps >= 32  # an occupant's whole life
    assert sched.backlog(None, inbox=3, expected_len=32).slot_steps >= 2 * 32  # a lap later


def test_while_a_protected_prompt_is_pending_only_decodes_and_protected_prompts_run() -> None:
    """The device defers everyone else's prompts while a protected caller's waits
    (``tiers/worker/device.py``):
    the flood's running chunk and its queued admissions sit the step out, its decodes do not."""
    sched = make(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64)  # share: 2 each
    decoding = seq(3, caller="heavy")
    sched.add(decoding)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    long = seq(100, start=100, caller="heavy")
    sched.add(long)
    run(sched, sched.schedule())  # type: ignore[arg-type]  # long is mid-prompt now
    queued = seq(10, start=300, caller="heavy")
    sched.add(queued)
    assert not sched.has_protected_prefill()  # one caller: nobody is protected
    light = seq(20, start=500, caller="light")
    sched.add(light)
    assert sched.protected_callers() == {"light"} and sched.has_protected_prefill()
    batch = sched.schedule(defer_unprotected_prompts=True)
    assert batch is not None
    assert set(batch.seqs) == {decoding, light} and queued in sched.waiting
    run(sched, batch)
    assert not sched.has_protected_prefill()  # its prompt is done: nothing to defer for
    batch = sched.schedule(defer_unprotected_prompts=False)
    assert batch is not None and long in batch.seqs and queued in batch.seqs


def test_a_deferred_step_admits_the_protected_caller_even_when_another_runs_fewer() -> None:
    """Admission under deferral looks only at protected callers' requests: the flood's next
    request (its caller running none here, so first in fair order) must not block them."""
    sched = make(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)  # share: 4 each
    running_light = seq(3, caller="light")
    sched.add(running_light)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    flood = queue(sched, "heavy", 5, start=100)
    light = seq(3, start=900, caller="light")
    sched.add(light)
    assert sched.protected_callers() == {"light"}
    batch = sched.schedule(defer_unprotected_prompts=True)
    assert batch is not None and batch.admitted == [light]
    assert all(s in sched.waiting for s in flood)


def test_more_callers_than_slots_never_preempt_each_other_at_their_share() -> None:
    """Three callers, two slots: the share is one slot each, and a caller holding one is at its
    share, not over it. Catches the fairness preemption firing at the share (``held < share``):
    the waiting caller preempted a running one, which then preempted back, step after step, and
    no sequence kept its KV long enough to finish."""
    sched = make(max_num_seqs=2)
    a, b, c = (queue(sched, caller, 2, start=100 * i + 1) for i, caller in enumerate("abc"))
    first = sched.schedule()
    assert first is not None and first.admitted == [a[0], b[0]]
    run(sched, first)
    for _ in range(6):
        batch = sched.schedule()
        assert batch is not None and not batch.preempted
        assert batch.seqs == [a[0], b[0]] and batch.num_new_tokens == [1, 1]
        run(sched, batch)
    assert sched.num_preemptions == 0 and c[0] in sched.waiting
    # A slot that frees goes to a caller running none (a's next, first in the queue), never to b;
    # and c, still waiting, does not take a slot from anyone at their share.
    sched.finish(a[0], SequenceStatus.FINISHED_STOPPED, "stop")
    for _ in range(3):
        batch = sched.schedule()
        assert batch is not None and not batch.preempted
        run(sched, batch)
    assert sched.running == [b[0], a[1]] and sched.num_preemptions == 0
