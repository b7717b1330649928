"""The Anthropic Messages request as the chat request the pipeline answers
(router/http/bridge/messages_request.py), read against Anthropic's reference: every field the
caller set reaches the chat request with its value (falsy ones too), content blocks become chat
messages in order (tool_use as calls, tool_result as tool messages before the user's text),
tool_choice maps to its chat form, each unsupported field or value is a 400 naming it as the
Messages API does (``messages.0.content.1.type``), and the values at each bound are accepted."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.errors import BadRequestError
from router.http.bridge.messages_request import (
    CountTokensRequest,
    MessagesRequest,
    chat_messages,
    count_tokens_body,
    to_chat,
    validate,
)

USER = [{"role": "user", "content": "hi"}]


def _req(**fields: Any) -> MessagesRequest:
    return msgspec.convert({"model": "small", "max_tokens": 16, "messages": USER, **fields}, MessagesRequest)


def _translated(req: MessagesRequest) -> None:
    validate(req)
    to_chat(req)


def _refused(**fields: Any) -> BadRequestError:
    req = _req(**fields)
    with pytest.raises(BadRequestError) as err:
        _translated(req)
    return err.value


def test_each_field_set_reaches_the_chat_request_with_its_value() -> None:
    """Bugs it catches: a field dropped or replaced by the tier's default - ``temperature: 0``,
    ``top_k: 0`` read as unset, the stop sequences not kept in the text (the answer could not name
    which one stopped it), the user id lost."""
    chat = to_chat(
        _req(
            temperature=0.0,
            top_p=0.5,
            top_k=0,
            max_tokens=7,
            stop_sequences=["END"],
            metadata={"user_id": "u-1"},
        )
    )
    assert chat.temperature == 0.0 and chat.top_p == 0.5 and chat.top_k == 0
    assert chat.max_completion_tokens == 7
    assert chat.stop == ["END"] and chat.include_stop_str_in_output is True
    assert chat.user == "u-1"
    assert chat.stream is False and chat.stream_options is None
    plain = to_chat(_req())
    assert plain.stop is None and plain.include_stop_str_in_output is None and plain.temperature is None
    streamed = to_chat(_req(stream=True))
    assert streamed.stream is True and streamed.stream_options is not None
    assert streamed.stream_options.include_usage is True


def test_blocks_become_chat_messages_in_order() -> None:
    """Bugs it catches: tool results placed after the user's text (a chat template then reads the
    answer before the question), an error result not marked, a tool call's input not JSON."""
    req = _req(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain", "is_error": True},
                    {"type": "text", "text": "and tomorrow?"},
                ],
            },
        ],
    )
    assert chat_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: rain"},
        {"role": "user", "content": "and tomorrow?"},
    ]


def test_a_results_only_turn_adds_no_empty_user_message_and_an_empty_turn_one() -> None:
    only_results = _req(
        messages=[
            {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a"}]},
        ]
    )
    out = chat_messages(only_results)
    assert out[-1] == {"role": "tool", "tool_call_id": "a", "content": ""}
    assert out[0] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    assert chat_messages(_req(messages=[{"role": "user", "content": []}])) == [
        {"role": "user", "content": ""}
    ]


def test_a_final_assistant_text_is_continued_not_answered() -> None:
    prefill = _req(messages=[*USER, {"role": "assistant", "content": "The answer is"}])
    assert to_chat(prefill).continue_final_message is True
    assert to_chat(_req()).continue_final_message is None


@pytest.mark.parametrize(
    ("choice", "tool_choice", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
        ({"type": "any"}, "required", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", None),
        ({"type": "tool", "name": "get"}, {"type": "function", "function": {"name": "get"}}, False),
    ],
)
def test_tool_choice_maps_to_its_chat_form(
    choice: dict[str, Any], tool_choice: Any, parallel: bool | None
) -> None:
    tools = [{"name": "get", "input_schema": {"type": "object"}}]
    chat = to_chat(_req(tools=tools, tool_choice=choice))
    assert chat.tool_choice == tool_choice
    assert chat.parallel_tool_calls is parallel


def test_tools_carry_their_schema_description_and_strict() -> None:
    tools = [
        {"name": "a", "input_schema": {"type": "object"}, "description": "does a", "strict": True},
        {"type": "custom", "name": "b", "input_schema": {}},
    ]
    chat = to_chat(_req(tools=tools))
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "a",
                "parameters": {"type": "object"},
                "description": "does a",
                "strict": True,
            },
        },
        {"type": "function", "function": {"name": "b", "parameters": {}}},
    ]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 1.01}, "temperature"),
        ({"temperature": -0.01}, "temperature"),
        ({"container": "c"}, "container"),
        ({"inference_geo": "us"}, "inference_geo"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"stop_sequences": ["a"] * 17}, "stop_sequences"),
        ({"stop_sequences": ["x" * 257]}, "stop_sequences"),
        ({"metadata": {"user_id": "u", "team": "t"}}, "metadata.team"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"speed": "fast"}, "speed"),
        ({"output_config": {"format": None, "verbosity": 1}}, "output_config.verbosity"),
        ({"output_config": {"effort": "high"}}, "output_config.effort"),
        ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]},
            "messages.0.content.1.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]},
            "messages.0.content.0.type",
        ),
        ({"system": [{"type": "image"}]}, "system.0.type"),
        ({"tools": [{"type": "web_search_20250305", "name": "w"}]}, "tools.0.type"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ],
)
def test_each_refusal_names_the_messages_apis_field(fields: dict[str, Any], param: str) -> None:
    err = _refused(**fields)
    assert err.param == param, err.message
    assert err.message.startswith(param)


def test_the_values_at_each_bound_are_accepted() -> None:
    """A valid request refused is a bug too: the ends of each range, the supported values of the
    fields that have unsupported ones."""
    for fields in (
        {"max_tokens": 1},
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"stop_sequences": ["x" * 256] * 16},
        {"metadata": {"user_id": "u"}},
        {"metadata": {}},
        {"thinking": {"type": "disabled"}},
        {"speed": "standard"},
        {"inference_geo": "global"},
        {"service_tier": "auto"},
        {"service_tier": "standard_only"},
        {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
    ):
        _translated(_req(**fields))


def test_output_config_format_becomes_a_json_schema_response_format() -> None:
    chat = to_chat(_req(output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}}))
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.schema == {"type": "object"}


def test_a_chat_conversion_error_is_named_as_the_messages_field() -> None:
    """Bug it catches: the chat field's name in the 400 (``user``) where the caller wrote
    ``metadata.user_id``."""
    req = _req(metadata={"user_id": 42})
    with pytest.raises(BadRequestError) as err:
        to_chat(req)
    assert err.value.param == "metadata.user_id"
    assert err.value.message.startswith("metadata.user_id: ")


def test_count_tokens_renders_the_same_messages_and_tools() -> None:
    body = {"model": "small", "messages": [*USER, {"role": "assistant", "content": "pre"}]}
    req = msgspec.convert(
        {**body, "tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "any"}},
        CountTokensRequest,
    )
    validate(req)
    rendered = count_tokens_body(req)
    assert rendered["messages"] == [*USER, {"role": "assistant", "content": "pre"}]
    assert rendered["continue_final_message"] is True
    assert rendered["tool_choice"] == "required" and rendered["tools"][0]["function"]["name"] == "f"
    bad = msgspec.convert({**body, "speed": "fast"}, CountTokensRequest)
    with pytest.raises(BadRequestError):
        validate(bad)
