"""What the Responses API (``router.http.bridge.responses``) and Anthropic's Messages API
(``router.http.bridge.messages``) share at the edge of the one chat pipeline: the internal request
built from a translated body, the call to ``RouterService.chat`` with errors renamed to the edge
API's fields, and the answer translated back - a JSON body from the chat body's first choice, or
a typed event stream from the chat SSE chunks.

Each edge API supplies only what differs: its field names, its body shape, and an
``EventTranslator`` subclass whose hooks say how text and tool-call deltas become its events.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

import msgspec
from litestar import Request

from router.errors import RouterError
from router.http.routes import answer_body
from router.openai.schemas import ChatCompletionRequest
from router.pipeline.calls import Completion

__all__ = [
    "EventTranslator",
    "answer_through_chat",
    "chat_chunks",
    "chat_request",
    "first_choice",
    "rename_param",
    "typed_event",
]


def chat_request(
    body: dict[str, Any], invalid: Callable[[msgspec.ValidationError, str | None], RouterError]
) -> ChatCompletionRequest:
    """The internal request from a translated body (None values dropped); a value it cannot hold
    raises ``invalid(error, the chat field it names)``, worded by the edge API."""
    try:
        return msgspec.convert({k: v for k, v in body.items() if v is not None}, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise invalid(exc, error_path(exc)) from exc


def error_path(exc: msgspec.ValidationError) -> str | None:
    """The top-level chat field a conversion error names (``$.messages[0]`` -> ``messages``)."""
    text = str(exc)
    marker = "at `$."
    if marker not in text:
        return None
    return text.split(marker, 1)[1].split("`", 1)[0].split("[", 1)[0]


def rename_param(
    param: str | None, names: Mapping[str, str], response_format: Callable[[str], str]
) -> str | None:
    """A chat field named in an error, as the edge API calls it: the head renamed through
    ``names``, ``response_format...`` through ``response_format`` (given what follows it)."""
    if param is None:
        return None
    head, sep, rest = param.partition(".")
    if head == "response_format":
        return response_format(rest)
    return names.get(head, head) + sep + rest


async def answer_through_chat(
    request: Request[Any, Any, Any],
    chat: ChatCompletionRequest,
    renamed: Callable[[str | None], str | None],
    body_of: Callable[[dict[str, Any]], dict[str, Any]],
    events_of: Callable[[str], EventTranslator],
) -> Completion:
    """``chat`` answered by the pipeline, its answer translated back: ``body_of`` the chat body, or
    the chat stream through ``events_of(the tier that answered)``."""
    try:
        result = await answer_body(request, chat)
    except RouterError as exc:
        exc.param = renamed(exc.param)
        raise
    if result.stream is not None:
        events = events_of(result.headers.get("x-router-tier", chat.model))
        return Completion(result.headers, stream=events.translate(result.stream))
    assert result.body is not None
    return Completion(result.headers, body=body_of(result.body))


def first_choice(chat: Mapping[str, Any]) -> tuple[str, list[dict[str, Any]], str | None]:
    """A chat body's first choice as ``(text, tool calls, finish_reason)``."""
    choice = chat["choices"][0]
    message = choice["message"]
    return message.get("content") or "", message.get("tool_calls") or [], choice.get("finish_reason")


def chat_chunks(stream: AsyncIterator[bytes]) -> AsyncGenerator[dict[str, Any], None]:
    """The JSON payloads of a Chat Completions SSE stream (``[DONE]`` ends it)."""

    async def parse() -> AsyncGenerator[dict[str, Any], None]:
        buffer = b""
        async for data in stream:
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        payload = line[6:].strip()
                        if payload == b"[DONE]":
                            return
                        yield json.loads(payload)

    return parse()


def typed_event(kind: str, payload: Mapping[str, Any]) -> bytes:
    """One named SSE event (``event:`` line, compact JSON ``data:``)."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


class EventTranslator:
    """Chat Completions chunks in, an edge API's events out. The first choice is translated;
    subclasses say how its text and tool-call deltas, the opening and the end read."""

    usage: dict[str, Any] | None = None
    finish_reason: str | None = None

    def start(self) -> list[bytes]:
        """Events before any chunk."""
        return []

    def opening(self) -> list[bytes]:
        """Events each chunk starts with (after its usage is read), before its deltas."""
        return []

    def text(self, delta: str) -> list[bytes]:
        raise NotImplementedError

    def call(self, delta: dict[str, Any]) -> list[bytes]:
        raise NotImplementedError

    def finish(self) -> list[bytes]:
        raise NotImplementedError

    def fail(self, error: Mapping[str, Any]) -> list[bytes]:
        raise NotImplementedError

    def done(self) -> None:
        """The whole stream was translated (not called after a failure or a disconnect)."""

    def chunk(self, payload: Mapping[str, Any]) -> list[bytes]:
        if payload.get("usage"):
            self.usage = payload["usage"]
        out = self.opening()
        for choice in payload.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self.text(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self.call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    async def translate(self, source: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        chunks = chat_chunks(source)
        try:
            for b in self.start():
                yield b
            async for payload in chunks:
                if "error" in payload and "choices" not in payload:
                    for b in self.fail(payload["error"]):
                        yield b
                    return
                for b in self.chunk(payload):
                    yield b
            for b in self.finish():
                yield b
            self.done()
        finally:
            await chunks.aclose()
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()
