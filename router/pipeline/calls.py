"""The values one request carries through the service: who is calling, what is generated, what
comes back. Plain data, imported by the service, the cache and the response writer alike, so none
of them needs another's module (no import circle).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.openai.schemas import ChatCompletionRequest, CompletionRequest, stop_list

if TYPE_CHECKING:
    from router.openai.structured import OutputSpec

__all__ = ["CachedAnswer", "CallContext", "Completion", "Generation", "Sampling"]


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


@dataclass(slots=True)
class Completion:
    """What the HTTP layer needs: routing headers plus a body or an SSE byte stream."""

    headers: dict[str, str]
    body: dict[str, Any] | None = None
    stream: AsyncIterator[bytes] | None = None


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
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            logit_bias=dict(req.logit_bias or {}),
        )


@dataclass(slots=True)
class Generation:
    """One generation request after parsing: the normalized conversation or prompt."""

    kind: str  # chat | completion
    request: ChatCompletionRequest | CompletionRequest
    messages: list[dict[str, str]] | None
    prompt: str | None
    stream: bool
    include_usage: bool
    last_user: str = ""
    ctx: CallContext | None = None
    output: OutputSpec | None = None
    """What the output must be beyond text (format, tools, logprobs, n); see router/openai/structured.py."""
    sampling: Sampling = field(init=False)
    """The request's sampling fields, derived from ``request`` (again when a copy replaces it)."""

    def __post_init__(self) -> None:
        self.sampling = Sampling.of(self.request)

    @classmethod
    def parsed(
        cls,
        request: ChatCompletionRequest | CompletionRequest,
        *,
        messages: list[dict[str, str]] | None = None,
        prompt: str | None = None,
        last_user: str = "",
        output: OutputSpec | None = None,
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
            output=output,
        )


_Gen = Generation  # the name other modules used before the split


@dataclass(slots=True, frozen=True)
class CachedAnswer:
    """A stored answer found by the response cache; the service turns it into a ``Completion``."""

    body: dict[str, Any]
    tier: str
    rule: str
    score: str
    kind: str  # exact | semantic
    similarity: float = 1.0
