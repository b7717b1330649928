"""Anthropic's stream events as the Messages bridge writes them (router/http/bridge/messages.py,
``MessageEvents``), read against the event sequence of Anthropic's reference: tool-use blocks
carry ``toolu_`` ids built from the call id, and a stop sequence split across chunks is held back
and never sent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from router.http.bridge.messages import MessageEvents
from router.http.bridge.messages_request import MessagesRequest


def _req(**fields: Any) -> MessagesRequest:
    body = {"model": "small", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    return msgspec.convert({**body, **fields}, MessagesRequest)


async def _source(*payloads: dict[str, Any]) -> AsyncIterator[bytes]:
    for p in payloads:
        yield f"data: {json.dumps(p)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _events(req: MessagesRequest, *payloads: dict[str, Any]) -> list[dict[str, Any]]:
    async def run() -> list[bytes]:
        return [b async for b in MessageEvents(req, "small").translate(_source(*payloads))]

    return [json.loads(raw.decode().split("data: ", 1)[1]) for raw in asyncio.run(run())]


def _choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_a_tool_call_is_a_tool_use_block_with_a_toolu_id_from_the_call_id() -> None:
    """Bug it catches: the ``call_`` prefix not removed (``toolu_call_ab12``) - the id the client
    sends back in its ``tool_result`` no longer matches the chat call it answers."""
    call = {"id": "call_ab12", "type": "function", "function": {"name": "get", "arguments": ""}}
    args = {"function": {"arguments": '{"city": "Oslo"}'}}
    events = _events(
        _req(),
        _choice({"tool_calls": [{"index": 0, **call}]}),
        _choice({"tool_calls": [{"index": 0, **args}]}, "tool_calls"),
    )
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["content_block"] == {"type": "tool_use", "id": "toolu_ab12", "name": "get", "input": {}}
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == [{"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'}]
    end = next(e for e in events if e["type"] == "message_delta")
    assert end["delta"]["stop_reason"] == "tool_use"


def test_a_stop_sequence_split_across_chunks_is_never_sent() -> None:
    """Bug it catches: the held-back tail of a possible stop sequence sent early (the client sees
    ``EN`` of ``END``) or dropped when it turns out not to be one."""
    events = _events(
        _req(stop_sequences=["END"]),
        _choice({"content": "one E"}),
        _choice({"content": "x two E"}),
        _choice({"content": "N"}),
        _choice({"content": "D"}, "stop"),
    )
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "one Ex two "
    end = next(e for e in events if e["type"] == "message_delta")
    assert end["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
