"""Outcome rows and RouteLLM's routing metrics (classifier/outcomes.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from classifier.validation.outcomes import (
    MMLU_CATEGORIES,
    family_of,
    heldout_subjects,
    load_outcomes,
    parse_outcome,
    plot_curves,
    random_apgr,
    routing_curve,
    routing_metrics,
    split_by_subject,
)


def _routellm_apgr(scores: list[float], weak: list[float], strong: list[float], steps: int = 2000) -> float:
    """Reference: route the top-k by score for many k, PGR per point, mean over a fine grid.

    Scores here are distinct, so no tie handling is needed; the grid approximates the integral.
    """
    n = len(scores)
    order = sorted(range(n), key=lambda i: -scores[i])
    w, s = sum(weak) / n, sum(strong) / n
    total = 0.0
    for j in range(steps + 1):
        c = j / steps
        k = c * n
        lo = int(np.floor(k))
        # Fractional k: interpolate between routing lo and lo + 1 prompts.
        perf_lo = (sum(weak) + sum(strong[i] - weak[i] for i in order[:lo])) / n
        perf_hi = perf_lo + ((strong[order[lo]] - weak[order[lo]]) / n if lo < n else 0.0)
        perf = perf_lo + (k - lo) * (perf_hi - perf_lo)
        total += ((perf - w) / (s - w)) * (0.5 if j in (0, steps) else 1.0)
    return total / steps


def test_apgr_matches_a_brute_force_reference() -> None:
    rng = np.random.default_rng(3)
    weak = rng.integers(0, 2, 60).astype(float).tolist()
    strong = np.clip(np.array(weak) + rng.integers(0, 2, 60), 0, 1).astype(float).tolist()
    scores = rng.random(60).tolist()
    assert routing_metrics(scores, weak, strong)["apgr"] == pytest.approx(
        _routellm_apgr(scores, weak, strong), abs=1e-3
    )


def test_oracle_random_and_inverse_routers() -> None:
    weak = [0, 0, 1, 1, 0, 1, 0, 1]
    strong = [1, 1, 1, 1, 0, 1, 1, 1]
    gain = [s - w for w, s in zip(weak, strong, strict=True)]
    oracle = routing_metrics(gain, weak, strong)
    inverse = routing_metrics([-g for g in gain], weak, strong)
    assert oracle["apgr"] > 0.8
    assert inverse["apgr"] < 0.2
    assert oracle["cpt_50"] == pytest.approx(1.5 / 8)  # 3 helpful prompts: half of the gap at 1.5
    assert oracle["curve"]["pgr"][0] == 0.0 and oracle["curve"]["pgr"][-1] == 1.0
    assert 0.45 < random_apgr(weak * 20, strong * 20) < 0.55


def test_ties_count_as_a_random_order() -> None:
    """A constant score cannot win by row order: the whole tie moves in one step (APGR 0.5)."""
    weak, strong = [0, 1, 0, 1], [1, 1, 1, 1]
    assert routing_metrics([0.3] * 4, weak, strong)["apgr"] == pytest.approx(0.5)
    assert routing_metrics([0.3] * 4, weak[::-1], strong[::-1])["apgr"] == pytest.approx(0.5)
    share, _ = routing_curve([0.3] * 4, weak, strong)
    assert share.tolist() == [0.0, 1.0]


def test_equal_models_have_no_gap() -> None:
    with pytest.raises(ValueError, match="PGR is undefined"):
        routing_metrics([0.1, 0.2], [1, 0], [1, 0])


def test_parse_the_accepted_shapes() -> None:
    assert parse_outcome({"prompt": "p", "weak": True, "strong": False}) == {
        "prompt": "p",
        "weak": 1.0,
        "strong": 0.0,
        "family": "all",
    }
    tiers = parse_outcome({"prompt": "p", "outcomes": {"large": 0.9, "small": 0.2, "medium": 0.5}})
    assert tiers is not None and (tiers["weak"], tiers["strong"]) == (0.2, 0.9)
    assert parse_outcome({"prompt": "p", "outcomes": {"small": 1}}) is None  # no comparison
    with pytest.raises(ValueError, match="unknown tier"):
        parse_outcome({"prompt": "p", "outcomes": {"small": 1, "huge": 0}})
    with pytest.raises(ValueError, match="not a number"):
        parse_outcome({"prompt": "p", "weak": "yes", "strong": 1})


def test_pass_rate_rows_need_a_pair_and_get_their_family() -> None:
    """difficulty_7b's shape: per-model pass rates; the pair picks weak and strong, the source the family."""
    raw = {"prompt": "p", "source": "humaneval_test", "scores": {"a": 0.2, "b": 0.7, "c": 0.5}}
    with pytest.raises(ValueError, match="model pair"):
        parse_outcome(raw)
    with pytest.raises(ValueError, match="no scores"):
        parse_outcome(raw, pair=("a", "z"))
    row = parse_outcome(raw, pair=("a", "b"))
    assert row is not None and (row["weak"], row["strong"], row["family"]) == (0.2, 0.7, "python")
    # MMLU subjects fall into Hendrycks et al.'s four categories; an explicit family wins.
    assert family_of({"subject": "moral_scenarios"}) == "mmlu_humanities"
    assert family_of({"subject": "virology", "family": "f"}) == "f"
    assert len(MMLU_CATEGORIES) == 57


def test_load_gzip_and_drop_contaminated(tmp_path: Path) -> None:
    path = tmp_path / "o.jsonl.gz"
    rows = [
        {"prompt": "a", "weak": 0, "strong": 1, "subject": "x"},
        {"prompt": "b", "weak": 1, "strong": 1, "subject": "y", "contaminated": True},
        {"prompt": "c", "outcomes": {"small": 0.1, "large": 0.8}},
    ]
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write("\n".join(json.dumps(r) for r in rows) + "\n\n")
    loaded = load_outcomes(path)
    assert [r["prompt"] for r in loaded] == ["a", "c"]
    assert len(load_outcomes(path, keep_contaminated=True)) == 3


def test_subject_split_is_stable_and_whole() -> None:
    subjects = [f"s{i}" for i in range(40)]
    held = heldout_subjects(subjects)
    assert held == heldout_subjects(list(reversed(subjects)))  # order-independent
    assert len(held) == 10
    rows = [{"prompt": str(i), "weak": 0, "strong": 1, "subject": subjects[i % 40]} for i in range(400)]
    train, test = split_by_subject(rows)
    assert {r["subject"] for r in train}.isdisjoint({r["subject"] for r in test})
    assert len(test) == 100


def test_plot_writes_a_png(tmp_path: Path) -> None:
    m = routing_metrics([0.1, 0.9, 0.5], [0, 0, 1], [1, 1, 1])
    plot_curves({"value": m}, tmp_path / "c.png", "t")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shadow_and_feedback_lines_merge_by_id(tmp_path: Path) -> None:
    from classifier.validation.outcomes import merge_by_id

    shadow = {"id": "r1", "prompt": "p", "outcomes": {"large": 1.0}, "answers": {}}
    feedback = {"id": "r1", "outcomes": {"small": 0.0}}
    unjudged = {"id": "r2", "prompt": "q", "outcomes": {}}
    no_content = {"id": "r3", "outcomes": {"small": 1, "large": 1}}  # logged without the prompt
    plain = {"prompt": "x", "weak": 1, "strong": 1, "id": 7}
    merged = merge_by_id(
        [("a:1", shadow), ("b:1", plain), ("c:1", feedback), ("a:2", unjudged), ("d", no_content)]
    )
    assert [raw for _, raw in merged] == [
        {"id": "r1", "outcomes": {"large": 1.0, "small": 0.0}, "prompt": "p"},
        plain,
        {"id": "r2", "outcomes": {}, "prompt": "q"},
    ]
    a, b = tmp_path / "shadow.jsonl", tmp_path / "feedback.jsonl"
    a.write_text(json.dumps(shadow) + "\n" + json.dumps(unjudged) + "\n")
    b.write_text(json.dumps(feedback) + "\n")
    assert load_outcomes([a, b]) == [{"prompt": "p", "weak": 0.0, "strong": 1.0, "family": "all"}]
    with pytest.raises(ValueError, match="no rows"):
        load_outcomes([b])  # feedback alone: one tier, no comparison
