"""The policy's semantic checks, across fields: a draft naming a missing tier, draft cycles,
thresholds out of order, unreachable rules, names unsafe for headers... (the structural pass is
``router.policy.convert``)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from router.policy.convert import FieldPath, Issues
from router.policy.schema import NGRAM, SUPPORTED_VERSIONS, Condition, Policy

__all__ = ["check_policy", "subsumes"]

_LANGUAGE = re.compile(r"[a-z]{2}|und")
_HEADER_SAFE = re.compile(r"[!-~](?:[ -~]{0,126}[!-~])?")
"""Printable ASCII, no leading/trailing space, at most 128 characters: names that end up in
``x-router-*`` response headers, metric labels and logs (no CR/LF, nothing outside latin-1)."""


def _check_name(ctx: Issues, path: FieldPath, name: str, what: str) -> None:
    if not _HEADER_SAFE.fullmatch(name):
        ctx.error(
            path,
            f"{what} {name[:40]!r} must be 1-128 printable ASCII characters without leading or "
            "trailing spaces (it is sent in x-router-* response headers)",
        )


# -- semantic pass ------------------------------------------------------------------------------
def check_policy(policy: Policy, ctx: Issues) -> None:
    tiers = policy.tiers
    names = list(tiers)
    if policy.version not in SUPPORTED_VERSIONS:
        ctx.error(
            ("version",), f"unsupported version {policy.version}; supported: {list(SUPPORTED_VERSIONS)}"
        )
    if not tiers:
        ctx.error(("tiers",), "at least one tier is required")
    for name, tier in tiers.items():
        p: FieldPath = ("tiers", name)
        _check_name(ctx, p, name, "tier name")
        if name == "auto":
            ctx.error(p, "'auto' is reserved for routed requests")
        if name == NGRAM:
            ctx.error(p, f"'{NGRAM}' is reserved: `draft: {NGRAM}` drafts by n-gram lookup")
        for fname, minimum in (
            ("max_num_seqs", 1),
            ("max_queue", 0),
            ("max_model_len", 16),
            ("max_num_batched_tokens", 16),
            ("speculative_tokens", 0),
            ("kv_cache_tokens", 16),
            ("max_retries", 0),
        ):
            if getattr(tier, fname) < minimum:
                ctx.error((*p, fname), f"must be >= {minimum}, got {getattr(tier, fname)}")
        if tier.max_num_batched_tokens < tier.max_num_seqs:
            ctx.error(
                (*p, "max_num_batched_tokens"),
                f"must be >= max_num_seqs ({tier.max_num_seqs}): each running sequence needs a token a step",
            )
        if tier.block_size not in (8, 16, 32, 64, 128):
            ctx.error((*p, "block_size"), f"must be 8, 16, 32, 64 or 128, got {tier.block_size}")
        if tier.max_decode_slowdown is not None and not tier.max_decode_slowdown > 1.0:
            ctx.error((*p, "max_decode_slowdown"), f"must be > 1 (or null), got {tier.max_decode_slowdown}")
        if tier.kv_cache_memory is not None:
            from tiers.models.plan import parse_memory

            try:
                parse_memory(tier.kv_cache_memory, device_total=1)
            except ValueError as exc:
                ctx.error((*p, "kv_cache_memory"), str(exc))
        if tier.activation_quantization != "none" and tier.quantization != "int4":
            ctx.error(
                (*p, "activation_quantization"),
                f"'{tier.activation_quantization}' needs quantization: int4, got {tier.quantization}",
            )
        if tier.head_int8_tokens and not (tier.quantization == "int4" and tier.quantize_head):
            ctx.error((*p, "head_int8_tokens"), "needs quantization: int4 and quantize_head: true")
        if tier.head_int8_tokens < 0 or tier.head_int8_tokens % 64:
            ctx.error((*p, "head_int8_tokens"), f"must be a multiple of 64 >= 0, got {tier.head_int8_tokens}")
        if tier.quant_group_size not in (32, 64, 128):
            ctx.error((*p, "quant_group_size"), f"must be 32, 64 or 128, got {tier.quant_group_size}")
        if tier.speculative_tokens > 16:
            ctx.error((*p, "speculative_tokens"), f"must be <= 16, got {tier.speculative_tokens}")
        for fname in ("timeout_s", "max_queue_wait_s", "circuit_cooldown_s"):
            if getattr(tier, fname) <= 0:
                ctx.error((*p, fname), "must be > 0")
        if tier.circuit_failures < 1:
            ctx.error((*p, "circuit_failures"), f"must be >= 1, got {tier.circuit_failures}")
        d = tier.defaults
        if d.max_tokens < 1:
            ctx.error((*p, "defaults", "max_tokens"), "must be >= 1")
        if not 0 <= d.temperature <= 2:
            ctx.error((*p, "defaults", "temperature"), "must be in [0, 2]")
        if not 0 < d.top_p <= 1:
            ctx.error((*p, "defaults", "top_p"), "must be in (0, 1]")
        if tier.draft == NGRAM:
            if tier.is_remote:
                ctx.error((*p, "draft"), "a remote tier cannot use a draft")
        elif tier.draft is not None:
            if tier.draft not in tiers:
                ctx.error(
                    (*p, "draft"),
                    f"names tier '{tier.draft}', which does not exist; tiers: {', '.join(names)}",
                )
            elif tier.draft == name:
                ctx.error((*p, "draft"), "a tier cannot draft for itself")
            elif tiers[tier.draft].is_remote:
                ctx.error(
                    (*p, "draft"),
                    f"tier '{tier.draft}' is remote and cannot be a draft (its KV is not in this process)",
                )
            if tier.is_remote:
                ctx.error((*p, "draft"), "a remote tier cannot use a draft")
    # Draft cycles: follow each chain; revisiting a tier is a cycle.
    for start in names:
        seen = [start]
        cur = tiers[start].draft
        while cur is not None and cur in tiers:
            if cur in seen:
                ctx.error(("tiers", start, "draft"), f"draft cycle: {' -> '.join([*seen, cur])}")
                break
            seen.append(cur)
            cur = tiers[cur].draft
    routing = policy.routing
    for alias, target in routing.aliases.items():
        _check_name(ctx, ("routing", "aliases", alias), alias, "alias")
        if target not in tiers:
            ctx.error(("routing", "aliases", alias), f"names tier '{target}', which does not exist")
        if alias in tiers or alias == "auto":
            ctx.error(("routing", "aliases", alias), "an alias cannot shadow a tier name or 'auto'")
    for src, dst in routing.fallback.items():
        if src not in tiers:
            ctx.error(("routing", "fallback", src), f"'{src}' is not a tier")
        if dst is not None and dst not in tiers:
            ctx.error(("routing", "fallback", src), f"names tier '{dst}', which does not exist")
    rule_names = {r.name for r in routing.rules}
    for i, name in enumerate(routing.load_aware.rules or []):
        if name not in rule_names:
            ctx.error(("routing", "load_aware", "rules", i), f"names rule '{name}', which does not exist")
    if routing.load_aware.up_tolerance < 0:
        ctx.error(
            ("routing", "load_aware", "up_tolerance"), f"must be >= 0, got {routing.load_aware.up_tolerance}"
        )
    if routing.load_aware.min_device_rows < 0:
        ctx.error(
            ("routing", "load_aware", "min_device_rows"),
            f"must be >= 0, got {routing.load_aware.min_device_rows}",
        )
    esc = routing.escalation.confidence_below
    if esc is not None and not 0 < esc <= 1:
        ctx.error(("routing", "escalation", "confidence_below"), "must be in (0, 1]")
    sh = policy.shadow
    if not 0 <= sh.sample <= 1:
        ctx.error(("shadow", "sample"), f"must be in [0, 1], got {sh.sample}")
    if not 0 <= sh.max_busy_fraction <= 1:
        ctx.error(("shadow", "max_busy_fraction"), f"must be in [0, 1], got {sh.max_busy_fraction}")
    for fname in ("max_concurrent", "max_tokens"):
        if getattr(sh, fname) < 1:
            ctx.error(("shadow", fname), f"must be >= 1, got {getattr(sh, fname)}")
    if sh.tier is not None and sh.tier not in tiers:
        ctx.error(
            ("shadow", "tier"), f"names tier '{sh.tier}', which does not exist; tiers: {', '.join(names)}"
        )
    rule_names = {r.name for r in routing.rules}
    for i, rname in enumerate(sh.rules or []):
        if rname not in rule_names:
            ctx.error(("shadow", "rules", i), f"names rule '{rname}', which does not exist")
    fb = policy.service.feedback
    if fb.max_ids < 1:
        ctx.error(("service", "feedback", "max_ids"), "must be >= 1")
    if fb.ttl_s <= 0:
        ctx.error(("service", "feedback", "ttl_s"), "must be > 0")
    if routing.sessions.max_entries < 1:
        ctx.error(("routing", "sessions", "max_entries"), "must be >= 1")
    if routing.sessions.ttl_s <= 0:
        ctx.error(("routing", "sessions", "ttl_s"), "must be > 0")
    _check_rules(policy, ctx)
    for tenant, cfg in policy.tenants.items():
        _check_name(ctx, ("tenants", tenant), tenant, "tenant name")
        for i, t in enumerate(cfg.allowed_tiers or []):
            if t not in tiers:
                ctx.error(("tenants", tenant, "allowed_tiers", i), f"'{t}' is not a tier")
        if cfg.allowed_tiers == []:
            ctx.error(("tenants", tenant, "allowed_tiers"), "must name at least one tier")
        if cfg.rate_limit_rpm is not None and cfg.rate_limit_rpm < 1:
            ctx.error(("tenants", tenant, "rate_limit_rpm"), "must be >= 1")
        if cfg.rate_limit_tpm is not None and cfg.rate_limit_tpm < 1:
            ctx.error(("tenants", tenant, "rate_limit_tpm"), "must be >= 1")
    svc = policy.service
    auth = svc.auth
    if auth.mode == "open":
        for fname in ("api_keys_env", "api_keys_file"):
            if getattr(auth, fname):
                ctx.error(
                    ("service", "auth", fname),
                    "is ignored with mode 'open' (no auth); use mode 'keys' or remove it",
                )
    if auth.rate_limit_rpm is not None and auth.rate_limit_rpm < 1:
        ctx.error(("service", "auth", "rate_limit_rpm"), "must be >= 1")
    if auth.rate_limit_tpm is not None and auth.rate_limit_tpm < 1:
        ctx.error(("service", "auth", "rate_limit_tpm"), "must be >= 1")
    if svc.cache.redis_timeout_s <= 0:
        ctx.error(("service", "cache", "redis_timeout_s"), "must be > 0")
    if svc.max_request_timeout_s <= 0:
        ctx.error(("service", "max_request_timeout_s"), "must be > 0")
    if svc.fair_slowdown is not None and svc.fair_slowdown < 1.0:
        ctx.error(("service", "fair_slowdown"), "must be >= 1 (or null: no holding back)")
    if svc.max_body_bytes < 1024:
        ctx.error(("service", "max_body_bytes"), "must be >= 1024")
    for fname in ("queue_timeout_s", "drain_timeout_s"):
        if getattr(svc, fname) <= 0:
            ctx.error(("service", fname), "must be > 0")
    if not 0 < svc.cache.semantic.threshold <= 1:
        ctx.error(("service", "cache", "semantic", "threshold"), "must be in (0, 1]")
    if svc.cache.max_entries < 1:
        ctx.error(("service", "cache", "max_entries"), "must be >= 1")
    if svc.cache.ttl_s <= 0:
        ctx.error(("service", "cache", "ttl_s"), "must be > 0")
    limits = svc.limits
    # logit_bias may be refused outright (0); each other bound must let one of its kind through.
    for fname, minimum in (
        ("max_logit_bias", 0),
        ("max_prompts", 1),
        ("max_tools", 1),
        ("max_schema_nodes", 1),
        ("max_schema_depth", 1),
        ("max_schema_properties", 1),
        ("max_schema_chars", 1),
        ("max_request_tokens", 1),
    ):
        if getattr(limits, fname) < minimum:
            ctx.error(("service", "limits", fname), f"must be >= {minimum}, got {getattr(limits, fname)}")
    if limits.grammar_timeout_s <= 0:
        ctx.error(("service", "limits", "grammar_timeout_s"), "must be > 0")


def _check_rules(policy: Policy, ctx: Issues) -> None:
    rules = policy.routing.rules
    if not rules:
        ctx.error(("routing", "rules"), "at least one rule is required (the last one without 'when')")
        return
    names: dict[str, int] = {}
    covered_below: tuple[float, int] | None = None  # highest score_below of score-only rules so far
    ordered = policy.routing.ordered_rules  # evaluation order: priority, then file order
    for pos, (i, rule) in enumerate(ordered):
        p: FieldPath = ("routing", "rules", i)
        if rule.name in names:
            ctx.error((*p, "name"), f"duplicate rule name '{rule.name}' (also rules[{names[rule.name]}])")
        names[rule.name] = i
        _check_name(ctx, (*p, "name"), rule.name, "rule name")
        if rule.tier not in policy.tiers:
            ctx.error(
                (*p, "tier"),
                f"names tier '{rule.tier}', which does not exist; tiers: {', '.join(policy.tiers)}",
            )
        if pos > 0 and ordered[pos - 1][1].when is None:
            j, prev = ordered[pos - 1]
            ctx.error(p, f"unreachable: rules[{j}] ('{prev.name}') has no 'when' and matches everything")
        w = rule.when
        if w is None:
            continue
        _check_condition(w, (*p, "when"), ctx)
        if w.is_score_only and w.score_below is not None and w.score_at_least is None:
            if covered_below is not None and w.score_below <= covered_below[0]:
                j = covered_below[1]
                ctx.error(
                    (*p, "when", "score_below"),
                    f"thresholds out of order: {w.score_below} must be greater than "
                    f"rules[{j}].when.score_below ({covered_below[0]}), or this rule never matches",
                )
                continue
            covered_below = (w.score_below, i)
        for j, earlier in ordered[:pos]:
            if earlier.when == w:
                ctx.error(
                    p, f"unreachable: rules[{j}] ('{earlier.name}') has the same conditions and comes first"
                )
                break
            if earlier.when is not None and subsumes(earlier.when, w):
                ctx.error(
                    p,
                    f"unreachable: rules[{j}] ('{earlier.name}') comes first and matches every request "
                    "this rule matches (its conditions are a subset of these)",
                )
                break
    last_i, last = ordered[-1]
    if last.when is not None:
        ctx.error(("routing", "rules", last_i), "the last rule must have no 'when' (the default rule)")


def _looser_list(a: list[Any] | None, b: list[Any] | None) -> bool:
    return a is None or (b is not None and set(b) <= set(a))


def subsumes(a: Condition, b: Condition) -> bool:
    """True when every request that ``b`` matches also matches ``a`` (conservative: False if unsure).

    Each condition ``a`` sets must be implied by ``b``: the same field with an equal or stricter
    value. Combinators only count when they are identical.
    """
    checks = (
        a.score_below is None or (b.score_below is not None and b.score_below <= a.score_below),
        a.score_at_least is None or (b.score_at_least is not None and b.score_at_least >= a.score_at_least),
        a.confidence_below is None
        or (b.confidence_below is not None and b.confidence_below <= a.confidence_below),
        a.prompt_tokens_above is None
        or (b.prompt_tokens_above is not None and b.prompt_tokens_above >= a.prompt_tokens_above),
        a.prompt_tokens_at_most is None
        or (b.prompt_tokens_at_most is not None and b.prompt_tokens_at_most <= a.prompt_tokens_at_most),
        a.turns_at_least is None or (b.turns_at_least is not None and b.turns_at_least >= a.turns_at_least),
        a.turns_at_most is None or (b.turns_at_most is not None and b.turns_at_most <= a.turns_at_most),
        a.has_tools is None or a.has_tools == b.has_tools,
        a.logprobs is None or a.logprobs == b.logprobs,
        _looser_list(a.predicted, b.predicted),
        _looser_list(a.model, b.model),
        _looser_list(a.tenant, b.tenant),
        _looser_list(a.response_format, b.response_format),
        _looser_list(a.language, b.language),
        a.keywords is None
        or (
            b.keywords is not None
            and {k.casefold() for k in b.keywords} <= {k.casefold() for k in a.keywords}
        ),
        _looser_headers(a.headers, b.headers),
        a.any_of is None or a.any_of == b.any_of,
        a.all_of is None or a.all_of == b.all_of,
        a.not_ is None or a.not_ == b.not_,
    )
    return all(checks)


def _looser_headers(a: dict[str, str | list[str]] | None, b: dict[str, str | list[str]] | None) -> bool:
    """Every header ``a`` requires, ``b`` requires too, with a subset of ``a``'s allowed values."""
    if a is None:
        return True
    if b is None:
        return False
    b_lower = {k.lower(): v for k, v in b.items()}
    for name, allowed in a.items():
        other = b_lower.get(name.lower())
        if other is None or not _looser_list(_header_values(allowed), _header_values(other)):
            return False
    return True


def _header_values(v: str | list[str]) -> list[str]:
    return [v] if isinstance(v, str) else list(v)


def _check_condition(w: Condition, p: FieldPath, ctx: Issues) -> None:
    for fname in ("score_below", "score_at_least", "confidence_below"):
        v = getattr(w, fname)
        if v is not None and not 0 <= v <= 1:
            ctx.error((*p, fname), f"must be in [0, 1], got {v}")
    if w.score_below is not None and w.score_at_least is not None and w.score_at_least >= w.score_below:
        ctx.error((*p, "score_at_least"), "must be below score_below, or the rule never matches")
    if (
        w.prompt_tokens_above is not None
        and w.prompt_tokens_at_most is not None
        and w.prompt_tokens_above >= w.prompt_tokens_at_most
    ):
        ctx.error(
            (*p, "prompt_tokens_above"), "must be below prompt_tokens_at_most, or the rule never matches"
        )
    for i, cls in enumerate(w.predicted or []):
        if cls not in ("small", "medium", "large"):
            ctx.error((*p, "predicted", i), f"must be small, medium or large, got '{cls}'")
    for fname in ("turns_at_least", "turns_at_most", "prompt_tokens_above", "prompt_tokens_at_most"):
        v = getattr(w, fname)
        if v is not None and v < 0:
            ctx.error((*p, fname), f"must be >= 0, got {v}")
    if w.turns_at_least is not None and w.turns_at_most is not None and w.turns_at_least > w.turns_at_most:
        ctx.error((*p, "turns_at_least"), "must be at most turns_at_most, or the rule never matches")
    for fname in ("keywords", "language", "response_format", "any_of", "all_of"):
        if getattr(w, fname) == []:
            ctx.error((*p, fname), "is an empty list and never matches; remove it or name at least one")
    for i, kw in enumerate(w.keywords or []):
        if not kw.strip():
            ctx.error((*p, "keywords", i), "must not be blank")
    for i, code in enumerate(w.language or []):
        if not _LANGUAGE.fullmatch(code):
            ctx.error(
                (*p, "language", i),
                f"must be an ISO 639-1 code such as 'en' or 'zh' (or 'und'), got '{code}'",
            )
    for fname in ("any_of", "all_of"):
        for i, sub in enumerate(getattr(w, fname) or []):
            _check_condition(sub, (*p, fname, i), ctx)
    if w.not_ is not None:
        _check_condition(w.not_, (*p, "not"), ctx)
    if all(getattr(w, f.name) is None for f in dataclasses.fields(w)):
        ctx.error(p, "is empty; remove 'when' for a default rule")
