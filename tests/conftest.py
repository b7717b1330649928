from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tiers.worker.device import DeviceWorker

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tiny test models gain nothing from intra-op threads, and with the test runner's own threads on
# two cores, OpenMP barriers would stall; the real-model tests still pass, a bit slower.
os.environ.setdefault("TIERED_ROUTER_TORCH_THREADS", "1")
os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
os.environ.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)


@pytest.fixture(scope="session", autouse=True)
def _state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Feedback and shadow logs a policy does not place go to the state directory
    (``router.policy.schema.state_file``): in tests, a tmp dir, never the checkout or ``~``."""
    path = tmp_path_factory.mktemp("state")
    old = os.environ.get("TIERED_ROUTER_STATE_DIR")
    os.environ["TIERED_ROUTER_STATE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TIERED_ROUTER_STATE_DIR", None)
    else:
        os.environ["TIERED_ROUTER_STATE_DIR"] = old


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """The real embedded default, materialized (slow the first time on a machine)."""
    from tiers.models.loading import materialize_embedded

    return materialize_embedded("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def worker() -> Iterator[DeviceWorker]:
    """The one device thread a test module's engines run on."""
    from tiers.worker.device import DeviceWorker

    w = DeviceWorker()
    yield w
    w.stop()
