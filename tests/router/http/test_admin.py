"""Issue 55: the admin port is not an open door. State-changing admin endpoints (``POST
/admin/classifier/reload``) need an admin key of their own - an API key is not one - on the admin
listener and, with ``--admin-port 0``, on the API port; with no admin key configured they answer
403 and change nothing. Read-only operator endpoints stay open on the admin listener. A failed
reload answers one message whatever the cause, so it never says whether a path exists. The admin
host defaults to loopback."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.http.app import admin_listener
from router.http.auth import ADMIN_KEYS_ENV, AdminKeys
from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, free_port, start_server

KEYS = """  auth:
    mode: keys
    api_keys_env: TEST_ADMIN_API_KEYS
"""
RELOAD = "/admin/classifier/reload"


def _admin(srv: Server) -> Iterator[str]:
    import uvicorn

    port = free_port()
    admin = uvicorn.Server(
        uvicorn.Config(
            admin_listener(srv.app), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
        )
    )
    thread = threading.Thread(target=admin.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not admin.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    admin.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    os.environ["TEST_ADMIN_API_KEYS"] = "sk-user"
    path = tmp_path_factory.mktemp("admin") / "policy.yaml"
    path.write_text(
        tiny_policy_yaml(tiny_model_dir, cache_enabled=False).replace("  auth: {mode: open}\n", KEYS, 1)
    )
    return path


@pytest.fixture(scope="module")
def admin_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("admin-keys") / "admin-keys"
    path.write_text("sk-admin\n")
    return path


@pytest.fixture(scope="module")
def closed(policy: Path) -> Iterator[tuple[Server, str]]:
    """Admin listener on, no admin key anywhere."""
    os.environ.pop(ADMIN_KEYS_ENV, None)
    srv, stop = start_server(policy, admin_separate=True)
    for url in _admin(srv):
        yield srv, url
    stop()


@pytest.fixture(scope="module")
def keyed(policy: Path, admin_keys: Path) -> Iterator[tuple[Server, str]]:
    """Admin listener on, admin keys from a file."""
    srv, stop = start_server(policy, admin_separate=True, admin_keys=AdminKeys(str(admin_keys)))
    for url in _admin(srv):
        yield srv, url
    stop()


def _classifier(srv: Server) -> Any:
    return srv.app.state.service.classifier


def test_with_no_admin_key_configured_reload_is_closed(closed: tuple[Server, str]) -> None:
    """Catches the admin port's state-changing endpoint open to anyone who reaches the port."""
    srv, admin = closed
    before = _classifier(srv)
    for headers in ({}, {"authorization": "Bearer sk-user"}, {"authorization": "Bearer anything"}):
        r = httpx.post(admin + RELOAD, headers=headers, timeout=30)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "admin_disabled"
    assert _classifier(srv) is before  # nothing was reloaded
    # Read-only operator endpoints stay open there (the scraper needs no key).
    assert httpx.get(admin + "/metrics", timeout=30).status_code == 200


def test_only_an_admin_key_may_reload(keyed: tuple[Server, str]) -> None:
    """Catches an API key (or no key) accepted as an admin key, and a valid admin key refused."""
    srv, admin = keyed
    before = _classifier(srv)
    for headers in ({}, {"authorization": "Bearer sk-user"}, {"authorization": "Bearer sk-admin2"}):
        r = httpx.post(admin + RELOAD, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_admin_key"
    assert _classifier(srv) is before
    ok = httpx.post(admin + RELOAD, headers={"authorization": "Bearer sk-admin"}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert ok.json()["reloaded"] is True and _classifier(srv) is not before
    # Still 404 on the API port while the admin listener is separate.
    assert (
        httpx.post(srv.url + RELOAD, headers={"authorization": "Bearer sk-admin"}, timeout=30).status_code
        == 404
    )


def test_a_failed_reload_never_says_whether_the_path_exists(
    keyed: tuple[Server, str], tmp_path: Path
) -> None:
    """Catches the error echoing the loader's message: a missing file and a file that exists but
    is no model (``/etc/passwd``) read differently, which maps the server's filesystem."""
    srv, admin = keyed
    auth = {"authorization": "Bearer sk-admin"}
    before = _classifier(srv)
    missing = httpx.post(admin + RELOAD, headers=auth, json={"path": str(tmp_path / "nope")}, timeout=30)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    present = httpx.post(admin + RELOAD, headers=auth, json={"path": str(broken)}, timeout=30)
    assert missing.status_code == present.status_code == 400
    assert missing.json() == present.json()
    assert str(tmp_path) not in missing.text
    assert _classifier(srv) is before


def test_a_rotated_admin_keys_file_takes_effect_without_restart(
    keyed: tuple[Server, str], admin_keys: Path
) -> None:
    """Catches the admin keys read once at start (a revoked key would keep working)."""
    _, admin = keyed
    admin_keys.write_text("sk-admin-new\n")
    try:
        assert (
            httpx.post(admin + RELOAD, headers={"authorization": "Bearer sk-admin"}, timeout=30).status_code
            == 401
        )
        assert (
            httpx.post(
                admin + RELOAD, headers={"authorization": "Bearer sk-admin-new"}, timeout=60
            ).status_code
            == 200
        )
    finally:
        admin_keys.write_text("sk-admin\n")


def test_admin_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches ``$TIERED_ROUTER_ADMIN_KEYS`` ignored, or any header accepted when it is set."""
    keys = AdminKeys()
    monkeypatch.delenv(ADMIN_KEYS_ENV, raising=False)
    assert keys.check({"authorization": "Bearer k1"}) is None
    monkeypatch.setenv(ADMIN_KEYS_ENV, "k1, k2")
    assert keys.check({"authorization": "Bearer k2"}) is True
    assert keys.check({"x-api-key": "k1"}) is True
    assert keys.check({"authorization": "Bearer k3"}) is False
    assert keys.check({}) is False


def test_the_admin_host_defaults_to_loopback() -> None:
    """Catches the admin listener bound to ``--host`` (0.0.0.0 in a container) unless told."""
    from router.cli import admin_host, build_parser

    assert (
        admin_host(build_parser().parse_args(["serve", "--policy", "p.yaml", "--host", "0.0.0.0"]))
        == "127.0.0.1"
    )
    args = build_parser().parse_args(["serve", "--policy", "p.yaml", "--admin-host", "0.0.0.0"])
    assert admin_host(args) == "0.0.0.0"


def test_the_classifier_is_described_by_path_and_version_and_loaded_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bugs it catches: the reload answer's keys misspelt or its version read off the wrong
    object, and a reloaded classifier placed on an accelerator the tiers use (``device`` default
    not the CPU) and probed after the swap instead of before."""
    from types import SimpleNamespace

    import classifier
    from router.http import admin

    described = admin._describe(SimpleNamespace(path=Path("/models/score.onnx"), version="4.0"))
    assert described == {"path": "/models/score.onnx", "version": "4.0"}
    assert admin._describe(object()) == {"path": "None", "version": None}
    calls: list[tuple[object, str]] = []
    probed: list[str] = []

    class Loaded:
        def score(self, prompt: str) -> float:
            probed.append(prompt)
            return 0.5

    def load(path: object, device: str = "auto") -> Loaded:
        calls.append((path, device))
        return Loaded()

    monkeypatch.setattr(classifier.ComplexityClassifier, "load", staticmethod(load))
    clf = admin._load("/models/score.onnx")
    assert isinstance(clf, Loaded) and calls == [("/models/score.onnx", "cpu")] and probed == [admin.PROBE]
