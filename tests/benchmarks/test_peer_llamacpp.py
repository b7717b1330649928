"""The llama.cpp peer benchmark's own arithmetic: pairing, ratio direction, request counts, arguments
(the benchmark itself needs a llama-server binary and is not part of the suite)."""

from __future__ import annotations

import math

import pytest

from benchmarks.peer_llamacpp import num_requests, parse_args, ratios, summarize


def _summary(tok_per_s: float, ttft: float, rss: float = 100.0) -> dict:
    return {"tok_per_s": tok_per_s, "ttft_p50_s": ttft, "ttft_p99_s": 2 * ttft, "rss_peak_mb": rss}


def test_ratios_pair_each_tier_with_its_peer_and_keep_direction():
    results = {
        "llama-q4_1": {"1": _summary(100, 0.1), "16": _summary(200, 0.5)},
        "llama-f32": {"1": _summary(50, 0.2)},
        "small": {"1": _summary(80, 0.15), "16": _summary(400, 0.4)},
        "large": {"1": _summary(75, 0.1, rss=300)},
    }
    r = ratios(results)
    assert set(r) == {"small", "large"}  # no medium results, no medium ratio
    assert r["small"]["1"]["peer"] == "llama-q4_1"
    assert r["small"]["1"]["tok_per_s"] == pytest.approx(0.8)  # ours / theirs: < 1 is slower
    assert r["small"]["16"]["tok_per_s"] == pytest.approx(2.0)
    assert r["small"]["1"]["ttft_p50"] == pytest.approx(1.5)  # > 1: our first token comes later
    assert r["large"]["1"]["peer"] == "llama-f32"  # fp32 against F32, not against Q4_1
    assert r["large"]["1"]["tok_per_s"] == pytest.approx(1.5)
    assert r["large"]["1"]["rss_peak"] == pytest.approx(3.0)
    assert "16" not in r["large"]  # the peer has no such level


def test_ratios_of_failed_levels_are_none_not_nan():
    results = {"llama-q4_1": {"1": _summary(0.0, float("nan"))}, "small": {"1": _summary(80, 0.1)}}
    r = ratios(results)["small"]["1"]
    assert r["tok_per_s"] is None
    assert r["ttft_p50"] is None


def test_summarize_counts_only_successful_requests():
    samples = [
        {"ttft_s": 0.1, "e2e_s": 1.0, "tokens": 64},
        {"ttft_s": 0.3, "e2e_s": 1.2, "tokens": 64},
        {"error": "HTTP 503", "ttft_s": 0, "e2e_s": 0, "tokens": 0},
    ]
    s = summarize(samples, wall_s=2.0)
    assert s["errors"] == 1
    assert s["tok_per_s"] == pytest.approx(64.0)
    assert s["ttft_p50_s"] == pytest.approx(0.2)
    assert s["tokens_per_request"] == [64]
    assert math.isnan(summarize([], 1.0)["ttft_p50_s"])


def test_num_requests_covers_every_prompt_in_whole_waves():
    assert num_requests(12, 1) == 12
    assert num_requests(12, 4) == 12
    assert num_requests(12, 16) == 32
    assert num_requests(12, 5) == 15


def test_arguments():
    a = parse_args(["--concurrency", "1,8", "--targets", "small,llama-f32"])
    assert a.concurrency == [1, 8]
    assert a.targets == ["small", "llama-f32"]
    with pytest.raises(SystemExit):
        parse_args(["--targets", "huge"])
    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "0"])


def test_the_median_round_stands_for_a_level_with_every_round_beside_it() -> None:
    """Catches a level reported from its first (or best) round, or speculative counters of one round
    only: three rounds at 90, 120 and 100 tok/s give the 100 tok/s run, all three listed, the
    drafted tokens of all three summed."""
    from benchmarks.peer_llamacpp import median_run

    runs = [
        {"tok_per_s": 90.0, "ttft_p50_s": 0.3, "speculative": {"draft_tokens": 1.0}},
        {"tok_per_s": 120.0, "ttft_p50_s": 0.1, "speculative": {"draft_tokens": 2.0}},
        {"tok_per_s": 100.0, "ttft_p50_s": 0.2, "speculative": {"draft_tokens": 4.0}},
    ]
    got = median_run(runs)
    assert got["tok_per_s"] == 100.0 and got["ttft_p50_s"] == 0.2
    assert got["tok_per_s_rounds"] == [90.0, 120.0, 100.0]
    assert got["speculative"] == {"draft_tokens": 7.0}
    assert parse_args([]).rounds == 3


def test_baseline_targets_ask_for_their_tier_and_compare_with_it() -> None:
    """Catches a baseline target sent to the service under its own name (``small@base`` is no
    model there) or compared with the wrong tier."""
    from benchmarks.peer_llamacpp import body, tier_of, vs_baseline

    assert tier_of("small@base") == "small" and tier_of("large") == "large" and tier_of("llama-q4_1") is None
    assert body("medium@base", "hi", 8)["model"] == "medium"
    assert body("llama-f32", "hi", 8)["model"] == "default"
    results = {
        "small": {"1": {"tok_per_s": 150.0}, "4": {"tok_per_s": 300.0}},
        "small@base": {"1": {"tok_per_s": 100.0}},
        "medium": {"1": {"tok_per_s": 90.0}},
    }
    assert vs_baseline(results) == {"small": {"1": 1.5}}
