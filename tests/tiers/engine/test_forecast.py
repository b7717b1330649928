"""``tiers.engine.forecast``: the figures an engine gives admission and routing - its load, the
room check before a submit, the predicted wait and the priced decode round - gathered from its
scheduler, its intake and the other engines on the device.

Under test: ``Forecast`` over a real ``Scheduler`` (its ``backlog`` recorded on the way through),
a real ``Intake`` and a real ``Pace`` with hand-set costs, and a stand-in spec controller. Expected
figures are worked by hand from those costs (``pacing.predict_wait``'s formula on small numbers).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tiers.core.block_manager import BlockManager, BlockTable
from tiers.core.sched.batch import SchedulerConfig
from tiers.core.sched.pacing import Backlog, Pace
from tiers.core.sched.scheduler import Scheduler
from tiers.core.sequence import SamplingParams, Sequence, SequenceStatus
from tiers.engine.forecast import Forecast
from tiers.engine.intake import Intake
from tiers.engine.request import EngineFullError


class SpyScheduler(Scheduler):
    """A real scheduler whose ``backlog`` calls are recorded (and, when set, answered with ``answer``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.answer: Backlog | None = None

    def backlog(self, *args: Any, **kwargs: Any) -> Backlog:  # type: ignore[override]
        self.calls.append((args, kwargs))
        return self.answer if self.answer is not None else super().backlog(*args, **kwargs)


class FakeSpec:
    def __init__(self) -> None:
        self.asked: list[int] = []
        self.fail = False

    def best_round(self, batch_size: int) -> tuple[float, float] | None:
        self.asked.append(batch_size)
        if self.fail:
            raise RuntimeError("dictionary changed size during iteration")
        return (0.01 * batch_size, 1.5)


class Tok:
    def decode(self, ids: list[int], **_: object) -> str:
        return ""


def build(
    *, max_num_seqs: int = 2, max_waiting: int = 3, max_model_len: int = 100, others: list[Any] | None = None
) -> tuple[Forecast, SpyScheduler, Intake, Pace, FakeSpec]:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
        max_model_len=max_model_len,
        max_waiting=max_waiting,
    )
    scheduler = SpyScheduler(config, BlockManager(10, 4))
    intake = Intake(Tok())
    pace = Pace(max_num_seqs, 64)
    spec = FakeSpec()
    listed = others if others is not None else []
    forecast = Forecast(scheduler, intake, pace, spec, lambda: listed)  # type: ignore[arg-type]
    return forecast, scheduler, intake, pace, spec


def submit(intake: Intake, prompt_len: int, n: int = 1, caller: str = "alice") -> None:
    async def go() -> None:
        intake.submit(
            None,  # type: ignore[arg-type]
            list(range(1, prompt_len + 1)),
            [SamplingParams()] * n,
            frozenset(),
            "",
            caller,
            (0.0, False),
        )

    asyncio.run(go())


def running(scheduler: Scheduler, n: int) -> None:
    for _ in range(n):
        seq = Sequence([1, 2, 3], SamplingParams())
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)


# -- load ---------------------------------------------------------------------------------------------


def test_load_gathers_scheduler_intake_and_pool_figures() -> None:
    """Bug it catches: the intake's queue left out of ``num_waiting``, running/waiting swapped, the
    pool's capacity computed from the wrong figure, used blocks for capacity, or ``submitted`` not
    the intake's - each field worked by hand."""
    forecast, scheduler, intake, _, _ = build(max_num_seqs=2, max_waiting=3)
    running(scheduler, 1)
    scheduler.add(Sequence([1], SamplingParams()))
    submit(intake, 4, n=2)
    submit(intake, 2)
    assert scheduler.blocks.allocate(BlockTable(), 12)  # 3 of the 10 blocks of 4 in use
    load = forecast.load(predicted=False)
    assert (load.num_running, load.num_waiting) == (1, 1 + 3)
    assert (load.max_num_seqs, load.max_waiting) == (2, 3)
    assert (load.kv_tokens, load.kv_capacity) == (12, 40)
    assert load.submitted == 2
    assert load.predicted_wait_s == 0.0


def test_load_predicts_the_wait_of_the_whole_engine() -> None:
    """Bug it catches: ``predicted`` ignored (or inverted), or the engine's wait asked for a caller
    rather than ``None`` - the load's wait is ``predicted_wait(None)`` when asked and 0.0 when not."""
    forecast, scheduler, _, pace, _ = build()
    pace.token_cost = 0.01
    scheduler.answer = Backlog(prefill_tokens=127, decoding=0, slots_ahead=0)
    assert forecast.load().predicted_wait_s == pytest.approx(1.28)  # (127 + max(1, 0)) tokens x 0.01
    assert scheduler.calls[-1][0][0] is None
    calls = len(scheduler.calls)
    assert forecast.load(predicted=False).predicted_wait_s == 0.0
    assert len(scheduler.calls) == calls  # not even estimated


# -- check_room ---------------------------------------------------------------------------------------


def test_prompt_at_the_context_length_is_refused_one_below_is_not() -> None:
    """Bug it catches: ``>`` for ``>=`` against ``max_model_len`` - a prompt filling the whole context
    leaves no room for one output token."""
    forecast, *_ = build(max_model_len=100)
    forecast.check_room("small", 99, 1)
    with pytest.raises(ValueError, match="prompt is 100 tokens; this tier's context is 100"):
        forecast.check_room("small", 100, 1)


def test_queue_room_at_the_bound_and_one_past() -> None:
    """Bug it catches: ``n - 1`` dropped or made ``n + 1``, ``>`` for ``>=``, the free slots or the
    intake's queue left out, or the load asked with a prediction (a backlog scan per submit) - with
    2 slots (1 running) and a waiting room of 3, the queue holds 4 more sequences: 2 in the intake
    leave room for exactly 2 more."""
    forecast, scheduler, intake, _, _ = build(max_num_seqs=2, max_waiting=3)
    running(scheduler, 1)
    submit(intake, 3, n=2)
    forecast.check_room("small", 3, 2)
    with pytest.raises(EngineFullError, match="tier 'small' queue is full"):
        forecast.check_room("small", 3, 3)
    assert scheduler.calls == []  # the room check does not pay for a wait prediction


def test_queue_room_counts_no_negative_slots() -> None:
    """Bug it catches: ``max(0, ...)`` dropped - more running than slots (after a resize) must not
    shrink the waiting room below ``max_waiting``."""
    forecast, scheduler, _, _, _ = build(max_num_seqs=2, max_waiting=3)
    running(scheduler, 4)
    forecast.check_room("small", 3, 3)
    with pytest.raises(EngineFullError):
        forecast.check_room("small", 3, 4)


# -- predicted wait -----------------------------------------------------------------------------------


def test_estimate_passes_the_inbox_counts_and_the_other_engines() -> None:
    """Bug it catches: the inbox's size, tokens, the caller's own counts or the expected output length
    not handed to the scheduler's backlog (or swapped), the other engines left out, or ``protected``
    not inverted into ``unprotected`` - the call's arguments and the hand-worked wait:
    own 128 tokens x 0.01 = 1.28 s, the other engine 50 x 0.02 + 2 turns x 0.005 = 1.01 s."""
    other_pace = Pace(4, 32)
    other_pace.token_cost, other_pace.decode_cost = 0.02, 0.005
    other = Backlog(prefill_tokens=50, decoding=1, slots_ahead=0)
    forecast, scheduler, intake, pace, _ = build(others=[(other_pace, other)])
    pace.token_cost = 0.01
    pace.output_len = 17.0
    submit(intake, 5, n=2, caller="alice")
    submit(intake, 7, caller="bob")
    scheduler.answer = Backlog(prefill_tokens=100, decoding=0, slots_ahead=0, protected=False)
    wait, unprotected = forecast.estimate("alice", 28)
    args, kwargs = scheduler.calls[-1]
    assert args == ("alice", 3, 12, 17.0)
    assert kwargs == {"inbox_mine": 2, "inbox_mine_tokens": 5}
    assert wait == pytest.approx(1.28 + 1.01)
    assert unprotected is True
    scheduler.answer = Backlog(prefill_tokens=100, decoding=0, slots_ahead=0, protected=True)
    assert forecast.estimate("alice", 28)[1] is False


def test_predicted_wait_is_calibrated_by_the_matching_ratio() -> None:
    """Bug it catches: the calibration skipped, or the protected ratio used for an unprotected
    request - a ratio of 2 learned for unprotected requests scales (1.28 + 1) x 2 - 1 = 3.56; the
    protected ratio (1) leaves 1.28."""
    forecast, scheduler, _, pace, _ = build()
    pace.token_cost = 0.01
    pace.correction[True] = 2.0
    pace._corrected_at[True] = float("inf")  # just learned: no relaxation towards 1
    scheduler.answer = Backlog(prefill_tokens=100, decoding=0, slots_ahead=0, protected=False)
    assert forecast.predicted_wait("alice", 28) == pytest.approx(3.56)
    scheduler.answer = Backlog(prefill_tokens=100, decoding=0, slots_ahead=0, protected=True)
    assert forecast.predicted_wait("alice", 28) == pytest.approx(1.28)


def test_predicted_wait_defaults_to_a_caller_with_no_prompt() -> None:
    """Bug it catches: a changed default caller (``""`` holds a share; ``None`` would not) or prompt."""
    forecast, scheduler, _, pace, _ = build()
    pace.token_cost = 0.01
    scheduler.answer = Backlog(prefill_tokens=0, decoding=0, slots_ahead=0)
    assert forecast.predicted_wait() == pytest.approx(0.01)  # max(1, 0) token
    assert scheduler.calls[-1][0][0] == ""


def test_backlog_is_the_whole_queue_with_the_inbox() -> None:
    """Bug it catches: the engine's backlog asked for a caller, or the inbox's size or tokens left out -
    it is the scheduler's backlog for ``None`` with the inbox's 3 entries and 12 prompt tokens."""
    forecast, scheduler, intake, _, _ = build()
    submit(intake, 5, n=2)
    submit(intake, 7, caller="bob")
    backlog = forecast.backlog()
    assert scheduler.calls[-1] == ((None, 3, 12), {})
    assert backlog.prefill_tokens == 12


# -- decode round -------------------------------------------------------------------------------------


def test_decode_round_of_an_empty_engine() -> None:
    """Bug it catches: ``< 0`` for ``<= 0`` (the controller asked to price a batch of 0), or a changed
    answer - nothing held and no extra is ``(0.0, 1.0)``."""
    forecast, _, _, _, spec = build()
    assert forecast.decode_round() == (0.0, 1.0)
    assert spec.asked == []


def test_decode_round_counts_every_held_sequence_capped_at_the_batch() -> None:
    """Bug it catches: running, waiting, the intake or ``extra`` left out of the batch, ``max`` for
    ``min``, or the reuse keyed on anything but the batch - each batch size is priced as its own."""
    forecast, scheduler, intake, _, spec = build(max_num_seqs=4)
    running(scheduler, 1)
    assert forecast.decode_round() == (0.01, 1.5)
    scheduler.add(Sequence([1], SamplingParams()))
    assert forecast.decode_round() == (0.02, 1.5)
    submit(intake, 2)
    assert forecast.decode_round() == (0.03, 1.5)
    assert forecast.decode_round(extra=1) == (0.04, 1.5)
    assert forecast.decode_round(extra=5) == (0.04, 1.5)  # capped at max_num_seqs
    assert set(spec.asked) == {1, 2, 3, 4}


def test_decode_round_is_unknown_when_the_controller_is_mid_update() -> None:
    """Bug it catches: the ``RuntimeError`` not caught (a routing decision would crash) or priced as
    something other than unknown."""
    forecast, scheduler, _, _, spec = build()
    running(scheduler, 1)
    spec.fail = True
    assert forecast.decode_round() is None
