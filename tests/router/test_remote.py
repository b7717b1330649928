"""A remote tier: the router streams an OpenAI-compatible upstream (here a second instance of this
service on loopback) through, with its own routing headers, metrics and error mapping."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, free_port, start_server


@pytest.fixture(scope="module")
def upstream(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("upstream") / "policy.yaml"
    path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False))
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()


@pytest.fixture(scope="module")
def front(
    upstream: Server, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    text = f"""
version: 1
tiers:
  small:
    model: {tiny_model_dir}
    quantization: int8
    max_num_seqs: 4
    max_model_len: 256
    defaults: {{max_tokens: 8, temperature: 0}}
  large: {{model: "{upstream.url}/v1", served_model_name: large, max_retries: 1, timeout_s: 30}}
  broken: {{model: "{dead}", max_retries: 1, timeout_s: 5}}
routing:
  rules:
    - {{name: hard, when: {{score_at_least: 0.5}}, tier: large}}
    - {{name: default, tier: small}}
service:
  auth: {{mode: open}}
  cache: {{enabled: false}}
"""
    path = tmp_path_factory.mktemp("front") / "policy.yaml"
    path.write_text(text)
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()


def test_remote_tier_non_streaming(front: Server, upstream: Server) -> None:
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="large", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    resp = raw.parse()
    assert raw.headers["x-router-tier"] == "large"
    direct = openai.OpenAI(base_url=upstream.url + "/v1", api_key="x").chat.completions.create(
        model="large", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert resp.choices[0].message.content == direct.choices[0].message.content
    assert resp.usage is not None and resp.usage.completion_tokens == direct.usage.completion_tokens  # type: ignore[union-attr]


def test_remote_tier_streaming_passthrough(front: Server) -> None:
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="large",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(
        model="large", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None


def test_remote_completions(front: Server) -> None:
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
    resp = client.completions.create(model="large", prompt="The quick", max_tokens=4, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_unreachable_upstream_is_503_with_retry_after(front: Server) -> None:
    r = httpx.post(
        front.url + "/v1/chat/completions",
        json={"model": "broken", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 503 and "retry-after" in r.headers
    assert r.json()["error"]["code"] == "upstream_unavailable"


def test_upstream_error_is_passed_as_an_openai_error(front: Server) -> None:
    r = httpx.post(
        front.url + "/v1/chat/completions",
        json={
            "model": "large",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 1.0,
            "max_tokens": 10**6,
        },
    )
    assert r.status_code in (200, 400, 502)
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
