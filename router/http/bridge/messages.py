"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) at the edge
of the one pipeline.

A request is translated into the internal request type (``ChatCompletionRequest``) and answered by
``RouterService.chat`` (classifier, policy, cache, admission, tenancy, traces and metrics
unchanged); the Chat Completions answer is translated back into a ``message`` object or
Anthropic's event stream (``message_start``, ``content_block_start/delta/stop``, ``message_delta``
with ``stop_reason``, ``message_stop``).

- ``system``; ``messages`` with ``text``, ``tool_use`` and ``tool_result`` blocks; ``tools`` (custom
  tools; ``input_schema`` is the grammar of ``input``) with ``tool_choice`` ``auto``/``any``/
  ``tool``/``none`` (``disable_parallel_tool_use``); ``output_config.format`` (``json_schema``)
  through the grammar engine; ``max_tokens``, ``stop_sequences`` (``stop_reason: stop_sequence``
  names the one that matched), ``temperature``/``top_p``/``top_k``.
- Errors are Anthropic-shaped, ``{"type": "error", "error": {"type", "message"}}``, with the same
  statuses as the OpenAI endpoints; ``x-api-key`` is accepted as well as a Bearer token (the same
  keys and tenants).
- Fields this server cannot honour (server tools, extended thinking, containers, effort...) are a
  400 naming them; unknown fields are a 400 too.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping
from typing import Any

from jinja2 import TemplateError
from litestar import Request, Response, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.status_codes import HTTP_200_OK

from router.backends.local import chat_prompt_ids
from router.errors import BadRequestError, ModelNotFoundError, UnavailableError, anthropic_error_body
from router.http.bridge.chat import (
    EventTranslator,
    answer_through_chat,
    first_choice,
    typed_event,
)
from router.http.bridge.messages_request import (
    CountTokensRequest,
    MessagesRequest,
    convert,
    count_tokens_body,
    renamed,
    to_chat,
    validate,
)
from router.http.routes import _ERRORS, _respond, _service, error_response, metered
from router.openai import api_types
from router.openai.request import template_options
from router.pipeline.calls import Completion

__all__ = ["MESSAGES_ROUTES", "MessagesRequest", "anthropic_error_response", "to_chat"]


# -- answer translation ---------------------------------------------------------------------------
def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _usage(chat_usage: Mapping[str, Any] | None) -> dict[str, Any]:
    usage = chat_usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    prompt = usage.get("prompt_tokens", 0)
    return {
        "input_tokens": prompt - cached,
        "output_tokens": usage.get("completion_tokens", 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "service_tier": "standard",
    }


def _split_stop(text: str, finish: str | None, stops: list[str]) -> tuple[str, str | None]:
    """The text without the stop sequence that ended it, and that sequence (or None)."""
    if finish == "stop":
        for s in sorted(stops, key=len, reverse=True):
            if s and text.endswith(s):
                return text[: -len(s)], s
    return text, None


def _stop_reason(finish: str | None, stop_sequence: str | None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    return {"tool_calls": "tool_use", "length": "max_tokens"}.get(finish or "stop", "end_turn")


def _tool_input(arguments: str) -> Any:
    try:
        return json.loads(arguments or "{}")
    except json.JSONDecodeError:  # cut by max_tokens: stop_reason says so
        return {}


def message_body(req: MessagesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    full_text, calls, finish = first_choice(chat)
    text, stop_sequence = _split_stop(full_text, finish, req.stop_sequences or [])
    content: list[dict[str, Any]] = []
    if text or not calls:
        content.append({"type": "text", "text": text})
    for call in calls:
        fn = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": _tool_use_id(call["id"]),
                "name": fn["name"],
                "input": _tool_input(fn["arguments"]),
            }
        )
    return {
        "id": _message_id(),
        "type": "message",
        "role": "assistant",
        "model": chat["model"],
        "content": content,
        "stop_reason": _stop_reason(finish, stop_sequence),
        "stop_sequence": stop_sequence,
        "usage": _usage(chat.get("usage")),
    }


def _tool_use_id(call_id: str) -> str:
    """Anthropic's ids look like ``toolu_...``; the chat call id keeps its suffix."""
    return "toolu_" + call_id.removeprefix("call_")


class MessageEvents(EventTranslator):
    """Chat Completions chunks in, Anthropic's stream events out. Text that could be the start of a
    stop sequence is held back until it is known not to be one (the sequence is never sent)."""

    def __init__(self, req: MessagesRequest, model: str) -> None:
        self.stops = [s for s in req.stop_sequences or [] if s]
        self.model = model
        self.block = -1
        self.block_type: str | None = None
        self.held = ""
        self.started = False

    @staticmethod
    def event(kind: str, **fields: Any) -> bytes:
        return typed_event(kind, {"type": kind, **fields})

    def _start(self) -> list[bytes]:
        self.started = True
        usage = _usage(self.usage)
        usage["output_tokens"] = min(usage["output_tokens"], 1)
        message: dict[str, Any] = {
            "id": _message_id(),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [self.event("message_start", message=message)]

    def _stop_block(self) -> list[bytes]:
        if self.block_type is None:
            return []
        out = []
        if self.held:
            out.append(self._text_delta(self.held))
            self.held = ""
        self.block_type = None
        return [*out, self.event("content_block_stop", index=self.block)]

    def _text_delta(self, text: str) -> bytes:
        return self.event("content_block_delta", index=self.block, delta={"type": "text_delta", "text": text})

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self._stop_block()
        self.block += 1
        self.block_type = block["type"]
        return [*out, self.event("content_block_start", index=self.block, content_block=block)]

    def _partial_stop(self, text: str) -> int:
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def text(self, delta: str) -> list[bytes]:
        out: list[bytes] = []
        if self.block_type != "text":
            out += self._open({"type": "text", "text": ""})
        text = self.held + delta
        keep = max((len(s) for s in self.stops if text.endswith(s)), default=0) or self._partial_stop(text)
        send, self.held = text[: len(text) - keep], text[len(text) - keep :]
        if send:
            out.append(self._text_delta(send))
        return out

    def opening(self) -> list[bytes]:
        return [] if self.started else self._start()

    def call(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        fn = delta.get("function") or {}
        if delta.get("id"):
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": _tool_use_id(delta["id"]),
                "name": fn.get("name") or "",
                "input": {},
            }
            out += self._open(block)
        if fn.get("arguments") and self.block_type == "tool_use":
            out.append(
                self.event(
                    "content_block_delta",
                    index=self.block,
                    delta={"type": "input_json_delta", "partial_json": fn["arguments"]},
                )
            )
        return out

    def finish(self) -> list[bytes]:
        out = [] if self.started else self._start()
        stop_sequence = None
        if self.block_type == "text":
            kept, stop_sequence = _split_stop(self.held, self.finish_reason, self.stops)
            self.held = kept
        if self.block < 0:  # an empty answer is still one (empty) text block
            out += self._open({"type": "text", "text": ""})
        out += self._stop_block()
        usage = _usage(self.usage)
        reason = _stop_reason(self.finish_reason, stop_sequence)
        delta = {"stop_reason": reason, "stop_sequence": stop_sequence}
        out.append(self.event("message_delta", delta=delta, usage=usage))
        out.append(self.event("message_stop"))
        return out

    def fail(self, error: Mapping[str, Any]) -> list[bytes]:
        return [self.event("error", **anthropic_error_body(500, str(error.get("message", ""))))]


async def create_message(request: Request[Any, Any, Any], req: MessagesRequest) -> Completion:
    validate(req)
    return await answer_through_chat(
        request,
        to_chat(req),
        renamed,
        lambda chat: message_body(req, chat),
        lambda model: MessageEvents(req, model),
    )


def count_tokens(request: Request[Any, Any, Any], req: CountTokensRequest) -> int:
    """Prompt tokens of the request as the first local tier's chat template renders it (tools
    included, as generation renders them)."""
    from router.openai.structured import chat_messages as rendered
    from router.openai.structured import output_spec

    validate(req)
    tiers = _service(request).tiers
    tokenizer = tiers.counting_tokenizer() if tiers is not None and tiers.ready else None
    if tokenizer is None:
        raise UnavailableError("Models are still loading.", code="not_ready", retry_after=5.0)
    body = count_tokens_body(req)
    if req.model not in _service(request).model_names():
        raise ModelNotFoundError(f"model: {req.model[:100]}", param="model")
    chat = convert(body)
    try:
        return len(chat_prompt_ids(tokenizer, rendered(chat, output_spec(chat)), template_options(chat)))
    except TemplateError as exc:
        raise BadRequestError(f"messages: {exc}", param="messages", code="invalid_messages") from exc


# -- errors ---------------------------------------------------------------------------------------
def anthropic_error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """Any error on the Messages routes in Anthropic's shape (the status and headers are those the
    OpenAI routes give: ``router.http.routes.error_response`` decides them)."""
    openai_shaped = error_response(request, exc)
    error = openai_shaped.content["error"]
    status = openai_shaped.status_code or 500
    message = error["message"]
    param = error.get("param")
    if param and not message.startswith(param + ":"):  # Anthropic's messages start with the field
        message = f"{param}: {message}"
    body = anthropic_error_body(status, message)
    return Response(content=body, status_code=status, headers=dict(openai_shaped.headers))


# -- routes ---------------------------------------------------------------------------------------
_ANTHROPIC_ERRORS = {
    status: ResponseSpec(api_types.AnthropicError, description=spec.description)
    for status, spec in _ERRORS.items()
}


@post(
    "/v1/messages",
    status_code=HTTP_200_OK,
    summary="Create a message (Anthropic Messages API), routed like a chat completion",
    responses={
        200: ResponseSpec(api_types.AnthropicMessage, description="The message, or an SSE stream of events"),
        **_ANTHROPIC_ERRORS,
    },
    exception_handlers={Exception: anthropic_error_response},
)
async def messages(request: Request[Any, Any, Any], data: MessagesRequest) -> Response[Any]:
    return await _respond(request, create_message(request, data))


@post(
    "/v1/messages/count_tokens",
    status_code=HTTP_200_OK,
    summary="Count a message request's input tokens (Anthropic Messages API)",
    responses={200: ResponseSpec(api_types.AnthropicTokenCount), **_ANTHROPIC_ERRORS},
    exception_handlers={Exception: anthropic_error_response},
)
async def messages_count_tokens(request: Request[Any, Any, Any], data: CountTokensRequest) -> Response[Any]:
    metered(request)
    # Rendering and tokenizing a large conversation takes a good part of a second: off the loop.
    tokens = await asyncio.to_thread(count_tokens, request, data)
    return Response(content={"input_tokens": tokens}, status_code=HTTP_200_OK)


MESSAGES_ROUTES = [messages, messages_count_tokens]
