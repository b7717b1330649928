"""router/pipeline/admission.py without a server: the fair share per caller and its window, the hold that
releases exactly once, the client deadline, priorities, each tier's pressure and the refusal's
error and Retry-After (test_admission.py drives the same through HTTP)."""

from __future__ import annotations

import asyncio
import gc
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import router.pipeline.admission
from router.errors import BadRequestError, OverloadedError, UnavailableError
from router.pipeline.admission import (
    FairShare,
    TierPressure,
    assess,
    client_deadline_s,
    rejection,
    tier_pressures,
)
from router.policy.decide import Decision
from router.policy.loader import parse_policy

POLICY = parse_policy(
    "tiers:\n"
    "  small: {model: m, max_num_seqs: 2, max_queue: 2, max_queue_wait_s: 4}\n"
    "  large: {model: m, max_num_seqs: 3, max_queue: 5}\n"
    "tenants: {batch: {priority: low}, vip: {priority: high}, plain: {}}\n"
    "routing: {rules: [{name: d, tier: small}]}\n"
    "service: {max_request_timeout_s: 30}\n"
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(router.pipeline.admission, "time", fake)
    return fake


async def stream(*items: Any, fail: BaseException | None = None) -> AsyncIterator[Any]:
    for item in items:
        yield item
    if fail is not None:
        raise fail


def test_a_pressure_refuses_for_each_reason_and_only_then() -> None:
    ok = TierPressure(full=False, wait_s=2.0, budget_s=2.0)
    assert not ok.refuses  # a wait equal to the budget is within it
    assert TierPressure(full=True, wait_s=0.0, budget_s=2.0).refuses
    assert TierPressure(full=False, wait_s=2.01, budget_s=2.0).refuses
    assert TierPressure(full=False, wait_s=0.0, budget_s=2.0, over_share=True).refuses
    assert TierPressure(full=False, wait_s=0.0, budget_s=2.0, circuit_open_s=0.0).refuses


def test_a_lone_caller_may_use_the_whole_tier_and_two_split_it(clock: Clock) -> None:
    fair = FairShare()
    assert not fair.over_share("small", None, 4)  # a request without a caller holds no share
    held = [fair.hold("small", "a", stream()) for _ in range(3)]
    assert not fair.over_share("small", "a", 4)  # alone: 3 of 4
    held.append(fair.hold("small", "a", stream()))
    assert fair.over_share("small", "a", 4)  # alone: 4 of 4
    # b arrives: it counts itself, so the share is 4 // 2 and a is over it, b is not.
    assert not fair.over_share("small", "b", 4)
    fair.note("small", "b")
    assert fair.over_share("small", "a", 4)
    b = fair.hold("small", "b", stream())
    assert not fair.over_share("small", "b", 4)
    b2 = fair.hold("small", "b", stream())
    assert fair.over_share("small", "b", 4)  # 2 of 2
    # Other tiers are counted apart.
    assert not fair.over_share("large", "a", 4)
    # More callers than places: each still gets one.
    for c in "cdefg":
        fair.note("small", c)
    assert not fair.over_share("small", "h", 4)
    assert held and b and b2


def test_a_caller_leaves_the_split_after_the_window_unless_it_still_holds(clock: Clock) -> None:
    fair = FairShare(window_s=10.0)
    a = [fair.hold("small", "a", stream()) for _ in range(2)]
    fair.note("small", "b")  # b was refused once: it still claims its share for the window
    assert fair.over_share("small", "a", 4)
    clock.now += 10.0
    assert fair.over_share("small", "a", 4)  # exactly the window: still counted
    clock.now += 0.1
    assert not fair.over_share("small", "a", 4)  # b has gone quiet: a alone again
    # a itself, quiet as long but still holding requests, stays in the split.
    clock.now += 100.0
    fair.note("small", "c")
    assert fair.over_share("small", "a", 4)
    assert a


async def test_a_hold_releases_once_at_the_end_on_close_on_error_and_when_dropped(clock: Clock) -> None:
    fair = FairShare()
    counts = fair._held["small"]

    done = fair.hold("small", "a", stream(1, 2))
    assert counts["a"] == 1
    assert [x async for x in done] == [1, 2]
    assert "a" not in counts  # released at the end, and the entry dropped at zero
    await done.aclose()  # type: ignore[attr-defined]
    assert "a" not in counts  # not twice

    closed = fair.hold("small", "a", stream(1, 2))
    other = fair.hold("small", "a", stream(1))
    assert counts["a"] == 2
    assert await anext(closed) == 1
    await closed.aclose()  # type: ignore[attr-defined]
    assert counts["a"] == 1

    failing = fair.hold("small", "b", stream(1, fail=RuntimeError("boom")))
    assert await anext(failing) == 1
    with pytest.raises(RuntimeError, match="boom"):
        await anext(failing)
    assert "b" not in counts

    dropped = fair.hold("small", "c", stream(1))
    assert counts["c"] == 1
    del dropped
    gc.collect()
    assert "c" not in counts  # never started: released when collected
    assert counts["a"] == 1 and other is not None

    plain = stream(1)
    assert fair.hold("small", None, plain) is plain  # no caller: nothing counted


def test_the_client_deadline_is_parsed_capped_and_validated() -> None:
    assert client_deadline_s({}, POLICY) is None
    assert client_deadline_s({"x-request-timeout": "  "}, POLICY) is None
    assert client_deadline_s({"x-request-timeout": "2.5"}, POLICY) == 2.5
    assert client_deadline_s({"x-request-timeout": "30"}, POLICY) == 30.0
    assert client_deadline_s({"x-request-timeout": "600"}, POLICY) == 30.0  # the policy's cap
    for bad in ("soon", "nan", "inf", "-1", "0", "-inf"):
        with pytest.raises(BadRequestError) as err:
            client_deadline_s({"x-request-timeout": bad}, POLICY)
        assert err.value.code == "invalid_request_timeout"


@dataclass
class Load:
    is_full: bool = False
    predicted_wait_s: float = 0.0
    circuit_open_s: float | None = None


@dataclass
class FakeEngine:
    load_now: Load = field(default_factory=Load)
    wait_s: float = 0.0
    asked: list[tuple[str, int]] = field(default_factory=list)

    def load(self, predicted: bool = True) -> Load:
        assert predicted is False  # admission reads the caller-aware estimate instead
        return self.load_now

    def predicted_wait(self, caller: str, prompt_tokens: int = 0) -> float:
        self.asked.append((caller, prompt_tokens))
        return self.wait_s


@dataclass
class Local:
    engine: FakeEngine


@dataclass
class Client:
    load_now: Load

    def load(self) -> Load:
        return self.load_now


@dataclass
class Remote:
    client: Client

    def load(self) -> Load:  # the Backend protocol's: the upstream's load
        return self.client.load()


@dataclass
class Tiers:
    tiers: dict[str, Any]


def test_pressures_budget_by_priority_and_deadline_and_wait_per_caller(clock: Clock) -> None:
    small = FakeEngine(Load(is_full=False, predicted_wait_s=99.0), wait_s=3.0)
    tiers = Tiers(
        {"small": Local(small), "large": Remote(Client(Load(True, 7.5, 2.5))), "gone": Local(FakeEngine())}
    )
    fair = FairShare()
    p = tier_pressures(tiers, POLICY, None, fair, "alice", "plain", prompt_tokens=40)  # type: ignore[arg-type]
    assert set(p) == {"small", "large"}  # a tier the policy no longer has is skipped
    assert p["small"] == TierPressure(full=False, wait_s=3.0, budget_s=4.0)  # the engine's own wait
    assert small.asked == [("alice", 40)]
    assert p["large"] == TierPressure(full=True, wait_s=7.5, budget_s=5.0, circuit_open_s=2.5)
    assert tier_pressures(tiers, POLICY, 1.5, tenant="plain")["small"].budget_s == 1.5  # type: ignore[arg-type]
    assert tier_pressures(tiers, POLICY, 9.0, tenant="plain")["small"].budget_s == 4.0  # type: ignore[arg-type]
    assert tier_pressures(tiers, POLICY, None, tenant="batch")["small"].budget_s == 2.0  # type: ignore[arg-type]
    assert tier_pressures(tiers, POLICY, None, tenant="vip")["large"].budget_s == 10.0  # type: ignore[arg-type]
    assert tier_pressures(tiers, POLICY, None, tenant="nobody")["small"].budget_s == 4.0  # type: ignore[arg-type]
    tier_pressures(tiers, POLICY, None)  # type: ignore[arg-type]
    assert small.asked[-1] == ("", 0)  # no caller: the estimate for a request holding no share
    # The share is of the tier's running + queued places: small 2 + 2, large 3 + 5.
    held = [fair.hold("small", "alice", stream()) for _ in range(4)]
    p = tier_pressures(tiers, POLICY, None, fair, "alice")  # type: ignore[arg-type]
    assert p["small"].over_share and not p["large"].over_share
    held += [fair.hold("large", "alice", stream()) for _ in range(7)]
    assert not tier_pressures(tiers, POLICY, None, fair, "alice")["large"].over_share  # type: ignore[arg-type]
    held.append(fair.hold("large", "alice", stream()))
    assert tier_pressures(tiers, POLICY, None, fair, "alice")["large"].over_share  # type: ignore[arg-type]
    assert held


def test_assess_is_the_deadline_and_the_pressures_in_one_call(clock: Clock) -> None:
    """Bug it guards: admission became one call (assess) instead of the service reading the
    deadline, the pressures and each pressure's verdict in turn; the deadline must still cap each
    budget and be refused when malformed even without tiers, and ``refusing`` must be each
    pressure's own verdict."""
    tiers = Tiers({"small": Local(FakeEngine(wait_s=3.0)), "large": Remote(Client(Load(is_full=True)))})
    headers = {"x-request-timeout": "2.5"}
    got = assess(tiers, POLICY, headers, FairShare(), "alice", "plain", 40, None)  # type: ignore[arg-type]
    assert got.deadline_s == 2.5
    assert got.pressures == tier_pressures(tiers, POLICY, 2.5, FairShare(), "alice", "plain", 40)  # type: ignore[arg-type]
    assert got.refusing == {"small": True, "large": True}  # 3 s > 2.5 s; large is full
    assert assess(tiers, POLICY, {}, None, None, None, 0, None).refusing == {"small": False, "large": True}  # type: ignore[arg-type]
    none = assess(None, POLICY, {"x-request-timeout": "600"}, None, None, None, 0, None)
    assert (none.deadline_s, none.pressures, none.refusing) == (30.0, {}, {})
    with pytest.raises(BadRequestError):
        assess(None, POLICY, {"x-request-timeout": "soon"}, None, None, None, 0, None)


def test_a_pressure_works_its_verdict_out_once_and_keeps_it() -> None:
    """``refuses`` and ``misses_deadline`` are fields set when the pressure is built (it is frozen)."""
    late = TierPressure(full=False, wait_s=0.0, budget_s=5.0, finish_s=3.0, deadline_s=2.0)
    assert late.misses_deadline and late.refuses
    assert not TierPressure(full=False, wait_s=0.0, budget_s=5.0, finish_s=2.0, deadline_s=2.0).refuses
    with pytest.raises(AttributeError):
        late.refuses = False  # type: ignore[misc]


DECISION = Decision("small", "d", "rule d", 0.5, rejected=True)


def test_each_refusal_names_its_reason_with_an_honest_retry_after() -> None:
    circuit = rejection(DECISION, {"small": TierPressure(True, 9.0, 1.0, circuit_open_s=2.2)})
    assert isinstance(circuit, UnavailableError) and circuit.code == "tier_unavailable"
    assert circuit.retry_after == 3 and not circuit.spread_retries
    assert rejection(DECISION, {"small": TierPressure(False, 0, 1, circuit_open_s=0.1)}).retry_after == 1.0

    share = rejection(DECISION, {"small": TierPressure(False, 2.4, 5.0, over_share=True)})
    assert isinstance(share, OverloadedError) and share.code == "fair_share_exceeded"
    assert share.retry_after == 3 and share.spread_retries
    assert rejection(DECISION, {"small": TierPressure(False, 0.0, 5.0, over_share=True)}).retry_after == 1.0

    slow = rejection(DECISION, {"small": TierPressure(False, 12.0, 5.0)})
    assert isinstance(slow, OverloadedError) and slow.code == "predicted_wait_exceeded"
    assert slow.retry_after == 7 and slow.spread_retries
    assert rejection(DECISION, {"small": TierPressure(False, 5.5, 5.0)}).retry_after == 1.0

    # Full (over its share too, or past the budget too): plain capacity, retry after the wait.
    for p in (TierPressure(True, 3.2, 5.0, over_share=True), TierPressure(True, 8.0, 5.0)):
        full = rejection(DECISION, {"small": p})
        assert isinstance(full, OverloadedError) and full.code not in (
            "fair_share_exceeded",
            "predicted_wait_exceeded",
        )
        assert full.retry_after == math.ceil(p.wait_s) and full.spread_retries
    unknown = rejection(DECISION, {})
    assert isinstance(unknown, OverloadedError) and unknown.retry_after == 1.0


def test_hold_counts_survive_concurrent_streams() -> None:
    """Several answers of one caller streaming at once: the count is theirs exactly."""

    async def scenario() -> None:
        fair = FairShare()
        streams = [fair.hold("small", "a", stream(*range(3))) for _ in range(5)]
        assert fair._held["small"]["a"] == 5

        async def drain(s: AsyncIterator[Any]) -> list[Any]:
            return [x async for x in s]

        assert await asyncio.gather(*(drain(s) for s in streams)) == [[0, 1, 2]] * 5
        assert "a" not in fair._held["small"]

    asyncio.run(scenario())


def test_a_non_streaming_answer_that_cannot_finish_before_the_deadline_is_refused() -> None:
    assert not TierPressure(False, 1.0, 5.0, finish_s=9.0).misses_deadline  # no deadline
    assert not TierPressure(False, 1.0, 5.0, deadline_s=9.0).misses_deadline  # not predicted
    assert not TierPressure(False, 1.0, 5.0, finish_s=9.0, deadline_s=9.0).misses_deadline
    late = TierPressure(False, 1.0, 5.0, finish_s=9.5, deadline_s=9.0)
    assert late.misses_deadline and late.refuses

    class Timed(FakeEngine):
        def __init__(self, rnd: tuple[float, float] | None) -> None:
            super().__init__(Load(), wait_s=2.0)
            self.rnd = rnd
            self.rows: list[int] = []

        def decode_round(self, rows: int) -> tuple[float, float] | None:
            self.rows.append(rows)
            return self.rnd

    engine = Timed((0.05, 2.0))  # a round of 50 ms gives each row 2 tokens
    tiers = Tiers({"small": Local(engine), "large": Remote(Client(Load()))})
    p = tier_pressures(tiers, POLICY, 20.0, max_tokens=100)  # type: ignore[arg-type]
    assert p["small"].finish_s == pytest.approx(2.0 + 100 / 2.0 * 0.05) and p["small"].deadline_s == 20.0
    assert engine.rows == [1] and p["large"].finish_s is None  # remote tiers: not predicted
    capped = tier_pressures(tiers, POLICY, 20.0, max_tokens=10**6)["small"].finish_s  # type: ignore[arg-type]
    assert capped == pytest.approx(2.0 + POLICY.tiers["small"].max_model_len / 2.0 * 0.05)
    assert tier_pressures(tiers, POLICY, None, max_tokens=100)["small"].finish_s is None  # type: ignore[arg-type]
    assert tier_pressures(tiers, POLICY, 20.0)["small"].finish_s is None  # type: ignore[arg-type]  # a stream
    for rnd in (None, (0.0, 2.0), (0.05, 0.0)):  # nothing measured yet: no prediction
        engine.rnd = rnd
        assert tier_pressures(tiers, POLICY, 20.0, max_tokens=100)["small"].finish_s is None  # type: ignore[arg-type]
    plain = Tiers({"small": Local(FakeEngine())})  # an engine without decode_round
    assert tier_pressures(plain, POLICY, 20.0, max_tokens=100)["small"].finish_s is None  # type: ignore[arg-type]

    err = rejection(DECISION, {"small": TierPressure(False, 1.0, 5.0, finish_s=12.2, deadline_s=9.0)})
    assert isinstance(err, OverloadedError) and err.code == "deadline_unreachable"
    assert err.retry_after == 4 and err.spread_retries
    close = rejection(DECISION, {"small": TierPressure(False, 5.0, 5.0, finish_s=9.1, deadline_s=9.0)})
    assert close.code == "deadline_unreachable" and close.retry_after == 1.0
    # Past the wait budget too, or full: those reasons come first.
    assert rejection(
        DECISION, {"small": TierPressure(False, 6.0, 5.0, finish_s=12.0, deadline_s=9.0)}
    ).code == ("predicted_wait_exceeded")
    assert (
        rejection(DECISION, {"small": TierPressure(True, 1.0, 5.0, finish_s=12.0, deadline_s=9.0)}).code
        != "deadline_unreachable"
    )


async def test_a_hold_counts_its_weight() -> None:
    fair = FairShare()
    many = fair.hold("small", "a", stream(1), weight=3)
    assert fair._held["small"]["a"] == 3 and fair.over_share("small", "a", 3)
    one = fair.hold("small", "a", stream(1))
    assert fair._held["small"]["a"] == 4
    assert [x async for x in many] == [1] and fair._held["small"]["a"] == 1
    assert [x async for x in one] == [1] and "a" not in fair._held["small"]


async def test_edges_of_shares_waits_and_closing(clock: Clock) -> None:
    """Boundaries the tests above leave open (found by make mutation)."""
    fair = FairShare()  # the default window: 10 s
    fair.note("small", "b")
    a = fair.hold("small", "a", stream())
    clock.now += 10.5
    assert fair.over_share("small", "a", 1)  # b has left the split; one place, a holds it
    fair.note("small", "b")
    one = fair.hold("small", "b", stream())
    assert fair.over_share("small", "b", 1)  # capacity below the callers: still one each
    fair2 = FairShare()
    fair2.note("small", "x")
    two = [fair2.hold("small", "y", stream()) for _ in range(2)]
    assert fair2.over_share("small", "y", 5)  # 5 // 2 = 2 places, not 2.5
    assert a and one and two
    # Closing a held stream closes the stream under it.
    closed: list[bool] = []

    async def inner() -> AsyncIterator[int]:
        try:
            yield 1
            yield 2
        finally:
            closed.append(True)

    held = fair.hold("small", "c", inner())
    assert await anext(held) == 1
    await held.aclose()  # type: ignore[attr-defined]
    assert closed == [True]
    assert client_deadline_s({"x-request-timeout": "0.5"}, POLICY) == 0.5


class Bare:
    """A load with only what every backend reports."""

    is_full = False


def test_pressure_defaults_and_skipped_tiers_and_messages() -> None:
    class Measured(FakeEngine):
        def decode_round(self, rows: int) -> tuple[float, float]:
            return (0.1, 1.0)  # one token a row a round

    bare = Measured(Bare(), wait_s=1.0)  # type: ignore[arg-type]
    tiers = Tiers({"gone": Local(FakeEngine()), "small": Local(bare), "large": Remote(Client(Bare()))})  # type: ignore[arg-type]
    p = tier_pressures(tiers, POLICY, 30.0, max_tokens=10)  # type: ignore[arg-type]
    assert set(p) == {"small", "large"}  # a tier the policy lacks is skipped, not the end
    assert p["small"].circuit_open_s is None and p["small"].finish_s == pytest.approx(1.0 + 10 * 0.1)
    assert p["large"].wait_s == 0.0 and p["large"].circuit_open_s is None
    zero = Tiers({"large": Remote(Client(Load(predicted_wait_s=0.0)))})
    assert tier_pressures(zero, POLICY, None)["large"].wait_s == 0.0  # type: ignore[arg-type]
    # A wait exactly at the budget is not the reason given.
    at = rejection(DECISION, {"small": TierPressure(False, 5.0, 5.0)})
    assert at.code not in ("predicted_wait_exceeded", "fair_share_exceeded", "deadline_unreachable")
    reasons = [
        TierPressure(True, 9.0, 1.0, circuit_open_s=2.0),
        TierPressure(False, 1.0, 5.0, finish_s=12.0, deadline_s=9.0),
        TierPressure(False, 1.0, 5.0, over_share=True),
        TierPressure(False, 9.0, 5.0),
        TierPressure(True, 1.0, 5.0),
    ]
    for p_ in reasons:
        message = rejection(DECISION, {"small": p_}).message
        assert isinstance(message, str) and "Tier 'small'" in message
    deadline = rejection(DECISION, {"small": reasons[1]}).message
    assert deadline.endswith("lower max_tokens, stream, or retry later.")
