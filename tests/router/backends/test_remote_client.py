"""``router.backends.remote_client`` on its own: the circuit breaker's states, the upstream error object, and
RemoteTier's mapping over an in-process transport (no sockets)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from router.backends.remote_client import CircuitBreaker, RemoteTier, _error_object
from router.errors import RemoteError


def test_circuit_opens_after_consecutive_failures_and_half_opens_after_cooldown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr("router.backends.remote_client.time.monotonic", lambda: now[0])
    c = CircuitBreaker(failures=3, cooldown_s=10)
    c.failure()
    c.failure()
    c.success()  # a success in between resets the count
    c.failure()
    c.failure()
    assert c.allow() and c.open_for() is None
    c.failure()  # third in a row
    assert not c.allow() and c.open_for() == pytest.approx(10)
    now[0] += 10
    assert c.open_for() is None  # half-open: free for one trial
    assert c.allow()  # the trial
    assert not c.allow() and c.open_for() == 0.0  # everyone else waits for its outcome
    c.failure()  # the trial failed: open again for a full cooldown
    assert not c.allow() and c.open_for() == pytest.approx(10)
    now[0] += 10
    assert c.allow()
    c.success()
    assert c.allow() and c.allow() and c.open_for() is None


def test_error_object_keeps_only_the_public_fields() -> None:
    raw = json.dumps(
        {
            "error": {
                "message": "too long",
                "type": "invalid_request_error",
                "param": "messages",
                "code": 400,
                "x": 1,
            }
        }
    ).encode()
    assert _error_object(raw) == {
        "message": "too long",
        "type": "invalid_request_error",
        "param": "messages",
        "code": 400,
    }
    assert _error_object(b'{"detail": "Not Found"}')["message"] == "Not Found"  # FastAPI-style
    assert _error_object(b"<html>bad gateway</html>") == {
        "message": None,
        "type": None,
        "param": None,
        "code": None,
    }
    assert _error_object(b'{"error": "plain string"}')["message"] == "plain string"


def run(tier: RemoteTier) -> list[Any]:
    async def go() -> list[Any]:
        try:
            return [out async for out in tier.generate("chat", {"messages": []})]
        finally:
            await tier.aclose()

    return asyncio.run(go())


def test_429_keeps_retry_after_and_is_not_retried() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        body = {"error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": None}}
        return httpx.Response(429, json=body, headers={"retry-after": "12"})

    tier = RemoteTier("r", "http://upstream/v1", max_retries=3, transport=httpx.MockTransport(handler))
    with pytest.raises(RemoteError) as err:
        run(tier)
    assert err.value.status_code == 429 and err.value.retry_after == 12.0 and len(calls) == 1
    assert err.value.body is not None and err.value.body["message"] == "slow down"
    assert tier.circuit.open_for() is None  # a 4xx is not an upstream failure


def test_503_is_retried_then_reported_unavailable() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(503, text="overloaded: internal queue /srv/x")

    tier = RemoteTier("r", "http://upstream/v1", max_retries=2, transport=httpx.MockTransport(handler))
    with pytest.raises(RemoteError) as err:
        run(tier)
    assert len(calls) == 3 and err.value.status_code == 503 and "/srv" not in str(err.value)


def test_the_pool_is_sized_to_the_tier_capacity() -> None:
    tier = RemoteTier("r", "http://upstream/v1", capacity=300)
    pool = tier._client._transport._pool  # type: ignore[attr-defined]
    assert pool._max_connections == 300
    asyncio.run(tier.aclose())
