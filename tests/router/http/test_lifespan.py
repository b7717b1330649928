"""Tier loading at startup (router/http/lifespan.py, ``_load_tiers``): the tiers are built with
the app's telemetry as their observer and readiness flips only once they are in; a failure keeps
the service not-ready, with the cause in the log and in ``load_error``."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from router.http import lifespan


class _Gauge:
    def __init__(self) -> None:
        self.value: float | None = None

    def set(self, value: float) -> None:
        self.value = value


def _app() -> Any:
    service = SimpleNamespace(policy=object(), tiers=None)
    telemetry = SimpleNamespace(ready=_Gauge())
    return SimpleNamespace(state=SimpleNamespace(service=service, worker=object(), telemetry=telemetry))


def test_loaded_tiers_get_the_apps_telemetry_and_readiness_flips(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug it catches: ``build_tiers`` called without ``observer=`` - every engine's metrics and
    spans (queue depth, step times, drafts) silently go nowhere."""
    app = _app()
    seen: dict[str, Any] = {}
    built = SimpleNamespace(tiers={"small": object()})

    def build(policy: Any, worker: Any, **kwargs: Any) -> Any:
        seen.update(policy=policy, worker=worker, **kwargs)
        return built

    monkeypatch.setattr(lifespan, "build_tiers", build)
    monkeypatch.setattr(
        lifespan, "gc", SimpleNamespace(collect=lambda: 0, freeze=lambda: None, get_freeze_count=lambda: 0)
    )
    with caplog.at_level(logging.INFO, logger=lifespan.__name__):
        lifespan._load_tiers(app)
    assert seen["observer"] is app.state.telemetry
    assert seen["policy"] is app.state.service.policy and seen["worker"] is app.state.worker
    assert app.state.service.tiers is built
    assert app.state.telemetry.ready.value == 1
    assert any(r.getMessage().startswith("ready: tiers small") for r in caplog.records)


def test_a_failed_load_stays_not_ready_and_logs_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    app = _app()

    def build(policy: Any, worker: Any, **kwargs: Any) -> Any:
        raise FileNotFoundError("no weights at /models/x")

    monkeypatch.setattr(lifespan, "build_tiers", build)
    with caplog.at_level(logging.ERROR, logger=lifespan.__name__):
        lifespan._load_tiers(app)
    assert app.state.load_error == "FileNotFoundError: no weights at /models/x"
    assert app.state.service.tiers is None and app.state.telemetry.ready.value is None
    (record,) = [r for r in caplog.records if r.name == lifespan.__name__]
    assert "tier loading failed" in record.getMessage()
    assert "no weights at /models/x" in record.getMessage()
