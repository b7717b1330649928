"""What routing reads off a request (router/pipeline/routing.py), on stand-in tiers and policies:
the prompt-token count (exact when a rule threshold could turn on it, else the byte estimate),
the refusals of a prompt no tier can hold and of a ``max_tokens`` past the serving tier's window
(each at its limit accepted, one past refused, the field named), the request-shape signals, and
the output each tier prices a request at."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from router.errors import BadRequestError
from router.pipeline.routing import (
    collected_max_tokens,
    count_tokens,
    count_tokens_off_loop,
    expected_output,
    refuse_past_context,
    refuse_unfittable,
    request_signals,
)


class _WordTokenizer:
    """One token per space-separated word: an independent count to compare with."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        self.calls += 1
        return list(range(len(text.split())))


def _tiers(*, token_bytes: int | None = 4, remote: bool = False, lens: tuple[int, ...] = (100, 300)) -> Any:
    tok = _WordTokenizer()
    backends = {
        f"t{i}": SimpleNamespace(is_remote=remote and i == 0, cfg=SimpleNamespace(max_model_len=n))
        for i, n in enumerate(lens)
    }
    return SimpleNamespace(tiers=backends, token_bytes=token_bytes, counting_tokenizer=lambda: tok, tok=tok)


def _policy(
    thresholds: tuple[tuple[int | None, int | None], ...] = (), tiers: dict[str, Any] | None = None
) -> Any:
    rules = [
        SimpleNamespace(when=SimpleNamespace(prompt_tokens_above=a, prompt_tokens_at_most=b))
        for a, b in thresholds
    ]
    rules.append(SimpleNamespace(when=None))
    return SimpleNamespace(routing=SimpleNamespace(rules=rules), tiers=tiers or {})


def test_without_a_token_rule_the_count_is_the_cheap_estimate_and_no_tokenizer_runs() -> None:
    tiers = _tiers()
    text = "word " * 40  # 200 characters
    assert count_tokens(tiers, _policy(), None, text) == 50
    assert tiers.tok.calls == 0


def test_a_prompt_that_could_cross_a_threshold_is_counted_exactly() -> None:
    """Bug it catches: the estimate used where a rule's threshold lies below the prompt's byte
    count - a 60-word prompt routed as if it had 75 tokens."""
    tiers = _tiers()
    text = "abcd " * 60  # 300 bytes, 60 words
    policy = _policy(((50, None),))
    assert count_tokens(tiers, policy, None, text) == 60
    assert asyncio.run(count_tokens_off_loop(tiers, policy, None, text)) == 60
    assert tiers.tok.calls == 2
    messages = [{"role": "system", "content": "a b"}, {"role": "user", "content": "c d e"}]
    assert count_tokens(tiers, _policy(((1, None),)), messages, None) == 5


def test_a_prompt_below_every_threshold_is_estimated_without_the_tokenizer() -> None:
    """At most one token per byte: a 40-byte prompt cannot be above a 40-token threshold."""
    tiers = _tiers()
    text = "x" * 40
    assert count_tokens(tiers, _policy(((None, 40), (100, None))), None, text) == 10
    assert count_tokens(tiers, _policy(((None, 40),)), None, "x") == 1  # a short prompt is 1, not 0
    assert count_tokens(tiers, _policy(((None, 40),)), None, "") == 0
    assert tiers.tok.calls == 0
    assert count_tokens(tiers, _policy(((None, 39),)), None, text) == 1  # 40 bytes > 39: counted
    assert tiers.tok.calls == 1


def test_a_prompt_certainly_past_every_window_is_refused_before_tokenizing() -> None:
    """Limit 300 tokens, at least one token per 4 bytes: 1,204 bytes are >= 301 tokens. Bugs it
    catches: ``>=`` for ``>`` (a prompt of exactly the window refused), the smallest window used
    instead of the largest, the param not naming the prompt's field."""
    tiers = _tiers()
    refuse_unfittable(tiers, None, "x" * 1203)  # at least 300: may fit the 300-token tier
    with pytest.raises(BadRequestError) as err:
        refuse_unfittable(tiers, None, "x" * 1204)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    assert "maximum context length is 300 tokens" in err.value.message and "at least 301" in err.value.message
    with pytest.raises(BadRequestError) as chat:
        refuse_unfittable(tiers, [{"role": "user", "content": "x" * 2000}], None)
    assert chat.value.param == "messages"
    refuse_unfittable(_tiers(remote=True), None, "x" * 100_000)  # a remote tier judges its own
    refuse_unfittable(_tiers(token_bytes=None), None, "x" * 100_000)
    refuse_unfittable(None, None, "x" * 100_000)


def _gen(max_tokens: int | None, *, completion_field: bool = False, stream: bool = False) -> Any:
    request = SimpleNamespace(max_completion_tokens=max_tokens if completion_field else None)
    return SimpleNamespace(
        sampling=SimpleNamespace(max_tokens=max_tokens), request=request, stream=stream, output=None
    )


def test_max_tokens_up_to_the_window_is_accepted_and_one_past_is_refused_by_name() -> None:
    tiers = _tiers(lens=(256,))
    policy = _policy(tiers={"t0": SimpleNamespace(max_model_len=256)})
    refuse_past_context(tiers, policy, "t0", _gen(256))
    refuse_past_context(tiers, policy, "t0", _gen(None))
    with pytest.raises(BadRequestError) as err:
        refuse_past_context(tiers, policy, "t0", _gen(257))
    assert err.value.param == "max_tokens" and err.value.code == "context_length_exceeded"
    assert "257" in err.value.message and "256" in err.value.message
    with pytest.raises(BadRequestError) as named:
        refuse_past_context(tiers, policy, "t0", _gen(300, completion_field=True))
    assert named.value.param == "max_completion_tokens"
    refuse_past_context(_tiers(lens=(256,), remote=True), policy, "t0", _gen(10**6))
    refuse_past_context(tiers, policy, "unknown", _gen(10**6))


def test_request_signals_read_the_last_user_turn_and_the_output_spec() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second question"},
    ]
    spec = SimpleNamespace(has_tools=True, response_format="json_schema", logprobs=0)
    gen = SimpleNamespace(output=spec)
    signals = request_signals(messages, None, gen)  # type: ignore[arg-type]
    assert signals == {
        "text": "second question",
        "turns": 2,
        "has_tools": True,
        "response_format": "json_schema",
        "logprobs": True,  # logprobs: 0 still asks for logprobs
    }
    assert request_signals(None, "a prompt", None) == {"text": "a prompt", "turns": 1}
    assert request_signals([{"role": "system", "content": "x"}], None, None) == {"text": "", "turns": 0}


def test_each_tier_prices_what_was_asked_else_its_default_capped_by_its_window() -> None:
    tiers = {
        "small": SimpleNamespace(defaults=SimpleNamespace(max_tokens=256), max_model_len=2048),
        "large": SimpleNamespace(defaults=SimpleNamespace(max_tokens=512), max_model_len=400),
    }
    policy = _policy(tiers=tiers)
    assert expected_output(policy, _gen(1000)) == {"small": 1000, "large": 400}
    assert expected_output(policy, _gen(None)) == {"small": 256, "large": 400}
    assert expected_output(policy, None) == {"small": 256, "large": 400}


def test_only_a_collected_answer_has_max_tokens_for_the_deadline_check() -> None:
    assert collected_max_tokens(_gen(64)) == 64
    assert collected_max_tokens(_gen(64, stream=True)) is None
    assert collected_max_tokens(None) is None
