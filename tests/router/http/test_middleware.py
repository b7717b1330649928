"""The router's ASGI middleware (router/http/middleware.py) through a running service on the tiny
tiers: the header-size bound counts names and values, a body of exactly ``max_body_bytes`` is
read and one byte more is a 413 (bodies without a declared length too), and a refusal on
``/v1/messages`` is worded in Anthropic's error shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
from opentelemetry.trace import StatusCode

from router.http.middleware import (
    LISTENER_KEY,
    MAX_HEADER_BYTES,
    admin_listener,
    is_operator_path,
    router_middleware,
)
from tests.router.conftest import Server

CHAT = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
MESSAGES = {"model": "small", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def _padded(body: dict[str, object], size: int) -> bytes:
    """``body`` as JSON followed by spaces up to exactly ``size`` bytes (still valid JSON)."""
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


def _chunked(raw: bytes) -> Iterator[bytes]:
    """The body in 64 KiB pieces from a generator: httpx sends it chunked, with no length."""
    for i in range(0, len(raw), 65536):
        yield raw[i : i + 65536]


def test_headers_over_the_bound_are_a_431_counting_values_too(server: Server) -> None:
    """Bug it catches: the bound summing ``len(name) - len(value)`` - one huge header value
    passes, and the whole head is parsed into a dict on every request."""
    big = {"x-pad": "v" * (MAX_HEADER_BYTES + 10)}
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=big, timeout=30)
    assert r.status_code == 431
    assert r.json()["error"]["code"] == "headers_too_large"
    under = {"x-pad": "v" * (MAX_HEADER_BYTES - 4096)}
    ok = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=under, timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_refusal_on_v1_messages_has_anthropics_shape(server: Server) -> None:
    """Bug it catches: the middleware's refusals worded OpenAI's way on ``/v1/messages`` - the
    Anthropic SDK reads ``{"type": "error", "error": {"type", "message"}}`` and nothing else."""
    big = {"x-pad": "v" * (MAX_HEADER_BYTES + 10)}
    r = httpx.post(server.url + "/v1/messages", json=MESSAGES, headers=big, timeout=30)
    assert r.status_code == 431
    body = r.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "too large" in body["error"]["message"]


def test_a_chunked_body_of_exactly_the_limit_is_read_and_one_byte_more_is_413(server: Server) -> None:
    """Bug it catches: ``>=`` for ``>`` in the running count of body bytes - a body of exactly
    ``max_body_bytes`` refused although the policy allows it."""
    limit = server.service.policy.service.max_body_bytes
    url = server.url + "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    at = httpx.post(url, content=_chunked(_padded(CHAT, limit)), headers=headers, timeout=60)
    assert at.status_code == 200, at.text[:300]
    over = httpx.post(url, content=_chunked(_padded(CHAT, limit + 1)), headers=headers, timeout=60)
    assert over.status_code == 413
    assert over.json()["error"]["type"] == "invalid_request_error"


def test_a_declared_length_over_the_limit_is_refused_before_the_body(server: Server) -> None:
    limit = server.service.policy.service.max_body_bytes
    url = server.url + "/v1/chat/completions"
    at = httpx.post(
        url, content=_padded(CHAT, limit), headers={"content-type": "application/json"}, timeout=60
    )
    assert at.status_code == 200, at.text[:300]
    over = httpx.post(
        url, content=_padded(CHAT, limit + 1), headers={"content-type": "application/json"}, timeout=60
    )
    assert over.status_code == 413


class _Span:
    def __init__(self) -> None:
        self.attributes: dict[str, object] = {}
        self.status: object = None
        self.ended = False

    def set_attribute(self, key: str, value: object) -> None:
        self.attributes[key] = value

    def set_status(self, status: object) -> None:
        self.status = status

    def end(self) -> None:
        self.ended = True


def _traced_request(status: int) -> _Span:
    """One GET /v1/models through ``router_middleware`` with tracing on, its app answering
    ``status``; the server span it opened."""
    span = _Span()
    telemetry = SimpleNamespace(tracing_enabled=True, server_span=lambda *a: span)
    auth = SimpleNamespace(authenticate=lambda headers: "caller")
    state = SimpleNamespace(telemetry=telemetry, auth=auth, admin_separate=False)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v1/models",
        "headers": [],
        "app": SimpleNamespace(state=state),
    }
    asyncio.run(router_middleware(app)(scope, receive, send))
    assert sent[0]["status"] == status and span.ended
    assert span.attributes["http.response.status_code"] == status
    return span


def test_a_5xx_answer_marks_the_server_span_as_an_error_and_a_4xx_does_not() -> None:
    """Bug it catches: the error bound at ``>= 501`` - a plain 500 shows as a healthy span in
    Jaeger, so the trace search for failed requests misses exactly the internal errors."""
    failed = _traced_request(500)
    assert failed.status is not None and failed.status.status_code == StatusCode.ERROR  # type: ignore[attr-defined]
    assert _traced_request(503).status is not None
    assert _traced_request(429).status is None
    assert _traced_request(200).status is None


def test_operator_paths_are_the_listed_ones_and_the_schema_and_admin_trees() -> None:
    """Bug it catches: the test inverted or a prefix dropped - ``/v1/...`` served on the admin
    port, or ``/metrics`` (tenant names, tier load) on the public one when the ports are split."""
    for path in (
        "/metrics",
        "/dashboard",
        "/dashboard/data",
        "/schema",
        "/schema/openapi.json",
        "/admin/reload",
    ):
        assert is_operator_path(path), path
    for path in ("/v1/models", "/v1/chat/completions", "/schemas", "/metricsx", "/healthz", "/"):
        assert not is_operator_path(path), path


def test_the_admin_listener_marks_its_requests_and_passes_the_channels_through() -> None:
    seen: list[tuple[dict[str, Any], Any, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append((scope, receive, send))

    async def receive() -> dict[str, Any]:
        return {}

    async def send(message: dict[str, Any]) -> None:
        return None

    original = {"type": "http", "path": "/metrics"}
    asyncio.run(admin_listener(app)(original, receive, send))
    asyncio.run(admin_listener(app)({"type": "lifespan"}, receive, send))
    (scope, got_receive, got_send), (life, _, _) = seen
    assert scope[LISTENER_KEY] == "admin" and got_receive is receive and got_send is send
    assert LISTENER_KEY not in original  # the server's own scope is left as it was
    assert LISTENER_KEY not in life


def test_only_api_paths_get_a_server_span() -> None:
    """Bug it catches: every request traced - each probe and metrics scrape a root span, and the
    traces of real requests drown in them in Jaeger."""
    opened: list[str] = []
    telemetry = SimpleNamespace(
        tracing_enabled=True, server_span=lambda name, *a: opened.append(name) or _Span()
    )
    state = SimpleNamespace(
        telemetry=telemetry, auth=SimpleNamespace(authenticate=lambda h: "c"), admin_separate=False
    )

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message: dict[str, Any]) -> None:
        return None

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    for path in ("/healthz", "/metrics", "/v1/models"):
        scope = {
            "type": "http",
            "method": "GET",
            "path": path,
            "headers": [],
            "app": SimpleNamespace(state=state),
        }
        asyncio.run(router_middleware(app)(scope, receive, send))
    assert opened == ["GET /v1/models"]
