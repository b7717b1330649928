"""Issue 37: no caller can read, steer or poison what belongs to another, and every API endpoint
counts against the caller's limit. Each test names the hole it closes; each failed on the code
before the fix (partitions by optional tenant name, unlimited /v1/route, feedback from anyone)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, start_server

KEYS_ENV = "TEST_ISOLATION_KEYS"
TENANTS = """tenants:
  team-x: {allowed_tiers: [small, medium]}
  team-y: {allowed_tiers: [small, medium], rate_limit_rpm: 1000}
  team-r: {rate_limit_rpm: 3}
  team-t: {rate_limit_tpm: 100}
routing:
"""


@pytest.fixture(scope="module")
def feedback_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("feedback") / "feedback.jsonl"


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, feedback_log: Path
) -> Iterator[Server]:
    # Two keys without a tenant, a tenant the policy caps, one it does not name, one rate limited.
    os.environ[KEYS_ENV] = "sk-a, sk-b, sk-x:team-x, sk-ghost:ghost, sk-r:team-r, sk-t:team-t"
    path = tmp_path_factory.mktemp("isolation") / "policy.yaml"
    text = tiny_policy_yaml(
        tiny_model_dir,
        cache_enabled=True,
        auth=f"{{mode: keys, api_keys_env: {KEYS_ENV}}}",
        service_extra=f"  feedback: {{log_path: {feedback_log}}}\n",
    ).replace("routing:\n", TENANTS, 1)
    path.write_text(text)
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()
    os.environ.pop(KEYS_ENV, None)


def _post(server: Server, key: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(
        server.url + path, json=body, headers={"authorization": f"Bearer {key}", **headers}, timeout=60
    )


def _chat(server: Server, key: str, content: str, **extra: Any) -> httpx.Response:
    headers = extra.pop("headers", {})
    body = {"model": "small", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    body.update(extra)
    return _post(server, key, "/v1/chat/completions", body, **headers)


def test_tenantless_keys_do_not_share_cached_answers(server: Server) -> None:
    """Bug: the cache scoped entries by ``tenant or "-"``, so key B got key A's answer (and learnt
    what A asked) from ``x-router-cache: hit``."""
    # Stop strings make the tiny model's answer complete ("stop"): only complete answers are cached.
    ask = {"temperature": 0, "max_tokens": 40, "stop": [" ", "e", "a", "o"]}
    first = _chat(server, "sk-a", "what does key A ask about privately?", **ask)
    assert first.status_code == 200 and first.headers["x-router-cache"] == "miss"
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    other = _chat(server, "sk-b", "what does key A ask about privately?", **ask)
    assert other.status_code == 200 and other.headers["x-router-cache"] == "miss"
    again = _chat(server, "sk-a", "what does key A ask about privately?", **ask)
    assert again.headers["x-router-cache"] == "hit"  # the cache itself is on: A's own entry
    assert again.json()["choices"] == first.json()["choices"]


def test_tenantless_keys_do_not_share_sessions(server: Server) -> None:
    """Bug: sessions used scope ``t:-`` for every tenant-less key, so key B could find (and steer)
    key A's conversation by its session id."""
    sid = {"x-session-id": "shared-looking-id"}
    first = _chat(server, "sk-a", "hello", headers={**sid, "x-priority": "high"}, model="auto")
    assert first.headers["x-router-tier"] == "large"
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}
    own = _post(server, "sk-a", "/v1/route", body, **sid).json()
    assert own["rule"].startswith("session:") and own["tier"] == "large"
    stranger = _post(server, "sk-b", "/v1/route", body, **sid).json()
    assert not stranger["rule"].startswith("session:")
    assert stranger["tier"] != "large"


def test_tenantless_keys_do_not_share_the_prefix_cache(server: Server) -> None:
    """Bug: the prefix-cache salt was the tenant or ``""``, so key B's prompt was served from the
    KV key A's identical prompt had warmed (and B could time A's prompts)."""
    prompt = " ".join(f"word{i}" for i in range(25))
    nc = {"cache-control": "no-cache"}

    def cached(key: str, text: str) -> int:
        r = _chat(server, key, text, headers=nc)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    cached("sk-a", prompt)
    # What B's own earlier prompts share with any new prompt (the chat template's head).
    cached("sk-b", " ".join(f"other{i}" for i in range(25)))
    baseline = cached("sk-b", " ".join(f"third{i}" for i in range(25)))
    other = cached("sk-b", prompt)
    own = cached("sk-a", prompt)
    assert other <= baseline + 1, (other, baseline)
    assert own > other + 20  # the cache works: A's own repeat is served from A's KV


def test_a_tenant_missing_from_the_policy_gets_default_caps_not_all_tiers(server: Server) -> None:
    """Bug: a key's tenant absent from ``policy.tenants`` had no ``allowed_tiers`` cap at all (a typo
    in the key file failed open). Here every named tenant with caps shares small+medium."""
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}
    ghost = _post(server, "sk-ghost", "/v1/route", body, **{"x-priority": "high"}).json()
    assert (ghost["tier"], ghost["capped"]) == ("medium", True)
    named = _post(server, "sk-x", "/v1/route", body, **{"x-priority": "high"}).json()
    assert (named["tier"], named["capped"]) == ("medium", True)
    tenantless = _post(server, "sk-a", "/v1/route", body, **{"x-priority": "high"}).json()
    assert tenantless["tier"] == "large"  # a key without a tenant is not a tenant with a typo


def test_route_endpoint_counts_against_the_callers_rate_limit(server: Server) -> None:
    """Bug: /v1/route classified for free, past the caller's limit (6 x 200 at 3 rpm)."""
    body = {"model": "auto", "prompt": "hi"}
    codes = [_post(server, "sk-r", "/v1/route", body).status_code for _ in range(4)]
    assert codes[:3] == [200, 200, 200]
    last = _post(server, "sk-r", "/v1/route", body)
    assert last.status_code == 429 and float(last.headers["retry-after"]) >= 1
    assert last.json()["error"]["type"] == "rate_limit_error"
    assert _post(server, "sk-a", "/v1/route", body).status_code == 200  # others are unaffected


def _lines(path: Path, rid: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [row for row in map(json.loads, path.read_text().splitlines()) if row["id"] == rid]


def test_feedback_only_from_the_caller_that_got_the_answer_and_bounded(
    server: Server, feedback_log: Path
) -> None:
    """Bugs: any caller could score any answer (another key's thumbs-down was 200), and the same
    score posted again appended a line each time (1,000 lines for one id)."""
    served = _chat(server, "sk-a", "rate me", headers={"cache-control": "no-cache"})
    rid = served.headers["x-router-response-id"]
    foreign = _post(server, "sk-b", "/v1/feedback", {"id": rid, "thumbs": "down"})
    assert foreign.status_code == 404 and foreign.json()["error"]["code"] == "unknown_response_id"
    assert _lines(feedback_log, rid) == []
    for _ in range(3):  # the same score again is accepted and writes nothing
        ok = _post(server, "sk-a", "/v1/feedback", {"id": rid, "thumbs": "up"})
        assert ok.status_code == 200, ok.text
    assert [r["outcomes"] for r in _lines(feedback_log, rid)] == [{"small": 1.0}]
    assert _lines(feedback_log, rid)[0]["partition"].startswith("k:key-")
    codes = [
        _post(server, "sk-a", "/v1/feedback", {"id": rid, "score": s}).status_code for s in (0.1, 0.2, 0.3)
    ]
    assert codes == [200, 200, 200]  # a changed mind replaces the score (later line wins)
    closed = _post(server, "sk-a", "/v1/feedback", {"id": rid, "score": 0.4})
    assert closed.status_code == 409 and closed.json()["error"]["code"] == "feedback_closed"
    assert len(_lines(feedback_log, rid)) == 4


def test_feedback_counts_against_the_callers_rate_limit(server: Server) -> None:
    """Bug: /v1/feedback was not rate limited at all."""
    body = {"id": "chatcmpl-unknown", "score": 1}
    codes = {_post(server, "sk-r", "/v1/feedback", body).status_code for _ in range(4)}
    assert 429 in codes


@pytest.mark.parametrize(
    ("change", "param", "code"),
    [
        # Bug: "²".isdigit() is true, int("²") raises: a 500.
        ({"logit_bias": {"²": 1}}, "logit_bias", None),
        # Bug: no cap on entries; a whole-vocabulary dict cost ~55 ms per row per step for everyone.
        ({"logit_bias": {str(i): 1.0 for i in range(49152)}}, "logit_bias", "limit_exceeded"),
        (
            {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
            "tools",
            "limit_exceeded",
        ),
    ],
    ids=["superscript-digit", "whole-vocabulary", "129-tools"],
)
def test_client_sized_inputs_are_400s_naming_the_field(
    server: Server, change: dict[str, Any], param: str, code: str | None
) -> None:
    r = _chat(server, "sk-a", "bounded", **change)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code and "service.limits." in err["message"]


def test_a_5000_property_schema_is_a_400_before_any_compilation(server: Server) -> None:
    """Bug: a 5,000-property ``json_schema`` was compiled inline on the event loop (2.8 s during
    which every stream and probe stalled); now it is refused by size before any work."""
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string"} for i in range(5000)},
        "required": [],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    r = _chat(server, "sk-a", "json please", response_format=fmt)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("response_format.json_schema.schema", "limit_exceeded")
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}
    r = _chat(server, "sk-a", "json please", response_format=fmt)
    assert r.status_code == 400 and "max_schema_depth" in r.json()["error"]["message"]
    # Under the node bound, but wider than the grammar parser can follow: it compiled, then the
    # first generated token passed llguidance's row limit, a 500 "grammar rejected a sampled token".
    wide = {"type": "object", "properties": {f"q{i}": {"type": "string"} for i in range(600)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": wide}}
    r = _chat(server, "sk-a", "json please", response_format=fmt, max_tokens=8)
    assert r.status_code == 400, r.text
    assert "max_schema_properties" in r.json()["error"]["message"]
    # Few nodes, one huge pattern: a 100,000-character regex would be compiled into the grammar
    # before the first token; it is counted in characters (service.limits.max_schema_chars).
    pattern = {"type": "object", "properties": {"s": {"type": "string", "pattern": "a" * 100_000}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "pat", "schema": pattern}}
    r = _chat(server, "sk-a", "json please", response_format=fmt, max_tokens=2)
    assert r.status_code == 400, r.text
    assert "max_schema_chars" in r.json()["error"]["message"]


def test_tokens_per_minute_count_prompt_plus_n_times_max_tokens(server: Server) -> None:
    """Bug: limits counted requests only: an n=16, 256-token request cost the same as a 1-token
    one. ``rate_limit_tpm: 100``: 60 tokens pass, 60 more do not, 1 more does."""
    nc = {"cache-control": "no-cache"}
    assert _chat(server, "sk-t", "hi", max_tokens=60, headers=nc).status_code == 200
    over = _chat(server, "sk-t", "hi", max_tokens=60, headers=nc)
    assert over.status_code == 429, over.text
    assert over.json()["error"]["code"] == "tokens_per_minute_exceeded"
    assert float(over.headers["retry-after"]) >= 1
    assert _chat(server, "sk-t", "hi", max_tokens=1, headers=nc).status_code == 200
    wide = _chat(server, "sk-t", "hi", max_tokens=10, n=16, headers=nc)
    assert wide.status_code == 429  # 160 tokens: more than the bucket holds now
