"""Response cache through the service: exact and semantic hits, partitions, what is never cached,
SSE replay, and Redis-backed sharing between two app instances."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

import router.pipeline.cache
from router.openai.request import CallContext, Generation
from router.openai.schemas import ChatCompletionRequest
from router.pipeline.cache import CacheKey, MemoryStore, RedisStore, ResponseCache
from router.policy.decide import Decision
from router.policy.loader import parse_policy
from router.policy.schema import CacheConfig, SemanticCacheConfig
from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, free_port, start_server

CACHE_SERVICE = """
  cache:
    enabled: true
    ttl_s: 60
    max_entries: 100
    backend: {backend}
    redis_url_env: TEST_REDIS_URL
    redis_timeout_s: 0.2
    semantic: {{enabled: true, threshold: 0.9}}
"""


# A model name that goes through the rules and lands on small - unless a rule before it (the
# x-priority header) sends the request to large.
ROUTED_SMALL = """    - name: routed-small
      when: {model: [routed]}
      tier: small
"""


def policy_text(model_dir: Path, backend: str = "memory") -> str:
    # The partition test below sets x-tenant, so this policy trusts the header (as behind a gateway).
    text = tiny_policy_yaml(model_dir, cache_enabled=True, auth="{mode: open, trust_tenant_header: true}")
    text = text.replace(
        "      tier: large\n    - name: score-small",
        "      tier: large\n" + ROUTED_SMALL + "    - name: score-small",
        1,
    )
    # Room for prompts longer than the embedder's 256-token window.
    text = text.replace("max_model_len: 256", "max_model_len: 1024", 1)
    return text.replace("  cache:\n    enabled: true\n", CACHE_SERVICE.format(backend=backend))


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("cache") / "policy.yaml"
    path.write_text(policy_text(tiny_model_dir))
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()


# The tiny random model rarely emits EOS; common stop strings make its answers complete ("stop"),
# and only complete answers are cached.
STOPS = [" ", "e", "a", "o"]


def chat(url: str, content: str, headers: dict[str, str] | None = None, **body: object) -> httpx.Response:
    payload = {
        "model": "small",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 40,
        "temperature": 0,
        "stop": STOPS,
        **body,
    }
    return httpx.post(url + "/v1/chat/completions", json=payload, headers=headers or {}, timeout=30)


def test_exact_hit_returns_the_same_answer_fast(server: Server) -> None:
    first = chat(server.url, "What is the capital of France?")
    assert first.headers["x-router-cache"] == "miss"
    started = time.perf_counter()
    second = chat(server.url, "What is the capital of France?")
    hit_s = time.perf_counter() - started
    assert second.headers["x-router-cache"] == "hit" and second.headers["x-router-cache-kind"] == "exact"
    assert second.json()["choices"] == first.json()["choices"]
    assert second.json()["id"] != first.json()["id"]
    assert second.headers["x-router-tier"] == first.headers["x-router-tier"]
    assert hit_s < 5  # generous; the benchmark measures the real ratio


def test_paraphrase_hits_semantically_and_unrelated_misses(server: Server) -> None:
    chat(server.url, "What is the capital city of France?")
    para = chat(server.url, "Tell me the capital city of France")
    assert para.headers["x-router-cache"] == "hit" and para.headers["x-router-cache-kind"] == "semantic"
    assert float(para.headers["x-router-cache-similarity"]) >= 0.9
    other = chat(server.url, "How do I bake sourdough bread at home?")
    assert other.headers["x-router-cache"] == "miss"


def test_no_hit_across_tenants(server: Server) -> None:
    chat(server.url, "tenant question one", {"x-tenant": "a"})
    assert chat(server.url, "tenant question one", {"x-tenant": "a"}).headers["x-router-cache"] == "hit"
    assert chat(server.url, "tenant question one", {"x-tenant": "b"}).headers["x-router-cache"] == "miss"


def test_a_cached_small_answer_never_answers_a_request_routed_to_large(server: Server) -> None:
    first = chat(server.url, "route me somewhere", model="routed")
    assert first.headers["x-router-tier"] == "small" and first.json()["choices"][0]["finish_reason"] == "stop"
    assert chat(server.url, "route me somewhere", model="routed").headers["x-router-cache"] == "hit"
    high = chat(server.url, "route me somewhere", {"x-priority": "high"}, model="routed")
    assert high.headers["x-router-tier"] == "large" and high.headers["x-router-rule"] == "priority-header"
    assert high.headers["x-router-cache"] == "miss" and high.json()["model"] == "large"


def test_conversations_differing_in_a_trailing_tool_message_do_not_share_an_entry(server: Server) -> None:
    def convo(result: str) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": "What is the weather in Paris today?"},
            {"role": "assistant", "content": "Let me look that up."},
            {"role": "tool", "content": result},
        ]

    first = chat(server.url, "", messages=convo("Sunny, 25 degrees"))
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    assert chat(server.url, "", messages=convo("Sunny, 25 degrees")).headers["x-router-cache"] == "hit"
    other = chat(server.url, "", messages=convo("Heavy rain, 9 degrees"))
    assert other.headers["x-router-cache"] == "miss"
    prefill = chat(
        server.url, "", messages=[*convo("Sunny, 25 degrees")[:1], {"role": "assistant", "content": "It is"}]
    )
    assert prefill.headers["x-router-cache"] == "miss"


def test_prompts_longer_than_the_embedder_window_never_match_semantically(server: Server) -> None:
    prefix = "the quick brown fox jumps over the lazy dog " * 40  # > 256 MiniLM tokens
    first = chat(server.url, prefix + "and then what is the capital of France?")
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    other = chat(server.url, prefix + "and write a haiku about the sea.")
    assert other.headers["x-router-cache"] == "miss"


def test_sampled_requests_are_not_cached(server: Server) -> None:
    chat(server.url, "sampled question", temperature=0.8)
    assert chat(server.url, "sampled question", temperature=0.8).headers["x-router-cache"] == "miss"


def test_no_cache_header_bypasses_lookup_and_store(server: Server) -> None:
    nc = {"cache-control": "no-cache"}
    chat(server.url, "bypass question", nc)
    assert chat(server.url, "bypass question").headers["x-router-cache"] == "miss"
    assert chat(server.url, "bypass question", nc).headers.get("x-router-cache") in ("miss", None)


def test_truncated_answers_are_not_cached(server: Server) -> None:
    first = chat(server.url, "truncate me please", max_tokens=2, ignore_eos=True, stop=None)
    assert first.json()["choices"][0]["finish_reason"] == "length"
    again = chat(server.url, "truncate me please", max_tokens=2, ignore_eos=True, stop=None)
    assert again.headers["x-router-cache"] == "miss"


def test_errored_answers_are_not_cached(server: Server) -> None:
    engine = server.engine("small")
    engine.step_hook = lambda batch: (_ for _ in ()).throw(RuntimeError("boom"))
    try:
        assert chat(server.url, "error question").status_code == 500
    finally:
        engine.step_hook = None
    assert chat(server.url, "error question").headers["x-router-cache"] == "miss"


def test_streaming_is_replayed_as_sse(server: Server) -> None:
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": "stream me"}],
        "max_tokens": 40,
        "temperature": 0,
        "stop": STOPS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def run() -> tuple[list[str], dict[str, str]]:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            return [line for line in r.iter_lines() if line], dict(r.headers)

    live, h1 = run()
    replay, h2 = run()
    assert h1["x-router-cache"] == "miss" and h2["x-router-cache"] == "hit"
    assert h2["content-type"].startswith("text/event-stream")
    assert replay[-1] == "data: [DONE]"

    import json

    def text(lines: list[str]) -> str:
        out = ""
        for line in lines:
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    out += c["delta"].get("content") or ""
        return out

    assert text(replay) == text(live)
    assert '"usage"' in replay[-2]


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (make test installs it)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.mark.redis
def test_redis_shares_exact_entries_between_two_instances(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    os.environ["TEST_REDIS_URL"] = redis_url
    try:
        path = tmp_path / "policy.yaml"
        path.write_text(policy_text(tiny_model_dir, backend="redis"))
        a, stop_a = start_server(path, watch_policy=False)
        b, stop_b = start_server(path, watch_policy=False)
        try:
            first = chat(a.url, "shared across replicas")
            assert first.headers["x-router-cache"] == "miss"
            other = chat(b.url, "shared across replicas")
            assert other.headers["x-router-cache"] == "hit"
            assert other.json()["choices"] == first.json()["choices"]
        finally:
            stop_a()
            stop_b()
    finally:
        os.environ.pop("TEST_REDIS_URL", None)


@pytest.fixture
def redis_server(redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Server]:
    os.environ["TEST_REDIS_URL"] = redis_url
    path = tmp_path / "policy.yaml"
    path.write_text(policy_text(tiny_model_dir, backend="redis"))
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()
    os.environ.pop("TEST_REDIS_URL", None)


@pytest.mark.redis
def test_a_corrupt_redis_value_is_a_miss_not_a_500(redis_server: Server, redis_url: str) -> None:
    import redis

    assert chat(redis_server.url, "corrupt me").headers["x-router-cache"] == "miss"
    assert chat(redis_server.url, "corrupt me").headers["x-router-cache"] == "hit"
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter("tiered-router:cache:*"):
        client.set(key, b"\xff not json {")
    again = chat(redis_server.url, "corrupt me")
    assert again.status_code == 200 and again.headers["x-router-cache"] == "miss"
    client.set(next(iter(client.scan_iter("tiered-router:cache:*"))), b'{"body": 3}')  # JSON, wrong shape
    assert chat(redis_server.url, "corrupt me").status_code == 200


@pytest.mark.redis
def test_a_paused_redis_costs_at_most_its_timeout(redis_server: Server, redis_url: str) -> None:
    import redis

    from tests.router.http.test_reload import metric

    chat(redis_server.url, "warm the connection")
    started = time.perf_counter()
    chat(redis_server.url, "baseline question")
    baseline = time.perf_counter() - started
    pid = int(redis.Redis.from_url(redis_url).info("server")["process_id"])
    os.kill(pid, signal.SIGSTOP)
    try:
        for i in range(3):
            started = time.perf_counter()
            r = chat(redis_server.url, f"while redis sleeps {i}")
            took = time.perf_counter() - started
            assert r.status_code == 200 and r.headers["x-router-cache"] == "miss"
            # lookup + store each bounded by the 0.2 s timeout (x2 for connect + read)
            assert took < baseline + 1.0 + 0.5, (took, baseline)
        assert metric(redis_server.url, "router_cache_errors_total") >= 1
    finally:
        os.kill(pid, signal.SIGCONT)


# -- the cache itself, without a server: expiry and semantic scope ------------------------------------


class FakeClock:
    """Stands in for the ``time`` module inside router/pipeline/cache.py: expiry without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(router.pipeline.cache, "time", fake)
    return fake


class WordEmbedder:
    """A bag-of-words embedding (crc32 buckets, unit norm): equal texts are similarity 1, texts
    sharing most words are close, unrelated ones far - what the semantic path needs, without a model."""

    def __init__(self) -> None:
        self.calls = 0

    def sees_whole(self, text: str) -> bool:
        return len(text) < 500

    def embed(self, text: str) -> np.ndarray:
        import zlib

        self.calls += 1
        v = np.zeros(256, dtype=np.float32)
        for word in text.lower().replace("?", " ").split():
            v[zlib.crc32(word.encode()) % 256] += 1.0
        return v / np.linalg.norm(v)


POLICY = parse_policy("tiers: {small: {model: m}}\nrouting: {rules: [{name: d, tier: small}]}\n")
DECISION = Decision("small", "d", "rule d", 0.25)


def chat_gen(messages: list[dict[str, str]]) -> Generation:
    req = msgspec.convert({"model": "auto", "messages": messages, "temperature": 0}, ChatCompletionRequest)
    return Generation("chat", req, messages, None, False, False, last_user=messages[-1]["content"])


def answer(text: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}


def semantic_cache(ttl_s: float = 60.0) -> tuple[ResponseCache, WordEmbedder]:
    embedder = WordEmbedder()
    cfg = CacheConfig(ttl_s=ttl_s, semantic=SemanticCacheConfig(enabled=True, threshold=0.8))
    return ResponseCache(cfg, MemoryStore(100), embedder), embedder  # type: ignore[arg-type]


def conversation(place: str, question: str) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"I am planning a week in {place}."},
        {"role": "assistant", "content": f"{place} is lovely; what would you like to know?"},
        {"role": "user", "content": question},
    ]


async def test_semantic_scope_covers_the_earlier_turns() -> None:
    """Two conversations of one tenant that end in the same question are different questions.
    Catches a semantic scope built without the earlier turns: the Rome answer served for Oslo."""
    cache, embedder = semantic_cache()
    ctx = CallContext({}, tenant="acme")
    rome = cache.key(chat_gen(conversation("Rome", "What should I pack for the trip?")), ctx, "small", POLICY)
    assert rome is not None and rome.scope is not None
    await cache.store(rome, answer("Sandals."), DECISION)
    oslo = cache.key(chat_gen(conversation("Oslo", "What should I pack for the trip?")), ctx, "small", POLICY)
    assert oslo is not None and oslo.scope != rome.scope
    assert await cache.lookup(oslo) is None
    # The same conversation, its last question reworded: a semantic hit (the path really ran).
    calls = embedder.calls
    reworded = conversation("Rome", "What should I pack for this trip?")
    hit = await cache.lookup(cache.key(chat_gen(reworded), ctx, "small", POLICY))  # type: ignore[arg-type]
    assert hit is not None and hit.kind == "semantic" and 0.8 <= hit.similarity < 1.0
    assert hit.body == answer("Sandals.") and embedder.calls == calls + 1
    # ...but never another tenant's, with the very same conversation.
    other = cache.key(chat_gen(reworded), CallContext({}, tenant="globex"), "small", POLICY)
    assert other is not None and await cache.lookup(other) is None


async def test_memory_store_entries_expire_at_their_ttl(clock: FakeClock) -> None:
    """Catches a memory store that never expires entries (an answer served long past ttl_s)."""
    store = MemoryStore(10)
    await store.set("a", {"v": 1}, ttl_s=30.0)
    clock.now += 29.9
    assert await store.get("a") == {"v": 1}
    clock.now += 0.2
    assert await store.get("a") is None
    assert len(store) == 0  # dropped, not just hidden
    await store.set("b", {"v": 2}, ttl_s=5.0)
    await store.set("b", {"v": 3}, ttl_s=50.0)  # a new value restarts the clock
    clock.now += 10.0
    assert await store.get("b") == {"v": 3}


async def test_memory_store_is_bounded_least_recently_used_first(clock: FakeClock) -> None:
    store = MemoryStore(2)
    await store.set("a", {"v": 1}, 60.0)
    await store.set("b", {"v": 2}, 60.0)
    assert await store.get("a") == {"v": 1}  # a is now the most recent
    await store.set("c", {"v": 3}, 60.0)
    assert await store.get("b") is None and await store.get("a") == {"v": 1} and len(store) == 2


async def test_exact_and_semantic_entries_expire_with_the_ttl(clock: FakeClock) -> None:
    cache, _ = semantic_cache(ttl_s=60.0)
    ctx = CallContext({}, tenant="acme")
    key = cache.key(
        chat_gen(conversation("Rome", "Where should I eat dinner near the old town tonight?")),
        ctx,
        "small",
        POLICY,
    )
    assert key is not None
    await cache.store(key, answer("Trastevere."), DECISION)
    reworded = cache.key(
        chat_gen(conversation("Rome", "Where should we eat dinner near the old town tonight?")),
        ctx,
        "small",
        POLICY,
    )
    assert reworded is not None
    clock.now += 59.0
    hit = await cache.lookup(key)
    assert hit is not None and hit.kind == "exact"
    semantic = await cache.lookup(reworded)
    assert semantic is not None and semantic.kind == "semantic"
    clock.now += 2.0
    assert await cache.lookup(key) is None
    assert await cache.lookup(reworded) is None
    assert len(cache._semantic) == 0  # the expired row was dropped from its scope


@pytest.mark.redis
async def test_redis_entries_carry_the_ttl_and_expire(redis_url: str) -> None:
    """Catches the shared store losing the TTL (entries living forever in Redis) or a wrong unit."""
    import redis.asyncio as aioredis

    store = RedisStore(redis_url, prefix="ttl-test:", timeout_s=2.0)
    client = aioredis.from_url(redis_url)
    try:
        await store.set("long", {"v": 1}, ttl_s=60.0)
        assert 59_000 < await client.pttl("ttl-test:long") <= 60_000
        assert await store.get("long") == {"v": 1}
        await store.set("short", {"v": 2}, ttl_s=0.05)
        assert 0 < await client.pttl("ttl-test:short") <= 50
        deadline = time.monotonic() + 10
        while await store.get("short") is not None:  # Redis expires it on its own clock
            assert time.monotonic() < deadline, "a 50 ms entry outlived 10 s"
        assert await client.exists("ttl-test:short") == 0
    finally:
        await client.delete("ttl-test:long")
        await client.aclose()
        await store.aclose()


class Counted:
    """A stand-in for the service's telemetry: counts what the cache reports, records span attributes."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.attrs: dict[str, object] = {}

    def _inc(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    @property
    def cache_misses(self) -> Counted._Metric:
        return Counted._Metric(self, "miss")

    @property
    def cache_hits(self) -> Counted._Metric:
        return Counted._Metric(self, "hit")

    @property
    def cache_errors(self) -> Counted._Metric:
        return Counted._Metric(self, "error")

    def span(self, name: str, parent: object = None) -> object:
        import contextlib

        outer = self

        class Span:
            def set_attribute(self, key: str, value: object) -> None:
                outer.attrs[key] = value

        assert name == "cache.lookup"
        return contextlib.nullcontext(Span())

    class _Metric:
        def __init__(self, owner: Counted, name: str) -> None:
            self.owner, self.name = owner, name

        def labels(self, label: str) -> Counted._Metric:
            return Counted._Metric(self.owner, f"{self.name}:{label}")

        def inc(self) -> None:
            self.owner._inc(self.name)


def request_gen(body: dict[str, object]) -> Generation:
    body = {"model": "auto", "temperature": 0, **body}
    if "prompt" in body:
        from router.openai.schemas import CompletionRequest

        req = msgspec.convert(body, CompletionRequest)
        return Generation("completion", req, None, str(body["prompt"]), False, False)
    messages = body["messages"]
    assert isinstance(messages, list)
    return Generation("chat", msgspec.convert(body, ChatCompletionRequest), messages, None, False, False)


HI = [{"role": "user", "content": "What is the tallest mountain in the world?"}]


def test_the_exact_key_covers_what_changes_the_answer_and_nothing_else() -> None:
    cache, _ = semantic_cache()
    ctx = CallContext({}, tenant="acme")

    def key(**body: object) -> str:
        k = cache.key(request_gen({"messages": HI, **body}), ctx, "small", POLICY)
        assert k is not None
        return k.exact

    base = key()
    # Transport fields and the requested model name do not change the answer.
    assert key(stream=True) == key(user="u1") == key(model="small") == key(metadata={"a": "b"}) == base
    assert key(max_tokens=5) != base and key(stop=["x"]) != base and key(seed=3) != base
    assert key(messages=[{"role": "system", "content": "Be brief."}, *HI]) != base
    other_tier = parse_policy("tiers: {small: {model: other}}\nrouting: {rules: [{name: d, tier: small}]}\n")
    k = cache.key(request_gen({"messages": HI}), ctx, "small", other_tier)
    assert k is not None and k.exact != base  # the tier's model is part of the key
    k = cache.key(request_gen({"messages": HI}), CallContext({}, tenant="globex"), "small", POLICY)
    assert k is not None and k.exact != base and k.scope is not None
    completion = cache.key(request_gen({"prompt": HI[0]["content"]}), ctx, "small", POLICY)
    assert completion is not None and completion.exact != base and completion.scope is not None
    assert completion.text == HI[0]["content"]


def test_what_is_cached_and_what_gets_a_semantic_scope() -> None:
    cache, _ = semantic_cache()
    ctx = CallContext({}, tenant="acme")
    assert cache.key(request_gen({"messages": HI, "temperature": 0.7}), ctx, "small", POLICY) is None
    assert cache.key(request_gen({"messages": HI, "temperature": 0.7, "top_k": 1}), ctx, "small", POLICY)
    sampled = ResponseCache(CacheConfig(cache_sampled=True), MemoryStore(4))
    assert sampled.key(request_gen({"messages": HI, "temperature": 0.7}), ctx, "small", POLICY) is not None
    tool_last = [*HI, {"role": "assistant", "content": "Everest."}]
    k = cache.key(request_gen({"messages": tool_last}), ctx, "small", POLICY)
    assert k is not None and k.scope is None  # an assistant prefill: exact only
    blank = cache.key(request_gen({"messages": [{"role": "user", "content": "   "}]}), ctx, "small", POLICY)
    assert blank is not None and blank.scope is None
    long = cache.key(
        request_gen({"messages": [{"role": "user", "content": "word " * 200}]}), ctx, "small", POLICY
    )
    assert long is not None and long.scope is None  # past the embedder's window
    plain = ResponseCache(CacheConfig(), MemoryStore(4))  # semantic off: no scope, no embedder needed
    k = plain.key(request_gen({"messages": HI}), ctx, "small", POLICY)
    assert k is not None and k.scope is None and k.text == ""
    off = ResponseCache(
        CacheConfig(semantic=SemanticCacheConfig(enabled=False)), MemoryStore(4), WordEmbedder()
    )  # type: ignore[arg-type]
    k = off.key(request_gen({"messages": HI}), ctx, "small", POLICY)
    assert k is not None and k.scope is None


async def test_lookups_report_hits_misses_and_never_serve_a_broken_entry() -> None:
    telemetry = Counted()
    embedder = WordEmbedder()
    cfg = CacheConfig(ttl_s=60.0, semantic=SemanticCacheConfig(enabled=True, threshold=0.8))
    store = MemoryStore(100)
    cache = ResponseCache(cfg, store, embedder, telemetry)  # type: ignore[arg-type]
    ctx = CallContext({}, tenant="acme")
    key = cache.key(request_gen({"messages": HI}), ctx, "small", POLICY)
    assert key is not None
    assert await cache.lookup(key) is None
    assert telemetry.counts == {"miss": 1} and telemetry.attrs == {"router.cache": "miss"}
    await cache.store(key, answer("Everest."), Decision("small", "d", "why", 0.123456))
    hit = await cache.lookup(key)
    assert hit is not None and (hit.tier, hit.rule, hit.score, hit.kind, hit.similarity) == (
        "small",
        "d",
        "0.1235",
        "exact",
        1.0,
    )
    assert telemetry.counts == {"miss": 1, "hit:exact": 1}
    assert telemetry.attrs == {
        "router.cache": "hit",
        "router.cache.kind": "exact",
        "router.cache.similarity": 1.0,
    }
    reworded = [{"role": "user", "content": "What is the tallest mountain in the whole world?"}]
    near = cache.key(request_gen({"messages": reworded}), ctx, "small", POLICY)
    assert near is not None
    hit = await cache.lookup(near)
    assert hit is not None and hit.kind == "semantic" and telemetry.counts["hit:semantic"] == 1
    assert (
        telemetry.attrs["router.cache.kind"] == "semantic"
        and 0.8 <= float(telemetry.attrs["router.cache.similarity"]) < 1
    )  # type: ignore[arg-type]
    # Broken entries (another version, a corrupt store) are misses, exact and semantic alike.
    for broken in ({"body": {"choices": []}, "tier": "small", "rule": "d", "score": "1"}, {"body": 3}, ["x"]):
        store._data[key.exact] = (float("inf"), broken)  # type: ignore[assignment]
        assert await cache.lookup(key) is None
        assert await cache.lookup(near) is None
    assert await cache.lookup(CacheKey(key.exact + "x", None, "")) is None  # no scope: exact only


def test_the_semantic_index_is_bounded_and_replaces_a_key() -> None:
    from router.pipeline.cache import SemanticIndex

    index = SemanticIndex(3)
    e = np.eye(4, dtype=np.float32)
    for i, key in enumerate("abcd"):
        index.add("s", key, e[i], expires=10.0)
    assert len(index) == 3 and index.best("s", e[0], 0.5, 0.0) is None  # a, the oldest, went
    assert index.best("s", e[3], 0.5, 0.0) == ("d", 1.0)
    index.add("s", "b", e[0], expires=10.0)  # b again: replaced, not duplicated
    assert len(index) == 3 and index.best("s", e[1], 0.5, 0.0) is None
    assert index.best("s", e[0], 0.5, 0.0) == ("b", 1.0)
    assert index.best("t", e[0], 0.5, 0.0) is None  # another scope
    assert index.best("s", (e[0] + e[2]) / np.sqrt(2), 0.8, 0.0) is None  # below the threshold
    assert index.best("s", e[2], 1.0, 10.0) == ("c", 1.0)  # at its expiry: still live
    assert index.best("s", e[2], 0.5, 10.5) is None and len(index) == 0  # past it: all dropped
    for i in range(20):  # grows past its first 8 rows
        index.add("s", f"k{i}", e[i % 4], expires=100.0)
    assert len(index) == 3 and index.best("s", e[19 % 4], 0.9, 0.0) == ("k19", 1.0)


def test_build_cache_picks_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    from router.pipeline.cache import build_cache

    def policy(cache: str) -> object:
        return parse_policy(
            "tiers: {small: {model: m}}\nrouting: {rules: [{name: d, tier: small}]}\n"
            f"service: {{cache: {cache}}}\n"
        )

    assert build_cache(policy("{enabled: false}")) is None  # type: ignore[arg-type]
    memory = build_cache(policy("{enabled: true, max_entries: 7}"))  # type: ignore[arg-type]
    assert memory is not None and isinstance(memory.backend, MemoryStore) and memory.backend.max_entries == 7
    assert memory.embedder is None
    monkeypatch.delenv("UNIT_REDIS", raising=False)
    fallback = build_cache(policy("{backend: redis, redis_url_env: UNIT_REDIS}"))  # type: ignore[arg-type]
    assert fallback is not None and isinstance(fallback.backend, MemoryStore)
    monkeypatch.setenv("UNIT_REDIS", "redis://127.0.0.1:1/0")
    shared = build_cache(policy("{backend: redis, redis_url_env: UNIT_REDIS, redis_timeout_s: 0.3}"))  # type: ignore[arg-type]
    assert shared is not None and isinstance(shared.backend, RedisStore) and shared.backend.timeout_s == 0.3
    from router.pipeline import embedder

    monkeypatch.setattr(embedder.Embedder, "load", classmethod(lambda cls: WordEmbedder()))
    semantic = build_cache(policy("{semantic: {enabled: true}}"))  # type: ignore[arg-type]
    assert semantic is not None and isinstance(semantic.embedder, WordEmbedder)


async def test_an_unreachable_redis_is_a_counted_miss_then_skipped(clock: FakeClock) -> None:
    telemetry = Counted()
    store = RedisStore("redis://127.0.0.1:1/0", timeout_s=0.5, backoff_s=2.0, telemetry=telemetry)  # type: ignore[arg-type]
    assert await store.get("k") is None
    assert telemetry.counts == {"error:get": 1}
    await store.set("k", {"v": 1}, 10.0)
    assert await store.get("k") is None  # within the backoff: Redis not even tried
    assert telemetry.counts == {"error:get": 1}
    clock.now += 2.5
    await store.set("k", {"v": 1}, 10.0)
    assert telemetry.counts == {"error:get": 1, "error:set": 1}
    await store.aclose()  # closing a dead connection does not raise


@pytest.mark.redis
async def test_undecodable_redis_values_are_counted_misses(redis_url: str) -> None:
    import redis.asyncio as aioredis

    telemetry = Counted()
    store = RedisStore(redis_url, prefix="decode-test:", timeout_s=2.0, telemetry=telemetry)  # type: ignore[arg-type]
    client = aioredis.from_url(redis_url)
    try:
        await client.set("decode-test:bad", b"\xff{")
        await client.set("decode-test:list", b"[1, 2]")
        assert await store.get("bad") is None and telemetry.counts == {"error:decode": 1}
        assert await store.get("list") is None and telemetry.counts == {"error:decode": 1}
        assert await store.get("absent") is None
    finally:
        await client.delete("decode-test:bad", "decode-test:list")
        await client.aclose()
        await store.aclose()
