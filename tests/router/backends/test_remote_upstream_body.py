"""A remote tier forwards the request as the client sent it (router/backends/remote.py's
``upstream_body``): every field the client set reaches the upstream with its value, falsy ones
included (0, 0.0, [], {}, false); only fields the client left out (None) are left out; raw JSON
values (a schema's ``"default": null``) pass through untouched. The reference is the client's own
body: forwarding must give it back."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.backends.remote import upstream_body
from router.openai.schemas import ChatCompletionRequest, CompletionRequest

FALSY: dict[str, Any] = {
    "temperature": 0.0,
    "top_p": 0.0,
    "seed": 0,
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "stop": [],
    "logit_bias": {},
    "top_k": 0,
    "min_p": 0.0,
    "min_tokens": 0,
    "ignore_eos": False,
    "stop_token_ids": [],
    "include_stop_str_in_output": False,
    "skip_special_tokens": False,
    "stream": False,
}


def _roundtrip(body: dict[str, Any], kind: type[Any]) -> dict[str, Any]:
    """The forwarded body, less ``stream``'s default ``false`` (the schema's default, not None,
    so it is always sent) where the client did not set it."""
    out: dict[str, Any] = upstream_body(msgspec.convert(body, kind))
    if "stream" not in body:
        assert out.pop("stream") is False
    return out


@pytest.mark.parametrize(("field", "value"), sorted(FALSY.items()))
def test_a_falsy_field_the_client_set_is_forwarded(field: str, value: Any) -> None:
    """Bug it catches: ``if value:`` where ``if value is not None:`` was meant - an explicit 0,
    [] or false dropped, and the upstream's own default used in its place."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    assert _roundtrip(chat, ChatCompletionRequest) == chat
    completion = {"model": "m", "prompt": "hi", field: value}
    assert _roundtrip(completion, CompletionRequest) == completion


def test_fields_left_out_stay_out_and_raw_json_passes_untouched() -> None:
    """Bug it catches: ``"name": null`` sent for an absent message name (strict servers refuse
    it), or a null inside a tool's JSON schema dropped (it is the schema's ``default``)."""
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": ["string", "null"], "default": None}},
            },
        },
    }
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "tools": [tool],
        "max_completion_tokens": 0,
        "logprobs": False,
        "top_logprobs": 0,
        "parallel_tool_calls": False,
        "metadata": {},
    }
    out = _roundtrip(body, ChatCompletionRequest)
    assert out == body
    assert all("name" not in m for m in out["messages"])
    assert out["tools"][0]["function"]["parameters"]["properties"]["x"]["default"] is None


def test_a_completions_body_with_token_prompts_and_best_of_is_forwarded_whole() -> None:
    body = {"model": "m", "prompt": [[1, 2, 3], [0]], "best_of": 2, "n": 1, "echo": False, "logprobs": 0}
    assert _roundtrip(body, CompletionRequest) == body
