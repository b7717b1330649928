"""A tier's engine: ``schedule -> run -> postprocess`` over a continuous batch, one ``step()`` at a time.

Steps run on the ``DeviceWorker`` thread (see ``device.py`` for why there is exactly one).
Requests arrive from asyncio through ``submit`` (thread-safe) and get a ``RequestHandle`` whose
async iterator yields ``StepOutput``s as tokens are produced.

One step: the scheduler hands out each sequence's tokens for this step under one token budget
(decodes, prefill chunks and speculative lookahead together, see ``scheduler.py``); with a draft
(the tier below's runner: its model, its KV pool), the draft first feeds its own chunks and
proposes up to k tokens for the decoding rows; one target forward then runs every row; one
vectorised pass processes logits, samples and applies the acceptance rule; postprocess appends
tokens, names the blocks they filled (the prefix cache) and finishes what is done.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from tiers.model_runner import ModelRunner, RowInput
from tiers.output import IncrementalDetokenizer, StepOutput, TokenLogprob
from tiers.pacing import Backlog, Pace, predict_wait
from tiers.proposers import Proposal, make_proposer
from tiers.request import EngineFullError, EngineLoad, EngineObserver, RequestHandle, push_all
from tiers.sampling import sample_rows
from tiers.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tiers.sequence import FinishReason, ModelOutput, SamplingParams, Sequence, SequenceStatus
from tiers.speculative import NgramProposer, SpecController

if TYPE_CHECKING:
    from tiers.device import DeviceWorker

__all__ = ["Engine", "EngineFullError", "EngineLoad", "EngineObserver", "RequestHandle"]

log = logging.getLogger(__name__)

BACKLOG_REUSE_S = 0.01
"""How long one engine's backlog snapshot serves the other engines' wait estimates."""


@dataclass(slots=True)
class _Tracked:
    seq: Sequence
    handle: RequestHandle
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    predicted_wait: tuple[float, bool] | None = None
    """The uncalibrated wait predicted at submission and whether it was unprotected (the first
    of ``n`` only)."""


class Engine:
    def __init__(
        self,
        name: str,
        runner: ModelRunner,
        config: SchedulerConfig,
        *,
        draft_runner: ModelRunner | NgramProposer | None = None,
        speculative_tokens: int = 0,
        observer: EngineObserver | None = None,
    ) -> None:
        self.name = name
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.config = config
        if runner.capacity_tokens < config.max_model_len + speculative_tokens:
            raise ValueError(
                f"tier '{name}': the KV pool holds {runner.capacity_tokens} tokens, fewer than one "
                f"sequence of max_model_len {config.max_model_len} (+{speculative_tokens} speculative); "
                "raise the KV budget or lower max_model_len"
            )
        if isinstance(draft_runner, ModelRunner) and draft_runner.vocab_size > runner.vocab_size:
            raise ValueError(
                f"tier '{name}': the draft's logits ({draft_runner.vocab_size}) are wider than the target's "
                f"({runner.vocab_size})"
            )
        self.draft = draft_runner if speculative_tokens > 0 else None
        self.spec = SpecController(max_k=speculative_tokens if self.draft is not None else 0)
        self.eos_token_ids = self._eos_ids()
        self._shared_generator = torch.Generator().manual_seed(0)
        self.proposer = make_proposer(
            self.draft,
            self.spec,
            vocab_size=runner.vocab_size,
            eos_token_ids=self.eos_token_ids,
            generator=self._shared_generator,
            max_num_seqs=config.max_num_seqs,
        )
        self.scheduler = Scheduler(
            config,
            runner.blocks,
            self.proposer.blocks if self.proposer is not None else None,
            spec_budget=self._spec_budget,
        )
        self.observer = observer
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._tracked: dict[int, _Tracked] = {}
        self._worker: DeviceWorker | None = None
        self._k = 0
        self._delivered: set[int] = set()
        """Rows of the current step whose tokens were already appended and emitted."""
        self._outbox: list[tuple[RequestHandle, StepOutput]] | None = None
        """A step's outputs, handed to the event loop in one call when the step ends: one wake-up
        of the loop per step instead of one per row, so the loop does not take the GIL from the
        step's own postprocessing sixteen times over."""
        self.step_hook: Callable[[ScheduledBatch], None] | None = None
        """Called before each step's forwards (tests inject faults and count steps here)."""
        self.num_steps = 0
        self.pace = Pace(config.max_num_seqs, config.max_num_batched_tokens)
        """Measured step costs, for the predicted wait (``tiers/pacing.py``)."""
        self._inbox_lock = threading.Lock()
        self._inbox_tokens = 0
        """Prompt tokens of requests submitted but not yet handed to the scheduler."""
        self._inbox_callers: Counter[str] = Counter()
        """Those requests per caller: a caller's share counts its own, not a flood's."""
        self._inbox_caller_tokens: Counter[str] = Counter()
        """And their prompt tokens: a caller's own earlier requests run before its new one."""
        self._backlog_cache: tuple[float, Backlog] | None = None
        self._round_cache: dict[int, tuple[float, tuple[float, float] | None]] = {}

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen = getattr(self.runner.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, list | tuple):
                ids.update(int(x) for x in src)
        return frozenset(ids)

    # -- lifecycle ------------------------------------------------------------------------------
    def attach(self, worker: DeviceWorker) -> None:
        """Let ``worker`` (the one thread that runs every torch op) drive this engine."""
        self._worker = worker
        worker.add_engine(self)

    @property
    def is_alive(self) -> bool:
        return self._worker is not None and self._worker.is_alive

    def load(self, *, predicted: bool = True) -> EngineLoad:
        """Queue and batch now; ``predicted=False`` skips the wait estimate (admission asks for
        the caller's own, ``predicted_wait``)."""
        sched = self.scheduler
        waiting = sched.num_waiting + self._inbox.qsize()
        return EngineLoad(
            num_running=sched.num_running,
            num_waiting=waiting,
            max_num_seqs=self.config.max_num_seqs,
            max_waiting=self.config.max_waiting,
            kv_tokens=sched.num_kv_tokens(),
            kv_capacity=self.runner.capacity_tokens,
            predicted_wait_s=self.predicted_wait(None) if predicted else 0.0,
        )

    def predicted_wait(self, caller: str | None = "", prompt_tokens: int = 0) -> float:
        """Seconds until a request from ``caller`` of ``prompt_tokens`` submitted now gets its
        first token: the prompt work queued ahead of it (the scheduler's fair sharing decides what
        is ahead, ``Scheduler.backlog``), the other tiers' steps on the same device thread, and a
        slot's wait when it must queue (``tiers/pacing.py``), scaled by how such estimates
        compared with the waits requests actually had. ``caller=None``: a request that holds no
        share (the engine's load as a whole)."""
        raw, unprotected = self._estimate(caller, prompt_tokens)
        return self.pace.calibrated(raw, unprotected)

    def _estimate(self, caller: str | None, prompt_tokens: int) -> tuple[float, bool]:
        """The uncalibrated wait, and whether the request would be unprotected (may be pushed back
        by later arrivals, ``Backlog.protected``)."""
        with self._inbox_lock:
            inbox_tokens = self._inbox_tokens
            inbox_mine = self._inbox_callers[caller] if caller is not None else 0
            inbox_mine_tokens = self._inbox_caller_tokens[caller] if caller is not None else 0
        own = self.scheduler.backlog(
            caller,
            self._inbox.qsize(),
            inbox_tokens,
            self.pace.output_len,
            inbox_mine=inbox_mine,
            inbox_mine_tokens=inbox_mine_tokens,
        )
        others = [
            (e.pace, e._whole_backlog())
            for e in (self._worker.engines if self._worker is not None else ())
            if e is not self and e.has_work()
        ]
        return predict_wait(self.pace, own, prompt_tokens, others), not own.protected

    def _whole_backlog(self) -> Backlog:
        """Everything queued here, as another engine's estimate sees it. Reused for a few
        milliseconds: every admission asks each tier about every other one, and a burst of
        requests would otherwise rescan the same sequences hundreds of times a second."""
        now = time.monotonic()
        cached = self._backlog_cache
        if cached is not None and now - cached[0] < BACKLOG_REUSE_S:
            return cached[1]
        backlog = self.scheduler.backlog(None, self._inbox.qsize(), self._inbox_tokens)
        self._backlog_cache = (now, backlog)
        return backlog

    def decode_round(self, extra: int = 0) -> tuple[float, float] | None:
        """``(seconds, tokens per row)`` of this engine's decode step once the sequences it holds
        (running, waiting, submitted) and ``extra`` more fill its batch (at most
        ``max_num_seqs``), at the k its controller would pick; ``(0, 1)`` for an empty batch and
        ``None`` before any step was measured. Any thread: load-aware routing prices a sequence
        here by it (``tiers.pacing.routing_cost``)."""
        sched = self.scheduler
        batch = min(
            self.config.max_num_seqs, sched.num_running + sched.num_waiting + self._inbox.qsize() + extra
        )
        if batch <= 0:
            return (0.0, 1.0)
        now = time.monotonic()
        cached = self._round_cache.get(batch)
        if cached is not None and now - cached[0] < BACKLOG_REUSE_S:
            return cached[1]  # a burst of decisions prices the same state: reuse it briefly
        try:
            priced = self.spec.best_round(batch)
        except RuntimeError:  # the device thread added a cost point mid-read: price it as unknown
            return None
        self._round_cache[batch] = (now, priced)
        return priced

    # -- intake (any thread) --------------------------------------------------------------------
    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, *, cache_salt: str = "", caller: str = ""
    ) -> RequestHandle:
        """Queue a request; raises ``EngineFullError`` when the waiting queue is full and
        ``ValueError`` when the prompt cannot fit the context. ``cache_salt`` names the
        prefix-cache partition (the tenant): KV is shared only within one. ``caller``: who asked,
        for fair sharing of batch slots (``Sequence.caller``)."""
        return self.submit_n(prompt_token_ids, [params], cache_salt=cache_salt, caller=caller)[0]

    def submit_n(
        self,
        prompt_token_ids: list[int],
        params: list[SamplingParams],
        *,
        cache_salt: str = "",
        caller: str = "",
    ) -> list[RequestHandle]:
        """``n > 1``: one sequence per entry of ``params`` over the same prompt (each its own seed
        and constraint); the later ones fork the first one's prompt blocks once it has computed
        them, so the prompt is computed once."""
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens; "
                f"this tier's context is {self.config.max_model_len}"
            )
        load = self.load(predicted=False)
        if load.num_waiting + len(params) - 1 >= load.max_waiting + max(
            0, load.max_num_seqs - load.num_running
        ):
            raise EngineFullError(f"tier '{self.name}' queue is full")
        loop = asyncio.get_running_loop()
        handles = []
        leader: Sequence | None = None
        predicted = self._estimate(caller, len(prompt_token_ids))
        with self._inbox_lock:  # the later forks reuse the first one's prompt blocks
            self._inbox_tokens += len(prompt_token_ids)
            self._inbox_callers[caller] += len(params)
            self._inbox_caller_tokens[caller] += len(prompt_token_ids)
        for p in params:
            seq = Sequence(
                list(prompt_token_ids),
                p,
                eos_token_ids=self.eos_token_ids,
                cache_salt=cache_salt,
                caller=caller,
            )
            seq.fork_of = leader
            leader = leader or seq
            handle = RequestHandle(self, seq, loop)
            gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            self._inbox.put(
                (
                    "add",
                    _Tracked(
                        seq,
                        handle,
                        IncrementalDetokenizer(self.tokenizer, p.stop, p.include_stop_str_in_output),
                        gen,
                        predicted_wait=predicted if seq is leader else None,
                    ),
                )
            )
            handles.append(handle)
        self._wakeup()
        return handles

    def abort(self, seq: Sequence) -> None:
        seq.abort_requested = True
        self._inbox.put(("abort", seq))
        self._wakeup()

    def _wakeup(self) -> None:
        if self._worker is not None:
            self._worker.wake()

    def _drain_inbox(self) -> None:
        while True:
            try:
                op, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                with self._inbox_lock:
                    self._inbox_callers[item.seq.caller] -= 1
                    if not self._inbox_callers[item.seq.caller]:
                        del self._inbox_callers[item.seq.caller]
                    if item.seq.fork_of is None:
                        self._inbox_tokens -= item.seq.num_prompt_tokens
                        self._inbox_caller_tokens[item.seq.caller] -= item.seq.num_prompt_tokens
                        if not self._inbox_caller_tokens[item.seq.caller]:
                            del self._inbox_caller_tokens[item.seq.caller]
                self._tracked[item.seq.seq_id] = item
                if item.seq.abort_requested:
                    self._finish(item, SequenceStatus.FINISHED_ABORTED, FinishReason.ABORT)
                    continue
                self.scheduler.add(item.seq)
            elif op == "abort" and item.seq_id in self._tracked:
                self._finish(self._tracked[item.seq_id], SequenceStatus.FINISHED_ABORTED, FinishReason.ABORT)

    # -- one step (on the device thread) -------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    def has_protected_prefill(self) -> bool:
        """A protected caller's prompt waits here (``Scheduler.has_protected_prefill``); device
        thread only (it hands the inbox over first)."""
        self._drain_inbox()
        return self.scheduler.has_protected_prefill()

    def step(self, *, defer_unprotected_prompts: bool = False) -> bool:
        """schedule -> run -> postprocess, once. Returns False when there was nothing to run.
        ``defer_unprotected_prompts``: see ``Scheduler.schedule``."""
        self._drain_inbox()
        batch = None
        started = time.perf_counter()
        self._outbox = []
        try:
            # k for the batch these rows decode in: a wave of new prompts (none decoding yet)
            # decodes as a full batch next step, and its draft feed is decided by this k.
            sched = self.scheduler
            batch_size = max(1, min(self.config.max_num_seqs, sched.num_running + sched.num_waiting))
            self._k = self.spec.choose_k(batch_size) if self.proposer is not None else 0
            batch = self.scheduler.schedule(defer_unprotected_prompts=defer_unprotected_prompts)
            if batch is None:
                return False
            now = time.monotonic()
            for seq in batch.admitted:
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = now
            self._run_isolated(batch)
        except Exception:  # a bug in the step itself: fail what it touched, keep the engine alive
            log.exception("engine %s: step failed", self.name)
            for seq in list(batch.seqs if batch is not None else self.scheduler.running):
                self._fail(seq, "internal error in the engine step")
        finally:
            outbox, self._outbox = self._outbox, None
            push_all(outbox)
        elapsed = time.perf_counter() - started
        if batch is not None:
            tokens = sum(batch.num_new_tokens)  # decodes and prompt chunks (verification excluded)
            self.pace.on_step(started, elapsed, tokens, batch.num_seqs, self.scheduler.has_work())
        self.num_steps += 1
        if self.observer is not None and batch is not None:
            self.observer.on_step(self.name, batch.kind, batch.num_seqs, elapsed)
        return True

    @property
    def num_deferred_draft_feeds(self) -> int:
        """Prompts whose last chunk ran without the draft (its feed deferred to the first decode)."""
        return self.proposer.num_deferred_feeds if self.proposer is not None else 0

    def abort_all(self) -> None:
        """Finish every request (shutdown), so no consumer waits forever."""
        self._drain_inbox()
        for tracked in list(self._tracked.values()):
            self._finish(tracked, SequenceStatus.FINISHED_ABORTED, FinishReason.ABORT)

    def _spec_budget(self, seq: Sequence) -> int:
        """How many tokens ``seq`` may draft this step: none for penalized requests (their logits
        depend on the tokens before them) and for seeded sampled ones (the documented contract: a
        seed reproduces a request's output, which a load-dependent k would not), never past
        max_tokens or the context."""
        p = seq.params
        if self._k == 0 or p.has_penalties or (p.seed is not None and not p.is_greedy):
            return 0
        room = min(seq.num_remaining_tokens - 1, self.config.max_model_len - seq.num_tokens - 1)
        return max(0, min(self._k, room))

    def _run_isolated(self, batch: ScheduledBatch) -> None:
        """Run the batch; if it raises, find the culprit by running each sequence alone, so an
        error inside one request's generation fails that request only. Retrying is safe: a
        forward only writes KV at positions >= num_computed_tokens, which nothing has read yet."""
        snapshot = self.scheduler.snapshot(batch.seqs)
        try:
            self._run(batch)
            return
        except Exception as exc:
            self._restore(batch, snapshot)
            if batch.num_seqs == 1:
                self._fail(batch.seqs[0], f"{type(exc).__name__}: {exc}")
                log.warning("engine %s: request failed: %s", self.name, traceback.format_exc(limit=3))
                return
        delivered = set(self._delivered)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            if seq.is_finished or seq.seq_id in delivered:
                continue
            alone = ScheduledBatch([seq], [n], [0], [0], kind=batch.kind)
            try:
                self._run(alone)
            except Exception as exc:
                self._restore(alone, [snapshot[i]])
                log.warning("engine %s: request %d failed: %s", self.name, seq.seq_id, exc)
                self._fail(seq, f"{type(exc).__name__}: {exc}")

    def _restore(self, batch: ScheduledBatch, snapshot: list[tuple[int, int, int]]) -> None:
        """Undo a failed step for the rows it had not yet delivered (delivered tokens stand: a
        retry must never emit them twice)."""
        for seq, snap in zip(batch.seqs, snapshot, strict=True):
            if seq.seq_id in self._delivered:
                continue
            self.scheduler.restore(seq, snap)
            if self.proposer is not None:
                self.proposer.forget(seq)

    def _run(self, batch: ScheduledBatch) -> None:
        """Draft, one target forward over every row, sample, and let the scheduler apply it."""
        self._delivered = set()
        if self.step_hook is not None:
            self.step_hook(batch)
        proposal = (
            self.proposer.propose(batch, self._k)
            if self.proposer is not None
            else Proposal.empty(batch.num_seqs)
        )
        rows = []
        for seq, n, d in zip(batch.seqs, batch.num_new_tokens, proposal.drafts, strict=True):
            start = seq.num_computed_tokens
            fed = seq.token_ids[start : start + n]
            if d is not None and d.tokens:
                rows.append(RowInput(seq.block_table.blocks, start, fed + d.tokens, "all"))
            else:
                last: Literal["last", "none"] = "last" if start + n == seq.num_tokens else "none"
                rows.append(RowInput(seq.block_table.blocks, start, fed, last))
        started = time.perf_counter()
        logits = self.runner.forward(rows)
        drafted = {len(d.tokens) if d else 0 for d in proposal.drafts}
        # An n-gram lookup proposes for some rows only: such a step's cost is not that of every
        # row feeding 1 + max tokens, which its key would say, so only uniform steps are recorded.
        ragged = self.proposer is not None and self.proposer.ragged
        if batch.kind == "decode" and (len(drafted) == 1 or not ragged):
            self.spec.record_target(batch.num_seqs, 1 + max(drafted), time.perf_counter() - started)
        generators = [self._generator(seq) for seq in batch.seqs]
        outcome = sample_rows(
            batch.seqs, logits, proposal.drafts, generators, self._shared_generator, self.eos_token_ids
        )
        drafted_total, accepted_total = self.scheduler.update_from_output(
            batch, ModelOutput(outcome, proposal.fed), self
        )
        if drafted_total:
            self.spec.record_acceptance(drafted_total, accepted_total)
            if self.observer is not None:
                self.observer.on_spec(self.name, drafted_total, accepted_total)

    # -- the scheduler's sink (``StepSink``) ------------------------------------------------------
    def on_accept(self, seq: Sequence, num_accepted: int) -> None:
        if self.proposer is not None:
            self.proposer.on_accept(seq, num_accepted)

    def deliver(self, seq: Sequence, tokens: list[int], logprobs: list[Any] | None) -> None:
        self._postprocess(seq, tokens, logprobs)

    def fail(self, seq: Sequence, message: str) -> None:
        self._fail(seq, message)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        tracked = self._tracked.get(seq.seq_id)
        return tracked.generator if tracked is not None else None

    # -- after sampling --------------------------------------------------------------------------
    def _postprocess(
        self, seq: Sequence, new_tokens: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> None:
        """Hand the new tokens to the scheduler (it appends them and checks the stops), then emit
        them and finish what is done."""
        tracked = self._tracked.get(seq.seq_id)
        if tracked is None or seq.is_finished:
            return
        self._delivered.add(seq.seq_id)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
            # A request preempted before its first token waited for a reason no estimate at
            # its submission could see (another caller took its slot): it says nothing of the model.
            if tracked.predicted_wait is not None and not seq.num_preemptions:
                # Calibrate the estimate on what this request actually waited (tiers/pacing.py).
                raw, unprotected = tracked.predicted_wait
                self.pace.observe(raw, seq.first_token_time - seq.arrival_time, unprotected)
        kept, finish = self.scheduler.append_tokens(seq, new_tokens, tracked.detok.add_and_check)
        tracked.pending_tokens.extend(new_tokens[:kept])
        if logprobs is not None:
            tracked.pending_logprobs.extend(logprobs[:kept])
        if finish is not None:
            self._finish(tracked, *finish)
        else:
            self._emit(tracked, None)

    def _emit(self, tracked: _Tracked, finish_reason: str | None, error: str | None = None) -> None:
        seq = tracked.seq
        text = tracked.detok.take(final=finish_reason is not None)
        if not text and not tracked.pending_tokens and finish_reason is None:
            return
        out = StepOutput(
            text=text,
            token_ids=tracked.pending_tokens,
            finish_reason=finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens,
            error=error,
            logprobs=tracked.pending_logprobs if seq.params.logprobs is not None else None,
        )
        tracked.pending_tokens = []
        tracked.pending_logprobs = []
        if finish_reason is not None:
            out.timings = _timings(seq)
        if self._outbox is not None:
            self._outbox.append((tracked.handle, out))
        else:
            tracked.handle._push_threadsafe(out)

    def _finish(
        self, tracked: _Tracked, status: SequenceStatus, reason: str, error: str | None = None
    ) -> None:
        seq = tracked.seq
        self.scheduler.finish(seq, status, reason)
        if self.proposer is not None:
            self.proposer.forget(seq)
        seq.error = error
        self._tracked.pop(seq.seq_id, None)
        if seq.first_scheduled_time is not None or seq.num_output_tokens:
            self.pace.on_finish(seq.num_output_tokens)
        self._emit(tracked, reason, error)
        if self.observer is not None:
            self.observer.on_finish(self.name, seq)

    def _fail(self, seq: Sequence, message: str) -> None:
        tracked = self._tracked.get(seq.seq_id)
        if tracked is not None:
            self._finish(tracked, SequenceStatus.FINISHED_ERROR, FinishReason.ERROR, message)

    # -- warm-up ---------------------------------------------------------------------------------
    def warmup(self) -> None:
        """One real forward per model (the readiness bar), then a timing profile that seeds the
        speculative cost model at batch sizes 1, 2, 4... and ``max_num_seqs``. Runs before the
        loop starts; its blocks are returned unnamed."""
        prompt = self.tokenizer.encode("Hello, how are you today?") or [0]
        self.runner.forward_scratch([prompt])
        # A full-budget chunk too: the first forward of a new large shape pays one-off kernel
        # setup (seconds for oneDNN on the CPU), which the first long prompt must not.
        chunk = min(self.config.max_num_batched_tokens, self.config.max_model_len - 1)
        long_prompt = (prompt * (chunk // len(prompt) + 1))[:chunk]
        self.runner.forward_scratch([long_prompt])
        # Then the costs the predicted wait starts from (tiers/pacing.py): a token of a prompt
        # chunk, and a decode step of a full batch.
        started = time.perf_counter()
        self.runner.forward_scratch([long_prompt])
        token_cost = (time.perf_counter() - started) / chunk
        started = time.perf_counter()
        self.runner.forward_scratch([prompt[:1]] * self.config.max_num_seqs, start=32)
        self.pace.seed(token_cost=token_cost, decode_cost=time.perf_counter() - started)
        ctx = 32
        sizes = sorted(
            {min(1 << i, self.config.max_num_seqs) for i in range(12)} | {self.config.max_num_seqs}
        )
        if self.proposer is None or self.spec.max_k == 0:
            # The plain step at each batch size: what load-aware routing prices a row by.
            for b in sizes:
                for _ in range(2):
                    started = time.perf_counter()
                    self.runner.forward_scratch([prompt[:1]] * b, start=ctx)
                    self.spec.record_target(b, 1, time.perf_counter() - started)
            return
        decode_cost = self.proposer.profile(self.runner, prompt, sizes, ctx)
        if decode_cost is not None:
            self.pace.seed(decode_cost=decode_cost)


def _timings(seq: Sequence) -> dict[str, float]:
    """Monotonic timestamps of the request's phases (telemetry turns them into spans and histograms)."""
    t = {"arrival": seq.arrival_time}
    for name, value in (
        ("scheduled", seq.first_scheduled_time),
        ("first_token", seq.first_token_time),
        ("finish", seq.finish_time),
    ):
        if value is not None:
            t[name] = value
    return t
