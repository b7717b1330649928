"""API-key auth: Bearer keys from the environment and a watched file, tenants from keys only,
per-key limits, operator endpoints behind auth, probes without internals, no bypass."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from router.http.auth import ApiKeys, Caller
from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, start_server

AUTH = """  auth:
    mode: keys
    api_keys_env: TEST_ROUTER_KEYS
    api_keys_file: {keys_file}
    rate_limit_rpm: 2
"""

TENANTS = """tenants:
  team-a: {allowed_tiers: [small], rate_limit_rpm: 1000}
  team-b: {rate_limit_rpm: 1}
  team-rot: {rate_limit_rpm: 1000}
  team-c: {rate_limit_rpm: 1000}
  team-d: {rate_limit_rpm: 1000}
routing:
"""

TEAM_B_RULE = """  rules:
    - name: team-b-rule
      when: {tenant: [team-b]}
      tier: medium
"""


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text("sk-rotating:team-rot\nsk-plain\nsk-other\nsk-stranger:nobody\n")
    return path


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, keys_file: Path
) -> Iterator[Server]:
    os.environ["TEST_ROUTER_KEYS"] = (
        "sk-alpha:team-a, sk-beta, sk-b1:team-b, sk-b2:team-b, sk-c1:team-c, sk-d:team-d, sk-e, "
        "sk-m-models, sk-m-model, sk-m-get, sk-m-delete, sk-m-count"
    )
    path = tmp_path_factory.mktemp("auth") / "policy.yaml"
    text = tiny_policy_yaml(tiny_model_dir, cache_enabled=True).replace(
        "  auth: {mode: open}\n", AUTH.format(keys_file=keys_file), 1
    )
    text = text.replace("routing:\n", TENANTS, 1).replace("  rules:\n", TEAM_B_RULE, 1)
    path.write_text(text)
    srv, stop = start_server(path, watch_policy=False, reload_interval_s=0.2)
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


def chat(url: str, key: str, content: str, **headers: str) -> httpx.Response:
    body = {
        "model": "auto",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 30,
        "temperature": 0,
        "stop": [" ", "e", "a", "o"],  # the tiny model's answers end with "stop", so they are cached
    }
    hdrs = {"authorization": f"Bearer {key}", **{k.replace("_", "-"): v for k, v in headers.items()}}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=hdrs, timeout=30)


def test_key_tenant_wins_over_the_header_for_rules_caps_cache_and_limits(server: Server) -> None:
    # Rules and caps: team-a's key claiming team-b is team-a (capped at small, no team-b rule).
    r = chat(server.url, "sk-alpha", "who am i", x_tenant="team-b")
    assert r.status_code == 200
    assert r.headers["x-router-tier"] == "small" and r.headers["x-router-rule"] != "team-b-rule"
    # Limits: that request did not spend team-b's 1 rpm, so team-b's own key still gets through.
    own = chat(server.url, "sk-b1", "who am i")
    assert own.status_code == 200 and own.headers["x-router-rule"] == "team-b-rule"
    assert own.headers["x-router-tier"] == "medium"
    # Cache: team-b's stored (medium) answer stays in team-b's partition.
    claimed = chat(server.url, "sk-alpha", "who am i", x_tenant="team-b")
    assert claimed.headers["x-router-tier"] == "small"
    assert claimed.json()["model"] == "small"
    # Both of team-b's keys share team-b's bucket.
    assert chat(server.url, "sk-b2", "who am i").status_code == 429


def test_keys_without_a_tenant_are_rate_limited_per_key(server: Server) -> None:
    codes = [chat(server.url, "sk-plain", f"plain {i}").status_code for i in range(3)]
    assert codes == [200, 200, 429]  # service.auth.rate_limit_rpm: 2
    assert chat(server.url, "sk-other", "plain 0").status_code == 200  # another key, its own bucket


METERED = {
    "sk-m-models": ("GET", "/v1/models", None),
    "sk-m-model": ("GET", "/v1/models/small", None),
    "sk-m-get": ("GET", "/v1/responses/resp_missing", None),
    "sk-m-delete": ("DELETE", "/v1/responses/resp_missing", None),
    "sk-m-count": (
        "POST",
        "/v1/messages/count_tokens",
        {"model": "small", "messages": [{"role": "user", "content": "hi"}]},
    ),
}


@pytest.mark.parametrize("key", list(METERED))
def test_every_api_endpoint_counts_against_the_rate_limit(server: Server, key: str) -> None:
    """Bug it catches: only generation and /v1/route were metered, so a client could call
    count_tokens (a full chat-template render and tokenization), stored-response lookups or the
    model list without limit. The third call within the minute is a 429 (rate_limit_rpm: 2)."""
    method, path, body = METERED[key]
    codes = [
        httpx.request(
            method, server.url + path, json=body, headers={"authorization": f"Bearer {key}"}
        ).status_code
        for _ in range(3)
    ]
    assert codes[:2] == ([404, 404] if "responses" in path else [200, 200]), codes
    assert codes[2] == 429, codes


def test_request_metrics_carry_bounded_tenant_labels(server: Server) -> None:
    chat(server.url, "sk-alpha", "labels")
    chat(server.url, "sk-stranger", "labels")  # 'nobody': a tenant the policy does not name
    text = httpx.get(server.url + "/metrics", headers={"authorization": "Bearer sk-alpha"}).text
    tenants = set(re.findall(r'router_requests_total\{[^}]*tenant="([^"]*)"', text))
    assert "team-a" in tenants and "other" in tenants and "nobody" not in tenants
    assert tenants <= {"team-a", "team-b", "team-rot", "other", "-"}


def test_operator_endpoints_need_a_key_on_the_api_port(server: Server) -> None:
    for path in ("/metrics", "/dashboard", "/dashboard/data", "/schema/openapi.json"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(server.url + path, headers={"authorization": "Bearer sk-beta"}).status_code == 200
    for path in ("/healthz", "/readyz"):
        assert httpx.get(server.url + path).status_code == 200
    ready = httpx.get(server.url + "/readyz").json()
    assert ready == {"status": "ready"}  # no tier names, paths or versions for anonymous callers


def test_rotated_key_is_rejected_within_two_seconds(server: Server, keys_file: Path) -> None:
    assert chat(server.url, "sk-rotating", "rotate").status_code == 200
    keys_file.write_text("sk-rotated:team-rot\nsk-plain\nsk-other\n")
    started = time.monotonic()
    while chat(server.url, "sk-rotating", "rotate").status_code != 401:
        assert time.monotonic() - started < 2.0, "revoked key still accepted"
        time.sleep(0.05)
    assert chat(server.url, "sk-rotated", "rotate").status_code == 200
    # A file that reads but is empty revokes every file key (fail closed); env keys stay.
    keys_file.write_text("")
    started = time.monotonic()
    while chat(server.url, "sk-rotated", "rotate").status_code != 401:
        assert time.monotonic() - started < 2.0
        time.sleep(0.05)
    keys_file.write_text("sk-rotated:team-rot\nsk-plain\nsk-other\n")


def test_x_tenant_is_ignored_unless_trusted() -> None:
    from router.http.auth import Authenticator
    from router.policy.schema import AuthConfig

    strict = Authenticator(AuthConfig(mode="open"), ApiKeys({}))
    assert strict.authenticate({"x-tenant": "acme"}) == Caller(None, None)
    trusted = Authenticator(AuthConfig(mode="open", trust_tenant_header=True), ApiKeys({}))
    assert trusted.authenticate({"x-tenant": "acme"}) == Caller("acme", "acme")
    keyed = Authenticator(AuthConfig(trust_tenant_header=True), ApiKeys({"k1": "t1", "k2": None, "gw": "*"}))
    assert keyed.authenticate({"authorization": "Bearer k1", "x-tenant": "acme"}) == Caller("t1", "t1")
    # Issue 55: a tenant-less key is not a master key - x-tenant does not move it into "acme".
    fp = ApiKeys({"k2": None}).lookup("Bearer k2")
    assert fp is not None
    assert keyed.authenticate({"authorization": "Bearer k2", "x-tenant": "acme"}) == Caller(None, fp[1])
    # Only a gateway key (tenant ``*``) acts for the tenant it names; without one, as itself.
    assert keyed.authenticate({"authorization": "Bearer gw", "x-tenant": "acme"}) == Caller("acme", "acme")
    gw = ApiKeys({"gw": "*"}).lookup("Bearer gw")
    assert gw is not None
    assert keyed.authenticate({"authorization": "Bearer gw"}) == Caller(None, gw[1])
    untrusted = Authenticator(AuthConfig(), ApiKeys({"gw": "*"}))
    assert untrusted.authenticate({"authorization": "Bearer gw", "x-tenant": "acme"}) == Caller(None, gw[1])
    assert keyed.authenticate({"x-tenant": "acme"}) is None


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
        "/METRICS",
        "/metrics/",
        "/healthz/../metrics",
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


def test_the_prefix_cache_is_partitioned_by_tenant(server: Server) -> None:
    def cached_tokens(key: str) -> int:
        body = {
            "model": "large",
            "messages": [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 4}],
            "max_tokens": 2,
        }
        headers = {"authorization": f"Bearer {key}", "cache-control": "no-cache"}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        details = r.json()["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    cached_tokens("sk-e")
    assert cached_tokens("sk-e") > 0  # the prompt's KV is reused within a partition...
    assert cached_tokens("sk-c1") == 0  # ...but never across tenants
    assert cached_tokens("sk-d") == 0


def test_an_unreadable_keys_file_keeps_the_last_good_keys(tmp_path: Path) -> None:
    """A Kubernetes Secret update swaps a symlink: for a moment the path is missing, or reads half
    a file. Catches that blip revoking every key (every request a 401 until the next good read);
    a file that reads and holds no key still revokes them (fail closed)."""
    from router.http.auth import Authenticator
    from router.policy.schema import AuthConfig

    path = tmp_path / "api-keys"
    path.write_text("sk-live:team-a\n")
    auth = Authenticator(AuthConfig(api_keys_file=str(path)), ApiKeys(ApiKeys.parse(path.read_text())))
    live = {"authorization": "Bearer sk-live"}
    assert auth.authenticate(live) == Caller("team-a", "team-a")

    def blip() -> None:
        assert auth.refresh() is False
        assert auth.authenticate(live) == Caller("team-a", "team-a")

    path.unlink()  # the path missing (a dangling symlink mid-swap)
    blip()
    path.mkdir()  # something that is not a file in its place
    blip()
    path.rmdir()
    path.write_bytes(b"sk-\xff\xfe")  # half a write: not UTF-8
    blip()
    path.write_text("sk-new:team-a\n")  # readable again, rotated: the new set replaces the old
    assert auth.refresh() is True
    assert auth.authenticate(live) is None
    assert auth.authenticate({"authorization": "Bearer sk-new"}) == Caller("team-a", "team-a")
    assert auth.refresh() is False  # unchanged: nothing reloaded
    path.write_text("# no keys any more\n")
    assert auth.refresh() is True
    assert auth.authenticate({"authorization": "Bearer sk-new"}) is None


# -- unit: key parsing, sources, fingerprints, tenants (no server) ---------------------------------


def test_unit_keys_parse_every_separator_and_skip_the_rest() -> None:
    parsed = ApiKeys.parse(" a:t1 ,b\n\n# c:x\n  d : t4 \n:orphan\ne:\n f")
    assert parsed == {"a": "t1", "b": None, "d": "t4", "e": None, "f": None}
    keys = ApiKeys(parsed)
    assert len(keys) == 5 and keys.enabled
    assert len(ApiKeys({})) == 0


def test_unit_lookup_checks_scheme_token_and_names_the_key_by_fingerprint() -> None:
    import hashlib

    keys = ApiKeys({"k1": "t1", "k2": None})
    fingerprint = "key-" + hashlib.sha256(b"k2").hexdigest()[:12]
    assert keys.lookup("Bearer k1") == ("t1", "key-" + hashlib.sha256(b"k1").hexdigest()[:12])
    assert keys.lookup("  BEARER   k2  ") == (None, fingerprint)
    for bad in (None, "", "Bearer", "Bearer   ", "Basic k1", "Bearerk1", "k1", "Bearer k3", "Bearer K1"):
        assert keys.lookup(bad) is None, bad
        assert keys.authenticate(bad) is False
    assert keys.authenticate("Bearer k2") is None and keys.authenticate("Bearer k1") == "t1"


def test_unit_keys_load_from_env_and_file_and_each_empty_source_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from router.http.auth import load_entries
    from router.policy.schema import AuthConfig

    path = tmp_path / "keys"
    path.write_text("f1:tf\nshared:from-file\n")
    monkeypatch.setenv("UNIT_KEYS", "e1:te, shared:from-env")
    entries, problems = load_entries(AuthConfig(api_keys_env="UNIT_KEYS", api_keys_file=str(path)))
    assert entries == {"e1": "te", "shared": "from-file", "f1": "tf"} and problems == []
    monkeypatch.setenv("UNIT_KEYS", "")
    path.write_text("# none\n")
    entries, problems = load_entries(AuthConfig(api_keys_env="UNIT_KEYS", api_keys_file=str(path)))
    assert entries == {}
    assert problems == ["$UNIT_KEYS is unset or empty", f"api_keys_file {path} holds no key"]
    monkeypatch.delenv("UNIT_KEYS")
    entries, problems = load_entries(AuthConfig(api_keys_env="UNIT_KEYS", api_keys_file=str(tmp_path / "no")))
    assert (
        entries == {} and problems[1] == f"api_keys_file {tmp_path / 'no'} cannot be read (FileNotFoundError)"
    )
    assert load_entries(AuthConfig()) == (
        {},
        ["neither service.auth.api_keys_env nor service.auth.api_keys_file is set"],
    )


def test_unit_keys_mode_without_a_key_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from router.errors import PolicyError
    from router.http.auth import Authenticator
    from router.policy.loader import parse_policy

    base = "tiers: {small: {model: m}}\nrouting: {rules: [{name: d, tier: small}]}\n"
    monkeypatch.delenv("UNIT_KEYS", raising=False)
    with pytest.raises(PolicyError, match=r"UNIT_KEYS is unset or empty") as err:
        Authenticator.from_policy(parse_policy(base + "service: {auth: {api_keys_env: UNIT_KEYS}}\n"))
    assert "mode: open" in str(err.value)
    monkeypatch.setenv("UNIT_KEYS", "k:t")
    path = tmp_path / "empty"
    path.write_text("")
    auth = Authenticator.from_policy(
        parse_policy(base + f"service: {{auth: {{api_keys_env: UNIT_KEYS, api_keys_file: {path}}}}}\n")
    )
    assert not auth.open and auth.authenticate({"authorization": "Bearer k"}) == Caller("t", "t")
    assert ApiKeys.from_policy(parse_policy(base + "service: {auth: {api_keys_env: UNIT_KEYS}}\n")).enabled
    opened = Authenticator.from_policy(parse_policy(base + "service: {auth: {mode: open}}\n"))
    assert opened.open and not opened.keys.enabled and opened.refresh() is False
    assert opened.authenticate({}) == Caller(None, None)


def test_unit_the_tenant_header_is_trimmed_bounded_and_only_fills_a_gap() -> None:
    from router.http.auth import MAX_TENANT_CHARS, Authenticator
    from router.policy.schema import AuthConfig

    trusted = Authenticator(AuthConfig(mode="open", trust_tenant_header=True), ApiKeys({}))
    assert trusted.authenticate({"x-tenant": "  acme  "}) == Caller("acme", "acme")
    assert trusted.authenticate({"x-tenant": "   "}) == Caller(None, None)
    long = "t" * (MAX_TENANT_CHARS + 10)
    assert trusted.authenticate({"x-tenant": long}) == Caller(
        long[:MAX_TENANT_CHARS], long[:MAX_TENANT_CHARS]
    )
    keyed = Authenticator(AuthConfig(trust_tenant_header=True), ApiKeys({"k2": None}))
    fp = ApiKeys({"k2": None}).lookup("Bearer k2")
    assert fp is not None
    assert keyed.authenticate({"authorization": "Bearer k2"}) == Caller(None, fp[1])  # the key's fingerprint
    untrusted = Authenticator(AuthConfig(), ApiKeys({"k2": None}))
    assert untrusted.authenticate({"authorization": "Bearer k2", "x-tenant": "acme"}) == Caller(None, fp[1])


def test_unit_anthropic_x_api_key_is_the_same_key_and_authorization_wins() -> None:
    from router.http.auth import Authenticator
    from router.policy.schema import AuthConfig

    auth = Authenticator(AuthConfig(), ApiKeys({"k1": "t1", "k2": "t2"}))
    assert auth.authenticate({"x-api-key": "k1"}) == Caller("t1", "t1")
    assert auth.authenticate({"x-api-key": "nope"}) is None
    assert auth.authenticate({"x-api-key": ""}) is None
    assert auth.authenticate({"authorization": "Bearer k2", "x-api-key": "k1"}) == Caller("t2", "t2")
    assert auth.authenticate({"authorization": "Bearer wrong", "x-api-key": "k1"}) is None


def test_unit_refresh_reloads_only_what_changed_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What refresh logs is what an operator sees of a rotation or an outage: the file, the count,
    the reason; an unreadable file is reported once, not on every poll."""
    import logging

    from router.http.auth import Authenticator, load_entries
    from router.policy.schema import AuthConfig

    path = tmp_path / "keys"
    path.write_text("k1:t\nk2\n")
    cfg = AuthConfig(api_keys_file=str(path))
    auth = Authenticator(cfg, ApiKeys(load_entries(cfg)[0]))
    assert auth.source == ""
    assert auth.refresh() is False  # the file it started from: nothing to reload
    caplog.set_level(logging.INFO, logger="router.http.auth")
    path.write_text("k1:t\nk2\nk3\n")
    assert auth.refresh() is True
    assert [r.getMessage() for r in caplog.records] == [f"auth: 3 API key(s) loaded from {path}"]
    caplog.clear()
    path.unlink()
    assert auth.refresh() is False
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, f"auth: api_keys_file {path} cannot be read; keeping the current keys")
    ]
    assert auth.refresh() is False and len(caplog.records) == 1  # reported once, not every poll
    caplog.clear()
    path.write_text("")  # back, but empty: revoked (not mistaken for the unreadable state)
    assert auth.refresh() is True
    assert auth.authenticate({"authorization": "Bearer k1"}) is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, f"auth: {path} holds no key; every request is refused"),
        (logging.INFO, f"auth: 0 API key(s) loaded from {path}"),
    ]
    # An open server never reads a keys file, even one configured.
    path.write_text("k9\n")
    opened = Authenticator(AuthConfig(mode="open", api_keys_file=str(path)), ApiKeys({}))
    path.write_text("k10\n")
    assert opened.refresh() is False and not opened.keys.enabled
    # Keys from the environment alone: no file to re-read, and no problem reported.
    monkeypatch.setenv("UNIT_KEYS", "e1")
    assert load_entries(AuthConfig(api_keys_env="UNIT_KEYS")) == ({"e1": None}, [])
    assert load_entries(AuthConfig(api_keys_file=str(path))) == ({"k10": None}, [])
    assert Authenticator(AuthConfig(api_keys_env="UNIT_KEYS"), ApiKeys({"e1": None})).refresh() is False


def test_unit_starting_without_keys_names_the_policy_and_field(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    import logging

    from router.errors import PolicyError
    from router.http.auth import Authenticator
    from router.policy.loader import parse_policy

    base = "tiers: {small: {model: m}}\nrouting: {rules: [{name: d, tier: small}]}\n"
    monkeypatch.delenv("UNIT_KEYS", raising=False)
    missing = tmp_path / "missing"
    policy = parse_policy(
        base + f"service: {{auth: {{api_keys_env: UNIT_KEYS, api_keys_file: {missing}}}}}\n", source="p.yaml"
    )
    with pytest.raises(PolicyError) as err:
        Authenticator.from_policy(policy)
    assert err.value.source == "p.yaml"
    (issue,) = err.value.issues
    assert issue.path == "service.auth"
    assert issue.message == (
        "mode is 'keys' but no API key could be loaded: $UNIT_KEYS is unset or empty; "
        f"api_keys_file {missing} cannot be read (FileNotFoundError)"
        " (set the keys, or mode: open for a loopback development server)"
    )
    # Both sources configured, one empty: started, the empty one warned about; the source kept.
    monkeypatch.setenv("UNIT_KEYS", "k")
    empty = tmp_path / "empty"
    empty.write_text("")
    caplog.set_level(logging.WARNING, logger="router.http.auth")
    two = parse_policy(
        base + f"service: {{auth: {{api_keys_env: UNIT_KEYS, api_keys_file: {empty}}}}}\n", source="q.yaml"
    )
    auth = Authenticator.from_policy(two)
    assert auth.source == "q.yaml"
    assert [r.getMessage() for r in caplog.records] == [f"auth: api_keys_file {empty} holds no key"]
    opened = Authenticator.from_policy(
        parse_policy(base + "service: {auth: {mode: open}}\n", source="o.yaml")
    )
    assert opened.source == "o.yaml"
