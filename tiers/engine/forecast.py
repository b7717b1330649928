"""An engine's figures for admission and routing: its load, the wait a new request would have for
its first token, and the price of its decode round. The model is ``pacing.py``'s; this gathers its
inputs (the scheduler's queue, the intake, the other engines' backlogs on the device) for one
engine. Any thread: every figure is read from snapshots."""

from __future__ import annotations

from collections.abc import Callable

from tiers.core.sched.pacing import Backlog, Pace, Reused, predict_wait
from tiers.core.sched.scheduler import Scheduler
from tiers.engine.intake import Intake
from tiers.engine.request import EngineFullError, EngineLoad
from tiers.spec_decode.controller import SpecController

__all__ = ["Forecast"]


class Forecast:
    def __init__(
        self,
        scheduler: Scheduler,
        intake: Intake,
        pace: Pace,
        spec: SpecController,
        others: Callable[[], list[tuple[Pace, Backlog]]],
    ) -> None:
        """``others()``: the pace and backlog of every other engine with work on the same device
        (``DeviceWorker.backlogs``)."""
        self.scheduler = scheduler
        self.intake = intake
        self.pace = pace
        self.spec = spec
        self.config = scheduler.config
        self.others = others
        self._backlog: Reused[None, Backlog] = Reused()
        self._rounds: Reused[int, tuple[float, float] | None] = Reused()

    def load(self, *, predicted: bool = True) -> EngineLoad:
        sched = self.scheduler
        return EngineLoad(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting + self.intake.qsize(),
            max_num_seqs=self.config.max_num_seqs,
            max_waiting=self.config.max_waiting,
            kv_tokens=sched.num_kv_tokens(),
            kv_capacity=sched.blocks.num_blocks * sched.blocks.block_size,
            predicted_wait_s=self.predicted_wait(None) if predicted else 0.0,
            submitted=self.intake.submitted,
        )

    def check_room(self, tier: str, prompt_tokens: int, n: int) -> None:
        """Raise ``ValueError`` when a prompt of ``prompt_tokens`` cannot fit the context, and
        ``EngineFullError`` when ``n`` more sequences would overflow the waiting queue."""
        if prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt is {prompt_tokens} tokens; this tier's context is {self.config.max_model_len}"
            )
        load = self.load(predicted=False)
        if load.num_waiting + n - 1 >= load.max_waiting + max(0, load.max_num_seqs - load.num_running):
            raise EngineFullError(f"tier '{tier}' queue is full")

    def predicted_wait(self, caller: str | None = "", prompt_tokens: int = 0) -> float:
        """Seconds until a request from ``caller`` of ``prompt_tokens`` submitted now gets its
        first token: the prompt work queued ahead of it (the scheduler's fair sharing decides what
        is ahead, ``pacing.queue_backlog``), the other tiers' steps on the same device thread, and
        a slot's wait when it must queue (``pacing.predict_wait``), scaled by how such estimates
        compared with the waits requests actually had. ``caller=None``: a request that holds no
        share (the engine's load as a whole)."""
        raw, unprotected = self.estimate(caller, prompt_tokens)
        return self.pace.calibrated(raw, unprotected)

    def estimate(self, caller: str | None, prompt_tokens: int) -> tuple[float, bool]:
        """The uncalibrated wait, and whether the request would be unprotected (may be pushed back
        by later arrivals, ``Backlog.protected``)."""
        tokens, mine, mine_tokens = self.intake.counts(caller)
        own = self.scheduler.backlog(
            caller,
            self.intake.qsize(),
            tokens,
            self.pace.output_len,
            inbox_mine=mine,
            inbox_mine_tokens=mine_tokens,
        )
        return predict_wait(self.pace, own, prompt_tokens, self.others()), not own.protected

    def backlog(self) -> Backlog:
        """Everything queued here, as another engine's estimate sees it (reused briefly: every
        admission asks each tier about every other one)."""
        return self._backlog.get(
            None, lambda: self.scheduler.backlog(None, self.intake.qsize(), self.intake.counts(None)[0])
        )

    def decode_round(self, extra: int = 0) -> tuple[float, float] | None:
        """``(seconds, tokens per row)`` of the decode step once the sequences held (running,
        waiting, submitted) and ``extra`` more fill the batch (at most ``max_num_seqs``), at the k
        the controller would pick; ``(0, 1)`` for an empty batch, ``None`` before any step was
        measured. Load-aware routing prices a sequence by it (``pacing.routing_cost``)."""
        sched = self.scheduler
        held = sched.num_running + sched.num_waiting + self.intake.qsize() + extra
        batch = min(self.config.max_num_seqs, held)
        if batch <= 0:
            return (0.0, 1.0)
        try:  # a burst of decisions prices the same state: reused briefly
            return self._rounds.get(batch, lambda: self.spec.best_round(batch))
        except RuntimeError:  # the device thread added a cost point mid-read: price it as unknown
            return None
