"""Shadow answers and feedback (router/pipeline/shadow.py, feedback.py), end to end on tiny models."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from classifier.validation.outcomes import load_outcomes
from router.pipeline.shadow import ShadowRecorder
from router.policy.loader import parse_policy
from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, start_server

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def shadow_server(tiny_model_dir: Path, logs: Path) -> Iterator[Server]:
    policy = yaml.safe_load(tiny_policy_yaml(tiny_model_dir, cache_enabled=False))
    policy["shadow"] = {
        "enabled": True,
        "sample": 1.0,
        "rules": ["score-small"],
        "max_tokens": 8,
        "log_path": str(logs / "shadow.jsonl"),
        "record_content": True,
    }
    service = policy.setdefault("service", {})
    service["feedback"] = {"log_path": str(logs / "feedback.jsonl")}
    service.setdefault("telemetry", {})["record_content"] = True
    path = logs / "policy.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))  # tier order is meaningful
    srv, stop = start_server(path)
    yield srv
    stop()


def _lines(path: Path, n: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if len(rows) >= n:
                return rows
        time.sleep(0.05)
    raise AssertionError(f"{path} did not get {n} lines")


def _chat(server: Server, messages: list[dict[str, str]], model: str = "auto") -> httpx.Response:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 6, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r


def test_shadow_logs_both_answers_without_touching_the_users(shadow_server: Server, logs: Path) -> None:
    served = _chat(shadow_server, HI)
    assert served.headers["x-router-tier"] == "small" and served.headers["x-router-rule"] == "score-small"
    (row,) = _lines(logs / "shadow.jsonl", 1)
    assert row["id"] == served.headers["x-router-response-id"]
    assert row["served"] == "small" and row["shadow"]["tier"] == "medium"  # the tier above by default
    assert row["prompt"] == "hi" and row["outcomes"] == {}
    answer = served.json()["choices"][0]["message"]["content"]
    assert row["answers"]["small"] == answer
    assert isinstance(row["answers"]["medium"], str) and row["shadow"]["completion_tokens"] <= 8
    # The user's answer is what the small tier says with shadowing out of the picture.
    alone = _chat(shadow_server, HI, model="small")
    assert alone.json()["choices"][0]["message"]["content"] == answer
    metrics = httpx.get(shadow_server.url + "/metrics", timeout=10).text
    assert 'router_shadow_requests_total{result="recorded",tier="medium"}' in metrics


def test_only_the_sampled_rules_are_shadowed(shadow_server: Server, logs: Path) -> None:
    before = len(_lines(logs / "shadow.jsonl", 1))
    hard = [{"role": "user", "content": "x"}]
    r = httpx.post(
        shadow_server.url + "/v1/chat/completions",
        json={"model": "auto", "messages": hard, "max_tokens": 2},
        headers={"x-priority": "high"},  # rule priority-header, not score-small
        timeout=60,
    )
    assert r.headers["x-router-rule"] == "priority-header"
    time.sleep(0.5)
    assert len(_lines(logs / "shadow.jsonl", before)) == before


def test_feedback_end_to_end_and_into_training(shadow_server: Server, logs: Path, tmp_path: Path) -> None:
    served = _chat(shadow_server, [{"role": "user", "content": "thanks a lot!"}])
    rid = served.headers["x-router-response-id"]
    ok = httpx.post(shadow_server.url + "/v1/feedback", json={"id": rid, "thumbs": "down"}, timeout=10)
    assert ok.status_code == 200 and ok.json() == {"id": rid, "recorded": True, "tier": "small", "score": 0.0}
    again = httpx.post(shadow_server.url + "/v1/feedback", json={"id": rid, "score": 0.25}, timeout=10)
    assert again.status_code == 200 and again.json()["score"] == 0.25
    feedback = [r for r in _lines(logs / "feedback.jsonl", 2) if r["id"] == rid]
    assert [r["outcomes"] for r in feedback] == [{"small": 0.0}, {"small": 0.25}]
    assert feedback[0]["prompt"] == "thanks a lot!"
    # A judge scores the shadow answer; shadow + feedback then make one weak/strong outcome row.
    shadow = next(r for r in _lines(logs / "shadow.jsonl", 2) if r["id"] == rid)
    judged = tmp_path / "judged.jsonl"
    judged.write_text(json.dumps(dict(shadow, outcomes={"medium": 1.0})) + "\n")
    (row,) = load_outcomes([judged, logs / "feedback.jsonl"])
    assert (row["prompt"], row["weak"], row["strong"]) == ("thanks a lot!", 0.25, 1.0)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"id": "chatcmpl-nope", "score": 1}, 404, "unknown_response_id"),
        ({"id": "x", "score": 1, "thumbs": "up"}, 400, None),
        ({"id": "x"}, 400, None),
        ({"id": "x", "score": 1.5}, 400, None),
        ({"id": "x", "thumbs": "sideways"}, 400, None),
    ],
)
def test_feedback_errors(shadow_server: Server, body: dict[str, Any], status: int, code: str | None) -> None:
    r = httpx.post(shadow_server.url + "/v1/feedback", json=body, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code


@dataclass
class Load:
    num_running: int = 0
    num_waiting: int = 0
    max_num_seqs: int = 8
    is_full: bool = False


POLICY = parse_policy(
    "tiers: {small: {model: m}, medium: {model: m}, large: {model: m}}\n"
    "routing: {rules: [{name: d, tier: small}]}\n"
    "shadow: {enabled: true, sample: 1.0, max_concurrent: 1, max_busy_fraction: 0.5}\n"
)


def test_admission_takes_idle_capacity_only() -> None:
    rec, cfg = ShadowRecorder(), POLICY.shadow
    assert rec.admit(cfg, "medium", Load(num_running=4))  # half the slots busy: still idle enough
    assert not rec.admit(cfg, "medium", Load(num_running=5))
    assert not rec.admit(cfg, "medium", Load(num_waiting=1))  # anyone waiting: never
    assert not rec.admit(cfg, "medium", Load(is_full=True))
    rec._running = 1  # max_concurrent reached
    assert not rec.admit(cfg, "medium", Load())
    assert rec.requests.labels("medium", "skipped_busy")._value.get() == 3
    assert rec.requests.labels("medium", "skipped_concurrency")._value.get() == 1


def test_sampling_and_targets() -> None:
    from router.policy.decide import Decision

    rec = ShadowRecorder()
    assert rec.target(POLICY, Decision("small", "d", "", 0.1), None) == "medium"
    assert rec.target(POLICY, Decision("large", "d", "", 0.9), None) is None  # nothing above large
    assert rec.target(POLICY, Decision("small", "d", "", 0.1, rejected=True), None) is None
    half = parse_policy(
        "tiers: {small: {model: m}, large: {model: m}}\nrouting: {rules: [{name: d, tier: small}]}\n"
        "shadow: {enabled: true, sample: 0.25, tier: large}\n"
    )
    import random

    rec = ShadowRecorder(rng=random.Random(1))
    hits = sum(rec.target(half, Decision("small", "d", "", 0.1), None) == "large" for _ in range(4000))
    assert 850 < hits < 1150


def test_a_real_request_preempts_running_shadow_answers(tmp_path: Path) -> None:
    import asyncio

    from tiers.core.output import StepOutput

    closed: list[bool] = []

    async def slow() -> Any:
        try:
            yield StepOutput("a", [1])
            await asyncio.sleep(30)  # a long shadow answer
            yield StepOutput("b", [2], finish_reason="stop")
        finally:
            closed.append(True)  # the engine request is aborted when its stream closes

    async def scenario() -> tuple[int, ShadowRecorder]:
        rec = ShadowRecorder()
        cfg = parse_policy(
            "tiers: {small: {model: m}, medium: {model: m}}\nrouting: {rules: [{name: d, tier: small}]}\n"
            f"shadow: {{enabled: true, sample: 1.0, log_path: {tmp_path / 's.jsonl'}}}\n"
        ).shadow
        assert rec.launch(cfg, "medium", Load(), slow, {"id": "r"}, record_content=False)
        await asyncio.sleep(0.05)
        n = rec.preempt()
        await rec.drain(1.0)
        return n, rec

    n, rec = asyncio.run(scenario())
    assert n == 1 and closed == [True]
    assert rec.requests.labels("medium", "preempted")._value.get() == 1
    assert rec.requests.labels("medium", "recorded")._value.get() == 0
    assert rec.in_flight._value.get() == 0 and not (tmp_path / "s.jsonl").exists()


def test_a_shadow_of_an_n_choice_answer_generates_one_choice(
    shadow_server: Server, logs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: the shadow request was given n=1 but kept the served request's output spec, so
    n sequences were submitted to the shadow tier and only the first was ever read (the other
    n-1 ran to their end, unaborted)."""
    engine = shadow_server.engine("medium")
    sizes: list[int] = []
    submit_n = engine.submit_n

    def many(ids: Any, params: Any, **kw: Any) -> Any:  # Engine.submit goes through it too
        sizes.append(len(params))
        return submit_n(ids, params, **kw)

    monkeypatch.setattr(engine, "submit_n", many)
    shadow_log = logs / "shadow.jsonl"
    before = len(shadow_log.read_text().splitlines()) if shadow_log.is_file() else 0
    r = httpx.post(
        shadow_server.url + "/v1/chat/completions",
        json={"model": "auto", "messages": HI, "max_tokens": 4, "n": 3, "temperature": 0.5},
        timeout=60,
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert r.headers["x-router-tier"] == "small"
    _lines(shadow_log, before + 1)
    assert sizes == [1]
    shadow_server.wait_idle()
