"""The acceptance of structured outputs on the real embedded default (SmolLM2-135M), through the
HTTP API with the official ``openai`` SDK, on the plain tier (``small``) and on a speculating
tier (``medium`` drafts with ``small``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import openai
import pydantic
import pytest

from tests.router.conftest import Server, start_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
TIERS = ["small", "medium"]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    population_millions: float
    is_capital: bool


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}


class WeatherArgs(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def client(embedded_model_dir: Path) -> Iterator[openai.OpenAI]:
    srv: Server
    srv, stop = start_server(ROOT / "policies/default.yaml", watch_policy=False)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    stop()


@pytest.mark.parametrize("tier", TIERS)
def test_parse_pydantic(client: openai.OpenAI, tier: str) -> None:
    done = client.chat.completions.parse(
        model=tier,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_completion_tokens=120,
        temperature=0,
    )
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(done.choices[0].message.parsed, City)


@pytest.mark.parametrize("tier", TIERS)
def test_json_object(client: openai.OpenAI, tier: str) -> None:
    resp = client.chat.completions.create(
        model=tier,
        messages=[{"role": "user", "content": "Give me a JSON object with a key 'answer' saying hello."}],
        response_format={"type": "json_object"},
        max_tokens=80,
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content or ""), dict)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("stream", [False, True])
def test_forced_and_required_tool_calls(client: openai.OpenAI, tier: str, stream: bool) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for tool_choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        kwargs = {
            "model": tier,
            "messages": ask,
            "tools": [WEATHER_TOOL],
            "tool_choice": tool_choice,
            "max_tokens": 80,
            "temperature": 0,
        }
        if not stream:
            resp = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
            assert resp.choices[0].finish_reason == "tool_calls"
            calls = resp.choices[0].message.tool_calls
            assert calls and calls[0].function.name == "get_weather"
            WeatherArgs.model_validate_json(calls[0].function.arguments)
        else:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
            deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            assert deltas[0].function.name == "get_weather" and deltas[0].id
            args = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
            WeatherArgs.model_validate_json(args)


@pytest.mark.parametrize("tier", TIERS)
def test_top_logprobs_and_n(client: openai.OpenAI, tier: str) -> None:
    resp = client.chat.completions.create(
        model=tier,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-3) for t in content)
    two = client.chat.completions.create(
        model=tier,
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=8,
        temperature=1.0,
        seed=1,
        n=2,
    )
    assert [c.index for c in two.choices] == [0, 1]
