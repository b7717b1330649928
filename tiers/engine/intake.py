"""Requests on their way into an engine: submitted from any thread, handed to the scheduler on the
device thread, and counted meanwhile (the wait prediction sees them: ``pacing.py``)."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any, Literal

import torch

from tiers.core.output import IncrementalDetokenizer
from tiers.core.sequence import SamplingParams, Sequence
from tiers.engine.request import Aborts, RequestHandle, Tracked

__all__ = ["Intake"]


class Intake:
    """A thread-safe inbox of new requests (``Tracked``) and aborts, with what it holds counted."""

    def __init__(self, tokenizer: Any, device: torch.device | str = "cpu") -> None:
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        """Where seeded requests' generators draw (the sampler's device)."""
        self._inbox: queue.SimpleQueue[tuple[Literal["add"], Tracked] | tuple[Literal["abort"], Sequence]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self.tokens = 0
        """Prompt tokens of requests submitted but not yet handed to the scheduler."""
        self.callers: Counter[str] = Counter()
        """Those requests per caller: a caller's share counts its own, not a flood's."""
        self.caller_tokens: Counter[str] = Counter()
        """And their prompt tokens: a caller's own earlier requests run before its new one."""
        self.submitted = 0
        """Requests submitted since the engine started (monotonic; n > 1 counts once): how a
        router that decided for this engine sees its decision land."""

    def qsize(self) -> int:
        return self._inbox.qsize()

    def empty(self) -> bool:
        return self._inbox.empty()

    def counts(self, caller: str | None) -> tuple[int, int, int]:
        """``(prompt tokens, caller's requests, caller's prompt tokens)`` in the inbox now."""
        with self._lock:
            if caller is None:
                return self.tokens, 0, 0
            return self.tokens, self.callers[caller], self.caller_tokens[caller]

    def submit(
        self,
        engine: Aborts,
        prompt: list[int],
        params: list[SamplingParams],
        eos_token_ids: frozenset[int],
        cache_salt: str,
        caller: str,
        predicted: tuple[float, bool],
    ) -> list[Tracked]:
        """Queue one request's sequences (one per entry of ``params``; the later ones fork the
        first one's prompt): each with its handle (on the running event loop), detokenizer and
        generator. ``predicted``: the uncalibrated wait predicted for it, and whether unprotected."""
        loop = asyncio.get_running_loop()
        items: list[Tracked] = []
        for p in params:
            seq = Sequence(list(prompt), p, eos_token_ids=eos_token_ids, cache_salt=cache_salt, caller=caller)
            seq.fork_of = items[0].seq if items else None
            gen = torch.Generator(self.device).manual_seed(p.seed) if p.seed is not None else None
            detok = IncrementalDetokenizer(self.tokenizer, p.stop, p.include_stop_str_in_output, p.min_tokens)
            wait = None if items else predicted
            items.append(Tracked(seq, RequestHandle(engine, seq, loop), detok, gen, predicted_wait=wait))
        self.add(items)
        self.submitted += 1
        return items

    def add(self, items: list[Tracked]) -> None:
        """One request's sequences (``n > 1``: the later ones fork the first one's prompt, so its
        tokens count once)."""
        if not items:
            return
        seq = items[0].seq
        with self._lock:
            self.tokens += seq.num_prompt_tokens
            self.callers[seq.caller] += len(items)
            self.caller_tokens[seq.caller] += seq.num_prompt_tokens
        for item in items:
            self._inbox.put(("add", item))

    def abort(self, seq: Sequence) -> None:
        self._inbox.put(("abort", seq))

    def drain(self) -> Iterator[tuple[Literal["add"], Tracked] | tuple[Literal["abort"], Sequence]]:
        """What was submitted since the last call, in order (device thread)."""
        while True:
            try:
                entry = self._inbox.get_nowait()
            except queue.Empty:
                return
            if entry[0] == "add":
                seq = entry[1].seq
                with self._lock:
                    self.callers[seq.caller] -= 1
                    if not self.callers[seq.caller]:
                        del self.callers[seq.caller]
                    if seq.fork_of is None:
                        self.tokens -= seq.num_prompt_tokens
                        self.caller_tokens[seq.caller] -= seq.num_prompt_tokens
                        if not self.caller_tokens[seq.caller]:
                            del self.caller_tokens[seq.caller]
            yield entry
