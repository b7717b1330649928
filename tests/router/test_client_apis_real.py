"""The Responses API and the Anthropic Messages API on the real embedded default (SmolLM2-135M),
through the official SDKs, on the plain tier (``small``) and on a speculating tier (``medium``
drafts with ``small``): a structured answer that parses, a forced tool call whose arguments
validate, its result sent back, and a streamed answer equal to the plain one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pydantic
import pytest

from tests.router.conftest import Server, start_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIERS = ["small", "medium"]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}


class Capital(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=40)
    is_capital: bool


@pytest.fixture(scope="module")
def server(embedded_model_dir: Path) -> Iterator[Server]:
    # Three real tiers warm up slowly on a busy CI host.
    srv, stop = start_server(ROOT / "policies/default.yaml", ready_timeout_s=900, watch_policy=False)
    yield srv
    stop()


@pytest.mark.parametrize("tier", TIERS)
def test_responses_api_on_the_real_model(server: Server, tier: str) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    parsed = client.responses.parse(
        model=tier,
        input="Is Paris the capital of France? Answer as JSON.",
        text_format=Capital,
        max_output_tokens=60,
        temperature=0,
    )
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Capital)
    tool: Any = {"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}
    called = client.responses.create(
        model=tier,
        input="What is the weather in Paris?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    call = next(item for item in called.output if item.type == "function_call")
    assert set(json.loads(call.arguments)) == {"city"}
    follow = client.responses.create(
        model=tier,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}],
        tools=[tool],
        max_output_tokens=24,
        temperature=0,
    )
    assert follow.status in ("completed", "incomplete") and follow.usage is not None
    assert follow.usage.input_tokens > called.usage.input_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("tier", TIERS)
def test_messages_api_on_the_real_model(server: Server, tier: str) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    ask: Any = [{"role": "user", "content": "Name the capital of France in one word."}]
    kwargs: dict[str, Any] = {
        "model": tier,
        "messages": ask,
        "max_tokens": 16,
        "extra_body": {"temperature": 0},
    }
    plain = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
    assert text == "".join(b.text for b in plain.content if b.type == "text") and text.strip()
    tool: Any = {"name": "get_weather", "description": "Weather of a city", "input_schema": SCHEMA}
    used = client.messages.create(
        model=tier,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=60,
    )
    block = next(b for b in used.content if b.type == "tool_use")
    assert used.stop_reason == "tool_use" and set(block.input) == {"city"}  # type: ignore[arg-type]
    result = client.messages.create(
        model=tier,
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [block.model_dump()]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "Sunny"}],
            },
        ],
        tools=[tool],
        max_tokens=24,
        extra_body={"temperature": 0},
    )
    assert result.stop_reason in ("end_turn", "max_tokens", "tool_use")
