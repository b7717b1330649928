"""After sampling: a row's new tokens go through the scheduler (``Scheduler.append_tokens``
appends them and checks the stops), then out to the request's handle as a ``StepOutput``; finished
requests leave the engine here (blocks freed, the proposer's state dropped, telemetry told)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tiers.core.output import StepOutput, TokenLogprob
from tiers.core.sched.pacing import Pace
from tiers.core.sched.scheduler import Scheduler
from tiers.core.sequence import FinishReason, Sequence, SequenceStatus
from tiers.engine.request import EngineObserver, RequestHandle, Tracked

if TYPE_CHECKING:
    from tiers.spec_decode.proposers import Proposer

__all__ = ["Postprocessor", "timings"]


class Postprocessor:
    """The requests an engine holds (``tracked``), and what a step hands each of them."""

    def __init__(
        self,
        name: str,
        scheduler: Scheduler,
        pace: Pace,
        proposer: Proposer | None,
        observer: EngineObserver | None,
    ) -> None:
        self.name = name
        self.scheduler = scheduler
        self.pace = pace
        self.proposer = proposer
        self.observer = observer
        self.tracked: dict[int, Tracked] = {}
        self.delivered: set[int] = set()
        """Rows of the current step whose tokens were already appended and emitted."""
        self.outbox: list[tuple[RequestHandle, StepOutput]] | None = None
        """A step's outputs, handed to the event loop in one call when the step ends: one wake-up
        of the loop per step instead of one per row, so the loop does not take the GIL from the
        step's own postprocessing sixteen times over."""

    def deliver(
        self, seq: Sequence, new_tokens: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> None:
        """Hand the new tokens to the scheduler (it appends them and checks the stops), then emit
        them and finish what is done."""
        tracked = self.tracked.get(seq.seq_id)
        if tracked is None or seq.is_finished:
            return
        self.delivered.add(seq.seq_id)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
            # A request preempted before its first token waited for a reason no estimate at
            # its submission could see (another caller took its slot): it says nothing of the model.
            if tracked.predicted_wait is not None and not seq.num_preemptions:
                # Calibrate the estimate on what this request actually waited (tiers/core/sched/pacing.py).
                raw, unprotected = tracked.predicted_wait
                self.pace.observe(raw, seq.first_token_time - seq.arrival_time, unprotected)
        kept, finish = self.scheduler.append_tokens(seq, new_tokens, tracked.detok.add_and_check)
        tracked.pending_tokens.extend(new_tokens[:kept])
        if logprobs is not None:
            tracked.pending_logprobs.extend(logprobs[:kept])
        if finish is not None:
            self.finish(tracked, *finish)
        else:
            self.emit(tracked, None)

    def record_prompt_logprobs(self, found: dict[int, list[tuple[int, TokenLogprob]]]) -> None:
        """Prompt logprobs of this step's prompt chunks (``sampling.split_prompt_logprobs``), kept
        by position (a chunk recomputed after a preemption overwrites its own)."""
        for seq_id, entries in found.items():
            tracked = self.tracked.get(seq_id)
            if tracked is not None:
                if tracked.prompt_logprobs is None:
                    tracked.prompt_logprobs = {}
                tracked.prompt_logprobs.update(entries)

    def emit(self, tracked: Tracked, finish_reason: str | None, error: str | None = None) -> None:
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
        if tracked.prompt_logprobs is not None:  # the request's first output carries them, once
            gathered, tracked.prompt_logprobs = tracked.prompt_logprobs, None
            out.prompt_logprobs = [None, *(gathered.get(p) for p in range(1, seq.num_prompt_tokens))]
            out.prompt_token_ids = list(seq.prompt_token_ids)
        tracked.pending_tokens = []
        tracked.pending_logprobs = []
        if finish_reason is not None:
            out.timings = timings(seq)
        if self.outbox is not None:
            self.outbox.append((tracked.handle, out))
        else:
            tracked.handle._push_threadsafe(out)

    def finish(self, tracked: Tracked, status: SequenceStatus, reason: str, error: str | None = None) -> None:
        seq = tracked.seq
        self.scheduler.finish(seq, status, reason)
        if self.proposer is not None:
            self.proposer.forget(seq)
        seq.error = error
        self.tracked.pop(seq.seq_id, None)
        if seq.first_scheduled_time is not None or seq.num_output_tokens:
            self.pace.on_finish(seq.num_output_tokens)
        self.emit(tracked, reason, error)
        if self.observer is not None:
            self.observer.on_finish(self.name, seq)

    def fail(self, seq: Sequence, message: str) -> None:
        tracked = self.tracked.get(seq.seq_id)
        if tracked is not None:
            self.finish(tracked, SequenceStatus.FINISHED_ERROR, FinishReason.ERROR, message)

    def abort_all(self) -> None:
        for tracked in list(self.tracked.values()):
            self.finish(tracked, SequenceStatus.FINISHED_ABORTED, FinishReason.ABORT)


def timings(seq: Sequence) -> dict[str, float]:
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
