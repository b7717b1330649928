"""A list of prompts on /v1/completions (OpenAI's batch form), end to end through the service:
each prompt routed on its own text, the answers merged (router/openai/batch.py), checked against
the same prompts sent one at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, start_server

# Scores of the shipped classifier: 0.12 (under the 0.2 threshold below: small) and 0.37 (medium).
EASY = "Write a short poem about the sea."
HARD = (
    "Prove that there are infinitely many primes of the form 4k+3, and compute the sum of the first 20 "
    "such primes."
)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    policy = tiny_policy_yaml(tiny_model_dir, cache_enabled=False, service_extra="  limits: {max_prompts: 3}")
    path = tmp_path_factory.mktemp("batch") / "policy.yaml"
    path.write_text(policy.replace("score_below: 0.35", "score_below: 0.2"))
    srv, stop = start_server(path)
    yield srv
    stop()


def _post(server: Server, **body: Any) -> httpx.Response:
    payload = {"model": "auto", "max_tokens": 5, "temperature": 0, **body}
    return httpx.post(server.url + "/v1/completions", json=payload, timeout=120)


def _events(response: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for line in response.text.split("\n\n"):
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_each_prompt_is_routed_on_its_own_and_answered_as_if_sent_alone(server: Server) -> None:
    """Bugs it catches: the batch routed on one prompt's score (one tier for all), choices indexed
    per prompt (0, 1, 0, 1) instead of OpenAI's i * n + j, usage of one prompt only, or one
    prompt's answer given for another."""
    alone = [_post(server, prompt=p, n=2) for p in (EASY, HARD)]
    for r in alone:
        assert r.status_code == 200, r.text
    assert [r.headers["x-router-tier"] for r in alone] == ["small", "medium"]
    batch = _post(server, prompt=[EASY, HARD], n=2)
    assert batch.status_code == 200, batch.text
    assert batch.headers["x-router-tier"] == "small, medium"
    assert batch.headers["x-router-rule"] == "score-small, score-medium"
    assert len(batch.headers["x-router-response-id"].split(", ")) == 2
    body = batch.json()
    assert body["object"] == "text_completion" and body["model"] == "auto"  # tiers differ
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    expected = [c["text"] for r in alone for c in r.json()["choices"]]
    assert [c["text"] for c in body["choices"]] == expected
    usage = [r.json()["usage"] for r in alone]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert body["usage"][key] == usage[0][key] + usage[1][key]
    server.wait_idle()


def test_a_streamed_batch_interleaves_prompts_and_ends_once_with_the_summed_usage(server: Server) -> None:
    """Bugs it catches: a [DONE] (or usage chunk) per prompt reaching the client, which would stop
    reading after the first prompt; chunks keeping their prompt's own choice index or id."""
    plain = _post(server, prompt=[EASY, HARD], n=2).json()
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={
            "model": "auto",
            "prompt": [EASY, HARD],
            "n": 2,
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=120,
    ) as response:
        response.read()
    events = _events(response)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    usage = [e for e in events[:-1] if not e["choices"]]
    assert len(usage) == 1 and usage[0] is events[-2]  # one usage chunk, last
    assert usage[0]["usage"] == plain["usage"]
    assert len({e["id"] for e in events[:-1]}) == 1
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for e in chunks:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finished[c["index"]] = c["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in plain["choices"]}
    assert finished == {c["index"]: c["finish_reason"] for c in plain["choices"]}
    server.wait_idle()


def test_one_refused_prompt_refuses_the_batch_and_leaves_no_work_behind(server: Server) -> None:
    """Bugs it catches: a 200 with the refused prompt's choices missing, or the other prompts'
    engine requests left running after the refusal."""
    too_long = "word " * 400  # over the tiny tiers' 256-token context
    r = _post(server, prompt=[EASY, too_long, HARD], max_tokens=16)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("prompt", "max_tokens")
    server.wait_idle()
    over = _post(server, prompt=[EASY] * 4)
    assert over.status_code == 400
    error = over.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "limit_exceeded") and "max_prompts" in error[
        "message"
    ]
    empty = _post(server, prompt=[])
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"


def test_a_client_leaving_a_streamed_batch_frees_every_prompts_work(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug it catches: the merged stream closed but a prompt's own stream left open, so its engine
    request decodes for nobody (to its end, never aborted) and its in-flight slot is held."""
    aborted: list[int] = []
    for engine in server.service.tiers.engines():

        def abort(seq: Any, _original: Any = engine.abort) -> None:
            aborted.append(seq.seq_id)
            _original(seq)

        monkeypatch.setattr(engine, "abort", abort)
    body = {"model": "auto", "prompt": [EASY, HARD, EASY + " dog"], "max_tokens": 200, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break  # leave mid-answer: the context manager closes the connection
    server.wait_idle(timeout=30)
    assert len(set(aborted)) == 3  # each prompt's engine request was aborted, none ran to its end
