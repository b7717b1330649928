"""The HTTP server around the app: uvicorn (httptools + uvloop) with the limits a public endpoint
needs, and the admin listener for operator endpoints.

uvicorn bounds idle keep-alive connections and total concurrency (``limit_concurrency``: 503
beyond it) but not how long a client may take to send its request head, so a slow-loris client
could hold connections open indefinitely by trickling header bytes. ``GuardedHttpToolsProtocol``
adds that: a request head must arrive within ``header_timeout_s`` (else 408 and close), and one
client address may hold at most ``max_connections_per_client`` connections at once (beyond that
a new connection gets 429 and is closed), so a single client cannot take more than its share of
``max_connections``. Body read time is bounded in ``router.middleware`` (408 between chunks).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["GuardedHttpToolsProtocol", "ServerLimits", "protocol_class"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    header_timeout_s: float = 10.0
    """A request head (request line + headers) must arrive within this; else 408."""
    body_timeout_s: float = 30.0
    """Longest pause between two body chunks; else 408."""
    keep_alive_s: int = 5
    """Idle keep-alive connections close after this."""
    max_connections: int = 1024
    """Connections + in-progress requests; beyond it uvicorn answers 503."""
    max_connections_per_client: int = 256
    """Connections one client address may hold (0 = no limit; behind a proxy every client shares
    the proxy's address, so size it for the proxy or turn it off)."""


def _response(status: bytes, message: bytes) -> bytes:
    body = (
        b'{"error": {"message": "'
        + message
        + b'", "type": "invalid_request_error", "param": null, "code": null}}'
    )
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    limits: ClassVar[ServerLimits] = ServerLimits()
    per_client: ClassVar[Counter[str]] = Counter()
    """Open connections per client address, shared by every connection of one listener."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._counted: str | None = None
        ip = self.client[0] if self.client else None
        cap = self.limits.max_connections_per_client
        if ip is not None and cap > 0:
            if self.per_client[ip] >= cap:
                transport.write(
                    _response(b"429 Too Many Requests", b"Too many connections from this client.")
                )
                transport.close()
                return
            self.per_client[ip] += 1
            self._counted = ip
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._counted is not None:
            self.per_client[self._counted] -= 1
            if self.per_client[self._counted] <= 0:
                del self.per_client[self._counted]
            self._counted = None
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_timer()  # each request on a kept-alive connection gets the same bound

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_response(b"408 Request Timeout", b"Request headers took too long."))
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
