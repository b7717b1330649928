"""``tiers.engine.request``: ``EngineLoad.is_full`` at its bound, the ``RequestHandle`` a caller
iterates (outputs in order, the end at the first finish reason, an abort when the consumer leaves
early and never after the end), and ``push_all``'s hand-off to event loops.

Compared against the bound worked by hand (waiting room plus free batch slots) and against
recording engines and loops; no model.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tiers.core.output import StepOutput
from tiers.core.sequence import SamplingParams, Sequence
from tiers.engine.request import EngineLoad, RequestHandle, Tracked, push_all


class FakeEngine:
    def __init__(self) -> None:
        self.aborted: list[Sequence] = []

    def abort(self, seq: Sequence) -> None:
        self.aborted.append(seq)


def load(num_running: int, num_waiting: int, max_num_seqs: int = 4, max_waiting: int = 3) -> EngineLoad:
    return EngineLoad(num_running, num_waiting, max_num_seqs, max_waiting, kv_tokens=0, kv_capacity=64)


def out(text: str, finish: str | None = None) -> StepOutput:
    return StepOutput(text=text, token_ids=[len(text)], finish_reason=finish)


# -- EngineLoad ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("running", "waiting", "full"),
    [
        (4, 2, False),  # one below the waiting room (3), no free slot
        (4, 3, True),  # exactly at it
        (4, 4, True),
        (1, 5, False),  # waiting room 3 + 3 free slots = 6: one below
        (1, 6, True),  # at it
        (0, 6, False),  # 3 + 4 free slots = 7
        (6, 3, True),  # more running than slots: no negative slots (max(0, ...))
        (6, 2, False),
    ],
)
def test_is_full_at_the_bound_and_one_below(running: int, waiting: int, full: bool) -> None:
    """Bug it catches: ``>`` for ``>=``, ``max(0, ...)`` dropped (running above ``max_num_seqs``
    would shrink the room), or the free slots not counted - full exactly when the waiting sequences
    reach ``max_waiting`` plus the free batch slots."""
    assert load(running, waiting).is_full is full


def test_is_full_with_no_waiting_room() -> None:
    """Bug it catches: the bound off by one at ``max_waiting = 0`` - a free slot still admits, none
    left means full even with nobody waiting."""
    assert load(3, 0, max_num_seqs=4, max_waiting=0).is_full is False
    assert load(3, 1, max_num_seqs=4, max_waiting=0).is_full is True
    assert load(4, 0, max_num_seqs=4, max_waiting=0).is_full is True


def test_engine_load_defaults() -> None:
    """Bug it catches: a changed default - a load with no prediction reports a 0.0 wait and 0 submitted."""
    figures = load(0, 0)
    assert figures.predicted_wait_s == 0.0 and figures.submitted == 0


# -- RequestHandle ------------------------------------------------------------------------------------


async def test_handle_yields_every_output_up_to_the_finish_and_stops() -> None:
    """Bug it catches: the end taken at the first output, the finishing output not yielded, or the
    iteration going on past it - outputs come in order, the last is the finishing one, and an output
    queued after it is never read."""
    engine = FakeEngine()
    seq = Sequence([1], SamplingParams())
    handle = RequestHandle(engine, seq, asyncio.get_running_loop())
    for o in (out("a"), out(""), out("b", "stop"), out("late")):
        handle._push(o)
    got = [o.text async for o in handle]
    assert got == ["a", "", "b"]
    assert handle.finished is True
    assert engine.aborted == []  # a finished request is never aborted


async def test_consumer_leaving_early_aborts_the_request() -> None:
    """Bug it catches: the ``finally`` abort dropped or its ``if not self.finished`` flipped - a client
    that stops reading before the finish cancels its sequence in the engine, once."""
    engine = FakeEngine()
    seq = Sequence([1], SamplingParams())
    handle = RequestHandle(engine, seq, asyncio.get_running_loop())
    handle._push(out("a"))
    handle._push(out("b"))
    it = handle.__aiter__()
    assert (await it.__anext__()).text == "a"
    await it.aclose()  # type: ignore[attr-defined]
    assert engine.aborted == [seq]
    assert handle.finished is False


async def test_abort_after_the_finish_does_nothing() -> None:
    """Bug it catches: ``if not self.finished`` dropped in ``abort`` - aborting a finished request
    would send the engine an abort for a sequence it no longer holds."""
    engine = FakeEngine()
    seq = Sequence([1], SamplingParams())
    handle = RequestHandle(engine, seq, asyncio.get_running_loop())
    handle.abort()
    assert engine.aborted == [seq]
    handle._push(out("x", "length"))
    assert [o.finish_reason async for o in handle] == ["length"]
    handle.abort()
    assert engine.aborted == [seq]


def test_request_id_is_the_sequence_id() -> None:
    """Bug it catches: ``request_id`` read from anything but the sequence's id."""
    seq = Sequence([1], SamplingParams())
    loop = asyncio.new_event_loop()
    try:
        assert RequestHandle(FakeEngine(), seq, loop).request_id == seq.seq_id
    finally:
        loop.close()


async def test_push_threadsafe_from_another_thread_reaches_the_loop() -> None:
    """Bug it catches: ``_push_threadsafe`` putting into the queue directly (not through the loop) or
    dropping the output - an output pushed from the device thread is read on the loop."""
    seq = Sequence([1], SamplingParams())
    handle = RequestHandle(FakeEngine(), seq, asyncio.get_running_loop())
    thread = threading.Thread(target=handle._push_threadsafe, args=(out("hi", "stop"),))
    thread.start()
    thread.join()
    assert [o.text async for o in handle] == ["hi"]


def test_push_to_a_closed_loop_is_silently_dropped() -> None:
    """Bug it catches: the ``suppress(RuntimeError)`` removed - a request whose loop has closed
    (nobody listens any more) must not crash the device thread."""
    loop = asyncio.new_event_loop()
    handle = RequestHandle(FakeEngine(), Sequence([1], SamplingParams()), loop)
    loop.close()
    handle._push_threadsafe(out("x"))
    push_all([(handle, out("y"))])
    assert handle._queue.empty()


def test_push_threadsafe_goes_through_the_loop() -> None:
    """Bug it catches: ``_push_threadsafe`` putting into the asyncio queue itself (not thread-safe from
    the device thread) - the output lands only when the handle's loop runs its callbacks."""
    loop = asyncio.new_event_loop()
    try:
        handle = RequestHandle(FakeEngine(), Sequence([1], SamplingParams()), loop)
        handle._push_threadsafe(out("x"))
        assert handle._queue.empty()
        loop.run_until_complete(asyncio.sleep(0))
        assert handle._queue.get_nowait().text == "x"
    finally:
        loop.close()


def test_push_all_delivers_in_order_per_loop_and_skips_closed_loops() -> None:
    """Bug it catches: outputs grouped under the wrong loop, reordered, one batch per output lost, or
    a closed loop stopping the rest - each handle gets its own outputs in the order given."""
    loops = [asyncio.new_event_loop() for _ in range(3)]
    try:
        handles = [RequestHandle(FakeEngine(), Sequence([1], SamplingParams()), lp) for lp in loops]
        loops[1].close()
        items = [
            (handles[0], out("a")),
            (handles[2], out("x")),
            (handles[1], out("lost")),
            (handles[0], out("b")),
            (handles[2], out("y", "stop")),
        ]
        push_all(items)
        for lp in (loops[0], loops[2]):
            lp.run_until_complete(asyncio.sleep(0))

        def drained(h: RequestHandle) -> list[str]:
            got = []
            while not h._queue.empty():
                got.append(h._queue.get_nowait().text)
            return got

        assert drained(handles[0]) == ["a", "b"]
        assert drained(handles[2]) == ["x", "y"]
    finally:
        for lp in loops:
            if not lp.is_closed():
                lp.close()


def test_tracked_defaults_are_fresh_and_empty() -> None:
    """Bug it catches: pending lists shared between requests or a default prompt-logprobs dict /
    predicted wait - a new request starts with nothing pending and no prediction."""
    loop = asyncio.new_event_loop()
    try:
        seqs = [Sequence([1], SamplingParams()) for _ in range(2)]
        a, b = (Tracked(s, RequestHandle(FakeEngine(), s, loop), None, None) for s in seqs)  # type: ignore[arg-type]
        a.pending_tokens.append(1)
        a.pending_logprobs.append(None)  # type: ignore[arg-type]
        assert b.pending_tokens == [] and b.pending_logprobs == []
        assert b.prompt_logprobs is None and b.predicted_wait is None
    finally:
        loop.close()
