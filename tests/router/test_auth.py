"""API-key auth: Bearer keys from the environment, tenants from keys, open health paths, no bypass."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from router.auth import ApiKeys
from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, start_server

AUTH = """
  auth:
    api_keys_env: TEST_ROUTER_KEYS
"""


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    os.environ["TEST_ROUTER_KEYS"] = "sk-alpha:team-a, sk-beta"
    path = tmp_path_factory.mktemp("auth") / "policy.yaml"
    text = tiny_policy_yaml(tiny_model_dir, cache_enabled=False).replace(
        "service:\n", "service:\n" + AUTH.lstrip("\n"), 1
    )
    text = text.replace("routing:\n", "tenants:\n  team-a: {allowed_tiers: [small]}\nrouting:\n", 1)
    path.write_text(text)
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()
    os.environ.pop("TEST_ROUTER_KEYS", None)


BODY = {"model": "large", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_missing_and_wrong_keys_are_401_in_openai_shape(server: Server) -> None:
    for headers in (
        {},
        {"authorization": "Bearer sk-wrong"},
        {"authorization": "Basic sk-alpha"},
        {"authorization": "Bearer"},
    ):
        r = httpx.post(server.url + "/v1/chat/completions", json=BODY, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_valid_key_works_and_maps_its_tenant(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-alpha", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="large", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert raw.headers["x-router-tier"] == "small"  # team-a is capped at small
    beta = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-beta", max_retries=0)
    raw = beta.chat.completions.with_raw_response.create(
        model="large", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert raw.headers["x-router-tier"] == "large"


def test_key_tenant_wins_over_the_header(server: Server) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json=BODY,
        headers={"authorization": "Bearer sk-alpha", "x-tenant": "someone-else"},
    )
    assert r.headers["x-router-tier"] == "small"


def test_health_and_metrics_stay_open(server: Server) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200


@pytest.mark.parametrize(
    "path",
    [
        "/V1/chat/completions",
        "/v1/chat/completions/",
        "//v1/chat/completions",
        "/v1/../v1/chat/completions",
        "/v1/chat/completions%2F",
        "/healthz/../v1/chat/completions",
        "/v1/models",
    ],
)
def test_path_tricks_do_not_bypass_auth(server: Server, path: str) -> None:
    r = httpx.post(server.url + path, json=BODY, headers={"host": "localhost"})
    assert r.status_code in (401, 404, 405)
    assert r.status_code != 200


def test_keys_parse_and_compare() -> None:
    keys = ApiKeys(ApiKeys.parse("k1:t1\n# comment\nk2\n, k3 : t3"))
    assert keys.authenticate("Bearer k1") == "t1"
    assert keys.authenticate("bearer k2") is None
    assert keys.authenticate("Bearer k3") == "t3"
    assert keys.authenticate("Bearer k4") is False
    assert keys.authenticate(None) is False
    assert not ApiKeys({}).enabled
