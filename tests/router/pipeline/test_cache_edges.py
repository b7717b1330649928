"""The response cache's edges without a server or a Redis: the Redis store against a recording
client, key scopes, expiry at the instant, and build_cache's wiring.

Written against the survivors of ``make mutation`` on ``router/pipeline/cache.py``: each test
names the broken code it catches; expected values are stated by hand.
"""

from __future__ import annotations

import json
import logging
import zlib
from typing import Any

import msgspec
import numpy as np
import pytest

import router.pipeline.cache as cache_module
from router.openai.request import CallContext, Generation
from router.openai.schemas import ChatCompletionRequest, CompletionRequest
from router.pipeline.cache import CacheKey, MemoryStore, RedisStore, ResponseCache, build_cache
from router.policy.decide import Decision
from router.policy.loader import parse_policy
from router.policy.schema import CacheConfig, SemanticCacheConfig

POLICY = parse_policy(
    "tiers: {small: {model: m}, medium: {model: m}}\nrouting: {rules: [{name: d, tier: small}]}\n"
)
DECISION = Decision("small", "d", "rule d", 0.25)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Words:
    """Bag-of-words unit vectors: equal texts are similarity 1 (no model needed)."""

    def __init__(self) -> None:
        self.calls = 0

    def sees_whole(self, text: str) -> bool:
        return True

    def embed(self, text: str) -> np.ndarray:
        self.calls += 1
        v = np.zeros(64, dtype=np.float32)
        for word in text.lower().split():
            v[zlib.crc32(word.encode()) % 64] += 1.0
        return v / np.linalg.norm(v)


class Recorder:
    """Stands in for redis.asyncio's client: records calls, fails on demand."""

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}
        self.url = ""
        self.data: dict[str, Any] = {}
        self.set_calls: list[tuple[str, str, int]] = []
        self.closed = False
        self.fail: Exception | None = None

    async def get(self, key: str) -> Any:
        if self.fail is not None:
            raise self.fail
        return self.data.get(key)

    async def set(self, key: str, value: str, px: int) -> None:
        if self.fail is not None:
            raise self.fail
        self.set_calls.append((key, value, px))

    async def aclose(self) -> None:
        if self.fail is not None:
            raise self.fail
        self.closed = True


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    import redis.asyncio

    rec = Recorder()

    def from_url(url: str, **kwargs: Any) -> Recorder:
        rec.url, rec.kwargs = url, kwargs
        return rec

    monkeypatch.setattr(redis.asyncio, "from_url", from_url)
    return rec


class Counted:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.parents: list[object] = []

    @property
    def cache_errors(self) -> Any:
        outer = self

        class Labels:
            def labels(self, op: str) -> Any:
                class Inc:
                    def inc(self) -> None:
                        outer.errors.append(op)

                return Inc()

        return Labels()

    @property
    def cache_misses(self) -> Any:
        class Inc:
            def inc(self) -> None:
                pass

        return Inc()

    def span(self, name: str, parent: object = None) -> Any:
        import contextlib

        self.parents.append(parent)
        return contextlib.nullcontext(None)


def test_redis_client_fails_fast_under_the_documented_names(client: Recorder) -> None:
    """Catches the client built with retries, health checks or without the socket timeouts (a
    stalled Redis would then hold requests past redis_timeout_s), and a changed key namespace."""
    store = RedisStore("redis://cache:6379/0", timeout_s=0.3)
    assert client.url == "redis://cache:6379/0"
    assert client.kwargs == {
        "socket_connect_timeout": 0.3,
        "socket_timeout": 0.3,
        "retry_on_timeout": False,
        "health_check_interval": 0,
    }
    assert store.prefix == "tiered-router:cache:"
    default = RedisStore("redis://cache:6379/0")
    assert (default.timeout_s, default.backoff_s) == (0.25, 2.0)


async def test_redis_values_round_trip_with_a_ttl_of_at_least_a_millisecond(client: Recorder) -> None:
    """Catches the TTL floor (px) raised or the prefix dropped, and non-object JSON served."""
    store = RedisStore("redis://cache/0")
    await store.set("k", {"v": 1}, 0.0004)
    assert client.set_calls == [("tiered-router:cache:k", '{"v": 1}', 1)]
    await store.set("k", {"v": 1}, 2.5)
    assert client.set_calls[-1][2] == 2500
    client.data["tiered-router:cache:k"] = json.dumps({"v": 2})
    assert await store.get("k") == {"v": 2}
    client.data["tiered-router:cache:k"] = json.dumps([1, 2])
    assert await store.get("k") is None


async def test_redis_failures_are_logged_with_their_operation_and_cause(
    client: Recorder, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches the warning losing which operation failed or why (the operator's only clue)."""
    clock = Clock()
    monkeypatch.setattr(cache_module, "time", clock)
    telemetry = Counted()
    store = RedisStore("redis://cache/0", backoff_s=2.0, telemetry=telemetry)  # type: ignore[arg-type]
    client.fail = ConnectionError("connection refused")
    with caplog.at_level(logging.WARNING, logger="router.pipeline.cache"):
        assert await store.get("k") is None
    assert [r.getMessage() for r in caplog.records] == [
        "redis cache get failed (connection refused); treating as a miss for 2s"
    ]
    clock.now += 2.0  # the backoff window has passed (it ends at its last instant)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="router.pipeline.cache"):
        await store.set("k", {"v": 1}, 1.0)
    assert "redis cache set failed (connection refused)" in caplog.text
    client.fail = None
    clock.now += 2.0
    client.data["tiered-router:cache:k"] = b"\xff not json"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="router.pipeline.cache"):
        assert await store.get("k") is None
    assert caplog.records[-1].getMessage().startswith("redis cache decode failed ('utf-8' codec can't decode")
    assert telemetry.errors == ["get", "set", "decode"]


async def test_closing_redis_closes_the_client_and_never_raises(
    client: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """Catches aclose() that never awaits the client's close (a leaked connection per reload) and
    a close failure that escapes or is logged without its cause."""
    store = RedisStore("redis://cache/0")
    await store.aclose()
    assert client.closed
    client.fail = OSError("broken pipe")
    with caplog.at_level(logging.DEBUG, logger="router.pipeline.cache"):
        await store.aclose()
    assert [r.getMessage() for r in caplog.records] == ["redis close: broken pipe"]


async def test_a_memory_entry_is_live_through_its_expiry_instant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches ``<=`` for ``<`` on expiry: an entry stored for 10 s answers at exactly 10 s."""
    clock = Clock()
    monkeypatch.setattr(cache_module, "time", clock)
    store = MemoryStore(4)
    await store.set("k", {"v": 1}, 10.0)
    clock.now += 10.0
    assert await store.get("k") == {"v": 1}
    clock.now += 0.001
    assert await store.get("k") is None


def _chat(messages: list[dict[str, Any]], **body: Any) -> Generation:
    req = msgspec.convert(
        {"model": "auto", "messages": messages, "temperature": 0, **body}, ChatCompletionRequest
    )
    return Generation("chat", req, messages, None, False, False, last_user=messages[-1]["content"])


def _completion(prompt: str, **body: Any) -> Generation:
    req = msgspec.convert({"model": "auto", "prompt": prompt, "temperature": 0, **body}, CompletionRequest)
    return Generation("completion", req, None, prompt, False, False)


def _semantic(embedder: Words | None = None) -> ResponseCache:
    cfg = CacheConfig(ttl_s=60.0, semantic=SemanticCacheConfig(enabled=True, threshold=0.8))
    return ResponseCache(cfg, MemoryStore(100), embedder or Words())  # type: ignore[arg-type]


CTX = CallContext({}, tenant="acme")


def test_keys_ignore_json_object_key_order() -> None:
    """Catches the digest without sorted keys: the same tool schema sent with its properties in
    another order (any two SDKs) would never hit."""
    cache = _semantic()
    ask = [{"role": "user", "content": "weather in Paris?"}]

    def tool(props: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "function": {"name": "w", "parameters": {"type": "object", "properties": props}},
            }
        ]

    a = cache.key(
        _chat(ask, tools=tool({"city": {"type": "string"}, "unit": {"type": "string"}})), CTX, "small", POLICY
    )
    b = cache.key(
        _chat(ask, tools=tool({"unit": {"type": "string"}, "city": {"type": "string"}})), CTX, "small", POLICY
    )
    assert a is not None and b is not None and a.exact == b.exact


def test_two_tiers_with_one_configuration_never_share_entries() -> None:
    """Catches the tier's name left out of its identity: small's answer would serve medium."""
    cache = _semantic()
    gen = _chat([{"role": "user", "content": "hello"}])
    small, medium = cache.key(gen, CTX, "small", POLICY), cache.key(gen, CTX, "medium", POLICY)
    assert small is not None and medium is not None
    assert small.exact != medium.exact and small.scope != medium.scope


def test_semantic_scopes_of_conversations_and_completions() -> None:
    """Catches a chat scope that drops the assistant's last turn, and a completion scope that
    holds the prompt itself (paraphrases never meet) or nothing at all (tenants would meet)."""
    cache = _semantic()
    first = [
        {"role": "user", "content": "plan a trip"},
        {"role": "assistant", "content": "Where to?"},
        {"role": "user", "content": "somewhere warm"},
    ]
    other_reply = [first[0], {"role": "assistant", "content": "When?"}, first[2]]
    a, b = cache.key(_chat(first), CTX, "small", POLICY), cache.key(_chat(other_reply), CTX, "small", POLICY)
    assert a is not None and b is not None and a.scope is not None and a.scope != b.scope
    p1 = cache.key(_completion("the capital of France is"), CTX, "small", POLICY)
    p2 = cache.key(_completion("France's capital city is"), CTX, "small", POLICY)
    assert p1 is not None and p2 is not None and p1.scope is not None
    assert p1.scope == p2.scope and p1.exact != p2.exact
    other_tenant = cache.key(
        _completion("the capital of France is"), CallContext({}, tenant="zeta"), "small", POLICY
    )
    assert other_tenant is not None and other_tenant.scope != p1.scope


async def test_storing_without_a_semantic_scope_embeds_nothing() -> None:
    """Catches store() embedding every answer when only the embedder is set (a wasted model call
    per answer, and rows under a None scope)."""
    words = Words()
    cache = _semantic(words)
    await cache.store(CacheKey("exact-only", None, "text"), {"choices": [{"index": 0}]}, DECISION)
    assert words.calls == 0


async def test_lookup_spans_hang_under_the_callers_span() -> None:
    """Catches the cache.lookup span started without its parent (a detached span in Jaeger)."""
    telemetry = Counted()
    cfg = CacheConfig(ttl_s=60.0)
    cache = ResponseCache(cfg, MemoryStore(4), None, telemetry)  # type: ignore[arg-type]
    parent = object()
    assert await cache.lookup(CacheKey("nothing", None), parent=parent) is None
    assert telemetry.parents == [parent]


async def test_build_cache_wires_limits_telemetry_and_names_a_missing_env(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, client: Recorder
) -> None:
    """Catches the Redis fallback store built unbounded, the error naming no variable, and the
    telemetry not handed to the Redis store or the cache (errors and hits uncounted)."""

    def policy(cache: str) -> Any:
        return parse_policy(
            "tiers: {small: {model: m}}\nrouting: {rules: [{name: d, tier: small}]}\n"
            f"service: {{cache: {cache}}}\n"
        )

    monkeypatch.delenv("EDGE_REDIS_URL", raising=False)
    with caplog.at_level(logging.ERROR, logger="router.pipeline.cache"):
        fallback = build_cache(policy("{backend: redis, redis_url_env: EDGE_REDIS_URL, max_entries: 2}"))
    assert [r.getMessage() for r in caplog.records] == [
        "cache backend is redis but $EDGE_REDIS_URL is unset; using the in-process store"
    ]
    assert fallback is not None and isinstance(fallback.backend, MemoryStore)
    for k in ("a", "b", "c"):
        await fallback.backend.set(k, {"v": k}, 60.0)
    assert len(fallback.backend) == 2
    telemetry = Counted()
    monkeypatch.setenv("EDGE_REDIS_URL", "redis://cache/0")
    shared = build_cache(policy("{backend: redis, redis_url_env: EDGE_REDIS_URL}"), telemetry)  # type: ignore[arg-type]
    assert shared is not None and isinstance(shared.backend, RedisStore)
    assert shared.backend.telemetry is telemetry and shared.telemetry is telemetry


def test_the_semantic_scope_is_dropped_only_past_the_embedders_window_in_words() -> None:
    """Catches the word-count guard off, made inclusive, or applied on characters alone: a prompt
    of more words than the embedder's window never matches semantically (its embedding would be
    of a truncated head), one of exactly that many, or of long words, still does."""
    from router.pipeline.embedder import MAX_TOKENS

    cache = _semantic()

    def scope(text: str) -> str | None:
        key = cache.key(_chat([{"role": "user", "content": text}]), CTX, "small", POLICY)
        assert key is not None
        return key.scope

    assert scope(" ".join(["w"] * (MAX_TOKENS + 1))) is None
    assert scope(" ".join(["w"] * MAX_TOKENS)) is not None
    assert scope(" ".join(["antidisestablishmentarianism"] * 20)) is not None  # > MAX_TOKENS chars
