"""The engine's interface to the outside: load figures, observer hooks, and the asyncio-side
handle of one request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from tiers.core.output import IncrementalDetokenizer, StepOutput, TokenLogprob
    from tiers.core.sequence import Sequence

__all__ = [
    "Aborts",
    "EngineFullError",
    "EngineLoad",
    "EngineObserver",
    "RequestHandle",
    "Tracked",
    "push_all",
]


class EngineFullError(RuntimeError):
    """The engine's waiting queue is full; the caller should shed load (429)."""


class EngineObserver(Protocol):
    def on_step(self, tier: str, kind: str, num_seqs: int, seconds: float) -> None: ...
    def on_spec(self, tier: str, drafted: int, accepted: int) -> None: ...
    def on_finish(self, tier: str, seq: Sequence) -> None: ...


@dataclass(slots=True)
class EngineLoad:
    num_running: int
    num_waiting: int
    max_num_seqs: int
    max_waiting: int
    kv_tokens: int
    kv_capacity: int
    predicted_wait_s: float = 0.0
    """The engine's estimate of how long a request submitted now waits for its first token
    (queue ahead of it, measured step times); admission compares it with the request's deadline."""
    submitted: int = 0
    """Requests submitted since the engine started (monotonic; n > 1 counts once)."""

    @property
    def is_full(self) -> bool:
        return self.num_waiting >= self.max_waiting + max(0, self.max_num_seqs - self.num_running)


class Aborts(Protocol):
    """What a handle asks of its engine."""

    def abort(self, seq: Sequence) -> None: ...


class RequestHandle:
    """The asyncio side of one request: iterate for outputs, ``abort()`` to cancel."""

    def __init__(self, engine: Aborts, seq: Sequence, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.seq = seq
        self._loop = loop
        self._queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self.finished = False

    @property
    def request_id(self) -> int:
        return self.seq.seq_id

    def _push(self, out: StepOutput) -> None:  # runs on the event loop
        self._queue.put_nowait(out)

    def _push_threadsafe(self, out: StepOutput) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(self._push, out)

    @staticmethod
    def _push_many(items: list[tuple[RequestHandle, StepOutput]]) -> None:  # runs on the event loop
        for handle, out in items:
            handle._push(out)

    def abort(self) -> None:
        if not self.finished:
            self.engine.abort(self.seq)

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        try:
            while True:
                out = await self._queue.get()
                if out.finish_reason is not None:
                    self.finished = True
                yield out
                if self.finished:
                    return
        finally:
            if not self.finished:  # the consumer went away (client disconnect, cancellation)
                self.abort()


@dataclass(slots=True)
class Tracked:
    """A request inside its engine: its sequence, handle, detokenizer, and what waits to be emitted."""

    seq: Sequence
    handle: RequestHandle
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: dict[int, TokenLogprob] | None = None
    """Prompt position -> logprob, gathered chunk by chunk until the first output carries them
    (then None again); only for requests that asked for prompt logprobs."""
    predicted_wait: tuple[float, bool] | None = None
    """The uncalibrated wait predicted at submission and whether it was unprotected (the first
    of ``n`` only)."""


def push_all(items: list[tuple[RequestHandle, StepOutput]]) -> None:
    """Hand outputs from the device thread to their event loops: one call per loop, in order."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, StepOutput]]] = {}
    for handle, out in items:
        by_loop.setdefault(handle._loop, []).append((handle, out))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            loop.call_soon_threadsafe(RequestHandle._push_many, batch)
