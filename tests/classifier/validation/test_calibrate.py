"""Thresholds from target traffic shares (classifier/calibrate.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from classifier.data import HELDOUT_PATH
from classifier.validation.calibrate import calibrate, parse_shares, propose_thresholds, routing_yaml


def test_parse_shares() -> None:
    assert parse_shares("small=0.5,medium=0.3,large=0.2") == pytest.approx(
        {"small": 0.5, "medium": 0.3, "large": 0.2}
    )
    assert parse_shares("small=50, large=50") == pytest.approx({"small": 0.5, "medium": 0.0, "large": 0.5})
    for bad in ("tiny=0.5", "small", "small=x", "small=-1", "small=0,medium=0", "small=nan"):
        with pytest.raises(ValueError, match="share"):
            parse_shares(bad)


def test_thresholds_hit_the_shares_on_uniform_values() -> None:
    rng = random.Random(0)
    values = [rng.random() for _ in range(10_000)]
    t = propose_thresholds(values, {"small": 0.5, "medium": 0.3, "large": 0.2})
    assert t["small"] == pytest.approx(0.5, abs=0.02)
    assert t["medium"] == pytest.approx(0.8, abs=0.02)


def test_thresholds_increase_strictly_and_stay_in_range() -> None:
    values = [0.25] * 100
    t = propose_thresholds(values, {"small": 0.5, "medium": 0.3, "large": 0.2})
    assert 0.0 <= t["small"] < t["medium"] <= 1.0
    assert propose_thresholds([0.1, 0.2], {"small": 1.0, "medium": 0.0, "large": 0.0}) == {
        "small": 1.0,
        "medium": 1.0,
    }
    with pytest.raises(ValueError, match="no values"):
        propose_thresholds([], {"small": 1.0})


def test_yaml_snippet_shape() -> None:
    doc = yaml.safe_load(routing_yaml({"small": 0.31, "medium": 0.62}))
    assert doc == {
        "routing": {
            "rules": [
                {"name": "score-small", "when": {"score_below": 0.31}, "tier": "small"},
                {"name": "score-medium", "when": {"score_below": 0.62}, "tier": "medium"},
                {"name": "default", "tier": "large"},
            ]
        }
    }


def test_yaml_leaves_out_rules_that_never_fire() -> None:
    rules = yaml.safe_load(routing_yaml({"small": 0.0, "medium": 0.7}))["routing"]["rules"]
    assert [r["name"] for r in rules] == ["score-medium", "default"]
    rules = yaml.safe_load(routing_yaml({"small": 0.4, "medium": 0.4}))["routing"]["rules"]
    assert [r["name"] for r in rules] == ["score-small", "default"]


@pytest.mark.parametrize(
    "shares",
    [
        {"small": 0.5, "medium": 0.3, "large": 0.2},
        pytest.param(
            {"small": 0.2, "medium": 0.2, "large": 0.6},
            marks=pytest.mark.xfail(
                strict=True,
                reason="issue 56: 4.0's category prior puts long constrained writing tasks (labelled "
                "large in the complexity corpus) low, so at a 20 % small share the routed-small "
                "prompts hold more large than small labels (22 vs 46; 3.2: 44 vs 41)",
            ),
        ),
        {"small": 0.7, "medium": 0.1, "large": 0.2},
    ],
)
def test_calibrate_on_the_heldout_prompts(shares: dict[str, float]) -> None:
    result = calibrate(HELDOUT_PATH, shares)
    assert result["n"] > 500
    for tier, target in shares.items():
        assert result["achieved"][tier] == pytest.approx(target, abs=0.02), tier
    assert yaml.safe_load(result["yaml"])["routing"]["rules"][-1] == {"name": "default", "tier": "large"}
    mix = result["label_mix"]
    # Routing by score sends most truly small prompts to the small tier, large ones to large.
    assert mix["small"]["small"] > mix["small"]["large"]
    assert mix["large"]["large"] > mix["large"]["small"]


def test_calibrate_without_labels(tmp_path: Path) -> None:
    data = tmp_path / "traffic.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question number {i}"}) + "\n" for i in range(20)))
    result = calibrate(data, "small=0.5,medium=0.5")
    assert "label_mix" not in result
    assert result["achieved"]["large"] == 0.0
