"""Anthropic Messages API (``/v1/messages``) through the official ``anthropic`` SDK, on the tiny
tiers: each answer is compared with the Chat Completions answer of the same conversation (greedy,
same tier), which is what the translation must reduce to (one pipeline)."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import message_create_params

from router.http.bridge.messages import MessagesRequest
from tests.router.conftest import Server, keyed_tiny_server

KEYS_ENV = "TEST_MESSAGES_KEYS"
KEY = "sk-msg-a"
SPECULATING = "large"  # drafts with medium (tiny_policy_yaml)
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with keyed_tiny_server(
        tiny_model_dir, tmp_path_factory.mktemp("messages"), KEYS_ENV, f"{KEY}:team-a"
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    # The SDK sends the key as x-api-key.
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _chat(server: Server, model: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The independent reference: the Chat Completions answer of the same conversation."""
    body = {"model": model, "messages": messages, "temperature": 0, **extra}
    r = httpx.post(
        server.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("model", ["small", SPECULATING])
def test_plain_message_is_the_chat_answer(server: Server, client: anthropic.Anthropic, model: str) -> None:
    """Bug caught: ``system`` or ``messages`` lost in translation, usage or stop_reason not mapped."""
    raw = client.messages.with_raw_response.create(
        model=model, system="Be brief.", messages=ASK, max_tokens=8, extra_body={"temperature": 0}
    )
    msg = raw.parse()
    assert raw.headers["x-router-tier"] == model
    assert msg.type == "message" and msg.role == "assistant" and msg.model == model
    ref = _chat(server, model, [{"role": "system", "content": "Be brief."}, *ASK], max_tokens=8)
    assert _text(msg) == ref["choices"][0]["message"]["content"]
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == ref["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == ref["usage"]["completion_tokens"]
    finish = ref["choices"][0]["finish_reason"]
    assert msg.stop_reason == ("max_tokens" if finish == "length" else "end_turn")


@pytest.mark.parametrize("model", ["small", SPECULATING])
def test_streamed_text_accumulates_to_the_plain_answer(client: anthropic.Anthropic, model: str) -> None:
    """Bug caught: events out of Anthropic's order (the SDK's accumulator raises), lost deltas, or
    a stop_reason that differs from the plain answer's."""
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Write a haiku about the sea."}],
        "max_tokens": 10,
        "extra_body": {"temperature": 0},
    }
    plain = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(final) == _text(plain)
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
    # The prefix cache serves part of a repeated prompt: read + uncached is the whole prompt.
    prompt = plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == prompt > 0
    events = list(client.messages.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types[1] == "content_block_start" and types[-3] == "content_block_stop"


@pytest.mark.parametrize("model", ["small", SPECULATING])
def test_forced_tool_use_and_tool_result(server: Server, client: anthropic.Anthropic, model: str) -> None:
    """Bug caught: ``tool_choice: tool`` not forcing the call, ``input`` not an object under the
    tool's schema, or a ``tool_result`` that never reaches the model as the tool's result."""
    first = client.messages.create(
        model=model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=200,
    )
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(uses) == 1
    use = uses[0]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Rome")  # type: ignore[index]
    follow: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24C"}],
        },
    ]
    second = client.messages.create(
        model=model,
        messages=follow,
        tools=[WEATHER],
        max_tokens=8,
        extra_body={"temperature": 0},  # type: ignore[list-item]
    )
    arguments = json.dumps(use.input, ensure_ascii=False)
    ref = _chat(
        server,
        model,
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": "sunny, 24C"},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": WEATHER["description"],
                    "parameters": WEATHER["input_schema"],
                },
            }
        ],
        max_tokens=8,
    )
    ref_message = ref["choices"][0]["message"]
    assert _text(second) == (ref_message["content"] or "")
    got = [(b.name, b.input) for b in second.content if b.type == "tool_use"]
    want = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in ref_message.get("tool_calls") or []
    ]
    assert got == want


def test_stop_sequences_name_the_one_that_matched(client: anthropic.Anthropic) -> None:
    """Bug caught: the stop sequence returned in the text, ``stop_reason`` ``end_turn`` instead of
    ``stop_sequence``, or the streamed text running past it. Reference: the unstopped answer."""
    kwargs: dict[str, Any] = {
        "model": "small",
        "messages": ASK,
        "max_tokens": 16,
        "extra_body": {"temperature": 0},
    }
    full = _text(client.messages.create(**kwargs))
    at = next(
        (k for k in range(1, len(full) - 1) if full[k : k + 2].strip() and full.find(full[k : k + 2]) == k),
        None,
    )
    assert at is not None, f"no usable stop sequence in {full!r}"
    stop = full[at : at + 2]
    msg = client.messages.create(stop_sequences=[stop, "\x00never"], **kwargs)
    assert _text(msg) == full[:at]
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    with client.messages.stream(stop_sequences=[stop], **kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == full[:at] and final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_count_tokens_is_the_prompt_the_model_reads(client: anthropic.Anthropic) -> None:
    """Bug caught: a count that is not the prompt's (the template, system or tools left out)."""
    for tools in (None, [WEATHER]):
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        counted = client.messages.count_tokens(model="small", system="Be brief.", messages=ASK, **extra)  # type: ignore[arg-type]
        used = client.messages.create(
            model="small",
            system="Be brief.",
            messages=ASK,
            max_tokens=1,
            tool_choice={"type": "none"} if tools else anthropic.NOT_GIVEN,
            **extra,
        )
        prompt = used.usage.input_tokens + (used.usage.cache_read_input_tokens or 0)
        if tools:  # with tool_choice none the tools are not rendered: the count with them is larger
            assert counted.input_tokens > prompt
        else:
            assert counted.input_tokens == prompt > 0


# -- errors and field coverage ----------------------------------------------------------------
def _post(server: Server, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    headers = {"x-api-key": KEY} if headers is None else headers
    return httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=30)


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return str(body["error"]["message"])


REFUSED: list[tuple[str, Any]] = [
    ("container", "container_1"),
    ("diagnostics", {"x": 1}),
    ("inference_geo", "us"),
    ("service_tier", "priority"),
    ("speed", "fast"),
    ("thinking", {"type": "enabled", "budget_tokens": 1024}),
    ("output_config", {"effort": "high"}),
    ("tools", [{"type": "web_search_20250305", "name": "web_search"}]),
    ("tool_choice", {"type": "sometimes"}),
    ("messages", [{"role": "user", "content": [{"type": "image", "source": {}}]}]),
    ("max_tokens", 0),
    ("temperature", 1.5),
    ("stop_sequences", [f"s{i}" for i in range(17)]),
    ("metadata", {"user_id": "u", "other": 1}),
]


@pytest.mark.parametrize(("field", "value"), REFUSED, ids=[f for f, _ in REFUSED])
def test_refused_fields_are_anthropic_400s_naming_them(server: Server, field: str, value: Any) -> None:
    body = {"model": "small", "max_tokens": 2, "messages": ASK, field: value}
    message = _anthropic_error(_post(server, body), 400, "invalid_request_error")
    assert message.startswith(field), message


def test_errors_are_anthropic_shaped(server: Server, client: anthropic.Anthropic) -> None:
    """Unknown field, missing field, bad key (either header), unknown model: Anthropic's shape."""
    unknown = _anthropic_error(
        _post(server, {"model": "small", "max_tokens": 2, "messages": ASK, "top_kk": 1}),
        400,
        "invalid_request_error",
    )
    assert "top_kk" in unknown
    missing = _anthropic_error(
        _post(server, {"model": "small", "messages": ASK}), 400, "invalid_request_error"
    )
    assert "max_tokens" in missing
    _anthropic_error(
        _post(server, {"model": "small", "max_tokens": 2, "messages": ASK}, {"x-api-key": "sk-wrong"}),
        401,
        "authentication_error",
    )
    _anthropic_error(
        _post(server, {"model": "small", "max_tokens": 2, "messages": ASK}, {}), 401, "authentication_error"
    )
    bearer = _post(
        server, {"model": "small", "max_tokens": 2, "messages": ASK}, {"authorization": f"Bearer {KEY}"}
    )
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    _anthropic_error(
        _post(server, {"model": "nope", "max_tokens": 2, "messages": ASK}), 404, "not_found_error"
    )
    bad = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="small", max_tokens=2, messages=ASK)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="small", max_tokens=2, messages=ASK, extra_body={"top_kk": 1})  # type: ignore[arg-type]
    assert err.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


M = "tests.router.http.bridge.test_messages"
COVERED = {
    "model": f"{M}::test_plain_message_is_the_chat_answer",
    "messages": f"{M}::test_forced_tool_use_and_tool_result",
    "system": f"{M}::test_plain_message_is_the_chat_answer",
    "max_tokens": f"{M}::test_plain_message_is_the_chat_answer",
    "stop_sequences": f"{M}::test_stop_sequences_name_the_one_that_matched",
    "tools": f"{M}::test_forced_tool_use_and_tool_result",
    "tool_choice": f"{M}::test_forced_tool_use_and_tool_result",
    "output_config": f"{M}::test_output_config_format_and_sampling",
    "metadata": f"{M}::test_accepted_fields",
    "cache_control": f"{M}::test_accepted_fields",
    "service_tier": f"{M}::test_accepted_fields",
    "thinking": f"{M}::test_accepted_fields",
    "speed": f"{M}::test_accepted_fields",
    "inference_geo": f"{M}::test_accepted_fields",
    "user_profile_id": f"{M}::test_accepted_fields",
    "workspace_id": f"{M}::test_accepted_fields",
}
EXTENSIONS = {"temperature", "top_p", "top_k"}  # Anthropic's API; this SDK sends them as extra body
STREAMING = {"stream"}


def _sdk_fields() -> set[str]:
    return set(message_create_params.MessageCreateParamsBase.__annotations__)


def test_every_messages_field_is_covered_or_refused() -> None:
    refused = {f for f, _ in REFUSED}
    missing = _sdk_fields() - set(COVERED) - refused
    assert not missing, f"Messages fields with neither a behaviour nor a 400 test: {sorted(missing)}"
    assert set(MessagesRequest.__struct_fields__) - _sdk_fields() - EXTENSIONS - STREAMING == set()
    for ref in set(COVERED.values()):
        module, name = ref.split("::")
        assert callable(getattr(importlib.import_module(module), name, None)), ref


def test_output_config_format_and_sampling(client: anthropic.Anthropic) -> None:
    """``output_config.format`` decodes under the schema (a random model's text is not JSON);
    ``top_k: 1`` is greedy whatever the temperature (so it equals the temperature-0 answer)."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model="small",
        messages=ASK,
        max_tokens=32,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    if msg.stop_reason == "end_turn":
        assert isinstance(json.loads(_text(msg))["ok"], bool)
    greedy = client.messages.create(model="small", messages=ASK, max_tokens=8, extra_body={"temperature": 0})
    top_k = client.messages.create(
        model="small", messages=ASK, max_tokens=8, extra_body={"temperature": 1.0, "top_k": 1, "top_p": 0.9}
    )
    assert _text(top_k) == _text(greedy)


def test_accepted_fields(client: anthropic.Anthropic) -> None:
    """Fields honoured as Anthropic documents them without a visible effect on a random model."""
    plain = client.messages.create(model="small", messages=ASK, max_tokens=3, extra_body={"temperature": 0})
    msg = client.messages.create(
        model="small",
        messages=ASK,
        max_tokens=3,
        metadata={"user_id": "u-1"},
        cache_control={"type": "ephemeral"},
        service_tier="auto",
        thinking={"type": "disabled"},
        speed="standard",
        inference_geo="global",
        extra_body={"temperature": 0, "user_profile_id": "p-1", "workspace_id": "w-1"},
    )
    assert _text(msg) == _text(plain)


def test_generated_requests_never_cause_a_5xx(server: Server) -> None:
    """schemathesis over the Messages operations of the service's OpenAPI schema (positive and
    negative data): no 5xx, and every 4xx in Anthropic's error shape."""
    from tests.router.http.bridge.test_responses import fuzz_operations
    from tests.router.test_reliability import error_body_ok

    statuses = fuzz_operations(
        server, "^/v1/messages", {"x-api-key": KEY}, lambda r: error_body_ok(r, anthropic=True)
    )
    # Generated bodies rarely make a valid conversation: the point is that none is a 5xx.
    assert sum(statuses.values()) >= 60 and statuses[400] > 0, statuses


def test_streamed_tool_use(client: anthropic.Anthropic) -> None:
    """Bug caught: tool calls missing from the event stream (no ``tool_use`` block, no
    ``input_json_delta``), or an input that differs from the plain (greedy) answer's."""
    kwargs: Any = {
        "model": "small",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "max_tokens": 200,
        "extra_body": {"temperature": 0},
    }
    plain = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "content_block_start" in kinds and final.stop_reason == plain.stop_reason == "tool_use"
    got = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert got == [(b.name, b.input) for b in plain.content if b.type == "tool_use"] and len(got) == 1


def test_a_final_assistant_message_is_continued_as_anthropic_prefill(
    server: Server, client: anthropic.Anthropic
) -> None:
    """Bug caught: Anthropic's prefill (a last ``assistant`` message the answer continues) answered
    as a new turn after it. Same prompt and answer as the chat route's ``continue_final_message``."""
    prefill = [*ASK, {"role": "assistant", "content": "The capital is"}]
    msg = client.messages.create(model="small", messages=prefill, max_tokens=6, extra_body={"temperature": 0})
    ref = _chat(server, "small", prefill, max_tokens=6, continue_final_message=True)
    new_turn = _chat(server, "small", prefill, max_tokens=6)
    assert ref["usage"]["prompt_tokens"] < new_turn["usage"]["prompt_tokens"]
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == ref["usage"]["prompt_tokens"]
    assert _text(msg) == ref["choices"][0]["message"]["content"]
