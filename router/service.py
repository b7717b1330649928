"""One request, end to end: classify -> decide -> cache (keyed on the decision) -> submit -> stream
or collect.

``RouterService`` holds the live state (policy, tiers, classifier, cache, telemetry); the HTTP
layer (``router.app``) only parses, authenticates and turns results into responses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from router.backends import LocalTier, RemoteBackend, TierSet
from router.calls import CachedAnswer, CallContext, Completion, Generation, Routed
from router.errors import BadRequestError, OverloadedError, RateLimitError, UnavailableError
from router.policy.decide import Decision, RouteRequest, decide
from router.responses import RETRY_AFTER_S, InFlight, ResponseWriter
from router.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_id,
    message_text,
    now,
    stop_list,
    validate_sampling,
)
from router.sse import replay
from tiers.engine import EngineFullError
from tiers.output import StepOutput
from tiers.sequence import SamplingParams

if TYPE_CHECKING:
    from classifier import ComplexityClassifier
    from router.cache import CacheKey, ResponseCache
    from router.policy.schema import Policy
    from router.telemetry import Telemetry

__all__ = ["CallContext", "Completion", "RouterService"]

log = logging.getLogger(__name__)

_Gen = Generation  # the name before request types moved to router.calls


class TenantLimiter:
    """Per-tenant token buckets (``tenants.<name>.rate_limit_rpm``)."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}

    def check(self, tenant: str, rpm: int) -> float | None:
        """None when allowed; otherwise the seconds until a request would be."""
        t = time.monotonic()
        tokens, last = self._buckets.get(tenant, (float(rpm), t))
        tokens = min(float(rpm), tokens + (t - last) * rpm / 60.0)
        if tokens < 1.0:
            self._buckets[tenant] = (tokens, t)
            return (1.0 - tokens) * 60.0 / rpm
        self._buckets[tenant] = (tokens - 1.0, t)
        return None


class RouterService:
    def __init__(
        self,
        policy: Policy,
        classifier: ComplexityClassifier,
        telemetry: Telemetry,
        tiers: TierSet | None = None,
        cache: ResponseCache | None = None,
    ) -> None:
        self.policy = policy
        self.classifier = classifier
        self.telemetry = telemetry
        self.tiers = tiers
        self.cache = cache
        self.draining = False
        self.limiter = TenantLimiter()
        self._in_flight = InFlight()
        self.writer = ResponseWriter(telemetry, self._in_flight)

    @property
    def in_flight(self) -> int:
        return self._in_flight.count

    # -- readiness -----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.tiers is not None and self.tiers.ready and not self.draining

    def _require_tiers(self) -> TierSet:
        if self.draining:
            raise UnavailableError("The server is shutting down.", code="draining", retry_after=RETRY_AFTER_S)
        if self.tiers is None or not self.tiers.ready:
            raise UnavailableError("Models are still loading.", code="not_ready", retry_after=5.0)
        return self.tiers

    def model_names(self) -> list[str]:
        return self.policy.model_names

    # -- routing -------------------------------------------------------------------------------
    def route(
        self, ctx: CallContext, model: str, messages: list[dict[str, str]] | None, prompt: str | None
    ) -> Routed:
        policy = self.policy  # one snapshot for the whole request (hot reload swaps the attribute)
        with self.telemetry.span("classify", parent=ctx.span) as span:
            started = time.perf_counter()
            if messages is not None:
                score = self.classifier.score_messages(
                    messages, context_chars=policy.service.classifier.context_chars
                )
            else:
                score = self.classifier.score(prompt or "")
            classify_s = time.perf_counter() - started
            span.set_attribute("router.score", score.value)
            span.set_attribute("router.predicted", score.tier)
        self.telemetry.classifier_latency.observe(classify_s)
        with self.telemetry.span("policy.decide", parent=ctx.span) as span:
            prompt_tokens = self._count_tokens(policy, messages, prompt)
            load = self.tiers.load_map() if self.tiers is not None else {}
            request = RouteRequest(
                model=model, headers=ctx.headers, tenant=ctx.tenant, prompt_tokens=prompt_tokens
            )
            decision = decide(policy, request, score, load)
            span.set_attribute("router.tier", decision.tier)
            span.set_attribute("router.rule", decision.rule)
            span.set_attribute("router.reason", decision.reason)
            span.set_attribute("router.policy", policy.digest[:12])
        self.telemetry.route_decisions.labels(decision.tier, decision.rule).inc()
        return Routed(decision, score, prompt_tokens, classify_s * 1000, policy)

    def _count_tokens(self, policy: Policy, messages: list[dict[str, str]] | None, prompt: str | None) -> int:
        """Prompt tokens for the ``prompt_tokens_*`` rules: exact when a rule could turn on it.

        A byte-level BPE token covers at least one UTF-8 byte, so a text of N bytes has at most N
        tokens; below the smallest threshold any rule uses, tokenizing cannot change the decision
        and the (cheap) byte count is used instead.
        """
        text = (prompt if messages is None else "\n".join(m["content"] for m in messages)) or ""
        thresholds = [
            t
            for r in policy.routing.rules
            if r.when is not None
            for t in (r.when.prompt_tokens_above, r.when.prompt_tokens_at_most)
            if t is not None
        ]
        upper_bound = len(text.encode("utf-8", "surrogatepass"))
        tok = self.tiers.counting_tokenizer() if self.tiers is not None else None
        if not thresholds or tok is None or upper_bound <= min(thresholds):
            return min(upper_bound, max(1, len(text) // 4)) if thresholds else len(text) // 4
        return len(tok.encode(text, add_special_tokens=False))

    def route_info(
        self, ctx: CallContext, model: str, messages: list[dict[str, str]] | None, prompt: str | None
    ) -> dict[str, Any]:
        routed = self.route(ctx, model, messages, prompt)
        d, s = routed.decision, routed.score
        return {
            "tier": d.tier,
            "rule": d.rule,
            "reason": d.reason,
            "score": round(s.value, 4),
            "predicted": s.tier,
            "probabilities": {k: round(v, 4) for k, v in s.probabilities.items()},
            "escalated": d.escalated,
            "capped": d.capped,
            "fallback_from": d.fallback_from,
            "rejected": d.rejected,
            "prompt_tokens": routed.prompt_tokens,
            "classify_ms": round(routed.classify_ms, 3),
            "policy": self.policy.digest[:12],
        }

    # -- generation ----------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, ctx: CallContext) -> Completion:
        validate_sampling(req)
        if not req.messages:
            raise BadRequestError("'messages' must contain at least one message.", param="messages")
        if req.logprobs:
            raise BadRequestError(
                "logprobs are not supported by this server.", param="logprobs", code="unsupported_value"
            )
        messages = [{"role": m.role, "content": message_text(m.content)} for m in req.messages]
        last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        gen = Generation(
            "chat",
            req,
            messages,
            None,
            bool(req.stream),
            bool(req.stream_options and req.stream_options.include_usage),
            last_user=last_user,
        )
        return await self._generate(gen, ctx)

    async def complete(self, req: CompletionRequest, ctx: CallContext) -> Completion:
        validate_sampling(req)
        if isinstance(req.prompt, list):
            if len(req.prompt) != 1:
                raise BadRequestError(
                    "Only a single prompt per request is supported.", param="prompt", code="unsupported_value"
                )
            prompt = req.prompt[0]
        else:
            prompt = req.prompt
        if req.logprobs:
            raise BadRequestError(
                "logprobs are not supported by this server.", param="logprobs", code="unsupported_value"
            )
        gen = Generation(
            "completion",
            req,
            None,
            prompt,
            bool(req.stream),
            bool(req.stream_options and req.stream_options.include_usage),
            last_user=prompt,
        )
        return await self._generate(gen, ctx)

    def _identify(self, ctx: CallContext) -> None:
        """Fill the caller's metric label and rate-limit identity from its (authenticated) tenant."""
        tenant = ctx.tenant
        if tenant is None:
            ctx.tenant_label = "-"
        else:
            ctx.tenant_label = tenant if tenant in self.policy.tenants else "other"
        if ctx.principal is None:
            ctx.principal = tenant

    def _check_rate(self, ctx: CallContext) -> None:
        """Per caller: the tenant's own ``rate_limit_rpm``, else ``service.auth.rate_limit_rpm``
        for every other caller (a tenant the policy does not name, or a key without a tenant)."""
        if ctx.principal is None:
            return
        cfg = self.policy.tenants.get(ctx.tenant) if ctx.tenant is not None else None
        rpm = cfg.rate_limit_rpm if cfg is not None and cfg.rate_limit_rpm is not None else None
        if rpm is None:
            rpm = self.policy.service.auth.rate_limit_rpm
        if rpm is None:
            return
        wait = self.limiter.check(ctx.principal, rpm)
        if wait is not None:
            who = f"tenant '{ctx.tenant}'" if ctx.tenant is not None else "this API key"
            raise RateLimitError(f"Rate limit reached for {who}.", retry_after=max(1.0, wait))

    async def _generate(self, gen: Generation, ctx: CallContext) -> Completion:
        tiers = self._require_tiers()
        gen.ctx = ctx
        self._identify(ctx)
        self._check_rate(ctx)
        req = gen.request
        routed = self.route(ctx, req.model, gen.messages, gen.prompt)
        d = routed.decision
        policy = routed.policy or self.policy
        headers = {
            "x-router-tier": d.tier,
            "x-router-score": f"{routed.score.value:.4f}",
            "x-router-rule": d.rule,
        }
        # The cache is consulted only now, keyed on the decision: a request the policy sends to
        # another tier (a header rule, a tenant cap, a fallback) never gets this tier's answer.
        cache = self.cache
        key: CacheKey | None = None
        if cache is not None and not ctx.no_cache and d.tier in policy.tiers:
            key = cache.key(gen, ctx, d.tier, policy)
            if key is not None:
                hit = await cache.lookup(key, parent=ctx.span)
                if hit is not None:
                    return self._cached_completion(gen, d, headers, hit)
        if cache is not None:
            headers["x-router-cache"] = "miss"
        if d.rejected:
            self.telemetry.count_request(gen.kind, d.tier, d.rule, "rejected", ctx.tenant_label)
            raise OverloadedError(
                f"Tier '{d.tier}' is at capacity and no fallback tier is free; retry shortly.",
                retry_after=RETRY_AFTER_S,
            )
        backend = tiers.tiers.get(d.tier)
        if backend is None:  # a reload renamed tiers while this request was being decided
            raise UnavailableError(
                f"Tier '{d.tier}' is not loaded yet; retry shortly.", code="tier_loading", retry_after=5.0
            )
        if isinstance(backend, RemoteBackend):
            source = self._remote_stream(backend, gen)
            prompt_tokens_hint = routed.prompt_tokens
        else:
            source, prompt_tokens_hint = self._local_stream(backend, gen)
        span_attrs = self.writer.span_attributes(gen, d, routed)
        if ctx.span is not None:
            ctx.span.set_attributes(span_attrs)
        # Answers produced by a load fallback are not stored: the next identical request may well
        # be decided differently once the preferred tier has room.
        on_complete = None
        if key is not None and cache is not None and d.fallback_from is None:
            stored_key = key

            async def on_complete(body: dict[str, Any]) -> None:
                await cache.store(stored_key, body, d)

        timeout_s = policy.service.queue_timeout_s
        if gen.stream:
            stream = await self.writer.sse(
                gen, d, source, span_attrs, prompt_tokens_hint, timeout_s=timeout_s, on_complete=on_complete
            )
            return Completion(headers, stream=stream)
        body = await self.writer.collect(
            gen, d, source, span_attrs, prompt_tokens_hint, timeout_s=timeout_s, on_complete=on_complete
        )
        return Completion(headers, body=body)

    def _cached_completion(
        self, gen: Generation, d: Decision, headers: dict[str, str], hit: CachedAnswer
    ) -> Completion:
        tenant = gen.ctx.tenant_label if gen.ctx is not None else "-"
        self.telemetry.count_request(gen.kind, d.tier, d.rule, "cache_hit", tenant)
        headers = dict(headers, **{"x-router-cache": "hit", "x-router-cache-kind": hit.kind})
        if hit.kind == "semantic":
            headers["x-router-cache-similarity"] = f"{hit.similarity:.4f}"
        body = dict(hit.body, id=completion_id("chatcmpl" if gen.kind == "chat" else "cmpl"), created=now())
        if gen.stream:
            return Completion(headers, stream=replay(gen.kind, body, gen.include_usage))
        return Completion(headers, body=body)

    def _sampling(self, backend: LocalTier, gen: Generation, num_prompt: int) -> SamplingParams:
        req = gen.request
        defaults = backend.cfg.defaults
        if isinstance(req, ChatCompletionRequest):
            requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            param = "max_completion_tokens"
        else:
            requested = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's completions default
            param = "max_tokens"
        max_tokens = backend.clamp_max_tokens(num_prompt, requested, param)
        eos_free = bool(req.ignore_eos)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature if req.temperature is None else req.temperature,
            top_p=defaults.top_p if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            stop=stop_list(req.stop),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            ignore_eos=eos_free,
        )

    def _local_stream(self, backend: LocalTier, gen: Generation) -> tuple[AsyncIterator[StepOutput], int]:
        try:
            ids = backend.prompt_ids(gen.kind, gen.messages, gen.prompt)
        except TemplateError as exc:  # e.g. a template that demands alternating roles
            raise BadRequestError(
                f"The messages do not fit the chat template of tier '{backend.name}': {exc}",
                param="messages",
                code="invalid_messages",
            ) from exc
        params = self._sampling(backend, gen, len(ids))
        try:
            handle = backend.engine.submit(ids, params)
        except EngineFullError as exc:
            raise OverloadedError(
                f"Tier '{backend.name}' is at capacity; retry shortly.", retry_after=RETRY_AFTER_S
            ) from exc
        except ValueError as exc:
            raise BadRequestError(
                str(exc), param="messages" if gen.kind == "chat" else "prompt", code="context_length_exceeded"
            ) from exc
        return handle.__aiter__(), len(ids)

    def _remote_stream(self, backend: RemoteBackend, gen: Generation) -> AsyncIterator[StepOutput]:
        body = {k: v for k, v in _struct_to_dict(gen.request).items() if v is not None}
        return backend.client.generate(gen.kind, body)

    # -- draining ------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> bool:
        """Stop admitting; wait up to ``timeout`` for in-flight requests. True when all finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._in_flight.wait_idle(), timeout)
            return True
        except TimeoutError:
            return False


def _struct_to_dict(obj: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(obj)
