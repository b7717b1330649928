"""The response writer's accounting when closing a request is itself interrupted.

A litestar streaming response runs in an anyio cancel scope, which re-delivers its cancellation at
every await: a close that suspends (a source whose cleanup awaits) can be cancelled a second time.
The in-flight count (what draining waits for) and every engine request must still be released.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from router.openai.request import Generation
from router.openai.schemas import ChatCompletionRequest, ChatMessage
from router.openai.writer import InFlight, Merged, ResponseWriter
from router.policy.decide import Decision
from router.telemetry import Telemetry
from tiers.core.output import StepOutput


class SlowClose:
    """A source that never yields and whose close suspends, like a generator awaiting in ``finally``."""

    def __init__(self) -> None:
        self.close_started = asyncio.Event()
        self.closed = False

    def __aiter__(self) -> SlowClose:
        return self

    async def __anext__(self) -> StepOutput:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self.close_started.set()
        await asyncio.sleep(30)
        self.closed = True


class Recording:
    def __init__(self) -> None:
        self.closed = False

    def __aiter__(self) -> Recording:
        return self

    async def __anext__(self) -> StepOutput:
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


async def cancel_twice(task: asyncio.Task[Any], slow: SlowClose) -> None:
    """Cancel ``task``, then cancel it again while it is closing ``slow``."""
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.wait_for(slow.close_started.wait(), 5)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


async def test_merged_closes_every_source_when_a_close_is_cancelled() -> None:
    # Before: the second source's close (which aborts its engine request) was skipped.
    slow, other = SlowClose(), Recording()
    merged = Merged([slow, other])
    task = asyncio.create_task(merged.aclose())
    await asyncio.wait_for(slow.close_started.wait(), 5)
    task.cancel()
    try:
        await task
        raise AssertionError("the cancellation must still reach the caller")
    except asyncio.CancelledError:
        pass
    assert other.closed


def writer_and_generation(stream: bool) -> tuple[ResponseWriter, InFlight, Generation, Decision]:
    in_flight = InFlight()
    writer = ResponseWriter(Telemetry(), in_flight)
    req = ChatCompletionRequest(model="small", messages=[ChatMessage(role="user", content="hi")])
    gen = Generation("chat", req, [{"role": "user", "content": "hi"}], None, stream, False)
    return writer, in_flight, gen, Decision("small", "r", "test", 0.0)


@pytest.mark.parametrize("stream", [False, True], ids=["collect", "sse"])
async def test_the_writer_leaves_in_flight_when_its_close_is_cancelled(stream: bool) -> None:
    # Before: the count stayed at 1 and a drain waited for a request that no longer existed.
    writer, in_flight, gen, d = writer_and_generation(stream=stream)
    slow = SlowClose()
    task = asyncio.create_task(writer.answer(gen, d, slow, {}, 1, timeout_s=30))
    await asyncio.sleep(0.01)
    assert in_flight.count == 1
    await cancel_twice(task, slow)
    assert in_flight.count == 0
