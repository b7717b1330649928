"""A request body's fields checked before anything is built from it: each field this server
cannot honour, or one out of its range, is a 400 in OpenAI's shape that names it
(``validate_sampling`` for the fields chat and completions share, ``validate_chat`` /
``validate_completion`` for each one's own); ``router.openai.request`` calls them first.
"""

from __future__ import annotations

import math

from router.errors import BadRequestError
from router.openai.schemas import (
    MAX_ID_CHARS,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    MAX_N,
    MAX_STOP_LENGTH,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID_DIGITS,
    MAX_TOKENS_BOUND,
    MAX_TOP_LOGPROBS,
    TEXT_PARTS,
    ChatCompletionRequest,
    CompletionRequest,
)

__all__ = ["unsupported", "validate_chat", "validate_completion", "validate_sampling"]


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
        # "²".isdigit() is true and int("²") raises; past 10 digits no vocabulary has the id, and
        # past 4,300 int() itself raises.
        if not (token.isascii() and token.isdigit()) or len(token) > MAX_TOKEN_ID_DIGITS:
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
        if value is not None and value > MAX_TOKENS_BOUND:
            raise BadRequestError(
                f"'{name}' must be at most {MAX_TOKENS_BOUND} (a tier stops at its context "
                "window in any case).",
                param=name,
            )
    _identifier("user", req.user)
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise BadRequestError(f"'stop' accepts at most {MAX_STOP_SEQUENCES} sequences.", param="stop")
    if any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise BadRequestError(
            f"each 'stop' sequence must be at most {MAX_STOP_LENGTH} characters.", param="stop"
        )


def _identifier(param: str, value: str | None) -> None:
    if value is not None and len(value) > MAX_ID_CHARS:
        raise BadRequestError(
            f"'{param}' must be at most {MAX_ID_CHARS} characters, got {len(value)}.", param=param
        )


def _validate_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's documented bounds: 16 pairs, keys of at most 64 and values of 512 characters."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise BadRequestError(
            f"'metadata' may have at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}.", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise BadRequestError(
                f"'metadata' keys must be at most {MAX_METADATA_KEY_CHARS} characters.", param="metadata"
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise BadRequestError(
                f"'metadata.{key}' must be at most {MAX_METADATA_VALUE_CHARS} characters.",
                param=f"metadata.{key}",
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
        unsupported("skip_special_tokens", "special tokens are always left out of the text")


def unsupported(param: str, why: str) -> None:
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
    _validate_metadata(req.metadata)
    _identifier("safety_identifier", req.safety_identifier)
    _identifier("prompt_cache_key", req.prompt_cache_key)
    for i, m in enumerate(req.messages or []):
        _identifier(f"messages[{i}].name", m.name)
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
        unsupported(
            "functions" if req.functions is not None else "function_call", "use 'tools' and 'tool_choice'"
        )
    if req.audio is not None:
        unsupported("audio", "the models answer in text only")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        unsupported("modalities", "the models answer in text only")
    if req.prediction is not None:
        unsupported("prediction", "predicted outputs are not used for drafting")
    if req.reasoning_effort not in (None, "none"):
        unsupported("reasoning_effort", "the models are not reasoning models")
    if req.moderation is not None:
        unsupported("moderation", "there is no moderation model")
    if req.prompt_cache_options is not None and req.prompt_cache_options.get("mode") == "explicit":
        unsupported(
            "prompt_cache_options", "the prefix cache is automatic; explicit breakpoints do not exist here"
        )
    if req.verbosity is not None:
        unsupported("verbosity", "the models have no verbosity control")
    if req.web_search_options is not None:
        unsupported("web_search_options", "there is no web search")
    if req.service_tier not in (None, "auto", "default"):
        unsupported("service_tier", "only 'auto' and 'default' exist here")
    if req.store:
        unsupported("store", "completions are not stored")
    if req.prompt_cache_retention not in (None, "in_memory"):
        unsupported("prompt_cache_retention", "the prefix cache lives in memory only")
    for i, m in enumerate(req.messages):
        if m.audio is not None:
            unsupported(f"messages[{i}].audio", "the models take text only")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type not in TEXT_PARTS and not (part.type == "refusal" and m.role == "assistant"):
                    unsupported(
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
        unsupported("suffix", "the models have no fill-in-the-middle mode")
    if req.echo and req.logprobs is not None and max(n, req.best_of or n) > 1:
        # The prompt's logprobs are computed on one choice's prompt (the others share its KV).
        unsupported("echo", "echo with logprobs takes one choice (n and best_of 1)")
