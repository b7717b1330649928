"""Request validation (router/openai/validation.py) at every bound: each range accepts both of its
ends and refuses the first value past each, with a 400 naming the field; falsy values inside the
range (0, 0.0, ``false``, empty lists) are accepted. The bounds are OpenAI's API reference's
(temperature [0, 2], top_p (0, 1], penalties [-2, 2], logit_bias [-100, 100], n, top_logprobs
[0, 20], metadata 16 x 64 / 512) and vLLM's for its extensions, written out here, not read from
the module's constants."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.errors import BadRequestError
from router.openai.schemas import ChatCompletionRequest, CompletionRequest
from router.openai.validation import validate_chat, validate_completion

MSG = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> ChatCompletionRequest:
    return msgspec.convert({"model": "small", "messages": MSG, **fields}, ChatCompletionRequest)


def _completion(**fields: Any) -> CompletionRequest:
    return msgspec.convert({"model": "small", "prompt": "hi", **fields}, CompletionRequest)


def _refused(req: ChatCompletionRequest | CompletionRequest) -> BadRequestError:
    check = validate_chat if isinstance(req, ChatCompletionRequest) else validate_completion
    with pytest.raises(BadRequestError) as err:
        check(req)  # type: ignore[arg-type]
    assert err.value.status_code == 400
    return err.value


def _accepted(req: ChatCompletionRequest | CompletionRequest) -> None:
    if isinstance(req, ChatCompletionRequest):
        validate_chat(req)
    else:
        validate_completion(req)


# (field, accepted values at and inside the bounds, refused values just past them, param named)
SAMPLING_BOUNDS: list[tuple[str, list[Any], list[Any], str]] = [
    ("temperature", [0.0, 0, 2.0, 1.0], [-0.001, 2.001, float("inf"), float("nan")], "temperature"),
    ("top_p", [1.0, 0.001], [0.0, 1.001, -0.5], "top_p"),
    ("presence_penalty", [-2.0, 0.0, 2.0], [-2.001, 2.001], "presence_penalty"),
    ("frequency_penalty", [-2.0, 0.0, 2.0], [-2.001, 2.001], "frequency_penalty"),
    ("repetition_penalty", [0.01, 1.0, 10.0], [0.0, 10.01], "repetition_penalty"),
    ("min_p", [0.0, 1.0], [-0.01, 1.01], "min_p"),
    ("n", [1, 16], [0, 17], "n"),
    ("top_k", [0, -0, 1, 50], [-1], "top_k"),
    ("seed", [0, -(2**63), 2**63 - 1], [2**63, -(2**63) - 1], "seed"),
    ("max_tokens", [1, 2**31 - 1], [0, 2**31, -1], "max_tokens"),
    ("stop_token_ids", [[], [0], list(range(1024))], [[-1], list(range(1025))], "stop_token_ids"),
    ("min_tokens", [0, 5], [-1], "min_tokens"),
    ("user", ["", "u" * 256], ["u" * 257], "user"),
    ("stop", [[], "x" * 256, ["a"] * 16], [["a"] * 17, "x" * 257, ["ok", "y" * 257]], "stop"),
]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    ("field", "ok", "bad", "param"), SAMPLING_BOUNDS, ids=[b[0] for b in SAMPLING_BOUNDS]
)
def test_each_sampling_bound_accepts_its_ends_and_refuses_one_past(
    kind: str, field: str, ok: list[Any], bad: list[Any], param: str
) -> None:
    """Bugs it catches: ``<`` for ``<=`` (an end refused: a valid request refused), a bound moved
    by one, a check dropped (a value past it reaching the engine)."""
    make = _chat if kind == "chat" else _completion
    for value in ok:
        _accepted(make(**{field: value}))
    for value in bad:
        err = _refused(make(**{field: value}))
        assert err.param == param, (field, value, err.param)
        assert field.split("_", maxsplit=1)[0] in err.message


def test_max_completion_tokens_has_the_same_bounds_as_max_tokens() -> None:
    for value in (1, 2**31 - 1):
        _accepted(_chat(max_completion_tokens=value))
    for value in (0, 2**31):
        assert _refused(_chat(max_completion_tokens=value)).param == "max_completion_tokens"


def test_logit_bias_keys_are_ascii_token_ids_of_at_most_ten_digits_and_values_in_range() -> None:
    """Bugs it catches: a unicode digit (``"²"``) passing ``isdigit`` and crashing ``int()``, an
    11-digit id accepted, ``-100`` or ``100`` refused."""
    _accepted(_chat(logit_bias={"0": -100.0, "9999999999": 100.0, "42": 0.0}))
    _accepted(_chat(logit_bias={}))
    for key in ("²", "12345678901", "-1", "a", " 1", ""):
        assert _refused(_chat(logit_bias={key: 1.0})).param == "logit_bias", key
    for value in (-100.5, 100.5, float("inf")):
        assert _refused(_chat(logit_bias={"1": value})).param == "logit_bias", value


def test_min_tokens_may_equal_the_token_limit_but_not_exceed_it() -> None:
    """Bug it catches: ``>=`` for ``>`` - ``min_tokens == max_tokens`` (a fixed-length answer, as
    benchmark clients ask) refused; and chat's ``max_completion_tokens`` is the limit it meets."""
    _accepted(_chat(min_tokens=8, max_tokens=8))
    _accepted(_completion(min_tokens=8, max_tokens=8))
    assert _refused(_completion(min_tokens=9, max_tokens=8)).param == "min_tokens"
    _accepted(_chat(min_tokens=8, max_tokens=4, max_completion_tokens=8))
    assert _refused(_chat(min_tokens=8, max_tokens=16, max_completion_tokens=4)).param == "min_tokens"
    _accepted(_chat(min_tokens=0, max_tokens=1))


def test_stream_options_need_stream_and_obfuscation_is_refused() -> None:
    _accepted(_chat(stream=True, stream_options={"include_usage": True}))
    _accepted(_chat(stream=True, stream_options={"include_usage": False, "include_obfuscation": False}))
    assert _refused(_chat(stream_options={"include_usage": True})).param == "stream_options"
    assert _refused(_chat(stream=False, stream_options={})).param == "stream_options"
    err = _refused(_chat(stream=True, stream_options={"include_obfuscation": True}))
    assert err.param == "stream_options.include_obfuscation" and err.code == "unsupported_value"


def test_skip_special_tokens_false_is_refused_and_true_is_accepted() -> None:
    _accepted(_chat(skip_special_tokens=True))
    assert _refused(_chat(skip_special_tokens=False)).param == "skip_special_tokens"


def test_metadata_bounds_name_the_offending_value() -> None:
    """OpenAI's documented bounds: 16 pairs, keys of at most 64 characters, values of 512."""
    _accepted(_chat(metadata={f"k{i}": "v" for i in range(16)}))
    _accepted(_chat(metadata={"k" * 64: "v" * 512}))
    _accepted(_chat(metadata={}))
    assert _refused(_chat(metadata={f"k{i}": "v" for i in range(17)})).param == "metadata"
    assert _refused(_chat(metadata={"k" * 65: "v"})).param == "metadata"
    assert _refused(_chat(metadata={"tag": "v" * 513})).param == "metadata.tag"


def test_chat_identifiers_are_bounded_and_name_their_field() -> None:
    for field in ("safety_identifier", "prompt_cache_key"):
        _accepted(_chat(**{field: "i" * 256}))
        assert _refused(_chat(**{field: "i" * 257})).param == field
    named = [
        {"role": "user", "content": "a", "name": "n" * 256},
        {"role": "user", "content": "b", "name": "n" * 257},
    ]
    assert _refused(_chat(messages=named)).param == "messages[1].name"


def test_continue_final_message_needs_the_assistants_last_turn_and_no_generation_prompt() -> None:
    turns = [*MSG, {"role": "assistant", "content": "The answer is"}]
    _accepted(_chat(messages=turns, continue_final_message=True, add_generation_prompt=False))
    err = _refused(_chat(messages=turns, continue_final_message=True, add_generation_prompt=True))
    assert err.param == "continue_final_message"
    assert (
        _refused(_chat(continue_final_message=True, add_generation_prompt=False)).param
        == "continue_final_message"
    )
    _accepted(_chat(messages=turns, continue_final_message=False))


def test_chat_template_kwargs_name_template_variables_only() -> None:
    _accepted(_chat(chat_template_kwargs={"enable_thinking": False, "date": "today"}))
    for name in ("tools", "tokenize", "add_generation_prompt", "not-an-identifier", "1x"):
        assert _refused(_chat(chat_template_kwargs={name: 1})).param == "chat_template_kwargs", name


def test_top_logprobs_range_and_its_need_for_logprobs() -> None:
    """Bugs it catches: ``top_logprobs: 0`` with ``logprobs: true`` refused (a falsy value taken
    for a missing one), 20 refused, 21 accepted, ``top_logprobs`` accepted without ``logprobs``."""
    _accepted(_chat(logprobs=True, top_logprobs=0))
    _accepted(_chat(logprobs=True, top_logprobs=20))
    assert _refused(_chat(logprobs=True, top_logprobs=21)).param == "top_logprobs"
    assert _refused(_chat(logprobs=True, top_logprobs=-1)).param == "top_logprobs"
    assert _refused(_chat(logprobs=False, top_logprobs=2)).param == "top_logprobs"
    assert _refused(_chat(top_logprobs=2)).param == "top_logprobs"


def test_response_format_types_and_a_json_schema_without_its_schema() -> None:
    for rf in (
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}},
    ):
        _accepted(_chat(response_format=rf))
    assert _refused(_chat(response_format={"type": "xml"})).param == "response_format.type"
    assert _refused(_chat(response_format={"type": "json_schema"})).param == "response_format.json_schema"
    err = _refused(_chat(response_format={"type": "json_schema", "json_schema": {"name": "a"}}))
    assert err.param == "response_format.json_schema.schema"


UNSUPPORTED_CHAT: list[tuple[dict[str, Any], str]] = [
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "x", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"store": True}, "store"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ({"prompt_cache_options": {"mode": "explicit"}}, "prompt_cache_options"),
]


@pytest.mark.parametrize(("fields", "param"), UNSUPPORTED_CHAT, ids=[p for _, p in UNSUPPORTED_CHAT])
def test_each_unsupported_chat_field_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    err = _refused(_chat(**fields))
    assert err.param == param and err.code == "unsupported_value"


def test_the_accepted_values_of_the_fields_that_have_unsupported_ones() -> None:
    """A valid request refused is a bug too: each field's supported values pass."""
    _accepted(
        _chat(
            modalities=["text"],
            reasoning_effort="none",
            service_tier="auto",
            store=False,
            prompt_cache_retention="in_memory",
            prompt_cache_options={"mode": "implicit"},
        )
    )
    _accepted(_chat(service_tier="default"))


def test_content_parts_other_than_text_are_refused_except_an_assistants_refusal() -> None:
    text = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]}]
    _accepted(_chat(messages=text))
    refusal = [*MSG, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]
    _accepted(_chat(messages=refusal))
    image = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}],
        }
    ]
    assert _refused(_chat(messages=image)).param == "messages[0].content[1].type"
    user_refusal = [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]
    assert _refused(_chat(messages=user_refusal)).param == "messages[0].content[0].type"


def test_completion_logprobs_best_of_echo_and_suffix() -> None:
    """Bugs it catches: ``logprobs: 0`` refused, ``best_of == n`` refused, a streamed ``best_of > n``
    accepted, echo with logprobs over several choices accepted."""
    _accepted(_completion(logprobs=0))
    _accepted(_completion(logprobs=20))
    assert _refused(_completion(logprobs=21)).param == "logprobs"
    assert _refused(_completion(logprobs=-1)).param == "logprobs"
    _accepted(_completion(n=2, best_of=2))
    _accepted(_completion(n=1, best_of=16))
    assert _refused(_completion(n=3, best_of=2)).param == "best_of"
    assert _refused(_completion(best_of=17)).param == "best_of"
    _accepted(_completion(stream=True, n=2, best_of=2))
    assert _refused(_completion(stream=True, n=1, best_of=2)).param == "best_of"
    _accepted(_completion(suffix=""))
    assert _refused(_completion(suffix="tail")).param == "suffix"
    _accepted(_completion(echo=True, logprobs=1))
    assert _refused(_completion(echo=True, logprobs=1, n=2)).param == "echo"
    assert _refused(_completion(echo=True, logprobs=0, n=1, best_of=2)).param == "echo"
    _accepted(_completion(echo=True, n=2))
