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

Fairness between callers (``Sequence.caller``: tenant or key): batch slots go first to the caller
with the fewest running sequences, each caller's own requests in arrival order, and when the batch
is full a caller below its share (``max_num_seqs`` / busy callers) preempts the newest sequence of
the caller furthest over it. One caller's flood therefore never holds a lighter caller's request
longer than a step or two, and the flood's own queue keeps its order (its waits stay predictable).

Draft-side KV (speculative tiers) follows the target: a sequence's draft table is grown for the
chunk the draft will feed this step, and a sequence whose draft cannot get blocks simply does not
speculate (drafting is an optimisation; it never preempts anything).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tiers.block_manager import BlockManager
from tiers.pacing import Backlog
from tiers.sequence import FinishReason, ModelOutput, Sequence, SequenceStatus

__all__ = ["ScheduledBatch", "Scheduler", "SchedulerConfig", "StepSink"]

MAX_DRAFT_CATCHUP = 8
"""A sequence speculates this step only if its draft is at most this many tokens behind; a longer
backlog (after plain steps) is caught up in chunks first."""


class StepSink(Protocol):
    """Where ``Scheduler.update_from_output`` hands each row's outcome (the engine)."""

    def on_accept(self, seq: Sequence, num_accepted: int) -> None:
        """The target settled ``seq``'s proposal at ``num_accepted`` drafts."""

    def deliver(self, seq: Sequence, tokens: list[int], logprobs: list[Any] | None) -> None:
        """New tokens for ``seq`` (appended by ``Scheduler.append_tokens``), then emitted."""

    def fail(self, seq: Sequence, message: str) -> None:
        """``seq`` cannot go on (finish it with an error)."""


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    """Sequences in one batch (a bound on the batch, not on memory: blocks are)."""
    max_num_batched_tokens: int = 512
    """Tokens one step may feed the target: decodes + speculative tokens + prefill chunks."""
    max_model_len: int = 2048
    """Prompt plus output tokens a sequence may hold."""
    max_waiting: int = 64
    """Sequences allowed to wait for a batch slot; the engine refuses more."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs a token each step"
            )


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]
    """Tokens of ``token_ids`` fed to the target per sequence, speculative tokens not included."""
    num_spec_tokens: list[int]
    """Speculative tokens the engine may draft per sequence (0: plain)."""
    num_draft_tokens: list[int]
    """Tokens of ``token_ids`` fed to the draft per sequence before drafting (catch-up)."""
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    preempted_for_blocks: bool = False
    """A sequence was preempted because the pool ran short (not for fairness): admit no one."""
    kind: str = "decode"
    """For metrics: ``decode`` (every row one token behind), ``prefill`` (none is) or ``mixed``."""

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens) + sum(self.num_spec_tokens)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        draft_blocks: BlockManager | None = None,
        *,
        spec_budget: Callable[[Sequence], int] | None = None,
    ) -> None:
        """``spec_budget(seq)``: most speculative tokens the engine would draft for ``seq`` this
        step (0 when it should not speculate); the scheduler fits them into budget and blocks."""
        self.config = config
        self.blocks = blocks
        self.draft_blocks = draft_blocks
        self.spec_budget = spec_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- intake ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` at the back (preempted sequences go back to the front: they already hold
        a turn). Which waiting sequence joins the batch next is decided per caller (``_next_waiting``)."""
        self.waiting.append(seq)

    def fair_share(self, num_callers: int) -> int:
        """Batch slots each of ``num_callers`` busy callers is entitled to."""
        return max(1, self.config.max_num_seqs // max(1, num_callers))

    def protected_callers(self) -> set[str]:
        """Callers below their fair share while another caller is busy here too (what
        ``backlog`` calls protected): their prompts go before anyone else's."""
        held = Counter(s.caller for s in [*self.running, *self.waiting] if not s.is_finished)
        if len(held) < 2:
            return set()
        share = self.fair_share(len(held))
        return {c for c, n in held.items() if n < share}

    def has_protected_prefill(self) -> bool:
        """A protected caller's prompt is not yet computed (waiting or running)."""
        callers = self.protected_callers()
        return bool(callers) and any(
            s.caller in callers and not s.is_decoding and not s.is_finished
            for s in [*self.running, *self.waiting]
        )

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
        """What a new request from ``caller`` finds ahead of it (a snapshot; any thread), with
        ``inbox`` requests of ``inbox_tokens`` prompt tokens not yet handed to the scheduler
        (``inbox_mine`` of them, of ``inbox_mine_tokens`` tokens, the caller's own).
        ``caller=None``: a request that holds no share (the whole backlog is ahead of it).

        A caller below its fair share gets a slot at once (free, or preempted from a caller over
        its share) and its prompt runs after the running prefills of callers no heavier and after
        its own earlier requests (a caller's requests keep their order); any other
        request also waits for the queued prompts of callers running no more than its own (all of
        them for ``None``), and for a slot once the batch is full: the steps until the
        running sequences have finished often enough (``expected_len``: output tokens a sequence
        is expected to produce, capped by each one's ``max_tokens``)."""
        running, waiting = list(self.running), list(self.waiting)
        decoding = sum(1 for s in running if s.is_decoding)
        running_prefill = sum(s.num_tokens - s.num_computed_tokens for s in running if not s.is_decoding)
        if caller is not None:
            per_caller = Counter(s.caller for s in running)
            mine = sum(1 for s in [*running, *waiting] if s.caller == caller)
            callers = per_caller.keys() | {s.caller for s in waiting} | {caller}
            # A lone caller is protected by nothing: any caller arriving after it is lighter and
            # goes first. (Counted as protected, a flood's requests, pushed back by a light
            # tenant's, taught the protected calibration a 4x ratio that then refused that tenant.)
            if len(callers) > 1 and mine + inbox_mine < self.fair_share(len(callers)):
                # Its prompt goes before those of callers running more than it does.
                ahead = sum(
                    s.num_tokens - s.num_computed_tokens
                    for s in running
                    if not s.is_decoding and per_caller[s.caller] <= mine + 1
                )
                ahead += sum(s.num_tokens - s.num_computed_tokens for s in waiting if s.caller == caller)
                return Backlog(ahead + inbox_mine_tokens, decoding, 0, protected=True)
            # Free slots go to the waiting caller running the fewest (``_next_waiting``): only
            # the queued requests of callers running no more than this one are ahead of it.
            waiting = [s for s in waiting if per_caller[s.caller] <= per_caller[caller]]
        queued = sum(s.num_tokens - s.num_computed_tokens for s in waiting)
        protected = self.protected_callers() if caller is None else set()
        protected_prefill = sum(
            s.num_tokens - s.num_computed_tokens
            for s in [*running, *waiting]
            if s.caller in protected and not s.is_decoding
        )
        slots_ahead = max(0, len(running) + len(waiting) + inbox + 1 - self.config.max_num_seqs)
        slot_steps = 0.0
        if slots_ahead:
            # The k-th slot frees when the k-th shortest remaining sequence ends, among those
            # holding the batch's slots once the free ones are taken: the running ones, and the
            # first of the queue ahead for their whole lives. (Counting only the running ones
            # left a burst that landed on an idle engine with no slot wait at all: measured, 70
            # requests in 0.3 s were all admitted to the small tier and the last waited 24 s.)
            # Beyond the batch, slots turn over once per expected lifetime.
            budget = self.config.max_num_batched_tokens
            left = [_steps_left(s, expected_len, budget) for s in running]
            free = max(0, self.config.max_num_seqs - len(running))
            left += [_steps_left(s, expected_len, budget) for s in waiting[:free]]
            left += [1.0 + max(1.0, expected_len)] * min(inbox, free - min(free, len(waiting)))
            left.sort()
            laps, k = divmod(slots_ahead - 1, len(left))
            slot_steps = left[k] + laps * max(1.0, expected_len)
        return Backlog(
            running_prefill + queued + inbox_tokens,
            decoding,
            slots_ahead,
            slot_steps=slot_steps,
            protected_prefill_tokens=protected_prefill,
        )

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
    def schedule(self, *, defer_unprotected_prompts: bool = False) -> ScheduledBatch | None:
        """Pick the next step's work; ``None`` when there is nothing to run.

        ``defer_unprotected_prompts``: a protected caller's prompt is pending somewhere on the
        device (this engine or another sharing it): run decodes and protected callers' prompts
        only, so the device's turn comes round to that prompt sooner (the other tiers' long
        prompt chunks were most of a protected request's wait)."""
        batch = ScheduledBatch([], [], [], [])
        self._preempt_for_fairness(batch)
        allowed = self.protected_callers() if defer_unprotected_prompts else None
        # Decodes first (a long prompt's chunk must never starve them), then prompt chunks, the
        # lighter callers' first (fewest running sequences; oldest first within a caller). A
        # waiting caller lighter than some running prompt's is admitted before that prompt takes
        # the budget: otherwise a flood's long prompts would hold every step's budget and a
        # light caller would not even get its slot.
        per_caller = Counter(s.caller for s in self.running)
        lightest_waiting = min((per_caller[s.caller] for s in self.waiting), default=None)
        prefills = sorted(
            (s for s in self.running if not s.is_decoding and (allowed is None or s.caller in allowed)),
            key=lambda s: per_caller[s.caller],
        )
        first = [s for s in self.running if s.is_decoding]
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
            contended = bool(self.waiting or batch.seqs)
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget, contended)
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
        """Waiting sequences while there is room, fairly between callers (``_next_waiting``) -
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
            seq = self._next_waiting(running, only, forks_waiting)
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

    def _next_waiting(
        self, running: Counter[str], only: set[str] | None = None, passed: set[int] | None = None
    ) -> Sequence | None:
        """Fair queuing between callers: the waiting sequence of the caller with the fewest
        running sequences goes next; within one caller, queue order (its preempted sequences,
        then its arrivals). A caller's own requests therefore never overtake each other, so the
        wait admission predicted for one is not stretched by the same caller's later arrivals.
        ``only``: among these callers' (``None`` when none of theirs waits); ``passed``: sequence
        ids not to pick (branches waiting for their first branch's prompt)."""
        best: Sequence | None = None
        for seq in self.waiting:
            if (only is not None and seq.caller not in only) or (passed and seq.seq_id in passed):
                continue
            if best is None or running[seq.caller] < running[best.caller]:
                best = seq
        return best

    def _preempt_for_fairness(self, batch: ScheduledBatch) -> None:
        """A caller below its fair share of batch slots, waiting while the batch is full, takes a
        slot from the caller furthest over its share: that caller's newest running sequence is
        preempted by recompute (it has done the least work; its full blocks stay named in the
        prefix cache, so the recompute is mostly cache hits). Without this a flooding caller keeps
        every slot and a light caller waits for the flood's answers to finish (vLLM's priority
        preemption, with the caller's share as the priority)."""
        if len(self.running) < self.config.max_num_seqs or not self.waiting:
            return
        running = Counter(s.caller for s in self.running)
        waiting = Counter(s.caller for s in self.waiting if not s.is_finished)
        share = self.fair_share(len(running.keys() | waiting.keys()))
        for caller in list(waiting):
            while waiting[caller] and running[caller] < share:
                victim_caller, held = running.most_common(1)[0]
                if held <= share:
                    return
                victim = next(s for s in reversed(self.running) if s.caller == victim_caller)
                self._preempt(victim, batch)
                running[victim_caller] -= 1
                running[caller] += 1  # the slot it frees is this caller's (``_next_waiting``)
                waiting[caller] -= 1

    def _chunk(self, remaining: int, budget: int, contended: bool) -> int:
        """Tokens a sequence feeds this step. A long prompt may not hold the whole budget while
        others decode or wait to be admitted (vLLM's long_prefill_token_threshold): a chunk takes
        at most half, so a decode's step (its inter-token gap) costs at most half a full-budget
        forward."""
        n = min(remaining, budget)
        if n > 1 and contended:
            n = min(n, max(1, self.config.max_num_batched_tokens // 2))
        return n

    def _spec_wanted(self, seq: Sequence) -> int:
        if self.spec_budget is None or self.draft_blocks is None or not seq.is_decoding:
            return 0
        return self.spec_budget(seq)

    def _add_row(self, batch: ScheduledBatch, seq: Sequence, n: int, k: int, *, follow_draft: bool) -> None:
        """``follow_draft``: the draft feeds this step too (prefill chunks, and decodes that want
        to speculate); a decode that does not speculate leaves the draft behind, to be caught up
        in chunks when speculation pays again."""
        if self.draft_blocks is not None and not k and not self._may_speculate(seq):
            # Speculation is off for this row: the draft is not fed (work for nothing while it
            # stays off) and holds none of the lower tier's pool, which that tier's own requests
            # need; its full blocks keep their names and are found again when speculation resumes.
            self._release_draft(seq)
            draft_n = 0
        else:
            draft_n = self._draft_feed(seq, n, k) if follow_draft else 0
            if k and draft_n < 0:
                k, draft_n = 0, self._draft_feed(seq, n, 0)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        batch.num_spec_tokens.append(k)
        batch.num_draft_tokens.append(max(0, draft_n))

    def _draft_feed(self, seq: Sequence, n: int, k: int) -> int:
        """Tokens the draft feeds this step: with ``k``, its whole backlog (then it proposes k);
        without, up to the target's chunk end, at most one step budget. -1 when its blocks
        cannot be had (the row then runs without drafting)."""
        if self.draft_blocks is None:
            return 0
        if not seq.draft_table.blocks and seq.num_draft_computed_tokens == 0:
            self._attach_draft_prefix(seq)  # released while speculation was off: find its blocks
        dc = seq.num_draft_computed_tokens
        if k:
            end = seq.num_tokens
        else:
            end = min(
                seq.num_computed_tokens + n, seq.num_tokens - 1, dc + self.config.max_num_batched_tokens
            )
        feed = max(0, end - dc)
        if feed == 0 and k == 0:
            return 0
        if not self.draft_blocks.allocate(seq.draft_table, dc + feed + max(0, k - 1)):
            return -1
        return feed

    def _may_speculate(self, seq: Sequence) -> bool:
        """The engine speculates this step and ``seq`` may draft (no ``spec_budget``: always)."""
        return self.spec_budget is None or self.spec_budget(seq) > 0

    def _release_draft(self, seq: Sequence) -> None:
        assert self.draft_blocks is not None
        if seq.draft_table.blocks:
            self.draft_blocks.free(seq.draft_table, seq.token_ids, seq.num_draft_computed_tokens)
        seq.num_draft_computed_tokens = 0

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
            limit = seq.num_tokens - 1  # the last token is computed: its logits give the next one
            prefix = self.blocks.match_prefix(seq.token_ids, seq.cache_salt, max_tokens=limit)
            partial = self.blocks.match_partial(seq.token_ids, prefix, seq.cache_salt, max_tokens=limit)
            cached = len(prefix) * bs + (partial[1] if partial is not None else 0)
        n = self._chunk(seq.num_tokens - cached, budget, contended)
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

    def _attach_draft_prefix(self, seq: Sequence) -> None:
        """A prefix-cache hit in the draft's pool skips the draft's prefill of those tokens too."""
        if self.draft_blocks is None or seq.draft_table.blocks:
            return
        hit = self.draft_blocks.match_prefix(seq.token_ids, seq.cache_salt, max_tokens=seq.num_tokens - 1)
        if hit and self.draft_blocks.allocate(seq.draft_table, len(hit) * self.draft_blocks.block_size, hit):
            seq.num_draft_computed_tokens = len(hit) * self.draft_blocks.block_size

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
        """Append ``tokens`` one by one, stopping at EOS, a stop id, a stop string
        (``text_stop(token)``: the detokenizer's verdict), a complete grammar, ``max_tokens`` or
        the context; then name the blocks they filled. Returns how many were kept and the finish
        (``(status, reason)``) when the sequence is done; the caller finishes it (``finish``)."""
        params = seq.params
        finish: tuple[SequenceStatus, str] | None = None
        kept = 0
        for j, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            kept += 1
            if (not params.ignore_eos and tok in seq.eos_token_ids) or tok in params.stop_token_ids:
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


def _steps_left(seq: Sequence, expected_len: float, budget: int) -> float:
    """Steps until ``seq`` ends: what is left of its prompt (in budget-sized chunks), then its
    expected length (capped by ``max_tokens``) less what it has produced; a sequence already past
    that is assumed halfway through what it may still add."""
    prefill = -(-max(0, seq.num_prompt_tokens - seq.num_computed_tokens) // max(1, budget))
    out = seq.num_output_tokens
    expected = min(float(seq.params.max_tokens), expected_len)
    if out < expected:
        return prefill + expected - out
    return max(1.0, seq.num_remaining_tokens / 2)
