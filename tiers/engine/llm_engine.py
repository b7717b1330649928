"""A tier's engine: ``schedule -> run -> update`` over a continuous batch, one ``step()`` at a time.

Steps run on the one ``DeviceWorker`` thread (``worker/device.py`` says why one); requests arrive
through ``submit`` (thread-safe, ``intake.py``), their ``RequestHandle`` yields ``StepOutput``s.

One step: the scheduler hands out each sequence's tokens under one token budget (decodes, prefill
chunks and speculative lookahead together, ``scheduler.py``); the proposer drafts for the rows that
speculate (``proposers.py``); one target forward runs every row; one vectorised pass processes
logits, samples and applies the acceptance rule (``sampler.sample_rows``); the scheduler alone
then writes the outcome into the sequences (``Scheduler.update_from_output``) and each row's new
tokens go out (``postprocess.py``). A step that raises fails only its culprit (``isolation.py``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tiers.core.sched.batch import ModelOutput, ScheduledBatch, SchedulerConfig
from tiers.core.sched.pacing import Backlog, Pace
from tiers.core.sched.scheduler import Scheduler
from tiers.core.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from tiers.engine.forecast import Forecast
from tiers.engine.intake import Intake
from tiers.engine.isolation import run_isolated
from tiers.engine.postprocess import Postprocessor
from tiers.engine.request import EngineFullError, EngineLoad, EngineObserver, RequestHandle, Tracked, push_all
from tiers.engine.warmup import warm_up
from tiers.sample.logprobs import split_prompt_logprobs
from tiers.sample.sampler import sample_rows
from tiers.spec_decode.controller import SpecController, spec_budget
from tiers.spec_decode.proposers import DraftSource, Proposal, make_proposer
from tiers.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from tiers.worker.device import DeviceWorker

__all__ = ["Engine", "EngineFullError", "EngineLoad", "EngineObserver", "RequestHandle"]

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        name: str,
        runner: ModelRunner,
        config: SchedulerConfig,
        *,
        draft_runner: DraftSource | None = None,
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
        self.draft = draft_runner if speculative_tokens > 0 else None
        self.spec = SpecController(max_k=speculative_tokens if self.draft is not None else 0)
        self.eos_token_ids = runner.eos_token_ids()
        self._shared_generator = torch.Generator(runner.device).manual_seed(0)  # where the sampler runs
        self.proposer = make_proposer(
            name, self.draft, self.spec, vocab_size=runner.vocab_size, eos_token_ids=self.eos_token_ids,
            generator=self._shared_generator, max_num_seqs=config.max_num_seqs
        )  # fmt: skip
        blocks = self.proposer.blocks if self.proposer is not None else None
        self.pace = pace = Pace(config.max_num_seqs, config.max_num_batched_tokens)
        """Measured step costs: the predicted wait, the chunk beside decodes (``sched/pacing.py``)."""
        self.scheduler = Scheduler(config, runner.blocks, blocks, spec_budget=self._spec_budget, pace=pace)
        self.observer = observer
        self.post = Postprocessor(name, self.scheduler, self.pace, self.proposer, observer)
        self.intake = Intake(self.tokenizer, runner.device)
        self._worker: DeviceWorker[Engine] | None = None
        self._k = 0
        self.step_hook: Callable[[ScheduledBatch], None] | None = None
        """Called with the batch before each step's forwards (tests inject faults and count steps)."""
        self.num_steps = 0
        self.forecast = Forecast(self.scheduler, self.intake, self.pace, self.spec, self._other_backlogs)

    # -- lifecycle and figures (any thread) ---------------------------------------------------------
    def attach(self, worker: DeviceWorker[Engine]) -> None:
        """Let ``worker`` (the one thread that runs every torch op) drive this engine."""
        self._worker = worker
        worker.add_engine(self)

    def _other_backlogs(self) -> list[tuple[Pace, Backlog]]:
        return self._worker.backlogs(exclude=self) if self._worker is not None else []

    is_alive = property(lambda self: self._worker is not None and self._worker.is_alive)

    def load(self, *, predicted: bool = True) -> EngineLoad:
        """Queue and batch now; ``predicted=False`` skips the wait estimate."""
        return self.forecast.load(predicted=predicted)

    def predicted_wait(self, caller: str | None = "", prompt_tokens: int = 0) -> float:
        """Seconds until a request from ``caller`` of ``prompt_tokens`` submitted now gets its
        first token (``pacing.predict_wait``, calibrated); ``caller=None``: one holding no share."""
        return self.forecast.predicted_wait(caller, prompt_tokens)

    def backlog(self) -> Backlog:
        """Everything queued here, as another engine's wait estimate sees it."""
        return self.forecast.backlog()

    def decode_round(self, extra: int = 0) -> tuple[float, float] | None:
        """``(seconds, tokens per row)`` of a decode step with ``extra`` more rows (load-aware price)."""
        return self.forecast.decode_round(extra)

    # -- intake (any thread) --------------------------------------------------------------------
    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, *, cache_salt: str = "", caller: str = ""
    ) -> RequestHandle:
        """Queue a request; raises ``EngineFullError`` when the waiting queue is full and
        ``ValueError`` when the prompt cannot fit the context. ``cache_salt``: the prefix-cache
        partition (the tenant); ``caller``: who asked, for fair sharing of batch slots."""
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
        self.forecast.check_room(self.name, len(prompt_token_ids), len(params))
        predicted = self.forecast.estimate(caller, len(prompt_token_ids))
        items = self.intake.submit(
            self, prompt_token_ids, params, self.eos_token_ids, cache_salt, caller, predicted
        )
        self._wakeup()
        return [t.handle for t in items]

    def abort(self, seq: Sequence) -> None:
        seq.abort_requested = True
        self.intake.abort(seq)
        self._wakeup()

    def _wakeup(self) -> None:
        if self._worker is not None:
            self._worker.wake()

    def _drain_inbox(self) -> None:
        for op, item in self.intake.drain():
            if op == "add":
                assert isinstance(item, Tracked)
                self.post.tracked[item.seq.seq_id] = item
                if item.seq.abort_requested:
                    self.post.finish(item, SequenceStatus.FINISHED_ABORTED, FinishReason.ABORT)
                else:
                    self.scheduler.add(item.seq)
            elif isinstance(item, Sequence) and item.seq_id in self.post.tracked:
                self.post.finish(
                    self.post.tracked[item.seq_id], SequenceStatus.FINISHED_ABORTED, FinishReason.ABORT
                )

    # -- one step (on the device thread) -------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self.intake.empty()

    def has_protected_prefill(self) -> bool:
        """A protected caller's prompt waits here; device thread only (it drains the inbox)."""
        self._drain_inbox()
        return self.scheduler.has_protected_prefill()

    def decoding(self) -> bool:
        """A running sequence here decodes (device thread): another engine's prompt chunks wait."""
        return any(s.is_decoding for s in self.scheduler.running)

    def share(self) -> tuple[Counter[str], int]:
        """Sequences per caller held here, and the batch slots (device thread: drains the inbox)."""
        self._drain_inbox()
        return self.scheduler.callers(), self.config.max_num_seqs

    def step(self, **options: Any) -> bool:
        """schedule -> run -> update, once; False when nothing ran (the options: ``Scheduler.schedule``)."""
        self._drain_inbox()
        batch, started = None, time.perf_counter()
        self.post.outbox = []
        try:
            self._k = self._choose_k()
            batch = self.scheduler.schedule(**options)
            if batch is None:
                return False
            run_isolated(
                batch,
                self._run,
                scheduler=self.scheduler,
                proposer=self.proposer,
                delivered=lambda: self.post.delivered,
                fail=self.post.fail,
                name=self.name,
            )
        except Exception:  # a bug in the step itself: fail what it touched, keep the engine alive
            log.exception("engine %s: step failed", self.name)
            # Before a batch formed, every held request (a waiting one would spin here for good).
            for seq in list(batch.seqs if batch else [*self.scheduler.running, *self.scheduler.waiting]):
                self.post.fail(seq, "internal error in the engine step")
        finally:
            outbox, self.post.outbox = self.post.outbox, None
            push_all(outbox)
        self._account(batch, started)
        return True

    def _choose_k(self) -> int:
        """k for the next batch (new prompts count: they decode as one next), at the proposer's
        acceptance, behind the draft's backlog (a model draft is fed only while it drafts)."""
        p, s = self.proposer, self.scheduler
        if p is None:
            return 0
        held = max(1, min(self.config.max_num_seqs, s.num_running + s.num_waiting))
        lag, backlog = p.behind([*s.running, *s.waiting])
        return self.spec.choose_k(held, max(1, lag), p.acceptance(s.running), draft_backlog=backlog)

    def _run(self, batch: ScheduledBatch) -> None:
        """Draft, one target forward over every row, sample, and let the scheduler apply it."""
        self.post.delivered = set()
        now = time.monotonic()
        for seq in batch.admitted:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        if self.step_hook is not None:
            self.step_hook(batch)
        proposal = self.proposer.propose(batch, self._k) if self.proposer else Proposal.empty(batch.num_seqs)
        started = time.perf_counter()
        logits = self.runner.forward(proposal.target_rows(batch))
        self.post.record_prompt_logprobs(split_prompt_logprobs(batch.seqs, logits, batch.num_new_tokens))
        drafted = {len(d.tokens) if d else 0 for d in proposal.drafts}
        # Only uniform steps are timed: an n-gram lookup's ragged step costs less than its key says.
        if batch.kind == "decode" and (len(drafted) == 1 or not (self.proposer and self.proposer.ragged)):
            self.spec.record_target(batch.num_seqs, 1 + max(drafted), time.perf_counter() - started)
        generators = [t.generator if (t := self.post.tracked.get(s.seq_id)) else None for s in batch.seqs]
        outcome = sample_rows(
            batch.seqs, logits, proposal.drafts, generators, self._shared_generator, self.eos_token_ids
        )
        drafted_total, accepted = self.scheduler.update_from_output(
            batch, ModelOutput(outcome, proposal.fed), self
        )
        if drafted_total:
            self.spec.record_acceptance(drafted_total, accepted)
            if self.observer is not None:
                self.observer.on_spec(self.name, drafted_total, accepted)

    def _account(self, batch: ScheduledBatch | None, started: float) -> None:
        elapsed = time.perf_counter() - started
        if batch is not None:
            tokens = sum(batch.num_new_tokens)  # decodes and prompt chunks (verification excluded)
            self.pace.on_step(started, elapsed, tokens, batch.num_seqs, self.scheduler.has_work(), batch.kind)
        self.num_steps += 1
        if self.observer is not None and batch is not None:
            self.observer.on_step(self.name, batch.kind, batch.num_seqs, elapsed)

    # -- the scheduler's sink (``batch.StepSink``) ---------------------------------------------
    def on_accept(self, seq: Sequence, num_accepted: int) -> None:
        if self.proposer is not None:
            self.proposer.on_accept(seq, num_accepted)

    def deliver(self, seq: Sequence, tokens: list[int], logprobs: list[Any] | None) -> None:
        """A row's new tokens, out through ``_postprocess`` (the seam fault-injection tests use)."""
        self._postprocess(seq, tokens, logprobs)

    def _postprocess(self, seq: Sequence, new_tokens: list[int], logprobs: list[Any] | None = None) -> None:
        self.post.deliver(seq, new_tokens, logprobs)

    def fail(self, seq: Sequence, message: str) -> None:
        self.post.fail(seq, message)

    def _spec_budget(self, seq: Sequence) -> int:
        """How many tokens ``seq`` may draft this step (``speculative.spec_budget``)."""
        return spec_budget(seq, self._k, self.config.max_model_len)

    # -- the rest: what tests and telemetry inspect (requests held, rows delivered, inbox callers)
    _tracked = property(lambda self: self.post.tracked)
    _delivered = property(lambda self: self.post.delivered)
    _inbox_callers = property(lambda self: self.intake.callers)

    # Prompts whose last chunk ran without the draft (its feed deferred to the first decode).
    num_deferred_draft_feeds = property(lambda self: self.proposer.num_deferred_feeds if self.proposer else 0)

    def abort_all(self) -> None:
        """Finish every request (shutdown), so no consumer waits forever."""
        self._drain_inbox()
        self.post.abort_all()

    def warmup(self) -> None:
        """A real forward per model, then the timing profile (``warmup.py``)."""
        warm_up(self.runner, self.config, self.pace, self.spec, self.proposer)
