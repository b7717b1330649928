"""A request body (``router.openai.schemas``) turned into the one typed request the service passes
down: ``parse_chat`` / ``parse_completion`` validate it (each field this server cannot honour is a
400 naming it), check it against the policy's bounds (``service.limits``), compile its output
contract and conversation (``router.openai.structured``) and read its sampling fields, once;
nothing downstream reads the body behind ``Generation``'s fields (the remote tier forwards it as
sent, the shadow copies it).

Bounds on what one request may ask bound work that grows with the request and that the rest of
the traffic would otherwise pay for: a ``logit_bias`` entry is applied to every row at every engine
step, a JSON schema node becomes grammar states compiled before the first token, a tool adds to
the prompt and to the tool-call grammar. Each refusal is a 400 in OpenAI's shape naming the field
and the limit (``code``: ``limit_exceeded``), so a client can tell which bound it hit and by how
much.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import msgspec

from router.errors import BadRequestError
from router.openai.schemas import (
    MAX_N,
    MAX_STOP_LENGTH,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    TEXT_PARTS,
    ChatCompletionRequest,
    CompletionRequest,
)
from router.openai.structured import compile_chat, compile_completion

if TYPE_CHECKING:
    from router.openai.structured import OutputSpec
    from router.policy.schema import LimitsConfig

__all__ = [
    "CallContext",
    "Generation",
    "Prompt",
    "Sampling",
    "check_limits",
    "completion_id",
    "completion_prompts",
    "parse_chat",
    "parse_completion",
    "parse_completions",
    "schema_size",
    "stop_list",
    "template_options",
    "validate_chat",
    "validate_completion",
    "validate_sampling",
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
        raise _refuse("prompt", f"has {len(prompts)} prompts", limits.max_prompts, "max_prompts")
    gens = []
    for prompt in prompts:
        one = req if len(prompts) == 1 else msgspec.structs.replace(req, prompt=prompt)
        if isinstance(prompt, list) and decode is None:
            _unsupported("prompt", "token-id prompts need a local tier's tokenizer")
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


# -- validation ------------------------------------------------------------------------------------
def _finite(name: str, value: float | None, lo: float, hi: float) -> None:
    if value is None:
        return
    if not math.isfinite(value) or not lo <= value <= hi:
        raise BadRequestError(f"'{name}' must be a number in [{lo}, {hi}], got {value}.", param=name)


def validate_sampling(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Reject out-of-range or non-finite sampling parameters with a 400 that names the field."""
    _finite("temperature", req.temperature, 0.0, 2.0)
    _finite("top_p", req.top_p, 0.0, 1.0)
    if req.top_p is not None and req.top_p == 0.0:
        raise BadRequestError("'top_p' must be greater than 0.", param="top_p")
    _finite("presence_penalty", req.presence_penalty, -2.0, 2.0)
    _finite("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    _finite("repetition_penalty", req.repetition_penalty, 0.01, 10.0)
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise BadRequestError(f"'n' must be an integer in [1, {MAX_N}], got {req.n}.", param="n")
    _finite("min_p", req.min_p, 0.0, 1.0)
    for token, bias in (req.logit_bias or {}).items():
        if not (token.isascii() and token.isdigit()):  # "²".isdigit() is true; int("²") raises
            raise BadRequestError(
                f"'logit_bias' keys must be token ids (integers as strings), got {token!r}.",
                param="logit_bias",
            )
        if not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
            raise BadRequestError(
                f"'logit_bias' values must be in [-100, 100], got {bias}.", param="logit_bias"
            )
    if req.stream_options is not None and not req.stream:
        raise BadRequestError(
            "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise BadRequestError(
            "'stream_options.include_obfuscation' is not supported: chunks are sent without padding.",
            param="stream_options.include_obfuscation",
            code="unsupported_value",
        )
    if req.top_k is not None and req.top_k < 0:
        raise BadRequestError("'top_k' must be >= 0.", param="top_k")
    _validate_vllm(req)
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise BadRequestError("'seed' is out of range.", param="seed")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name, None)
        if value is not None and value < 1:
            raise BadRequestError(f"'{name}' must be at least 1, got {value}.", param=name)
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise BadRequestError(f"'stop' accepts at most {MAX_STOP_SEQUENCES} sequences.", param="stop")
    if any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise BadRequestError(
            f"each 'stop' sequence must be at most {MAX_STOP_LENGTH} characters.", param="stop"
        )


def _validate_vllm(req: ChatCompletionRequest | CompletionRequest) -> None:
    """vLLM's extensions: honoured (``stop_token_ids``, ``include_stop_str_in_output``,
    ``min_tokens``), or refused where this engine has no such mode (``skip_special_tokens: false``)."""
    ids = req.stop_token_ids or []
    if len(ids) > MAX_STOP_TOKEN_IDS or any(i < 0 for i in ids):
        raise BadRequestError(
            f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} token ids >= 0.", param="stop_token_ids"
        )
    if req.min_tokens is not None:
        if req.min_tokens < 0:
            raise BadRequestError("'min_tokens' must be >= 0.", param="min_tokens")
        asked = req.max_tokens
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            asked = req.max_completion_tokens
        if asked is not None and req.min_tokens > asked:
            raise BadRequestError(
                f"'min_tokens' ({req.min_tokens}) must not exceed the token limit ({asked}).",
                param="min_tokens",
            )
    if req.skip_special_tokens is False:
        _unsupported("skip_special_tokens", "special tokens are always left out of the text")


def _unsupported(param: str, why: str) -> None:
    raise BadRequestError(
        f"'{param}' is not supported by this server: {why}.", param=param, code="unsupported_value"
    )


# apply_chat_template's own arguments: a template variable of one of these names would change how
# the prompt is built (or tokenized), not what the template says.
_TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def validate_chat(req: ChatCompletionRequest) -> None:
    """Chat-only fields: each one this server cannot honour is a 400 that names it."""
    validate_sampling(req)
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise BadRequestError(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                param="continue_final_message",
            )
        if not req.messages or req.messages[-1].role != "assistant":
            raise BadRequestError(
                "'continue_final_message' needs the last message to be the assistant's.",
                param="continue_final_message",
            )
    for name in req.chat_template_kwargs or {}:
        if not name.isidentifier() or name in _TEMPLATE_ARGUMENTS:
            raise BadRequestError(
                f"'chat_template_kwargs' may name template variables only, not {name!r}.",
                param="chat_template_kwargs",
            )
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequestError(
                f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}].", param="top_logprobs"
            )
        if not req.logprobs:
            raise BadRequestError("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    if req.response_format is not None:
        rf = req.response_format
        if rf.type not in ("text", "json_object", "json_schema"):
            raise BadRequestError(
                f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {rf.type!r}.",
                param="response_format.type",
            )
        if rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema is None):
            param = "response_format.json_schema" + ("" if rf.json_schema is None else ".schema")
            raise BadRequestError(
                f"'{param}' is required when 'response_format.type' is 'json_schema'.", param=param
            )
    if req.functions is not None or req.function_call is not None:
        _unsupported(
            "functions" if req.functions is not None else "function_call", "use 'tools' and 'tool_choice'"
        )
    if req.audio is not None:
        _unsupported("audio", "the models answer in text only")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        _unsupported("modalities", "the models answer in text only")
    if req.prediction is not None:
        _unsupported("prediction", "predicted outputs are not used for drafting")
    if req.reasoning_effort not in (None, "none"):
        _unsupported("reasoning_effort", "the models are not reasoning models")
    if req.moderation is not None:
        _unsupported("moderation", "there is no moderation model")
    if req.prompt_cache_options is not None and req.prompt_cache_options.get("mode") == "explicit":
        _unsupported(
            "prompt_cache_options", "the prefix cache is automatic; explicit breakpoints do not exist here"
        )
    if req.verbosity is not None:
        _unsupported("verbosity", "the models have no verbosity control")
    if req.web_search_options is not None:
        _unsupported("web_search_options", "there is no web search")
    if req.service_tier not in (None, "auto", "default"):
        _unsupported("service_tier", "only 'auto' and 'default' exist here")
    if req.store:
        _unsupported("store", "completions are not stored")
    if req.prompt_cache_retention not in (None, "in_memory"):
        _unsupported("prompt_cache_retention", "the prefix cache lives in memory only")
    if req.metadata is not None and (
        len(req.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in req.metadata.items())
    ):
        raise BadRequestError(
            "'metadata' allows 16 pairs, keys <= 64 and values <= 512 chars.", param="metadata"
        )
    for i, m in enumerate(req.messages):
        if m.audio is not None:
            _unsupported(f"messages[{i}].audio", "the models take text only")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type not in TEXT_PARTS and not (part.type == "refusal" and m.role == "assistant"):
                    _unsupported(
                        f"messages[{i}].content[{j}].type", f"'{part.type}' parts (the models read text only)"
                    )


def validate_completion(req: CompletionRequest) -> None:
    validate_sampling(req)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequestError(f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}].", param="logprobs")
    n = req.n or 1
    if req.best_of is not None:
        if not n <= req.best_of <= MAX_N:
            raise BadRequestError(
                f"'best_of' must be an integer in [n, {MAX_N}], got {req.best_of}.", param="best_of"
            )
        if req.stream and req.best_of > n:
            raise BadRequestError("'best_of' greater than 'n' cannot be streamed.", param="best_of")
    if req.suffix:
        _unsupported("suffix", "the models have no fill-in-the-middle mode")
    if req.echo and req.logprobs is not None and max(n, req.best_of or n) > 1:
        # The prompt's logprobs are computed on one choice's prompt (the others share its KV).
        _unsupported("echo", "echo with logprobs takes one choice (n and best_of 1)")


# -- bounds ----------------------------------------------------------------------------------------
def _refuse(param: str, what: str, limit: int, key: str) -> BadRequestError:
    return BadRequestError(
        f"'{param}' {what}; the limit is {limit} (service.limits.{key}).",
        param=param,
        code="limit_exceeded",
    )


def schema_size(schema: Any, max_nodes: int, max_depth: int) -> tuple[int, int, int]:
    """``(nodes, depth, widest)`` of a JSON value (``widest``: the most ``properties`` of one
    object); counting stops once nodes or depth pass their bound (so a huge schema costs no more
    than ``max_nodes`` steps to refuse)."""
    nodes = 0
    deepest = 0
    widest = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        deepest = max(deepest, depth)
        if nodes > max_nodes or deepest > max_depth:
            break
        if isinstance(value, dict):
            props = value.get("properties")
            if isinstance(props, dict):
                widest = max(widest, len(props))
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return nodes, deepest, widest


def _check_schema(param: str, schema: Any, limits: LimitsConfig) -> None:
    nodes, depth, widest = schema_size(schema, limits.max_schema_nodes, limits.max_schema_depth)
    if nodes > limits.max_schema_nodes:
        raise _refuse(param, "has too many schema nodes", limits.max_schema_nodes, "max_schema_nodes")
    if depth > limits.max_schema_depth:
        raise _refuse(param, "is nested too deeply", limits.max_schema_depth, "max_schema_depth")
    if widest > limits.max_schema_properties:
        why = f"has an object of {widest} properties"
        raise _refuse(param, why, limits.max_schema_properties, "max_schema_properties")


def check_limits(req: ChatCompletionRequest | CompletionRequest, limits: LimitsConfig) -> None:
    """Raise ``BadRequestError`` naming the first bound ``req`` exceeds."""
    if req.logit_bias is not None and len(req.logit_bias) > limits.max_logit_bias:
        raise _refuse(
            "logit_bias", f"has {len(req.logit_bias)} entries", limits.max_logit_bias, "max_logit_bias"
        )
    if not isinstance(req, ChatCompletionRequest):
        return  # a completion's prompts are counted once known (parse_completions)
    if req.tools is not None:
        if len(req.tools) > limits.max_tools:
            raise _refuse("tools", f"has {len(req.tools)} tools", limits.max_tools, "max_tools")
        # All tools together: the tool-call grammar is compiled from their union.
        _check_schema("tools", req.tools, limits)
    fmt = req.response_format
    if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema is not None:
        _check_schema("response_format.json_schema.schema", fmt.json_schema.schema, limits)


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(s for s in stop if s)


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
