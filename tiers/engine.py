"""A tier's engine: ``schedule -> run -> postprocess`` over a continuous batch, one ``step()`` at a time.

Steps run on the ``DeviceWorker`` thread (see ``device.py`` for why there is exactly one).
Requests arrive from asyncio through ``submit`` (thread-safe) and get a ``RequestHandle`` whose
async iterator yields ``StepOutput``s as tokens are produced. Sequences join the batch at the next
step and leave the moment they finish; their slot is released at once.

With a draft (the tier below's model object, shared in memory), decode steps speculate: the draft
proposes k tokens per sequence from its own KV pool, the target verifies all of them in one
forward, and ``accept_draft`` decides per sequence. k comes from ``SpecController`` each step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tiers.model_runner import ModelRunner, RowInput
from tiers.output import IncrementalDetokenizer, StepOutput
from tiers.request import EngineFullError, EngineLoad, EngineObserver, RequestHandle
from tiers.sampling import apply_penalties, probs_from_logits, sample_rows
from tiers.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tiers.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from tiers.speculative import SpecController, accept_draft

if TYPE_CHECKING:
    from tiers.device import DeviceWorker
    from tiers.prefix_cache import PrefixCache

__all__ = ["Engine", "EngineFullError", "EngineLoad", "EngineObserver", "RequestHandle"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Tracked:
    seq: Sequence
    handle: RequestHandle
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    pending_tokens: list[int] = field(default_factory=list)


class Engine:
    def __init__(
        self,
        name: str,
        runner: ModelRunner,
        config: SchedulerConfig,
        *,
        draft_runner: ModelRunner | None = None,
        speculative_tokens: int = 0,
        prefix_cache: PrefixCache | None = None,
        observer: EngineObserver | None = None,
    ) -> None:
        self.name = name
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.config = config
        self.scheduler = Scheduler(config, on_admit=self._on_admit)
        self.draft = draft_runner
        self.spec = SpecController(max_k=speculative_tokens if draft_runner is not None else 0)
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            prefix_cache.allocate(runner)
        self.observer = observer
        self.eos_token_ids = self._eos_ids()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._tracked: dict[int, _Tracked] = {}
        self._worker: DeviceWorker | None = None
        self._default_generator = torch.Generator().manual_seed(0)
        self.step_hook: Callable[[ScheduledBatch], None] | None = None
        """Called before each step's forward (tests inject faults and count steps here)."""
        self.num_steps = 0

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

    def load(self) -> EngineLoad:
        return EngineLoad(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + self._inbox.qsize(),
            max_num_seqs=self.config.max_num_seqs,
            max_waiting=self.config.max_waiting,
            kv_tokens=self.scheduler.num_kv_tokens(),
            kv_capacity=self.config.max_num_seqs * self.config.max_model_len,
        )

    # -- intake (any thread) --------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request; raises ``EngineFullError`` when the waiting queue is full and
        ``ValueError`` when the prompt cannot fit the context."""
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens; "
                f"this tier's context is {self.config.max_model_len}"
            )
        if self.load().is_full:
            raise EngineFullError(f"tier '{self.name}' queue is full")
        seq = Sequence(list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids)
        handle = RequestHandle(self, seq, asyncio.get_running_loop())
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        tracked = _Tracked(seq, handle, IncrementalDetokenizer(self.tokenizer, params.stop), gen)
        self._inbox.put(("add", tracked))
        self._wakeup()
        return handle

    def submit_n(self, prompt_token_ids: list[int], params: list[SamplingParams]) -> list[RequestHandle]:
        """``n > 1``: one sequence per entry of ``params`` over the same prompt (each its own seed
        and constraint); they share the prompt's KV."""
        return [self.submit(prompt_token_ids, p) for p in params]

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
                if item.seq.abort_requested:
                    self._finish(item, SequenceStatus.FINISHED_ABORTED, FinishReason.ABORT)
                    continue
                self._tracked[item.seq.seq_id] = item
                self.scheduler.add(item.seq)
            elif op == "abort" and item.seq_id in self._tracked:
                self._finish(self._tracked[item.seq_id], SequenceStatus.FINISHED_ABORTED, FinishReason.ABORT)

    # -- one step (on the device thread) -------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    def step(self) -> bool:
        """schedule -> run -> postprocess, once. Returns False when there was nothing to run."""
        self._drain_inbox()
        batch = None
        started = time.perf_counter()
        try:
            self._apply_slot_moves()
            batch = self.scheduler.schedule()
            if batch is None:
                return False
            self._run_isolated(batch)
        except Exception:  # a bug in the step itself: fail what it touched, keep the engine alive
            log.exception("engine %s: step failed", self.name)
            for seq in list(batch.seqs if batch is not None else self.scheduler.running):
                self._fail(seq, "internal error in the engine step")
        self.num_steps += 1
        if self.observer is not None and batch is not None:
            self.observer.on_step(self.name, batch.kind, batch.num_seqs, time.perf_counter() - started)
        return True

    def abort_all(self) -> None:
        """Finish every request (shutdown), so no consumer waits forever."""
        self._drain_inbox()
        for tracked in list(self._tracked.values()):
            self._finish(tracked, SequenceStatus.FINISHED_ABORTED, FinishReason.ABORT)

    def _apply_slot_moves(self) -> None:
        for src, dst, seq in self.scheduler.take_pending_moves():
            self.runner.move_slot(src, dst, seq.num_computed_tokens)
            if self.draft is not None:
                self.draft.move_slot(src, dst, seq.num_draft_computed_tokens)

    def _on_admit(self, seq: Sequence) -> None:
        seq.first_scheduled_time = time.monotonic()
        if self.prefix_cache is not None:
            assert seq.slot is not None
            hit = self.prefix_cache.load(seq.slot, seq.prompt_token_ids, self.runner)
            seq.num_cached_tokens = hit
            seq.num_computed_tokens = hit

    def _run_isolated(self, batch: ScheduledBatch) -> None:
        """Run the batch; if its forward raises, find the culprit by running each sequence alone,
        so an error inside one request's generation fails that request only. Retrying is safe:
        a forward only writes KV at positions >= num_computed_tokens."""
        try:
            self._run(batch, speculate=True)
            return
        except Exception as exc:
            if batch.num_seqs == 1:
                self._fail(batch.seqs[0], f"{type(exc).__name__}: {exc}")
                log.warning("engine %s: request failed: %s", self.name, traceback.format_exc(limit=3))
                return
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.is_finished:
                continue
            try:
                self._run(ScheduledBatch(batch.kind, [seq], [n]), speculate=False)
            except Exception as exc:
                log.warning("engine %s: request %d failed: %s", self.name, seq.seq_id, exc)
                self._fail(seq, f"{type(exc).__name__}: {exc}")

    def _run(self, batch: ScheduledBatch, *, speculate: bool) -> None:
        if self.step_hook is not None:
            self.step_hook(batch)
        if batch.kind == "prefill":
            self._prefill(batch)
        elif speculate and self.draft is not None:
            self._decode_speculative(batch)
        else:
            self._decode(batch)

    # -- prefill ---------------------------------------------------------------------------------
    def _prefill(self, batch: ScheduledBatch) -> None:
        rows = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            completes = start + n == seq.num_tokens
            rows.append(
                RowInput(
                    self._slot(seq), start, seq.token_ids[start : start + n], "last" if completes else "none"
                )
            )
        logits = self.runner.forward(rows)
        for seq, n, lg in zip(batch.seqs, batch.num_new_tokens, logits, strict=True):
            seq.num_computed_tokens += n
            if lg is not None:
                self._postprocess(seq, [self._sample(seq, lg)])
        if self.prefix_cache is not None:
            for seq in batch.seqs:
                if not seq.is_prefilling and seq.slot is not None:
                    self.prefix_cache.store(seq.slot, seq.prompt_token_ids, self.runner)

    # -- plain decode ----------------------------------------------------------------------------
    def _decode(self, batch: ScheduledBatch) -> None:
        started = time.perf_counter()
        rows = [
            RowInput(self._slot(s), s.num_computed_tokens, s.token_ids[s.num_computed_tokens :])
            for s in batch.seqs
        ]
        logits = self.runner.forward(rows)
        self.spec.record_target(batch.num_seqs, 1, time.perf_counter() - started)
        for seq, lg in zip(batch.seqs, logits, strict=True):
            assert lg is not None
            seq.num_computed_tokens = seq.num_tokens
            self._postprocess(seq, [self._sample(seq, lg)])

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int:
        """logits: [1, V] for the next position of ``seq``."""
        lg = apply_penalties(logits, seq.params, seq.prompt_token_ids, seq.output_token_ids)
        if seq.params.is_greedy:
            return int(lg[0].argmax())
        probs = probs_from_logits(lg, seq.params)
        return int(sample_rows(probs, self._generator(seq))[0])

    def _generator(self, seq: Sequence) -> torch.Generator:
        tracked = self._tracked.get(seq.seq_id)
        if tracked is not None and tracked.generator is not None:
            return tracked.generator
        return self._default_generator

    # -- speculative decode ----------------------------------------------------------------------
    def _spec_budget(self, seq: Sequence, k: int) -> int:
        """How many tokens this sequence may draft: none for penalized requests (their logits depend
        on the tokens before them), and never past max_tokens or the context."""
        if seq.params.has_penalties:
            return 0
        room = min(seq.num_remaining_tokens - 1, self.config.max_model_len - seq.num_tokens - 1)
        return max(0, min(k, room))

    def _decode_speculative(self, batch: ScheduledBatch) -> None:
        assert self.draft is not None
        lag = max(s.num_tokens - s.num_draft_computed_tokens for s in batch.seqs)
        k = self.spec.choose_k(batch.num_seqs, lag)
        budgets = [self._spec_budget(s, k) for s in batch.seqs]
        k = max(budgets, default=0)
        if k == 0:
            self._decode(batch)
            return
        seqs = batch.seqs
        # 1. Draft: catch up on tokens the draft has not seen - the prompt on a sequence's first
        #    speculative step (the draft never runs where speculation does not pay), 1 or 2 after a
        #    round, more after plain steps - then propose up to k tokens per row.
        drafts: list[list[int]] = [[] for _ in seqs]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        feed = [s.token_ids[s.num_draft_computed_tokens :] for s in seqs]
        starts = [s.num_draft_computed_tokens for s in seqs]
        for step in range(k):
            active = [i for i, s in enumerate(seqs) if step < budgets[i]]
            if not active:
                break
            rows = [RowInput(self._slot(seqs[i]), starts[i], feed[i]) for i in active]
            started = time.perf_counter()
            logits = self.draft.forward(rows)
            if step > 0 or max(len(r.token_ids) for r in rows) <= 2:
                # Catch-up forwards (a whole prompt on a sequence's first round) are not what a
                # draft step costs; keep them out of the cost model.
                self.spec.record_draft(len(rows), 1, time.perf_counter() - started)
            for i, lg in zip(active, logits, strict=True):
                assert lg is not None
                starts[i] += len(feed[i])
                probs = probs_from_logits(lg, seqs[i].params)  # [1, V]
                tok = (
                    int(probs[0].argmax())
                    if seqs[i].params.is_greedy
                    else int(sample_rows(probs, self._generator(seqs[i]))[0])
                )
                drafts[i].append(tok)
                draft_probs[i].append(probs[0])
                feed[i] = [tok]
        # 2. Verify: one target forward over [last token, d1..dk] for every row.
        started = time.perf_counter()
        rows = [
            RowInput(
                self._slot(s), s.num_computed_tokens, s.token_ids[s.num_computed_tokens :] + drafts[i], "all"
            )
            for i, s in enumerate(seqs)
        ]
        logits = self.runner.forward(rows)
        self.spec.record_target(batch.num_seqs, k + 1, time.perf_counter() - started)
        # 3. Accept per row, roll both caches back to what was accepted.
        drafted_total = accepted_total = 0
        for i, (seq, lg) in enumerate(zip(seqs, logits, strict=True)):
            assert lg is not None
            n_fed_before = seq.num_tokens - seq.num_computed_tokens  # usually 1
            target_logits = lg[n_fed_before - 1 :]  # positions predicting d1..dk and the bonus: [k_i+1, V]
            if not drafts[i]:  # this row did not speculate (penalties, or no room left)
                new = [self._sample(seq, target_logits[:1])]
            elif seq.params.is_greedy:
                new = self._accept_greedy(drafts[i], target_logits)
            else:
                q = probs_from_logits(target_logits, seq.params)
                new = accept_draft(drafts[i], torch.stack(draft_probs[i]), q, self._generator(seq))
            n_accepted = len(new) - 1
            drafted_total += len(drafts[i])
            accepted_total += n_accepted
            seq.num_draft_tokens += len(drafts[i])
            seq.num_accepted_tokens += n_accepted
            base = seq.num_tokens
            # Target KV is valid through the last accepted draft; the draft's through the last
            # accepted draft it was fed (it never saw d_k).
            seq.num_computed_tokens = base + n_accepted
            seq.num_draft_computed_tokens = min(base + n_accepted, starts[i])
            self._postprocess(seq, new)
        self.spec.record_acceptance(drafted_total, accepted_total)
        if self.observer is not None:
            self.observer.on_spec(self.name, drafted_total, accepted_total)

    @staticmethod
    def _accept_greedy(draft: list[int], target_logits: torch.Tensor) -> list[int]:
        """target_logits: [len(draft)+1, V]. Accept while the target's argmax agrees, then take its argmax."""
        best = target_logits.argmax(dim=-1).tolist()
        out: list[int] = []
        for i, tok in enumerate(draft):
            if best[i] != tok:
                break
            out.append(tok)
        out.append(best[len(out)])
        return out

    # -- after sampling --------------------------------------------------------------------------
    def _postprocess(self, seq: Sequence, new_tokens: list[int]) -> None:
        """Append tokens one by one, stopping at EOS, stop ids/strings, max_tokens or the context."""
        tracked = self._tracked.get(seq.seq_id)
        if tracked is None or seq.is_finished:
            return
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        params = seq.params
        finish: tuple[SequenceStatus, str] | None = None
        for tok in new_tokens:
            seq.token_ids.append(tok)
            tracked.pending_tokens.append(tok)
            if (not params.ignore_eos and tok in self.eos_token_ids) or tok in params.stop_token_ids:
                finish = (SequenceStatus.FINISHED_STOPPED, FinishReason.STOP)
                break
            tracked.detok.add(tok)
            if tracked.detok.stopped:
                finish = (SequenceStatus.FINISHED_STOPPED, FinishReason.STOP)
                break
            if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
                finish = (SequenceStatus.FINISHED_LENGTH, FinishReason.LENGTH)
                break
        # KV past the kept tokens is stale; never count it as computed.
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_tokens - 1)
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
        )
        tracked.pending_tokens = []
        if finish_reason is not None:
            out.timings = _timings(seq)
        tracked.handle._push_threadsafe(out)

    def _finish(
        self, tracked: _Tracked, status: SequenceStatus, reason: str, error: str | None = None
    ) -> None:
        seq = tracked.seq
        self.scheduler.finish(seq, status, reason)
        seq.error = error
        self._tracked.pop(seq.seq_id, None)
        self._emit(tracked, reason, error)
        if self.observer is not None:
            self.observer.on_finish(self.name, seq)

    def _fail(self, seq: Sequence, message: str) -> None:
        tracked = self._tracked.get(seq.seq_id)
        if tracked is not None:
            self._finish(tracked, SequenceStatus.FINISHED_ERROR, FinishReason.ERROR, message)

    @staticmethod
    def _slot(seq: Sequence) -> int:
        assert seq.slot is not None
        return seq.slot

    # -- warm-up ---------------------------------------------------------------------------------
    def warmup(self) -> None:
        """One real forward per model (the readiness bar), then a timing profile that seeds the
        speculative cost model at each batch-size bucket. Runs before the loop starts."""
        prompt = self.tokenizer.encode("Hello, how are you today?") or [0]
        self.runner.forward([RowInput(0, 0, prompt)])
        if self.draft is None or self.spec.max_k == 0:
            return
        self.draft.forward([RowInput(0, 0, prompt)])
        ctx = 32
        k = self.spec.max_k
        bucket = 1
        while bucket <= self.config.max_num_seqs:
            slots = list(range(bucket))
            for _ in range(2):
                for tokens, runner, record in (
                    (1, self.runner, self.spec.record_target),
                    (k + 1, self.runner, self.spec.record_target),
                    (1, self.draft, self.spec.record_draft),
                ):
                    started = time.perf_counter()
                    runner.forward([RowInput(s, ctx, [prompt[0]] * tokens) for s in slots])
                    record(bucket, tokens, time.perf_counter() - started)
            bucket *= 2


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
