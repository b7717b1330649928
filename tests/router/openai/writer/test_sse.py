"""The wire framing (router/openai/writer/sse.py): usage as OpenAI defines it, a cached body replayed
as the same chunk sequence a live stream sends (text whole, finish reason, usage chunk, ``[DONE]``),
and ``SSEStream``'s guarantees - exactly one ``on_close``, and a stream that ends without ``[DONE]``
or fails mid-way still ends with one error event and ``[DONE]``, never two."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from router.errors import BadRequestError
from router.openai.writer.sse import DONE, SSEStream, completion_body, replay, sse_event, usage_body


def _events(raw: list[bytes]) -> list[Any]:
    out: list[Any] = []
    for b in raw:
        assert b.startswith(b"data: ") and b.endswith(b"\n\n"), b
        data = b[6:-2]
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def test_usage_totals_and_the_speculative_extension_only_when_drafted() -> None:
    assert usage_body(7, 3) == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    drafted = usage_body(7, 3, cached_tokens=4, drafted=5, accepted=0)
    assert drafted["speculative"] == {"draft_tokens": 5, "accepted_tokens": 0}
    assert drafted["prompt_tokens_details"] == {"cached_tokens": 4}


def _replayed(kind: str, body: dict[str, Any], include_usage: bool) -> list[Any]:
    async def run() -> list[bytes]:
        return [b async for b in replay(kind, body, include_usage)]

    return _events(asyncio.run(run()))


def test_a_cached_chat_body_replays_as_a_live_stream_would_send_it() -> None:
    """Bugs it catches: the text cut or sent twice, the finish reason lost, the usage chunk
    missing (or sent without ``include_usage``), no ``[DONE]``."""
    usage = usage_body(5, 2)
    body = completion_body("chat", "small", "Hi there", "length", usage)
    body["system_fingerprint"] = "fp_1"
    events = _replayed("chat", body, include_usage=True)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["id"] == body["id"] and c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(c["system_fingerprint"] == "fp_1" and c["model"] == "small" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hi there"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes == [None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage
    without = _replayed("chat", body, include_usage=False)
    assert all("usage" not in c for c in without[:-1]) and without[-1] == "[DONE]"


def test_a_cached_completion_body_replays_its_text() -> None:
    body = completion_body("completion", "small", "42", "stop", usage_body(3, 1))
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl")
    events = _replayed("completion", body, include_usage=False)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["42", ""]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all("system_fingerprint" not in e for e in events[:-1])


async def _gen(*items: bytes, fail: Exception | None = None) -> AsyncGenerator[bytes, None]:
    for item in items:
        yield item
    if fail is not None:
        raise fail


def _drain(stream: SSEStream) -> list[bytes]:
    async def run() -> list[bytes]:
        return [b async for b in stream]

    return asyncio.run(run())


def test_a_whole_stream_passes_through_and_closes_once() -> None:
    closed: list[int] = []
    first = sse_event({"a": 1})
    stream = SSEStream(_gen(first, DONE), lambda: closed.append(1))
    assert _drain(stream) == [first, DONE]
    assert closed == [1]
    asyncio.run(stream.aclose())
    del stream
    assert closed == [1]


def test_a_stream_cut_without_done_gets_an_aborted_error_then_done() -> None:
    """Bug it catches: a stream the engine aborted ending silently - the client takes a cut
    answer for a whole one."""
    closed: list[int] = []
    events = _events(_drain(SSEStream(_gen(sse_event({"a": 1})), lambda: closed.append(1))))
    assert events[0] == {"a": 1}
    assert events[1]["error"]["code"] == "aborted"
    assert events[2:] == ["[DONE]"]
    assert closed == [1]


def test_a_failure_mid_stream_is_one_error_event_with_the_routers_error() -> None:
    events = _events(
        _drain(SSEStream(_gen(sse_event({"a": 1}), fail=BadRequestError("bad stop")), lambda: None))
    )
    assert events[1]["error"]["message"] == "bad stop"
    assert events[2:] == ["[DONE]"]
    other = _events(_drain(SSEStream(_gen(fail=ValueError("internal detail")), lambda: None)))
    assert other[0]["error"]["code"] == "stream_error"
    assert "internal detail" not in json.dumps(other[0])  # the cause goes to the log, not the client
    assert other[1:] == ["[DONE]"]


def test_an_error_event_the_answer_wrote_itself_is_not_repeated() -> None:
    """Bug it catches: a second error event after the answer's own (clients raise on the first
    and report the wrong cause)."""
    own = b'data: {"error":{"message":"tier failed","code":"x"}}\n\n'
    events = _events(_drain(SSEStream(_gen(own), lambda: None)))
    assert events == [{"error": {"message": "tier failed", "code": "x"}}, "[DONE]"]


def test_a_stream_dropped_before_its_first_read_still_closes_once() -> None:
    closed: list[int] = []
    stream = SSEStream(_gen(DONE), lambda: closed.append(1))
    del stream
    assert closed == [1]
