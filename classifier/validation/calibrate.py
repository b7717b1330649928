"""Turn target traffic shares per tier into ``score_below`` thresholds for the routing policy.

As RouteLLM's calibration does for its routers: score a sample of real prompts, then put each
threshold at the quantile of ``ComplexityScore.value`` that sends the wanted share below it.
With shares small=0.5, medium=0.3, large=0.2 the small threshold is the 50th percentile of the
values and the medium one the 80th. A rule ``score_below: t`` fires when ``value < t``.
Writing them into a policy file is the policy's business (``router.policy.thresholds``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from classifier.data import LABELS, load_jsonl

__all__ = ["DECIMALS", "calibrate", "parse_shares", "propose_thresholds", "routing_yaml"]

DECIMALS = 4
BATCH = 256


def parse_shares(text: str) -> dict[str, float]:
    """``"small=0.5,medium=0.3,large=0.2"`` -> shares normalized to sum 1 (missing tiers get 0).

    Normalizing lets percentages (``small=50,medium=30,large=20``) work as well.
    """
    shares = dict.fromkeys(LABELS, 0.0)
    for item in text.split(","):
        if not item.strip():
            continue
        name, sep, number = item.partition("=")
        name = name.strip()
        if not sep or name not in shares:
            raise ValueError(f"bad share {item.strip()!r}: expected TIER=FRACTION with TIER in {LABELS}")
        try:
            value = float(number)
        except ValueError:
            raise ValueError(f"bad share {item.strip()!r}: {number.strip()!r} is not a number") from None
        if not math.isfinite(value) or value < 0.0:
            raise ValueError(f"bad share {item.strip()!r}: must be a finite, non-negative number")
        shares[name] = value
    total = sum(shares.values())
    if total <= 0.0:
        raise ValueError("shares must not all be zero")
    return {name: value / total for name, value in shares.items()}


def _cut(sorted_values: Sequence[float], share: float) -> float:
    """A threshold with ``round(share * n)`` values strictly below it: midway between neighbours."""
    n = len(sorted_values)
    k = round(share * n)
    if k <= 0:
        return 0.0
    if k >= n:
        return 1.0
    return (sorted_values[k - 1] + sorted_values[k]) / 2.0


def propose_thresholds(values: Sequence[float], shares: Mapping[str, float]) -> dict[str, float]:
    """``{"small": t1, "medium": t2}``, rounded to DECIMALS places.

    t1 < t2 strictly whenever the medium share is positive (the policy loader rejects score rules
    whose thresholds do not increase); with a zero share the two coincide and routing_yaml()
    leaves the medium rule out.
    """
    if not values:
        raise ValueError("no values to calibrate on")
    ordered = sorted(values)
    small_share = shares.get("small", 0.0)
    medium_share = shares.get("medium", 0.0)
    small = round(_cut(ordered, small_share), DECIMALS)
    medium = round(_cut(ordered, small_share + medium_share), DECIMALS)
    if medium_share > 0.0 and medium <= small:
        medium = min(1.0, small + 10.0**-DECIMALS)
    return {"small": small, "medium": max(small, medium)}


def routing_yaml(thresholds: Mapping[str, float]) -> str:
    """The routing rules as a ready-to-paste YAML snippet (a rule that can never fire is left out)."""
    lines = ["routing:", "  rules:"]
    lower = 0.0
    for tier in ("small", "medium"):
        threshold = round(thresholds[tier], DECIMALS)
        if threshold > lower:
            lines += [
                f"    - name: score-{tier}",
                f"      when: {{score_below: {threshold!r}}}",
                f"      tier: {tier}",
            ]
            lower = threshold
    lines += ["    - name: default", "      tier: large"]
    return "\n".join(lines) + "\n"


def _route(value: float, thresholds: Mapping[str, float]) -> str:
    if value < thresholds["small"]:
        return "small"
    if value < thresholds["medium"]:
        return "medium"
    return "large"


def calibrate(
    data_path: str | Path, shares: Mapping[str, float] | str, model_path: str | Path | None = None
) -> dict[str, Any]:
    """Thresholds for ``shares`` on the prompts of ``data_path`` (JSONL, ``label`` optional).

    Returns ``n``, ``targets``, ``thresholds``, ``achieved`` (the shares those rounded thresholds
    really give on this data), ``yaml`` and, when rows carry labels, ``label_mix``: for each
    routed tier, how many prompts of each labeled tier it receives.
    """
    from classifier.inference import ComplexityClassifier

    targets = (
        parse_shares(shares)
        if isinstance(shares, str)
        else parse_shares(",".join(f"{k}={v}" for k, v in shares.items()))
    )
    rows = load_jsonl(data_path)
    if not rows:
        raise ValueError(f"{data_path}: no prompts")
    clf = ComplexityClassifier.load(model_path)
    values: list[float] = []
    for start in range(0, len(rows), BATCH):
        values += [s.value for s in clf.score_batch([r["prompt"] for r in rows[start : start + BATCH]])]
    thresholds = propose_thresholds(values, targets)
    routed = [_route(v, thresholds) for v in values]
    result: dict[str, Any] = {
        "n": len(rows),
        "targets": {k: round(v, 6) for k, v in targets.items()},
        "thresholds": thresholds,
        "achieved": {tier: routed.count(tier) / len(rows) for tier in LABELS},
        "yaml": routing_yaml(thresholds),
    }
    if all(r.get("label") in LABELS for r in rows):
        mix = {tier: dict.fromkeys(LABELS, 0) for tier in LABELS}
        for tier, row in zip(routed, rows, strict=True):
            mix[tier][row["label"]] += 1
        result["label_mix"] = mix
    return result
