"""The speculative controller without a model: its cost interpolation, its prices of a round, the
k it chooses (the margins, exploration, the draft's backlog) and what it records - each against
figures worked out by hand from the formulas in ``tiers/spec_decode/controller.py``'s docstrings:

    tokens(k, a) = (1 - a**(k+1)) / (1 - a)        rate(k) = tokens / (target(k+1) + k * draft)

Model-free and fast, so ``make mutation`` can run it on every mutant of the module."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tiers.core.sequence import SamplingParams, Sequence
from tiers.spec_decode.controller import (
    CATCH_UP,
    EXPLORE_BUDGET,
    EXPLORE_STEPS,
    LONG_EXPLORE_WAIT,
    SPEC_MARGIN,
    SPEC_RESUME_MARGIN,
    SpecController,
    fastest,
    spec_budget,
)
from tiers.spec_decode.ngram import NgramProposer


def tokens(k: int, a: float) -> float:
    return sum(a**i for i in range(k + 1))  # the geometric series, summed term by term


def profiled(acceptance: float, *, max_k: int = 2, explore_every: int = 64) -> SpecController:
    """Batch 1: plain 10 ms, a 3-token verify 15 ms (ratio 1.5), a draft forward 2 ms (ratio 0.2)."""
    c = SpecController(max_k=max_k, acceptance=acceptance, explore_every=explore_every)
    c.record_target(1, 1, 0.010)
    c.record_target(1, 3, 0.015)
    c.record_draft(1, 1, 0.002)
    return c


# -- interpolation -----------------------------------------------------------------------------


def test_interp_is_piecewise_linear_and_extrapolates_from_the_end_segments() -> None:
    """Catches a wrong segment picked (``<`` for ``<=`` at a knot, the first segment used past the
    end), a slope or offset slip, the single point not scaled through the origin, the floor lost."""
    one = [(2, 4.0)]
    assert SpecController._interp(one, 3) == pytest.approx(6.0)  # through the origin: 4 * 3 / 2
    assert SpecController._interp([(0, 4.0)], 3) == pytest.approx(4.0)
    pts = [(1, 1.0), (3, 5.0), (7, 6.0)]
    want = {1: 1.0, 2: 3.0, 3: 5.0, 5: 5.5, 7: 6.0, 9: 6.5, 15: 8.0}
    for x, y in want.items():
        assert SpecController._interp(pts, x) == pytest.approx(y), x
    # Below the first point: the first segment's line (slope 2) goes under zero: floored just above 0.
    assert SpecController._interp(pts, 0) == pytest.approx(1e-9)
    assert SpecController._interp([(1, 3.0), (2, 5.0)], 0) == pytest.approx(1.0)
    # Costs far above the token counts: a segment is found by its x only (never compared with a y).
    big = [(1, 10.0), (3, 20.0), (7, 30.0)]
    assert [SpecController._interp(big, x) for x in (2, 5, 9)] == pytest.approx([15.0, 25.0, 35.0])


def test_cost_interpolates_in_tokens_at_each_batch_then_across_batches() -> None:
    """Catches the two interpolation axes swapped or a batch's points mixed with another's: at
    batch 2, 3 tokens, batch 1 gives 2.0 and batch 4 gives 7.0 (each halfway in tokens), and batch
    2 lies a third of the way from 1 to 4. A measured point is returned as measured; nothing
    measured is None."""
    c = SpecController(max_k=1)
    table = {(1, 1): 1.0, (1, 5): 3.0, (4, 1): 4.0, (4, 5): 10.0}
    assert c._cost(table, 2, 3) == pytest.approx(2.0 + (7.0 - 2.0) / 3)
    assert c._cost(table, 4, 5) == 10.0
    assert c._cost({}, 2, 3) is None


# -- prices of a round -------------------------------------------------------------------------


def test_expected_rate_prices_each_k_from_the_ratios_to_todays_plain_step() -> None:
    """rate(0) = 1 / 10 ms; rate(1) = 1.5 / (12.5 + 2) ms (the 2-token verify interpolated between
    ratios 1.0 and 1.5); rate(2) = 1.75 / (15 + 2 * 2) ms. Then the plain step is measured at
    20 ms once (EMA 0.1: 11 ms): every k > 0 is priced at its ratio times 11 ms. Catches the
    token count or the cost formula changed, k drafts priced as one, the ratios not used."""
    c = profiled(0.5)
    assert c.target_ratio == {(1, 3): pytest.approx(1.5)} and c.draft_ratio == {(1, 1): pytest.approx(0.2)}
    assert c.expected_rate(0, 1) == pytest.approx(1 / 0.010)
    assert c.expected_rate(1, 1) == pytest.approx(tokens(1, 0.5) / (0.0125 + 0.002))
    assert c.expected_rate(2, 1) == pytest.approx(tokens(2, 0.5) / (0.015 + 2 * 0.002))
    c.record_target(1, 1, 0.020)
    assert c.target_cost[(1, 1)] == pytest.approx(0.011)
    assert c.expected_rate(2, 1) == pytest.approx(tokens(2, 0.5) / (0.011 * 1.5 + 2 * 0.011 * 0.2))
    # An acceptance passed in overrides the estimate, capped just below 1 (a = 1 would divide by 0).
    assert c.expected_rate(1, 1, acceptance=0.9) == pytest.approx(1.9 / (0.011 * 1.25 + 0.011 * 0.2))
    assert c.expected_rate(1, 1, acceptance=1.0) == pytest.approx(
        tokens(1, 0.999) / (0.011 * 1.25 + 0.011 * 0.2)
    )


def test_a_batch_never_measured_is_priced_from_the_measured_ones() -> None:
    """Only batch 1 measured: batch 3's plain step is 3 x 10 ms (through the origin); with batches
    1 and 5 measured, batch 3 lies halfway. Catches the batch axis ignored or extrapolated from
    the wrong end."""
    c = profiled(0.5)
    assert c.expected_rate(0, 3) == pytest.approx(1 / 0.030)
    c.record_target(5, 1, 0.030)
    assert c.expected_rate(0, 3) == pytest.approx(1 / 0.020)
    assert c.expected_rate(0, 9) == pytest.approx(1 / 0.050)


def test_a_ratio_measured_at_one_batch_size_carries_unchanged_to_the_others() -> None:
    """Only batch 1 measured (plain 10 ms, 3-token verify ratio 1.5, draft ratio 0.2): batch 3's
    plain step is 30 ms (a time scales with the rows), its verify 1.5 x that and its draft 0.2 x
    that, so rate(2) = tokens(2, a) / (45 + 2 x 6) ms. Catches a ratio extrapolated in proportion
    to the batch like a time (4.5 and 0.6 at batch 3: speculation priced 3x dearer than measured,
    and turned off where it pays)."""
    c = profiled(0.5)
    assert c.expected_rate(2, 3) == pytest.approx(tokens(2, 0.5) / (0.045 + 2 * 0.006))


def test_without_ratios_the_absolute_measurements_price_the_round() -> None:
    """A verify or draft measured before any plain step at its batch has no ratio: its absolute
    time prices it. Catches the fallback dropped (no price: None) or the wrong table read."""
    c = SpecController(max_k=2, acceptance=0.5)
    c.record_target(1, 3, 0.030)  # no plain step yet: no ratio
    c.record_draft(1, 1, 0.004)
    assert c.target_ratio == {} and c.draft_ratio == {}
    assert c.expected_rate(2, 1) == pytest.approx(tokens(2, 0.5) / (0.030 + 2 * 0.004))
    assert c.expected_rate(0, 1) is None  # no plain step: nothing to compare with
    c.record_target(1, 1, 0.010)
    assert c.target_ratio == {} and c.draft_ratio == {}  # a plain step records no ratio
    assert c.expected_rate(2, 1) == pytest.approx(tokens(2, 0.5) / (0.030 + 2 * 0.004))
    assert c.expected_rate(0, 1) == pytest.approx(100.0)


def test_record_keeps_a_moving_average_of_each_measurement() -> None:
    """First measurement as is, then old + 0.1 * (new - old), per key; the ratio is taken against
    the plain step of the same batch at that time. Catches the EMA's sign or weight flipped, a
    ratio taken over another batch's plain step, a ratio recorded for the plain step itself."""
    c = SpecController(max_k=2, ema=0.1)
    c.record_target(2, 1, 0.020)
    c.record_target(2, 1, 0.030)
    assert c.target_cost == {(2, 1): pytest.approx(0.021)}
    c.record_target(2, 4, 0.042)
    c.record_target(2, 4, 0.0525)
    assert c.target_cost[(2, 4)] == pytest.approx(0.042 + 0.1 * (0.0525 - 0.042))
    assert c.target_ratio == {(2, 4): pytest.approx(2.0 + 0.1 * (2.5 - 2.0))}
    c.record_draft(2, 1, 0.0042)
    c.record_draft(4, 1, 0.0042)  # batch 4's plain step is not measured: no ratio
    assert c.draft_cost == {(2, 1): pytest.approx(0.0042), (4, 1): pytest.approx(0.0042)}
    assert c.draft_ratio == {(2, 1): pytest.approx(0.2)}


def test_acceptance_moves_by_the_ema_and_ends_an_exploration() -> None:
    """0.8 + 0.1 * (1/2 - 0.8) = 0.77; a round that drafted nothing changes nothing (and does not
    end an exploration, which still waits for a drafting round). Catches the EMA written as an
    assignment or with the difference reversed, the drafted == 0 guard lost."""
    c = SpecController(max_k=2, acceptance=0.8, ema=0.1)
    c.exploring = 2
    c.record_acceptance(0, 0)
    assert c.acceptance == 0.8 and c.exploring == 2
    c.record_acceptance(4, 2)
    assert c.acceptance == pytest.approx(0.77) and c.exploring == 0
    c.record_acceptance(4, 4)
    assert c.acceptance == pytest.approx(0.77 + 0.1 * (1.0 - 0.77))


# -- best_round --------------------------------------------------------------------------------


def test_best_round_prices_the_best_k_only_on_a_clear_win() -> None:
    """At a = 0.5 k = 1 is the best rate (103 vs 100 tokens/s) but within the 1.1 margin: the plain
    round (10 ms, 1 token) is priced. At a = 0.9 k = 2 wins clearly: 19 ms for 2.71 tokens. A fixed
    k is priced as is (capped at max_k). Catches the margin dropped or inverted, the best taken by
    cost or by tokens alone, the fixed k ignored."""
    c = profiled(0.5)
    assert c.best_round(1) == (pytest.approx(0.010), pytest.approx(1.0))
    c.acceptance = 0.9
    assert c.best_round(1) == (pytest.approx(0.019), pytest.approx(tokens(2, 0.9)))
    c.acceptance = 0.6  # k = 1: 1.6 / 14.5 ms = 110.3/s, k = 2: 1.96 / 19 ms = 103.2/s: just over 1.1x
    assert c.best_round(1) == (pytest.approx(0.0145), pytest.approx(1.6))
    c.acceptance = 0.5
    c.fixed_k = 1
    assert c.best_round(1) == (pytest.approx(0.0145), pytest.approx(1.5))
    c.fixed_k = 5
    assert c.best_round(1) == (pytest.approx(0.019), pytest.approx(1.75))
    c.acceptance = 1.0  # capped at 0.999
    assert c.best_round(1) == (pytest.approx(0.019), pytest.approx(tokens(2, 0.999)))


# -- choose_k ----------------------------------------------------------------------------------


def test_choose_k_pins_and_unprofiled_cases() -> None:
    """No drafting at max_k = 0 (whatever is pinned); a pinned k capped at max_k; before the costs
    are known, max_k (measure by doing)."""
    assert SpecController(max_k=0, fixed_k=3).choose_k(1) == 0
    assert SpecController(max_k=3, fixed_k=2).choose_k(1) == 2
    assert SpecController(max_k=3, fixed_k=5).choose_k(1) == 3
    assert SpecController(max_k=3).choose_k(1) == 3
    c = SpecController(max_k=2)
    c.record_target(1, 1, 0.010)
    assert c.choose_k(1) == 2  # the verify and draft costs are still unknown


def test_choose_k_speculates_above_the_margin_and_resumes_only_above_the_higher_one() -> None:
    """a = 0.62: k = 1 predicts 1.62 / 14.5 ms = 111.7/s against 100/s: 1.117x, above SPEC_MARGIN
    (1.1) but below SPEC_RESUME_MARGIN (1.25). A draft at most 2 tokens behind speculates; one 3
    behind must first catch up, so it does not. At a = 0.9 k = 2 clears both margins. Catches
    the margins swapped, the lag boundary moved, the best k not returned."""
    assert SPEC_MARGIN == 1.1 and SPEC_RESUME_MARGIN == 1.25
    c = profiled(0.62)
    r0, r1, r2 = (c.expected_rate(k, 1) for k in range(3))
    assert r0 is not None and r1 is not None and r2 is not None
    assert 1.1 * r0 < r1 < 1.25 * r0 and r2 < r1
    assert c.choose_k(1, draft_lag=2) == 1 and c.steps_without_spec == 0
    assert c.choose_k(1, draft_lag=3) == 0 and c.steps_without_spec == 1
    assert c.choose_k(1) == 1 and c.steps_without_spec == 0  # a speculating step resets the count
    c.acceptance = 0.9
    assert c.choose_k(1, draft_lag=3) == 2
    c.acceptance = 0.55  # 1.55 / 14.5 ms = 106.9/s: the best k, but under 1.1x
    assert c.choose_k(1) == 0


def test_an_exploration_tries_the_best_k_above_zero_and_only_where_it_could_pay() -> None:
    """Plain decoding chosen (a = 0.1) at explore_every = 3: the 3rd plain step explores with the
    k > 0 of the best rate (k = 1 here: 1.1 / 14.5 ms beats 1.11 / 19 ms), for EXPLORE_STEPS
    steps at most. Not, with the catch-up unpriced, behind more than 8 tokens (8 is still fine),
    and never where a perfect draft would lose. Catches the count's boundary (``>=``), the reset of
    the count, the explored k (max_k instead of the best), the backlog boundary, the ceiling's
    comparison."""
    c = profiled(0.1, explore_every=3)
    assert [c.choose_k(1, draft_lag=8) for _ in range(3)] == [0, 0, 1]
    assert c.steps_without_spec == 0 and c.exploring == EXPLORE_STEPS - 1
    assert [c.choose_k(1) for _ in range(EXPLORE_STEPS)] == [1] * (EXPLORE_STEPS - 1) + [0]
    assert c.exploring == 0 and c.steps_without_spec == 1
    c = profiled(0.1, explore_every=3)
    assert [c.choose_k(1, draft_lag=1, draft_backlog=9) for _ in range(5)] == [0] * 5
    assert c.steps_without_spec == 5
    assert c.choose_k(1, draft_lag=9, draft_backlog=8) == 1  # past the count: explores
    # Verifying 3 tokens costs 3 plain steps and a draft forward 1: even a = 0.999 loses to plain.
    c = SpecController(max_k=2, acceptance=0.1, explore_every=1)
    c.record_target(1, 1, 0.010)
    c.record_target(1, 3, 0.030)
    c.record_draft(1, 1, 0.010)
    ceiling = c.expected_rate(2, 1, acceptance=0.999)
    assert ceiling is not None and ceiling < 100.0
    assert [c.choose_k(1) for _ in range(6)] == [0] * 6 and c.exploring == 0


def test_an_exploration_where_a_perfect_draft_wins_by_a_hair_still_runs() -> None:
    """The ceiling need only beat plain decoding (not by the margin): verifying 2 tokens at 9.9 ms
    + a 0.1 ms draft gives a perfect draft 1.999 / 10 ms against 1 / 10 ms. Catches the ceiling
    compared with the margin applied, or computed at the estimated acceptance."""
    c = SpecController(max_k=1, acceptance=0.0, explore_every=1)
    c.record_target(1, 1, 0.010)
    c.record_target(1, 2, 0.0099)
    c.record_draft(1, 1, 0.0001)
    assert c.choose_k(1) == 1 and c.exploring == EXPLORE_STEPS - 1


# -- spec_budget -------------------------------------------------------------------------------


def test_spec_budget_stops_one_short_of_max_tokens_and_of_the_context() -> None:
    """A round emits up to k + 1 tokens: with 4 output tokens left, 3 may be drafted; with the
    context 4 tokens from full, 3 too. Catches the room computed without the bonus token (``- 1``
    lost) or off by one the other way; penalized and seeded sampled requests never draft, seeded
    greedy ones do."""
    s = Sequence([1, 2, 3], SamplingParams(max_tokens=4))
    assert spec_budget(s, 8, 100) == 3
    assert spec_budget(s, 2, 100) == 2
    assert spec_budget(s, 1, 100) == 1  # only k = 0 means "do not draft"
    assert spec_budget(s, 0, 100) == 0
    assert spec_budget(s, 8, 7) == 3  # context: 7 - 3 - 1
    assert spec_budget(s, 8, 4) == 0
    assert spec_budget(s, 8, 3) == 0  # never negative
    assert (
        spec_budget(Sequence([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, seed=1)), 8, 100) == 3
    )
    assert spec_budget(Sequence([1, 2, 3], SamplingParams(max_tokens=4, seed=1)), 8, 100) == 0
    assert spec_budget(Sequence([1, 2, 3], SamplingParams(max_tokens=4, presence_penalty=0.5)), 8, 100) == 0


def test_with_only_the_plain_step_measured_the_plain_round_is_priced() -> None:
    """k = 0 needs no draft figure: its rate and its round are known once the plain step is.
    Catches the draft looked up for k = 0 too (no rate: None) and a round kept whose draft is
    unknown (None added to seconds)."""
    c = SpecController(max_k=2, acceptance=0.8)
    c.record_target(1, 1, 0.010)
    assert c.expected_rate(0, 1) == pytest.approx(100.0)
    assert c.expected_rate(1, 1) is None
    assert c.best_round(1) == (pytest.approx(0.010), pytest.approx(1.0))


def test_no_drafting_at_max_k_zero_even_when_profiled() -> None:
    """Catches ``max_k <= 0`` -> ``< 0``: a profiled controller with max_k = 0 would look for an
    exploration among no k at all (``max`` of nothing raises)."""
    c = SpecController(max_k=0, explore_every=1)
    c.record_target(1, 1, 0.010)
    assert [c.choose_k(1) for _ in range(3)] == [0, 0, 0]


def test_an_exploration_takes_the_best_k_even_when_it_is_not_the_smallest() -> None:
    """A 2-token verify measured dear (30 ms), a 3-token one cheap (16 ms): plain decoding wins at
    a = 0.3 (100/s against 43/s and 86/s), and the exploration tries k = 2, the better of the
    two. Catches the exploration's key broken (every k scoring alike picks k = 1)."""
    c = SpecController(max_k=2, acceptance=0.3, explore_every=1)
    c.record_target(1, 1, 0.010)
    c.record_target(1, 2, 0.030)
    c.record_target(1, 3, 0.016)
    c.record_draft(1, 1, 0.0001)
    r = [c.expected_rate(k, 1) or 0.0 for k in range(3)]
    assert r[1] < r[2] < r[0]
    assert c.choose_k(1) == 2 and c.exploring == EXPLORE_STEPS - 1
    assert c.choose_k(1) == 2  # the exploration's later steps too


def test_the_exploration_ceiling_counts_only_the_ks_that_can_be_chosen() -> None:
    """max_k = 1: a perfect draft at k = 1 loses (1.999 / 31 ms < 1 / 10 ms), so there is nothing
    to explore - though a k = 2 round, measured cheap, would win. Catches the ceiling taken over
    one k too many."""
    c = SpecController(max_k=1, acceptance=0.1, explore_every=1)
    c.record_target(1, 1, 0.010)
    c.record_target(1, 2, 0.030)
    c.record_target(1, 3, 0.010)
    c.record_draft(1, 1, 0.001)
    assert (c.expected_rate(2, 1, acceptance=0.999) or 0.0) > 100.0
    assert [c.choose_k(1) for _ in range(4)] == [0] * 4


def test_interp_picks_the_segment_that_holds_x_among_many() -> None:
    """Four points: x = 4 lies on the second segment, x = 6 on the third. Catches the end
    segment taken from the second point on (``points[+1]`` for ``points[-1]``)."""
    pts = [(1, 1.0), (3, 3.0), (5, 13.0), (7, 15.0)]
    assert SpecController._interp(pts, 4) == pytest.approx(8.0)
    assert SpecController._interp(pts, 6) == pytest.approx(14.0)


def test_an_ngram_proposer_may_use_one_n() -> None:
    """``min_n == max_n`` is allowed (one n-gram length); ``min_n > max_n`` and ``min_n < 1`` are
    not. Catches the bound tightened to ``min_n < max_n``."""
    p = NgramProposer(4, 4, min_n=3, max_n=3)
    assert p.propose(1, [1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(4, 4, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(4, 4, min_n=0, max_n=2)


# -- per-row acceptance (n-gram drafts) --------------------------------------------------------


STEP_MS = {(1, 1): 20, (1, 2): 29, (1, 3): 32, (1, 4): 45, (1, 5): 52}
STEP_MS |= {(3, 1): 33, (4, 1): 39, (4, 2): 58, (4, 3): 81, (4, 4): 108, (4, 5): 144}
"""Small's step costs (ms) on the AVX2 host at 1 and 4 rows x tokens per row (3 rows: plain)."""


def _ngram_priced() -> SpecController:
    c = SpecController(max_k=4, acceptance=0.5)
    for (b, tokens), ms in STEP_MS.items():
        c.record_target(b, tokens, ms / 1000)
    c.record_draft(1, 1, 0.0)  # a lookup costs nothing
    return c


def _best_k_by_hand(acceptance: float, k: int, batch: int) -> int:
    """The same choice written out: an accepted token saves the row's share of a later step (the
    whole step alone; plain(4) - plain(3) at 4 rows); j drafts cost this step (target(j + 1) -
    plain) / rows; the j of the best net saving where the saving is 1.1x the cost."""
    a, plain = acceptance, STEP_MS[(batch, 1)]
    share = plain if batch == 1 else plain - STEP_MS[(batch - 1, 1)]
    best, best_net = 0, 0.0
    for j in range(1, k + 1):
        saved = sum(a**i for i in range(1, j + 1)) * share
        cost = (STEP_MS[(batch, j + 1)] - plain) / batch
        if saved >= 1.1 * cost and saved - cost > best_net:
            best, best_net = j, saved - cost
    return best


def test_a_rows_acceptance_is_its_record_shrunk_toward_the_average() -> None:
    """Catches a row priced at the engine's average (every row inherits the rows before it) or at
    its raw record (one lucky draft would pin it at 100%): 4 pseudo-drafts at the average."""
    c = SpecController(max_k=4, acceptance=0.5)
    assert c.row_acceptance(0, 0) == 0.5  # no record: the average
    assert c.row_acceptance(4, 0) == pytest.approx(2 / 8)
    assert c.row_acceptance(12, 12) == pytest.approx(14 / 16)
    c.acceptance = 0.9
    assert c.row_acceptance(4, 0) == pytest.approx(3.6 / 8)


@pytest.mark.parametrize("acceptance", [0.1, 0.3, 0.45, 0.6, 0.75, 0.9, 0.99])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 4])
def test_row_k_is_the_best_net_saving_at_the_rows_acceptance(acceptance: float, k: int, batch: int) -> None:
    """Catches row_k ignoring the row's acceptance, its cap k, the margin, or pricing one row's
    drafts as if every row of the batch gained from them (at 4 rows an accepted token saves only
    the row's share of a step): compared with the savings worked out by hand from the same costs."""
    c = _ngram_priced()
    assert c.row_k(batch, k, acceptance) == _best_k_by_hand(acceptance, k, batch)


def test_a_row_drafts_less_in_a_batch_than_alone() -> None:
    """The measured case: acceptance 0.72 pays alone (a whole step saved per accepted token) and
    not beside three other rows at these costs (6 ms saved per accepted token, 4.75 ms per draft)."""
    c = _ngram_priced()
    assert c.row_k(1, 4, 0.72) >= 2
    assert c.row_k(4, 4, 0.72) == 0


def test_row_k_drafts_for_a_repetitive_row_and_not_for_a_prose_one() -> None:
    """The case behind it: at batch 1 a prose request's failed drafts stop its drafting, while a
    repetitive request after it drafts at once (its own record, not the previous request's)."""
    c = _ngram_priced()
    c.acceptance = 0.3  # the engine's average after prose requests
    assert c.choose_k(1) == 0  # priced at the average, nobody would draft
    prose = c.row_acceptance(8, 1)
    repeats = c.row_acceptance(8, 8)
    assert c.row_k(1, 4, prose) == 0
    assert c.row_k(1, 4, repeats) > 0
    assert c.choose_k(1, acceptance=repeats) > 0  # the engine's k priced at its best row


def test_row_k_leaves_pinned_and_zero_k_alone() -> None:
    c = _ngram_priced()
    assert c.row_k(1, 0, 0.99) == 0
    c.fixed_k = 3
    assert c.row_k(1, 3, 0.01) == 3  # a pinned k is a benchmark's or a test's: honoured


def test_a_tier_kept_off_by_its_backlog_or_its_profile_still_explores_now_and_then() -> None:
    """The latch: with speculation off the draft is not fed, so its backlog only grows and the short
    exploration (backlog <= 8) never comes; a profile whose draft cost was measured while the
    machine was busy keeps even a perfect draft below plain decoding. Both read figures only
    drafting refreshes. Catches a tier that never drafts again: after explore_every x
    LONG_EXPLORE_WAIT plain steps it explores whatever the backlog and the ceiling, each such
    exploration doubles the wait (up to 8x), and a step that speculates resets it."""
    every = 2
    c = profiled(0.1, explore_every=every)
    wait = every * LONG_EXPLORE_WAIT
    assert all(c.choose_k(1, draft_lag=500) == 0 for _ in range(wait - 1))
    assert c.choose_k(1, draft_lag=500) == 1  # explores with the best k > 0
    assert c.long_wait == 2 * LONG_EXPLORE_WAIT and c.exploring == EXPLORE_STEPS - 1
    assert [c.choose_k(1, draft_lag=500) for _ in range(EXPLORE_STEPS - 1)] == [1] * (EXPLORE_STEPS - 1)
    gaps, plain = [], 0
    while len(gaps) < 4:  # the next ones wait 2x, 4x, 8x, then 8x again
        k = c.choose_k(1, draft_lag=500)
        plain += 1
        if k:
            gaps.append(plain)
            plain = 0
            for _ in range(EXPLORE_STEPS - 1):
                assert c.choose_k(1, draft_lag=500) == k
    assert gaps == [2 * wait, 4 * wait, 8 * wait, 8 * wait]
    c.acceptance = 0.9  # drafting pays again: a speculating step resets the wait
    assert c.choose_k(1) > 0 and c.long_wait == LONG_EXPLORE_WAIT
    # A draft priced at a whole plain step (a busy warm-up): even a perfect draft loses, and still
    # the long wait explores.
    c = SpecController(max_k=2, acceptance=0.1, explore_every=every)
    c.record_target(1, 1, 0.010)
    c.record_target(1, 3, 0.030)
    c.record_draft(1, 1, 0.010)
    assert [c.choose_k(1) for _ in range(wait)] == [0] * (wait - 1) + [1]


def test_a_busy_warm_up_figure_gives_way_to_the_first_measurement_in_service() -> None:
    """The latch behind a large tier that never drafted after warming up beside a second service:
    the profile priced its draft at a whole plain step, and only drafting refreshes that figure.
    Averaged (ema 0.1), one exploration's true 1 ms moved it to 9.1 ms and drafting stayed off;
    seeded figures are replaced by the first measurement instead, then averaged as before. Catches
    ``seeded`` marking nothing, the replacement left out of ``_record`` or kept for later samples."""

    def busy(seed: bool) -> SpecController:
        c = SpecController(max_k=4, acceptance=0.8)
        c.record_target(1, 1, 0.010)
        c.record_target(1, 5, 0.012)
        c.record_draft(1, 1, 0.010)  # the busy profile: a draft forward as dear as a target step
        if seed:
            c.seeded()
        return c

    for seed in (True, False):
        c = busy(seed)
        # rate(0) = 100/s; rate(4) = 3.36 / (12 + 4 x 10 ms) = 65/s: off
        assert c.choose_k(1) == 0
        c.record_draft(1, 1, 0.001)  # an exploration's draft forward, measured
        if seed:
            assert c.draft_cost[(1, 1)] == pytest.approx(0.001)
            assert c.draft_ratio[(1, 1)] == pytest.approx(0.1)
            assert c.choose_k(1) == 4  # 3.36 / (12 + 4 x 1 ms) = 210/s > 1.1 x 100
        else:  # what averaging gave: 10 + 0.1 x (1 - 10) = 9.1 ms, still off
            assert c.draft_cost[(1, 1)] == pytest.approx(0.0091)
            assert c.choose_k(1) == 0
    c = busy(True)
    assert ("target_cost", (1, 5)) in c.provisional and ("draft_ratio", (1, 1)) in c.provisional
    c.record_draft(1, 1, 0.001)
    c.record_draft(1, 1, 0.002)  # from the second measurement on: the moving average
    assert c.draft_cost[(1, 1)] == pytest.approx(0.0011)
    assert ("target_cost", (1, 5)) in c.provisional and ("draft_cost", (1, 1)) not in c.provisional


def test_the_profile_records_the_fastest_forward_of_each_shape() -> None:
    """Every first forward of a shape here is 40 ms slower (the machine busy with something else):
    the seed must be the quiet figure, not the average the controller would make of both (36 ms).
    Catches the profile back on ``record`` per forward."""
    from tiers.spec_decode.proposers import ModelDraft

    class Stub:
        blocks = None

        def __init__(self, seconds: float) -> None:
            self.seconds, self.shapes = seconds, set()

        def forward_scratch(self, rows: list[list[int]], start: int = 0) -> None:
            shape = (len(rows), len(rows[0]))
            time.sleep(self.seconds + (0.04 if shape not in self.shapes else 0.0))
            self.shapes.add(shape)

    spec = SpecController(max_k=2)
    draft = ModelDraft(
        Stub(0.001),  # type: ignore[arg-type]
        spec,
        vocab_size=8,
        eos_token_ids=frozenset(),
        generator=SimpleNamespace(),  # type: ignore[arg-type]
        max_num_seqs=2,
    )
    draft.profile(Stub(0.002), [1, 2, 3], [1, 2], ctx=4)  # type: ignore[arg-type]
    assert set(spec.target_cost) == {(1, 1), (1, 3), (2, 1), (2, 3)} and set(spec.draft_cost) == {
        (1, 1),
        (2, 1),
    }
    assert max(spec.target_cost.values()) < 0.02 and max(spec.draft_cost.values()) < 0.02
    assert spec.catch_up_ratio[CATCH_UP] < 0.02 / 4 / spec.target_cost[(1, 1)]  # 4 tokens of backlog read
    assert fastest(lambda: None, repeats=3) < 0.01


def test_a_warm_up_plain_step_far_off_its_first_measurement_explores_at_once() -> None:
    """The latch seen from outside (a large tier warmed up while both cores ran other work): the
    profile's 5-token verify came out 2.6x its plain step (1.3x in truth) and kept the predicted gain
    just under the resume margin; only drafting measures a verify, and the draft's backlog kept the
    short exploration away. A seeded plain step more than PROFILE_TRUST x off its first live
    measurement marks the profile suspect, and the next plain choice explores whatever the gates.
    Catches the check left out, made one-sided (a profile too fast is as wrong), or firing on a
    figure that was never seeded."""

    def seeded_at(plain: float) -> SpecController:
        c = SpecController(max_k=2, acceptance=0.8)
        c.record_target(1, 1, plain)
        c.record_target(1, 3, 2.6 * plain)  # the busy verify
        c.record_draft(1, 1, 0.1 * plain)
        c.seeded()
        return c

    # rate(0) = 1/p; rate(1) = 1.8 / (1.8 + 0.1) p = 0.95/p (the 2-token verify interpolated at
    # 1.8x); rate(2) = 2.44 / (2.6 + 0.2) p = 0.87/p: off, behind a backlog of 40; explores with k = 1
    for seed, live, recheck in ((0.30, 0.03, True), (0.01, 0.03, True), (0.02, 0.028, False)):
        c = seeded_at(seed)
        c.record_target(1, 1, live)
        assert c.recheck is recheck and ("target_cost", (1, 1)) not in c.provisional
        got = c.choose_k(1, draft_lag=40)
        assert got == (1 if recheck else 0)
        if recheck:
            assert not c.recheck and c.exploring == EXPLORE_STEPS - 1 and c.long_wait == LONG_EXPLORE_WAIT
    c = SpecController(max_k=2)
    c.record_target(1, 1, 0.01)
    c.record_target(1, 1, 0.05)  # never seeded: the moving average, no recheck
    assert not c.recheck


def test_an_exploration_waits_until_its_catch_up_is_a_small_share_of_the_plain_decoding() -> None:
    """At one stream a model draft starts every request a prompt behind (it is fed only while
    drafting): gated at 8 tokens, drafting that stopped once never came back (the large tier); with
    no gate, the medium tier, whose draft never pays, caught up every 64 steps and ran at 0.88x. The
    catch-up is priced at the draft's measured seconds per token: here 1 ms against a 10 ms plain
    step, so 40 tokens cost 4 plain steps, and at a 2% budget the exploration comes after 200
    plain steps (not 199; the long wait would come at 320); 4 tokens after 20. Catches
    the budget's side or unit (the batch's plain step vs the one-row one), the price ignored, the
    backlog not summed."""
    c = profiled(0.1, explore_every=10)
    c.record_catch_up(40, 0.040)
    assert c.catch_up_ratio[CATCH_UP] == pytest.approx(0.1)
    wait = round(40 * 0.1 / EXPLORE_BUDGET)
    assert wait == 200
    assert [c.choose_k(1, draft_lag=20, draft_backlog=40) for _ in range(wait)] == [0] * (wait - 1) + [1]
    c = profiled(0.1, explore_every=10)
    c.record_catch_up(40, 0.040)
    assert [c.choose_k(1, draft_lag=4, draft_backlog=4) for _ in range(20)] == [0] * 19 + [1]
    # At batch 4 (plain 20 ms: 2x the one-row step) the same catch-up is 2 plain steps: 100.
    c = profiled(0.1, explore_every=10)
    c.record_target(4, 1, 0.020)
    c.record_target(4, 3, 0.030)
    c.record_catch_up(40, 0.040)
    assert [c.choose_k(4, draft_lag=10, draft_backlog=40) for _ in range(100)] == [0] * 99 + [1]
