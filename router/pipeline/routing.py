"""What a routing decision is taken on, besides the classifier's score: the prompt's size (its
token count, exact only where a ``prompt_tokens_*`` rule could turn on it; a prompt certainly
longer than every local tier refused from its bytes), the request's shape signals and expected
output, and ``Routed``, the decision with what it was taken on (``RouterService.route``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.errors import BadRequestError

if TYPE_CHECKING:
    from classifier import ComplexityScore
    from router.backends.tierset import TierSet
    from router.openai.request import Generation
    from router.pipeline.admission import TierPressure
    from router.policy.decide import Decision
    from router.policy.schema import Policy

__all__ = [
    "Routed",
    "collected_max_tokens",
    "count_tokens",
    "count_tokens_off_loop",
    "expected_output",
    "refuse_past_context",
    "refuse_unfittable",
    "request_signals",
]


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


def count_tokens(
    tiers: TierSet | None, policy: Policy, messages: list[dict[str, str]] | None, prompt: str | None
) -> int:
    """Prompt tokens for the ``prompt_tokens_*`` rules: exact when a rule could turn on it."""
    estimate, text, tok = _token_plan(tiers, policy, messages, prompt)
    return estimate if tok is None else len(tok.encode(text, add_special_tokens=False))


async def count_tokens_off_loop(
    tiers: TierSet | None, policy: Policy, messages: list[dict[str, str]] | None, prompt: str | None
) -> int:
    """``count_tokens`` with the tokenization (0.6-0.9 s for a 1 MB prompt) in a worker
    thread: every other stream and probe keeps its event loop meanwhile."""
    estimate, text, tok = _token_plan(tiers, policy, messages, prompt)
    if tok is None:
        return estimate
    return len(await asyncio.to_thread(tok.encode, text, add_special_tokens=False))


def refuse_unfittable(
    tiers: TierSet | None, messages: list[dict[str, str]] | None, prompt: str | None
) -> None:
    """A 400 ``context_length_exceeded`` for a prompt that is certainly longer than every
    tier's ``max_model_len``, from its byte count alone: tokenizing a 1 MB prompt costs a
    second of CPU beside the engines, only to refuse it. Tiers served elsewhere (remote) have
    their own limits, so only an all-local tier set is checked."""
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


def refuse_past_context(tiers: TierSet, policy: Policy, tier: str, gen: Generation) -> None:
    """A 400 naming ``max_tokens`` when it alone is more than the serving local tier's context
    window (``max_model_len``) holds, as vLLM refuses it; below that, an answer that reaches the
    window ends with ``finish_reason: length``. A remote tier judges its own limits."""
    asked = gen.sampling.max_tokens
    cfg = policy.tiers.get(tier)
    backend = tiers.tiers.get(tier)
    if asked is None or cfg is None or backend is None or backend.is_remote:
        return
    if asked > cfg.max_model_len:
        raise BadRequestError(
            f"'max_tokens' is too large: {asked}. Tier '{tier}' has a context window of "
            f"{cfg.max_model_len} tokens (prompt and completion together).",
            param="max_completion_tokens" if _asked_completion_tokens(gen) else "max_tokens",
            code="context_length_exceeded",
        )


def _asked_completion_tokens(gen: Generation) -> bool:
    return getattr(gen.request, "max_completion_tokens", None) is not None


def _token_plan(
    tiers: TierSet | None, policy: Policy, messages: list[dict[str, str]] | None, prompt: str | None
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
    tok = tiers.counting_tokenizer() if could_matter and tiers is not None else None
    if tok is None:
        estimate = min(upper_bound, max(1, len(text) // 4)) if thresholds else len(text) // 4
        return estimate, text, None
    return 0, text, tok


def collected_max_tokens(gen: Generation | None) -> int | None:
    """The output tokens a non-streaming request asks for (None for a stream, or when unknown):
    what admission checks against the client's deadline."""
    return None if gen is None or gen.stream else gen.sampling.max_tokens


def request_signals(
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


def expected_output(policy: Policy, gen: Generation | None) -> dict[str, int]:
    """Output tokens a request is priced at on each tier (load-aware routing): what it asks for,
    else the tier's default ``max_tokens``, at most the tier's context window (where it stops)."""
    asked = gen.sampling.max_tokens if gen is not None else None
    return {
        name: min(asked or cfg.defaults.max_tokens, cfg.max_model_len) for name, cfg in policy.tiers.items()
    }
