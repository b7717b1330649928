"""A lean HTTP/1.1 client for load generation: one keep-alive connection per simulated client,
request bytes written by hand, responses read with ``asyncio`` streams (content-length or
chunked bodies, SSE lines).

Why not httpx here: on a 2-core machine the load generator shares the CPU with the server it
measures. httpx spends milliseconds of Python per request; at 4x overload (~100 requests/s, most
of them refused) the generator's own event loop fell seconds behind, so the rejection latency it
reported (p99 2.8 s) was its own lag - a curl probe against the same server at the same time saw
/healthz answered in 2 ms (p50) and 12 ms at worst. This client costs a fraction of that, and the
benchmarks also record the server's own ``Server-Timing`` for each answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["Connection", "Response"]


class Response:
    def __init__(self, status: int, headers: dict[str, str], conn: Connection) -> None:
        self.status = status
        self.headers = headers
        self._conn = conn

    async def _chunks(self) -> AsyncIterator[bytes]:
        reader = self._conn.reader
        assert reader is not None
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    await reader.readline()  # the empty trailer line
                    break
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        else:
            length = int(self.headers.get("content-length", "0"))
            if length:
                yield await reader.readexactly(length)
        if self.headers.get("connection", "").lower() == "close":
            self._conn.close()

    async def read(self) -> bytes:
        return b"".join([c async for c in self._chunks()])

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines (SSE ``data: ...`` lines among them), decoded."""
        buf = b""
        async for chunk in self._chunks():
            buf += chunk
            *complete, buf = buf.split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r").decode()
        if buf:
            yield buf.decode()


class Connection:
    """One keep-alive connection, reopened when the server closed it or a request failed."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def post(self, path: str, payload: dict[str, Any], headers: dict[str, str]) -> Response:
        """Send a JSON POST; returns once the status line and headers are in. Read the body (``read``
        or ``lines``) before the next request on this connection; on any error call ``close``."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps(payload).encode()
        head = [
            f"POST {path} HTTP/1.1",
            f"host: {self.host}:{self.port}",
            "content-type: application/json",
            f"content-length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        assert self.reader is not None
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionResetError("server closed the connection")
        status = int(status_line.split(b" ", 2)[1])
        out: dict[str, str] = {}
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            out[k.strip().lower()] = v.strip()
        return Response(status, out, self)
