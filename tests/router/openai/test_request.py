"""router/openai/request.py: a body becomes the typed request in one pass (validation, bounds,
output contract, conversation, sampling, response id), with its refusals in the order the
service gave them before parsing moved here, and nothing left for a reader to derive again."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.errors import BadRequestError
from router.openai.request import CallContext, Generation, parse_chat, parse_completion, parse_completions
from router.openai.schemas import ChatCompletionRequest, CompletionRequest
from router.policy.schema import LimitsConfig

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
LIMITS = LimitsConfig(max_logit_bias=2, max_tools=1)


def _chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


def _refusal(req: ChatCompletionRequest | CompletionRequest) -> str | None:
    parse = parse_chat if isinstance(req, ChatCompletionRequest) else parse_completion
    with pytest.raises(BadRequestError) as err:
        parse(req, LIMITS)  # type: ignore[arg-type]
    return err.value.param


def test_refusals_keep_their_order_validation_then_bounds_then_tools() -> None:
    """Bug it guards: parsing moved from the service into one function; checking the bounds (or
    compiling tools) before validating would name another field of a body wrong in two ways."""
    bias = {"1": 1.0, "2": 1.0, "3": 1.0}  # over max_logit_bias
    assert _refusal(_chat(temperature=3.0, logit_bias=bias)) == "temperature"
    assert _refusal(_chat(logit_bias=bias)) == "logit_bias"
    two_tools = [WEATHER, {**WEATHER, "function": {**WEATHER["function"], "name": "other"}}]
    assert _refusal(_chat(tools=two_tools, tool_choice="bogus")) == "tools"  # the bound first
    assert _refusal(_chat(tools=[WEATHER], tool_choice="bogus")) == "tool_choice"
    assert _refusal(_chat(messages=[])) == "messages"
    prompts = ["a"] * (LIMITS.max_prompts + 1)
    assert _refusal(CompletionRequest(model="auto", prompt=prompts, temperature=3.0)) == "temperature"
    assert _refusal(CompletionRequest(model="auto", prompt=prompts)) == "prompt"  # over max_prompts
    assert _refusal(CompletionRequest(model="auto", prompt=[])) == "prompt"


def test_a_list_of_prompts_is_one_typed_request_per_prompt() -> None:
    """Bug it guards: every prompt parsed into the first prompt's request (all answered alike), or
    a one-prompt list split into a copy that loses nothing but costs a request."""
    req = CompletionRequest(model="auto", prompt=["a", "b c"], n=2, max_tokens=4, echo=True)
    gens = parse_completions(req, LIMITS)
    assert [g.prompt for g in gens] == ["a", "b c"] and [g.last_user for g in gens] == ["a", "b c"]
    assert [g.request.prompt for g in gens] == ["a", "b c"]
    assert all(g.request.n == 2 and g.request.echo and g.sampling.max_tokens == 4 for g in gens)
    assert len({g.response_id for g in gens}) == 2
    one = CompletionRequest(model="auto", prompt=["only"])
    assert parse_completions(one, LIMITS)[0].request is one


def test_a_chat_is_parsed_into_plain_fields_once() -> None:
    """Bug it guards: readers (cache, backends, writer) re-deriving fields from the raw body, or
    the parsed request missing what the local backend's native tool template needs."""
    call = {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "lima"}'}}
    req = _chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        ],
        tools=[WEATHER],
        stream=True,
        stream_options={"include_usage": True},
        max_completion_tokens=7,
        stop="END",
    )
    ctx = CallContext(headers={}, tenant="acme")
    gen = parse_chat(req, LimitsConfig(), ctx)
    assert (gen.kind, gen.stream, gen.include_usage, gen.ctx) == ("chat", True, True, ctx)
    assert gen.output is not None and gen.output.parses_tool_calls and gen.output.has_tools
    assert gen.output.grammar is not None and gen.output.grammar_param == "tools"
    # The raw messages keep the call as sent; the plain ones carry it in the generic template.
    assert gen.raw_messages is not None
    assert gen.raw_messages[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "lima"}'
    assert gen.raw_messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert gen.messages is not None and [m["role"] for m in gen.messages] == [
        "system",
        "user",
        "assistant",
        "user",
    ]
    assert gen.messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert (
        gen.messages[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "lima"}}\n</tool_call>'
    )
    assert gen.messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    assert gen.last_user == gen.messages[3]["content"]  # the tool result is the last user turn
    assert (gen.sampling.max_tokens, gen.sampling.max_tokens_param, gen.sampling.stop) == (
        7,
        "max_completion_tokens",
        ("END",),
    )
    assert gen.response_id.startswith("chatcmpl-") and len(gen.response_id) == len("chatcmpl-") + 24


def test_a_completion_is_parsed_with_its_one_prompt_and_id() -> None:
    gen = parse_completion(CompletionRequest(model="auto", prompt=["only"], n=2, best_of=3), LimitsConfig())
    assert (gen.kind, gen.prompt, gen.last_user, gen.messages, gen.raw_messages) == (
        "completion",
        "only",
        "only",
        None,
        None,
    )
    assert gen.output is not None and (gen.output.n, gen.output.best_of) == (2, 3)
    assert gen.sampling.max_tokens == 16  # OpenAI's completions default
    assert gen.response_id.startswith("cmpl-")
    # A copy keeps its id (the shadow answer is recorded under the served request's id).
    again = Generation("completion", gen.request, None, "only", False, False, response_id=gen.response_id)
    assert again.response_id == gen.response_id


def test_a_shadow_copy_asks_one_bounded_unstreamed_choice_of_its_tier() -> None:
    """Catches a shadow copy that streams, asks n or best_of choices (the extra sequences run
    unaborted), keeps a larger token limit than the shadow's (or raises a smaller one the caller
    asked), keeps max_completion_tokens (which overrides max_tokens on the wire), loses its
    response id, or leaves the sampling fields read from the old body."""
    chat = parse_chat(
        _chat(n=2, stream=True, stream_options={"include_usage": True}, max_completion_tokens=500, seed=7),
        LimitsConfig(),
    )
    copy = chat.shadow_copy("large", 64)
    assert (copy.request.model, copy.stream, copy.include_usage, copy.request.stream) == (
        "large",
        False,
        False,
        False,
    )
    assert copy.request.stream_options is None and copy.request.n == 1
    assert (copy.request.max_tokens, copy.request.max_completion_tokens, copy.sampling.max_tokens) == (
        64,
        None,
        64,
    )
    assert copy.output is not None and copy.output.n == 1
    assert copy.sampling.seed == 7 and copy.response_id == chat.response_id and copy.messages == chat.messages
    assert chat.request.n == 2 and chat.stream  # the served request is untouched
    small = parse_chat(_chat(max_tokens=10), LimitsConfig()).shadow_copy("large", 64)
    assert small.request.max_tokens == 10  # the caller's own lower limit stands

    completion = parse_completion(CompletionRequest(model="auto", prompt="x", n=2, best_of=3), LimitsConfig())
    copy = completion.shadow_copy("medium", 32)
    assert (copy.request.best_of, copy.request.n, copy.request.max_tokens) == (None, 1, 16)
    assert copy.output is not None and (copy.output.n, copy.output.best_of) == (1, 1)


@pytest.mark.parametrize(
    ("tenant", "principal", "partition"),
    [("acme", "fp1", "t:acme"), (None, "fp1", "k:fp1"), (None, None, "-"), ("acme", None, "t:acme")],
)
def test_a_context_partition_is_fixed_when_built(
    tenant: str | None, principal: str | None, partition: str
) -> None:
    """Bug it guards: the partition became a field set once; identifying the caller afterwards
    (the service fills ``principal`` from the tenant when it has none) must not change it."""
    ctx = CallContext(headers={}, tenant=tenant, principal=principal)
    assert ctx.partition == partition
    if ctx.principal is None:
        ctx.principal = ctx.tenant  # what router.pipeline.limits.identify does
    expected = "t:" + tenant if tenant is not None else ("k:" + principal if principal is not None else "-")
    assert ctx.partition == expected


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_token_fields_accept_their_bound_and_refuse_one_past_it(api: str) -> None:
    """Bugs it catches: a ``logit_bias`` key of 5,000 digits reaching ``int()`` (past Python's
    4,300-digit limit: a 500), and ``max_tokens`` with no upper bound (``10**30`` accepted, prices
    and token budgets overflowing)."""
    from router.openai.schemas import MAX_TOKEN_ID_DIGITS, MAX_TOKENS_BOUND

    def make(**fields: Any) -> ChatCompletionRequest | CompletionRequest:
        if api == "chat":
            return _chat(**fields)
        return msgspec.convert({"model": "auto", "prompt": "hi", **fields}, CompletionRequest)

    parse = parse_chat if api == "chat" else parse_completion
    ok = parse(make(max_tokens=MAX_TOKENS_BOUND, logit_bias={"9" * MAX_TOKEN_ID_DIGITS: 1.0}), LIMITS)  # type: ignore[arg-type]
    assert ok.sampling.max_tokens == MAX_TOKENS_BOUND
    assert _refusal(make(max_tokens=MAX_TOKENS_BOUND + 1)) == "max_tokens"
    assert _refusal(make(max_tokens=10**400)) == "max_tokens"
    assert _refusal(make(logit_bias={"9" * (MAX_TOKEN_ID_DIGITS + 1): 1.0})) == "logit_bias"
    assert _refusal(make(logit_bias={"5" * 5000: 1.0})) == "logit_bias"
    if api == "chat":
        assert _refusal(make(max_completion_tokens=MAX_TOKENS_BOUND + 1)) == "max_completion_tokens"


def test_a_schema_is_bounded_in_characters_at_its_limit_and_one_past_it() -> None:
    """Bug it catches: ``schema_size`` counted nodes only, so one huge ``pattern`` (a single node)
    passed every bound. Keys ``type``, ``pattern`` and the value ``string`` are 17 characters."""

    def fmt(n: int) -> dict[str, Any]:
        schema = {"type": "string", "pattern": "a" * n}
        return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}

    limits = LimitsConfig(max_schema_chars=1000)
    assert parse_chat(_chat(response_format=fmt(1000 - 17)), limits).output is not None
    with pytest.raises(BadRequestError, match="max_schema_chars") as err:
        parse_chat(_chat(response_format=fmt(1000 - 16)), limits)
    assert err.value.param == "response_format.json_schema.schema"


def test_identifiers_and_metadata_accept_their_bound_and_refuse_one_past_it() -> None:
    """Bugs it catches: ``user`` (1 MB) kept with every stored answer and logged, ``metadata`` past
    OpenAI's documented 16 pairs / 64-character keys / 512-character values accepted, a message
    ``name`` of any size passed into the prompt."""
    from router.openai.schemas import (
        MAX_ID_CHARS,
        MAX_METADATA_KEY_CHARS,
        MAX_METADATA_PAIRS,
        MAX_METADATA_VALUE_CHARS,
    )

    at = "u" * MAX_ID_CHARS
    meta = {f"k{i}".ljust(MAX_METADATA_KEY_CHARS, "x"): "v" * MAX_METADATA_VALUE_CHARS for i in range(16)}
    assert len(meta) == MAX_METADATA_PAIRS
    named = [{"role": "user", "content": "hi", "name": at}]
    ok = _chat(user=at, safety_identifier=at, prompt_cache_key=at, metadata=meta, messages=named)
    assert parse_chat(ok, LIMITS).request.user == at
    assert _refusal(_chat(user=at + "u")) == "user"
    assert _refusal(_chat(safety_identifier=at + "u")) == "safety_identifier"
    assert _refusal(_chat(prompt_cache_key=at + "u")) == "prompt_cache_key"
    assert (
        _refusal(_chat(messages=[{"role": "user", "content": "hi", "name": at + "u"}])) == "messages[0].name"
    )
    assert _refusal(_chat(metadata={**meta, "one": "more"})) == "metadata"
    assert _refusal(_chat(metadata={"k" * (MAX_METADATA_KEY_CHARS + 1): "v"})) == "metadata"
    assert _refusal(_chat(metadata={"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)})) == "metadata.k"
    completion = msgspec.convert({"model": "auto", "prompt": "hi", "user": at + "u"}, CompletionRequest)
    assert _refusal(completion) == "user"


def test_n_times_max_tokens_is_bounded_per_request() -> None:
    """Bug it catches: ``n: 16`` with a large ``max_tokens`` asked for 16 long sequences at the
    price of one request (service.limits.max_request_tokens counts max(n, best_of) x max_tokens;
    one choice is bounded by the tier's context window instead)."""
    limits = LimitsConfig(max_request_tokens=1000)
    assert parse_chat(_chat(n=4, max_tokens=250), limits).sampling.max_tokens == 250
    with pytest.raises(BadRequestError, match="max_request_tokens") as err:
        parse_chat(_chat(n=4, max_tokens=251), limits)
    assert err.value.param == "max_tokens"
    with pytest.raises(BadRequestError, match="4 x 251") as err:
        parse_chat(_chat(n=4, max_tokens=10, max_completion_tokens=251), limits)
    assert err.value.param == "max_completion_tokens"
    assert parse_chat(_chat(max_tokens=5000), limits).sampling.max_tokens == 5000  # n = 1
    best = msgspec.convert(
        {"model": "auto", "prompt": "hi", "n": 1, "best_of": 5, "max_tokens": 201}, CompletionRequest
    )
    with pytest.raises(BadRequestError, match="5 x 201"):
        parse_completion(best, limits)
