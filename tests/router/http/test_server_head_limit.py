"""Issue 55: the request head is bounded where it is parsed. A header line that never ends is cut
off with 431 once ``max_head_bytes`` have arrived (before the parser buffers more, before routing
and before the app), on a connection the server then closes; heads within the limit, kept-alive
and pipelined requests are served as before. A tiny ASGI app, no model: only the protocol is under
test (the middleware's own 64 KiB check runs after the whole head is in, and would not catch it)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from router.http.server import ServerLimits, uvicorn_config
from tests.router.conftest import free_port

LIMIT = 8 * 1024


def _app(calls: list[str]) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


@pytest.fixture
def server() -> Iterator[tuple[int, list[str]]]:
    import uvicorn

    calls: list[str] = []
    port = free_port()
    config = uvicorn_config(
        _app(calls), "127.0.0.1", port, ServerLimits(max_head_bytes=LIMIT), lifespan="off"
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield port, calls
    srv.should_exit = True
    thread.join(10)


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    sock.settimeout(10)
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _trickle_endless_header(port: int, chunk: int, total: int) -> tuple[int, bytes]:
    """Sends one header line that never ends, ``chunk`` bytes at a time; returns how many bytes the
    server took before it answered and closed, and what it answered."""
    sock = socket.create_connection(("127.0.0.1", port))
    sent = 0
    try:
        sock.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\nx-long: ")
        while sent < total:
            try:
                sock.sendall(b"a" * chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += chunk
            time.sleep(0.001)
        return sent, _read_all(sock)
    except (ConnectionResetError, TimeoutError):
        return sent, b""
    finally:
        sock.close()


def test_a_header_line_that_never_ends_gets_431_and_a_closed_connection(
    server: tuple[int, list[str]],
) -> None:
    """Catches the head bounded by time only (the parser took tens of MB per connection in 8 s)."""
    port, calls = server
    sent, answer = _trickle_endless_header(port, 4096, 4 * 1024 * 1024)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"too large" in answer
    assert sent < 1024 * 1024  # cut off long before the client was done (socket buffers aside)
    assert calls == []  # the app never saw it


def test_an_oversized_head_in_one_write_is_refused_too(server: tuple[int, list[str]]) -> None:
    """Catches the count skipped when the whole excess arrives in one read (split at the limit)."""
    port, calls = server
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\nx-long: " + b"a" * (3 * LIMIT) + b"\r\n\r\n")
        assert _read_all(sock).startswith(b"HTTP/1.1 431 ")
    assert calls == []


def test_heads_inside_the_limit_and_pipelined_requests_are_served(server: tuple[int, list[str]]) -> None:
    """Catches the count not reset per request: a kept-alive connection whose heads add up past
    the limit must still be served, and a body after a small head is not head bytes."""
    port, calls = server
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        for i in range(5):  # 5 x ~6 KiB heads on one connection: 30 KiB in all, past LIMIT
            r = client.post(f"/ok{i}", headers={"x-pad": "b" * (6 * 1024)}, content=b"c" * (64 * 1024))
            assert r.status_code == 200, r.text
    # Two requests in one write (pipelined): both answered.
    with socket.create_connection(("127.0.0.1", port)) as sock:
        one = b"GET /p HTTP/1.1\r\nhost: t\r\nx-pad: " + b"d" * (5 * 1024) + b"\r\n\r\n"
        sock.sendall(
            one
            + one.replace(b"connection", b"c")
            + b"GET /q HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"
        )
        answer = _read_all(sock)
    assert answer.count(b"HTTP/1.1 200 ") == 3, answer[:300]
    assert calls[-3:] == ["/p", "/p", "/q"]


def test_the_serve_option_sets_the_limit() -> None:
    """Catches ``--max-header-bytes`` parsed but not passed into the listeners' limits."""
    from router.cli import build_parser, server_limits

    args = build_parser().parse_args(["serve", "--policy", "x.yaml", "--max-header-bytes", "12345"])
    assert server_limits(args).max_head_bytes == 12345
    default = build_parser().parse_args(["serve", "--policy", "x.yaml"])
    assert server_limits(default).max_head_bytes == 64 * 1024
