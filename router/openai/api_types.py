"""Response shapes, declared for the OpenAPI schema (handlers build plain dicts that match them)."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "AnthropicError",
    "AnthropicMessage",
    "AnthropicTokenCount",
    "ChatCompletion",
    "DeletedResponse",
    "ErrorResponse",
    "Model",
    "ModelList",
    "ResponseObject",
    "RouteDecision",
    "TextCompletion",
]


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    speculative: dict[str, int] | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str
    """JSON text of the arguments (valid under the function's schema for grammar-decoded calls)."""


class ToolCall(msgspec.Struct):
    id: str
    type: str
    function: FunctionCall


class AssistantMessage(msgspec.Struct):
    role: str
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    """stop | length | tool_calls"""
    logprobs: Any = None
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal": null}`` when asked."""


class ChatCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    """The tier that answered: what a client maps to a price."""
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    """Changes exactly when the answering tier's serving configuration does."""


class TextChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: Any = None


class TextCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    system_fingerprint: str | None = None


class Model(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[Model]
    object: str = "list"


class RouteDecision(msgspec.Struct):
    tier: str
    rule: str
    reason: str
    score: float
    predicted: str
    probabilities: dict[str, float]
    escalated: bool
    capped: bool
    fallback_from: str | None
    rejected: bool
    prompt_tokens: int
    classify_ms: float
    policy: str


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]


class ResponseObject(msgspec.Struct):
    """OpenAI Responses API ``response`` (``POST /v1/responses``, ``GET /v1/responses/{id}``)."""

    id: str
    object: str
    created_at: int
    status: str
    """completed | incomplete (``max_output_tokens``) | failed"""
    model: str
    """The tier that answered."""
    output: list[dict[str, Any]]
    """``message`` items (``output_text`` parts) and ``function_call`` items."""
    usage: ResponseUsage | None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True


class DeletedResponse(msgspec.Struct):
    id: str
    object: str
    deleted: bool


class AnthropicUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class AnthropicMessage(msgspec.Struct):
    """Anthropic Messages API ``message`` (``POST /v1/messages``)."""

    id: str
    type: str
    role: str
    model: str
    """The tier that answered."""
    content: list[dict[str, Any]]
    """``text`` and ``tool_use`` blocks."""
    stop_reason: str
    """end_turn | max_tokens | stop_sequence | tool_use"""
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicErrorBody(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct):
    type: str
    error: AnthropicErrorBody


class AnthropicTokenCount(msgspec.Struct):
    input_tokens: int
