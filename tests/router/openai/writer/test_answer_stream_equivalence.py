"""Differential tests of the one writer of answers (router/openai/writer): the same greedy
request answered streamed and unstreamed carries the same text, finish reason and usage on
chat, completions, Responses and Messages; and a stop string (found in the unstopped answer's
own tokens, so split across tokens and stream chunks) ends the text exactly where it starts.

The reference is the unstopped, unstreamed answer of the same greedy request: greedy decoding
is deterministic, so every other answer is a prefix of it."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.openai.writer import DONE
from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, start_server

PROMPT = "Tell me a short story about a lighthouse keeper."


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny tiers without drafts (a draft changes only how tokens are grouped in chunks)."""
    path = tmp_path_factory.mktemp("policy") / "policy.yaml"
    path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False))
    s, stop = start_server(path, watch_policy=False)
    yield s
    stop()


def _post(srv: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _events(srv: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's JSON events, in order (the ``[DONE]`` sentinel checked and dropped)."""
    events: list[dict[str, Any]] = []
    done = False
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == DONE.decode().strip().removeprefix("data: ") or data == "[DONE]":
                done = True
                continue
            events.append(json.loads(data))
    if path in ("/v1/chat/completions", "/v1/completions"):
        assert done, "an OpenAI stream ends with [DONE]"
    return events


def _counts(usage: dict[str, Any] | None) -> dict[str, Any]:
    """Usage without what the prefix cache served (a repeated prompt is partly cached the second
    time: the same tokens, counted as cached)."""
    assert usage is not None
    return {k: v for k, v in usage.items() if not k.endswith("_details")}


def _chat_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "small",
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": 16,
        **extra,
    }


def _chat_streamed(srv: Server, body: dict[str, Any]) -> tuple[str, str | None, dict[str, Any] | None]:
    text, finish, usage = "", None, None
    for e in _events(srv, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}):
        for c in e.get("choices", []):
            text += c["delta"].get("content") or ""
            finish = c.get("finish_reason") or finish
        usage = e.get("usage") or usage
    return text, finish, usage


@pytest.mark.parametrize("max_tokens", [1, 7, 16])
def test_chat_streamed_equals_unstreamed(srv: Server, max_tokens: int) -> None:
    """Bug it catches: a stream that loses its last characters (held back for a stop string that
    never came), repeats a delta, ends with another finish reason, or counts usage differently."""
    body = _chat_body(max_tokens=max_tokens)
    plain = _post(srv, "/v1/chat/completions", body)
    text, finish, usage = _chat_streamed(srv, body)
    assert text == plain["choices"][0]["message"]["content"]
    assert finish == plain["choices"][0]["finish_reason"]
    assert _counts(usage) == _counts(plain["usage"])
    if plain["choices"][0]["finish_reason"] == "length":
        assert plain["usage"]["completion_tokens"] == max_tokens


def test_completions_streamed_equals_unstreamed(srv: Server) -> None:
    body = {"model": "small", "prompt": PROMPT, "temperature": 0, "max_tokens": 12}
    plain = _post(srv, "/v1/completions", body)
    text, finish, usage = "", None, None
    for e in _events(srv, "/v1/completions", {**body, "stream_options": {"include_usage": True}}):
        for c in e.get("choices", []):
            text += c.get("text") or ""
            finish = c.get("finish_reason") or finish
        usage = e.get("usage") or usage
    assert text == plain["choices"][0]["text"]
    assert finish == plain["choices"][0]["finish_reason"]
    assert _counts(usage) == _counts(plain["usage"])


def test_responses_streamed_equals_unstreamed(srv: Server) -> None:
    body = {"model": "small", "input": PROMPT, "temperature": 0, "max_output_tokens": 12, "store": False}
    plain = _post(srv, "/v1/responses", body)
    events = _events(srv, "/v1/responses", body)
    deltas = "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete")

    def text_of(resp: dict[str, Any]) -> str:
        return "".join(
            part["text"]
            for item in resp["output"]
            if item.get("type") == "message"
            for part in item["content"]
            if part.get("type") == "output_text"
        )

    assert deltas == text_of(final["response"]) == text_of(plain)
    assert final["response"]["status"] == plain["status"]
    assert final["response"].get("incomplete_details") == plain.get("incomplete_details")
    assert _counts(final["response"]["usage"]) == _counts(plain["usage"])


def test_messages_streamed_equals_unstreamed(srv: Server) -> None:
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 12,
        "temperature": 0,
    }
    plain = _post(srv, "/v1/messages", body)
    events = _events(srv, "/v1/messages", body)
    text = "".join(
        e["delta"]["text"]
        for e in events
        if e.get("type") == "content_block_delta" and e["delta"].get("type") == "text_delta"
    )
    start = next(e for e in events if e.get("type") == "message_start")
    end = next(e for e in events if e.get("type") == "message_delta")
    assert text == "".join(b["text"] for b in plain["content"] if b["type"] == "text")
    assert end["delta"]["stop_reason"] == plain["stop_reason"]
    assert end["usage"]["output_tokens"] == plain["usage"]["output_tokens"]

    def prompt(usage: dict[str, Any]) -> int:
        return int(usage["input_tokens"]) + int(usage.get("cache_read_input_tokens") or 0)

    assert prompt(start["message"]["usage"]) == prompt(plain["usage"]) > 0


def _tokens(srv: Server) -> tuple[str, list[str]]:
    """The unstopped greedy answer and its tokens (as the logprobs name them), special tokens left
    out: the random tiny model may emit one, which the logprobs name (``<|im_start|>``) and the
    text skips, as vLLM's ``skip_special_tokens`` does."""
    plain = _post(srv, "/v1/chat/completions", _chat_body(logprobs=True))
    choice = plain["choices"][0]
    tok = srv.engine("small").tokenizer
    special = {t.content for t in tok.added_tokens_decoder.values() if t.special} | set(
        tok.all_special_tokens
    )
    tokens = [t["token"] for t in choice["logprobs"]["content"] if t["token"] not in special]
    return choice["message"]["content"], tokens


def _split_stops(text: str, tokens: list[str]) -> list[str]:
    """Stop strings that straddle a token boundary (the end of one token, the start of the next),
    each first found in ``text`` at that boundary."""
    stops, at = [], 0
    for a, b in itertools.pairwise(tokens):
        at += len(a)
        if a.strip() and b.strip():
            stop = a[-2:] + b[:2]
            if text.find(stop) == at - len(a[-2:]) and stop.strip() and "\ufffd" not in stop:
                stops.append(stop)
    return stops


def test_a_stop_string_split_across_tokens_ends_the_text_exactly_before_it(srv: Server) -> None:
    """Bug it catches: text past the stop string returned (the stop only matched within one
    token), text before it held back and never sent, or the stop string itself returned."""
    text, tokens = _tokens(srv)
    # A last byte token of an unfinished UTF-8 character is not text yet (logprobs name it
    # U+FFFD); every other token is the text, in order.
    assert "".join(tokens).rstrip("\ufffd") == text.rstrip("\ufffd"), "the tokens spell the text"
    stops = _split_stops(text, tokens)
    if not stops:
        pytest.skip("the tiny model's answer has no token boundary between printable tokens")
    for stop in stops[:3]:
        want = text[: text.index(stop)]
        body = _chat_body(stop=[stop])
        plain = _post(srv, "/v1/chat/completions", body)["choices"][0]
        assert plain["message"]["content"] == want
        assert plain["finish_reason"] == "stop"
        streamed, finish, _ = _chat_streamed(srv, body)
        assert streamed == want and finish == "stop"
        kept = _post(srv, "/v1/chat/completions", _chat_body(stop=[stop], include_stop_str_in_output=True))
        assert kept["choices"][0]["message"]["content"] == want + stop


def test_a_stop_string_never_generated_holds_nothing_back(srv: Server) -> None:
    """Bug it catches: the last characters kept back as a possible start of a stop string and
    dropped when the answer ends by length instead."""
    text, _ = _tokens(srv)
    for stop in [text[-1] + "\u2603", "\u2603"]:
        body = _chat_body(stop=[stop])
        plain = _post(srv, "/v1/chat/completions", body)["choices"][0]
        assert plain["message"]["content"] == text and plain["finish_reason"] == "length"
        streamed, finish, _ = _chat_streamed(srv, body)
        assert streamed == text and finish == "length"
