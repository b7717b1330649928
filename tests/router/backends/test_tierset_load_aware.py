"""TierSet.routing_costs: the price of one more request on each tier, from the engines' live
state, driving decide() in load-aware mode (fake engines: the step costs are given)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from router.backends.local import LocalTier
from router.backends.tierset import DECIDED_TTL_S, LOAD_MEMORY_S, SHARE_EMA, TierSet
from router.policy.decide import BUSY_JOIN, RouteRequest, TierBatch, decide
from router.policy.loader import parse_policy
from router.policy.schema import TierConfig
from tests.router.policy.test_decide import Score
from tiers.engine.request import EngineLoad

POLICY = parse_policy(
    textwrap.dedent("""
    version: 1
    tiers:
      small: {model: m}
      medium: {model: m}
      large: {model: m}
    routing:
      mode: load_aware
      load_aware: {min_device_rows: 0}
      rules:
        - {name: score-small, when: {score_below: 0.3}, tier: small}
        - {name: score-medium, when: {score_below: 0.7}, tier: medium}
        - {name: score-large, tier: large}
      fallback: {small: medium, medium: large, large: null}
    """)
)


@dataclass
class FakeScheduler:
    num_running: int = 0


@dataclass
class FakePace:
    token_cost: float = 0.0001


class FakeEngine:
    """An engine whose decode step costs ``step_s[b]`` at batch ``b`` (one token a row)."""

    tokenizer: Any = None

    def __init__(self, step_s: dict[int, float], running: int = 0, max_num_seqs: int = 16) -> None:
        self.step_s = step_s
        self.scheduler = FakeScheduler(running)
        self.pace = FakePace()
        self.max_num_seqs = max_num_seqs
        self.submitted = 0

    def has_work(self) -> bool:
        return self.scheduler.num_running > 0

    def load(self, *, predicted: bool = True) -> EngineLoad:
        return EngineLoad(
            self.scheduler.num_running, 0, self.max_num_seqs, 64, 0, 1, submitted=self.submitted
        )

    def decode_round(self, extra: int = 0) -> tuple[float, float] | None:
        b = min(self.max_num_seqs, self.scheduler.num_running + extra)
        return (self.step_s[b] if b else 0.0, 1.0)


def linear(base: float, per_row: float) -> dict[int, float]:
    return {b: base + per_row * b for b in range(1, 17)}


def tierset(small: FakeEngine, medium: FakeEngine, large: FakeEngine) -> TierSet:
    engines = {"small": small, "medium": medium, "large": large}
    return TierSet(
        {n: LocalTier(n, TierConfig(model="m"), e, None) for n, e in engines.items()},  # type: ignore[arg-type]
        worker=None,
    )


def route(ts: TierSet, waits: dict[str, float] | None = None, score: float = 0.1) -> Any:
    waits = waits or dict.fromkeys(ts.tiers, 0.0)
    costs = ts.routing_costs(waits, dict.fromkeys(ts.tiers, 64), prompt_tokens=20)
    return decide(POLICY, RouteRequest(), Score(score), {}, {t: c.total_s for t, c in costs.items()})


# Step costs shaped like the default ladder on a CPU: a big fixed cost per step that grows slowly
# with the batch, cheapest for small.
SMALL, MEDIUM, LARGE = linear(0.004, 0.0008), linear(0.008, 0.001), linear(0.020, 0.0025)


def test_on_an_idle_device_a_cheap_prompt_goes_to_the_cheapest_acceptable_tier() -> None:
    d = route(tierset(FakeEngine(SMALL), FakeEngine(MEDIUM), FakeEngine(LARGE)))
    assert (d.tier, d.rule) == ("small", "score-small")
    d = route(tierset(FakeEngine(SMALL), FakeEngine(MEDIUM), FakeEngine(LARGE)), score=0.5)
    assert (d.tier, d.rule) == ("medium", "score-medium")


def test_a_large_batch_with_room_takes_the_cheap_prompt_for_its_marginal_cost() -> None:
    # Catches: pricing a tier by its own step alone (small's 5 ms beats large's 45 ms), which
    # starts a third batch on the device - every turn then also runs small's whole step.
    ts = tierset(FakeEngine(SMALL), FakeEngine(MEDIUM), FakeEngine(LARGE, running=10))
    costs = ts.routing_costs(dict.fromkeys(ts.tiers, 0.0), dict.fromkeys(ts.tiers, 64), prompt_tokens=20)
    assert costs["large"].delay_s < costs["small"].delay_s
    d = route(ts)
    assert (d.tier, d.rule) == ("large", "load:score-small")


def test_a_full_large_tier_sends_the_prompt_to_the_cheapest_acceptable_tier() -> None:
    # At max_num_seqs a new row must wait for a slot (admission's predicted wait) and adds no
    # row to the step: the wait decides.
    ts = tierset(FakeEngine(SMALL), FakeEngine(MEDIUM), FakeEngine(LARGE, running=16))
    d = route(ts, waits={"small": 0.0, "medium": 0.0, "large": 30.0})
    assert (d.tier, d.rule) == ("small", "score-small")


def test_unmeasured_and_remote_tiers_are_left_out() -> None:
    class Unmeasured(FakeEngine):
        def decode_round(self, extra: int = 0) -> tuple[float, float] | None:
            return None

    ts = tierset(FakeEngine(SMALL), FakeEngine(MEDIUM), Unmeasured(LARGE))
    costs = ts.routing_costs(dict.fromkeys(ts.tiers, 0.0), dict.fromkeys(ts.tiers, 64), prompt_tokens=0)
    assert set(costs) == {"small", "medium"}


def _held(batches: Mapping[str, TierBatch]) -> dict[str, tuple[int, int]]:
    return {t: (b.held, b.slots) for t, b in batches.items()}


def test_a_split_device_consolidates_into_the_highest_running_batch() -> None:
    # Small and large both decode six rows. One more row prices almost the same on either (a
    # sliver of a running step), so pricing alone keeps feeding small and the device stays split:
    # every turn runs both steps. TierSet.batches lets decide() join large's batch; small drains.
    ts = tierset(FakeEngine(SMALL, running=6), FakeEngine(MEDIUM), FakeEngine(LARGE, running=6))
    assert route(ts).tier == "small"  # the prices alone
    costs = ts.routing_costs(dict.fromkeys(ts.tiers, 0.0), dict.fromkeys(ts.tiers, 64), prompt_tokens=20)
    batches = ts.batches()
    assert _held(batches) == {"small": (6, 16), "medium": (0, 16), "large": (6, 16)}
    d = decide(POLICY, RouteRequest(), Score(0.1), {}, {t: c.total_s for t, c in costs.items()}, batches)
    assert (d.tier, d.rule) == ("large", "load:score-small")


def test_a_burst_of_decisions_sees_the_batch_its_earlier_decisions_are_about_to_join() -> None:
    # Catches: batches counted from the engines alone. A burst's decisions all happen before any
    # of its requests is submitted (they await tokenization and the cache in between), so each
    # saw an idle device and the burst split over every tier's floor.
    small, large = FakeEngine(SMALL), FakeEngine(LARGE)
    ts = tierset(small, FakeEngine(MEDIUM), large)
    ts.decided("large", now=0.0)
    assert _held(ts.batches(now=0.1)) == {"small": (0, 16), "medium": (0, 16), "large": (1, 16)}
    costs = ts.routing_costs(dict.fromkeys(ts.tiers, 0.0), dict.fromkeys(ts.tiers, 64), prompt_tokens=20)
    d = decide(
        POLICY, RouteRequest(), Score(0.1), {}, {t: c.total_s for t, c in costs.items()}, ts.batches(now=0.1)
    )
    assert (d.tier, d.rule) == ("large", "load:score-small")
    # The engine counts the submission: the decision has landed and is not counted twice.
    ts.decided("large", now=0.2)
    large.submitted, large.scheduler.num_running = 1, 1
    assert ts.batches(now=0.3)["large"][:2] == (2, 16)
    large.submitted, large.scheduler.num_running = 2, 2
    assert ts.batches(now=0.4)["large"][:2] == (2, 16)
    # A decision whose request never arrives (a cache hit, an error) is forgotten after the TTL.
    ts.decided("small", now=1.0)
    assert ts.batches(now=1.0 + DECIDED_TTL_S - 0.01)["small"][:2] == (1, 16)
    assert ts.batches(now=1.0 + DECIDED_TTL_S + 0.01)["small"][:2] == (0, 16)


def test_an_idle_tier_is_as_busy_as_the_chance_another_request_in_flight_lands_there() -> None:
    # Catches: the busy estimate ignoring the other requests held on the device (one client alone
    # would be consolidated onto large), ignoring the decisions' shares, or marking a tier that
    # holds work as anything but running. Reference: 1 - (1 - share) ** others, with the share a
    # moving average of decisions (weight SHARE_EMA) written out here.
    small, medium, large = FakeEngine(SMALL), FakeEngine(MEDIUM), FakeEngine(LARGE)
    ts = tierset(small, medium, large)
    idle = ts.batches(now=0.0)
    assert [b.busy for b in idle.values()] == [0.0, 0.0, 0.0]  # nothing else held: nothing runs anyway
    share = {"small": 1 / 3, "medium": 1 / 3, "large": 1 / 3}
    for i, tier in enumerate(["large", "large", "small", "large"] * 2):
        ts.decided(tier, now=10.0 + i)  # long ago by now=100: only the shares remain
        share = {t: v + SHARE_EMA * (float(t == tier) - v) for t, v in share.items()}
    small.scheduler.num_running = 3  # three requests in flight, all on small
    got = ts.batches(now=100.0)
    assert got["small"] == TierBatch(3, 16, 1.0)
    assert got["large"].busy == pytest.approx(1 - (1 - share["large"]) ** 3, abs=1e-3)
    assert got["medium"].busy == pytest.approx(1 - (1 - share["medium"]) ** 3, abs=1e-3)
    assert got["large"].busy > BUSY_JOIN > got["medium"].busy


def test_a_burst_on_an_idle_device_consolidates_within_its_first_requests_and_one_client_does_not() -> None:
    # The case behind it (routing_gain, 16 clients): a burst of small-scored requests on an idle
    # device went to small one after the other (each saw only small running) until a large-scored
    # request started large, and the device ran small's and large's steps in turn for the whole
    # wave. With half the recent decisions on large, the burst's third request joins large.
    def burst(ts: TierSet, n: int, start: float) -> list[str]:
        picks = []
        for i in range(n):
            now = start + 0.001 * i
            costs = ts.routing_costs(
                dict.fromkeys(ts.tiers, 0.0), dict.fromkeys(ts.tiers, 64), prompt_tokens=20
            )
            d = decide(
                POLICY,
                RouteRequest(),
                Score(0.1),
                {},
                {t: c.total_s for t, c in costs.items()},
                ts.batches(now),
            )
            ts.decided(d.tier, now=now)
            picks.append(d.tier)
        return picks

    ts = tierset(FakeEngine(SMALL), FakeEngine(MEDIUM), FakeEngine(LARGE))
    for i in range(20):
        ts.decided(["small", "large"][i % 2], now=float(i))
    assert burst(ts, 6, 100.0) == ["small", "small", "large", "large", "large", "large"]
    # Only small-scored traffic so far: nothing makes large run, and the burst stays on small.
    ts = tierset(FakeEngine(SMALL), FakeEngine(MEDIUM), FakeEngine(LARGE))
    for i in range(20):
        ts.decided("small", now=float(i))
    assert burst(ts, 6, 100.0) == ["small"] * 6
    # One client: its requests never overlap, so nothing else is held when it is routed, and a
    # small-scored request goes to small however many went to large before it.
    ts = tierset(FakeEngine(SMALL), FakeEngine(MEDIUM), FakeEngine(LARGE))
    for i in range(20):
        ts.decided("large", now=float(i))
    assert burst(ts, 1, 100.0) == ["small"]
    # The reason says why an idle tier was joined.
    d = decide(
        POLICY,
        RouteRequest(),
        Score(0.1),
        {},
        dict.fromkeys(ts.tiers, 1.0),
        {"small": (2, 16), "large": (0, 16, 0.6)},
    )
    assert d.tier == "large" and "idle now but likely to run anyway (p 0.60)" in d.reason


def test_the_device_load_is_the_rows_held_now_or_the_recent_peak_fading() -> None:
    # Catches: the guard reading only the rows held now (each wave of a closed loop starts on a
    # nearly empty device and would split it by the rules again), a peak that never fades (one
    # client after a burst would be consolidated for ever), or one that fades at the wrong rate.
    # Reference: max(held now, peak * exp(-age / LOAD_MEMORY_S)), written out here.
    small, medium, large = FakeEngine(SMALL), FakeEngine(MEDIUM), FakeEngine(LARGE)
    ts = tierset(small, medium, large)
    assert ts.observe(now=0.0)[1] == 0.0
    small.scheduler.num_running, large.scheduler.num_running = 4, 11
    assert ts.observe(now=1.0)[1] == 15.0
    small.scheduler.num_running, large.scheduler.num_running = 0, 2  # the wave drained
    for age in (0.5, 10.0, 30.0):
        expected = max(2.0, 15.0 * math.exp(-age / LOAD_MEMORY_S))
        assert ts.observe(now=1.0 + age)[1] == pytest.approx(expected)
    # A new peak replaces the faded one at once.
    large.scheduler.num_running = 9
    assert ts.observe(now=40.0)[1] == 9.0
    large.scheduler.num_running = 0
    assert ts.observe(now=41.0)[1] == pytest.approx(9.0 * math.exp(-1 / LOAD_MEMORY_S))


def test_after_a_busy_spell_the_next_waves_first_request_joins_the_likely_tier() -> None:
    # Catches: the busy estimate counting only the requests held now. The first request of a
    # closed loop's next wave finds the device empty; routed to idle small it keeps small's step
    # in every turn of the wave. Reference: busy = 1 - (1 - share) ** (peak faded - held), with the
    # peak and shares written out here; once the peak has faded, one client is routed by price.
    small, medium, large = FakeEngine(SMALL), FakeEngine(MEDIUM), FakeEngine(LARGE)
    ts = tierset(small, medium, large)
    share = {"small": 1 / 3, "medium": 1 / 3, "large": 1 / 3}
    for i, tier in enumerate(["large", "small"] * 6):
        ts.decided(tier, now=float(i))
        share = {t: v + SHARE_EMA * (float(t == tier) - v) for t, v in share.items()}
    small.scheduler.num_running, large.scheduler.num_running = 5, 7
    ts.batches(now=20.0)  # the wave: 12 rows
    small.scheduler.num_running = large.scheduler.num_running = 0
    for age, joins in ((2.0, True), (200.0, False)):
        got, device_rows = ts.observe(now=20.0 + age)
        rows = max(0.0, 12 * math.exp(-age / LOAD_MEMORY_S))
        assert got["large"].busy == pytest.approx(1 - (1 - share["large"]) ** rows, abs=1e-3)
        d = decide(
            POLICY,
            RouteRequest(),
            Score(0.1),
            {},
            {"small": 1.0, "medium": 1.5, "large": 2.0},
            got,
            device_rows,
        )
        assert d.tier == ("large" if joins else "small"), (age, d.reason)
