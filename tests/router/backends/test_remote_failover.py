"""Issue 55: a remote tier that fails before its first byte (a connect error, a 5xx) falls back
along ``routing.fallback`` as an open circuit does, instead of answering the client's request
with the upstream's failure; a 4xx, or a failure after the first byte, is still the answer. The
upstream is the scriptable fake of ``test_remote_hardening``; the fallback tier is the tiny model."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.router.backends.test_remote_hardening import Upstream, _handler
from tests.router.conftest import Server, start_server


def _policy(tiny_model_dir: Path, url: str) -> str:
    return f"""
version: 1
tiers:
  small:
    model: {tiny_model_dir}
    quantization: int8
    max_num_seqs: 4
    max_model_len: 256
    defaults: {{max_tokens: 4, temperature: 0}}
  large:
    model: "{url}"
    max_retries: 0
    timeout_s: 30
    circuit_failures: 100
routing:
  rules:
    - {{name: default, tier: small}}
  fallback: {{large: small, small: null}}
service:
  auth: {{mode: open}}
  cache: {{enabled: false}}
"""


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[Upstream, str]]:
    state = Upstream()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield state, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    state.hold.set()
    httpd.shutdown()


@pytest.fixture(scope="module")
def front(
    upstream: tuple[Upstream, str], tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("failover") / "policy.yaml"
    path.write_text(_policy(tiny_model_dir, upstream[1]))
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()


@pytest.fixture
def state(upstream: tuple[Upstream, str], front: Server) -> Upstream:
    st = upstream[0]
    st.mode, st.status, st.headers, st.error_message = "ok", 200, {}, ""
    st.bodies.clear()
    return st


def _chat(front: Server, **extra: Any) -> httpx.Response:
    body = {"model": "large", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    return httpx.post(front.url + "/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_a_5xx_before_the_first_byte_is_answered_by_the_fallback_tier(
    front: Server, state: Upstream, stream: bool
) -> None:
    """Bug it catches: the upstream's 500 (llama.cpp restarting, a proxy's 502) reached the client
    as a 502 although ``routing.fallback`` names a healthy tier."""
    ok = _chat(front)
    assert ok.status_code == 200 and ok.headers["x-router-tier"] == "large"
    assert ok.json()["choices"][0]["message"]["content"] == "hello"  # the upstream's own answer
    state.mode = "down"
    r = _chat(front, stream=stream)
    assert r.status_code == 200, r.text
    assert r.headers["x-router-tier"] == "small"
    assert len(state.bodies) == 2  # the upstream was asked, and failed, before the fallback
    if stream:
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks)
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_4xx_from_the_upstream_is_the_answer_not_a_fallback(front: Server, state: Upstream) -> None:
    """Bug it would catch: a request the upstream refused (its 400, its 401) silently answered by
    another tier - a client error is not an outage."""
    state.mode, state.status, state.error_message = "status", 400, "bad request upstream"
    r = _chat(front)
    assert r.status_code == 400, r.text
    assert "x-router-tier" not in r.headers or r.headers["x-router-tier"] == "large"


def test_an_unreachable_upstream_falls_back(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A connect error (nothing listens on the port) before any byte: the fallback answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again at once: connections are refused
    path = tmp_path / "policy.yaml"
    path.write_text(_policy(tiny_model_dir, f"http://127.0.0.1:{port}/v1"))
    srv, stop = start_server(path, watch_policy=False)
    try:
        r = _chat(srv)
        assert r.status_code == 200, r.text
        assert r.headers["x-router-tier"] == "small"
    finally:
        stop()
