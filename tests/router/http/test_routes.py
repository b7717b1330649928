"""Pieces of the route handlers (router/http/routes.py): closing a response's source (its
``aclose`` runs - that is what aborts its engine request - and an error in it is not the
client's), the call context read off a request (Cache-Control in any case, the authenticated
caller), and litestar's validation errors named as OpenAI names the field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx
from litestar.exceptions import ValidationException

from router.http.auth import Caller
from router.http.routes import _aclose_quietly, _context, _validation_param
from tests.router.conftest import Server


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


def _request(headers: dict[str, str], caller: object = None) -> object:
    return SimpleNamespace(headers=headers, scope={"state": {"caller": caller, "span": "span"}})


def test_the_call_context_reads_cache_control_in_any_case_and_the_authenticated_caller() -> None:
    """Bugs it catches: ``Cache-Control: No-Cache`` (any case, as RFC 9111 allows) not honoured,
    ``no-store`` not bypassing the response cache, the tenant taken from a raw header instead of
    the authenticated caller."""
    for value, expected in (
        ("No-Cache", True),
        ("max-age=0, NO-STORE", True),
        ("max-age=60", False),
        ("", False),
    ):
        ctx = _context(_request({"Cache-Control": value, "X-Tenant": "forged"}))  # type: ignore[arg-type]
        assert ctx.no_cache is expected, value
        assert ctx.tenant is None and ctx.principal is None
        assert ctx.headers["x-tenant"] == "forged"  # headers lower-cased, kept for the policy
    keyed = _context(_request({}, Caller(tenant="acme", principal="acme")))  # type: ignore[arg-type]
    assert (keyed.tenant, keyed.principal, keyed.span) == ("acme", "acme", "span")
    assert keyed.no_cache is False


def test_a_validation_error_names_the_field_as_openai_does() -> None:
    """litestar's validation errors, worded as OpenAI's API words them. Bugs it catches: an
    unknown top-level field named ``data.x`` (or a nested one without its parent), a missing
    required field not named."""
    unknown = ValidationException(extra=[{"key": "data", "message": "Object contains unknown field `foo`"}])
    assert _validation_param(unknown) == ("foo", "Unrecognized request argument supplied: foo")
    nested = ValidationException(
        extra=[{"key": "stream_options", "message": "Object contains unknown field `x`"}]
    )
    assert _validation_param(nested)[0] == "stream_options.x"
    missing = ValidationException(extra=[{"key": "data", "message": "Object missing required field `model`"}])
    assert _validation_param(missing) == ("model", "Object missing required field `model`")
    typed = ValidationException(extra=[{"key": "temperature", "message": "Expected `float`, got `str`"}])
    assert _validation_param(typed) == ("temperature", "Expected `float`, got `str`")
    bare = ValidationException(detail="bad body")
    assert _validation_param(bare) == (None, "bad body")


def test_a_validation_item_without_a_message_falls_back_to_the_detail() -> None:
    item = ValidationException(detail="Invalid body", extra=[{"key": "temperature"}])
    assert _validation_param(item) == ("temperature", "Invalid body")


def test_a_streamed_answer_is_an_event_stream_that_proxies_do_not_buffer(server: Server) -> None:
    """Bug it catches: the stream sent with another media type or without ``cache-control:
    no-cache`` / ``x-accel-buffering: no`` - SSE clients refuse it, nginx buffers it whole."""
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    plain = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60)
    assert plain.headers["content-type"].startswith("application/json")
