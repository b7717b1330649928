"""What one step is made of: the scheduler's configuration and batch, the model's outcome per
row, and where the scheduler hands each row's outcome (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from tiers.core.sequence import Sequence

__all__ = ["ModelOutput", "RowOutput", "ScheduledBatch", "SchedulerConfig", "StepSink"]


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
    max_decode_slowdown: float | None = None
    """Decode first: a step that runs decodes feeds prompt chunks beside them only up to what
    keeps it within this multiple of a step of the decodes alone (``pacing.prefill_cap``, from
    the engine's measured step costs); None: prompt chunks take up to half the budget."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if self.max_decode_slowdown is not None and not self.max_decode_slowdown > 1.0:
            raise ValueError(f"max_decode_slowdown must be > 1 (or null), got {self.max_decode_slowdown}")
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


class StepSink(Protocol):
    """Where ``Scheduler.update_from_output`` hands each row's outcome (the engine)."""

    def on_accept(self, seq: Sequence, num_accepted: int) -> None:
        """The target settled ``seq``'s proposal at ``num_accepted`` drafts."""

    def deliver(self, seq: Sequence, tokens: list[int], logprobs: list[Any] | None) -> None:
        """New tokens for ``seq`` (appended by ``Scheduler.append_tokens``), then emitted."""

    def fail(self, seq: Sequence, message: str) -> None:
        """``seq`` cannot go on (finish it with an error)."""


@dataclass(slots=True)
class RowOutput:
    """What one step decided for a row that chose tokens (``Scheduler.update_from_output`` applies it)."""

    tokens: list[int]
    """The accepted drafts, then the target's own token."""
    num_drafted: int = 0
    num_accepted: int = 0
    logprobs: list[Any] | None = None
    """``TokenLogprob`` per token of ``tokens`` (rows that asked for logprobs)."""


@dataclass(slots=True)
class ModelOutput:
    """One step's results: a ``RowOutput`` per row (``None``: a prompt chunk short of the
    prompt's end, which chooses nothing), and the tokens each row's draft wrote into its KV."""

    rows: list[RowOutput | None]
    draft_fed: list[int]
