"""The dashboard's figures (router/http/dashboard.py), computed from the app's own Prometheus
registry: quantiles as Prometheus's ``histogram_quantile`` interpolates them (worked by hand
here), per-tier sums over every other label, the acceptance rate, the routing mix and rules, and
no model path or remote URL on the page."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from router.http.dashboard import _quantile, dashboard_data
from router.policy.loader import parse_policy
from router.telemetry import _LATENCY_BUCKETS, Telemetry
from tests.fixtures import tiny_policy_yaml

INF = float("inf")


def test_quantiles_interpolate_inside_the_bucket_that_holds_the_rank() -> None:
    """Worked as Prometheus does: rank q*total, linear between the bucket's bounds. Bugs it
    catches: the rank compared with ``>`` (the next bucket's answer), the lower bound taken as 0,
    the +Inf bucket returned as inf."""
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (INF, 10.0)]
    assert _quantile(buckets, 0.5) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)  # 0.4
    assert _quantile(buckets, 0.99) == pytest.approx(0.5 + 0.5 * (9.9 - 6) / 4)  # 0.9875
    assert _quantile(buckets, 0.2) == pytest.approx(0.1)  # rank 2 ends the first bucket
    assert _quantile(buckets, 0.1) == pytest.approx(0.05)  # from 0 inside the first bucket
    # A rank past the last finite bound: the last finite bound, never inf.
    assert _quantile([(0.1, 1.0), (INF, 4.0)], 0.9) == pytest.approx(0.1)
    assert _quantile([], 0.5) is None
    assert _quantile([(0.1, 0.0), (INF, 0.0)], 0.5) is None


def test_the_data_sums_each_tier_over_the_other_labels(tiny_model_dir: Path) -> None:
    policy = parse_policy(tiny_policy_yaml(tiny_model_dir), source="/etc/router/policy.yaml")
    t = Telemetry()
    try:
        for endpoint, outcome, n in (("chat", "ok", 3), ("completions", "ok", 2), ("chat", "error", 1)):
            t.requests.labels(endpoint, "small", "r", outcome, "-").inc(n)
        t.requests.labels("chat", "large", "r", "ok", "-").inc(4)
        t.spec_draft.labels("medium").inc(10)
        t.spec_accepted.labels("medium").inc(7)
        t.completion_tokens.labels("small").inc(30)
        for tier, rule, n in (("small", "easy", 5), ("large", "hard", 2), ("small", "hard", 1)):
            t.route_decisions.labels(tier, rule).inc(n)
        t.cache_hits.labels("exact").inc(2)
        t.cache_hits.labels("semantic").inc(1)
        t.cache_misses.inc(5)
        t.policy_reloads.inc()
        for v in (0.01, 0.02, 0.03, 0.04):
            t.ttft.labels("small").observe(v)
        service = SimpleNamespace(policy=policy, ready=True, draining=False)
        data = dashboard_data(t, service)  # type: ignore[arg-type]
    finally:
        t.shutdown()
    tiers = {row["name"]: row for row in data["tiers"]}
    assert list(tiers) == list(policy.tiers)
    assert tiers["small"]["requests"] == {"ok": 5.0, "error": 1.0}
    assert tiers["large"]["requests"] == {"ok": 4.0}
    assert tiers["medium"]["acceptance_rate"] == pytest.approx(0.7)
    assert tiers["small"]["acceptance_rate"] is None  # nothing drafted: no rate, not 0
    assert tiers["small"]["completion_tokens"] == 30.0
    assert data["routing_mix"] == {"small": 6.0, "large": 2.0}
    assert data["rules"] == {"easy": 5.0, "hard": 3.0}
    assert data["cache"] == {"hits": 3.0, "misses": 5.0}
    assert (data["reloads"], data["reload_failures"]) == (1.0, 0.0)
    # The median of 0.01..0.04 (rank 2) lies in the bucket whose bound first reaches 0.02.
    edges = [0.0, *_LATENCY_BUCKETS]
    upper = min(b for b in edges if b >= 0.02)
    lower = max(b for b in edges if b < upper)
    p50 = tiers["small"]["ttft_s"]["p50"]
    assert p50 is not None and lower < p50 <= upper
    assert tiers["large"]["ttft_s"] == {"p50": None, "p95": None, "p99": None}
    # No paths on the page: the model's directory name and the policy file's name only.
    assert tiers["small"]["model"] == Path(policy.tiers["small"].model).name
    assert data["policy"]["source"] == "policy.yaml"
    assert data["policy"]["version"] == policy.digest[:12]
