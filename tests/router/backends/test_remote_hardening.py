"""Issue 37, remote tiers: what the router sends a strict upstream (llama.cpp's server refuses
nulls), how its circuit recovers after a trial cut short, how a burst is admitted, and how an
upstream's auth failures and odd ``Retry-After`` values reach the client. The upstream is a small
scriptable OpenAI-compatible server on loopback; each test failed on the code before the fix."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.router.conftest import Server, start_server


@dataclass
class Upstream:
    """What the fake upstream does next, and what it saw."""

    mode: str = "ok"  # ok | down | slow | status
    strict: bool = False
    """Refuse a null anywhere in ``messages`` with a 500, as llama.cpp's server does."""
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    error_message: str = ""
    hold: threading.Event = field(default_factory=threading.Event)
    """``slow`` answers wait for this (set it to let them go)."""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    active: int = 0
    max_active: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _has_null(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, dict):
        return any(_has_null(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_null(v) for v in value)
    return False


def _handler(state: Upstream) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with state.lock:
                state.bodies.append(body)
                state.active += 1
                state.max_active = max(state.max_active, state.active)
            try:
                self._answer(body)
            finally:
                with state.lock:
                    state.active -= 1

        def _answer(self, body: dict[str, Any]) -> None:
            if state.mode == "status":
                err = json.dumps({"error": {"message": state.error_message, "type": "auth"}}).encode()
                self._send(state.status, err, {"content-type": "application/json", **state.headers})
                return
            if state.mode == "down" or (state.strict and _has_null(body.get("messages", []))):
                # llama.cpp: "[json.exception.type_error.302] type must be string, but is null"
                self._send(500, b'{"error": {"message": "type must be string, but is null"}}', {})
                return
            if state.mode == "slow":
                state.hold.wait(30)
            chat = self.path.endswith("/chat/completions")
            piece: dict[str, Any] = {"delta": {"content": "hello"}} if chat else {"text": "hello"}
            end: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
            chunks: list[dict[str, Any]] = [
                {"choices": [{"index": 0, **piece, "finish_reason": None}]},
                {"choices": [{"index": 0, **end, "finish_reason": "stop"}]},
                {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}},
            ]
            sse = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
            self._send(200, sse, {"content-type": "text/event-stream"})

    return Handler


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[Upstream, str]]:
    state = Upstream()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    state.hold.set()
    httpd.shutdown()


@pytest.fixture(scope="module")
def front(
    upstream: tuple[Upstream, str], tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    _, url = upstream
    text = f"""
version: 1
tiers:
  small:
    model: {tiny_model_dir}
    quantization: int8
    max_num_seqs: 4
    max_model_len: 256
    defaults: {{max_tokens: 8, temperature: 0}}
  large:
    model: "{url}"
    max_retries: 0
    timeout_s: 30
    max_num_seqs: 1
    max_queue: 1
    circuit_failures: 1
    circuit_cooldown_s: 0.2
routing:
  rules:
    - {{name: default, tier: small}}
  fallback: {{small: null, large: null}}
service:
  auth: {{mode: open}}
  cache: {{enabled: false}}
"""
    path = tmp_path_factory.mktemp("front") / "policy.yaml"
    path.write_text(text)
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()


@pytest.fixture
def state(upstream: tuple[Upstream, str], front: Server) -> Iterator[Upstream]:
    st = upstream[0]
    st.mode, st.status, st.headers, st.error_message, st.strict = "ok", 200, {}, "", False
    st.hold.clear()
    st.bodies.clear()
    st.max_active = 0
    yield st
    st.hold.set()
    _wait_closed(front)


def _circuit(front: Server) -> Any:
    return front.service.tiers.tiers["large"].client.circuit


def _wait_closed(front: Server) -> None:
    """Until the circuit lets a request through (after its cooldown), polling with a deadline."""
    deadline = time.monotonic() + 10
    while _circuit(front).open_for() not in (None,) and time.monotonic() < deadline:
        time.sleep(0.02)


def _chat(front: Server, **extra: Any) -> httpx.Response:
    headers = extra.pop("headers", {})
    body = {"model": "large", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body.update(extra)
    return httpx.post(front.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_upstream_body_has_no_nulls_the_client_did_not_send(front: Server, state: Upstream) -> None:
    """Bug: the router forwarded its parsed messages with ``"name": null, "tool_calls": null...``;
    llama.cpp refuses them, so every request to it was a 502."""
    state.strict = True
    schema = {"type": "object", "properties": {"x": {"type": ["string", "null"], "default": None}}}
    r = _chat(
        front,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "hello"
    (sent,) = state.bodies
    assert sent["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    # A null the client wrote inside raw JSON (a schema default) is the client's: kept as sent.
    assert sent["response_format"]["json_schema"]["schema"] == schema
    assert sent["stream"] is True and sent["max_tokens"] == 4
    streamed = _chat(front, stream=True)
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
    comp = httpx.post(
        front.url + "/v1/completions", json={"model": "large", "prompt": "hi", "max_tokens": 4}, timeout=30
    )
    assert comp.status_code == 200 and comp.json()["choices"][0]["text"] == "hello"


def test_a_trial_cut_by_the_client_deadline_does_not_stick_the_circuit(
    front: Server, state: Upstream
) -> None:
    """Bug: the one half-open trial, when cancelled (client deadline or disconnect), left
    ``_trial`` set: every later request was a 503 even once the upstream was healthy."""
    state.mode = "down"
    assert _chat(front).status_code == 502  # one failure opens the circuit (circuit_failures: 1)
    assert _circuit(front).open_for() is not None
    _wait_closed(front)  # cooldown over: half-open, the next request is the trial
    state.mode = "slow"
    cut = _chat(front, headers={"x-request-timeout": "0.3"})
    assert cut.status_code == 503, cut.text  # the trial, cut short by the client's deadline
    state.hold.set()
    state.mode = "ok"
    _wait_closed(front)
    ok = _chat(front)
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-router-tier"] == "large"
    assert _circuit(front).open_for() is None  # closed again


def test_a_burst_is_admitted_against_reserved_slots_not_the_pool(front: Server, state: Upstream) -> None:
    """Bug: ``in_flight`` rose only once a handler first read its stream, so a burst was admitted
    against 0, then waited on the connection pool, whose ``PoolTimeout`` opened the circuit of a
    healthy upstream. Capacity here is max_num_seqs + max_queue = 2."""
    state.mode = "slow"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_chat, front) for _ in range(8)]
        deadline = time.monotonic() + 10
        while sum(f.done() for f in futures) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        state.hold.set()
        answers = [f.result() for f in futures]
    codes = sorted(r.status_code for r in answers)
    assert codes == [200, 200] + [429] * 6, codes
    assert all("retry-after" in r.headers for r in answers if r.status_code == 429)
    assert state.max_active <= 2
    assert _circuit(front).open_for() is None  # load is not an upstream failure
    assert front.service.tiers.tiers["large"].client.in_flight == 0


@pytest.mark.parametrize("status", [401, 403])
def test_upstream_auth_failure_is_a_502_without_its_headers(
    front: Server, state: Upstream, status: int
) -> None:
    """Bug: an upstream 401 reached the client as a 401 with the upstream's ``www-authenticate``
    and message: the client was told its own key was wrong, and saw the upstream's internals."""
    state.mode, state.status = "status", status
    state.headers = {"www-authenticate": 'Bearer realm="upstream-internal"'}
    state.error_message = "invalid key sk-upstream-secret"
    r = _chat(front)
    assert r.status_code == 502, r.text
    assert "www-authenticate" not in r.headers
    assert "sk-upstream-secret" not in r.text and "large" in r.json()["error"]["message"]


@pytest.mark.parametrize("value", ["inf", "nan", "-3", "1e400"])
def test_odd_retry_after_from_the_upstream_is_parsed_defensively(
    front: Server, state: Upstream, value: str
) -> None:
    """Bug: ``Retry-After: inf`` from the upstream crashed the error mapper (a 500)."""
    state.mode, state.status, state.headers = "status", 429, {"retry-after": value}
    state.error_message = "slow down"
    r = _chat(front)
    assert r.status_code == 429, r.text
    retry = float(r.headers["retry-after"])
    assert 0 <= retry <= 3600


def test_remote_best_of_above_n_returns_the_upstreams_choices(front: Server, state: Upstream) -> None:
    """Bug: a remote ``best_of > n`` always ended in a 500 after the upstream had done the work:
    the router tried to rank choices by token logprobs the upstream had already ranked."""
    r = httpx.post(
        front.url + "/v1/completions",
        json={"model": "large", "prompt": "hi", "max_tokens": 4, "n": 1, "best_of": 3},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == ["hello"]
    assert state.bodies[-1]["best_of"] == 3  # the upstream was asked for it
