from __future__ import annotations

import gc
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures import tiny_policy_yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    app: Any
    policy_path: Path

    @property
    def service(self) -> Any:
        return self.app.state.service

    def engine(self, tier: str) -> Any:
        return self.service.tiers.get(tier).engine

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until every engine is idle and every response has been accounted for.

        The engines go idle a few event-loop turns before the handler that owned the request
        leaves the in-flight count (it closes its source first), so both are awaited; a response
        that is never released still fails here, after ``timeout``."""
        deadline = time.monotonic() + timeout
        polls = 0
        while time.monotonic() < deadline:
            loads = [e.load() for e in self.service.tiers.engines()]
            engines_idle = all(load.num_running == 0 and load.num_waiting == 0 for load in loads)
            if engines_idle and self.service.in_flight == 0:
                return
            polls += 1
            if polls % 25 == 0:
                gc.collect()  # a response dropped unstarted is released when collected
            time.sleep(0.02)
        raise AssertionError(f"not idle: engines {loads}, {self.service.in_flight} in flight")


def start_server(policy_path: Path, ready_timeout_s: float = 120, **app_kwargs: Any) -> tuple[Server, Any]:
    import uvicorn

    from router.http.app import create_app

    app = create_app(policy_path, **app_kwargs)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    else:
        raise RuntimeError("server did not become ready")

    def stop() -> None:
        server.should_exit = True
        thread.join(30)

    return Server(url, app, policy_path), stop


@contextmanager
def keyed_tiny_server(
    model_dir: Path, policy_dir: Path, keys_env: str, keys: str, *, drafts: bool = True
) -> Iterator[Server]:
    """The tiny tiers in keys mode (``keys`` as ``key:tenant`` entries in ``$keys_env``) with room
    for long tool prompts; no response cache, so every answer is generated. ``drafts=False``
    turns speculative drafting off (whether a tier speculates, and so how its tokens are grouped
    into stream chunks, follows step times measured as it runs)."""
    import os

    from tests.fixtures import tiny_policy_yaml

    os.environ[keys_env] = keys
    path = policy_dir / "policy.yaml"
    text = tiny_policy_yaml(model_dir, cache_enabled=False, auth=f"{{mode: keys, api_keys_env: {keys_env}}}")
    text = text.replace("max_model_len: 256", "max_model_len: 1024")  # tool prompts are long
    if not drafts:
        text = text.replace("draft: small", "draft: null").replace("draft: medium", "draft: null")
    path.write_text(text)
    srv, stop = start_server(path, watch_policy=False)
    try:
        yield srv
    finally:
        stop()
        os.environ.pop(keys_env, None)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("policy") / "policy.yaml"
    path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False))
    srv, stop = start_server(path)
    yield srv
    stop()
