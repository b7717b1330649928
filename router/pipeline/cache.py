"""Response cache, looked up *after* the routing decision: exact match, then semantic match.

- Exact: a sha256 over everything that changes the answer: the tier the policy chose and that
  tier's model configuration (weights, quantization, generation defaults), the whole request as
  parsed (every message with its role and fields, every sampling, tool or format option) apart
  from transport fields (``stream``, ``stream_options``, ``user``) and the requested ``model``
  name (the decision already says which model answers), partitioned by the caller
  (``CallContext.partition``: its tenant, else its key's fingerprint: two keys without a tenant
  never see each other's answers).
- Semantic: an embedding of the final user message (all-MiniLM-L6-v2, see ``router.pipeline.embedder``)
  compared by cosine similarity only inside the same scope: same partition, tier, request shape and
  every earlier message. A conversation whose last message is not the user's (a tool result, an
  assistant prefill) never matches semantically, and neither does a prompt longer than the
  embedder's window (it would be compared on its truncated head).

Only deterministic requests (temperature 0, unless ``cache_sampled``) are cached; errors,
truncated answers (finish_reason ``length``) and answers from a load fallback never are. Streamed
answers are stored once complete and served back as a proper SSE stream. A store that fails
(Redis down or stalled past its timeout) is a miss, counted in ``router_cache_errors_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from router.pipeline.calls import CachedAnswer
from router.pipeline.embedder import MAX_TOKENS

if TYPE_CHECKING:
    import numpy as np

    from router.openai.request import CallContext, Generation
    from router.pipeline.embedder import Embedder
    from router.policy.decide import Decision
    from router.policy.schema import CacheConfig, Policy, TierConfig
    from router.telemetry import Telemetry

__all__ = ["CacheKey", "MemoryStore", "RedisStore", "ResponseCache", "SemanticIndex", "build_cache"]

log = logging.getLogger(__name__)

# Request fields that do not change the answer: how it is delivered, who asked, and the model name
# (the decision, which is part of the key, says which model answers).
_TRANSPORT_FIELDS = frozenset({"stream", "stream_options", "user", "model", "metadata", "store"})


class Store(Protocol):
    async def get(self, key: str) -> dict[str, Any] | None: ...
    async def set(self, key: str, value: dict[str, Any], ttl_s: float) -> None: ...
    async def aclose(self) -> None: ...


class MemoryStore:
    """In-process LRU with per-entry expiry."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._data: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    async def get(self, key: str) -> dict[str, Any] | None:
        item = self._data.get(key)
        if item is None:
            return None
        expires, value = item
        if expires < time.monotonic():
            del self._data[key]
            return None
        self._data.move_to_end(key)
        return value

    async def set(self, key: str, value: dict[str, Any], ttl_s: float) -> None:
        self._data[key] = (time.monotonic() + ttl_s, value)
        self._data.move_to_end(key)
        while len(self._data) > self.max_entries:
            self._data.popitem(last=False)

    async def aclose(self) -> None:
        self._data.clear()


class RedisStore:
    """Exact-match entries shared by every replica through Redis (JSON values, native TTL).

    Every call is bounded by ``timeout_s`` (connect and socket): a partitioned or stalled Redis
    costs a request at most that long, and after a failure Redis is skipped for ``backoff_s`` so
    the requests behind it do not each pay the timeout again.
    """

    def __init__(
        self,
        url: str,
        prefix: str = "tiered-router:cache:",
        *,
        timeout_s: float = 0.25,
        backoff_s: float = 2.0,
        telemetry: Telemetry | None = None,
    ) -> None:
        import redis.asyncio as redis

        self._client = redis.from_url(
            url,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.telemetry = telemetry
        self._skip_until = 0.0

    def _failed(self, op: str, exc: BaseException) -> None:
        # The cache is an optimization: an outage is a miss, logged once per backoff window.
        if time.monotonic() >= self._skip_until:
            log.warning("redis cache %s failed (%s); treating as a miss for %.0fs", op, exc, self.backoff_s)
        self._skip_until = time.monotonic() + self.backoff_s
        if self.telemetry is not None:
            self.telemetry.cache_errors.labels(op).inc()

    async def get(self, key: str) -> dict[str, Any] | None:
        if time.monotonic() < self._skip_until:
            return None
        try:
            # The client's socket timeout covers reads; wait_for also covers a stalled connect
            # handshake or a connection-pool wait.
            raw = await asyncio.wait_for(self._client.get(self.prefix + key), self.timeout_s * 2)
        except Exception as exc:
            self._failed("get", exc)
            return None
        if raw is None:
            return None
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            self._failed("decode", exc)
            return None
        return value if isinstance(value, dict) else None

    async def set(self, key: str, value: dict[str, Any], ttl_s: float) -> None:
        if time.monotonic() < self._skip_until:
            return
        try:
            await asyncio.wait_for(
                self._client.set(self.prefix + key, json.dumps(value), px=max(1, int(ttl_s * 1000))),
                self.timeout_s * 2,
            )
        except Exception as exc:
            self._failed("set", exc)

    async def aclose(self) -> None:
        try:
            await asyncio.wait_for(self._client.aclose(), self.timeout_s * 2)
        except Exception as exc:  # closing a dead connection must not fail shutdown or a reload
            log.debug("redis close: %s", exc)


class SemanticIndex:
    """Embeddings by scope, one float32 matrix per scope: a lookup is one matrix-vector product
    over its own scope's rows (0.5 ms at 10,000 rows of 384), never a scan of every entry.

    At most ``max_entries`` rows in all (the least recently stored go first); a row past its
    expiry never matches and is dropped when its scope is next searched. Thread-safe: lookups run
    in a worker thread beside stores on the event loop."""

    def __init__(self, max_entries: int) -> None:
        import numpy as np

        self.max_entries = max_entries
        self._np = np
        self._order: OrderedDict[str, str] = OrderedDict()  # exact key -> scope, oldest first
        self._scopes: dict[str, _ScopeRows] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._order)

    def add(self, scope: str, key: str, vector: np.ndarray, expires: float) -> None:
        with self._lock:
            if key in self._order:
                self._remove(key)
            rows = self._scopes.get(scope)
            if rows is None:
                rows = self._scopes[scope] = _ScopeRows(self._np, vector.shape[-1])
            rows.add(key, vector, expires)
            self._order[key] = scope
            while len(self._order) > self.max_entries:
                self._remove(next(iter(self._order)))

    def _remove(self, key: str) -> None:
        scope = self._order.pop(key)
        rows = self._scopes[scope]
        rows.remove(key)
        if not rows.keys:
            del self._scopes[scope]

    def best(self, scope: str, vector: np.ndarray, threshold: float, now: float) -> tuple[str, float] | None:
        """The most similar live row of ``scope`` at or above ``threshold``: ``(key, similarity)``."""
        with self._lock:
            rows = self._scopes.get(scope)
            if rows is None:
                return None
            for key in rows.expired(now):
                self._remove(key)
            if scope not in self._scopes:
                return None
            return rows.best(vector, threshold)


class _ScopeRows:
    """One scope's rows: a matrix grown by doubling, removal by moving the last row into the hole."""

    def __init__(self, np: Any, dim: int) -> None:
        self._np = np
        self.matrix = np.zeros((8, dim), dtype=np.float32)
        self.expires = np.zeros(8, dtype=np.float64)
        self.keys: list[str] = []
        self._row: dict[str, int] = {}

    def add(self, key: str, vector: np.ndarray, expires: float) -> None:
        n = len(self.keys)
        if n == self.matrix.shape[0]:
            self.matrix = self._np.concatenate([self.matrix, self._np.zeros_like(self.matrix)])
            self.expires = self._np.concatenate([self.expires, self._np.zeros_like(self.expires)])
        self.matrix[n] = vector
        self.expires[n] = expires
        self.keys.append(key)
        self._row[key] = n

    def remove(self, key: str) -> None:
        i = self._row.pop(key)
        last = len(self.keys) - 1
        if i != last:
            moved = self.keys[last]
            self.matrix[i] = self.matrix[last]
            self.expires[i] = self.expires[last]
            self.keys[i] = moved
            self._row[moved] = i
        self.keys.pop()

    def expired(self, now: float) -> list[str]:
        n = len(self.keys)
        return [self.keys[i] for i in self._np.flatnonzero(self.expires[:n] < now)]

    def best(self, vector: np.ndarray, threshold: float) -> tuple[str, float] | None:
        n = len(self.keys)
        sims = self.matrix[:n] @ vector.astype(self._np.float32, copy=False)
        i = int(sims.argmax())
        sim = float(sims[i])
        return (self.keys[i], sim) if sim >= threshold else None


@dataclass(frozen=True, slots=True)
class CacheKey:
    """Where one decided request's answer lives."""

    exact: str
    scope: str | None
    """Semantic scope (tenant, tier, shape, earlier messages), or None: no semantic match."""
    text: str = ""
    """The final user message the semantic match compares."""


def tier_identity(name: str, cfg: TierConfig) -> list[Any]:
    """The tier's answer-changing configuration: a policy edit to any of it starts fresh entries."""
    from router.backends.base import engine_key

    defaults = cfg.defaults
    return [name, list(engine_key(cfg)), defaults.max_tokens, defaults.temperature, defaults.top_p]


def _valid_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("body"), dict)
        and all(isinstance(entry.get(k), str) for k in ("tier", "rule", "score"))
        and isinstance(entry["body"].get("choices"), list)
        and bool(entry["body"]["choices"])
    )


class ResponseCache:
    def __init__(
        self,
        config: CacheConfig,
        store: Store,
        embedder: Embedder | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.config = config
        self.backend = store
        self.embedder = embedder
        self.telemetry = telemetry
        self._semantic = SemanticIndex(config.max_entries)

    # -- keys ----------------------------------------------------------------------------------
    def cacheable(self, gen: Generation) -> bool:
        req = gen.request
        if self.config.cache_sampled:
            return True
        return req.temperature == 0.0 or req.top_k == 1

    def key(self, gen: Generation, ctx: CallContext, tier: str, policy: Policy) -> CacheKey | None:
        """The key of ``gen`` as decided (``tier``) under ``policy``, or None when not cacheable."""
        if not self.cacheable(gen):
            return None
        fields = {k: v for k, v in msgspec.to_builtins(gen.request).items() if k not in _TRANSPORT_FIELDS}
        content_field = "messages" if gen.kind == "chat" else "prompt"
        content = fields.pop(content_field, None)
        head = [ctx.partition, tier_identity(tier, policy.tiers[tier]), gen.kind, fields]
        exact = _digest([*head, content])
        scope = None
        text = ""
        if self._semantic_on():
            if gen.kind == "chat" and gen.messages and gen.messages[-1]["role"] == "user":
                text = gen.messages[-1]["content"]
                earlier = content[:-1] if isinstance(content, list) else None
                scope = _digest([*head, "semantic", earlier])
            elif gen.kind == "completion" and gen.prompt:
                text = gen.prompt
                scope = _digest([*head, "semantic"])
            assert self.embedder is not None
            # Each word is at least one token: past MAX_TOKENS words the text cannot fit, and a
            # long prompt is not tokenized on the event loop only to learn that.
            too_long = len(text) > MAX_TOKENS and len(text.split(maxsplit=MAX_TOKENS)) > MAX_TOKENS
            if scope is not None and (too_long or not text.strip() or not self.embedder.sees_whole(text)):
                scope = None  # a truncated embedding would match prompts sharing only a prefix
        return CacheKey(exact, scope, text)

    def _semantic_on(self) -> bool:
        return self.config.semantic.enabled and self.embedder is not None

    # -- lookup / store ------------------------------------------------------------------------
    async def lookup(self, key: CacheKey, parent: Any = None) -> CachedAnswer | None:
        telemetry = self.telemetry
        span_cm = telemetry.span("cache.lookup", parent=parent) if telemetry is not None else None
        with span_cm if span_cm is not None else contextlib.nullcontext() as span:
            entry = await self.backend.get(key.exact)
            kind = "exact"
            similarity = 1.0
            if not _valid_entry(entry):
                entry = None
            if entry is None and key.scope is not None:
                found = await self._semantic_lookup(key)
                if found is not None:
                    exact, similarity = found
                    entry = await self.backend.get(exact)
                    entry = entry if _valid_entry(entry) else None
                    kind = "semantic"
            if span is not None:
                span.set_attribute("router.cache", "hit" if entry else "miss")
            if entry is None:
                if telemetry is not None:
                    telemetry.cache_misses.inc()
                return None
            if span is not None:
                span.set_attribute("router.cache.kind", kind)
                span.set_attribute("router.cache.similarity", similarity)
        if telemetry is not None:
            telemetry.cache_hits.labels(kind).inc()
        return CachedAnswer(entry["body"], entry["tier"], entry["rule"], entry["score"], kind, similarity)

    async def _semantic_lookup(self, key: CacheKey) -> tuple[str, float] | None:
        return await asyncio.to_thread(self._semantic_search, key)

    def _semantic_search(self, key: CacheKey) -> tuple[str, float] | None:
        """Embed and search (a worker thread: both grow with the request and the cache)."""
        assert self.embedder is not None
        assert key.scope is not None
        vec = self.embedder.embed(key.text)
        return self._semantic.best(key.scope, vec, self.config.semantic.threshold, time.monotonic())

    async def store(self, key: CacheKey, body: dict[str, Any], decision: Decision) -> None:
        entry = {"body": body, "tier": decision.tier, "rule": decision.rule, "score": f"{decision.score:.4f}"}
        await self.backend.set(key.exact, entry, self.config.ttl_s)
        if key.scope is not None and self.embedder is not None:
            vec = await asyncio.to_thread(self.embedder.embed, key.text)
            self._semantic.add(key.scope, key.exact, vec, time.monotonic() + self.config.ttl_s)

    async def aclose(self) -> None:
        await self.backend.aclose()


def _digest(parts: list[Any]) -> str:
    raw = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(raw.encode()).hexdigest()


def build_cache(policy: Policy, telemetry: Telemetry | None = None) -> ResponseCache | None:
    cfg = policy.service.cache
    if not cfg.enabled:
        return None
    store: Store
    if cfg.backend == "redis":
        url = os.environ.get(cfg.redis_url_env)
        if not url:
            log.error(
                "cache backend is redis but $%s is unset; using the in-process store", cfg.redis_url_env
            )
            store = MemoryStore(cfg.max_entries)
        else:
            store = RedisStore(url, timeout_s=cfg.redis_timeout_s, telemetry=telemetry)
    else:
        store = MemoryStore(cfg.max_entries)
    embedder = None
    if cfg.semantic.enabled:
        from router.pipeline.embedder import Embedder

        embedder = Embedder.load()
    return ResponseCache(cfg, store, embedder, telemetry)
