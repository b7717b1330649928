"""Completions ``echo`` with ``logprobs`` through the service, in lm-evaluation-harness's own
request shape (its loglikelihood tasks: a list of prompts, ``max_tokens: 1``, ``logprobs: 1``,
``echo: true``), checked against the Hugging Face model's forward over the same tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import torch

from tests.router.conftest import Server

CONTEXT = "Question: what colour is the sky on a clear day?\nAnswer:"
CONTINUATION = " blue"


def _reference(model_dir: Path, ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(lp[p - 1, ids[p]]) for p in range(1, len(ids))]


def _post(server: Server, **body: Any) -> httpx.Response:
    payload = {"model": "large", "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True, "seed": 1234}
    return httpx.post(server.url + "/v1/completions", json={**payload, **body}, timeout=120)


def test_lm_eval_loglikelihood_request_gets_every_prompt_tokens_logprob(
    server: Server, tiny_model_dir: Path
) -> None:
    """Bugs it catches: echo with logprobs refused (every lm-eval loglikelihood task fails), the
    prompt's logprobs missing or shifted by one token, the continuation's sum (what lm-eval
    compares between answers) wrong, or the prompts of a batch scored against each other."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [CONTEXT + CONTINUATION, CONTEXT + " green"]
    r = _post(server, prompt=prompts)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for prompt, choice in zip(prompts, choices, strict=True):
        ids = tokenizer.encode(prompt)
        lp = choice["logprobs"]
        assert choice["text"].startswith(prompt)
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert "".join(lp["tokens"][: len(ids)]) == prompt
        assert lp["text_offset"][: len(ids)] == sorted(lp["text_offset"][: len(ids)])
        want = _reference(tiny_model_dir, ids)
        got = lp["token_logprobs"][1 : len(ids)]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3
        # lm-eval's greedy check reads the top alternative at each continuation position.
        for top, token, value in zip(
            lp["top_logprobs"][1:], lp["tokens"][1:], lp["token_logprobs"][1:], strict=True
        ):
            ((best, best_value),) = top.items()
            assert best_value >= value - 1e-6 and (best != token or abs(best_value - value) < 1e-6)


def test_a_streamed_echo_carries_the_prompts_logprobs_once(server: Server) -> None:
    plain = _post(server, prompt=CONTEXT, max_tokens=3).json()["choices"][0]
    r = _post(server, prompt=CONTEXT, max_tokens=3, stream=True)
    chunks = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    tokens: list[str] = []
    values: list[float | None] = []
    for c in chunks:
        lp = c["choices"][0]["logprobs"] if c["choices"] else None
        if lp:
            tokens += lp["tokens"]
            values += lp["token_logprobs"]
    assert text == plain["text"]
    assert tokens == plain["logprobs"]["tokens"] and values == plain["logprobs"]["token_logprobs"]


def test_echo_with_logprobs_and_several_choices_is_refused_by_name(server: Server) -> None:
    r = _post(server, prompt=CONTEXT, n=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_token_id_prompts_are_generated_from_exactly_those_ids(server: Server, tiny_model_dir: Path) -> None:
    """lm-evaluation-harness's default (``tokenized_requests``) sends token ids, one list per
    prompt. Bugs it catches: ids refused, re-tokenized from their decoded text (a different split
    scores other tokens), or a batch of id lists read as one prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = [tokenizer.encode(CONTEXT + CONTINUATION), tokenizer.encode(CONTEXT + " green")]
    # The same text split into single characters: other token ids, the same decoded prompt.
    odd = tokenizer.encode(CONTEXT) + [t for ch in CONTINUATION for t in tokenizer.encode(ch)]
    assert tokenizer.decode(odd) == tokenizer.decode(ids[0]) and odd != ids[0]
    by_text = _post(server, prompt=[CONTEXT + CONTINUATION, CONTEXT + " green"]).json()["choices"]
    by_ids = _post(server, prompt=ids).json()["choices"]
    assert [c["logprobs"]["token_logprobs"] for c in by_ids] == [
        c["logprobs"]["token_logprobs"] for c in by_text
    ]
    assert [c["text"] for c in by_ids] == [c["text"] for c in by_text]
    split = _post(server, prompt=odd).json()["choices"][0]["logprobs"]
    assert len(split["tokens"]) == len(odd) + 1  # scored as sent, not as its text would tokenize
    assert split["token_logprobs"][1 : len(odd)] != by_ids[0]["logprobs"]["token_logprobs"][1 : len(odd)]
    single = _post(server, prompt=ids[0], echo=False, logprobs=None, max_tokens=4)
    assert single.status_code == 200 and single.json()["usage"]["prompt_tokens"] == len(ids[0])
    for bad in ([[1, 2], "text"], [1, -2], [[]], [10**9]):
        r = _post(server, prompt=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (bad, r.text)
