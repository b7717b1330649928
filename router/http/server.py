"""The HTTP server around the app: uvicorn (httptools + uvloop) with the limits a public endpoint
needs, and the admin listener for operator endpoints.

uvicorn bounds idle keep-alive connections and total concurrency (``limit_concurrency``) but not
how long a client may take to send its request head, so a slow-loris client could hold
connections open indefinitely by trickling header bytes, nor how large the head may grow (httptools
buffers a header line until it ends). ``GuardedHttpToolsProtocol`` adds both: a request head must
arrive within ``header_timeout_s`` (else 408 and close) and in at most ``max_head_bytes`` (else 431
and close), counted as the bytes arrive, before the parser, routing or the app see them. Body read
time is bounded in ``router.http.middleware`` (408 between chunks).

Optionally one client may hold at most ``max_connections_per_client`` connections (off by
default: behind an ingress or a Kubernetes Service every connection comes from the proxy's
address, and a cap on it turns away healthy traffic). A client is the peer address, or, for a
peer listed in ``trusted_proxies``, the address the proxy reports in ``X-Forwarded-For``, counted
per request in progress. Every refusal is a complete HTTP response with ``Retry-After`` given
once the request head is in (429 for the per-client cap; 503, JSON, for ``max_connections``),
never a connection closed under a client that has not sent its request yet; the probes
(``/healthz``, ``/health``, ``/readyz``) are never refused by either, so a kubelet does not mark
a busy pod unready.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["PROBE_PATHS", "GuardedHttpToolsProtocol", "ServerLimits", "protocol_class"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    header_timeout_s: float = 10.0
    """A request head (request line + headers) must arrive within this; else 408."""
    max_head_bytes: int = 64 * 1024
    """A request head (request line + headers) may be at most this many bytes; else 431 (h11's and
    nginx's order of size)."""
    body_timeout_s: float = 30.0
    """Longest pause between two body chunks; else 408."""
    keep_alive_s: int = 5
    """Idle keep-alive connections close after this."""
    max_connections: int = 1024
    """Connections + in-progress requests; beyond it a request gets 503 with Retry-After."""
    max_connections_per_client: int = 0
    """Connections (or, through a trusted proxy, requests in progress) one client may hold; 0 = no
    cap (the default: behind a proxy without ``trusted_proxies`` every client is the proxy)."""
    trusted_proxies: frozenset[str] = frozenset()
    """Peer addresses whose ``X-Forwarded-For`` names the client (an ingress, a load balancer)."""


PROBE_PATHS = frozenset({b"/healthz", b"/health", b"/readyz"})
"""Never refused by the connection limits: a probe that fails under load restarts a busy pod."""

OVER_CAP_HEAD_S = 1.0
"""An over-cap connection whose head has not arrived by then gets its 429 anyway."""


def _json_body(message: str, error_type: str, code: str) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    ).encode()


def _response(status: bytes, message: bytes, extra: bytes = b"") -> bytes:
    body = (
        b'{"error": {"message": "'
        + message
        + b'", "type": "invalid_request_error", "param": null, "code": null}}'
    )
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
        + extra
        + b"content-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def _refusal(status: int, message: str, error_type: str, code: str, *, close: bool) -> Any:
    """An ASGI app answering every request with ``status`` and ``Retry-After`` (uvicorn runs it in
    place of the app, after the head, so the client reads a whole response)."""
    body = _json_body(message, error_type, code)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
    ]
    if close:
        headers.append((b"connection", b"close"))

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


_TOO_MANY_CONNECTIONS = _refusal(
    429, "Too many connections from this client.", "rate_limit_error", "too_many_connections", close=True
)
_TOO_MANY_REQUESTS = _refusal(
    429,
    "Too many requests in progress from this client.",
    "rate_limit_error",
    "too_many_requests",
    close=False,
)
_OVERLOADED = _refusal(
    503, "The server is at its connection limit; retry shortly.", "server_error", "overloaded", close=True
)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    limits: ClassVar[ServerLimits] = ServerLimits()
    per_client: ClassVar[Counter[str]] = Counter()
    """Open connections (or forwarded requests in progress) per client, for one listener."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # The concurrency limit is applied here (probes exempt, a JSON 503 with Retry-After).
        self.limit_concurrency = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._counted: str | None = None
        self._forwarded: list[str | None] = []
        self._over_cap = False
        self._head_bytes: int | None = 0
        """Bytes of the request head received so far; ``None`` from its end to the next request's."""
        ip = self.client[0] if self.client else None
        cap = self.limits.max_connections_per_client
        if ip is not None and cap > 0 and ip not in self.limits.trusted_proxies:
            if self.per_client[ip] >= cap:
                # Refused, but only once its request head is in (or briefly overdue): a client
                # that has not sent its request yet would read a reset, not this answer.
                self._over_cap = True
            else:
                self.per_client[ip] += 1
                self._counted = ip
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._counted is not None:
            self._uncount(self._counted)
            self._counted = None
        for client in self._forwarded:
            if client is not None:
                self._uncount(client)
        self._forwarded.clear()
        super().connection_lost(exc)

    def _uncount(self, client: str) -> None:
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]

    def data_received(self, data: bytes) -> None:
        """Counts the head's bytes before the parser sees them: past ``max_head_bytes`` without the
        head's end, 431 and close, so the parser never buffers more than that. Data is fed at most
        the head's remaining room at a time; a pipelined request's head that begins inside one such
        part is counted from the next, so a head holds at most twice the limit."""
        while data:
            if self._head_bytes is None:  # the body, or whatever follows a complete head
                super().data_received(data)
                return
            room = self.limits.max_head_bytes - self._head_bytes
            if room <= 0:
                self._head_too_large()
                return
            part, data = data[:room], data[room:]
            self._head_bytes += len(part)
            super().data_received(part)
            if self.transport is None or self.transport.is_closing():
                return

    def _head_too_large(self) -> None:
        self._cancel_head_timer()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(
                _response(b"431 Request Header Fields Too Large", b"Request header fields are too large.")
            )
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_timer()  # each request on a kept-alive connection gets the same bound

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_bytes = 0  # what follows on this connection is the next request's head

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        self._head_bytes = None
        path = self.url.split(b"?", 1)[0]
        refusal, counted = (None, None) if path in PROBE_PATHS else self._refusal()
        if self.client is not None and self.client[0] in self.limits.trusted_proxies:
            self._forwarded.append(counted)  # one entry per request, taken at its response
        app = self.app
        if refusal is not None:
            self.app = refusal
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def _refusal(self) -> tuple[Any, str | None]:
        """The refusing app for this request (None: serve it), and the forwarded client it was
        counted against (None: not counted)."""
        if self._over_cap:
            return _TOO_MANY_CONNECTIONS, None
        limit = self.limits.max_connections
        if limit and (len(self.connections) >= limit or len(self.tasks) >= limit):
            return _OVERLOADED, None
        cap = self.limits.max_connections_per_client
        if cap > 0 and self.client is not None and self.client[0] in self.limits.trusted_proxies:
            client = self._forwarded_for()
            if client is not None:
                if self.per_client[client] >= cap:
                    return _TOO_MANY_REQUESTS, None
                self.per_client[client] += 1
                return None, client
        return None, None

    def _forwarded_for(self) -> str | None:
        """The client a trusted proxy names: the last ``X-Forwarded-For`` entry (the one the
        proxy itself appended; earlier entries are the client's own claims)."""
        for name, value in self.scope["headers"]:
            if name.lower() == b"x-forwarded-for":
                last = value.decode("latin-1").rsplit(",", 1)[-1].strip()
                return last or None
        return None

    def on_response_complete(self) -> None:
        if self._forwarded:
            client = self._forwarded.pop(0)
            if client is not None:
                self._uncount(client)
        super().on_response_complete()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        timeout = self.limits.header_timeout_s
        if getattr(self, "_over_cap", False):
            timeout = min(timeout, OVER_CAP_HEAD_S)
        self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport is not None and not self.transport.is_closing():
            if self._over_cap:
                response = _response(
                    b"429 Too Many Requests", b"Too many connections from this client.", b"retry-after: 1\r\n"
                )
            else:
                response = _response(b"408 Request Timeout", b"Request headers took too long.")
            self.transport.write(response)
            self.transport.close()


def protocol_class(limits: ServerLimits) -> type[GuardedHttpToolsProtocol]:
    """A protocol class bound to ``limits``, with its own per-client table (one per listener)."""
    return type(
        "GuardedHttpTools",
        (GuardedHttpToolsProtocol,),
        {"limits": limits, "per_client": Counter()},
    )


def uvicorn_config(app: Any, host: str, port: int, limits: ServerLimits, **kwargs: Any) -> Any:
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_class(limits),
        limit_concurrency=limits.max_connections,
        timeout_keep_alive=limits.keep_alive_s,
        **kwargs,
    )
