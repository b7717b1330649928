"""Admission by predicted wait through HTTP: a tier that would make a request wait past its budget
(the tier's ``max_queue_wait_s`` or the client's ``x-request-timeout``) hands it to the fallback
tier, or refuses it at once with an honest Retry-After."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.router.conftest import Server


@pytest.fixture
def predicted(server: Server) -> Iterator[dict[str, float]]:
    """Set a tier's predicted wait (what the engine would estimate from its queue and step times)."""
    waits: dict[str, float] = {}
    patched = []
    for name in ("small", "medium", "large"):
        engine = server.engine(name)
        original = engine.load

        def load(original: Any = original, name: str = name, **kw: Any) -> Any:
            return dataclasses.replace(original(**kw), predicted_wait_s=waits.get(name, 0.0))

        def wait(caller: str, prompt_tokens: int = 0, name: str = name, **kw: Any) -> float:
            return waits.get(name, 0.0)

        engine.load = load
        engine.predicted_wait = wait  # the caller-aware estimate admission reads
        patched.append((engine, original))
    yield waits
    for engine, original in patched:
        engine.load = original
        del engine.predicted_wait


def ask(server: Server, model: str = "small", **headers: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    hdrs = {k.replace("_", "-"): v for k, v in headers.items()}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=hdrs, timeout=30)


def test_a_tier_predicted_to_wait_too_long_falls_back(server: Server, predicted: dict[str, float]) -> None:
    predicted["small"] = 30.0  # > the default max_queue_wait_s (5 s)
    r = ask(server)
    assert r.status_code == 200 and r.headers["x-router-tier"] == "medium"


def test_no_tier_with_headroom_is_refused_at_once_with_an_honest_retry_after(
    server: Server, predicted: dict[str, float]
) -> None:
    predicted.update(small=30.0, medium=30.0, large=12.0)
    started = time.perf_counter()
    r = ask(server)
    took = time.perf_counter() - started
    assert r.status_code == 429 and took < 0.5
    assert r.json()["error"]["code"] == "predicted_wait_exceeded"
    # large, the last in the chain: 12 s predicted - 5 s allowed, spread by up to half again so
    # the clients refused together do not retry together.
    ms = int(r.headers["retry-after-ms"])
    assert 7000 <= ms <= 10500 and r.headers["retry-after"] == str(-(-ms // 1000))


def test_refusals_spread_their_retries(server: Server, predicted: dict[str, float]) -> None:
    predicted.update(small=30.0, medium=30.0, large=12.0)
    waits = {int(ask(server).headers["retry-after-ms"]) for _ in range(8)}
    assert len(waits) > 1 and min(waits) >= 7000


def test_the_client_deadline_lowers_the_budget(server: Server, predicted: dict[str, float]) -> None:
    predicted["small"] = 3.0
    assert ask(server).headers["x-router-tier"] == "small"  # 3 s is within the tier's 5 s
    assert ask(server, x_request_timeout="2").headers["x-router-tier"] == "medium"
    assert ask(server, x_request_timeout="60").headers["x-router-tier"] == "small"
    for bad in ("soon", "-1", "nan", "0"):
        r = ask(server, x_request_timeout=bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_timeout"


FAIR_AUTH = "{mode: open, trust_tenant_header: true}"


@pytest.fixture(scope="module")
def fair_server(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from tests.fixtures import tiny_policy_yaml
    from tests.router.conftest import start_server

    # small admits 4 (2 running + 2 waiting) and has no fallback: what it refuses is a 429.
    text = tiny_policy_yaml(tiny_model_dir, cache_enabled=False, max_num_seqs=2, max_queue=2, auth=FAIR_AUTH)
    text = text.replace("fallback: {small: medium, medium: large, large: null}", "fallback: {}")
    path = tmp_path_factory.mktemp("fair") / "policy.yaml"
    path.write_text(text)
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()


def until(condition: Any, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_a_flooding_tenant_cannot_starve_a_light_one(fair_server: Server) -> None:
    """heavy's eight requests arrive one by one: two are admitted and the rest refused, and while
    heavy's two answers are in flight the light tenant still gets in, three times. No timing:
    heavy-only steps are held (its answers stay in flight for as long as the test needs) and run
    only while a light request is pending, and each heavy request is sent once the previous one
    has been admitted or refused."""
    import threading

    engine = fair_server.engine("small")
    held = fair_server.service.fair._held["small"]
    release = threading.Event()

    def light_pending(batch: Any) -> bool:
        return (
            any(s.caller == "light" for s in batch.seqs)
            or engine._inbox_callers.get("light", 0) > 0
            or any(s.caller == "light" for s in engine.scheduler.waiting)
        )

    def hold_heavy_steps(batch: Any) -> None:
        while not release.is_set() and not light_pending(batch):
            release.wait(0.005)

    body = {"model": "small", "messages": [{"role": "user", "content": "x"}], "max_tokens": 120}
    body |= {"ignore_eos": True, "stream": True}
    codes: list[int] = []

    def heavy() -> None:
        with httpx.stream(
            "POST",
            fair_server.url + "/v1/chat/completions",
            json=body,
            headers={"x-tenant": "heavy"},
            timeout=60,
        ) as r:
            codes.append(r.status_code)
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=heavy) for _ in range(8)]
    try:
        light = ask(fair_server, x_tenant="light")  # the light tenant has used the tier lately
        assert light.status_code == 200
        engine.step_hook = hold_heavy_steps
        for i, t in enumerate(threads):
            t.start()
            until(lambda i=i: codes.count(429) + held["heavy"] == i + 1)
        # heavy holds its half of the tier's 4 places; the rest of its flood was refused...
        assert held["heavy"] == 2 and codes == [429] * 6, codes
        # ...and the light tenant still gets in while heavy's answers are in flight.
        results = [ask(fair_server, x_tenant="light").status_code for _ in range(3)]
        assert results == [200, 200, 200]
        assert held["heavy"] == 2
    finally:
        release.set()
        engine.step_hook = None
        for t in threads:
            t.join(60)
    assert sorted(codes) == [200, 200] + [429] * 6, codes


@pytest.fixture(scope="module")
def priority_server(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from tests.fixtures import tiny_policy_yaml
    from tests.router.conftest import start_server

    text = tiny_policy_yaml(tiny_model_dir, cache_enabled=False, auth=FAIR_AUTH)
    text = text.replace("fallback: {small: medium, medium: large, large: null}", "fallback: {}")
    tenants = "tenants:\n  batch: {priority: low}\n  vip: {priority: high}\nrouting:\n"
    path = tmp_path_factory.mktemp("priority") / "policy.yaml"
    path.write_text(text.replace("routing:\n", tenants, 1))
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()


def test_priorities_scale_the_wait_budget(priority_server: Server) -> None:
    engine = priority_server.engine("small")
    original = engine.load
    wait = {"s": 4.0}
    engine.load = lambda **kw: dataclasses.replace(
        original(**kw), predicted_wait_s=wait["s"]
    )  # default budget: 5 s
    engine.predicted_wait = lambda caller, prompt_tokens=0, **kw: wait["s"]
    try:
        assert ask(priority_server, x_tenant="batch").status_code == 429  # low: 2.5 s, shed first
        assert ask(priority_server, x_tenant="someone").status_code == 200  # normal: 5 s
        wait["s"] = 8.0
        assert ask(priority_server, x_tenant="someone").status_code == 429
        assert ask(priority_server, x_tenant="vip").status_code == 200  # high: 10 s
    finally:
        engine.load = original
        del engine.predicted_wait
