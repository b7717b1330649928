"""The chat bridge's shared stream machinery (router/http/bridge/chat.py): SSE payloads parsed in
order, only the first choice translated, a usage-only chunk not taken for an error, and the chat
field a conversion error names."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from router.errors import BadRequestError
from router.http.bridge.chat import EventTranslator, chat_chunks, chat_request, error_path, rename_param
from router.openai.schemas import ChatCompletionRequest


class _Recorder(EventTranslator):
    """Writes each hook call as one line, so a test reads what the translator did in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self) -> list[bytes]:
        return [b"start"]

    def text(self, delta: str) -> list[bytes]:
        return [f"text:{delta}".encode()]

    def call(self, delta: dict[str, Any]) -> list[bytes]:
        return [f"call:{delta.get('id')}".encode()]

    def finish(self) -> list[bytes]:
        return [f"finish:{self.finish_reason}".encode()]

    def fail(self, error: Any) -> list[bytes]:
        return [f"fail:{error.get('message')}".encode()]


def _sse(*payloads: dict[str, Any] | str) -> bytes:
    parts = [p if isinstance(p, str) else json.dumps(p) for p in payloads]
    return b"".join(f"data: {p}\n\n".encode() for p in parts)


async def _source(*pieces: bytes) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


def _translate(*pieces: bytes) -> list[bytes]:
    async def run() -> list[bytes]:
        return [b async for b in _Recorder().translate(_source(*pieces))]

    return asyncio.run(run())


def _delta(content: str, index: int = 0, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": index, "delta": {"content": content}, "finish_reason": finish}]}


def test_payloads_split_across_reads_come_out_whole_and_in_order() -> None:
    """Bug it catches: an event cut at a read boundary parsed early (or dropped), or events
    reordered when several arrive in one read."""
    stream = _sse(_delta("a"), _delta("b"), _delta("c", finish="stop"), "[DONE]")
    pieces = [stream[:7], stream[7:60], stream[60:]]

    async def run() -> list[dict[str, Any]]:
        return [p async for p in chat_chunks(_source(*pieces))]

    payloads = asyncio.run(run())
    assert [p["choices"][0]["delta"]["content"] for p in payloads] == ["a", "b", "c"]


def test_a_choice_past_the_first_does_not_hide_the_first_one_after_it() -> None:
    """Bug it catches: ``break`` for ``continue`` at a choice whose index is not 0 - the first
    choice listed after it is never translated."""
    payload = {
        "choices": [
            {"index": 1, "delta": {"content": "other"}, "finish_reason": None},
            {"index": 0, "delta": {"content": "mine"}, "finish_reason": "stop"},
        ]
    }
    out = _translate(_sse(payload, "[DONE]"))
    assert out == [b"start", b"text:mine", b"finish:stop"]


def test_a_chunk_without_choices_is_not_an_error() -> None:
    """Bug it catches: ``or`` for ``and`` in the error test - a usage-only chunk (no ``choices``
    key) fails the stream with a KeyError instead of carrying its usage."""
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    out = _translate(_sse(_delta("x", finish="length"), {"usage": usage}, "[DONE]"))
    assert out == [b"start", b"text:x", b"finish:length"]


def test_an_error_chunk_fails_the_stream_and_nothing_follows() -> None:
    out = _translate(_sse(_delta("x"), {"error": {"message": "boom"}}, _delta("y"), "[DONE]"))
    assert out == [b"start", b"text:x", b"fail:boom"]


def test_a_conversion_error_names_the_top_level_chat_field() -> None:
    """Bug it catches: the path cut at the wrong character (the backtick that closes msgspec's
    ``$.field`` path), giving ``None`` or a garbled name to ``param``."""
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert({"model": "m", "messages": [{"role": 3}]}, ChatCompletionRequest)
    assert error_path(info.value) == "messages"
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert({"model": "m", "messages": [], "temperature": "hot"}, ChatCompletionRequest)
    assert error_path(info.value) == "temperature"


def test_chat_request_hands_the_named_field_to_the_edge_api_error() -> None:
    seen: list[str | None] = []

    def invalid(exc: msgspec.ValidationError, path: str | None) -> BadRequestError:
        seen.append(path)
        return BadRequestError(str(exc), param=path)

    with pytest.raises(BadRequestError):
        chat_request({"model": "m", "messages": [], "top_p": "x"}, invalid)
    assert seen == ["top_p"]


def test_rename_param_renames_the_head_and_keeps_the_rest() -> None:
    """Bugs it catches: the rest of the path dropped (``messages`` for ``messages[0].content``
    renamed as just ``input``), ``response_format`` paths not handed to their own renamer."""
    names = {"messages": "input", "max_completion_tokens": "max_output_tokens"}

    def fmt(rest: str) -> str:
        return "text.format" + ("." + rest if rest else "")

    assert rename_param("messages.0.content", names, fmt) == "input.0.content"
    assert rename_param("max_completion_tokens", names, fmt) == "max_output_tokens"
    assert rename_param("temperature", names, fmt) == "temperature"
    assert rename_param("response_format.json_schema.name", names, fmt) == "text.format.json_schema.name"
    assert rename_param("response_format", names, fmt) == "text.format"
    assert rename_param(None, names, fmt) is None
