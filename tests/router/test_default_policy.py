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
    srv, stop = start_server(ROOT / "policies/default.yaml", watch_policy=False)
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
