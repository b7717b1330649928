"""OpenAI Responses API (``/v1/responses``) through the official SDK, on the tiny tiers: each answer
is compared with the Chat Completions answer of the same conversation (greedy, same tier), which
is what the translation must reduce to (one pipeline)."""

from __future__ import annotations

import importlib
import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import response_create_params
from pydantic import BaseModel

from router.http.bridge.responses import ResponsesRequest
from tests.router.conftest import Server, keyed_tiny_server

KEYS_ENV = "TEST_RESPONSES_KEYS"
KEY_A, KEY_B = "sk-resp-a", "sk-resp-b"
SPECULATING = "large"  # drafts with medium (tiny_policy_yaml)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with keyed_tiny_server(
        tiny_model_dir, tmp_path_factory.mktemp("responses"), KEYS_ENV, f"{KEY_A}:team-a, {KEY_B}:team-b"
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0)


def _chat(server: Server, model: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The independent reference: the Chat Completions answer of the same conversation."""
    body = {"model": model, "messages": messages, "temperature": 0, **extra}
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY_A}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("model", ["small", SPECULATING])
def test_plain_response_is_the_chat_answer(server: Server, client: openai.OpenAI, model: str) -> None:
    """Bug caught: ``input``/``instructions`` lost or reordered in translation, usage not mapped."""
    raw = client.responses.with_raw_response.create(
        model=model,
        instructions="Be brief.",
        input="What is the capital of France?",
        max_output_tokens=8,
        temperature=0,
    )
    resp = raw.parse()
    assert raw.headers["x-router-tier"] == model
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == model
    ref = _chat(
        server,
        model,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_completion_tokens=8,
    )
    assert resp.output_text == ref["choices"][0]["message"]["content"]
    assert resp.usage is not None
    assert resp.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert resp.usage.output_tokens == ref["usage"]["completion_tokens"] <= 8
    truncated = ref["choices"][0]["finish_reason"] == "length"
    assert resp.status == ("incomplete" if truncated else "completed")


@pytest.mark.parametrize("model", ["small", SPECULATING])
def test_streamed_events_in_order(client: openai.OpenAI, model: str) -> None:
    """Bug caught: events out of order, missing ``sequence_number``s, deltas that do not add up to
    the completed response's text, or a stream that differs from the plain answer."""
    kwargs: dict[str, Any] = {
        "model": model,
        "input": "Write a haiku about the sea.",
        "max_output_tokens": 10,
    }
    plain = client.responses.create(temperature=0, **kwargs)
    events = list(client.responses.create(temperature=0, stream=True, **kwargs))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if plain.status == "completed" else "response.incomplete",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == final.output_text == plain.output_text
    assert final.usage is not None and final.usage.output_tokens == plain.usage.output_tokens  # type: ignore[union-attr]


class Verdict(BaseModel):
    ok: bool


def test_text_format_json_schema_parses(client: openai.OpenAI) -> None:
    """Bug caught: ``text.format`` not reaching the grammar engine (a random model's text is not
    JSON, so ``.parse`` would fail)."""
    resp = client.responses.parse(
        model="small", input="Is the sky blue?", text_format=Verdict, max_output_tokens=32, temperature=0
    )
    assert isinstance(resp.output_parsed, Verdict)
    json_object = client.responses.create(
        model="small",
        input="Reply in JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=24,
        temperature=0,
    )
    if json_object.status == "completed":
        assert isinstance(json.loads(json_object.output_text), dict)


@pytest.mark.parametrize("model", ["small", SPECULATING])
def test_forced_function_call_and_its_output(server: Server, client: openai.OpenAI, model: str) -> None:
    """Bug caught: tools or ``tool_choice`` dropped (no call), call items without ``call_id``, or a
    ``function_call_output`` that never reaches the model as the tool's result."""
    tool_choice: Any = {"type": "function", "name": "get_weather"}
    first = client.responses.create(
        model=model,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice=tool_choice,
        max_output_tokens=200,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    call = calls[0]
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    follow: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24C"},
    ]
    second = client.responses.create(
        model=model, input=follow, tools=[WEATHER], max_output_tokens=8, temperature=0
    )
    ref = _chat(
        server,
        model,
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 24C"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        max_completion_tokens=8,
    )
    ref_message = ref["choices"][0]["message"]
    got_calls = [(i.name, i.arguments) for i in second.output if i.type == "function_call"]
    want_calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in ref_message.get("tool_calls") or []
    ]
    assert second.output_text == (ref_message["content"] or "") and got_calls == want_calls


def test_previous_response_id_continues_and_is_per_tenant(server: Server, client: openai.OpenAI) -> None:
    """Bug caught: the stored conversation not prepended (the follow-up answers out of context), a
    stored response readable by another tenant, or DELETE that does not forget it."""
    first = client.responses.create(model="small", input="Name a color.", max_output_tokens=6, temperature=0)
    second = client.responses.create(
        model="small",
        previous_response_id=first.id,
        input="And another one?",
        max_output_tokens=6,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    ref = _chat(
        server,
        "small",
        [
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another one?"},
        ],
        max_completion_tokens=6,
    )
    assert second.output_text == ref["choices"][0]["message"]["content"]
    assert client.responses.retrieve(second.id).output_text == second.output_text

    other = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_B, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        other.responses.create(model="small", previous_response_id=first.id, input="hi", max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(first.id)

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model="small", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


# -- errors and field coverage ----------------------------------------------------------------
def _post(server: Server, body: dict[str, Any], key: str = KEY_A) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/responses", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30
    )


REFUSED: list[tuple[str, Any]] = [
    ("background", True),
    ("background_options", {"mode": "x"}),
    ("conversation", "conv_1"),
    ("context_management", [{"type": "compaction"}]),
    ("prompt", {"id": "pmpt_1"}),
    ("moderation", {"input": {"mode": "block"}}),
    ("image", {"model": "x"}),
    ("access_programs", ["x"]),
    ("max_tool_calls", 2),
    ("top_logprobs", 2),
    ("include", ["message.output_text.logprobs"]),
    ("reasoning", {"effort": "high"}),
    ("truncation", "auto"),
    ("tools", [{"type": "web_search"}]),
    ("tool_choice", {"type": "web_search_preview"}),
    ("text", {"format": {"type": "xml"}}),
    ("text", {"verbosity": "high"}),
    ("stream_options", {"include_obfuscation": True}),  # without stream: true
    ("input", [{"type": "reasoning", "summary": []}]),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
    ("max_output_tokens", 0),
    ("temperature", 3),
    ("service_tier", "flex"),
    ("prompt_cache_retention", "24h"),
    ("metadata", {f"k{i}": "v" for i in range(17)}),
]


@pytest.mark.parametrize(("field", "value"), REFUSED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(REFUSED)])
def test_refused_fields_are_400_naming_them(server: Server, field: str, value: Any) -> None:
    body = {"model": "small", "input": "hi", "max_output_tokens": 2, field: value}
    r = _post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == field or err["param"].startswith((field + ".", field + "[")), err


def test_unknown_field_and_bad_key_are_openai_shaped(server: Server) -> None:
    r = _post(server, {"model": "small", "input": "hi", "max_output_token": 2})
    assert r.status_code == 400 and r.json()["error"]["message"].endswith("max_output_token")
    assert r.json()["error"]["param"] == "max_output_token"
    bad = _post(server, {"model": "small", "input": "hi"}, key="sk-wrong")
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    missing = _post(server, {"model": "nope", "input": "hi"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


R = "tests.router.http.bridge.test_responses"
COVERED = {
    "model": f"{R}::test_plain_response_is_the_chat_answer",
    "input": f"{R}::test_forced_function_call_and_its_output",
    "instructions": f"{R}::test_plain_response_is_the_chat_answer",
    "max_output_tokens": f"{R}::test_plain_response_is_the_chat_answer",
    "temperature": f"{R}::test_plain_response_is_the_chat_answer",
    "top_p": f"{R}::test_accepted_fields",
    "tools": f"{R}::test_forced_function_call_and_its_output",
    "tool_choice": f"{R}::test_forced_function_call_and_its_output",
    "parallel_tool_calls": f"{R}::test_accepted_fields",
    "text": f"{R}::test_text_format_json_schema_parses",
    "store": f"{R}::test_previous_response_id_continues_and_is_per_tenant",
    "previous_response_id": f"{R}::test_previous_response_id_continues_and_is_per_tenant",
    "stream_options": f"{R}::test_accepted_fields",
    # Caller descriptions and cache hints: accepted, they do not change the output.
    "metadata": f"{R}::test_accepted_fields",
    "user": f"{R}::test_accepted_fields",
    "safety_identifier": f"{R}::test_accepted_fields",
    "prompt_cache_key": f"{R}::test_accepted_fields",
    "prompt_cache_options": f"{R}::test_accepted_fields",
    "prompt_cache_retention": f"{R}::test_accepted_fields",
    "service_tier": f"{R}::test_accepted_fields",
    "truncation": f"{R}::test_accepted_fields",
    "reasoning": f"{R}::test_accepted_fields",
    "include": f"{R}::test_accepted_fields",
}
STREAMING = {"stream"}


def _sdk_fields() -> set[str]:
    return set(response_create_params.ResponseCreateParamsBase.__annotations__)


def test_every_responses_field_is_covered_or_refused() -> None:
    refused = {f for f, _ in REFUSED}
    missing = _sdk_fields() - set(COVERED) - refused
    assert not missing, f"Responses fields with neither a behaviour nor a 400 test: {sorted(missing)}"
    assert set(ResponsesRequest.__struct_fields__) - _sdk_fields() - STREAMING == set()
    for ref in set(COVERED.values()):
        module, name = ref.split("::")
        assert callable(getattr(importlib.import_module(module), name, None)), ref


def test_accepted_fields(client: openai.OpenAI) -> None:
    """Fields honoured as OpenAI documents them without a visible effect on a random model's text."""
    plain = client.responses.create(model="small", input="hi", max_output_tokens=3, temperature=0)
    resp = client.responses.create(
        model="small",
        input="hi",
        max_output_tokens=3,
        temperature=0,
        top_p=0.9,
        parallel_tool_calls=False,
        metadata={"team": "a"},
        user="u-1",
        safety_identifier="s-1",
        prompt_cache_key="k",
        prompt_cache_retention="in_memory",
        service_tier="auto",
        truncation="disabled",
        reasoning={"effort": "none"},
        include=[],
        extra_body={"prompt_cache_options": {"mode": "implicit"}},
    )
    assert resp.output_text == plain.output_text and resp.metadata == {"team": "a"}
    streamed = list(
        client.responses.create(
            model="small",
            input="hi",
            max_output_tokens=3,
            stream=True,
            stream_options={"include_obfuscation": False},
        )
    )
    assert streamed[-1].type in ("response.completed", "response.incomplete")


def fuzz_operations(
    server: Server, path_regex: str, headers: dict[str, str], error_ok: Callable[[httpx.Response], bool]
) -> Counter[int]:
    """schemathesis over the operations of the service's OpenAPI schema whose path matches, with
    positive and negative data (bounded): fails on a 5xx other than 503 or a 4xx whose body is not
    in the API's error shape; returns the statuses seen."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(server.url + "/schema/openapi.json", headers=headers).include(
        path_regex=path_regex
    )
    assert list(schema.get_all_operations())
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

        @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(schema.as_strategy(generation_mode=mode))
        def check(case: Any) -> None:
            resp = case.call(base_url=server.url, headers=headers, timeout=60)
            statuses[resp.status_code] += 1
            where = f"{case.method} {case.path}"
            if resp.status_code >= 500 and resp.status_code != 503:
                failures.append(f"{where}: {resp.status_code} {resp.text[:300]}")
            elif 400 <= resp.status_code < 500 and not error_ok(
                httpx.Response(resp.status_code, content=resp.content)
            ):
                failures.append(f"{where}: {resp.status_code} body not in the API's shape: {resp.text[:200]}")

        check()
    assert not failures, failures[:5]
    return statuses


def test_generated_requests_never_cause_a_5xx(server: Server) -> None:
    """schemathesis over the Responses operations (create, retrieve, delete): no 5xx, every 4xx
    OpenAI-shaped."""
    from tests.router.test_reliability import error_body_ok

    statuses = fuzz_operations(server, "^/v1/responses", {"authorization": f"Bearer {KEY_A}"}, error_body_ok)
    # Generated bodies rarely make a valid conversation: the point is that none is a 5xx.
    assert sum(statuses.values()) >= 60 and statuses[400] > 0, statuses


def test_streamed_function_call_events(client: openai.OpenAI) -> None:
    """Bug caught: tool-call deltas dropped from the event stream, or arguments that do not add up
    to the call of the plain (greedy) answer."""
    kwargs: Any = {
        "model": "small",
        "input": "Weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 200,
        "temperature": 0,
    }
    plain = next(i for i in client.responses.create(**kwargs).output if i.type == "function_call")
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == plain.arguments  # type: ignore[union-attr]
    assert types.index("response.function_call_arguments.done") < types.index("response.output_item.done")
    final = events[-1].response  # type: ignore[union-attr]
    assert [i.type for i in final.output] == ["function_call"] and final.output[
        0
    ].arguments == plain.arguments
