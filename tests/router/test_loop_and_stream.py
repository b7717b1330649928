"""Issue 37: request-sized work never runs on the event loop (one client's 1 MB prompt or large
schema must not stall every stream and probe), and a stream that fails after its first byte
still ends as OpenAI clients expect: an error event, then ``[DONE]``."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, start_server

LONG_PROMPT_RULE = """  rules:
    - name: long-prompt
      when: {prompt_tokens_above: 64}
      tier: medium
"""


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("loop") / "policy.yaml"
    # A prompt_tokens rule, as in the default policy: long prompts are tokenized to be counted.
    text = tiny_policy_yaml(tiny_model_dir, cache_enabled=False).replace("  rules:\n", LONG_PROMPT_RULE, 1)
    path.write_text(text)
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()


class _OnLoop:
    """Wraps callables and records, per call, whether it ran on a thread with a running loop."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []
        self._lock = threading.Lock()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            on_loop = asyncio._get_running_loop() is not None
            with self._lock:
                self.calls.append((name, on_loop))
            return fn(*args, **kwargs)

        return wrapped


def test_tokenization_and_grammar_compilation_run_off_the_event_loop(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug: a long prompt was tokenized twice on the loop (0.6-0.9 s each at 1 MB: routing's
    count, then the tier's template) and a fresh schema compiled there (2.8 s at 5,000
    properties): /healthz and every stream stalled meanwhile."""
    from tiers.sample.grammar import compiler_for

    seen = _OnLoop()
    counting = server.service.tiers.counting_tokenizer()
    medium = server.service.tiers.tiers["medium"]
    small = server.service.tiers.tiers["small"]
    monkeypatch.setattr(counting, "encode", seen.wrap("count", counting.encode))
    for tier in (small, medium):
        tok = tier.tokenizer
        monkeypatch.setattr(tok, "apply_chat_template", seen.wrap("template", tok.apply_chat_template))
    compiler = compiler_for(small.tokenizer)
    monkeypatch.setattr(compiler, "_template", seen.wrap("grammar", compiler._template))

    long_prompt = "lorem ipsum dolor " * 300  # ~5 KB: counted for the rule, past the 256-token context
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "auto", "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": "small",
            "messages": [{"role": "user", "content": "json"}],
            "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    names = {name for name, _ in seen.calls}
    assert {"count", "template", "grammar"} <= names  # every wrapped step ran
    assert [name for name, on_loop in seen.calls if on_loop] == []


def test_a_prompt_longer_than_every_tier_is_refused_from_its_bytes_without_tokenizing(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug: a 1 MB prompt was tokenized (1.5 s of CPU beside the engines) only to be refused with
    a 429 ``predicted_wait_exceeded``, an error that tells the client to retry the same request.
    A text of N bytes holds at least N / (most bytes per token) tokens: past every tier's
    ``max_model_len`` that is a 400 ``context_length_exceeded`` with no tokenizer call."""
    seen = _OnLoop()
    counting = server.service.tiers.counting_tokenizer()
    monkeypatch.setattr(counting, "encode", seen.wrap("count", counting.encode))
    for tier in server.service.tiers.tiers.values():
        monkeypatch.setattr(
            tier.tokenizer, "apply_chat_template", seen.wrap("template", tier.tokenizer.apply_chat_template)
        )
    huge = "x " * 20_000
    chat = {"model": "auto", "messages": [{"role": "user", "content": huge}], "max_tokens": 2}
    for path, body, param in (
        ("/v1/chat/completions", chat, "messages"),
        ("/v1/completions", {"model": "auto", "prompt": huge, "max_tokens": 2}, "prompt"),
        ("/v1/route", {"messages": chat["messages"]}, "messages"),
    ):
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", param), path
    assert seen.calls == []  # refused before any tokenization
    monkeypatch.undo()
    # The refusal is right: the real count is past every tier's limit.
    limit = max(t.max_model_len for t in server.service.tiers.tiers.values())
    assert len(counting.encode(huge, add_special_tokens=False)) > limit
    # Just under the bound the prompt is tokenized as before (a 400 from the tier's own count).
    below = "x " * (limit * server.service.tiers.token_bytes // 4)
    seen2 = _OnLoop()
    monkeypatch.setattr(counting, "encode", seen2.wrap("count", counting.encode))
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "auto", "messages": [{"role": "user", "content": below}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert seen2.calls  # counted: the byte bound alone could not refuse it


def _events(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line[6:]


def test_an_engine_abort_mid_stream_ends_with_an_error_event_and_done(server: Server) -> None:
    """Bug: a mid-stream engine abort ended the SSE stream with neither an error event nor
    ``[DONE]``: clients took the cut answer for a whole one (or waited for more)."""
    engine = server.engine("small")
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": "count to a thousand"}],
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = _events(r.iter_lines())
        first = json.loads(next(events))
        assert first["choices"][0]["delta"].get("role") == "assistant"
        deadline = time.monotonic() + 10
        while not engine._tracked and time.monotonic() < deadline:
            time.sleep(0.01)
        for tracked in list(engine._tracked.values()):
            engine.abort(tracked.seq)
        rest = list(events)
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])
    assert error["error"]["code"] == "aborted" and error["error"]["type"]
    assert all("error" not in json.loads(e) for e in rest[:-2])
    server.wait_idle()


def test_a_collected_answer_that_cannot_finish_before_the_deadline_is_refused_up_front(
    server: Server,
) -> None:
    """Bug: a non-streaming request was admitted although its ``max_tokens`` could not be
    generated before its ``x-request-timeout``: the work was done for a client that had left."""
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": "a long story"}],
        "max_tokens": 200,
        "ignore_eos": True,
    }
    r = httpx.post(
        server.url + "/v1/chat/completions", json=body, headers={"x-request-timeout": "0.01"}, timeout=30
    )
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "deadline_unreachable" and "retry-after" in r.headers
    fits = dict(body, max_tokens=2)
    ok = httpx.post(
        server.url + "/v1/chat/completions", json=fits, headers={"x-request-timeout": "20"}, timeout=30
    )
    assert ok.status_code == 200, ok.text
