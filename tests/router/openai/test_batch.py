"""router/openai/batch.py on hand-written answers: what the merged body, headers and stream are,
and that a merged stream's end (failure or client gone) closes every prompt's source."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from router.openai.batch import merge_bodies, merge_headers, merge_streams, sum_usage


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _chunk(cid: str, index: int, text: str, model: str = "small") -> bytes:
    return _event(
        {
            "id": cid,
            "object": "text_completion",
            "created": 1,
            "model": model,
            "choices": [{"index": index, "text": text, "finish_reason": None}],
        }
    )


class Source:
    """One prompt's SSE stream; records whether it was closed."""

    def __init__(self, events: list[bytes], hold: asyncio.Event | None = None) -> None:
        self.events, self.hold, self.closed = events, hold, False
        self._gen = self._run()

    async def _run(self) -> AsyncGenerator[bytes, None]:
        try:
            for e in self.events:
                yield e
            if self.hold is not None:
                await self.hold.wait()
            yield b"data: [DONE]\n\n"
        finally:
            self.closed = True

    def __aiter__(self) -> Source:
        return self

    async def __anext__(self) -> bytes:
        return await anext(self._gen)

    async def aclose(self) -> None:
        await self._gen.aclose()


def test_usage_sums_every_numeric_field_nested_details_included() -> None:
    a = {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    b = {
        "prompt_tokens": 4,
        "completion_tokens": 6,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert sum_usage([a, None, b]) == {
        "prompt_tokens": 7,
        "completion_tokens": 8,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    assert sum_usage([None]) is None


def test_bodies_and_headers_merge_in_prompt_order() -> None:
    """Bugs it catches: choices renumbered per prompt, the tier of one prompt reported for all,
    a fingerprint kept that only one of the tiers has."""

    def body(model: str, texts: list[str], fp: str) -> dict[str, Any]:
        return {
            "id": f"cmpl-{model}",
            "object": "text_completion",
            "created": 5,
            "model": model,
            "system_fingerprint": fp,
            "choices": [{"index": i, "text": t} for i, t in enumerate(texts)],
            "usage": {"prompt_tokens": 1, "completion_tokens": len(texts), "total_tokens": 1 + len(texts)},
        }

    merged = merge_bodies([body("small", ["a", "b"], "fp1"), body("large", ["c", "d"], "fp2")], "auto")
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert merged["model"] == "auto" and "system_fingerprint" not in merged
    assert merged["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    same = merge_bodies([body("small", ["a"], "fp1"), body("small", ["b"], "fp1")], "auto")
    assert same["model"] == "small" and same["system_fingerprint"] == "fp1"
    headers = merge_headers(
        [
            {"x-router-tier": "small", "x-router-cache": "miss", "x-router-score": "0.1"},
            {"x-router-tier": "large", "x-router-cache": "miss"},
        ]
    )
    assert headers == {"x-router-tier": "small, large", "x-router-cache": "miss"}


async def _drain(stream: AsyncGenerator[bytes, None]) -> list[Any]:
    out = []
    async for raw in stream:
        data = raw[len(b"data: ") :].strip()
        out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


def test_a_stream_is_reindexed_and_ends_once_with_the_summed_usage() -> None:
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}

    async def run() -> list[Any]:
        a = Source(
            [_chunk("x", 0, "a0"), _chunk("x", 1, "a1"), _event({"id": "x", "choices": [], "usage": usage})]
        )
        b = Source([_chunk("y", 1, "b1", "large"), _event({"id": "y", "choices": [], "usage": usage})])
        return await _drain(merge_streams([a, b], 2, ["small", "large"], "auto", include_usage=True))

    events = asyncio.run(run())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert events[-2]["choices"] == [] and events[-2]["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
    }
    texts = {c["index"]: c["text"] for e in events[:-2] for c in e["choices"]}
    assert texts == {0: "a0", 1: "a1", 3: "b1"}
    assert {e["id"] for e in events[:-1]} == {events[0]["id"]} and {e["model"] for e in events[:-1]} == {
        "auto"
    }


def test_a_failing_prompt_ends_the_stream_with_its_error_and_closes_the_others() -> None:
    """Bug it catches: the other prompts' engine requests left generating for nobody, or a
    client waiting on a stream whose [DONE] never comes."""

    async def run() -> tuple[list[Any], Source]:
        hold = asyncio.Event()  # the healthy prompt never ends by itself
        healthy = Source([_chunk("x", 0, "ok")], hold)
        failing = Source([_event({"error": {"message": "boom", "type": "server_error"}})])
        events = await _drain(merge_streams([healthy, failing], 1, ["small", "small"], "auto", False))
        return events, healthy

    events, healthy = asyncio.run(run())
    assert events[-2]["error"]["message"] == "boom" and events[-1] == "[DONE]"
    assert healthy.closed


def test_closing_the_merged_stream_closes_every_source() -> None:
    async def run() -> list[Source]:
        hold = asyncio.Event()
        sources = [Source([_chunk("x", 0, "a")], hold), Source([], hold)]
        merged = merge_streams(sources, 1, ["small", "small"], "auto", False)
        first = await anext(merged)
        assert b'"a"' in first
        await merged.aclose()  # the client left
        return sources

    assert all(s.closed for s in asyncio.run(run()))
