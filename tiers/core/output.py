"""What an engine hands back per step, and its text side: incremental detokenization and stop strings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["IncrementalDetokenizer", "StepOutput", "TokenLogprob"]


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's log-probability under the distribution it was sampled from (after
    temperature, penalties, bias and masks: the request's own distribution, as vLLM reports
    ``processed_logprobs``), with the ``top`` most likely alternatives ``(token_id, logprob)``."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class StepOutput:
    """New text and tokens of one sequence from one engine step (several tokens with speculation)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    """One entry per token in ``token_ids`` when the request asked for logprobs."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """On a request's first output, when it asked for them: one entry per prompt token, ``None``
    for the first (nothing precedes it); ``prompt_token_ids`` beside them."""
    prompt_token_ids: list[int] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # Remote tiers only: an OpenAI-compatible upstream has already shaped these, and they are
    # passed through as it sent them (local engines leave them at their defaults).
    index: int = 0
    """The choice this output belongs to (an upstream streams n > 1 choices interleaved)."""
    tool_calls: list[dict[str, Any]] | None = None
    """The upstream's ``delta.tool_calls`` items (index, id, function name, argument fragments)."""
    wire_logprobs: Any = None
    """The upstream's ``logprobs`` object of this chunk (chat ``{"content": [...]}`` or legacy)."""


class IncrementalDetokenizer:
    """Turns output token ids into text deltas, holding back what may still change.

    Two things are held back: a trailing incomplete UTF-8 sequence (decodes to U+FFFD until its last
    byte-token arrives), and a suffix that could be the start of a stop string, since OpenAI never
    returns the stop string itself.
    """

    def __init__(
        self, tokenizer: Any, stop: tuple[str, ...] = (), include_stop: bool = False, min_tokens: int = 0
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.min_tokens = min_tokens
        """Stop strings are looked for once this many tokens are in (vLLM's ``min_tokens``)."""
        self.include_stop = include_stop
        """Keep the stop string that ended the text (vLLM's ``include_stop_str_in_output``)."""
        self.ids: list[int] = []
        self.text = ""  # all decoded text so far (truncated at a stop string once found)
        self.emitted = 0  # chars of self.text already returned
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def add(self, token_id: int) -> None:
        """Append one token; sets ``stopped`` when a stop string completes."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        before = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        if self.stop and len(self.ids) >= self.min_tokens:
            longest = max(len(s) for s in self.stop)
            window_start = max(0, before - longest + 1)
            hits = [(i, i + len(s)) for s in self.stop if (i := self.text.find(s, window_start)) >= 0]
            if hits:
                start, end = min(hits)
                self.text = self.text[: end if self.include_stop else start]
                self.stopped = True

    def add_and_check(self, token_id: int) -> bool:
        """``add``, then whether a stop string has completed (``Scheduler.append_tokens``)."""
        self.add(token_id)
        return self.stopped

    def take(self, final: bool = False) -> str:
        """Text not yet returned that can no longer change (everything, when ``final``)."""
        end = len(self.text)
        if not final and not self.stopped and self.stop:
            end -= self._partial_stop_len()
        end = max(end, self.emitted)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
