"""``Merged``: one answer's choices, one output stream each (a local tier) or one stream whose
outputs say their own index (a remote tier), read as ``(index, output)`` pairs in arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from tiers.core.output import StepOutput

__all__ = ["Merged"]


class Merged:
    """``(choice index, output)`` pairs from one stream per choice, in arrival order, or from a
    single stream whose outputs say their own index (a remote tier). Ends when every stream has."""

    def __init__(self, sources: list[AsyncIterator[StepOutput]]) -> None:
        self.sources = sources
        self._queue: asyncio.Queue[tuple[int, StepOutput | BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._live = len(sources)

    def __aiter__(self) -> Merged:
        return self

    async def _pump(self, index: int, source: AsyncIterator[StepOutput]) -> None:
        try:
            async for out in source:
                self._queue.put_nowait((index, out))
        except BaseException as exc:  # handed to the reader, which raises it
            self._queue.put_nowait((index, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._queue.put_nowait((index, None))

    async def __anext__(self) -> tuple[int, StepOutput]:
        if len(self.sources) == 1:
            out = await anext(self.sources[0])  # StopAsyncIteration ends us too
            return out.index, out
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self.sources)]
        while self._live:
            index, item = await self._queue.get()
            if item is None:
                self._live -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return index, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        # Every source is closed (each close aborts its engine request), even if this task is
        # cancelled while closing one of them; the cancellation is raised after the last.
        cancelled: asyncio.CancelledError | None = None
        for source in self.sources:
            close = getattr(source, "aclose", None)
            if close is None:
                continue
            try:
                await close()
            except asyncio.CancelledError as exc:
                cancelled = exc
            except Exception:
                pass
        if cancelled is not None:
            raise cancelled
