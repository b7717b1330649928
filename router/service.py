"""One request, end to end: cache -> classify -> decide -> submit -> stream or collect.

``RouterService`` holds the live state (policy, tiers, classifier, cache, telemetry); the HTTP
layer (``router.app``) only parses, authenticates and turns results into responses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.backends import LocalTier, RemoteBackend, TierSet
from router.errors import BadRequestError, OverloadedError, RateLimitError, UnavailableError
from router.policy.decide import Decision, RouteRequest, decide
from router.responses import RETRY_AFTER_S, ResponseMixin
from router.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    message_text,
    stop_list,
    validate_sampling,
)
from tiers.engine import EngineFullError
from tiers.output import StepOutput
from tiers.sequence import SamplingParams

if TYPE_CHECKING:
    from classifier import ComplexityClassifier, ComplexityScore
    from router.cache import ResponseCache
    from router.policy.schema import Policy
    from router.telemetry import Telemetry

__all__ = ["CallContext", "Completion", "RouterService"]

log = logging.getLogger(__name__)



@dataclass(slots=True)
class CallContext:
    headers: Mapping[str, str]
    """Lower-cased request headers."""
    tenant: str | None = None
    no_cache: bool = False
    span: Any = None
    """The request's server span: parent of classify/decide/cache/queue/prefill/decode spans."""


@dataclass(slots=True)
class Routed:
    decision: Decision
    score: ComplexityScore
    prompt_tokens: int
    classify_ms: float


@dataclass(slots=True)
class Completion:
    """What the HTTP layer needs: routing headers plus a body or an SSE byte stream."""

    headers: dict[str, str]
    body: dict[str, Any] | None = None
    stream: AsyncIterator[bytes] | None = None


@dataclass(slots=True)
class _Gen:
    kind: str  # chat | completion
    request: ChatCompletionRequest | CompletionRequest
    messages: list[dict[str, str]] | None
    prompt: str | None
    stream: bool
    include_usage: bool
    cache_key: dict[str, Any] | None = None
    last_user: str = ""
    ctx: CallContext | None = None


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


class RouterService(ResponseMixin):
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
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

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
        policy = self.policy  # one snapshot for the whole decision (hot reload swaps the attribute)
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
        return Routed(decision, score, prompt_tokens, classify_s * 1000)

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
        gen = _Gen(
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
        gen = _Gen(
            "completion",
            req,
            None,
            prompt,
            bool(req.stream),
            bool(req.stream_options and req.stream_options.include_usage),
            last_user=prompt,
        )
        return await self._generate(gen, ctx)

    def _check_rate(self, ctx: CallContext) -> None:
        if ctx.tenant is None:
            return
        cfg = self.policy.tenants.get(ctx.tenant)
        if cfg is None or cfg.rate_limit_rpm is None:
            return
        wait = self.limiter.check(ctx.tenant, cfg.rate_limit_rpm)
        if wait is not None:
            raise RateLimitError(f"Rate limit reached for tenant '{ctx.tenant}'.", retry_after=max(1.0, wait))

    async def _generate(self, gen: _Gen, ctx: CallContext) -> Completion:
        tiers = self._require_tiers()
        gen.ctx = ctx
        self._check_rate(ctx)
        req = gen.request
        if self.cache is not None and not ctx.no_cache:
            hit = await self.cache.lookup(gen, ctx, self)
            if hit is not None:
                return hit
        routed = self.route(ctx, req.model, gen.messages, gen.prompt)
        d = routed.decision
        headers = {
            "x-router-tier": d.tier,
            "x-router-score": f"{routed.score.value:.4f}",
            "x-router-rule": d.rule,
        }
        if self.cache is not None:
            headers["x-router-cache"] = "miss"
        if d.rejected:
            self.telemetry.requests.labels(gen.kind, d.tier, d.rule, "rejected").inc()
            raise OverloadedError(
                f"Tier '{d.tier}' is at capacity and no fallback tier is free; retry shortly.",
                retry_after=RETRY_AFTER_S,
            )
        backend = tiers.get(d.tier)
        if isinstance(backend, RemoteBackend):
            source = self._remote_stream(backend, gen)
            prompt_tokens_hint = routed.prompt_tokens
        else:
            source, prompt_tokens_hint = self._local_stream(backend, gen)
        span_attrs = self._span_attributes(gen, d, routed)
        if ctx.span is not None:
            ctx.span.set_attributes(span_attrs)
        if gen.stream:
            return Completion(
                headers, stream=await self._sse(gen, d, source, span_attrs, prompt_tokens_hint, ctx)
            )
        return Completion(
            headers, body=await self._collect(gen, d, source, span_attrs, prompt_tokens_hint, ctx)
        )

    def _sampling(self, backend: LocalTier, gen: _Gen, num_prompt: int) -> SamplingParams:
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

    def _local_stream(self, backend: LocalTier, gen: _Gen) -> tuple[AsyncIterator[StepOutput], int]:
        ids = backend.prompt_ids(gen.kind, gen.messages, gen.prompt)
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

    def _remote_stream(self, backend: RemoteBackend, gen: _Gen) -> AsyncIterator[StepOutput]:
        body = {k: v for k, v in _struct_to_dict(gen.request).items() if v is not None}
        return backend.client.generate(gen.kind, body)

    # -- draining ------------------------------------------------------------------------------
    def _enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Stop admitting; wait up to ``timeout`` for in-flight requests. True when all finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False


def _struct_to_dict(obj: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(obj)
