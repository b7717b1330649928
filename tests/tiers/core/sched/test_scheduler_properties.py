"""The scheduler under random workloads (Hypothesis): callers, shared prompt starts, ``n > 1``
branches, speculative lookahead, aborts, and a pool small enough that preemption is routine.

After every step: the batch respects ``max_num_seqs`` and the token budget; every scheduled row
has blocks for what it feeds; free and referenced blocks partition both pools and a block's
refcount is the number of tables holding it; waiting and finished sequences hold no blocks; every
computed token's KV (tracked per block, copies for partial prefix hits included) is that
sequence's own token in its own context and partition; each caller's requests are first admitted
in arrival order. At the end, the workload drains: every sequence finishes (no livelock between
callers) and the pool is whole again.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tiers.core.block_manager import BlockManager, BlockTable
from tiers.core.sched.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tiers.core.sequence import SamplingParams, Sequence, SequenceStatus

STARTS = ([], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9], [6, 6, 6, 6, 6, 6])
CALLERS = ("a", "b", "c")


@dataclass
class Content:
    salt: str
    before: tuple[int, ...]
    written: list[int] = field(default_factory=list)


class TrackedBlocks(BlockManager):
    """A block manager whose pool memory is modelled: ``content`` is what each block holds (a
    block handed out keeps its old memory until written; a partial hit's copy copies it)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.content: dict[int, Content] = {}
        self.copy_block = self._copy

    def _copy(self, src: int, dst: int) -> None:
        held = self.content.get(src)
        if held is not None:
            self.content[dst] = Content(held.salt, held.before, list(held.written))


def write(bm: TrackedBlocks, seq: Sequence, table: BlockTable, start: int, end: int) -> None:
    """The forward: KV of ``token_ids[start:end]`` lands in ``table``'s blocks."""
    bs = bm.block_size
    for pos in range(start, end):
        i, off = divmod(pos, bs)
        b = table.blocks[i]
        assert bm.ref_counts[b] == 1, f"writing into block {b} that another table holds"
        held = bm.content.get(b)
        if held is None or off == 0:
            held = bm.content[b] = Content(seq.cache_salt, tuple(seq.token_ids[: i * bs]))
        assert (held.salt, held.before) == (seq.cache_salt, tuple(seq.token_ids[: i * bs]))
        assert held.written[:off] == seq.token_ids[i * bs : pos], "computing after KV that is not ours"
        del held.written[off:]
        held.written.append(seq.token_ids[pos])


def check_computed(bm: TrackedBlocks, seq: Sequence, table: BlockTable, computed: int) -> None:
    bs = bm.block_size
    assert table.num_blocks * bs >= computed
    for i in range(-(-computed // bs)):
        held = bm.content.get(table.blocks[i])
        assert held is not None, f"computed tokens in block {table.blocks[i]} that holds nothing"
        assert (held.salt, held.before) == (seq.cache_salt, tuple(seq.token_ids[: i * bs]))
        end = min(computed, (i + 1) * bs)
        assert held.written[: end - i * bs] == seq.token_ids[i * bs : end], "KV of other tokens"


def check_pool(bm: BlockManager, tables: list[BlockTable]) -> None:
    held = [0] * bm.num_blocks
    for t in tables:
        assert len(set(t.blocks)) == len(t.blocks), "a table holds a block twice"
        for b in t.blocks:
            held[b] += 1
    assert bm.ref_counts == held, "refcounts are not the tables holding each block"
    free = list(bm._free)
    assert sorted(free) == [b for b in range(bm.num_blocks) if held[b] == 0], "free/referenced overlap"


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched = Scheduler(SchedulerConfig(), TrackedBlocks(64, 4))
        self.seqs: list[Sequence] = []
        self.arrivals: defaultdict[str, list[Sequence]] = defaultdict(list)
        self.admitted: defaultdict[str, list[Sequence]] = defaultdict(list)
        self.branches: set[int] = set()
        """``n > 1`` branches: they wait for their leader's prompt, so may start after later arrivals."""
        self.spec_k = 0

    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.sampled_from([2, 4]),
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(4, 16),
        spec_k=st.integers(0, 3),
    )
    def config(self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int, spec_k: int) -> None:
        cfg = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(budget, max_num_seqs),
            max_model_len=num_blocks * block_size,
        )
        draft = TrackedBlocks(num_blocks, block_size) if spec_k else None
        self.spec_k = spec_k
        self.sched = Scheduler(
            cfg, TrackedBlocks(num_blocks, block_size), draft, spec_budget=lambda s: spec_k
        )

    @property
    def blocks(self) -> TrackedBlocks:
        assert isinstance(self.sched.blocks, TrackedBlocks)
        return self.sched.blocks

    # -- operations -------------------------------------------------------------------------------
    @rule(
        caller=st.sampled_from(CALLERS),
        start=st.sampled_from(STARTS),
        tail=st.lists(st.integers(1, 9), max_size=5),
        max_tokens=st.integers(1, 6),
        branches=st.integers(1, 2),
    )
    def add(self, caller: str, start: list[int], tail: list[int], max_tokens: int, branches: int) -> None:
        prompt = [*start, *tail] or [5]
        # A sequence that fits the pool alone (the engine refuses longer ones up front).
        limit = self.blocks.num_blocks * self.blocks.block_size
        if len(prompt) + max_tokens > limit // max(1, branches):
            return
        leader = Sequence(prompt, SamplingParams(max_tokens=max_tokens), caller=caller, cache_salt=caller)
        family = [leader] + [
            Sequence(
                prompt,
                SamplingParams(max_tokens=max_tokens),
                caller=caller,
                cache_salt=caller,
                fork_of=leader,
            )
            for _ in range(branches - 1)
        ]
        self.branches.update(s.seq_id for s in family[1:])
        for s in family:
            self.sched.add(s)
            self.seqs.append(s)
            self.arrivals[caller].append(s)

    @rule(accepted=st.integers(0, 3), defer=st.booleans())
    def step(self, accepted: int, defer: bool) -> None:
        running = Counter(s.caller for s in self.sched.running)
        callers = running.keys() | {s.caller for s in self.sched.waiting if not s.is_finished}
        share = self.sched.fair_share(len(callers))
        batch = self.sched.schedule(defer_unprotected_prompts=defer)
        if batch is None:
            return
        if not batch.preempted_for_blocks:
            # Preempted for fairness only: each from a caller that held more than its share.
            for victim in batch.preempted:
                assert running[victim.caller] > share, (victim.caller, running, share)
        self._check_batch(batch)
        self._run(batch, accepted)

    @rule(index=st.integers(0, 50))
    def abort(self, index: int) -> None:
        live = [s for s in self.seqs if not s.is_finished]
        if live:
            self.sched.finish(live[index % len(live)], SequenceStatus.FINISHED_ABORTED, "abort")

    # -- the engine's side of a step ---------------------------------------------------------------
    def _check_batch(self, batch: ScheduledBatch) -> None:
        cfg = self.sched.config
        assert len(self.sched.running) <= cfg.max_num_seqs
        assert batch.num_seqs <= cfg.max_num_seqs and batch.num_tokens <= cfg.max_num_batched_tokens
        assert len({s.seq_id for s in batch.seqs}) == batch.num_seqs
        for s, n, k in zip(batch.seqs, batch.num_new_tokens, batch.num_spec_tokens, strict=True):
            assert s.status == SequenceStatus.RUNNING and s in self.sched.running
            assert 1 <= n <= s.num_tokens - s.num_computed_tokens
            assert s.block_table.num_blocks * self.blocks.block_size >= s.num_computed_tokens + n + k
        for s in batch.admitted:
            if s.num_preemptions == 0 and s not in self.admitted[s.caller]:
                self.admitted[s.caller].append(s)

    def _run(self, batch: ScheduledBatch, accepted: int) -> None:
        draft = self.sched.draft_blocks
        for s, n, k, fed in zip(
            batch.seqs, batch.num_new_tokens, batch.num_spec_tokens, batch.num_draft_tokens, strict=True
        ):
            if draft is not None and fed:
                assert isinstance(draft, TrackedBlocks)
                dc = s.num_draft_computed_tokens
                write(draft, s, s.draft_table, dc, dc + fed)
                s.num_draft_computed_tokens = dc + fed
            start = s.num_computed_tokens
            if start + n < s.num_tokens:  # a prompt chunk
                write(self.blocks, s, s.block_table, start, start + n)
                s.num_computed_tokens = start + n
            else:  # the row samples: k drafted tokens verified, a of them kept, then one more
                a = min(k, accepted, s.num_remaining_tokens - 1)
                s.token_ids.extend(7 + (s.num_tokens + j) % 3 for j in range(a))
                write(self.blocks, s, s.block_table, start, start + n + a)
                s.num_computed_tokens = start + n + a
                s.token_ids.append(5)
            self.sched.cache_blocks(s)
            if s.num_output_tokens >= s.params.max_tokens:
                self.sched.finish(s, SequenceStatus.FINISHED_LENGTH, "length")

    # -- invariants -------------------------------------------------------------------------------
    @invariant()
    def queues_are_consistent(self) -> None:
        running, waiting = self.sched.running, list(self.sched.waiting)
        assert not {s.seq_id for s in running} & {s.seq_id for s in waiting}
        assert all(s.status == SequenceStatus.RUNNING for s in running)
        assert all(s.status == SequenceStatus.WAITING for s in waiting)
        for s in self.seqs:
            if s.is_finished or s.status == SequenceStatus.WAITING:
                assert not s.block_table.blocks and not s.draft_table.blocks, "an idle sequence holds blocks"

    @invariant()
    def pools_are_partitioned_and_every_computed_token_is_ours(self) -> None:
        check_pool(self.blocks, [s.block_table for s in self.sched.running])
        for s in self.sched.running:
            check_computed(self.blocks, s, s.block_table, s.num_computed_tokens)
        draft = self.sched.draft_blocks
        if draft is not None:
            assert isinstance(draft, TrackedBlocks)
            check_pool(draft, [s.draft_table for s in self.sched.running])
            for s in self.sched.running:
                check_computed(draft, s, s.draft_table, s.num_draft_computed_tokens)

    @invariant()
    def each_callers_requests_start_in_arrival_order(self) -> None:
        for caller, admitted in self.admitted.items():
            order = [s for s in self.arrivals[caller] if s in admitted and s.seq_id not in self.branches]
            assert [s for s in admitted if s in order] == order

    def teardown(self) -> None:
        for _ in range(3000):
            batch = self.sched.schedule()
            if batch is None:
                break
            self._check_batch(batch)
            self._run(batch, 1)
        assert not self.sched.has_work(), "the workload did not drain"
        assert all(s.is_finished for s in self.seqs)
        assert self.blocks.num_free_blocks == self.blocks.num_blocks
        check_pool(self.blocks, [])


SchedulerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("TIERED_ROUTER_PROPERTY_EXAMPLES", "100")),
    # Fixed examples where a count is given (make mutation: every mutant meets the same ones).
    derandomize="TIERED_ROUTER_PROPERTY_EXAMPLES" in os.environ,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    # No shrinking: on these machines it ran five minutes per failure; the failing steps print anyway.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
test_scheduler_under_random_workloads = SchedulerMachine.TestCase
