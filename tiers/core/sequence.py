"""One request's state inside an engine: its tokens, sampling parameters, progress and status.

Progress follows one rule (as in vLLM v1): ``num_computed_tokens`` counts the tokens whose KV is in
the tier's cache; every step feeds ``token_ids[num_computed_tokens:]`` (capped by the prefill chunk)
plus any speculative tokens. Prefill, chunked prefill, prefix-cache hits and decoding are the same
rule at different distances from ``num_tokens``.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from tiers.core.block_manager import BlockTable

if TYPE_CHECKING:
    from tiers.core.constraint import TokenConstraint

__all__ = ["FinishReason", "SamplingParams", "Sequence", "SequenceStatus"]

_ids = itertools.count(1)


class SequenceStatus(IntEnum):
    """Ordered: every status from FINISHED_STOPPED on is terminal."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


class FinishReason:
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation settings, with OpenAI's meanings. Validated on construction."""

    max_tokens: int = 256
    """Upper bound on generated tokens."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 turns it off."""
    seed: int | None = None
    """Makes sampling reproducible for this request."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends before the first occurrence, which is not returned."""
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    """OpenAI: subtract this from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """OpenAI: subtract this times the token's count among generated tokens."""
    repetition_penalty: float = 1.0
    """CTRL-style, over prompt and output: positive logits divided by it, negative multiplied."""
    ignore_eos: bool = False
    min_tokens: int = 0
    """vLLM's extension: EOS and ``stop_token_ids`` are masked, and stop strings not looked for,
    until this many tokens are out (load tools fix the output length with it)."""
    include_stop_str_in_output: bool = False
    """vLLM's extension: the stop string that ended the text is kept at its end."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the most likely token's (vLLM's extension)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI ``logit_bias``: ``(token_id, bias)`` pairs added to the raw logits, bias in [-100, 100]."""
    logprobs: int | None = None
    """None: no logprobs. 0..20: return each sampled token's logprob plus this many top alternatives."""
    prompt_logprobs: int | None = None
    """None: none. 0..20: the model's logprob of each prompt token after the first (given the
    tokens before it) plus this many top alternatives, with the first output (completions ``echo``
    with ``logprobs``). The prompt is then computed whole: no prefix-cache hit, no drafting."""
    constraint: TokenConstraint | None = None
    """A grammar matcher (structured outputs, tool calls) that masks each step's logits
    (``tiers/core/constraint.py``)."""

    def __post_init__(self) -> None:
        checks = [
            (
                "max_tokens",
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "must be an integer >= 1",
            ),
            (
                "temperature",
                math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0,
                "must be in [0, 2]",
            ),
            ("top_p", math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "must be an integer >= 0"),
            (
                "presence_penalty",
                math.isfinite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
                "must be in [-2, 2]",
            ),
            (
                "frequency_penalty",
                math.isfinite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
                "must be in [-2, 2]",
            ),
            (
                "repetition_penalty",
                math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
                "must be in (0, 10]",
            ),
        ]
        checks.append(("min_p", math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"))
        checks.append(
            (
                "min_tokens",
                isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
                "must be an integer in [0, max_tokens]",
            )
        )
        checks.append(
            (
                "logprobs",
                self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
                "must be an integer in [0, 20]",
            )
        )
        checks.append(
            (
                "prompt_logprobs",
                self.prompt_logprobs is None
                or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
                "must be an integer in [0, 20]",
            )
        )
        checks.append(
            (
                "logit_bias",
                all(math.isfinite(b) and -100.0 <= b <= 100.0 for _, b in self.logit_bias),
                "values must be in [-100, 100]",
            )
        )
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass(slots=True, eq=False)
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    """Prompt followed by generated tokens."""
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    """Tokens whose KV is in the target's cache."""
    num_draft_computed_tokens: int = 0
    """Tokens whose KV is in the draft model's cache (speculative tiers only)."""
    num_cached_tokens: int = 0
    """Prompt tokens taken from the prefix cache instead of computed."""
    cache_salt: str = ""
    """Prefix-cache partition (the tenant): blocks are only shared within one."""
    block_table: BlockTable = field(default_factory=BlockTable)
    """The target's KV blocks."""
    draft_table: BlockTable = field(default_factory=BlockTable)
    """The draft model's KV blocks, in the draft tier's pool (speculative tiers)."""
    fork_of: Sequence | None = None
    """``n > 1``: the branch whose prompt blocks this one shares once they are computed."""
    num_preemptions: int = 0
    caller: str = ""
    """Who asked (the tenant, or the API key): the scheduler shares batch slots fairly between
    callers and keeps each caller's own requests in arrival order (``Scheduler``)."""
    finish_reason: str | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    abort_requested: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # Block names are chained from the partition's salt: a table salted otherwise would
        # publish this tenant's blocks where another partition finds them.
        self.block_table.salt = self.draft_table.salt = self.cache_salt

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefilling(self) -> bool:
        """True until the whole prompt is in the cache (the first token is sampled at that step)."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def prompt_logprobs_pending(self) -> bool:
        """The request asked for its prompt's logprobs and has no output yet: its prompt chunks
        run with logits at every position, from the first token (no prefix-cache hit)."""
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def is_decoding(self) -> bool:
        """Exactly the last sampled token is not in the cache yet: one forward gives the next."""
        return self.num_tokens - self.num_computed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_remaining_tokens(self) -> int:
        return self.params.max_tokens - self.num_output_tokens

    def finish(self, status: SequenceStatus, reason: str) -> None:
        self.status = status
        self.finish_reason = reason
        self.finish_time = time.monotonic()
