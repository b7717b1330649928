"""OpenAI wire format: request bodies (validated by msgspec at the edge) and response builders.

Unknown-field policy: every field of OpenAI's API reference is declared here and either honoured
or refused with a 400 naming it (``validate_chat`` / ``validate_completion``). A top-level field
that is neither OpenAI's nor one of the declared extensions (``VLLM_EXTENSIONS``) is
refused too, with OpenAI's own message
("Unrecognized request argument supplied: <name>"): a misspelt ``respone_format`` must not return
a 200 that silently ignores it. Inside ``messages`` unknown keys are ignored, because clients send
assistant messages back with response-only keys (``annotations``, ``refusal``, ``audio: null``).
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

import msgspec

from router.errors import BadRequestError

__all__ = [
    "VLLM_EXTENSIONS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "JsonSchemaFormat",
    "ResponseFormat",
    "RouteBody",
    "StreamOptions",
    "validate_chat",
    "validate_completion",
    "validate_sampling",
]

MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 256
MAX_N = 16
"""Most choices one request may ask for (``n``, ``best_of``): each is a sequence in the batch."""
MAX_TOP_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
TEXT_PARTS = ("text", "input_text")


class ContentPart(msgspec.Struct, forbid_unknown_fields=False):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=False):
    name: str
    arguments: str = "{}"


class MessageToolCall(msgspec.Struct, forbid_unknown_fields=False):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    audio: dict[str, Any] | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool = False
    """vLLM's extension: every chunk carries the usage so far (guidellm sends it)."""


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions that vLLM also accepts.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    min_tokens: int | None = None


VLLM_EXTENSIONS = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "min_tokens",
    }
)
"""Request fields beyond OpenAI's reference, as vLLM's OpenAI server accepts them."""


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Accepted with their documented meaning where this server can keep it, refused otherwise
    # (see validate_chat).
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    moderation: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[str]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class RouteBody(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """``POST /v1/route``: a chat ``messages`` list or a plain ``prompt``; ``model`` defaults to auto."""

    model: str = "auto"
    messages: list[ChatMessage] | None = None
    prompt: str | None = None


def _finite(name: str, value: float | None, lo: float, hi: float) -> None:
    if value is None:
        return
    if not math.isfinite(value) or not lo <= value <= hi:
        raise BadRequestError(f"'{name}' must be a number in [{lo}, {hi}], got {value}.", param=name)


def validate_sampling(req: _SamplingFields) -> None:
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


def _validate_vllm(req: _SamplingFields) -> None:
    """vLLM's extensions: honoured (``stop_token_ids``, ``include_stop_str_in_output``), or refused
    where this engine has no such mode (``min_tokens`` > 0, ``skip_special_tokens: false``)."""
    ids = req.stop_token_ids or []
    if len(ids) > MAX_STOP_TOKEN_IDS or any(i < 0 for i in ids):
        raise BadRequestError(
            f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} token ids >= 0.", param="stop_token_ids"
        )
    if req.min_tokens is not None:
        if req.min_tokens < 0:
            raise BadRequestError("'min_tokens' must be >= 0.", param="min_tokens")
        if req.min_tokens > 0:
            _refuse("min_tokens", "the sampler has no end-of-sequence mask before a minimum length")
    if req.skip_special_tokens is False:
        _refuse("skip_special_tokens", "special tokens are always left out of the text")


def _refuse(param: str, why: str) -> None:
    raise BadRequestError(
        f"'{param}' is not supported by this server: {why}.", param=param, code="unsupported_value"
    )


def validate_chat(req: ChatCompletionRequest) -> None:
    """Chat-only fields: each one this server cannot honour is a 400 that names it."""
    validate_sampling(req)
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
        _refuse(
            "functions" if req.functions is not None else "function_call", "use 'tools' and 'tool_choice'"
        )
    if req.audio is not None:
        _refuse("audio", "the models answer in text only")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        _refuse("modalities", "the models answer in text only")
    if req.prediction is not None:
        _refuse("prediction", "predicted outputs are not used for drafting")
    if req.reasoning_effort not in (None, "none"):
        _refuse("reasoning_effort", "the models are not reasoning models")
    if req.moderation is not None:
        _refuse("moderation", "there is no moderation model")
    if req.prompt_cache_options is not None and req.prompt_cache_options.get("mode") == "explicit":
        _refuse(
            "prompt_cache_options", "the prefix cache is automatic; explicit breakpoints do not exist here"
        )
    if req.verbosity is not None:
        _refuse("verbosity", "the models have no verbosity control")
    if req.web_search_options is not None:
        _refuse("web_search_options", "there is no web search")
    if req.service_tier not in (None, "auto", "default"):
        _refuse("service_tier", "only 'auto' and 'default' exist here")
    if req.store:
        _refuse("store", "completions are not stored")
    if req.prompt_cache_retention not in (None, "in_memory"):
        _refuse("prompt_cache_retention", "the prefix cache lives in memory only")
    if req.metadata is not None and (
        len(req.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in req.metadata.items())
    ):
        raise BadRequestError(
            "'metadata' allows 16 pairs, keys <= 64 and values <= 512 chars.", param="metadata"
        )
    for i, m in enumerate(req.messages):
        if m.audio is not None:
            _refuse(f"messages[{i}].audio", "the models take text only")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type not in TEXT_PARTS and not (part.type == "refusal" and m.role == "assistant"):
                    _refuse(
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
        _refuse("suffix", "the models have no fill-in-the-middle mode")
    if req.echo and req.logprobs is not None:
        # Echoed prompt tokens need prompt logprobs, which the engine does not compute.
        _refuse("echo", "echo together with logprobs (prompt logprobs are not computed)")


def now() -> int:
    return int(time.time())
