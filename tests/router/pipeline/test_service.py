"""Pieces of the request pipeline that need no server."""

from __future__ import annotations

import pytest

from router.pipeline.limits import TenantLimiter


def test_tenant_token_bucket_allows_the_rate_then_asks_to_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("router.pipeline.limits.time.monotonic", lambda: now[0])
    limiter = TenantLimiter()
    assert all(limiter.check("t", 60) is None for _ in range(60))  # a full minute's burst
    wait = limiter.check("t", 60)
    assert wait is not None and 0.9 <= wait <= 1.1
    now[0] += 1.0  # one request's worth refills per second at 60 rpm
    assert limiter.check("t", 60) is None
    assert limiter.check("other", 60) is None  # buckets are per tenant


def test_routing_signals_come_from_the_parsed_request() -> None:
    """Bug it guards: the policy's request-shape conditions (``has_tools``, ``response_format``,
    ``logprobs``) read from the typed request instead of the raw body: a mapping slip would route
    a tool call or a JSON answer by the wrong rule. Expected values written out per request."""
    import msgspec

    from router.openai.request import parse_chat, parse_completion
    from router.openai.schemas import ChatCompletionRequest, CompletionRequest
    from router.pipeline.routing import collected_max_tokens, request_signals
    from router.policy.schema import LimitsConfig

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]

    def chat(**fields: object) -> object:
        req = msgspec.convert({"model": "auto", "messages": msgs, **fields}, ChatCompletionRequest)
        return parse_chat(req, LimitsConfig())

    plain = chat()
    assert request_signals(plain.messages, None, plain) == {  # type: ignore[attr-defined]
        "text": "c",
        "turns": 2,
        "has_tools": False,
        "response_format": "text",
        "logprobs": False,
    }
    rich = chat(
        tools=[tool],
        response_format={"type": "json_object"},
        logprobs=True,
        max_completion_tokens=7,
        max_tokens=99,
    )
    got = request_signals(rich.messages, None, rich)  # type: ignore[attr-defined]
    assert (got["has_tools"], got["response_format"], got["logprobs"]) == (True, "json_object", True)
    assert collected_max_tokens(rich) == 7  # type: ignore[arg-type]
    assert collected_max_tokens(chat(stream=True, max_tokens=5)) is None  # type: ignore[arg-type]
    comp = parse_completion(
        msgspec.convert({"model": "auto", "prompt": "p", "logprobs": 0}, CompletionRequest), LimitsConfig()
    )
    got = request_signals(None, "p", comp)
    assert (got["text"], got["turns"], got["logprobs"], got["has_tools"]) == ("p", 1, True, False)
    assert collected_max_tokens(comp) == 16  # OpenAI's completions default
    # /v1/route: no parsed request, only the text.
    assert request_signals(None, "q", None) == {"text": "q", "turns": 1}
