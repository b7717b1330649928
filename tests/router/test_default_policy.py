"""The real embedded default through the running service with the official openai client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.router.conftest import Server, start_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(embedded_model_dir: Path) -> Iterator[Server]:
    # Three real tiers warm up and profile (about a minute alone, several on a busy machine).
    srv, stop = start_server(ROOT / "policies/default.yaml", ready_timeout_s=900, watch_policy=False)
    yield srv
    stop()


def test_default_policy_answers_for_real(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="auto",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=30,
        temperature=0,
    )
    resp = raw.parse()
    assert "Paris" in (resp.choices[0].message.content or "")
    assert raw.headers["x-router-tier"] in ("small", "medium", "large")
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="large",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=30,
            temperature=0,
            stream=True,
        )
        if c.choices
    )
    assert "Paris" in streamed
    hard = client.chat.completions.with_raw_response.create(
        model="auto",
        max_tokens=4,
        messages=[
            {
                "role": "user",
                "content": "Prove that there are infinitely many primes, then generalize the "
                "argument to primes of the form 4k+3 with a rigorous step-by-step proof.",
            }
        ],
    )
    assert hard.headers["x-router-tier"] == "large"


def test_load_aware_mode_prices_every_embedded_tier_from_its_warm_up(server: Server) -> None:
    # Catches: an engine whose decode step was never measured (warm-up profiles only drafting
    # tiers' costs) dropping out of load-aware routing silently - every tier must carry a price.
    import dataclasses

    import httpx

    service = server.service
    static = service.policy
    # min_device_rows 0: load applies on the idle device too (below 8 rows the rule's tier stands).
    load_aware = dataclasses.replace(static.routing.load_aware, min_device_rows=0)
    service.policy = dataclasses.replace(
        static, routing=dataclasses.replace(static.routing, mode="load_aware", load_aware=load_aware)
    )
    try:
        server.wait_idle()
        r = httpx.post(
            server.url + "/v1/route",
            json={
                "model": "auto",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            },
            timeout=30,
        )
    finally:
        service.policy = static
    assert r.status_code == 200
    body = r.json()
    assert "load-aware (" in body["reason"]
    priced = body["reason"].split("load-aware (")[1].split(")")[0]
    floor = {"small": 0, "medium": 1, "large": 2}[body["rule"].removeprefix("load:").split("-")[-1]]
    assert [t for t in ("small", "medium", "large")[floor:] if f"{t} " in priced] == [
        "small",
        "medium",
        "large",
    ][floor:]
    # On an idle device the cheapest acceptable tier wins: the one the rule named.
    assert not body["rule"].startswith("load:")
    # /v1/route explains without submitting: its decision must not count toward a batch
    # (TierSet.decided), or a burst of explains would pull real requests onto an idle tier.
    assert all(b.held == 0 for b in service.tiers.batches().values())
