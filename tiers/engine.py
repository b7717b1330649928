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
from typing import TYPE_CHECKING, Any

import torch

from tiers.model_runner import ModelRunner, RowInput
from tiers.output import IncrementalDetokenizer, StepOutput, TokenLogprob
from tiers.pacing import Backlog, Pace, predict_wait
from tiers.request import EngineFullError, EngineLoad, EngineObserver, RequestHandle, push_all
from tiers.sampling import Draft as _Draft
from tiers.sampling import choose_tokens, propose_tokens, target_logits, token_logprob
from tiers.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tiers.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
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
        self.scheduler = Scheduler(
            config,
            runner.blocks,
            self.draft.blocks if self.draft is not None else None,
            spec_budget=self._spec_budget,
        )
        self.observer = observer
        self.eos_token_ids = self._eos_ids()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._tracked: dict[int, _Tracked] = {}
        self._worker: DeviceWorker | None = None
        self._shared_generator = torch.Generator().manual_seed(0)
        self._k = 0
        self._matcher_advance: dict[int, int] = {}
        """Tokens each constrained row's matcher took during this step's drafting (rolled back
        by what the target rejects, or all of it when the step fails)."""
        self._delivered: set[int] = set()
        """Rows of the current step whose tokens were already appended and emitted."""
        self._outbox: list[tuple[RequestHandle, StepOutput]] | None = None
        """A step's outputs, handed to the event loop in one call when the step ends: one wake-up
        of the loop per step instead of one per row, so the loop does not take the GIL from the
        step's own postprocessing sixteen times over."""
        self.step_hook: Callable[[ScheduledBatch], None] | None = None
        """Called before each step's forwards (tests inject faults and count steps here)."""
        self.num_steps = 0
        self.num_deferred_draft_feeds = 0
        """Prompts whose last chunk ran without the draft (its feed deferred to the first decode)."""
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
            self._k = self.spec.choose_k(batch_size) if self.draft is not None else 0
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
        snapshot = [(s.num_computed_tokens, s.num_draft_computed_tokens, s.num_tokens) for s in batch.seqs]
        self._matcher_advance = {}
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
            self._matcher_advance = {}
            try:
                self._run(alone)
            except Exception as exc:
                self._restore(alone, [snapshot[i]])
                log.warning("engine %s: request %d failed: %s", self.name, seq.seq_id, exc)
                self._fail(seq, f"{type(exc).__name__}: {exc}")

    def _restore(self, batch: ScheduledBatch, snapshot: list[tuple[int, int, int]]) -> None:
        """Undo a failed step for the rows it had not yet delivered (delivered tokens stand: a
        retry must never emit them twice)."""
        for seq, (nc, dc, n) in zip(batch.seqs, snapshot, strict=True):
            if seq.seq_id in self._delivered:
                continue
            seq.num_computed_tokens, seq.num_draft_computed_tokens = nc, dc
            del seq.token_ids[n:]
            if isinstance(self.draft, NgramProposer):
                self.draft.forget(seq.seq_id)
            advanced = self._matcher_advance.pop(seq.seq_id, 0)
            if advanced and seq.params.constraint is not None:
                seq.params.constraint.rollback(advanced)

    def _run(self, batch: ScheduledBatch) -> None:
        self._delivered = set()
        if self.step_hook is not None:
            self.step_hook(batch)
        drafts: list[_Draft | None] = (
            self._draft(batch) if self.draft is not None else [None] * batch.num_seqs
        )
        rows = []
        for seq, n, d in zip(batch.seqs, batch.num_new_tokens, drafts, strict=True):
            start = seq.num_computed_tokens
            fed = seq.token_ids[start : start + n]
            if d is not None and d.tokens:
                rows.append(RowInput(seq.block_table.blocks, start, fed + d.tokens, "all"))
            else:
                rows.append(
                    RowInput(
                        seq.block_table.blocks, start, fed, "last" if start + n == seq.num_tokens else "none"
                    )
                )
        started = time.perf_counter()
        logits = self.runner.forward(rows)
        drafted = {len(d.tokens) if d else 0 for d in drafts}
        # An n-gram lookup proposes for some rows only: such a step's cost is not that of every
        # row feeding 1 + max tokens, which its key would say, so only uniform steps are recorded.
        if batch.kind == "decode" and (len(drafted) == 1 or not isinstance(self.draft, NgramProposer)):
            self.spec.record_target(batch.num_seqs, 1 + max(drafted), time.perf_counter() - started)
        self._sample_and_accept(batch, drafts, logits)

    # -- drafting ------------------------------------------------------------------------------
    def _draft(self, batch: ScheduledBatch) -> list[_Draft | None]:
        """Feed the draft its chunks (catch-up and the rows' backlogs), then propose up to k
        tokens for each speculating row, one draft forward per proposed position."""
        assert self.draft is not None
        if isinstance(self.draft, NgramProposer):
            return self._draft_ngram(batch, self.draft)
        out: list[_Draft | None] = [None] * batch.num_seqs
        if self._k == 0 and not any(batch.num_spec_tokens):
            # Speculation is off this step: feeding the draft (new prompts, above all) would be
            # work for nothing while it stays off; the scheduler catches the draft up in chunks
            # when it is back on. Measured: large at 16 streams spent ~2 s per wave of 16 new
            # prompts in the int4 draft's prefill while never drafting (156 vs 209 tok/s).
            return out
        seqs = batch.seqs
        # A prompt's last chunk gives the first token from the target alone: the draft's feed of
        # it is deferred, so TTFT never pays for the draft's prefill. The scheduler then catches
        # the draft up in the row's first decode step, and it speculates from the next one. The
        # last chunk may be one token: the prefix cache serves prompts to the token.
        wants = [i for i, n in enumerate(batch.num_draft_tokens) if n > 0]
        feeding = [
            i
            for i in wants
            if not (
                batch.num_spec_tokens[i] == 0
                and (batch.num_new_tokens[i] > 1 or seqs[i].num_output_tokens == 0)
                and seqs[i].num_computed_tokens + batch.num_new_tokens[i] == seqs[i].num_tokens
            )
        ]
        self.num_deferred_draft_feeds += len(wants) - len(feeding)
        if not feeding:
            return out
        rows = []
        for i in feeding:
            seq, n = seqs[i], batch.num_draft_tokens[i]
            dc = seq.num_draft_computed_tokens
            rows.append(
                RowInput(
                    seq.draft_table.blocks,
                    dc,
                    seq.token_ids[dc : dc + n],
                    "last" if batch.num_spec_tokens[i] else "none",
                )
            )
        logits = self.draft.forward(rows)
        for i, n in zip(feeding, (batch.num_draft_tokens[i] for i in feeding), strict=True):
            seqs[i].num_draft_computed_tokens += n
        active = {
            i: lg
            for i, lg in zip(feeding, logits, strict=True)
            if batch.num_spec_tokens[i] and lg is not None
        }
        props = {i: _Draft() for i in active}
        for i, d in props.items():
            out[i] = d
        while active:
            idx = list(active)
            proposed = self._propose(
                [seqs[i] for i in idx], torch.cat([active[i] for i in idx]), [props[i] for i in idx]
            )
            nxt = []
            for i, tok in zip(idx, proposed, strict=True):
                if tok is None:  # the grammar allows nothing more (complete): stop drafting
                    continue
                if len(props[i].tokens) < batch.num_spec_tokens[i]:
                    nxt.append(i)
            # A row's draft KV already holds everything before its last proposal; feed that one.
            if not nxt:
                break
            rows = []
            for i in nxt:
                seq = seqs[i]
                rows.append(
                    RowInput(
                        seq.draft_table.blocks, seq.num_draft_computed_tokens, [props[i].tokens[-1]], "last"
                    )
                )
            started = time.perf_counter()
            logits = self.draft.forward(rows)
            self.spec.record_draft(len(rows), 1, time.perf_counter() - started)
            for i in nxt:
                seqs[i].num_draft_computed_tokens += 1
            active = dict(zip(nxt, logits, strict=True))  # type: ignore[arg-type]
        return out

    def _draft_ngram(self, batch: ScheduledBatch, ngram: NgramProposer) -> list[_Draft | None]:
        """Proposals by n-gram lookup (``NgramProposer``) for the rows allowed to speculate;
        constrained rows propose nothing (their grammar would have to vet each token). The lookup
        has no KV to catch up, so every row's draft position follows its tokens."""
        out: list[_Draft | None] = [None] * batch.num_seqs
        started = time.perf_counter()
        proposed = 0
        for i, seq in enumerate(batch.seqs):
            seq.num_draft_computed_tokens = seq.num_tokens
            k = batch.num_spec_tokens[i]
            if not k or seq.params.constraint is not None:
                continue
            tokens = ngram.propose(seq.seq_id, seq.token_ids, k)
            if not tokens:
                continue
            d = out[i] = _Draft(tokens)
            if not seq.params.is_greedy:  # the draft's law is one-hot at each proposed token
                for t in tokens:
                    law = torch.zeros(self.runner.vocab_size)
                    law[t] = 1.0
                    d.probs.append(law)
            proposed += 1
        if proposed:
            self.spec.record_draft(batch.num_seqs, 1, (time.perf_counter() - started) / self._k)
        return out

    def _propose(self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[_Draft]) -> list[int | None]:
        """One draft token per row (None: the row stops drafting, its grammar being complete or
        refusing the token), advancing each constrained row's matcher over what it proposes."""
        tokens, laws, masks = propose_tokens(
            seqs, logits, self.runner.vocab_size, self.eos_token_ids, self._shared_generator
        )
        out: list[int | None] = []
        for r, seq in enumerate(seqs):
            tok, c, mask = tokens[r], seq.params.constraint, masks[r]
            stop = False
            if c is not None and mask is not None:
                if not c.accept(tok):
                    out.append(None)
                    continue
                self._matcher_advance[seq.seq_id] = self._matcher_advance.get(seq.seq_id, 0) + 1
                drafts[r].masks.append(mask)
                stop = c.is_terminated
            drafts[r].tokens.append(tok)
            if r in laws:
                drafts[r].probs.append(laws[r])
            out.append(None if stop else tok)
        return out

    # -- sampling and acceptance ---------------------------------------------------------------
    def _sample_and_accept(
        self, batch: ScheduledBatch, drafts: list[_Draft | None], logits: list[torch.Tensor | None]
    ) -> None:
        seqs = batch.seqs
        # 1. Rows that choose a token this step, their logits processed (penalties, bias, grammar).
        chunks: list[torch.Tensor] = []
        owners: list[int] = []  # batch row of each chunk
        for i, (seq, raw) in enumerate(zip(seqs, logits, strict=True)):
            if raw is None:  # a prefill chunk short of the prompt's end
                seq.num_computed_tokens += batch.num_new_tokens[i]
                self.scheduler.cache_blocks(seq)
                continue
            chunks.append(target_logits(seq, raw, drafts[i], self.eos_token_ids))
            owners.append(i)
        if not chunks:
            return
        # 2-3. Acceptance and the next tokens, vectorised over the rows.
        chosen = choose_tokens(
            [seqs[i] for i in owners],
            chunks,
            [drafts[i] for i in owners],
            [self._generator(seqs[i]) for i in owners],
            self._shared_generator,
        )
        accepted, tokens, offsets, logprobs = chosen.accepted, chosen.tokens, chosen.offsets, chosen.logprobs
        # 4. Apply: computed counts, matcher state, logprobs, postprocess.
        drafted_total = accepted_total = 0
        for r, i in enumerate(owners):
            seq = seqs[i]
            d = drafts[i]
            num_drafted = len(d.tokens) if d is not None else 0
            m = accepted[r]
            new = (d.tokens[:m] if d is not None else []) + [tokens[r]]
            base = seq.num_tokens
            if num_drafted:
                drafted_total += num_drafted
                accepted_total += m
                seq.num_draft_tokens += num_drafted
                seq.num_accepted_tokens += m
                # Target KV holds the fed last token and the m accepted drafts; the draft's holds
                # what it was fed of them (never the last draft).
                seq.num_computed_tokens = base + m
                seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, base + m)
            else:
                seq.num_computed_tokens += batch.num_new_tokens[i]
            matcher = seq.params.constraint
            if matcher is not None:
                advanced = self._matcher_advance.pop(seq.seq_id, 0)
                if advanced > m:
                    matcher.rollback(advanced - m)
                if m and matcher.is_terminated:
                    # The accepted drafts completed the grammar: nothing may follow them (as when a
                    # plain step's token completes it), so the target's bonus token is dropped.
                    new.pop()
                elif not matcher.accept(new[-1]) and new[-1] not in self.eos_token_ids:
                    self._fail(seq, "the grammar rejected a sampled token")
                    continue
            lps = None
            if logprobs is not None and seq.params.logprobs is not None:
                lps = [
                    token_logprob(logprobs[offsets[r] + j], tok, seq.params.logprobs)
                    for j, tok in enumerate(new)
                ]
            self._postprocess(seq, new, lps)
        if drafted_total:
            self.spec.record_acceptance(drafted_total, accepted_total)
            if self.observer is not None:
                self.observer.on_spec(self.name, drafted_total, accepted_total)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        tracked = self._tracked.get(seq.seq_id)
        return tracked.generator if tracked is not None else None

    # -- after sampling --------------------------------------------------------------------------
    def _postprocess(
        self, seq: Sequence, new_tokens: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> None:
        """Append tokens one by one, stopping at EOS, stop ids/strings, a complete grammar,
        max_tokens or the context; then name the blocks they filled and finish what is done."""
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
        params = seq.params
        finish: tuple[SequenceStatus, str] | None = None
        for j, tok in enumerate(new_tokens):
            seq.token_ids.append(tok)
            tracked.pending_tokens.append(tok)
            if logprobs is not None:
                tracked.pending_logprobs.append(logprobs[j])
            if (not params.ignore_eos and tok in self.eos_token_ids) or tok in params.stop_token_ids:
                finish = (SequenceStatus.FINISHED_STOPPED, FinishReason.STOP)
                break
            tracked.detok.add(tok)
            if tracked.detok.stopped:
                finish = (SequenceStatus.FINISHED_STOPPED, FinishReason.STOP)
                break
            if params.constraint is not None and params.constraint.is_terminated and j == len(new_tokens) - 1:
                finish = (SequenceStatus.FINISHED_STOPPED, FinishReason.STOP)
                break
            if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
                finish = (SequenceStatus.FINISHED_LENGTH, FinishReason.LENGTH)
                break
        # KV past the kept tokens is stale; never count it as computed.
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_tokens - 1)
        self.scheduler.cache_blocks(seq)
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
        if isinstance(self.draft, NgramProposer):
            self.draft.forget(seq.seq_id)
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
        _forward_scratch(self.runner, [prompt])
        # A full-budget chunk too: the first forward of a new large shape pays one-off kernel
        # setup (seconds for oneDNN on the CPU), which the first long prompt must not.
        chunk = min(self.config.max_num_batched_tokens, self.config.max_model_len - 1)
        long_prompt = (prompt * (chunk // len(prompt) + 1))[:chunk]
        _forward_scratch(self.runner, [long_prompt])
        # Then the costs the predicted wait starts from (tiers/pacing.py): a token of a prompt
        # chunk, and a decode step of a full batch.
        started = time.perf_counter()
        _forward_scratch(self.runner, [long_prompt])
        token_cost = (time.perf_counter() - started) / chunk
        started = time.perf_counter()
        _forward_scratch(self.runner, [prompt[:1]] * self.config.max_num_seqs, start=32)
        self.pace.seed(token_cost=token_cost, decode_cost=time.perf_counter() - started)
        ctx, k = 32, self.spec.max_k
        sizes = sorted(
            {min(1 << i, self.config.max_num_seqs) for i in range(12)} | {self.config.max_num_seqs}
        )
        if self.draft is None or k == 0:
            # The plain step at each batch size: what load-aware routing prices a row by.
            for b in sizes:
                for _ in range(2):
                    started = time.perf_counter()
                    _forward_scratch(self.runner, [prompt[:1]] * b, start=ctx)
                    self.spec.record_target(b, 1, time.perf_counter() - started)
            return
        if isinstance(self.draft, NgramProposer):
            self._profile_ngram(prompt, sizes, ctx)
            return
        drafter = self.draft
        _forward_scratch(drafter, [prompt])
        for b in sizes:
            for _ in range(2):
                for tokens, runner, record in (
                    (1, self.runner, self.spec.record_target),
                    (k + 1, self.runner, self.spec.record_target),
                    (1, drafter, self.spec.record_draft),
                ):
                    started = time.perf_counter()
                    _forward_scratch(runner, [[prompt[0]] * tokens] * b, start=ctx)
                    record(b, tokens, time.perf_counter() - started)
        # A full batch's decode step drafts as the controller would: k draft forwards and the
        # target over k + 1 tokens, not the plain forward the seed above timed.
        b = self.config.max_num_seqs
        k = self.spec.choose_k(b)
        target, draft = self.spec.target_cost.get((b, k + 1)), self.spec.draft_cost.get((b, 1))
        if target is not None and draft is not None:
            self.pace.seed(decode_cost=target + draft * k)

    def _profile_ngram(self, prompt: list[int], sizes: list[int], ctx: int) -> None:
        """The n-gram drafter's cost profile: the target over every 1..k+1 tokens at each batch
        size (it is not linear in tokens: small at batch 1 measured 14 ms for 4 tokens and 19-22 ms
        for 5), and the lookup itself per proposed token."""
        assert isinstance(self.draft, NgramProposer)
        k = self.spec.max_k
        for b in sizes:
            for _ in range(2):
                for tokens in range(1, k + 2):
                    started = time.perf_counter()
                    _forward_scratch(self.runner, [[prompt[0]] * tokens] * b, start=ctx)
                    self.spec.record_target(b, tokens, time.perf_counter() - started)
        history = (prompt * (ctx // len(prompt) + 1))[:ctx]
        for b in sizes:
            started = time.perf_counter()
            for r in range(b):
                self.draft.propose(-1 - r, history, k)
            self.spec.record_draft(b, 1, (time.perf_counter() - started) / k)
            for r in range(b):
                self.draft.forget(-1 - r)


def _forward_scratch(runner: ModelRunner, token_rows: list[list[int]], start: int = 0) -> None:
    """A forward on temporary blocks (warm-up and profiling), freed before returning. Every row
    uses the same blocks: their KV is garbage nobody reads, and the pool's memory stays untouched
    (blocks are zeroed, so resident, on first use)."""
    from tiers.block_manager import BlockTable

    table = BlockTable()
    if not runner.blocks.allocate(table, start + max(len(t) for t in token_rows)):
        return
    try:
        runner.forward([RowInput(table.blocks, start, toks) for toks in token_rows])
    finally:
        runner.blocks.free(table)


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
