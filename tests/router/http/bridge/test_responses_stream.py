"""The Responses API's streamed events and usage as the bridge writes them
(router/http/bridge/responses.py, ``ResponsesEvents`` and ``_usage``), read against the event
shapes of OpenAI's reference: every ``*.done`` event of a message says which item, output and
content part it closes, a failed stream's response carries the error's message, and usage always
carries integer cached tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from router.http.bridge.responses import ResponsesEvents, _usage
from router.http.bridge.responses_request import ResponsesRequest


def _req(**fields: Any) -> ResponsesRequest:
    return msgspec.convert({"model": "small", "input": "hi", **fields}, ResponsesRequest)


async def _source(*payloads: dict[str, Any]) -> AsyncIterator[bytes]:
    for p in payloads:
        yield f"data: {json.dumps(p)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _events(*payloads: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The events the translator wrote (parsed), and what it handed the store."""
    stored: list[dict[str, Any]] = []
    translator = ResponsesEvents(_req(stream=True), "small", stored.append)

    async def run() -> list[bytes]:
        return [b async for b in translator.translate(_source(*payloads))]

    events = []
    for raw in asyncio.run(run()):
        kind, data = raw.decode().strip().split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    return events, stored


def _text(t: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": finish}]}


def test_every_done_event_of_a_message_names_its_item_output_and_part() -> None:
    """Bug it catches: ``response.output_text.done`` written without ``item_id``/``output_index``/
    ``content_index`` - SDKs that route done events by item (openai-python's stream helpers) drop
    the finished text."""
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    events, stored = _events(_text("he"), _text("llo", "stop"), {"choices": [], "usage": usage})
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = next(e for e in events if e["type"] == "response.output_item.added")
    item_id = added["item"]["id"]
    for kind in ("response.output_text.delta", "response.output_text.done", "response.content_part.done"):
        for e in (e for e in events if e["type"] == kind):
            assert (e["item_id"], e["output_index"], e["content_index"]) == (item_id, 0, 0), kind
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["text"] == "hello"
    assert stored and stored[0]["output"][0]["content"][0]["text"] == "hello"
    assert stored[0]["usage"]["input_tokens_details"] == {"cached_tokens": 0}


def test_a_failed_stream_carries_the_error_message_in_the_response() -> None:
    """Bug it catches: the failed response's ``error`` without its ``message`` key (the Responses
    object's error is ``{code, message}``)."""
    events, stored = _events(_text("par"), {"error": {"message": "tier down", "code": "unavailable"}})
    failed = events[-1]
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "unavailable", "message": "tier down"}
    error = next(e for e in events if e["type"] == "error")
    assert error["message"] == "tier down" and error["code"] == "unavailable"
    assert stored == []  # a failed stream is not stored as an answer


def test_usage_without_prompt_token_details_reports_zero_cached_tokens() -> None:
    """Bug it catches: a missing ``prompt_tokens_details`` read as ``cached_tokens: null``; the
    Responses usage object declares an integer, and typed clients fail to parse null."""
    usage = _usage({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8})
    assert usage is not None
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert (usage["input_tokens"], usage["output_tokens"]) == (5, 3)
    cached = _usage(
        {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 4},
        }
    )
    assert cached is not None and cached["input_tokens_details"] == {"cached_tokens": 4}
