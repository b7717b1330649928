"""``RouterService.generate`` (router/pipeline/service.py) through a running service on the tiny
tiers with the response cache on: every routed answer carries its tier, rule, score and response
id; a header rule and a model alias pick their tier; the cache answers a repeat with the same
text and ``hit`` and is bypassed by ``Cache-Control: no-cache``; a stream replays from the cache
like a live one; ``max_tokens`` past the tier's window is a 400 naming it; nothing stays in
flight afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, start_server

STOPS = [" ", "e", "a", "o"]


@pytest.fixture(scope="module")
def cached(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("policy") / "policy.yaml"
    path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=True))
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()


def _chat(
    srv: Server, content: str, headers: dict[str, str] | None = None, **fields: object
) -> httpx.Response:
    body = {
        "model": fields.pop("model", "auto"),
        "messages": [{"role": "user", "content": content}],
        **fields,
    }
    return httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=120)


def test_a_routed_answer_names_its_tier_rule_score_and_id(cached: Server) -> None:
    r = _chat(cached, "Name a colour.", max_tokens=4)
    assert r.status_code == 200, r.text
    h = r.headers
    assert h["x-router-tier"] in ("small", "medium", "large")
    assert h["x-router-rule"].startswith("score-")
    assert 0.0 <= float(h["x-router-score"]) <= 1.0 and len(h["x-router-score"].split(".")[1]) == 4
    assert h["x-router-response-id"].startswith("chatcmpl-")
    assert h["x-router-cache"] == "miss"
    usage = r.json()["usage"]
    assert (
        usage["completion_tokens"] <= 4
        and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    )
    cached.wait_idle()
    assert cached.service.in_flight == 0


def test_a_header_rule_and_an_alias_pick_their_tier(cached: Server) -> None:
    """Bugs it catches: request headers not handed to the policy (the priority rule never fires),
    an alias not resolved before the tier lookup."""
    high = _chat(cached, "hello there", {"x-priority": "high"}, max_tokens=2)
    assert (high.headers["x-router-tier"], high.headers["x-router-rule"]) == ("large", "priority-header")
    alias = _chat(cached, "hello there", model="fast", max_tokens=2)
    assert alias.status_code == 200 and alias.headers["x-router-tier"] == "small"


def test_a_repeat_is_answered_by_the_cache_unless_the_caller_says_no_cache(cached: Server) -> None:
    """Bugs it catches: the cache consulted but its answer not returned (every repeat generated),
    or ``no-cache`` ignored."""
    prompt = "Repeat after me: the cache works."
    # Only complete answers are cached; common stop strings end the tiny model's answers early.
    complete = {"max_tokens": 40, "temperature": 0, "stop": STOPS}
    first = _chat(cached, prompt, **complete)
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    again = _chat(cached, prompt, **complete)
    assert first.headers["x-router-cache"] == "miss"
    assert again.headers["x-router-cache"] == "hit" and again.headers["x-router-cache-kind"] == "exact"
    text = first.json()["choices"][0]["message"]["content"]
    assert again.json()["choices"][0]["message"]["content"] == text
    assert again.headers["x-router-tier"] == first.headers["x-router-tier"]
    bypass = _chat(cached, prompt, {"cache-control": "no-cache"}, **complete)
    assert bypass.headers["x-router-cache"] == "miss"
    assert bypass.json()["choices"][0]["message"]["content"] == text  # greedy: the same answer
    streamed = httpx.post(
        cached.url + "/v1/chat/completions",
        json={"model": "auto", "messages": [{"role": "user", "content": prompt}], **complete, "stream": True},
        timeout=120,
    )
    assert streamed.headers["x-router-cache"] == "hit"
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == text
    assert streamed.text.rstrip().endswith("data: [DONE]")
    cached.wait_idle()


def test_max_tokens_past_the_tiers_window_is_refused_by_name(cached: Server) -> None:
    r = _chat(cached, "hi", model="small", max_tokens=257)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    ok = _chat(cached, "hi", model="small", max_tokens=256)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    cached.wait_idle()
    assert cached.service.in_flight == 0
