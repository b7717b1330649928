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


class AssistantMessage(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: Any = None


class ChatCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


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
