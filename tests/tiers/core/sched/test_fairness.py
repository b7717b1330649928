"""Device time between callers (``fairness.TurnBudget``, ``light_and_heavy``), the scheduler's
``hold_back`` and the device worker's turn plan, without models; then an engine pair on the
tiny model, where a light caller beside a heavy one is served first and nobody's answer changes."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.tiers.core.sched.test_scheduler import make, queue, run
from tiers.core.sched.fairness import TurnBudget, light_and_heavy
from tiers.worker.device import DeviceWorker


def test_light_and_heavy_split_the_device_slots_equally() -> None:
    # Catches: a threshold on the callers' count instead of the share, or a caller at exactly its
    # share counted as heavy (it would be held back for using what it is entitled to).
    assert light_and_heavy(Counter({"a": 40}), 48) == (set(), set())  # one caller: nobody to protect
    assert light_and_heavy(Counter({"a": 2, "b": 30}), 48) == ({"a"}, {"b"})
    assert light_and_heavy(Counter({"a": 24, "b": 24}), 48) == (set(), set())  # both at their share
    assert light_and_heavy(Counter({"a": 1, "b": 16, "c": 40}), 48) == ({"a"}, {"c"})  # b at 16 = 48/3
    assert light_and_heavy(Counter({"a": 0, "b": 30}), 48) == (set(), set())  # a holds nothing


def _simulate(budget: TurnBudget, light_s: float, extra_s: float, turns: int) -> tuple[float, int]:
    """Drive ``budget`` over ``turns`` turns of a light and a heavy caller: a held-back turn takes
    ``light_s``, one with the heavy caller ``light_s + extra_s``. Returns (total seconds, turns
    the heavy caller got)."""
    held = Counter({"light": 2, "heavy": 40})
    total = 0.0
    heavy_turns = 0
    for _ in range(turns):
        back = budget.plan(held, 48)
        seconds = light_s if back else light_s + extra_s
        heavy_turns += not back
        budget.record(seconds, did_work=True)
        total += seconds
    return total, heavy_turns


@pytest.mark.parametrize(
    ("slowdown", "light_s", "extra_s"), [(1.25, 0.03, 0.2), (1.5, 0.05, 0.05), (2.0, 0.01, 1.0)]
)
def test_the_light_callers_turns_last_at_most_slowdown_times_as_long(
    slowdown: float, light_s: float, extra_s: float
) -> None:
    # Reference: every turn earns (slowdown - 1) x light_s of credit and a heavy turn spends
    # extra_s, so a fraction f = (slowdown - 1) x light_s / extra_s of the turns are the heavy
    # caller's and the mean turn lasts light_s + f x extra_s = slowdown x light_s.
    # Catches: credit earned on heavy turns only, spent on light ones, a sign error, or no
    # holding back at all (the mean turn would be light_s + extra_s).
    budget = TurnBudget(slowdown)
    turns = 2000
    total, heavy_turns = _simulate(budget, light_s, extra_s, turns)
    assert total / (turns * light_s) == pytest.approx(slowdown, rel=0.05)
    f = (slowdown - 1) * light_s / extra_s
    assert heavy_turns / turns == pytest.approx(f, rel=0.1)  # the heavy caller keeps its share


def test_no_holding_back_without_a_light_caller_or_with_slowdown_off() -> None:
    # Catches: holding back a lone caller (a single tenant at capacity would idle the device),
    # ignoring ``fair_slowdown: null``, banking credit while uncontended, or forgetting a debt
    # whenever a closed-loop light caller is between two requests (measured: the polite tenant
    # of benchmarks/abuse kept 69% of its pace with the debt forgotten).
    budget = TurnBudget(1.25)
    budget.credit = 0.5
    assert budget.plan(Counter({"a": 40}), 48) == frozenset()
    assert budget.credit == 0.0  # no credit banked while nobody needs protecting
    budget.credit = -0.5
    assert budget.plan(Counter({"a": 40}), 48) == frozenset()
    assert budget.credit == -0.5  # but a debt stays for the light caller's next request
    assert budget.plan(Counter({"light": 1, "a": 40}), 48) == frozenset({"a"})
    off = TurnBudget(None)
    off.credit = -5.0
    assert off.plan(Counter({"light": 1, "heavy": 40}), 48) == frozenset()


def test_a_held_back_turn_that_ran_nothing_lets_the_heavy_callers_in_next() -> None:
    # Catches: the device idling while only held-back callers have runnable work (the light one's
    # sequence waits on something else), which would stall everyone for the idle wait.
    budget = TurnBudget(1.25)
    held = Counter({"light": 1, "heavy": 40})
    budget.plan(held, 48)
    budget.record(1.0, did_work=True)  # the heavy caller's turn: deep in debt
    assert budget.plan(held, 48) == frozenset({"heavy"})
    budget.record(0.0, did_work=False)
    assert budget.plan(held, 48) == frozenset()


def test_a_held_back_caller_keeps_its_slots_and_blocks_but_gets_no_rows() -> None:
    # Catches: hold_back preempting (recompute) instead of pausing, admitting the held-back
    # caller's waiting requests, or holding back the light caller's own rows.
    sched = make(max_num_seqs=8, max_num_batched_tokens=64)
    heavy = queue(sched, "heavy", 5)
    light = queue(sched, "light", 1, start=500)
    run(sched, sched.schedule())  # type: ignore[arg-type]
    more = queue(sched, "heavy", 2, start=900)  # waiting when the next step is planned
    blocks = {s.seq_id: list(s.block_table.blocks) for s in heavy}
    batch = sched.schedule(hold_back=frozenset({"heavy"}))
    assert batch is not None and batch.seqs == light
    assert all(s in sched.running and s.block_table.blocks == blocks[s.seq_id] for s in heavy)
    assert all(s in sched.waiting for s in more)
    run(sched, batch)
    batch = sched.schedule()  # let in again: every running row, then the waiting ones
    assert batch is not None and set(heavy + light + more) == set(batch.seqs)


class _Engine:
    def __init__(self, callers: Counter[str], slots: int) -> None:
        self.callers = callers
        self.slots = slots
        self.stepped: list[frozenset[str]] = []

    def has_work(self) -> bool:
        return True

    def has_protected_prefill(self) -> bool:
        return False

    def share(self) -> tuple[Counter[str], int]:
        return self.callers, self.slots

    def step(
        self, *, defer_unprotected_prompts: bool = False, hold_back: frozenset[str] = frozenset()
    ) -> bool:
        self.stepped.append(hold_back)
        return True

    def abort_all(self) -> None:
        pass


def test_the_device_worker_plans_over_every_engine_together() -> None:
    # Catches: a per-engine split (the light caller on one tier, the heavy one on another would
    # never meet) or the slots of one engine only. Light caller: 2 on small; heavy: 14 on small
    # and 16 on large; 48 slots -> share 24: heavy (30) is over it, light under.
    worker: DeviceWorker[Any] = DeviceWorker()
    worker.stop()  # drive the plan by hand
    small = _Engine(Counter({"light": 2, "heavy": 14}), 16)
    large = _Engine(Counter({"heavy": 16}), 16)
    medium = _Engine(Counter(), 16)
    worker.engines = [small, medium, large]
    worker.turns = TurnBudget(1.25)
    worker.turns.credit = -1.0
    assert worker._hold_back() == frozenset({"heavy"})
    large.callers = Counter({"heavy": 8})  # 22 in all: under the share, nobody is held back
    assert worker._hold_back() == frozenset()


async def _answers(engine: Any, prompts: list[list[int]], caller: str, tokens: int) -> list[list[int]]:
    from tiers.core.sequence import SamplingParams

    async def one(ids: list[int]) -> list[int]:
        out: list[int] = []
        async for step in engine.submit(
            ids, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), caller=caller
        ):
            out = list(step.token_ids)
        return out

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_an_engine_serves_the_light_caller_first_and_every_answer_stays_the_same(
    tiny_model_dir: Path,
) -> None:
    """A heavy caller (12 sequences of 24 tokens) and a light one (1 sequence of 24) submitted
    together on one engine: with holding back on, steps with only the light caller's row run
    (the mechanism), the light caller finishes within fewer engine steps than the heavy one, and
    every answer is token for token what the same engine gives each request alone with
    holding back off (pausing a row never changes its tokens)."""
    from tests.fixtures import make_engine

    worker: DeviceWorker[Any] = DeviceWorker()
    try:
        engine: Any = make_engine(worker, tiny_model_dir, max_num_seqs=16, max_num_batched_tokens=256)
        heavy_prompts = [[5 + i, 17, 29 + i, 41] for i in range(12)]
        light_prompt = [[7, 11, 13, 19, 23]]
        worker.turns = TurnBudget(None)
        reference_heavy = asyncio.run(_answers(engine, heavy_prompts, "heavy", 24))
        reference_light = asyncio.run(_answers(engine, light_prompt, "light", 24))

        rows: list[Counter[str]] = []
        engine.step_hook = lambda batch: rows.append(Counter(s.caller for s in batch.seqs))
        worker.turns = TurnBudget(1.25)

        async def both() -> tuple[list[list[int]], list[list[int]]]:
            return await asyncio.gather(
                _answers(engine, heavy_prompts, "heavy", 24), _answers(engine, light_prompt, "light", 24)
            )

        heavy, light = asyncio.run(both())
    finally:
        worker.stop()
    assert heavy == reference_heavy and light == reference_light
    light_only = [r for r in rows if r["light"] and not r["heavy"]]
    assert light_only, "no step held the heavy caller back"
    last_light = max(i for i, r in enumerate(rows) if r["light"])
    last_heavy = max(i for i, r in enumerate(rows) if r["heavy"])
    assert last_light < last_heavy
