"""vLLM's request extensions, as vLLM's OpenAI server accepts them: each honoured (and shown by its
effect against a reference request without it) or refused with a 400 naming it; ``GET /health``;
guidellm's exact request shape."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx
import pytest

from router.openai.schemas import VLLM_EXTENSIONS
from tests.router.conftest import Server

PROMPT = [{"role": "user", "content": "Write a haiku about the sea."}]


def _chat(server: Server, **body: Any) -> httpx.Response:
    payload = {"model": "small", "messages": PROMPT, "temperature": 0, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=60)


def _sse(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_on_every_chunk(server: Server, path: str) -> None:
    """Bug caught: guidellm's ``continuous_usage_stats`` refused as an unknown field (every one of
    its requests was a 400), or accepted but ignored (no usage until the last chunk)."""
    body: dict[str, Any] = {
        "model": "small",
        "max_tokens": 6,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    body["messages" if path.endswith("chat/completions") else "prompt"] = (
        PROMPT if path.endswith("chat/completions") else "Write a haiku"
    )
    chunks = _sse(httpx.post(server.url + path, json=body, timeout=60))
    assert all("usage" in c and c["usage"] is not None for c in chunks), chunks
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 6  # ignore_eos: exactly max_tokens
    assert len({c["usage"]["prompt_tokens"] for c in chunks}) == 1
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + 6
    plain = _sse(
        httpx.post(server.url + path, json={**body, "stream_options": {"include_usage": True}}, timeout=60)
    )
    assert [c for c in plain if c.get("usage")] == [plain[-1]]  # without it: usage on the last chunk only


def test_stop_token_ids_end_the_answer(server: Server) -> None:
    """Bug caught: ``stop_token_ids`` accepted but not passed to the engine. With every token but
    the end-of-sequence one a stop id, the answer ends at its first token (whose text is not
    returned); the reference without them runs to ``max_tokens``."""
    tokenizer = server.service.tiers.get("small").tokenizer
    every = [i for i in range(len(tokenizer)) if i != tokenizer.eos_token_id]
    ref = _chat(server, max_tokens=5, ignore_eos=True).json()
    assert ref["usage"]["completion_tokens"] == 5 and ref["choices"][0]["finish_reason"] == "length"
    stopped = _chat(server, max_tokens=5, ignore_eos=True, stop_token_ids=every).json()
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["message"]["content"] == ""
    too_big = _chat(server, max_tokens=2, stop_token_ids=[len(tokenizer) + 5])
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "stop_token_ids"


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(server: Server, stream: bool) -> None:
    """Bug caught: the stop string dropped (or kept) regardless of ``include_stop_str_in_output``.
    Reference: the unstopped greedy answer, cut before (default) or after (extension) the stop."""
    full = _chat(server, max_tokens=16, ignore_eos=True).json()["choices"][0]["message"]["content"]
    at = next(
        (k for k in range(1, len(full) - 1) if full[k : k + 2].strip() and full.find(full[k : k + 2]) == k),
        None,
    )
    assert at is not None, f"no usable stop string in {full!r}"
    stop = full[at : at + 2]

    def text(**extra: Any) -> str:
        r = _chat(server, max_tokens=16, ignore_eos=True, stop=[stop], stream=stream, **extra)
        if not stream:
            return str(r.json()["choices"][0]["message"]["content"])
        chunks = _sse(r)
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])

    assert text() == full[:at]
    assert text(include_stop_str_in_output=False) == full[:at]
    assert text(include_stop_str_in_output=True) == full[: at + 2]


def test_ignore_eos_top_k_repetition_penalty(server: Server) -> None:
    """``ignore_eos`` runs to ``max_tokens``; ``top_k: 1`` is greedy at any temperature;
    ``repetition_penalty`` changes a greedy answer's tokens (mechanism: the sampler's penalty)."""
    greedy = _chat(server, max_tokens=12, ignore_eos=True).json()
    assert greedy["usage"]["completion_tokens"] == 12
    top1 = _chat(server, max_tokens=12, ignore_eos=True, temperature=1.0, top_k=1, seed=5).json()
    assert top1["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    penalized = _chat(server, max_tokens=12, ignore_eos=True, repetition_penalty=5.0).json()
    assert penalized["choices"][0]["message"]["content"] != greedy["choices"][0]["message"]["content"]
    assert _chat(server, max_tokens=2, skip_special_tokens=True, min_tokens=0).status_code == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_tokens", 4),
        ("skip_special_tokens", False),
        ("stop_token_ids", [-1]),
        ("repetition_penalty", 0.0),
        ("top_k", -1),
        ("stream_options", {"continuous_usage_stats": True}),  # without stream: true
    ],
)
def test_refused_extensions_name_the_field(server: Server, field: str, value: Any) -> None:
    r = _chat(server, max_tokens=2, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_unknown_fields_are_still_refused(server: Server) -> None:
    """The strict 400 for fields neither OpenAI's nor vLLM's stays (a typo is never ignored)."""
    r = _chat(server, max_tokens=2, ignore_eoss=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eoss"
    nested = _chat(server, max_tokens=2, stream=True, stream_options={"continuous_usage": True})
    assert nested.status_code == 400 and nested.json()["error"]["param"] == "stream_options.continuous_usage"
    assert {"continuous_usage_stats"} & VLLM_EXTENSIONS == set()  # a stream option, not a top-level field


def test_health_is_an_unauthenticated_alias(server: Server) -> None:
    assert (
        httpx.get(server.url + "/health").json()
        == httpx.get(server.url + "/healthz").json()
        == {"status": "ok"}
    )


def test_guidellm_request_shape_is_answered(server: Server) -> None:
    """guidellm's own body (0.8, openai_http backend, streaming text completions and chat): every
    field it sends is accepted and the usage it reads is there."""
    for path, content in (
        ("/v1/completions", {"prompt": "the quick brown fox"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the quick brown fox"}]}),
    ):
        body = {
            "model": "small",
            **content,
            "max_tokens": 8,
            "max_completion_tokens": 8,
            "stop": None,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if path == "/v1/completions":
            body.pop("max_completion_tokens")
        chunks = _sse(httpx.post(server.url + path, json=body, timeout=60))
        assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_chat_template_kwargs_reach_the_tiers_template(server: Server, tiny_model_dir: Any) -> None:
    """Bug caught: ``chat_template_kwargs`` refused as an unknown field (clients of Qwen3 send
    ``enable_thinking``), accepted but never passed to the template, or answered from the cache
    entry of the same messages without it. The tiny model's template writes ``<think>`` when
    ``enable_thinking`` is true; the prompt's length is checked against the tokenizer's own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def expected(**kwargs: Any) -> int:
        ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, **kwargs)
        return len(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    assert expected(enable_thinking=True) > expected()  # the fixture's template uses the variable
    plain = _chat(server, max_tokens=2)
    thinking = _chat(server, max_tokens=2, chat_template_kwargs={"enable_thinking": True})
    off = _chat(server, max_tokens=2, chat_template_kwargs={"enable_thinking": False})
    for r in (plain, thinking, off):
        assert r.status_code == 200, r.text
    assert thinking.json()["usage"]["prompt_tokens"] == expected(enable_thinking=True)
    assert plain.json()["usage"]["prompt_tokens"] == off.json()["usage"]["prompt_tokens"] == expected()
    for name in ("tokenize", "add_generation_prompt", "not an identifier"):
        refused = _chat(server, max_tokens=2, chat_template_kwargs={name: False})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


def test_more_than_four_stop_sequences_are_honoured(server: Server) -> None:
    """Bug caught: OpenAI's cap of 4 applied (vLLM takes any number; lm-evaluation-harness sends a
    task's whole ``until`` list), or only the first four of a longer list matched."""
    full = _chat(server, max_tokens=12, ignore_eos=True).json()["choices"][0]["message"]["content"]
    cut = full[len(full) // 2 :][:3]
    assert cut and cut in full
    stops = [f"never{i}" for i in range(5)] + [cut]  # the one that matches is the sixth
    r = _chat(server, max_tokens=12, ignore_eos=True, stop=stops)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == full[: full.index(cut)]
    too_many = _chat(server, max_tokens=2, stop=[f"s{i}" for i in range(17)])
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "stop"


def test_min_tokens_holds_back_every_ending_until_the_minimum(server: Server, tiny_model_dir: Any) -> None:
    """Bugs caught: ``min_tokens`` refused (genai-perf and other load tools pin the output length
    with it), or honoured for EOS only - a stop token id or a stop string still ending the answer
    early. Each ending is forced by a +100 ``logit_bias`` so that without the minimum it ends at once."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    other = tokenizer.encode(" the")[0]

    def usage(**body: Any) -> tuple[int, str]:
        r = _chat(server, max_tokens=12, **body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]

    assert usage(logit_bias={str(eos): 100})[0] <= 1
    assert usage(logit_bias={str(eos): 100}, min_tokens=5) == (6, "stop")  # five, then the EOS
    assert usage(logit_bias={str(other): 100}, stop_token_ids=[other]) == (1, "stop")
    assert usage(logit_bias={str(other): 100}, stop_token_ids=[other], min_tokens=3) == (4, "stop")
    full = _chat(server, max_tokens=12, ignore_eos=True).json()["choices"][0]["message"]["content"]
    early = full[:2]
    assert usage(ignore_eos=True, stop=[early])[0] <= 2
    assert usage(ignore_eos=True, stop=[early], min_tokens=8)[0] >= 8


def test_the_prompt_can_continue_the_assistants_message(server: Server, tiny_model_dir: Any) -> None:
    """Bugs caught: vLLM's ``continue_final_message`` / ``add_generation_prompt`` refused or
    ignored (a prefilled assistant message answered by a new turn instead of continued). The
    prompt's length is checked against the tokenizer's own rendering of each option."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prefill = [*PROMPT, {"role": "assistant", "content": "Waves roll"}]

    def expected(messages: list[dict[str, str]], **options: Any) -> int:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, **options)
        return len(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    def prompt_tokens(messages: list[dict[str, str]], **body: Any) -> int:
        r = _chat(server, messages=messages, max_tokens=2, **body)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    cont = expected(prefill, continue_final_message=True)
    assert cont < expected(prefill, add_generation_prompt=True)
    assert prompt_tokens(prefill, continue_final_message=True) == cont
    assert prompt_tokens(prefill) == expected(prefill, add_generation_prompt=True)
    assert prompt_tokens(PROMPT, add_generation_prompt=False) == expected(PROMPT, add_generation_prompt=False)
    both = _chat(server, messages=prefill, continue_final_message=True, add_generation_prompt=True)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    user_last = _chat(server, continue_final_message=True)
    assert user_last.status_code == 400 and user_last.json()["error"]["param"] == "continue_final_message"
