"""Issue 37: the per-client cap behind a trusted proxy counts the client its ``X-Forwarded-For``
names (per request in progress), not the proxy's one address; its counts are given back with
each response. A tiny ASGI app, no model: only the protocol's accounting is under test."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from router.http.server import ServerLimits, uvicorn_config
from tests.router.conftest import free_port


def _app(release: threading.Event) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/hold":
            while not release.is_set():
                await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


@pytest.fixture
def proxied() -> Iterator[tuple[str, threading.Event, Any]]:
    import uvicorn

    release = threading.Event()
    port = free_port()
    limits = ServerLimits(max_connections_per_client=2, trusted_proxies=frozenset({"127.0.0.1"}))
    config = uvicorn_config(_app(release), "127.0.0.1", port, limits, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield url, release, config.http  # the protocol class: its per_client table
    release.set()
    server.should_exit = True
    thread.join(10)


def _get(url: str, path: str, client: str) -> httpx.Response:
    return httpx.get(url + path, headers={"x-forwarded-for": f"203.0.113.9, {client}"}, timeout=20)


def test_the_cap_counts_forwarded_clients_not_the_proxy(proxied: tuple[str, threading.Event, Any]) -> None:
    url, release, protocol = proxied
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        held = [pool.submit(_get, url, "/hold", "10.0.0.1") for _ in range(2)]
        deadline = time.monotonic() + 10
        while protocol.per_client["10.0.0.1"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # until both are in progress (the app holds them)
        assert protocol.per_client["10.0.0.1"] == 2 and "127.0.0.1" not in protocol.per_client
        refused = _get(url, "/other", "10.0.0.1")
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "too_many_requests"
        # Another client behind the same proxy, and a probe, are served meanwhile.
        assert _get(url, "/other", "10.0.0.2").status_code == 200
        assert _get(url, "/readyz", "10.0.0.1").status_code == 200
        # A probe is told by its path alone, whatever its query holds (a second '?' included).
        assert _get(url, "/readyz?probe=1?again", "10.0.0.1").status_code == 200
        release.set()
        assert [f.result().status_code for f in held] == [200, 200]
    # The counts went back with the responses (a refused request never took one).
    for _ in range(3):
        assert _get(url, "/other", "10.0.0.1").status_code == 200
    assert not protocol.per_client
