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
