"""A request body (``router.openai.schemas``) turned into the one typed request the service passes
down: ``parse_chat`` / ``parse_completion`` validate it (each field this server cannot honour is a
400 naming it, ``router.openai.validation``), check it against the policy's bounds
(``service.limits``, ``router.openai.bounds``), compile its output contract and conversation
(``router.openai.structured``) and read its sampling fields, once; nothing downstream reads the
body behind ``Generation``'s fields (the remote tier forwards it as sent, the shadow copies it).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import msgspec

from router.errors import BadRequestError
from router.openai.bounds import check_limits, limit_refusal
from router.openai.schemas import ChatCompletionRequest, CompletionRequest
from router.openai.structured import compile_chat, compile_completion
from router.openai.validation import unsupported, validate_chat, validate_completion

if TYPE_CHECKING:
    from router.openai.structured import OutputSpec
    from router.policy.schema import LimitsConfig

__all__ = [
    "CallContext",
    "Generation",
    "Prompt",
    "Sampling",
    "completion_id",
    "completion_prompts",
    "parse_chat",
    "parse_completion",
    "parse_completions",
    "stop_list",
    "template_options",
]


def template_options(req: ChatCompletionRequest) -> dict[str, Any]:
    """What a chat's prompt is rendered with besides its messages: ``chat_template_kwargs`` and
    how it ends (a new assistant turn, none, or the last assistant message continued)."""
    cont = bool(req.continue_final_message)
    generation = req.add_generation_prompt if req.add_generation_prompt is not None else not cont
    return {
        **(req.chat_template_kwargs or {}),
        "add_generation_prompt": generation,
        "continue_final_message": cont,
    }


def parse_chat(
    req: ChatCompletionRequest, limits: LimitsConfig, ctx: CallContext | None = None
) -> Generation:
    """A chat body as the typed request (a 400 naming the field for anything it may not ask)."""
    validate_chat(req)
    check_limits(req, limits)
    if not req.messages:
        raise BadRequestError("'messages' must contain at least one message.", param="messages")
    # Tools, tool calls and tool results as plain messages (the generic tool template).
    spec, raw, messages = compile_chat(req)
    last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    return Generation.parsed(
        req, messages=messages, raw_messages=raw, last_user=last_user, output=spec, ctx=ctx
    )


Prompt = str | list[int]
"""One completions prompt: text, or token ids of the tiers' tokenizer."""

_MAX_TOKEN_ID = 2**31 - 1


def completion_prompts(prompt: str | list[Any]) -> list[Prompt]:
    """The prompts of a completions body, in OpenAI's four forms: a string, a list of strings, a
    list of token ids, or a list of such lists (lm-evaluation-harness sends the last)."""
    if isinstance(prompt, str):
        return [prompt]

    def token_ids(value: Any) -> bool:
        return (
            isinstance(value, list)
            and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_TOKEN_ID for t in value)
        )

    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if token_ids(prompt):
        return [list(prompt)]
    if prompt and all(token_ids(p) for p in prompt):
        return [list(p) for p in prompt]
    raise BadRequestError(
        "'prompt' must be a string, a non-empty list of strings, a list of token ids (integers >= 0) "
        "or a list of such lists.",
        param="prompt",
    )


def parse_completions(
    req: CompletionRequest,
    limits: LimitsConfig,
    ctx: CallContext | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> list[Generation]:
    """A completions body as one typed request per prompt: a list of prompts (OpenAI's batch form)
    is answered prompt by prompt, each routed on its own text, and merged (router/openai/batch.py).
    A token-id prompt is routed (and echoed) as ``decode`` renders it and generated from its ids;
    without ``decode`` (no local tier's tokenizer) it is a 400."""
    validate_completion(req)
    check_limits(req, limits)
    prompts = completion_prompts(req.prompt)
    if len(prompts) > limits.max_prompts:
        raise limit_refusal("prompt", f"has {len(prompts)} prompts", limits.max_prompts, "max_prompts")
    gens = []
    for prompt in prompts:
        one = req if len(prompts) == 1 else msgspec.structs.replace(req, prompt=prompt)
        if isinstance(prompt, list) and decode is None:
            unsupported("prompt", "token-id prompts need a local tier's tokenizer")
        text = decode(prompt) if isinstance(prompt, list) and decode is not None else str(prompt)
        gen = Generation.parsed(one, prompt=text, last_user=text, output=compile_completion(one), ctx=ctx)
        gen.prompt_ids = prompt if isinstance(prompt, list) else None
        gens.append(gen)
    return gens


def parse_completion(
    req: CompletionRequest, limits: LimitsConfig, ctx: CallContext | None = None
) -> Generation:
    """A completions body of one prompt (a string, or a list of one) as the typed request."""
    gens = parse_completions(req, limits, ctx)
    if len(gens) != 1:
        raise BadRequestError(
            "This call takes one prompt; a list of prompts is answered by parse_completions.", param="prompt"
        )
    return gens[0]


@dataclass(slots=True)
class CallContext:
    headers: Mapping[str, str]
    """Lower-cased request headers."""
    tenant: str | None = None
    """The caller's tenant: from its API key (or, behind ``trust_tenant_header``, ``x-tenant``)."""
    no_cache: bool = False
    span: Any = None
    """The request's server span: parent of classify/decide/cache/queue/prefill/decode spans."""
    principal: str | None = None
    """Who is calling, for per-caller limits: the tenant, else the API key's fingerprint."""
    tenant_label: str = "-"
    """The tenant as a metric label: a tenant the policy names, ``other``, or ``-`` (bounded)."""
    partition: str = field(init=False)
    """Whose data this request may see and warm (response cache, semantic scope, sessions,
    prefix cache, feedback): ``t:<tenant>`` when the caller has a tenant, else ``k:<key
    fingerprint>`` (a digest prefix, never the key), else ``-`` (an anonymous caller of an
    ``open`` server). Two keys without a tenant are two partitions. Fixed when the context is
    built: identifying the caller later only fills ``principal`` from the tenant, which leaves it
    as it is."""

    def __post_init__(self) -> None:
        if self.tenant is not None:
            self.partition = "t:" + self.tenant
        else:
            self.partition = "k:" + self.principal if self.principal is not None else "-"


@dataclass(frozen=True, slots=True)
class Sampling:
    """A request's sampling fields, read once from its validated body; a backend lays them over
    its tier's defaults (None: the tier's) and checks token ids against its own vocabulary."""

    max_tokens: int | None
    """What the caller asked for: chat ``max_completion_tokens`` else ``max_tokens``; completions
    ``max_tokens`` else OpenAI's default of 16. None: the tier's default."""
    max_tokens_param: str
    """The field a context overflow is blamed on."""
    temperature: float | None
    top_p: float | None
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    ignore_eos: bool
    min_tokens: int
    stop_token_ids: tuple[int, ...]
    include_stop_str_in_output: bool
    logit_bias: Mapping[str, float]

    @classmethod
    def of(cls, req: ChatCompletionRequest | CompletionRequest) -> Sampling:
        if isinstance(req, ChatCompletionRequest):
            asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            param = "max_completion_tokens"
        else:
            asked = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's completions default
            param = "max_tokens"
        return cls(
            max_tokens=asked,
            max_tokens_param=param,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            stop=stop_list(req.stop),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            min_p=req.min_p or 0.0,
            ignore_eos=bool(req.ignore_eos),
            min_tokens=req.min_tokens or 0,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            logit_bias=dict(req.logit_bias or {}),
        )


@dataclass(slots=True)
class Generation:
    """One generation request after parsing: everything downstream reads, as plain fields."""

    kind: str  # chat | completion
    request: ChatCompletionRequest | CompletionRequest
    messages: list[dict[str, str]] | None
    """The conversation as plain messages (generic tool template); None for a completion."""
    prompt: str | None
    stream: bool
    include_usage: bool
    last_user: str = ""
    ctx: CallContext | None = None
    output: OutputSpec | None = None
    """What the output must be beyond text (format, tools, logprobs, n); see router/openai/structured.py."""
    raw_messages: list[dict[str, Any]] | None = None
    """The messages as OpenAI-shaped dicts, tool calls kept (``structured.raw_messages``): what a
    model whose own chat template renders tools is given."""
    response_id: str = ""
    """The id ``POST /v1/feedback`` takes (the ``x-router-response-id`` header); minted when the
    request is parsed, unless given."""
    sampling: Sampling = field(init=False)
    """The request's sampling fields, derived from ``request`` (again when a copy replaces it)."""
    prompt_ids: list[int] | None = None
    """A completion's prompt as the client's token ids (``prompt`` is then their decoded text):
    a local tier generates from exactly these."""
    template_kwargs: dict[str, Any] = field(init=False)
    """What a local tier's ``apply_chat_template`` is given besides the messages: the chat's
    ``chat_template_kwargs`` variables and how the prompt ends (``add_generation_prompt``,
    ``continue_final_message``); for a completion, nothing."""

    def __post_init__(self) -> None:
        self.sampling = Sampling.of(self.request)
        req = self.request
        self.template_kwargs = template_options(req) if isinstance(req, ChatCompletionRequest) else {}
        if not self.response_id:
            self.response_id = completion_id("chatcmpl" if self.kind == "chat" else "cmpl")

    @classmethod
    def parsed(
        cls,
        request: ChatCompletionRequest | CompletionRequest,
        *,
        messages: list[dict[str, str]] | None = None,
        raw_messages: list[dict[str, Any]] | None = None,
        prompt: str | None = None,
        last_user: str = "",
        output: OutputSpec | None = None,
        ctx: CallContext | None = None,
    ) -> Generation:
        """A validated request and what was parsed from it: its kind, and whether it streams
        and with usage, read from the request itself."""
        options = request.stream_options
        return cls(
            "chat" if isinstance(request, ChatCompletionRequest) else "completion",
            request,
            messages,
            prompt,
            bool(request.stream),
            bool(options and options.include_usage),
            last_user=last_user,
            ctx=ctx,
            output=output,
            raw_messages=raw_messages,
        )

    def shadow_copy(self, tier: str, max_tokens: int) -> Generation:
        """This request as a shadow answer asks it of ``tier``: one choice, not streamed, at most
        ``max_tokens`` (or the request's own limit, when lower) - the same prompt, sampling and
        output contract, so the two answers compare like for like."""
        limit = min(max_tokens, self.sampling.max_tokens or max_tokens)
        changes: dict[str, Any] = {"stream": False, "stream_options": None, "n": 1, "max_tokens": limit}
        if isinstance(self.request, CompletionRequest):
            changes["best_of"] = None
        else:
            changes["max_completion_tokens"] = None
        return replace(
            self,
            request=msgspec.structs.replace(self.request, model=tier, **changes),
            stream=False,
            include_usage=False,
            # One choice generated, as asked of the request: the spec decides how many sequences
            # are submitted, and the shadow reads only the first (the rest would run unaborted).
            output=replace(self.output, n=1, best_of=1) if self.output is not None else None,
        )


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(s for s in stop if s)


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
