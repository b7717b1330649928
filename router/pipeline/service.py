"""One request, end to end: classify -> decide -> cache (keyed on the decision) -> submit -> stream
or collect.

``RouterService`` holds the live state (policy, tiers, classifier, cache, telemetry); the HTTP
layer (``router.http.app``) only parses, authenticates and turns results into responses.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from router.backends.remote import first_or_fallback
from router.backends.tierset import TierSet
from router.errors import BadRequestError, UnavailableError
from router.openai.request import CallContext, Generation, completion_id
from router.openai.writer import (
    RETRY_AFTER_S,
    InFlight,
    ResponseWriter,
    Served,
    now,
    replay,
)
from router.pipeline.admission import FairShare, assess, rejection
from router.pipeline.calls import CachedAnswer, Completion
from router.pipeline.limits import TenantLimiter, check_rate, check_tokens, identify, refunding
from router.pipeline.routing import (
    Routed,
    collected_max_tokens,
    count_tokens,
    count_tokens_off_loop,
    expected_output,
    refuse_past_context,
    refuse_unfittable,
    request_signals,
)
from router.pipeline.session import SessionMemory
from router.pipeline.shadow import FeedbackLog, ShadowRecorder, shadow_row, then_shadow
from router.policy.decide import Decision, RouteRequest, decide, fallback_after_failure
from tiers.core.output import StepOutput

if TYPE_CHECKING:
    from classifier import ComplexityClassifier
    from router.pipeline.cache import CacheKey, ResponseCache
    from router.policy.schema import Policy
    from router.telemetry import Telemetry

__all__ = ["CallContext", "Completion", "RouterService"]

log = logging.getLogger(__name__)


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
        self.fair = FairShare()
        self._in_flight = InFlight()
        self.writer = ResponseWriter(telemetry, self._in_flight)
        self._sessions: SessionMemory | None = None
        # Shadow answers and feedback (router/pipeline/shadow.py): the outcome-collection loop.
        self.shadow = ShadowRecorder(getattr(telemetry, "registry", None))
        self._feedback: FeedbackLog | None = None

    def feedback_log(self, policy: Policy | None = None) -> FeedbackLog | None:
        """The feedback log of ``policy`` (the live one by default); None when feedback is off."""
        policy = policy or self.policy
        cfg = policy.service.feedback
        if not cfg.enabled:
            return None
        if self._feedback is None or self._feedback.cfg != cfg:
            old = self._feedback
            self._feedback = FeedbackLog(
                cfg,
                policy.service.telemetry.record_content,
                getattr(self.telemetry, "registry", None) if old is None else None,
            )
            if old is not None:  # keep the registered counter (and the ids already issued)
                self._feedback.received, self._feedback.issued = old.received, old.issued
        return self._feedback

    def sessions(self, policy: Policy) -> SessionMemory | None:
        """The conversation -> tier memory (router/pipeline/session.py); rebuilt when a reload resizes it."""
        cfg = policy.routing.sessions
        if not cfg.enabled:
            return None
        mem = self._sessions
        if mem is None or (mem.max_entries, mem.ttl_s) != (cfg.max_entries, cfg.ttl_s):
            mem = self._sessions = SessionMemory(cfg.max_entries, cfg.ttl_s)
        return mem

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

    def decode_prompt(self, ids: list[int]) -> str:
        """A token-id prompt as text, for routing and ``echo``: the local tiers' tokenizer (one
        tokenizer, as drafting between them needs; ``counting_tokenizer``)."""
        tokenizer = self._require_tiers().counting_tokenizer()
        if tokenizer is None:
            raise BadRequestError(
                "Token-id prompts need a local tier's tokenizer; this server's tiers are all remote.",
                param="prompt",
                code="unsupported_value",
            )
        if max(ids) >= len(tokenizer):
            raise BadRequestError(
                f"'prompt' names token {max(ids)}; the tiers' tokenizer has {len(tokenizer)} tokens.",
                param="prompt",
            )
        return str(tokenizer.decode(ids))

    # -- routing -------------------------------------------------------------------------------
    def route(
        self,
        ctx: CallContext,
        model: str,
        messages: list[dict[str, str]] | None,
        prompt: str | None,
        gen: Generation | None = None,
        prompt_tokens: int | None = None,
    ) -> Routed:
        """Classify and decide; ``gen``: the parsed request (None for ``/v1/route``, which only
        asks); ``prompt_tokens`` when the caller has already counted them (off the event loop:
        ``routing.count_tokens_off_loop``)."""
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
            if prompt_tokens is None:
                prompt_tokens = count_tokens(self.tiers, policy, messages, prompt)
            # Admission: a tier whose queue is full, whose circuit is open or whose predicted
            # wait exceeds this request's budget counts as full, so the fallback applies.
            admission = assess(
                self.tiers,
                policy,
                ctx.headers,
                self.fair,
                ctx.principal,
                ctx.tenant,
                prompt_tokens,
                max_tokens=collected_max_tokens(gen),
            )
            pressures = admission.pressures
            sessions = self.sessions(policy)
            prior = sessions.recall(messages, ctx.headers, ctx.partition) if sessions is not None else None
            route_request = RouteRequest(
                model=model,
                headers=ctx.headers,
                tenant=ctx.tenant,
                prompt_tokens=prompt_tokens,
                **request_signals(messages, prompt, gen),
                session=prior,
            )
            costs = (
                self.tiers.routing_costs(
                    {name: p.wait_s for name, p in pressures.items()},
                    expected_output(policy, gen),
                    prompt_tokens,
                )
                if policy.routing.mode == "load_aware" and self.tiers is not None
                else {}
            )
            # Observed in every mode: the device's recent peak is load-aware's memory of sustained load.
            batches, rows = self.tiers.observe() if self.tiers is not None else ({}, 0.0)
            device_rows = rows if batches else None
            decision = decide(
                policy,
                route_request,
                score,
                admission.refusing,
                {t: c.total_s for t, c in costs.items()},
                batches,
                device_rows,
            )
            if costs:
                span.set_attribute(
                    "router.costs", json.dumps({t: round(c.total_s, 4) for t, c in costs.items()})
                )
                span.set_attribute("router.batches", json.dumps(batches))
                if device_rows is not None:
                    span.set_attribute("router.device_rows", round(device_rows, 2))
            if batches and self.tiers is not None and gen is not None and not decision.rejected:
                self.tiers.decided(decision.tier)  # /v1/route (no request) submits nothing
            span.set_attribute("router.tier", decision.tier)
            span.set_attribute("router.rule", decision.rule)
            span.set_attribute("router.reason", decision.reason)
            span.set_attribute("router.policy", policy.digest[:12])
        self.telemetry.route_decisions.labels(decision.tier, decision.rule).inc()
        return Routed(
            decision, score, prompt_tokens, classify_s * 1000, policy, pressures, admission.deadline_s
        )

    async def route_info(
        self, ctx: CallContext, model: str, messages: list[dict[str, str]] | None, prompt: str | None
    ) -> dict[str, Any]:
        self.check_caller(ctx)  # a decision costs a classification: limited like generation
        refuse_unfittable(self.tiers, messages, prompt)
        tokens = await count_tokens_off_loop(self.tiers, self.policy, messages, prompt)
        routed = self.route(ctx, model, messages, prompt, prompt_tokens=tokens)
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
    def check_caller(self, ctx: CallContext) -> None:
        """Identify the caller and apply its rate limit: every API endpoint, not only generation."""
        identify(ctx, self.policy)
        check_rate(self.limiter, self.policy, ctx)

    async def generate(self, gen: Generation, ctx: CallContext) -> Completion:
        """Answer one parsed request (``router.openai.request.parse_chat`` / ``parse_completion``,
        called by the route handler): limits, routing, admission, the backend, the writer."""
        tiers = self._require_tiers()
        self.check_caller(ctx)
        req = gen.request
        refuse_unfittable(self.tiers, gen.messages, gen.prompt)
        tokens = await count_tokens_off_loop(self.tiers, self.policy, gen.messages, gen.prompt)
        routed = self.route(ctx, req.model, gen.messages, gen.prompt, gen, prompt_tokens=tokens)
        d = routed.decision
        policy = routed.policy
        if not d.rejected:
            refuse_past_context(tiers, policy, d.tier, gen)
        sessions = self.sessions(policy)
        if sessions is not None and not d.rejected:
            # What the next turn of this conversation will look up (router/pipeline/session.py).
            sessions.record(gen.messages, ctx.headers, ctx.partition, d.tier)
        headers = {
            "x-router-tier": d.tier,
            "x-router-score": f"{routed.score.value:.4f}",
            "x-router-rule": d.rule,
        }
        # The id POST /v1/feedback takes (the header's: the body's own id is not remembered).
        rid = gen.response_id
        headers["x-router-response-id"] = rid
        feedback = self.feedback_log(policy)
        if feedback is not None and not d.rejected:
            feedback.remember([rid], gen, d)
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
        charge = None
        if not d.rejected:
            charge = check_tokens(
                self.limiter,
                self.policy,
                ctx,
                gen,
                routed.prompt_tokens,
                policy.tiers[d.tier].defaults.max_tokens,
                policy.tiers[d.tier].max_model_len,
            )
        if d.rejected:
            self.telemetry.count_request(gen.kind, d.tier, d.rule, "rejected", ctx.tenant_label)
            self.fair.note(d.tier, ctx.principal)  # a refused caller still claims its share
            raise rejection(d, routed.pressures)
        source, prompt_tokens_hint, served = await self._submit(
            tiers, d.tier, gen, routed.prompt_tokens, policy
        )
        # The first token must come within the queue timeout, and within the client's deadline.
        timeout_s = policy.service.queue_timeout_s
        if routed.deadline_s is not None:
            timeout_s = min(timeout_s, routed.deadline_s)
        if tiers.tiers[d.tier].is_remote:

            async def resubmit(tier: str) -> tuple[list[AsyncIterator[StepOutput]], int, Served]:
                return await self._submit(tiers, tier, gen, routed.prompt_tokens, policy)

            fallback = functools.partial(fallback_after_failure, policy, tenant=ctx.tenant)
            source, d, prompt_tokens_hint, served = await first_or_fallback(
                tiers.tiers, d, source, (prompt_tokens_hint, served), timeout_s, fallback, resubmit
            )
            headers["x-router-tier"] = d.tier
        if charge is not None:  # the output tokens charged and not produced come back at the end
            source = refunding(self.limiter, charge, source)
        # Counted against the caller's share of the tier until the answer ends (pipeline.admission).
        spec = gen.output
        weight = served.choices or (max(spec.n, spec.best_of) if spec is not None else 1)
        source[0] = self.fair.hold(d.tier, ctx.principal, source[0], weight)
        if policy.shadow.preempt:
            self.shadow.preempt()  # real traffic first: running shadow answers give way
        shadow_tier = self.shadow.target(policy, d, ctx.tenant)
        if shadow_tier is not None:
            # The user's stream, unchanged; once it has finished, the shadow answer starts.
            start = functools.partial(self._start_shadow, shadow_tier, gen, ctx, d, policy, rid)
            source[0] = then_shadow(source[0], start)
        span_attrs = self.writer.span_attributes(gen, d, routed.score.value)
        if ctx.span is not None:
            ctx.span.set_attributes(span_attrs)
        # Answers produced by a load fallback are not stored: the next identical request may well
        # be decided differently once the preferred tier has room.
        on_complete = None
        if key is not None and cache is not None and d.fallback_from is None:
            stored_key = key

            async def on_complete(body: dict[str, Any]) -> None:
                await cache.store(stored_key, body, d)

        body, stream = await self.writer.answer(
            gen,
            d,
            source,
            span_attrs,
            prompt_tokens_hint,
            served=served,
            timeout_s=timeout_s,
            on_complete=on_complete,
        )
        return Completion(headers, body=body, stream=stream)

    async def _submit(
        self, tiers: TierSet, tier: str, gen: Generation, prompt_tokens: int, policy: Policy
    ) -> tuple[list[AsyncIterator[StepOutput]], int, Served]:
        """Submit ``gen`` to ``tier``: one output stream per choice, the prompt's token count, and
        what the backend tells the writer about itself.

        Preparing a local request awaits (tokenization, grammar compilation off the loop); a
        reload may retire the tier's engine meanwhile. A retired backend takes nothing new: the
        request is prepared again for the tier the reload put in its place."""
        for _ in range(3):
            backend = tiers.tiers.get(tier)
            if backend is None:  # a reload renamed tiers while this request was being decided
                raise UnavailableError(
                    f"Tier '{tier}' is not loaded yet; retry shortly.", code="tier_loading", retry_after=5.0
                )
            prepared = await backend.prepare(
                gen, prompt_tokens, grammar_timeout_s=policy.service.limits.grammar_timeout_s
            )
            if not backend.retired:  # no await from this check to the submission
                return backend.submit(gen, prepared), prepared.num_prompt_tokens, prepared.served
            tiers = self._require_tiers()  # the set the reload swapped in
        raise UnavailableError(
            f"Tier '{tier}' is being reloaded; retry shortly.", code="tier_loading", retry_after=1.0
        )

    def _start_shadow(
        self,
        tier: str,
        gen: Generation,
        ctx: CallContext,
        d: Decision,
        policy: Policy,
        rid: str,
        answer: str,
    ) -> None:
        backend = self.tiers.tiers.get(tier) if self.tiers is not None else None
        if backend is None:
            return
        cfg = policy.shadow
        record = (
            cfg.record_content if cfg.record_content is not None else policy.service.telemetry.record_content
        )
        shadow_gen = gen.shadow_copy(tier, cfg.max_tokens)
        load = backend.shadow_load()

        def stream() -> AsyncIterator[StepOutput]:
            return backend.stream(shadow_gen)

        row = shadow_row(rid, gen, d, ctx.tenant, answer, record)
        self.shadow.launch(cfg, tier, load, stream, row, record)

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

    # -- draining ------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> bool:
        """Stop admitting; wait up to ``timeout`` for in-flight requests. True when all finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._in_flight.wait_idle(), timeout)
            return True
        except TimeoutError:
            return False
