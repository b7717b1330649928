"""Response cache, checked before classification: exact match, then semantic match.

- Exact: a sha256 over the normalized request (messages or prompt, requested model, every sampling
  parameter that changes the output), partitioned by tenant and by policy version.
- Semantic: an embedding of the last user turn (all-MiniLM-L6-v2, see ``router.embedder``)
  compared by cosine similarity within the same partition and the same request shape; a hit
  needs ``service.cache.semantic.threshold``.

Only deterministic requests (temperature 0, unless ``cache_sampled``) are cached; errors and
truncated answers (finish_reason ``length``) never are. Streamed answers are stored once complete
and served back as a proper SSE stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from router.schemas import completion_id, now
from router.sse import replay

if TYPE_CHECKING:
    import numpy as np

    from router.embedder import Embedder
    from router.policy.decide import Decision
    from router.policy.schema import CacheConfig, Policy
    from router.service import CallContext, Completion, RouterService, _Gen

__all__ = ["MemoryStore", "RedisStore", "ResponseCache", "build_cache"]

log = logging.getLogger(__name__)


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
    """Exact-match entries shared by every replica through Redis (JSON values, native TTL)."""

    def __init__(self, url: str, prefix: str = "tiered-router:cache:") -> None:
        import redis.asyncio as redis

        self._client = redis.from_url(url)
        self.prefix = prefix

    async def get(self, key: str) -> dict[str, Any] | None:
        try:
            raw = await self._client.get(self.prefix + key)
        except Exception as exc:  # the cache is an optimization: a Redis outage is a miss
            log.warning("redis cache get failed: %s", exc)
            return None
        return None if raw is None else json.loads(raw)

    async def set(self, key: str, value: dict[str, Any], ttl_s: float) -> None:
        try:
            await self._client.set(self.prefix + key, json.dumps(value), px=max(1, int(ttl_s * 1000)))
        except Exception as exc:
            log.warning("redis cache set failed: %s", exc)

    async def aclose(self) -> None:
        await self._client.aclose()


@dataclass(slots=True)
class _SemanticEntry:
    vector: np.ndarray
    partition: str
    key: str
    expires: float


class ResponseCache:
    def __init__(self, config: CacheConfig, store: Store, embedder: Embedder | None = None) -> None:
        self.config = config
        self.backend = store
        self.embedder = embedder
        self._semantic: OrderedDict[str, _SemanticEntry] = OrderedDict()

    # -- keys ----------------------------------------------------------------------------------
    def cacheable(self, gen: _Gen) -> bool:
        req = gen.request
        if self.config.cache_sampled:
            return True
        return req.temperature == 0.0 or req.top_k == 1

    @staticmethod
    def _partition(ctx: CallContext, policy: Policy) -> str:
        return f"{ctx.tenant or '-'}|{policy.digest[:16]}"

    @staticmethod
    def _shape(gen: _Gen) -> dict[str, Any]:
        """Everything but the conversation content that changes the answer."""
        req = gen.request
        fields = (
            "model",
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "stop",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "ignore_eos",
        )
        shape = {f: getattr(req, f, None) for f in fields}
        shape["max_completion_tokens"] = getattr(req, "max_completion_tokens", None)
        shape["kind"] = gen.kind
        return shape

    def _key(self, gen: _Gen, partition: str) -> str:
        content = gen.messages if gen.messages is not None else gen.prompt
        raw = json.dumps([partition, self._shape(gen), content], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(raw.encode()).hexdigest()

    def _semantic_scope(self, gen: _Gen, partition: str) -> str:
        """Semantic hits must agree on everything but the last user turn's wording."""
        earlier = gen.messages[:-1] if gen.messages else []
        raw = json.dumps([partition, self._shape(gen), earlier], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(raw.encode()).hexdigest()

    # -- lookup / store ------------------------------------------------------------------------
    async def lookup(self, gen: _Gen, ctx: CallContext, service: RouterService) -> Completion | None:
        if not self.cacheable(gen):
            return None
        telemetry = service.telemetry
        with telemetry.span("cache.lookup", parent=ctx.span) as span:
            partition = self._partition(ctx, service.policy)
            entry = await self.backend.get(self._key(gen, partition))
            kind = "exact"
            similarity = 1.0
            if entry is None and self._semantic_enabled(gen):
                found = await self._semantic_lookup(gen, partition)
                if found is not None:
                    key, similarity = found
                    entry = await self.backend.get(key)
                    kind = "semantic"
            span.set_attribute("router.cache", "hit" if entry else "miss")
            if entry is None:
                telemetry.cache_misses.inc()
                return None
            span.set_attribute("router.cache.kind", kind)
            span.set_attribute("router.cache.similarity", similarity)
        telemetry.cache_hits.labels(kind).inc()
        telemetry.requests.labels(gen.kind, entry["tier"], entry["rule"], "cache_hit").inc()
        headers = {
            "x-router-tier": entry["tier"],
            "x-router-score": entry["score"],
            "x-router-rule": entry["rule"],
            "x-router-cache": "hit",
            "x-router-cache-kind": kind,
        }
        if kind == "semantic":
            headers["x-router-cache-similarity"] = f"{similarity:.4f}"
        from router.service import Completion

        body = dict(
            entry["body"], id=completion_id("chatcmpl" if gen.kind == "chat" else "cmpl"), created=now()
        )
        if gen.stream:
            return Completion(headers, stream=replay(gen.kind, body, gen.include_usage))
        return Completion(headers, body=body)

    def _semantic_enabled(self, gen: _Gen) -> bool:
        return self.config.semantic.enabled and self.embedder is not None and bool(gen.last_user.strip())

    async def _semantic_lookup(self, gen: _Gen, partition: str) -> tuple[str, float] | None:
        assert self.embedder is not None
        scope = self._semantic_scope(gen, partition)
        vec = await asyncio.to_thread(self.embedder.embed, gen.last_user)
        best: tuple[str, float] | None = None
        t = time.monotonic()
        for entry in list(self._semantic.values()):
            if entry.expires < t or entry.partition != scope:
                continue
            sim = float(entry.vector @ vec)
            if sim >= self.config.semantic.threshold and (best is None or sim > best[1]):
                best = (entry.key, sim)
        return best

    async def store(
        self,
        gen: _Gen,
        ctx: CallContext,
        policy: Policy,
        body: dict[str, Any],
        decision: Decision,
        usage: dict[str, Any],
    ) -> None:
        if not self.cacheable(gen):
            return
        partition = self._partition(ctx, policy)
        key = self._key(gen, partition)
        entry = {"body": body, "tier": decision.tier, "rule": decision.rule, "score": f"{decision.score:.4f}"}
        await self.backend.set(key, entry, self.config.ttl_s)
        if self._semantic_enabled(gen):
            assert self.embedder is not None
            vec = await asyncio.to_thread(self.embedder.embed, gen.last_user)
            self._semantic[key] = _SemanticEntry(
                vec, self._semantic_scope(gen, partition), key, time.monotonic() + self.config.ttl_s
            )
            self._semantic.move_to_end(key)
            while len(self._semantic) > self.config.max_entries:
                self._semantic.popitem(last=False)

    async def aclose(self) -> None:
        await self.backend.aclose()


def build_cache(policy: Policy) -> ResponseCache | None:
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
            store = RedisStore(url)
    else:
        store = MemoryStore(cfg.max_entries)
    embedder = None
    if cfg.semantic.enabled:
        from router.embedder import Embedder

        embedder = Embedder.load()
    return ResponseCache(cfg, store, embedder)
