"""The policy watcher and the swap (router/http/reload.py) on stand-in app state, no server: an
unchanged file is never re-applied, an edit is applied once and logged with its path and digest,
a rejected edit leaves the old policy and is counted, an edit waits while the first tiers load,
and a swap reloads the classifier only when its setting changed and none was injected."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from router.http import reload
from router.policy.loader import parse_policy

POLICY = """
version: 1
service:
  auth: {mode: open}
tiers:
  small: {model: m}
routing:
  rules: [{name: d, tier: small}]
"""


class _Counter:
    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1


def _app(tiers: object = "loaded", load_error: str | None = None) -> Any:
    telemetry = SimpleNamespace(
        policy_reloads=_Counter(), policy_reload_failures=_Counter(), record_content=False
    )
    service = SimpleNamespace(tiers=tiers, policy=parse_policy(POLICY), cache=None, classifier="old-clf")
    return SimpleNamespace(state=SimpleNamespace(service=service, telemetry=telemetry, load_error=load_error))


@pytest.fixture
def applied(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []

    async def apply(app: Any, policy: Any) -> None:
        calls.append(policy)

    monkeypatch.setattr(reload, "apply_policy", apply)
    return calls


def test_an_unchanged_file_is_never_reapplied(tmp_path: Path, applied: list[Any]) -> None:
    """Bug it catches: the watcher starting without the file's digest - its first look reloads the
    policy it was started with (rebuilding engines for nothing, counting a reload nobody made)."""
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    app = _app()
    watcher = reload.PolicyWatcher(path, app)
    assert asyncio.run(watcher.check()) is False
    assert applied == [] and app.state.telemetry.policy_reloads.value == 0


def test_an_edit_is_applied_once_and_logged_with_its_path_and_digest(
    tmp_path: Path, applied: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    app = _app()
    watcher = reload.PolicyWatcher(path, app)
    edited = POLICY.replace("{model: m}", "{model: m, max_num_seqs: 4}")
    path.write_text(edited)
    with caplog.at_level(logging.INFO, logger=reload.__name__):
        assert asyncio.run(watcher.check()) is True
        assert asyncio.run(watcher.check()) is False  # seen: not applied twice
    assert len(applied) == 1 and applied[0].tiers["small"].max_num_seqs == 4
    assert app.state.telemetry.policy_reloads.value == 1 and watcher.last_error is None
    digest = hashlib.sha256(edited.encode()).hexdigest()[:12]
    messages = [r.getMessage() for r in caplog.records if r.name == reload.__name__]
    assert any(str(path) in m and digest in m for m in messages), messages


def test_a_rejected_edit_keeps_the_old_policy_and_is_counted(tmp_path: Path, applied: list[Any]) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    app = _app()
    watcher = reload.PolicyWatcher(path, app)
    path.write_text(POLICY.replace("version: 1", "version: 9"))
    assert asyncio.run(watcher.check()) is False
    assert applied == []
    assert app.state.telemetry.policy_reload_failures.value == 1
    assert watcher.last_error is not None and "version" in watcher.last_error.render()


def test_an_edit_waits_while_the_first_tiers_load(tmp_path: Path, applied: list[Any]) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    app = _app(tiers=None)
    watcher = reload.PolicyWatcher(path, app)
    path.write_text(POLICY.replace("{model: m}", "{model: m, max_num_seqs: 4}"))
    assert asyncio.run(watcher.check()) is False and applied == []
    app.state.service.tiers = "loaded"
    assert asyncio.run(watcher.check()) is True and len(applied) == 1  # the edit was kept unseen
    failed = _app(tiers=None, load_error="boom")
    other = reload.PolicyWatcher(path, failed)
    path.write_text(POLICY.replace("{model: m}", "{model: m, max_num_seqs: 2}"))
    assert asyncio.run(other.check()) is True  # the load failed: a fix may be applied


def _swap_state(monkeypatch: pytest.MonkeyPatch, *, injected: bool) -> tuple[Any, list[tuple[Any, str]]]:
    loads: list[tuple[Any, str]] = []

    def load(path: Any, device: str = "auto") -> str:
        loads.append((path, device))
        return "new-clf"

    import classifier

    monkeypatch.setattr(classifier.ComplexityClassifier, "load", staticmethod(load))
    app = _app(tiers=None)
    app.state.classifier_injected = injected
    app.state.auth = None
    return app, loads


def test_a_swap_reloads_the_classifier_only_when_its_setting_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bugs it catches: the classifier reloaded on every policy edit (seconds of ONNX session
    setup, and a model swapped in through the admin port replaced), or never reloaded when the
    policy names another one."""
    app, loads = _swap_state(monkeypatch, injected=False)
    same = parse_policy(POLICY.replace("{model: m}", "{model: m, max_num_seqs: 4}"))
    asyncio.run(reload.apply_policy(app, same))
    assert loads == [] and app.state.service.classifier == "old-clf"
    assert app.state.service.policy is same
    changed = parse_policy(
        POLICY.replace("{mode: open}", "{mode: open}\n  classifier: {path: /models/other, device: cpu}")
    )
    asyncio.run(reload.apply_policy(app, changed))
    assert loads == [("/models/other", "cpu")] and app.state.service.classifier == "new-clf"


def test_an_injected_classifier_is_never_replaced_by_a_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    app, loads = _swap_state(monkeypatch, injected=True)
    changed = parse_policy(
        POLICY.replace("{mode: open}", "{mode: open}\n  classifier: {path: /models/other, device: cpu}")
    )
    asyncio.run(reload.apply_policy(app, changed))
    assert loads == [] and app.state.service.classifier == "old-clf"
    assert app.state.service.policy is changed


def test_a_failing_key_refresh_is_logged_and_the_loop_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug it catches: the key loop's error logged without saying what failed (or the loop dying
    on the first error: a rotated key would then never be read again)."""
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    app = _app()
    calls: list[int] = []

    def refresh() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("keys file unreadable")

    app.state.auth = SimpleNamespace(refresh=refresh)
    watcher = reload.PolicyWatcher(path, app, interval_s=0.001)

    async def run() -> None:
        task = asyncio.create_task(watcher._run_keys())
        for _ in range(2000):
            await asyncio.sleep(0.001)
            if len(calls) >= 3:
                break
        task.cancel()

    with caplog.at_level(logging.ERROR, logger=reload.__name__):
        asyncio.run(run())
    assert len(calls) >= 3  # refreshed again after the failure
    (record,) = [r for r in caplog.records if r.name == reload.__name__]
    assert record.getMessage() == "API key refresh error" and record.exc_info is not None
