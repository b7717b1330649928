"""The per-client connection table of the guarded HTTP protocol (router/http/server.py): a
client's count goes down by one per connection closed and its entry goes only when none is left."""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

from router.http.server import GuardedHttpToolsProtocol


class _Table(GuardedHttpToolsProtocol):
    per_client: ClassVar[Counter[str]] = Counter()


def test_closing_one_of_two_connections_keeps_the_other_counted() -> None:
    """Bug it catches: the entry deleted while the client still holds a connection (``<= 1`` for
    ``<= 0``): its next connections pass the per-client cap uncounted."""
    proto = object.__new__(_Table)
    _Table.per_client.clear()
    _Table.per_client.update({"10.0.0.1": 2, "10.0.0.2": 1})
    proto._uncount("10.0.0.1")
    assert _Table.per_client["10.0.0.1"] == 1
    proto._uncount("10.0.0.1")
    assert "10.0.0.1" not in _Table.per_client
    proto._uncount("10.0.0.2")
    assert not _Table.per_client


class _Transport:
    def __init__(self, closing: bool = False) -> None:
        self.written: list[bytes] = []
        self.closed = closing

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _timed_out(over_cap: bool, transport: _Transport | None) -> None:
    proto = object.__new__(_Table)
    proto.transport = transport  # type: ignore[assignment]
    proto._over_cap = over_cap
    proto._head_timer = None
    proto._head_timed_out()


def test_a_head_that_never_completes_gets_408_and_a_closed_connection() -> None:
    """Bug it catches: the timer's guard inverted (``is None``) - a slow-loris head is never
    answered or closed, and holds its connection slot for good."""
    transport = _Transport()
    _timed_out(False, transport)
    assert transport.closed
    assert len(transport.written) == 1 and transport.written[0].startswith(b"HTTP/1.1 408 ")


def test_an_over_cap_client_that_sends_no_head_gets_its_429_at_the_timer() -> None:
    transport = _Transport()
    _timed_out(True, transport)
    assert transport.closed
    (answer,) = transport.written
    assert answer.startswith(b"HTTP/1.1 429 ") and b"retry-after: 1\r\n" in answer.lower()


def test_a_connection_already_closing_or_gone_is_left_alone() -> None:
    closing = _Transport(closing=True)
    _timed_out(False, closing)
    assert closing.written == []
    _timed_out(False, None)  # the transport went away before the timer fired: nothing to do
