"""OpenAI wire format: request bodies, decoded and type-checked by msgspec at the edge.

Unknown-field policy: every field of OpenAI's API reference is declared here and either honoured
or refused with a 400 naming it (``validate_chat`` / ``validate_completion`` in
``router.openai.validation``, run as ``router.openai.request`` turns a body into the typed
request). A top-level field that is neither OpenAI's nor one of the declared extensions
(``VLLM_EXTENSIONS``) is refused too, with OpenAI's own message
("Unrecognized request argument supplied: <name>"): a misspelt ``respone_format`` must not return
a 200 that silently ignores it. Inside ``messages`` unknown keys are ignored, because clients send
assistant messages back with response-only keys (``annotations``, ``refusal``, ``audio: null``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "VLLM_EXTENSIONS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "JsonSchemaFormat",
    "ResponseFormat",
    "RouteBody",
    "StreamOptions",
]

MAX_STOP_SEQUENCES = 16
"""OpenAI takes 4 stop sequences, vLLM any number; lm-evaluation-harness sends a task's whole
``until`` list (more than 4 for some tasks). Each is matched against every new token's text."""
MAX_STOP_LENGTH = 256
MAX_N = 16
"""Most choices one request may ask for (``n``, ``best_of``): each is a sequence in the batch."""
MAX_TOP_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKENS_BOUND = 2**31 - 1
"""Largest ``max_tokens`` accepted (vLLM's int32 bound): a tier stops at its context window in any
case, and prices and token budgets count ``min(max_tokens, max_model_len)``."""
MAX_TOKEN_ID_DIGITS = 10
"""Digits a ``logit_bias`` key may have (token ids are int32)."""
MAX_ID_CHARS = 256
"""Characters of a caller-chosen identifier (``user``, ``safety_identifier``,
``prompt_cache_key``, a message's ``name``): each is logged, hashed or kept with the answer."""
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
"""``metadata``: OpenAI's documented bounds (16 pairs, keys of 64, values of 512 characters)."""
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
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
    }
)
"""Request fields beyond OpenAI's reference, as vLLM's OpenAI server accepts them."""


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's extension: variables for the local tier's chat template (``enable_thinking``)."""
    add_generation_prompt: bool | None = None
    """vLLM's extension: open the assistant's turn after the messages (default true)."""
    continue_final_message: bool | None = None
    """vLLM's extension: continue the last (assistant) message instead of opening a new turn."""
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
    prompt: str | list[Any]
    """A string, a list of strings, a list of token ids or a list of such lists
    (``router.openai.request.completion_prompts`` checks which)."""
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class RouteBody(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """``POST /v1/route``: a chat ``messages`` list or a plain ``prompt``; ``model`` defaults to auto."""

    model: str = "auto"
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
