"""Response shapes, declared for the OpenAPI schema (handlers build plain dicts that match them)."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["ChatCompletion", "ErrorResponse", "Model", "ModelList", "RouteDecision", "TextCompletion"]


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
