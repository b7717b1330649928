"""Closing a response's source (router/http/routes.py, ``_aclose_quietly``): the source's
``aclose`` runs (that is what aborts its engine request), an error in it is not the client's,
and a source without one is fine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from router.http.routes import _aclose_quietly


class _Source:
    def __init__(self, fail: bool = False) -> None:
        self.closed = 0
        self.fail = fail

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed += 1
        if self.fail:
            raise RuntimeError("engine gone")


def test_closing_runs_the_sources_aclose_and_swallows_its_error() -> None:
    """Bug it catches: ``aclose`` looked up on the wrong object - nothing is closed and the
    engine keeps generating for a client that left."""
    ok, failing = _Source(), _Source(fail=True)
    asyncio.run(_aclose_quietly(ok))
    asyncio.run(_aclose_quietly(failing))
    assert (ok.closed, failing.closed) == (1, 1)


def test_a_source_without_aclose_is_left_as_it_is() -> None:
    class Plain:
        def __aiter__(self) -> AsyncIterator[bytes]:
            return self

        async def __anext__(self) -> bytes:
            raise StopAsyncIteration

    asyncio.run(_aclose_quietly(Plain()))
