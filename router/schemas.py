"""OpenAI wire format: request bodies (validated by msgspec at the edge) and response builders.

Unknown request fields are ignored, as OpenAI does. Range checks that msgspec's types cannot say
live in ``validate_sampling`` so every 400 names its ``param``.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

import msgspec

from router.errors import BadRequestError

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "RouteBody",
    "StreamOptions",
    "completion_id",
    "message_text",
    "validate_sampling",
]

MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 256


class ContentPart(msgspec.Struct, forbid_unknown_fields=False):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
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
    user: str | None = None
    # Extensions that vLLM also accepts.
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[str]
    echo: bool | None = None
    logprobs: int | None = None


class RouteBody(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """``POST /v1/route``: a chat ``messages`` list or a plain ``prompt``; ``model`` defaults to auto."""

    model: str = "auto"
    messages: list[ChatMessage] | None = None
    prompt: str | None = None


def message_text(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text or "" for p in content if p.type in ("text", "input_text"))


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
    if req.n is not None and req.n != 1:
        raise BadRequestError("Only n=1 is supported by this server.", param="n", code="unsupported_value")
    if req.top_k is not None and req.top_k < 0:
        raise BadRequestError("'top_k' must be >= 0.", param="top_k")
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


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(s for s in stop if s)


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage_body(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, drafted: int = 0, accepted: int = 0
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if drafted:
        # Extension: speculative decoding stats of this response.
        body["speculative"] = {"draft_tokens": drafted, "accepted_tokens": accepted}
    return body
