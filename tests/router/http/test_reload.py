"""Hot reload through a running service: valid edits apply within 2 s, broken ones change nothing,
ConfigMap-style symlink swaps are seen, engine changes are built in the background, no request is lost."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, start_server


def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == name:
                total += s.value
    return total


def route(url: str) -> dict[str, object]:
    r = httpx.post(url + "/v1/route", json={"messages": [{"role": "user", "content": "hello there"}]})
    assert r.status_code == 200
    body: dict[str, object] = r.json()
    return body


def wait_for(pred: Callable[[], object], timeout: float = 2.0) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if pred():
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.fixture
def configmap(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[Server, Path, Path]]:
    """A policy mounted the way Kubernetes mounts a ConfigMap: policy.yaml -> ..data/policy.yaml,
    ..data -> a timestamped directory that an update replaces by swapping the link."""
    root = tmp_path / "configmap"
    root.mkdir()
    first = root / "..2026_01"
    first.mkdir()
    (first / "policy.yaml").write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False))
    (root / "..data").symlink_to(first.name)
    (root / "policy.yaml").symlink_to("..data/policy.yaml")
    srv, stop = start_server(root / "policy.yaml", reload_interval_s=0.2)
    yield srv, root, tiny_model_dir
    stop()


def swap(root: Path, name: str, text: str) -> None:
    d = root / name
    d.mkdir()
    (d / "policy.yaml").write_text(text)
    tmp = root / "..data_tmp"
    tmp.symlink_to(name)
    os.replace(tmp, root / "..data")  # atomic, like the kubelet's swap


def test_valid_edit_applies_within_two_seconds(configmap: tuple[Server, Path, Path]) -> None:
    srv, root, model = configmap
    before = metric(srv.url, "router_policy_reloads_total")
    text = (
        tiny_policy_yaml(model, cache_enabled=False)
        .replace("name: score-small", "name: renamed-small")
        .replace("score_below: 0.35", "score_below: 0.6")
    )
    swap(root, "..2026_02", text)
    took = wait_for(lambda: route(srv.url)["rule"] == "renamed-small")
    assert took < 2.0
    assert metric(srv.url, "router_policy_reloads_total") == before + 1


def test_broken_edit_keeps_the_old_policy(configmap: tuple[Server, Path, Path]) -> None:
    srv, root, model = configmap
    rule_before = route(srv.url)["rule"]
    failures = metric(srv.url, "router_policy_reload_failures_total")
    swap(root, "..2026_03", tiny_policy_yaml(model).replace("tier: small", "tier: tiny"))
    wait_for(lambda: metric(srv.url, "router_policy_reload_failures_total") == failures + 1)
    assert route(srv.url)["rule"] == rule_before
    assert httpx.get(srv.url + "/readyz").status_code == 200


def test_engine_change_builds_in_the_background_and_loses_nothing(
    configmap: tuple[Server, Path, Path],
) -> None:
    srv, root, model = configmap
    old_engine = srv.engine("small")
    results: list[int] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                r = c.post(
                    srv.url + "/v1/chat/completions",
                    json={"model": "small", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4},
                )
                results.append(r.status_code)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    swap(root, "..2026_04", tiny_policy_yaml(model, cache_enabled=False, max_num_seqs=6))
    wait_for(lambda: srv.engine("small") is not old_engine, timeout=20)
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join()
    assert results and all(code == 200 for code in results), set(results)
    assert srv.engine("small").config.max_num_seqs == 6
    wait_for(lambda: old_engine not in srv.service.tiers.worker.engines, timeout=10)  # retired once idle


def test_plain_file_edit_is_seen(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False))
    srv, stop = start_server(path, reload_interval_s=0.2)
    try:
        path.write_text(
            tiny_policy_yaml(tiny_model_dir, cache_enabled=False).replace("name: score-large", "name: edited")
        )
        # The routing of "hello there" depends on its score; the default rule name must have changed.
        wait_for(lambda: any(r.name == "edited" for r in srv.service.policy.routing.rules))
    finally:
        stop()


def test_reload_rebuilds_body_limit_cache_and_telemetry_settings(
    configmap: tuple[Server, Path, Path],
) -> None:
    srv, root, model = configmap
    body = {"model": "small", "messages": [{"role": "user", "content": "x" * 4000}], "max_tokens": 2}
    assert httpx.post(srv.url + "/v1/chat/completions", json=body).status_code != 413
    assert srv.service.cache is None
    text = tiny_policy_yaml(
        model, cache_enabled=True, service_extra="  max_body_bytes: 2048\n  telemetry: {record_content: true}"
    )
    swap(root, "..2026_05", text)
    wait_for(lambda: httpx.post(srv.url + "/v1/chat/completions", json=body).status_code == 413)
    assert srv.service.cache is not None and srv.app.state.telemetry.record_content is True
    small = {"model": "small", "messages": [{"role": "user", "content": "cache me"}], "temperature": 0}
    small |= {"max_tokens": 30, "stop": [" ", "e", "a", "o"]}
    assert httpx.post(srv.url + "/v1/chat/completions", json=small).headers["x-router-cache"] == "miss"
    assert httpx.post(srv.url + "/v1/chat/completions", json=small).headers["x-router-cache"] == "hit"


def test_a_keys_mode_edit_without_keys_is_rejected_and_keeps_serving(
    configmap: tuple[Server, Path, Path],
) -> None:
    srv, root, model = configmap
    failures = metric(srv.url, "router_policy_reload_failures_total")
    os.environ.pop("TEST_RELOAD_NO_KEYS", None)
    swap(root, "..2026_06", tiny_policy_yaml(model, auth="{mode: keys, api_keys_env: TEST_RELOAD_NO_KEYS}"))
    wait_for(lambda: metric(srv.url, "router_policy_reload_failures_total") == failures + 1)
    assert srv.app.state.auth.open
    assert route(srv.url)["tier"] in ("small", "medium", "large")  # still served, still open


def test_an_edit_while_the_first_tiers_load_waits_for_them(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Swapping the policy before its tiers exist could name a tier with no engine (a 500): the
    watcher holds the edit back until the first tiers are up, then applies it."""
    import asyncio
    from types import SimpleNamespace

    from router.http.reload import PolicyWatcher
    from router.policy.loader import parse_policy

    path = tmp_path / "policy.yaml"
    path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False))
    service = SimpleNamespace(tiers=None, policy=parse_policy(path.read_text(), str(path)))
    app = SimpleNamespace(state=SimpleNamespace(service=service, load_error=None, telemetry=None))
    watcher = PolicyWatcher(path, app)
    path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False).replace("score-large", "edited"))
    assert asyncio.run(watcher.check()) is False  # still loading: not applied, not marked seen
    assert service.policy.routing.rules[-1].name == "score-large"
    applied: list[object] = []

    async def fake_apply(app: object, new: object) -> None:
        applied.append(new)

    monkeypatch.setattr("router.http.reload.apply_policy", fake_apply)
    counter = SimpleNamespace(inc=lambda: None)
    app.state.telemetry = SimpleNamespace(policy_reloads=counter, policy_reload_failures=counter)
    service.tiers = object()  # the first tiers are up
    assert asyncio.run(watcher.check()) is True and len(applied) == 1
