"""Every documented sampling field of a request reaches the engine's ``SamplingParams`` with the
value the caller set, its boundary and falsy values included (0, 0.0, [], false): a value the
caller set explicitly is never replaced by the tier's default (router/backends/local.py's
``sampling_params`` over router/openai/request.py's ``Sampling``)."""

from __future__ import annotations

import types
from typing import Any

import msgspec
import pytest

from router.backends.local import LocalTier, sampling_params
from router.openai.request import parse_chat, parse_completion
from router.openai.schemas import ChatCompletionRequest, CompletionRequest
from router.policy.schema import GenerationDefaults, LimitsConfig, TierConfig
from tiers.core.sequence import SamplingParams

DEFAULTS = GenerationDefaults(max_tokens=99, temperature=0.7, top_p=0.9)
VOCAB = 500


def _backend(max_model_len: int = 1000) -> Any:
    """What ``sampling_params`` reads of a local tier: its config, name, vocabulary and clamp."""
    ns = types.SimpleNamespace(
        name="t",
        cfg=TierConfig(model="m", max_model_len=max_model_len, defaults=DEFAULTS),
        tokenizer=[0] * VOCAB,
        max_model_len=max_model_len,
    )
    ns.clamp_max_tokens = lambda n, req, param: LocalTier.clamp_max_tokens(ns, n, req, param)  # type: ignore[arg-type]
    return ns


def _chat_params(num_prompt: int = 10, **fields: Any) -> SamplingParams:
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}], **fields}
    gen = parse_chat(msgspec.convert(body, ChatCompletionRequest), LimitsConfig())
    return sampling_params(_backend(), gen, num_prompt)


def _completion_params(**fields: Any) -> SamplingParams:
    req = msgspec.convert({"model": "auto", "prompt": "hi", **fields}, CompletionRequest)
    return sampling_params(_backend(), parse_completion(req, LimitsConfig()), 10)


# (request field, value, SamplingParams attribute, expected value): falsy values first.
CASES: list[tuple[str, Any, str, Any]] = [
    ("temperature", 0.0, "temperature", 0.0),
    ("temperature", 0.3, "temperature", 0.3),
    ("temperature", 2.0, "temperature", 2.0),
    ("top_p", 0.5, "top_p", 0.5),
    ("top_p", 1.0, "top_p", 1.0),
    ("seed", 0, "seed", 0),
    ("seed", 7, "seed", 7),
    ("top_k", 0, "top_k", 0),
    ("top_k", 5, "top_k", 5),
    ("presence_penalty", 0.0, "presence_penalty", 0.0),
    ("presence_penalty", -2.0, "presence_penalty", -2.0),
    ("presence_penalty", 2.0, "presence_penalty", 2.0),
    ("frequency_penalty", 0.0, "frequency_penalty", 0.0),
    ("frequency_penalty", 1.5, "frequency_penalty", 1.5),
    ("repetition_penalty", 1.2, "repetition_penalty", 1.2),
    ("min_p", 0.0, "min_p", 0.0),
    ("min_p", 0.1, "min_p", 0.1),
    ("min_tokens", 0, "min_tokens", 0),
    ("min_tokens", 3, "min_tokens", 3),
    ("ignore_eos", False, "ignore_eos", False),
    ("ignore_eos", True, "ignore_eos", True),
    ("include_stop_str_in_output", False, "include_stop_str_in_output", False),
    ("include_stop_str_in_output", True, "include_stop_str_in_output", True),
    ("stop", [], "stop", ()),
    ("stop", "x", "stop", ("x",)),
    ("stop", ["a", "b"], "stop", ("a", "b")),
    ("stop_token_ids", [], "stop_token_ids", ()),
    ("stop_token_ids", [0, VOCAB - 1], "stop_token_ids", (0, VOCAB - 1)),
    ("logit_bias", {}, "logit_bias", ()),
    ("logit_bias", {"0": -100, "5": 100}, "logit_bias", ((0, -100.0), (5, 100.0))),
    ("max_tokens", 1, "max_tokens", 1),
    ("max_tokens", 40, "max_tokens", 40),
    ("max_completion_tokens", 1, "max_tokens", 1),
]


@pytest.mark.parametrize(("field", "value", "attr", "want"), CASES)
def test_a_field_reaches_the_engine_with_the_value_set(field: str, value: Any, attr: str, want: Any) -> None:
    """Bug it catches: ``x or default`` where ``x if x is not None else default`` was meant (an
    explicit 0 / 0.0 / [] / false replaced by the tier's default), or a field dropped on the way."""
    assert getattr(_chat_params(**{field: value}), attr) == want
    if field != "max_completion_tokens":
        assert getattr(_completion_params(**{field: value}), attr) == want


def test_unset_fields_take_the_tiers_defaults_and_the_engines_neutral_values() -> None:
    """Bug it catches: the tier's defaults not applied (or applied over the caller's), or an
    unset penalty that is not the neutral one."""
    p = _chat_params()
    assert (p.max_tokens, p.temperature, p.top_p) == (99, 0.7, 0.9)
    assert (p.top_k, p.seed, p.stop, p.stop_token_ids, p.logit_bias) == (0, None, (), (), ())
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.0, 0.0, 1.0, 0.0)
    assert (p.min_tokens, p.ignore_eos, p.include_stop_str_in_output) == (0, False, False)
    # Completions default to OpenAI's 16 tokens, not the tier's default.
    assert _completion_params().max_tokens == 16


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert _chat_params(max_tokens=30, max_completion_tokens=5).max_tokens == 5
    assert _chat_params(max_tokens=30).max_tokens == 30


def test_max_tokens_is_clamped_to_the_room_left_and_min_tokens_to_max_tokens() -> None:
    """Bug it catches: the clamp off by one (a prompt of 990 tokens in a 1000-token context has
    room for exactly 10), or ``min_tokens`` left above the clamped ``max_tokens``."""
    assert _chat_params(num_prompt=990, max_tokens=50).max_tokens == 10
    assert _chat_params(num_prompt=990, max_tokens=10).max_tokens == 10
    assert _chat_params(num_prompt=990, max_tokens=9).max_tokens == 9
    assert _chat_params(num_prompt=999).max_tokens == 1
    assert _chat_params(num_prompt=990, max_tokens=50, min_tokens=20).min_tokens == 10
    assert _chat_params(num_prompt=990, max_tokens=50, min_tokens=10).min_tokens == 10


def test_token_ids_past_the_vocabulary_are_refused_and_the_last_one_accepted() -> None:
    from router.errors import BadRequestError

    assert _chat_params(stop_token_ids=[VOCAB - 1]).stop_token_ids == (VOCAB - 1,)
    with pytest.raises(BadRequestError) as err:
        _chat_params(stop_token_ids=[VOCAB])
    assert err.value.param == "stop_token_ids"
    assert _chat_params(logit_bias={str(VOCAB - 1): 1}).logit_bias == ((VOCAB - 1, 1.0),)
    with pytest.raises(BadRequestError) as err:
        _chat_params(logit_bias={str(VOCAB): 1})
    assert err.value.param == "logit_bias"


def test_a_prompt_that_fills_the_context_is_refused() -> None:
    from router.errors import BadRequestError

    with pytest.raises(BadRequestError) as err:
        _chat_params(num_prompt=1000)
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
