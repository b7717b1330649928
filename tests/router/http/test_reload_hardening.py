"""Issue 37, hot reload under load: an engine is retired only when no request holds it, and a
request that picked the old engine before the swap, but had not submitted yet, is served by the
new one instead of waiting on an engine nobody steps any more."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, start_server

CAUGHT = 4
"""Requests held in preparation across the swap (the loop's default executor has ~6 workers;
the reload's own build needs one)."""


def _wait(pred: Callable[[], object], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


@pytest.fixture
def served(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[Server, Path, Path]]:
    path = tmp_path / "policy.yaml"
    path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False))
    srv, stop = start_server(path, reload_interval_s=0.1)
    yield srv, path, tiny_model_dir
    stop()


def test_a_reload_during_16_in_flight_requests_loses_none(
    served: tuple[Server, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug: a request holding the old TierSet could submit to an engine ``_retire`` had already
    removed (its queue never stepped again: a 503 after the queue timeout)."""
    import router.backends.local

    srv, path, model = served
    old_engine = srv.engine("small")
    gate = threading.Event()
    lock = threading.Lock()
    engines: list[Any] = []
    prepare = router.backends.local.prepare_local

    def held_prepare(backend: Any, gen: Any) -> Any:
        with lock:
            engines.append(backend.engine)
            hold = len(engines) <= CAUGHT
        if hold:
            gate.wait(60)
        return prepare(backend, gen)

    monkeypatch.setattr(router.backends.local, "prepare_local", held_prepare)
    codes: list[int] = []

    def ask(i: int) -> None:
        r = httpx.post(
            srv.url + "/v1/chat/completions",
            json={"model": "small", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4},
            timeout=60,
        )
        with lock:
            codes.append(r.status_code)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    _wait(lambda: len(engines) >= CAUGHT, 20)
    path.write_text(tiny_policy_yaml(model, cache_enabled=False, max_num_seqs=6))  # small rebuilt
    _wait(lambda: srv.engine("small") is not old_engine, 60)
    new_engine = srv.engine("small")
    # The held requests picked the old engine, which has no work of its own: it is removed from
    # the device thread (nothing steps it any more) before they go on.
    _wait(lambda: old_engine not in srv.service.tiers.worker.engines, 20)
    gate.set()
    for t in threads:
        t.join(60)
    assert sorted(codes) == [200] * 16, codes
    with lock:
        moved = sum(1 for e in engines[CAUGHT:] if e is new_engine)
    assert moved >= CAUGHT  # each held request was prepared again for the new engine
    assert new_engine.config.max_num_seqs == 6


def test_a_revoked_key_is_refused_while_an_engine_rebuild_is_in_progress(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug: the keys file was re-read by the policy watcher's loop, between policy checks, so a
    revoked key stayed valid for as long as a policy edit's engines took to build."""
    import router.http.reload

    keys = tmp_path / "keys"
    keys.write_text("sk-keep\nsk-revoke\n")
    path = tmp_path / "policy.yaml"
    auth = f"{{mode: keys, api_keys_file: {keys}}}"
    path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False, auth=auth))
    srv, stop = start_server(path, reload_interval_s=0.1)
    building = threading.Event()
    release = threading.Event()
    build = router.http.reload.build_tiers

    def slow_build(*args: Any, **kwargs: Any) -> Any:
        building.set()
        release.wait(60)  # a large model's rebuild: minutes
        return build(*args, **kwargs)

    monkeypatch.setattr(router.http.reload, "build_tiers", slow_build)
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def status(key: str) -> int:
        r = httpx.post(
            srv.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )
        return r.status_code

    try:
        assert status("sk-revoke") == 200
        path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False, auth=auth, max_num_seqs=6))
        assert building.wait(20)
        # Replaced whole, as a Secret update or an editor's save does: written in place, the
        # watcher can read the truncated file between open and write, which revokes every key
        # (fail closed) until its next read, and sk-keep's request below could land in between.
        (tmp_path / "keys.new").write_text("sk-keep\n")
        os.replace(tmp_path / "keys.new", keys)
        _wait(lambda: status("sk-revoke") == 401, 10)
        assert status("sk-keep") == 200  # the old engines keep serving meanwhile
    finally:
        release.set()
        stop()


def test_a_reload_can_never_open_what_start_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 55. Bug: ``--allow-open`` was checked only at start, so editing a keys-mode policy to
    ``mode: open`` on a public bind switched authentication off. The edit is refused (counted) and
    the keys stay in force; on loopback the same edit applies."""
    path = tmp_path / "policy.yaml"
    os.environ["TEST_RELOAD_BIND_KEYS"] = "sk-only"
    keyed = "{mode: keys, api_keys_env: TEST_RELOAD_BIND_KEYS}"
    path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False, auth=keyed))
    srv, stop = start_server(path, reload_interval_s=0.1)
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        srv.app.state.bind = ("0.0.0.0", False)  # what ``serve --host 0.0.0.0`` records
        failures = srv.app.state.telemetry.policy_reload_failures
        before = failures._value.get()
        path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False, auth="{mode: open}"))
        _wait(lambda: failures._value.get() > before, 10)
        assert httpx.post(srv.url + "/v1/chat/completions", json=body).status_code == 401
        assert srv.app.state.auth.open is False
        srv.app.state.bind = ("127.0.0.1", False)
        path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False, auth="{mode: open} "))
        _wait(lambda: srv.app.state.auth.open, 10)
        assert httpx.post(srv.url + "/v1/chat/completions", json=body).status_code == 200
    finally:
        stop()


def test_an_admin_classifier_swap_during_a_policy_reload_stays(
    served: tuple[Server, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 55. Bug: ``apply_policy`` captured the classifier before building the tiers and wrote
    that one back at the swap, silently undoing a ``/admin/classifier/reload`` made meanwhile."""
    import router.http.reload

    srv, path, model = served
    service = srv.app.state.service
    building, release = threading.Event(), threading.Event()
    build = router.http.reload.build_tiers

    def slow_build(*args: Any, **kwargs: Any) -> Any:
        building.set()
        release.wait(60)
        return build(*args, **kwargs)

    monkeypatch.setattr(router.http.reload, "build_tiers", slow_build)
    reloads = srv.app.state.telemetry.policy_reloads
    before = reloads._value.get()
    path.write_text(tiny_policy_yaml(model, cache_enabled=False, max_num_seqs=6))  # new engines
    assert building.wait(20)
    swapped = object.__new__(type(service.classifier))
    swapped.__dict__.update(service.classifier.__dict__)  # an admin reload's fresh model object
    service.classifier = swapped
    release.set()
    _wait(lambda: reloads._value.get() > before, 30)
    assert service.policy.tiers["small"].max_num_seqs == 6  # the edit applied
    assert service.classifier is swapped
