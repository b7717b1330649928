"""The predicted wait from measured costs and the work ahead (no model: the numbers are given).

The bug this guards against: the first estimate counted queued requests and steps, not prompt
tokens, so a burst of long prompts on an idle service was predicted to start in a second and
waited 34 s (benchmarks/results/overload.json)."""

from __future__ import annotations

import pytest

from tiers.core.sched.pacing import CORRECTION_MEMORY_S, Backlog, Pace, predict_wait, routing_cost
from tiers.spec_decode.controller import SpecController


def pace(token_cost: float = 0.001, decode_cost: float = 0.02, max_num_seqs: int = 16) -> Pace:
    p = Pace(max_num_seqs=max_num_seqs, budget_tokens=512)
    p.seed(token_cost=token_cost, decode_cost=decode_cost)
    return p


def test_unmeasured_engines_predict_no_wait() -> None:
    assert predict_wait(Pace(16, 512), Backlog(10_000, 4, 3), 500, []) == 0.0


def test_queued_prompt_tokens_are_waited_for_at_the_measured_cost_of_a_token() -> None:
    p = pace()
    alone = predict_wait(p, Backlog(0, 0, 0), 500, [])
    assert alone == pytest.approx(0.5)
    burst = predict_wait(p, Backlog(15 * 500, 0, 0), 500, [])  # fifteen 500-token prompts first
    assert burst == pytest.approx(8.0)


def test_decoding_rows_take_their_share_of_every_step() -> None:
    p = pace()
    # 1001 prompt tokens at 512 - 12 per step: 3 steps, each also feeding 12 decodes.
    assert predict_wait(p, Backlog(500, 12, 0), 501, []) == pytest.approx((1001 + 3 * 12) * 0.001)


def test_other_engines_on_the_device_add_their_steps() -> None:
    p = pace()
    own = Backlog(0, 0, 0)
    idle_other = (pace(), Backlog(0, 0, 0))
    busy_other = (pace(token_cost=0.002), Backlog(10_000, 8, 0))
    assert predict_wait(p, own, 1024, [idle_other]) == pytest.approx(1.024)
    # 1024 tokens take 2 turns of ours; each turn the other engine feeds a full budget (512) of
    # its own queued prompts and a decode step for its running rows.
    assert predict_wait(p, own, 1024, [busy_other]) == pytest.approx(1.024 + 2 * 512 * 0.002 + 2 * 0.02)
    # One with less queued than that costs only what it has.
    assert predict_wait(p, own, 1024, [(pace(token_cost=0.002), Backlog(100, 0, 0))]) == pytest.approx(
        1.024 + 0.2
    )


def test_a_request_that_must_queue_waits_for_a_slot_at_the_loaded_pace() -> None:
    p = pace()
    p.loaded_period = 0.1
    # A slot frees in 12 steps of 0.1 s, then its own 100-token prompt (one step with 16 decodes).
    assert predict_wait(p, Backlog(0, 16, 4, slot_steps=12), 100, []) == pytest.approx(1.2 + 0.116)
    p.loaded_period = 0.0  # never measured at that load: a decode step of every busy engine
    other = (pace(decode_cost=0.05), Backlog(0, 4, 0))
    assert predict_wait(p, Backlog(0, 16, 4, slot_steps=12), 100, [other]) == pytest.approx(
        12 * (0.02 + 0.05) + 0.116 + 0.05
    )


def test_steps_update_the_costs_they_measure() -> None:
    p = Pace(max_num_seqs=4, budget_tokens=512)
    p.on_step(started=1.0, elapsed=0.256, tokens=256, num_seqs=1, busy_after=True)
    assert p.token_cost == pytest.approx(0.001) and p.decode_cost == 0.0
    p.on_step(started=1.3, elapsed=0.02, tokens=3, num_seqs=3, busy_after=True)
    assert p.decode_cost == pytest.approx(0.02)
    assert p.loaded_period == pytest.approx(0.3)  # batch half full: the gap is the loaded pace
    p.on_step(started=1.4, elapsed=0.02, tokens=1, num_seqs=1, busy_after=False)
    assert p.loaded_period == pytest.approx(0.3)  # a light batch says nothing about a full one
    p.on_step(started=9.0, elapsed=0.02, tokens=4, num_seqs=4, busy_after=True)
    assert p.loaded_period == pytest.approx(0.3)  # after an idle spell the gap is idleness


def test_the_estimate_is_calibrated_on_the_waits_requests_actually_had() -> None:
    """What the model misses (a draft's share of a step, the CPU the HTTP side takes) shows up as
    requests waiting longer than predicted; the correction learns it, within bounds, separately
    for protected requests (below their caller's share) and the rest."""
    p = pace(decode_cost=0.02)
    for _ in range(30):
        p.observe(predicted=2.0, actual=5.0, unprotected=True)
    assert p.calibrated(2.0, unprotected=True) == pytest.approx(5.0, rel=0.01)
    assert p.calibrated(2.0, unprotected=False) == 2.0  # a flood's error says nothing of protected ones
    for _ in range(30):
        p.observe(predicted=1.0, actual=100.0, unprotected=False)
    assert p.correction[False] == 4.0  # bounded: one stalled request cannot stop admission
    q = pace()
    for _ in range(30):  # a burst's short waits: off by an offset, not a factor
        q.observe(predicted=0.3, actual=1.3, unprotected=False)
    assert q.calibrated(4.0, unprotected=False) < 8.0  # a pure ratio (4.3x) would say 17 s


def test_a_correction_not_confirmed_by_new_waits_relaxes_to_one() -> None:
    """A ratio learned under one load (a flood) is not applied unchanged to the next (a light
    tenant's requests), but a fresh one holds."""
    p = pace()
    for i in range(30):
        p.observe(predicted=1.0, actual=7.0, unprotected=False, now=100.0 + i * 0.1)
    fresh = p.calibrated(1.0, unprotected=False, now=103.0)
    assert fresh > 5.0
    later = p.calibrated(1.0, unprotected=False, now=103.0 + CORRECTION_MEMORY_S)
    much_later = p.calibrated(1.0, unprotected=False, now=103.0 + 10 * CORRECTION_MEMORY_S)
    assert 1.0 < much_later < later < fresh and much_later == pytest.approx(1.0, abs=0.01)


def test_a_protected_request_waits_only_for_the_other_engines_protected_prompts() -> None:
    """The other tiers run no one else's prompts while a protected one is pending, so only their
    protected prompts and decode steps are ahead of it; an unprotected request waits for all."""
    p = pace()
    other = (pace(token_cost=0.002), Backlog(2000, 8, 0, protected_prefill_tokens=100))
    protected = predict_wait(p, Backlog(0, 0, 0, protected=True), 100, [other])
    unprotected = predict_wait(p, Backlog(0, 0, 0), 100, [other])
    assert protected == pytest.approx(0.1 + 100 * 0.002 + 0.02)
    assert unprotected == pytest.approx(0.1 + 512 * 0.002 + 0.02)


# -- load-aware routing's price of one more request (routing_cost) ----------------------------


def test_on_an_idle_device_the_price_is_the_requests_own_decode_time() -> None:
    # Catches: a cost that ignores the tokens a step yields (speculation) or the request's wait.
    cost = routing_cost(wait_s=0.1, output_tokens=64, joined=(0.020, 2.0), before_s=0.0, others_s=0.0, rows=0)
    assert cost.completion_s == pytest.approx(0.1 + 32 * 0.020)
    assert cost.delay_s == 0.0
    assert cost.total_s == cost.completion_s


def test_a_request_waits_for_every_other_engines_step_each_turn() -> None:
    cost = routing_cost(
        wait_s=0.0, output_tokens=10, joined=(0.005, 1.0), before_s=0.0, others_s=0.060, rows=0
    )
    assert cost.completion_s == pytest.approx(10 * 0.065)


def test_joining_a_running_batch_delays_others_by_the_rows_marginal_cost_only() -> None:
    # Eight rows decode on a 40 ms step; a ninth adds 3 ms to it. Starting an idle engine's 5 ms
    # step instead adds all 5 ms to every turn: the cheaper step alone costs the device more.
    join = routing_cost(
        wait_s=0.0, output_tokens=64, joined=(0.043, 1.0), before_s=0.040, others_s=0.0, rows=8
    )
    fresh = routing_cost(
        wait_s=0.0, output_tokens=64, joined=(0.005, 1.0), before_s=0.0, others_s=0.040, rows=8
    )
    assert join.delay_s == pytest.approx(8 * 64 * 0.003)
    assert fresh.delay_s == pytest.approx(8 * 64 * 0.005)
    assert join.total_s < fresh.total_s
    # Its prompt delays them too, once.
    with_prompt = routing_cost(
        wait_s=0.0, output_tokens=64, joined=(0.043, 1.0), before_s=0.040, others_s=0.0, rows=8, prefill_s=0.1
    )
    assert with_prompt.delay_s == pytest.approx(join.delay_s + 8 * 0.1)


def test_best_round_prices_the_k_the_controller_would_run() -> None:
    spec = SpecController(max_k=2, acceptance=0.8)
    assert spec.best_round(1) is None  # nothing measured yet
    spec.record_target(1, 1, 0.010)
    spec.record_target(1, 3, 0.012)
    spec.record_draft(1, 1, 0.001)
    seconds, tokens = spec.best_round(1) or (0.0, 0.0)
    # k=2: 1 + 0.8 + 0.64 tokens for 12 + 2 ms beats k=1 (1.8 in 11 + 1 ms) and k=0 (1 in 10 ms).
    assert (seconds, tokens) == (pytest.approx(0.014), pytest.approx(2.44))
    assert spec.choose_k(1) == 2
    # A draft that is never accepted is not worth its cost: the plain step is priced.
    spec.acceptance = 0.0
    assert spec.best_round(1) == (pytest.approx(0.010), pytest.approx(1.0))
    assert spec.choose_k(1) == 0
