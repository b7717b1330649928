"""LangChain's ``ChatOpenAI`` against the server: ``with_structured_output`` (by ``json_schema``
and by ``function_calling``) and ``bind_tools`` return parsed objects, on the tiny random models
(so every parse is the grammar's doing)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pydantic
import pytest

from tests.router.conftest import Server
from tests.router.openai.test_structured import long_context_server

langchain_openai = pytest.importorskip("langchain_openai")


class Forecast(pydantic.BaseModel):
    """A weather forecast."""

    city: Literal["paris", "tokyo", "lima"]
    rain: bool
    days: int = pydantic.Field(ge=1, le=7)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from long_context_server(tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def llm(server: Server) -> Any:
    return langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        model="small",
        temperature=0,
        max_tokens=200,
        max_retries=0,
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(llm: Any, method: str) -> None:
    structured = llm.with_structured_output(Forecast, method=method)
    result = structured.invoke("Will it rain in Paris this week?")
    assert isinstance(result, Forecast)


def test_with_structured_output_include_raw(llm: Any) -> None:
    structured = llm.with_structured_output(Forecast, method="function_calling", include_raw=True)
    out = structured.invoke("Will it rain in Lima?")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Forecast)
    assert out["raw"].tool_calls and out["raw"].tool_calls[0]["name"] == "Forecast"


def test_bind_tools(llm: Any) -> None:
    def get_weather(city: Literal["paris", "tokyo"], unit: Literal["c", "f"]) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    msg = bound.invoke("What is the weather in Tokyo?")
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert call["args"]["city"] in ("paris", "tokyo") and call["args"]["unit"] in ("c", "f")
    assert get_weather(**call["args"]).startswith("sunny")
    streamed = None
    for piece in bound.stream("What is the weather in Paris?"):
        streamed = piece if streamed is None else streamed + piece
    assert streamed is not None and streamed.tool_calls and streamed.tool_calls[0]["name"] == "get_weather"
