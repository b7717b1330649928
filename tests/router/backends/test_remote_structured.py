"""Remote tiers forward tools, response_format, logprobs and n unchanged and stream the upstream's
tool-call deltas and logprobs back (the upstream here: a second instance of this service)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.router.conftest import Server, start_server
from tests.router.openai.test_structured import (
    ANSWER_SCHEMA,
    ASK,
    TOOLS,
    Answer,
    WeatherArgs,
    long_context_server,
)


@pytest.fixture(scope="module")
def upstream(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from long_context_server(tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def client(upstream: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    path = tmp_path_factory.mktemp("front") / "policy.yaml"
    path.write_text(
        f"""
version: 1
tiers:
  remote: {{model: "{upstream.url}/v1", served_model_name: medium, max_retries: 0, timeout_s: 60}}
routing:
  rules:
    - {{name: default, tier: remote}}
service:
  auth: {{mode: open}}
  cache: {{enabled: false}}
"""
    )
    srv, stop = start_server(path, watch_policy=False)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    stop()


def test_remote_json_schema_and_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="remote",
        messages=ASK,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}},
        max_tokens=200,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = resp.choices[0]
    Answer.model_validate_json(choice.message.content or "")
    assert choice.logprobs is not None and choice.logprobs.content
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert resp.system_fingerprint


def test_remote_forced_tool_call_streamed_and_not(client: openai.OpenAI) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(
        model="remote",
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=200,
        temperature=0,
    )
    calls = resp.choices[0].message.tool_calls or []
    assert resp.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    WeatherArgs.model_validate_json(calls[0].function.arguments)  # type: ignore[union-attr]
    chunks = list(
        client.chat.completions.create(
            model="remote",
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=200,
            temperature=0,
            stream=True,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert args == calls[0].function.arguments  # type: ignore[union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_remote_n_choices(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="remote", messages=ASK, max_tokens=5, n=2, temperature=1.0, seed=3
    )
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in resp.choices)
