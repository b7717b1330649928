"""No silently ignored field: every request field of OpenAI's API reference (as the official SDK
declares it) is either covered by a behaviour test or refused with a 400 that names it, and the
server declares no field outside the reference besides its documented extensions."""

from __future__ import annotations

import importlib
from typing import Any

import httpx
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from router.openai.schemas import VLLM_EXTENSIONS, ChatCompletionRequest, CompletionRequest
from tests.router.conftest import Server

# field -> the test that shows it honoured ("module::function").
S = "tests.router.openai.test_structured"
A = "tests.router.http.test_app"
F = "tests.router.openai.test_schemas_fields"
CHAT_COVERED = {
    "messages": f"{A}::test_chat_completion_with_routing_headers",
    "model": f"{A}::test_chat_completion_with_routing_headers",
    "max_tokens": f"{A}::test_streaming_chunks_and_usage",
    "max_completion_tokens": f"{S}::test_parse_with_pydantic_model",
    "temperature": f"{S}::test_json_schema_output_validates_sampled",
    "top_p": f"{F}::test_accepted_fields",
    "seed": f"{S}::test_json_schema_output_validates_sampled",
    "stop": f"{F}::test_accepted_fields",
    "stream_options": f"{A}::test_streaming_chunks_and_usage",
    "presence_penalty": f"{F}::test_accepted_fields",
    "frequency_penalty": f"{F}::test_accepted_fields",
    "logit_bias": f"{S}::test_logit_bias_and_min_p",
    "logprobs": f"{S}::test_top_logprobs",
    "top_logprobs": f"{S}::test_top_logprobs",
    "n": f"{S}::test_n_choices",
    "response_format": f"{S}::test_json_schema_output_validates_sampled",
    "tools": f"{S}::test_forced_tool_call",
    "tool_choice": f"{S}::test_required_tool_calls_streamed",
    "parallel_tool_calls": f"{S}::test_required_tool_calls_streamed",
    # Caller descriptions and cache hints: accepted, they do not change the output (README).
    "user": f"{F}::test_accepted_fields",
    "safety_identifier": f"{F}::test_accepted_fields",
    "metadata": f"{F}::test_accepted_fields",
    "prompt_cache_key": f"{F}::test_accepted_fields",
    "prompt_cache_options": f"{F}::test_accepted_fields",
    "prompt_cache_retention": f"{F}::test_accepted_fields",
    "service_tier": f"{F}::test_accepted_fields",
    "store": f"{F}::test_accepted_fields",
    "modalities": f"{F}::test_accepted_fields",
    "reasoning_effort": f"{F}::test_accepted_fields",
}
COMPLETION_COVERED = {
    "model": f"{S}::test_completions_logprobs_echo_n",
    "prompt": f"{S}::test_completions_logprobs_echo_n",
    "max_tokens": f"{S}::test_completions_logprobs_echo_n",
    "temperature": f"{S}::test_completions_logprobs_echo_n",
    "logprobs": f"{S}::test_completions_logprobs_echo_n",
    "echo": f"{S}::test_completions_logprobs_echo_n",
    "n": f"{S}::test_completions_logprobs_echo_n",
    "best_of": f"{S}::test_completions_logprobs_echo_n",
    "seed": f"{S}::test_completions_logprobs_echo_n",
    "logit_bias": f"{S}::test_logit_bias_and_min_p",
    "stream_options": f"{F}::test_accepted_fields",
    "stop": f"{F}::test_accepted_fields",
    "top_p": f"{F}::test_accepted_fields",
    "presence_penalty": f"{F}::test_accepted_fields",
    "frequency_penalty": f"{F}::test_accepted_fields",
    "user": f"{F}::test_accepted_fields",
}
# (endpoint, field, value that cannot be honoured); the 400 names the field.
REFUSED: list[tuple[str, str, Any]] = [
    ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "modalities", ["text", "audio"]),
    ("chat", "prediction", {"type": "content", "content": "x"}),
    ("chat", "reasoning_effort", "high"),
    ("chat", "verbosity", "low"),
    ("chat", "web_search_options", {}),
    ("chat", "service_tier", "flex"),
    ("chat", "store", True),
    ("chat", "moderation", {"input": {"mode": "block"}}),
    ("chat", "prompt_cache_options", {"mode": "explicit"}),
    ("chat", "prompt_cache_retention", "24h"),
    ("chat", "functions", [{"name": "f", "parameters": {}}]),
    ("chat", "function_call", "auto"),
    ("chat", "metadata", {f"k{i}": "v" for i in range(17)}),
    ("chat", "n", 17),
    ("chat", "top_logprobs", 3),  # without logprobs: true
    ("chat", "logit_bias", {"x": 1}),
    ("chat", "response_format", {"type": "xml"}),
    ("chat", "tool_choice", "sometimes"),
    ("chat", "tools", [{"type": "code_interpreter"}]),
    ("chat", "stream_options", {"include_usage": True}),  # without stream: true
    ("completion", "suffix", " and the end."),
    ("completion", "best_of", 17),
    ("completion", "logprobs", 21),
]
# vLLM's request extensions (tests/router/openai/test_schemas_vllm_extensions.py)
EXTENSIONS = VLLM_EXTENSIONS
STREAMING = {"stream"}  # declared by the SDK's streaming variant of the params


def _sdk_fields(module: Any) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__)


def test_every_chat_field_is_covered_or_refused() -> None:
    refused = {f for kind, f, _ in REFUSED if kind == "chat"}
    missing = _sdk_fields(chat_params) - set(CHAT_COVERED) - refused
    assert not missing, f"OpenAI chat fields with neither a behaviour nor a 400 test: {sorted(missing)}"


def test_every_completion_field_is_covered_or_refused() -> None:
    refused = {f for kind, f, _ in REFUSED if kind == "completion"}
    missing = _sdk_fields(completion_params) - set(COMPLETION_COVERED) - refused
    assert not missing, f"OpenAI completion fields with neither a behaviour nor a 400 test: {sorted(missing)}"


def test_covering_tests_exist() -> None:
    for ref in {*CHAT_COVERED.values(), *COMPLETION_COVERED.values()}:
        module, name = ref.split("::")
        assert callable(getattr(importlib.import_module(module), name, None)), ref


@pytest.mark.parametrize(
    ("struct", "sdk"), [(ChatCompletionRequest, chat_params), (CompletionRequest, completion_params)]
)
def test_no_field_outside_the_reference(struct: Any, sdk: Any) -> None:
    declared = set(struct.__struct_fields__)
    assert declared - _sdk_fields(sdk) - EXTENSIONS - STREAMING == set()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize(("kind", "field", "value"), REFUSED, ids=[f"{k}-{f}" for k, f, _ in REFUSED])
def test_refused_fields_are_400_naming_them(server: Server, kind: str, field: str, value: Any) -> None:
    body: dict[str, Any] = {"model": "small", "max_tokens": 2, field: value}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
        if field == "tool_choice":
            body["tools"] = [{"type": "function", "function": {"name": "f"}}]
    else:
        body["prompt"] = "hi"
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == field or err["param"].startswith((field + ".", field + "[")), err


def test_accepted_fields(client: openai.OpenAI) -> None:
    """Fields honoured as OpenAI documents them without a visible effect on a random model's
    text: sampling knobs (in range), caller descriptions and cache hints."""
    resp = client.chat.completions.create(
        model="small",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        top_p=0.9,
        stop=["\n\n"],
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="u-1",
        safety_identifier="s-1",
        metadata={"team": "a"},
        prompt_cache_key="k",
        prompt_cache_retention="in_memory",
        service_tier="auto",
        store=False,
        modalities=["text"],
        reasoning_effort="none",
        extra_body={"prompt_cache_options": {"mode": "implicit"}},
    )
    assert resp.choices[0].finish_reason in ("stop", "length")
    text = client.completions.create(
        model="small",
        prompt="hi",
        max_tokens=3,
        top_p=0.9,
        stop="\n\n",
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="u-1",
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(text)
    assert chunks[-1].usage is not None
