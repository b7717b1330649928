"""The torch-free scheduler: which sequences run this step, with how many tokens, in which blocks.

One rule for everything (vLLM v1's): a sequence's ``num_computed_tokens`` catches up with its
``num_tokens`` under one per-step token budget. A decode is a sequence one token behind (plus the
speculative tokens the engine will draft for it); a prefill chunk is a sequence further behind; a
prefix-cache hit or a preempted sequence's recompute are the same rule from another starting
point. Decodes, prefill chunks and verification tokens share one forward.

Order within a step: running decodes first, then running prefill chunks (so a long prompt
never stalls decodes; it progresses in what budget is left, at most half of it while others decode
or wait),
then waiting sequences while budget, batch slots and blocks last. When a running sequence cannot
get blocks for its next tokens, the newest running sequence not yet in the step is preempted by
recompute: its blocks are freed and it goes back to the front of the queue, keeping its
generated tokens. A sequence that fits the pool alone is therefore never failed.

Fairness between callers: ``fairness.py`` decides who goes next and who is preempted for whom.

Draft-side KV (speculative tiers) follows the target (``draft_tables.py``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from tiers.core.block_manager import BlockManager
from tiers.core.sched.batch import ModelOutput, ScheduledBatch, SchedulerConfig, StepSink
from tiers.core.sched.draft_tables import DraftTables
from tiers.core.sched.fairness import (
    fair_share,
    fairness_victims,
    has_protected_prefill,
    next_waiting,
    protected_callers,
)
from tiers.core.sched.pacing import Backlog, Pace, prefill_cap, queue_backlog
from tiers.core.sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["ScheduledBatch", "Scheduler", "SchedulerConfig", "StepSink"]

MAX_DRAFT_CATCHUP = 8
"""A sequence speculates this step only if its draft is at most this many tokens behind; a longer
backlog (after plain steps) is caught up in chunks first."""
PROMPT_LOGPROBS_CHUNK = 256
"""Most prompt positions one step feeds for a request that asked for its prompt's logprobs."""


class Scheduler(DraftTables):
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        draft_blocks: BlockManager | None = None,
        *,
        spec_budget: Callable[[Sequence], int] | None = None,
        pace: Pace | None = None,
    ) -> None:
        """``spec_budget(seq)``: most speculative tokens the engine would draft for ``seq`` this
        step (0: no speculation), fitted into budget and blocks. ``pace``: the engine's measured
        step costs, which bound the prompt tokens fed beside decodes (``pacing.prefill_cap``)."""
        self.config = config
        self.blocks = blocks
        self.draft_blocks = draft_blocks
        self.spec_budget = spec_budget
        self.pace = pace
        self._prefill_room: int | None = None  # prompt tokens this step may still feed (None: any)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- intake ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` at the back (preempted sequences go back to the front: they already hold
        a turn). Which waiting sequence joins the batch next is decided per caller
        (``fairness.next_waiting``)."""
        self.waiting.append(seq)

    def fair_share(self, num_callers: int) -> int:
        return fair_share(self.config.max_num_seqs, num_callers)

    def protected_callers(self) -> set[str]:
        """Callers below their fair share while another caller is busy here too (``fairness.py``)."""
        return protected_callers([*self.running, *self.waiting], self.config.max_num_seqs)

    def has_protected_prefill(self) -> bool:
        """A protected caller's prompt is not yet computed (waiting or running)."""
        return has_protected_prefill([*self.running, *self.waiting], self.config.max_num_seqs)

    def backlog(
        self,
        caller: str | None,
        inbox: int = 0,
        inbox_tokens: int = 0,
        expected_len: float = 32.0,
        *,
        inbox_mine: int = 0,
        inbox_mine_tokens: int = 0,
    ) -> Backlog:
        """What a new request from ``caller`` finds ahead of it (``pacing.queue_backlog``)."""
        cfg = self.config
        return queue_backlog(
            list(self.running), list(self.waiting), cfg.max_num_seqs, cfg.max_num_batched_tokens, caller,
            inbox, inbox_tokens, expected_len, inbox_mine=inbox_mine, inbox_mine_tokens=inbox_mine_tokens,
        )  # fmt: skip

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def num_kv_tokens(self) -> int:
        return self.blocks.num_used_blocks * self.blocks.block_size

    # -- one step -------------------------------------------------------------------------------
    def callers(self) -> Counter[str]:
        return Counter(s.caller for s in (*self.running, *self.waiting) if not s.is_finished)

    def schedule(
        self,
        *,
        defer_unprotected_prompts: bool = False,
        hold_back: frozenset[str] = frozenset(),
        decodes_elsewhere: bool = False,
    ) -> ScheduledBatch | None:
        """Pick the next step's work; ``None`` when there is nothing to run.

        ``defer_unprotected_prompts``: a protected caller's prompt is pending on the device: run
        decodes and protected callers' prompts only, so the turn comes round to it sooner.
        ``hold_back``: callers that sit out this step (``fairness.TurnBudget``), keeping their
        slots. ``decodes_elsewhere``: another engine on the device decodes (its streams wait)."""
        batch = ScheduledBatch([], [], [], [])
        self._preempt_for_fairness(batch)
        allowed = self.protected_callers() if defer_unprotected_prompts else None
        if hold_back:
            everyone = {s.caller for s in (*self.running, *self.waiting)}
            allowed = (everyone if allowed is None else allowed) - hold_back
        # Decodes first, then prompt chunks, lighter callers' first (fewest running; oldest first
        # within a caller). A waiting caller lighter than a running prompt's is admitted before
        # it takes the budget: else a flood's long prompts would hold it and starve light callers.
        per_caller = Counter(s.caller for s in self.running)
        lightest_waiting = min((per_caller[s.caller] for s in self.waiting), default=None)
        prefills = sorted(
            (s for s in self.running if not s.is_decoding and (allowed is None or s.caller in allowed)),
            key=lambda s: per_caller[s.caller],
        )
        first = [s for s in self.running if s.is_decoding and s.caller not in hold_back]
        # Decode first: beside decodes (here or on the device), prompt chunks stay within prefill_cap.
        beside, slowdown = bool(first) or decodes_elsewhere, self.config.max_decode_slowdown
        self._prefill_room = prefill_cap(self.pace, slowdown) if beside and self.pace else None
        later: list[Sequence] = []
        for seq in prefills:
            heavier = lightest_waiting is not None and per_caller[seq.caller] > lightest_waiting
            (later if heavier else first).append(seq)
        budget = self._schedule_running(batch, first, self.config.max_num_batched_tokens)
        if later:
            budget = self._schedule_waiting(
                batch, budget, lighter_than=per_caller[later[0].caller], only=allowed
            )
            budget = self._schedule_running(batch, later, budget)
        self._schedule_waiting(batch, budget, only=allowed)
        if not batch.seqs:
            return None
        decodes = sum(
            1 for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if n == 1 and s.is_decoding
        )
        batch.kind = "decode" if decodes == batch.num_seqs else "prefill" if decodes == 0 else "mixed"
        return batch

    def _schedule_running(self, batch: ScheduledBatch, order: list[Sequence], budget: int) -> int:
        """Running sequences ``order``, in that order, while budget lasts. Returns the budget left."""
        scheduled = {s.seq_id for s in batch.seqs}
        for seq in order:
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            if self._prefill_room == 0 and not seq.is_decoding:
                continue  # this step's prompt tokens are spent: the decodes go first
            contended = bool(self.waiting or batch.seqs)
            n = self._chunk(seq, seq.num_tokens - seq.num_computed_tokens, budget, contended)
            want = self._spec_wanted(seq) if n == 1 else 0
            if want and not seq.draft_table.blocks and seq.num_draft_computed_tokens == 0:
                self._attach_draft_prefix(seq)  # released while speculation was off: find its blocks
            lag = seq.num_tokens - seq.num_draft_computed_tokens
            k = min(want, budget - n) if lag <= MAX_DRAFT_CATCHUP else 0
            while not self.blocks.allocate(seq.block_table, seq.num_computed_tokens + n + k):
                if k:
                    k = 0  # first give up the speculative lookahead
                    continue
                # Preempt the newest sequence not already in this step (possibly seq itself).
                victim = next(v for v in reversed(self.running) if v.seq_id not in scheduled)
                self._preempt(victim, batch)
                batch.preempted_for_blocks = True
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            scheduled.add(seq.seq_id)
            self._add_row(batch, seq, n, k, follow_draft=n > 1 or want > 0)
            budget -= n + k
        return budget

    def _schedule_waiting(
        self,
        batch: ScheduledBatch,
        budget: int,
        lighter_than: int | None = None,
        only: set[str] | None = None,
    ) -> int:
        """Waiting sequences while there is room, fairly between callers (``fairness.next_waiting``) -
        none right after a preemption for blocks: the pool is short, and a readmitted sequence
        would only be preempted again. ``lighter_than``: only while the next one's caller runs
        fewer sequences than that; ``only``: only these callers' (the next one is another's:
        stop). Returns the budget left."""
        running = Counter(s.caller for s in self.running)
        # Branches of an n > 1 request whose first branch is still computing the prompt: passed
        # over this step, never blocking the callers queued behind them.
        forks_waiting: set[int] = set()
        while (
            self.waiting
            and budget > 0
            and not batch.preempted_for_blocks
            and len(self.running) < self.config.max_num_seqs
        ):
            if self._prefill_room == 0:
                break  # a new prompt's chunk would slow the decodes past max_decode_slowdown
            seq = next_waiting(self.waiting, running, only, forks_waiting)
            if seq is None:
                break
            if lighter_than is not None and running[seq.caller] >= lighter_than:
                break
            if seq.is_finished:  # aborted while waiting
                self.waiting.remove(seq)
                continue
            if seq.fork_of is not None and not self._may_fork(seq):
                forks_waiting.add(seq.seq_id)
                continue
            n = self._allocate_new(seq, budget, contended=len(self.waiting) > 1 or bool(batch.seqs))
            if not n:
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            running[seq.caller] += 1
            batch.admitted.append(seq)
            self._add_row(batch, seq, n, 0, follow_draft=True)
            budget -= n
        return budget

    def _preempt_for_fairness(self, batch: ScheduledBatch) -> None:
        """A caller below its fair share, waiting while the batch is full, takes a slot from the
        caller furthest over its share (``fairness.fairness_victims``)."""
        for victim in fairness_victims(self.running, self.waiting, self.config.max_num_seqs):
            self._preempt(victim, batch)

    def _chunk(self, seq: Sequence, remaining: int, budget: int, contended: bool) -> int:
        """Tokens a sequence feeds this step: while others decode or wait, a prompt chunk takes at
        most half the budget, and beside decodes what is left of ``_prefill_room``; a prompt whose
        logprobs were asked for (logits at every position) at most PROMPT_LOGPROBS_CHUNK."""
        n = min(remaining, budget)
        if seq.prompt_logprobs_pending:
            n = min(n, PROMPT_LOGPROBS_CHUNK)
        if n > 1 and contended:
            n = min(n, max(1, self.config.max_num_batched_tokens // 2))
        if self._prefill_room is not None and remaining > 1:
            n = min(n, self._prefill_room)
        return n

    def _add_row(self, batch: ScheduledBatch, seq: Sequence, n: int, k: int, *, follow_draft: bool) -> None:
        """``follow_draft``: the draft feeds this step too (prefill chunks, and decodes that want
        to speculate); a decode that does not speculate leaves the draft behind, to be caught up
        in chunks when speculation pays again (``draft_tables.py``)."""
        k, draft_n = self._draft_row(seq, n, k, follow_draft)
        if self._prefill_room is not None and not seq.is_decoding:
            self._prefill_room = max(0, self._prefill_room - n)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        batch.num_spec_tokens.append(k)
        batch.num_draft_tokens.append(max(0, draft_n))

    def _may_fork(self, seq: Sequence) -> bool:
        """``n > 1`` branches wait until their first branch has computed the prompt, then share
        its full blocks."""
        parent = seq.fork_of
        assert parent is not None
        if parent.is_finished or parent.status == SequenceStatus.WAITING:
            if parent.is_finished:
                seq.fork_of = None  # nothing left to share: prefill on its own
            return parent.is_finished
        return parent.num_computed_tokens >= parent.num_prompt_tokens - 1

    def _allocate_new(self, seq: Sequence, budget: int, *, contended: bool) -> int:
        """Blocks for a sequence joining the batch: a fork of its parent's prompt blocks, or
        the prefix cache's longest match, then fresh blocks for this step's chunk. Returns the
        chunk (tokens to feed this step), 0 when the pool cannot hold it."""
        bs = self.blocks.block_size
        prefix: list[int] = []
        partial: tuple[int, int] | None = None
        if seq.fork_of is not None:
            parent = seq.fork_of
            table = self.blocks.fork(parent.block_table, min(parent.num_computed_tokens, seq.num_tokens - 1))
            cached = table.num_blocks * bs
        else:
            table = seq.block_table
            # The last token is computed: its logits give the next one. Prompt logprobs need
            # every prompt position's logits: nothing of the prompt comes from the cache.
            limit = 0 if seq.prompt_logprobs_pending else seq.num_tokens - 1
            prefix = self.blocks.match_prefix(seq.token_ids, seq.cache_salt, max_tokens=limit)
            partial = self.blocks.match_partial(seq.token_ids, prefix, seq.cache_salt, max_tokens=limit)
            cached = len(prefix) * bs + (partial[1] if partial is not None else 0)
        n = self._chunk(seq, seq.num_tokens - cached, budget, contended)
        if not self.blocks.allocate(table, cached + n, prefix, partial):
            self.blocks.free(table)  # a fork's shared refs
            return 0
        seq.block_table = table
        seq.fork_of = None
        seq.num_computed_tokens = cached
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = cached
        self._attach_draft_prefix(seq)
        return n

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Free ``seq``'s blocks and requeue it at the front; it recomputes its tokens later."""
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.num_draft_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _free(self, seq: Sequence) -> None:
        # The KV of the first num_computed_tokens tokens is valid: a partly filled last block is
        # remembered for a later prompt that continues the same way (block_manager.py).
        self.blocks.free(seq.block_table, seq.token_ids, seq.num_computed_tokens)
        if self.draft_blocks is not None:
            self.draft_blocks.free(seq.draft_table)

    # -- after the step: the one writer of sequence state ------------------------------------------
    def update_from_output(
        self, batch: ScheduledBatch, output: ModelOutput, sink: StepSink
    ) -> tuple[int, int]:
        """Apply one step's results: the draft's and the target's computed counts, the acceptance
        of each row's drafts, its grammar, then its new tokens (``sink.deliver``, which hands them
        back to ``append_tokens`` for the stop checks). Returns ``(drafted, accepted)`` tokens
        over the rows that drafted."""
        drafted_total = accepted_total = 0
        for seq, fed in zip(batch.seqs, output.draft_fed, strict=True):
            seq.num_draft_computed_tokens += fed
        for i, (seq, row) in enumerate(zip(batch.seqs, output.rows, strict=True)):
            if row is None:  # a prefill chunk short of the prompt's end
                seq.num_computed_tokens += batch.num_new_tokens[i]
                self.cache_blocks(seq)
                continue
            m, new = row.num_accepted, list(row.tokens)
            if row.num_drafted:
                drafted_total += row.num_drafted
                accepted_total += m
                seq.num_draft_tokens += row.num_drafted
                seq.num_accepted_tokens += m
                # Target KV holds the fed last token and the m accepted drafts; the draft's holds
                # what it was fed of them (never the last draft).
                base = seq.num_tokens
                seq.num_computed_tokens = base + m
                seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, base + m)
            else:
                seq.num_computed_tokens += batch.num_new_tokens[i]
            matcher = seq.params.constraint
            if matcher is not None:
                sink.on_accept(seq, m)  # the drafter rolls back the grammar past what was accepted
                if m and matcher.is_terminated:
                    # The accepted drafts completed the grammar: nothing may follow them (as when a
                    # plain step's token completes it), so the target's bonus token is dropped.
                    new.pop()
                elif not matcher.accept(new[-1]) and new[-1] not in seq.eos_token_ids:
                    sink.fail(seq, "the grammar rejected a sampled token")
                    continue
            sink.deliver(seq, new, row.logprobs)
        return drafted_total, accepted_total

    def append_tokens(
        self, seq: Sequence, tokens: list[int], text_stop: Callable[[int], bool] | None = None
    ) -> tuple[int, tuple[SequenceStatus, str] | None]:
        """Append ``tokens`` one by one, stopping at EOS, a stop id, a stop string (``text_stop(token)``:
        the detokenizer's verdict), a complete grammar, ``max_tokens`` or the context; name the blocks
        they filled. Returns how many were kept and the ``(status, reason)`` finish, if done."""
        params = seq.params
        finish: tuple[SequenceStatus, str] | None = None
        kept = 0
        for j, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            kept += 1
            if (not params.ignore_eos and tok in seq.eos_token_ids) or tok in params.stop_token_ids:
                if tok in params.stop_token_ids and params.include_stop_str_in_output and text_stop:
                    text_stop(tok)  # vLLM keeps a stop id's text with include_stop_str_in_output
                finish = (SequenceStatus.FINISHED_STOPPED, FinishReason.STOP)
                break
            if text_stop is not None and text_stop(tok):
                finish = (SequenceStatus.FINISHED_STOPPED, FinishReason.STOP)
                break
            if params.constraint is not None and params.constraint.is_terminated and j == len(tokens) - 1:
                finish = (SequenceStatus.FINISHED_STOPPED, FinishReason.STOP)
                break
            if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
                finish = (SequenceStatus.FINISHED_LENGTH, FinishReason.LENGTH)
                break
        # KV past the kept tokens is stale; never count it as computed.
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_tokens - 1)
        self.cache_blocks(seq)
        return kept, finish

    @staticmethod
    def snapshot(seqs: list[Sequence]) -> list[tuple[int, int, int]]:
        """What ``restore`` puts back: computed counts and token count per sequence."""
        return [(s.num_computed_tokens, s.num_draft_computed_tokens, s.num_tokens) for s in seqs]

    @staticmethod
    def restore(seq: Sequence, snapshot: tuple[int, int, int]) -> None:
        """Undo a failed step's effects on ``seq`` (its KV past the snapshot is never read)."""
        seq.num_computed_tokens, seq.num_draft_computed_tokens, n = snapshot
        del seq.token_ids[n:]

    def cache_blocks(self, seq: Sequence) -> None:
        """Name the blocks this step filled (target and draft), so later requests hit them."""
        self.blocks.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed_tokens)
        if self.draft_blocks is not None:
            self.draft_blocks.cache_full_blocks(seq.draft_table, seq.token_ids, seq.num_draft_computed_tokens)

    def finish(self, seq: Sequence, status: SequenceStatus, reason: str) -> None:
        """Mark ``seq`` finished wherever it is and release its blocks at once. Blocks keep their
        KV (and names) until reused, so nothing is ever moved or copied on the way out."""
        if not seq.is_finished:
            seq.finish(status, reason)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
