"""The wire framing of chat and text completions: envelopes, stream chunks, usage, SSE events and
the guaranteed ``[DONE]`` (``SSEStream``), and the replay of a cached body as a stream.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from router.errors import RouterError, UnavailableError
from router.openai.request import completion_id

__all__ = [
    "DONE",
    "ERROR_PREFIX",
    "SSEStream",
    "chunk",
    "completion_body",
    "now",
    "object_name",
    "replay",
    "sse_event",
    "usage_body",
]

log = logging.getLogger(__name__)


# -- wire shapes ----------------------------------------------------------------------------------
def now() -> int:
    """An answer's ``created``: Unix seconds."""
    return int(time.time())


DONE = b"data: [DONE]\n\n"


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


def object_name(kind: str, *, chunk: bool) -> str:
    if kind == "chat":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def chunk(kind: str, cid: str, created: int, model: str, delta: Any, finish: str | None) -> dict[str, Any]:
    """One streamed chunk: ``delta`` is a chat delta dict, or the text for completions."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
    choice["delta" if kind == "chat" else "text"] = delta
    return {
        "id": cid,
        "object": object_name(kind, chunk=True),
        "created": created,
        "model": model,
        "choices": [choice],
    }


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def completion_body(
    kind: str, model: str, text: str, finish: str | None, usage: dict[str, Any]
) -> dict[str, Any]:
    """The non-streaming response body."""
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    cid = completion_id("chatcmpl" if kind == "chat" else "cmpl")
    return {
        "id": cid,
        "object": object_name(kind, chunk=False),
        "created": now(),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


async def replay(kind: str, body: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    """A stored answer as the same SSE sequence a live stream produces (the cache stores plain
    one-choice text answers only: no tool calls, logprobs or n > 1)."""
    cid, created, model = body["id"], body["created"], body["model"]
    extra = {"system_fingerprint": body["system_fingerprint"]} if body.get("system_fingerprint") else {}
    first = body["choices"][0]
    text = first["message"]["content"] if kind == "chat" else first["text"]

    def event(delta: Any, finish: str | None) -> bytes:
        return sse_event({**chunk(kind, cid, created, model, delta, finish), **extra})

    if kind == "chat":
        yield event({"role": "assistant", "content": ""}, None)
    yield event({"content": text} if kind == "chat" else text, None)
    yield event({} if kind == "chat" else "", first["finish_reason"])
    if include_usage:
        usage_chunk = {"id": cid, "object": object_name(kind, chunk=True), "created": created, "model": model}
        yield sse_event({**usage_chunk, **extra, "choices": [], "usage": body["usage"]})
    yield DONE


ERROR_PREFIX = b'data: {"error"'
"""How an SSE error event starts (one an answer wrote itself, told apart from a chunk)."""


class SSEStream:
    """An SSE body whose end is accounted exactly once, however the response ends, and whose
    last event is always ``[DONE]``.

    The HTTP layer may drop a response before iterating it (the client left while the first token
    was being produced); an async generator that never started runs no ``finally``, so the
    in-flight count would leak. ``on_close`` runs on exhaustion, on ``aclose()``, or at the latest
    when the object is collected. (The engine request itself is aborted by the source generator's
    own cleanup, which asyncio runs for started generators that are dropped.)

    Once the first byte is out the status is 200 for good, so every failure after it must be told
    in the stream: a body that raises gets an OpenAI error event, and one that ends without
    ``[DONE]`` (an engine abort, an error event it wrote itself) gets the missing error event and
    ``[DONE]``, so a client never mistakes a cut answer for a whole one, nor waits for more.
    """

    def __init__(self, body: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> None:
        self._body = body
        self._on_close: Callable[[], None] | None = on_close
        self._tail: list[bytes] = []
        self._ended = False
        self._done = False
        self._errored = False

    def __aiter__(self) -> SSEStream:
        return self

    async def __anext__(self) -> bytes:
        if self._tail:
            return self._tail.pop(0)
        if self._ended:
            raise StopAsyncIteration
        try:
            data = await anext(self._body)
        except StopAsyncIteration:
            await self.aclose()
            self._end(None)
            if not self._tail:
                raise
            return self._tail.pop(0)
        except Exception as exc:
            await self.aclose()
            self._end(exc)
            return self._tail.pop(0)
        except BaseException:  # cancelled, or closed by the server: nobody is reading any more
            await self.aclose()
            raise
        if data == DONE:
            self._done = True
        elif data.startswith(ERROR_PREFIX):
            self._errored = True
        return data

    def _end(self, exc: Exception | None) -> None:
        """Queue what the stream still owes its client: an error event unless one was sent, then
        ``[DONE]`` unless it was."""
        self._ended = True
        if self._done:
            return
        if not self._errored:
            if isinstance(exc, RouterError):
                err: RouterError = exc
            elif exc is not None:
                log.error("stream failed after its first byte", exc_info=exc)
                err = RouterError("The answer failed mid-stream.", code="stream_error")
            else:
                err = UnavailableError("The answer was cut short: generation was aborted.", code="aborted")
            self._tail.append(sse_event(err.to_body()))
        self._tail.append(DONE)
        self._done = True

    def _close_sync(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    async def aclose(self) -> None:
        try:
            await self._body.aclose()
        finally:
            self._close_sync()

    def __del__(self) -> None:
        self._close_sync()
