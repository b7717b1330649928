"""One request, end to end: classify -> decide -> cache (keyed on the decision) -> submit -> stream
or collect.

``RouterService`` holds the live state (policy, tiers, classifier, cache, telemetry); the HTTP
layer (``router.http.app``) only parses, authenticates and turns results into responses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.backends.tierset import TierSet
from router.errors import BadRequestError, RateLimitError, UnavailableError
from router.openai.request import CallContext, Generation, completion_id
from router.openai.writer import RETRY_AFTER_S, InFlight, ResponseWriter, Served, now, replay
from router.pipeline.admission import FairShare, TierPressure, assess, rejection
from router.pipeline.calls import CachedAnswer, Completion
from router.pipeline.limits import TenantLimiter
from router.pipeline.session import SessionMemory
from router.pipeline.shadow import FeedbackLog, ShadowRecorder, shadow_row
from router.policy.decide import Decision, RouteRequest, decide
from tiers.core.output import StepOutput

if TYPE_CHECKING:
    from classifier import ComplexityClassifier, ComplexityScore
    from router.pipeline.cache import CacheKey, ResponseCache
    from router.policy.schema import Policy
    from router.telemetry import Telemetry

__all__ = ["CallContext", "Completion", "RouterService"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Routed:
    """A request's routing: the decision, what it was taken on, and admission's view of the tiers."""

    decision: Decision
    score: ComplexityScore
    prompt_tokens: int
    classify_ms: float
    policy: Policy
    """The policy snapshot the decision was taken under (a reload may swap the live one)."""
    pressures: dict[str, TierPressure]
    """Each tier's admission state when the decision was taken (``router.pipeline.admission``)."""
    deadline_s: float | None
    """The client's deadline (``x-request-timeout``), if it sent one."""


def _prompt_text(messages: list[dict[str, str]] | None, prompt: str | None) -> str:
    """The text a prompt's length is judged by: the messages' contents, one per line, or the prompt."""
    return (prompt if messages is None else "\n".join(m["content"] for m in messages)) or ""


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
        ``_count_tokens_off_loop``)."""
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
                prompt_tokens = self._count_tokens(policy, messages, prompt)
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
                max_tokens=_collected_max_tokens(gen),
            )
            pressures = admission.pressures
            sessions = self.sessions(policy)
            prior = sessions.recall(messages, ctx.headers, ctx.partition) if sessions is not None else None
            route_request = RouteRequest(
                model=model,
                headers=ctx.headers,
                tenant=ctx.tenant,
                prompt_tokens=prompt_tokens,
                **_request_signals(messages, prompt, gen),
                session=prior,
            )
            costs = (
                self.tiers.routing_costs(
                    {name: p.wait_s for name, p in pressures.items()},
                    _expected_output(policy, gen),
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

    def _count_tokens(self, policy: Policy, messages: list[dict[str, str]] | None, prompt: str | None) -> int:
        """Prompt tokens for the ``prompt_tokens_*`` rules: exact when a rule could turn on it."""
        estimate, text, tok = self._token_plan(policy, messages, prompt)
        return estimate if tok is None else len(tok.encode(text, add_special_tokens=False))

    async def _count_tokens_off_loop(
        self, policy: Policy, messages: list[dict[str, str]] | None, prompt: str | None
    ) -> int:
        """``_count_tokens`` with the tokenization (0.6-0.9 s for a 1 MB prompt) in a worker
        thread: every other stream and probe keeps its event loop meanwhile."""
        estimate, text, tok = self._token_plan(policy, messages, prompt)
        if tok is None:
            return estimate
        return len(await asyncio.to_thread(tok.encode, text, add_special_tokens=False))

    def _refuse_unfittable(self, messages: list[dict[str, str]] | None, prompt: str | None) -> None:
        """A 400 ``context_length_exceeded`` for a prompt that is certainly longer than every
        tier's ``max_model_len``, from its byte count alone: tokenizing a 1 MB prompt costs a
        second of CPU beside the engines, only to refuse it. Tiers served elsewhere (remote) have
        their own limits, so only an all-local tier set is checked."""
        tiers = self.tiers
        if tiers is None or tiers.token_bytes is None or not tiers.tiers:
            return
        if any(b.is_remote for b in tiers.tiers.values()):
            return
        limit = max(b.cfg.max_model_len for b in tiers.tiers.values())
        text = _prompt_text(messages, prompt)
        if len(text) <= limit:  # short: cheap to tokenize, and the tier's own count decides
            return
        at_least = len(text.encode("utf-8", "surrogatepass")) // tiers.token_bytes
        if at_least > limit:
            raise BadRequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt is "
                f"at least {at_least} tokens.",
                param="messages" if messages is not None else "prompt",
                code="context_length_exceeded",
            )

    def _token_plan(
        self, policy: Policy, messages: list[dict[str, str]] | None, prompt: str | None
    ) -> tuple[int, str, Any]:
        """``(estimate, text, tokenizer)``: the tokenizer is None when the estimate will do.

        A byte-level BPE token covers at least one UTF-8 byte, so a text of N bytes has at most N
        tokens; below the smallest threshold any rule uses, tokenizing cannot change the decision
        and the (cheap) byte count is used instead.
        """
        text = _prompt_text(messages, prompt)
        thresholds = [
            t
            for r in policy.routing.rules
            if r.when is not None
            for t in (r.when.prompt_tokens_above, r.when.prompt_tokens_at_most)
            if t is not None
        ]
        upper_bound = len(text.encode("utf-8", "surrogatepass"))
        # The tokenizer is fetched only when a threshold could tell the count from the estimate.
        could_matter = bool(thresholds) and upper_bound > min(thresholds)
        tok = self.tiers.counting_tokenizer() if could_matter and self.tiers is not None else None
        if tok is None:
            estimate = min(upper_bound, max(1, len(text) // 4)) if thresholds else len(text) // 4
            return estimate, text, None
        return 0, text, tok

    async def route_info(
        self, ctx: CallContext, model: str, messages: list[dict[str, str]] | None, prompt: str | None
    ) -> dict[str, Any]:
        self.check_caller(ctx)  # a decision costs a classification: limited like generation
        self._refuse_unfittable(messages, prompt)
        tokens = await self._count_tokens_off_loop(self.policy, messages, prompt)
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
    def _identify(self, ctx: CallContext) -> None:
        """Fill the caller's metric label and rate-limit identity from its (authenticated) tenant."""
        tenant = ctx.tenant
        if tenant is None:
            ctx.tenant_label = "-"
        else:
            ctx.tenant_label = tenant if tenant in self.policy.tenants else "other"
        if ctx.principal is None:
            ctx.principal = tenant

    def check_caller(self, ctx: CallContext) -> None:
        """Identify the caller and apply its rate limit: every API endpoint, not only generation."""
        self._identify(ctx)
        self._check_rate(ctx)

    def _check_rate(self, ctx: CallContext) -> None:
        """Per caller: the tenant's own ``rate_limit_rpm``, else ``service.auth.rate_limit_rpm``
        for every other caller (a tenant the policy does not name, or a key without a tenant)."""
        if ctx.principal is None:
            return
        cfg = self.policy.tenants.get(ctx.tenant) if ctx.tenant is not None else None
        if cfg is None and ctx.tenant is not None:  # a tenant the policy does not name
            cfg = self.policy.tenants.get("default")
        rpm = cfg.rate_limit_rpm if cfg is not None and cfg.rate_limit_rpm is not None else None
        if rpm is None:
            rpm = self.policy.service.auth.rate_limit_rpm
        if rpm is None:
            return
        wait = self.limiter.check(ctx.principal, rpm)
        if wait is not None:
            who = f"tenant '{ctx.tenant}'" if ctx.tenant is not None else "this API key"
            raise RateLimitError(f"Rate limit reached for {who}.", retry_after=max(1.0, wait))

    def _check_tokens(self, ctx: CallContext, gen: Generation, prompt_tokens: int, default_max: int) -> None:
        """The caller's ``rate_limit_tpm``: prompt tokens plus n x max_tokens, charged at admission
        (after the cache: a hit costs nothing). Its own bucket, beside the requests'."""
        if ctx.principal is None:
            return
        policy = self.policy
        cfg = policy.tenants.get(ctx.tenant) if ctx.tenant is not None else None
        if cfg is None and ctx.tenant is not None:
            cfg = policy.tenants.get("default")
        tpm = cfg.rate_limit_tpm if cfg is not None and cfg.rate_limit_tpm is not None else None
        if tpm is None:
            tpm = policy.service.auth.rate_limit_tpm
        if tpm is None:
            return
        spec = gen.output
        choices = max(spec.n, spec.best_of) if spec is not None else 1
        asked = gen.sampling.max_tokens or default_max
        cost = prompt_tokens + choices * asked
        wait = self.limiter.check("tokens\x00" + ctx.principal, tpm, cost)
        if wait is not None:
            who = f"tenant '{ctx.tenant}'" if ctx.tenant is not None else "this API key"
            raise RateLimitError(
                f"Token rate limit reached for {who}: this request costs {cost} tokens "
                f"(prompt + n x max_tokens) of {tpm} a minute.",
                code="tokens_per_minute_exceeded",
                retry_after=max(1.0, wait),
            )

    async def generate(self, gen: Generation, ctx: CallContext) -> Completion:
        """Answer one parsed request (``router.openai.request.parse_chat`` / ``parse_completion``,
        called by the route handler): limits, routing, admission, the backend, the writer."""
        tiers = self._require_tiers()
        self.check_caller(ctx)
        req = gen.request
        self._refuse_unfittable(gen.messages, gen.prompt)
        tokens = await self._count_tokens_off_loop(self.policy, gen.messages, gen.prompt)
        routed = self.route(ctx, req.model, gen.messages, gen.prompt, gen, prompt_tokens=tokens)
        d = routed.decision
        policy = routed.policy
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
        if not d.rejected:
            self._check_tokens(ctx, gen, routed.prompt_tokens, policy.tiers[d.tier].defaults.max_tokens)
        if d.rejected:
            self.telemetry.count_request(gen.kind, d.tier, d.rule, "rejected", ctx.tenant_label)
            self.fair.note(d.tier, ctx.principal)  # a refused caller still claims its share
            raise rejection(d, routed.pressures)
        source, prompt_tokens_hint, served = await self._submit(
            tiers, d.tier, gen, routed.prompt_tokens, policy
        )
        # Counted against the caller's share of the tier until the answer ends (pipeline.admission).
        spec = gen.output
        weight = served.choices or (max(spec.n, spec.best_of) if spec is not None else 1)
        source[0] = self.fair.hold(d.tier, ctx.principal, source[0], weight)
        if policy.shadow.preempt:
            self.shadow.preempt()  # real traffic first: running shadow answers give way
        shadow_tier = self.shadow.target(policy, d, ctx.tenant)
        if shadow_tier is not None:
            source[0] = self._shadow_after(source[0], shadow_tier, gen, ctx, d, policy, rid)
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

        # The first token must come within the queue timeout, and within the client's deadline.
        timeout_s = policy.service.queue_timeout_s
        if routed.deadline_s is not None:
            timeout_s = min(timeout_s, routed.deadline_s)
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

    async def _shadow_after(
        self,
        source: AsyncIterator[StepOutput],
        tier: str,
        gen: Generation,
        ctx: CallContext,
        d: Decision,
        policy: Policy,
        rid: str,
    ) -> AsyncIterator[StepOutput]:
        """The user's stream, unchanged; once it has finished, the shadow answer starts.

        Not after a disconnect (the generator is closed mid-way) or an error: only answers the
        user actually got are compared.
        """
        parts: list[str] = []
        finished = False
        try:
            async for out in source:
                if out.index == 0:
                    parts.append(out.text)
                    finished = finished or out.finish_reason is not None
                yield out
        finally:
            # The writer closes the stream once it has the last output, without reading past it:
            # the finished answer is known here, at the close.
            if finished:
                self._start_shadow(tier, gen, ctx, d, policy, rid, "".join(parts))

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


def _collected_max_tokens(gen: Generation | None) -> int | None:
    """The output tokens a non-streaming request asks for (None for a stream, or when unknown):
    what admission checks against the client's deadline."""
    return None if gen is None or gen.stream else gen.sampling.max_tokens


def _request_signals(
    messages: list[dict[str, str]] | None, prompt: str | None, gen: Generation | None
) -> dict[str, Any]:
    """The request-shape fields of ``RouteRequest`` (policy conditions ``has_tools``, ``keywords``...)."""
    if messages is not None:
        users = [m.get("content") or "" for m in messages if m.get("role") == "user"]
        text, turns = (users[-1] if users else ""), len(users)
    else:
        text, turns = prompt or "", 1
    signals: dict[str, Any] = {"text": text, "turns": turns}
    if gen is not None and gen.output is not None:
        signals["has_tools"] = gen.output.has_tools
        signals["response_format"] = gen.output.response_format
        signals["logprobs"] = gen.output.logprobs is not None
    return signals


def _expected_output(policy: Policy, gen: Generation | None) -> dict[str, int]:
    """Output tokens a request is priced at on each tier (load-aware routing): what it asks for,
    else the tier's default ``max_tokens``."""
    asked = gen.sampling.max_tokens if gen is not None else None
    return {name: asked or cfg.defaults.max_tokens for name, cfg in policy.tiers.items()}
