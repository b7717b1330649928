"""The Responses API's request as the chat request the pipeline answers
(router/http/bridge/responses_request.py): every part of the input kept in order, every field the
caller set carried over with its value (falsy ones included), and an error in the chat request
named as the Responses API calls the field."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.errors import BadRequestError
from router.http.bridge.responses_request import ResponsesRequest, input_messages, renamed, to_chat


def _req(**fields: Any) -> ResponsesRequest:
    return msgspec.convert({"model": "small", "input": "hi", **fields}, ResponsesRequest)


def test_a_refusal_part_is_skipped_and_the_parts_after_it_kept() -> None:
    """Bug it catches: ``break`` for ``continue`` at a refusal part - the text after it lost."""
    items = [
        {
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "a"},
                {"type": "refusal", "refusal": "no"},
                {"type": "output_text", "text": "b"},
            ],
        }
    ]
    assert input_messages(items) == [{"role": "assistant", "content": "ab"}]


def test_calls_join_the_assistant_turn_before_them_and_outputs_follow() -> None:
    items = [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "name": "f", "call_id": "c1", "arguments": {"x": 1}},
        {"type": "function_call", "name": "g", "call_id": "c2", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "sun"}]},
    ]
    out = input_messages(items)
    assert [m["role"] for m in out] == ["user", "assistant", "tool"]
    assert [c["id"] for c in out[1]["tool_calls"]] == ["c1", "c2"]
    assert out[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert out[2] == {"role": "tool", "tool_call_id": "c1", "content": "sun"}


def test_errors_name_the_responses_fields() -> None:
    """Bug it catches: an error about the chat request's ``response_format`` named with a stray
    ``json_schema`` (or not as ``text.format``), or ``messages`` not renamed ``input``."""
    assert renamed("messages") == "input"
    assert renamed("max_completion_tokens") == "max_output_tokens"
    assert renamed("response_format") == "text.format"
    assert renamed("response_format.json_schema.schema") == "text.format.schema"
    assert renamed("response_format.json_schema") == "text.format"
    assert renamed("temperature") == "temperature"
    assert renamed(None) is None


@pytest.mark.parametrize(
    ("field", "value", "chat_field"),
    [
        ("temperature", 0.0, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("max_output_tokens", 1, "max_completion_tokens"),
        ("parallel_tool_calls", False, "parallel_tool_calls"),
        ("metadata", {}, "metadata"),
    ],
)
def test_a_field_set_reaches_the_chat_request_with_its_value(field: str, value: Any, chat_field: str) -> None:
    """Bug it catches: a falsy value the caller set (0, false, {}) dropped on the way to chat."""
    chat, _ = to_chat(_req(**{field: value}), [])
    assert getattr(chat, chat_field) == value


def test_instructions_come_first_and_history_before_the_new_input() -> None:
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    chat, conversation = to_chat(_req(instructions="sys", input="c"), history)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "sys"),
        ("user", "a"),
        ("assistant", "b"),
        ("user", "c"),
    ]
    assert conversation == [*history, {"role": "user", "content": "c"}]
    streamed, _ = to_chat(_req(stream=True), [])
    assert streamed.stream is True and streamed.stream_options is not None
    assert streamed.stream_options.include_usage is True


def test_an_empty_input_is_a_400_naming_input() -> None:
    with pytest.raises(BadRequestError) as err:
        to_chat(_req(input=[]), [])
    assert err.value.param == "input"


def test_a_chat_conversion_error_is_a_400_naming_the_responses_field() -> None:
    """Bug it catches: the 400 from the chat conversion without ``param`` (or with the chat
    name): a client cannot tell which of its fields was wrong."""
    bad = {"format": {"type": "json_schema", "name": 5, "schema": {"type": "object"}}}
    with pytest.raises(BadRequestError) as err:
        to_chat(_req(text=bad), [])
    assert err.value.param == "text.format.name"
    assert "name" in err.value.message


def test_function_tools_keep_strict_and_other_tool_types_are_refused() -> None:
    """Bugs it catches: ``strict`` dropped from the flattened function (structured tool calls no
    longer enforced), and ``and`` for ``or`` in the type test - a ``web_search`` tool passing as a
    function tool without a name."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    chat, _ = to_chat(_req(tools=[tool]), [])
    assert chat.tools is not None
    fn = chat.tools[0]["function"]
    assert fn == {"name": "f", "parameters": {"type": "object"}, "strict": True}
    falsy, _ = to_chat(_req(tools=[{**tool, "strict": False}]), [])
    assert falsy.tools is not None and falsy.tools[0]["function"]["strict"] is False
    with pytest.raises(BadRequestError) as err:
        to_chat(_req(tools=[tool, {"type": "web_search"}]), [])
    assert err.value.param == "tools[1].type"
    assert "web_search" in err.value.message
