"""router/openai/tools.py, structured.py, logprobs.py and the writer's choices without a server:
the generic tool template, the call grammar, parsing and streaming of calls, strict
schemas, logprobs objects, and choice assembly from remote deltas."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from router.errors import BadRequestError
from router.openai.json_schema import check_strict_schema, close_objects
from router.openai.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from router.openai.request import Generation
from router.openai.schemas import ChatCompletionRequest, ChatMessage
from router.openai.structured import (
    OutputSpec,
    ToolChoice,
    output_spec,
    parse_tool_choice,
    parse_tools,
    raw_messages,
    render_messages,
    tool_grammar,
)
from router.openai.tools import ToolCallStreamer, parse_tool_calls
from router.openai.validation import validate_chat
from router.openai.writer import ChoiceBuilder, Merged
from tiers.core.output import StepOutput, TokenLogprob
from tiers.sample.grammar import GrammarCompiler, compiler_for

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["paris", "lima"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def smol(embedded_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir)


def test_render_generic_template() -> None:
    tools = parse_tools([WEATHER, TIME])
    out = render_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"lima"}'},
                    },
                    {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        ],
        tools,
    )
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    lines = out[0]["content"].split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in lines] == ["get_weather", "get_time"]
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "lima"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert (
        out[3]["content"]
        == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
    )
    assert render_messages([{"role": "user", "content": "x"}], []) == [{"role": "user", "content": "x"}]


def test_runs_of_tool_results_are_one_user_turn_each_and_runs_stay_apart() -> None:
    """Bugs it catches: tool results appended by re-copying the turn so far (quadratic: 30,000
    results rebuilt a growing string on the event loop), two runs split by an assistant turn
    merged into one, or a user's own text that starts like a tool response swallowed."""
    results = [{"role": "tool", "content": f"r{i}"} for i in range(30_000)]
    msgs = [
        {"role": "user", "content": "<tool_response> is a tag"},
        *results,
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "last"},
    ]
    out = render_messages(msgs, [])
    assert [m["role"] for m in out] == ["user", "user", "assistant", "user"]
    assert out[0]["content"] == "<tool_response> is a tag"
    expected = "\n".join(f"<tool_response>\nr{i}\n</tool_response>" for i in range(30_000))
    assert out[1]["content"] == expected
    assert out[3]["content"] == "<tool_response>\nlast\n</tool_response>"


def test_tool_and_choice_validation() -> None:
    tools = parse_tools([WEATHER, TIME])
    assert tools[1].parameters == {"type": "object", "properties": {}}
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools) == ToolChoice(
        "named", "get_time"
    )
    cases: list[tuple[Any, str]] = [
        ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        ("always", "tool_choice"),
        (3, "tool_choice"),
    ]
    for raw, param in cases:
        with pytest.raises(BadRequestError) as info:
            parse_tool_choice(raw, tools)
        assert info.value.param == param
    with pytest.raises(BadRequestError) as info:
        parse_tool_choice("required", [])
    assert info.value.param == "tool_choice"
    for bad, param in [
        ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
        ([WEATHER, WEATHER], "tools[1].function.name"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "tools[0].function.parameters"),
    ]:
        with pytest.raises(BadRequestError) as info:
            parse_tools(bad)  # type: ignore[arg-type]
        assert info.value.param == param


def test_parse_tool_calls() -> None:
    tools = parse_tools([WEATHER, TIME])
    content, calls = parse_tool_calls(CALL + "\n" + CALL.replace("get_weather", "get_time"), tools)
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "paris"}
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["id"].startswith("call_")
    # Text that only looks like a call stays text.
    odd = "<tool_call>\nnot json\n</tool_call>"
    assert parse_tool_calls(odd, tools) == (odd, [])
    unknown = CALL.replace("get_weather", "launch_rockets")
    assert parse_tool_calls(unknown, tools) == (unknown, [])
    assert parse_tool_calls("plain answer", tools) == ("plain answer", [])


@pytest.mark.parametrize("seed", range(6))
def test_streamer_fragments_join_up_at_any_split(seed: int) -> None:
    tools = parse_tools([WEATHER, TIME])
    text = CALL + "\n" + CALL.replace("paris", "lima")
    rng = random.Random(seed)
    streamer = ToolCallStreamer(tools)
    deltas: list[dict[str, Any]] = []
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 9)
        deltas += streamer.feed(text[pos : pos + step])
        pos += step
    deltas += streamer.feed("", final=True)
    assert not any("content" in d for d in deltas)
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for tc in d["tool_calls"]:
            entry = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            entry["id"] += tc.get("id", "")
            entry["name"] += tc.get("function", {}).get("name", "")
            entry["arguments"] += tc.get("function", {}).get("arguments", "")
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"city": "paris"}, {"city": "lima"}]
    assert all(c["name"] == "get_weather" and c["id"].startswith("call_") for c in calls.values())


def test_streamer_passes_text_and_holds_a_possible_marker() -> None:
    streamer = ToolCallStreamer(parse_tools([WEATHER]))
    assert streamer.feed("<tool") == []  # could still become a call
    assert streamer.feed("bar> is a tag") == [{"content": "<toolbar> is a tag"}]
    assert streamer.feed(" and more") == [{"content": " and more"}]
    short = ToolCallStreamer(parse_tools([WEATHER]))
    assert short.feed("<", final=True) == [{"content": "<"}]


@pytest.mark.parametrize("mode", ["auto", "required", "named"])
def test_tool_grammar_accepts_calls_on_real_tokenizer(smol: Any, mode: str) -> None:
    tools = parse_tools([WEATHER, TIME])
    choice = ToolChoice("named", "get_weather") if mode == "named" else ToolChoice(mode)  # type: ignore[arg-type]
    spec = tool_grammar(tools, choice, parallel=True)
    assert spec is not None
    compiler = compiler_for(smol)
    con = compiler.constraint(spec)
    assert all(con.accept(t) for t in smol.encode(CALL, add_special_tokens=False))
    assert con.is_accepting
    # Arguments outside the schema are not writable.
    con = compiler.constraint(spec)
    bad = CALL.replace("paris", "rome")
    assert not all(con.accept(t) for t in smol.encode(bad, add_special_tokens=False))
    con = compiler.constraint(spec)
    text_ok = all(con.accept(t) for t in smol.encode("It is sunny.", add_special_tokens=False))
    assert text_ok == (mode == "auto")


def test_auto_text_may_not_contain_the_marker(smol: Any) -> None:
    spec = tool_grammar(parse_tools([WEATHER]), ToolChoice("auto"), parallel=False)
    assert spec is not None
    con = compiler_for(smol).constraint(spec)
    ids = smol.encode("Sure. <tool_call> oops", add_special_tokens=False)
    assert not all(con.accept(t) for t in ids)


def test_parallel_false_allows_one_call(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = parse_tools([WEATHER])
    for parallel, ok in ((True, True), (False, False)):
        spec = tool_grammar(tools, ToolChoice("required"), parallel=parallel)
        assert spec is not None
        con = GrammarCompiler(tok).constraint(spec)
        ids = tok.encode(CALL + "\n" + CALL, add_special_tokens=False)
        assert all(con.accept(t) for t in ids) == ok


def test_random_walk_under_tool_grammar_parses(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = parse_tools([WEATHER])
    spec = tool_grammar(tools, ToolChoice("required"), parallel=False)
    assert spec is not None
    for seed in range(3):
        con = GrammarCompiler(tok).constraint(spec)
        rng = random.Random(seed)
        mask = torch.zeros(len(tok), dtype=torch.bool)
        ids: list[int] = []
        while not con.is_terminated and len(ids) < 300:
            con.fill_mask(mask)
            t = rng.choice(mask.nonzero().flatten().tolist())
            assert con.accept(t)
            ids.append(t)
        content, calls = parse_tool_calls(str(tok.decode(ids, skip_special_tokens=True)), tools)
        assert content is None and json.loads(calls[0]["function"]["arguments"])["city"] in ("paris", "lima")


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="small", messages=[ChatMessage(role="user", content="hi")], **fields)


def test_strict_schema_rules() -> None:
    ok = {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "integer"}},
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    }
    check_strict_schema(ok, "x")
    open_inner = json.loads(json.dumps(ok))
    del open_inner["properties"]["a"]["additionalProperties"]
    with pytest.raises(BadRequestError, match=r"context=\('properties', 'a'\)"):
        check_strict_schema(open_inner, "x")
    partial = json.loads(json.dumps(ok))
    partial["properties"]["c"] = {"type": "string"}
    with pytest.raises(BadRequestError, match="Missing 'c'") as info:
        check_strict_schema(partial, "x")
    assert info.value.param == "response_format.json_schema.schema"
    from router.openai.schemas import JsonSchemaFormat, ResponseFormat

    req = _chat(
        response_format=ResponseFormat(
            type="json_schema", json_schema=JsonSchemaFormat(name="x", schema=partial, strict=True)
        )
    )
    with pytest.raises(BadRequestError):
        output_spec(req)
    req.response_format.json_schema.strict = False  # type: ignore[union-attr]
    assert output_spec(req).grammar is not None  # non-strict: best effort, no 400


def test_close_objects_keeps_property_names() -> None:
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a property map, not a schema
    assert schema == {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {}}}},
    }


def test_output_spec_shapes() -> None:
    from router.openai.schemas import ResponseFormat

    plain = output_spec(_chat())
    assert plain.is_plain and plain.grammar is None and plain.response_format == "text"
    spec = output_spec(
        _chat(response_format=ResponseFormat(type="json_object"), logprobs=True, top_logprobs=2, n=3)
    )
    assert (spec.response_format, spec.logprobs, spec.n, spec.is_plain) == ("json_object", 2, 3, False)
    tools = output_spec(_chat(tools=[WEATHER], tool_choice="none"))
    assert tools.has_tools and not tools.parses_tool_calls and tools.grammar is None
    with pytest.raises(BadRequestError) as info:
        validate_chat(_chat(response_format=ResponseFormat(type="json_schema")))
    assert info.value.param == "response_format.json_schema"


def test_token_texts_and_logprobs_objects(smol: Any) -> None:
    texts = TokenTexts(smol)
    ids = smol.encode("café 東京", add_special_tokens=False)
    joined = b"".join(bytes(texts.get(t)[1]) for t in ids)
    assert joined.decode() == "café 東京"
    entries = [TokenLogprob(t, -0.5, [(t, -0.5), (0, float("-inf"))]) for t in ids]
    chat = chat_logprobs(texts, entries, top=1)
    assert [len(c["top_logprobs"]) for c in chat] == [1] * len(ids)
    legacy = completion_logprobs(texts, list[TokenLogprob | None](entries), top=2, offset=4)
    assert legacy["text_offset"][0] == 4 and len(legacy["tokens"]) == len(ids)
    assert all(v >= -9999.0 for tops in legacy["top_logprobs"] for v in tops.values())  # -inf is not JSON


async def test_merged_and_remote_tool_call_deltas() -> None:
    async def upstream() -> Any:
        # A remote tier: one stream, choices tagged with their index, tool calls as deltas.
        yield StepOutput(
            "",
            [],
            index=0,
            tool_calls=[
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ],
        )
        yield StepOutput("", [], index=1, tool_calls=None, wire_logprobs=None)
        yield StepOutput("", [], index=0, tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}])
        yield StepOutput("hello", [], index=1)
        yield StepOutput("", [], index=0, tool_calls=[{"index": 0, "function": {"arguments": '"lima"}'}}])
        yield StepOutput(
            "", [], finish_reason="tool_calls", index=0, num_prompt_tokens=5, num_output_tokens=9
        )
        yield StepOutput("", [], finish_reason="stop", index=1)

    spec = OutputSpec(n=2, tools=parse_tools([WEATHER]), tool_choice=ToolChoice("auto"))
    choices = [ChoiceBuilder(i, "chat", spec, None) for i in range(2)]
    async for index, out in Merged([upstream()]):
        choices[index].add(out)
    first, second = choices[0].body(), choices[1].body()
    assert first["finish_reason"] == "tool_calls"
    assert first["message"]["tool_calls"] == [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "lima"}'},
        }
    ]
    assert second["message"]["content"] == "hello" and second["finish_reason"] == "stop"


async def test_merged_interleaves_local_choices() -> None:
    async def choice(tag: str) -> Any:
        for i in range(3):
            yield StepOutput(f"{tag}{i}", [i])
        yield StepOutput("", [], finish_reason="stop")

    seen: dict[int, str] = {0: "", 1: ""}
    merged = Merged([choice("a"), choice("b")])
    async for index, out in merged:
        seen[index] += out.text
    await merged.aclose()
    assert seen == {0: "a0a1a2", 1: "b0b1b2"}


def test_native_tool_template_is_used_when_the_model_has_one(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from router.backends.local import native_prompt_ids, native_tool_template

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert not native_tool_template(tok)  # the tiny template (like SmolLM2's) has no tool support
    req = _chat(tools=[WEATHER], tool_choice="required")
    gen = Generation.parsed(req, raw_messages=raw_messages(req), output=output_spec(req))
    assert native_prompt_ids(tok, gen) is None
    tok.chat_template = (
        "{% for t in tools %}[TOOL {{ t['function']['name'] }}]{% endfor %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}[CALL {{ c['function']['name'] }}]{% endfor %}{% endfor %}"
    )
    assert native_tool_template(tok)
    ids = native_prompt_ids(tok, gen)
    assert ids is not None
    assert str(tok.decode(ids)).startswith("[TOOL get_weather]<user>hi")


def test_native_rendering_leaves_the_parsed_messages_as_they_are(tiny_model_dir: Path) -> None:
    """Bug it guards: the request's messages are parsed once and kept on ``Generation``; turning a
    call's ``arguments`` into an object for the template in place would make a second rendering
    (a request prepared again after a reload) see an object where the JSON text was."""
    from transformers import AutoTokenizer

    from router.backends.local import native_prompt_ids

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}[{{ c['function']['arguments']['city'] }}]{% endfor %}"
        "{% endfor %}{{ tools | length }}tool_calls"
    )
    call = {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "lima", "days": 1}'}}
    body = {
        "model": "small",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        ],
        "tools": [WEATHER],
    }
    req = msgspec.convert(body, ChatCompletionRequest)
    gen = Generation.parsed(req, raw_messages=raw_messages(req), output=output_spec(req))
    first = native_prompt_ids(tok, gen)
    assert first is not None and "[lima]" in str(tok.decode(first))  # the template saw an object
    assert gen.raw_messages is not None
    assert gen.raw_messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "lima", "days": 1}'
    assert native_prompt_ids(tok, gen) == first
