"""Every bound in ``service.limits`` accepts a request at its limit and refuses one past it, and
``schema_size`` measures exactly what its docstring says (nodes, depth, widest object, text) and
stops counting once a bound is passed. The sizes are built by construction here, independently
of ``schema_size``: each case's measure is known from its shape."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.errors import BadRequestError
from router.openai.bounds import check_limits, schema_size
from router.openai.request import parse_chat, parse_completions
from router.openai.schemas import ChatCompletionRequest, CompletionRequest
from router.policy.schema import LimitsConfig


def _chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


def _with_schema(schema: Any) -> ChatCompletionRequest:
    return _chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


def _refused(req: ChatCompletionRequest | CompletionRequest, limits: LimitsConfig) -> BadRequestError:
    with pytest.raises(BadRequestError) as err:
        check_limits(req, limits)
    assert err.value.code == "limit_exceeded"
    return err.value


def _nested(levels: int) -> Any:
    """``levels`` objects one inside the other around a 0: depth ``levels + 1``."""
    return 0 if levels == 0 else {"a": _nested(levels - 1)}


def test_schema_size_counts_nodes_depth_properties_and_text_exactly() -> None:
    """Bug it catches: a node, level or character miscounted (``depth + 2`` for a child, ``-``
    for ``+``, a key's length assigned instead of added): each bound is then off by a margin."""
    # A dict holding a list of 3 numbers: 5 nodes, 3 levels, no properties, the key's 4 chars.
    assert schema_size({"enum": [1, 2, 3]}, 100, 100) == (5, 3, 0, 4)
    assert schema_size(_nested(5), 100, 100) == (6, 6, 0, 5)
    props = {"properties": {"ab": 0, "cde": "xyz"}}
    assert schema_size(props, 100, 100) == (4, 3, 2, len("properties") + 2 + 3 + 3)
    # Keys of every object add up, not only the last one's.
    assert schema_size({"ab": {"cde": 0}, "f": 1}, 100, 100)[3] == 2 + 1 + 3
    # The widest object wins, wherever it sits.
    wide = {"properties": {"p": {"properties": {f"q{i}": 0 for i in range(7)}}}}
    assert schema_size(wide, 100, 100)[2] == 7


def test_schema_size_stops_counting_just_past_a_bound() -> None:
    """Bug it catches: counting went on past the bound (``and`` for ``or``), so a 10**5-node
    schema cost 10**5 steps to refuse; or it returned nothing when it stopped."""
    huge = list(range(100_000))
    assert schema_size(huge, 10, 1000)[0] == 11
    assert schema_size(_nested(50), 1000, 4)[1] == 5
    assert schema_size(["x" * 50, *huge], 1000, 1000, max_chars=10)[3] <= 50 + 1


@pytest.mark.parametrize("limit", [5, 40])
def test_schema_nodes_accept_the_limit_and_refuse_one_past_it(limit: int) -> None:
    """Bug it catches: ``>=`` for ``>`` refuses a schema of exactly ``max_schema_nodes`` nodes."""
    limits = LimitsConfig(max_schema_nodes=limit)
    check_limits(_with_schema({"enum": [0] * (limit - 2)}), limits)
    err = _refused(_with_schema({"enum": [0] * (limit - 1)}), limits)
    assert "max_schema_nodes" in str(err) and err.param == "response_format.json_schema.schema"


@pytest.mark.parametrize("limit", [3, 10])
def test_schema_depth_accepts_the_limit_and_refuses_one_past_it(limit: int) -> None:
    limits = LimitsConfig(max_schema_depth=limit)
    check_limits(_with_schema(_nested(limit - 1)), limits)
    assert "max_schema_depth" in str(_refused(_with_schema(_nested(limit)), limits))


def test_schema_properties_accept_the_limit_and_refuse_one_past_it() -> None:
    """Bug it catches: the widest object not compared, or its refusal naming no limit
    (``None`` for the limit in the message)."""
    limits = LimitsConfig(max_schema_properties=6)

    def obj(n: int) -> dict[str, Any]:
        return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}

    check_limits(_with_schema(obj(6)), limits)
    err = _refused(_with_schema(obj(7)), limits)
    assert "max_schema_properties" in str(err) and "the limit is 6" in str(err)
    assert "7 properties" in str(err)


def test_schema_chars_accept_the_limit_and_refuse_one_past_it() -> None:
    limits = LimitsConfig(max_schema_chars=100)
    check_limits(_with_schema({"pattern": "a" * (100 - 7)}), limits)
    assert "max_schema_chars" in str(_refused(_with_schema({"pattern": "a" * (100 - 6)}), limits))


def test_tools_count_and_their_schemas_are_bounded() -> None:
    limits = LimitsConfig(max_tools=3, max_schema_depth=4)

    def tool(i: int) -> dict[str, Any]:
        return {"type": "function", "function": {"name": f"f{i}"}}

    check_limits(_chat(tools=[tool(i) for i in range(3)]), limits)
    err = _refused(_chat(tools=[tool(i) for i in range(4)]), limits)
    assert err.param == "tools" and "max_tools" in str(err)
    # The tools list (1) > tool (2) > function (3) > name (4) is at the limit; one more level is not.
    deep = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert "max_schema_depth" in str(_refused(_chat(tools=[deep]), limits))


def test_logit_bias_entries_accept_the_limit_and_refuse_one_past_it() -> None:
    limits = LimitsConfig(max_logit_bias=4)
    check_limits(_chat(logit_bias={str(i): 1.0 for i in range(4)}), limits)
    err = _refused(_chat(logit_bias={str(i): 1.0 for i in range(5)}), limits)
    assert err.param == "logit_bias" and "5 entries" in str(err)


def test_request_tokens_accept_the_limit_and_refuse_one_past_it() -> None:
    limits = LimitsConfig(max_request_tokens=100)
    check_limits(_chat(n=2, max_tokens=50), limits)
    assert _refused(_chat(n=2, max_tokens=51), limits).param == "max_tokens"
    check_limits(_chat(n=5, max_completion_tokens=20), limits)
    assert _refused(_chat(n=5, max_completion_tokens=21), limits).param == "max_completion_tokens"
    best = {"model": "auto", "prompt": "hi", "best_of": 4}
    check_limits(msgspec.convert({**best, "max_tokens": 25}, CompletionRequest), limits)
    _refused(msgspec.convert({**best, "max_tokens": 26}, CompletionRequest), limits)


def test_prompts_accept_the_limit_and_refuse_one_past_it() -> None:
    limits = LimitsConfig(max_prompts=3)

    def req(n: int) -> CompletionRequest:
        return msgspec.convert({"model": "auto", "prompt": [f"p{i}" for i in range(n)]}, CompletionRequest)

    assert len(parse_completions(req(3), limits)) == 3
    with pytest.raises(BadRequestError, match="max_prompts") as err:
        parse_completions(req(4), limits)
    assert err.value.param == "prompt"


def test_the_default_limits_accept_a_request_at_each_bound() -> None:
    """Bug it catches: a default bound off by one against its documented value (300 logit_bias
    entries and 128 tools are OpenAI's own caps)."""
    limits = LimitsConfig()
    parse_chat(_chat(logit_bias={str(i): 1.0 for i in range(300)}), limits)
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(128)]
    check_limits(_chat(tools=tools), limits)
    _refused(_chat(logit_bias={str(i): 1.0 for i in range(301)}), limits)
    _refused(_chat(tools=[*tools, tools[0]]), limits)
