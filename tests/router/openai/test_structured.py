"""Structured outputs, tool calls, logprobs and n > 1 through the HTTP API with the official
``openai`` SDK, on the tiny random models.

A random model never writes JSON by itself, so every parse below is the grammar's doing. The
schemas are bounded (enums, bounded numbers and strings) so that every path through them ends
well within ``max_tokens``; each test runs on the plain tier (``small``) and on a speculating
one (``medium`` drafts with ``small``), where draft tokens are checked against the grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pydantic
import pytest

from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, start_server

TIERS = ["small", "medium"]


class Answer(pydantic.BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool
    count: int = pydantic.Field(ge=0, le=99)
    tag: str = pydantic.Field(max_length=6, pattern="^[a-z]+$")


ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "maxLength": 6, "pattern": "^[a-z]+$"},
    },
    "required": ["color", "ok", "count", "tag"],
    "additionalProperties": False,
}


class WeatherArgs(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: Literal["paris", "tokyo", "lima"]
    unit: Literal["c", "f"]
    days: int = pydantic.Field(ge=1, le=7)


TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["paris", "tokyo", "lima"]},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "unit", "days"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


def long_context_server(model_dir: Path, tmp: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny policy with room for tool prompts, which are long in the tiny tokenizer (a few
    characters per token)."""
    path = tmp.mktemp("policy") / "policy.yaml"
    yaml = tiny_policy_yaml(model_dir, cache_enabled=False)
    path.write_text(yaml.replace("max_model_len: 256", "max_model_len: 1024"))
    srv, stop = start_server(path)
    yield srv
    stop()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from long_context_server(tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("tier", TIERS)
def test_parse_with_pydantic_model(client: openai.OpenAI, tier: str) -> None:
    done = client.chat.completions.parse(
        model=tier, messages=ASK, response_format=Answer, max_completion_tokens=200, temperature=0
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Answer)
    assert done.system_fingerprint and done.system_fingerprint.startswith("fp_")


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("seed", [1, 2])
def test_json_schema_output_validates_sampled(client: openai.OpenAI, tier: str, seed: int) -> None:
    resp = client.chat.completions.create(
        model=tier,
        messages=ASK,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True},
        },
        max_tokens=200,
        temperature=1.0,
        seed=seed,
    )
    assert resp.choices[0].finish_reason == "stop"
    Answer.model_validate_json(resp.choices[0].message.content or "")


@pytest.mark.parametrize("tier", TIERS)
def test_json_schema_streamed(client: openai.OpenAI, tier: str) -> None:
    stream = client.chat.completions.create(
        model=tier,
        messages=ASK,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    Answer.model_validate_json(text)


@pytest.mark.parametrize("tier", TIERS)
def test_json_object_is_an_object_or_says_length(client: openai.OpenAI, tier: str) -> None:
    resp = client.chat.completions.create(
        model=tier,
        messages=[{"role": "user", "content": "Reply in JSON."}],
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0,
    )
    choice = resp.choices[0]
    content = choice.message.content or ""
    assert content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # the only way out of the grammar, and then the response says so
        assert choice.finish_reason == "length"


def _check_call(call: Any) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    if call.function.name == "get_weather":
        WeatherArgs.model_validate_json(call.function.arguments)
    else:
        assert call.function.name == "get_time"
        assert json.loads(call.function.arguments)["zone"] in ("utc", "cet")


@pytest.mark.parametrize("tier", TIERS)
def test_forced_tool_call(client: openai.OpenAI, tier: str) -> None:
    resp = client.chat.completions.create(
        model=tier,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        temperature=0.8,
        seed=3,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    _check_call(calls[0])


@pytest.mark.parametrize("tier", TIERS)
def test_required_tool_calls_streamed(client: openai.OpenAI, tier: str) -> None:
    stream = client.chat.completions.create(
        model=tier,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].id and deltas[0].function and deltas[0].function.name
    assert all(d.index == 0 for d in deltas)  # parallel_tool_calls=false: exactly one call
    assert all(d.id is None for d in deltas[1:])  # the id and name come once, then fragments
    args = "".join(d.function.arguments or "" for d in deltas if d.function)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    name = deltas[0].function.name
    if name == "get_weather":
        WeatherArgs.model_validate_json(args)
    else:
        assert json.loads(args)["zone"] in ("utc", "cet")
    # The same request without streaming gives the same call (greedy).
    again = client.chat.completions.create(
        model=tier,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    calls = again.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [(name, args)]  # type: ignore[union-attr]


def test_auto_tool_choice_is_text_or_valid_calls(client: openai.OpenAI) -> None:
    for seed in range(4):
        resp = client.chat.completions.create(
            model="small", messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0, seed=seed
        )
        choice = resp.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and not choice.message.content
            for call in choice.message.tool_calls:
                _check_call(call)
        else:
            assert "<tool_call>" not in (choice.message.content or "")


def test_tool_history_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="small", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    messages: list[Any] = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    final = client.chat.completions.create(
        model="small", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in (
        "stop",
        "length",
    )


@pytest.mark.parametrize("tier", TIERS)
def test_top_logprobs(client: openai.OpenAI, tier: str) -> None:
    resp = client.chat.completions.create(
        model=tier, messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = resp.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    # A character split over tokens has no text per token; the bytes always join up exactly.
    joined = bytes(b for t in content for b in t.bytes or [])
    assert joined.decode(errors="replace") == choice.message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
        assert [a.logprob for a in t.top_logprobs] == sorted(
            (a.logprob for a in t.top_logprobs), reverse=True
        )
    stream = client.chat.completions.create(
        model=tier, messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [
        t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []
    ]
    assert [(t.token, round(t.logprob, 3)) for t in streamed] == [
        (t.token, round(t.logprob, 3)) for t in content
    ]


@pytest.mark.parametrize("tier", TIERS)
def test_n_choices(client: openai.OpenAI, tier: str) -> None:
    resp = client.chat.completions.create(
        model=tier,
        messages=ASK,
        max_tokens=8,
        temperature=1.0,
        seed=7,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
    )
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage is not None and resp.usage.completion_tokens >= 2
    stream = client.chat.completions.create(
        model=tier, messages=ASK, max_tokens=8, temperature=1.0, seed=7, n=2, stream=True
    )
    texts = {0: "", 1: ""}
    finishes = {}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert set(finishes) == {0, 1}


def test_completions_logprobs_echo_n(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model="small", prompt="The quick", max_tokens=5, temperature=0, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert resp.usage is not None and len(lp.tokens) == resp.usage.completion_tokens
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    echoed = client.completions.create(
        model="small", prompt="The quick", max_tokens=5, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "The quick" + resp.choices[0].text
    many = client.completions.create(model="small", prompt="The quick", max_tokens=5, n=2, best_of=3, seed=1)
    assert [c.index for c in many.choices] == [0, 1]
    stream = client.completions.create(
        model="small", prompt="The quick", max_tokens=5, temperature=0, stream=True, echo=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].text == "The quick"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "The quick" + resp.choices[0].text
    streamed = client.completions.create(
        model="small", prompt="The quick", max_tokens=5, temperature=0, logprobs=2, stream=True
    )
    tokens = [
        t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []
    ]
    assert tokens == lp.tokens
    # Echo with logprobs scores the prompt too (tests/router/openai/test_logprobs_prompt.py), on one choice.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="small", prompt="The quick", max_tokens=5, echo=True, logprobs=1, n=2)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "echo"


def test_logit_bias_and_min_p(client: openai.OpenAI, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = client.completions.create(
        model="small", prompt="The quick", max_tokens=1, temperature=0, logprobs=0
    )
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.tokens
    first = plain.choices[0].logprobs.tokens[0]
    ids = tokenizer.encode(first, add_special_tokens=False)
    # min_p keeps the most likely token; a -100 bias on it forbids it.
    kept = client.completions.create(
        model="small",
        prompt="The quick",
        max_tokens=1,
        temperature=1.0,
        seed=5,
        logprobs=0,
        extra_body={"min_p": 1.0},
    )
    assert kept.choices[0].logprobs is not None and kept.choices[0].logprobs.tokens == [first]
    biased = client.completions.create(
        model="small",
        prompt="The quick",
        max_tokens=1,
        temperature=0,
        logprobs=0,
        logit_bias={str(ids[0]): -100},
    )
    assert biased.choices[0].logprobs is not None and biased.choices[0].logprobs.tokens != [first]


def test_schemas_that_cannot_be_enforced_are_400(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        # strict: OpenAI's rules (every property required, additionalProperties false)
        (
            {
                "name": "a",
                "strict": True,
                "schema": {"type": "object", "properties": {"x": {"type": "string"}}},
            },
            "response_format.json_schema.schema",
        ),
        # not a schema the grammar compiler understands
        ({"name": "a", "schema": {"type": "frobnicate"}}, "response_format"),
    ]
    for json_schema, param in cases:
        fmt: Any = {"type": "json_schema", "json_schema": json_schema}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="small",
                messages=ASK,
                max_tokens=5,
                response_format=fmt,
            )
        assert isinstance(info.value.body, dict) and info.value.body["param"] == param
    bad_tool: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="small", messages=ASK, max_tokens=5, tools=bad_tool, tool_choice="required"
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "tools"


def test_sdk_stream_helper_parses_content_and_tool_calls(client: openai.OpenAI) -> None:
    # The SDK's own stream accumulator (chat.completions.stream) over our chunks.
    with client.chat.completions.stream(
        model="medium", messages=ASK, response_format=Answer, max_completion_tokens=200, temperature=0
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Answer)
    with client.chat.completions.stream(
        model="medium",
        messages=ASK,
        tools=[openai.pydantic_function_tool(WeatherArgs, name="get_weather")],
        tool_choice="required",
        max_completion_tokens=200,
        temperature=0,
    ) as tool_stream:
        done = tool_stream.get_final_completion()
    calls = done.choices[0].message.tool_calls or []
    assert calls and isinstance(calls[0].function.parsed_arguments, WeatherArgs)
