"""One ASGI middleware in front of every route: header and body limits, auth, listener split,
server span and ``Server-Timing``.

Paths fall in three groups:
- public: ``/healthz`` (alias ``/health``) and ``/readyz`` (probes; they say nothing about internals);
- operator: ``/metrics``, ``/dashboard``, ``/schema``, ``/admin/...`` (router/http/admin.py). With a
  separate admin listener (``serve``'s default) they exist only there, unauthenticated, and the
  API port answers 404; without one they need an API key like everything else;
- the API: everything else, behind the policy's auth mode.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Status, StatusCode

from router.errors import (
    AuthError,
    ModelNotFoundError,
    PayloadTooLargeError,
    RouterError,
    anthropic_error_body,
)

if TYPE_CHECKING:
    from litestar import Litestar
    from litestar.datastructures import State

    from router.http.auth import AdminKeys, Authenticator
    from router.telemetry import Telemetry

__all__ = ["LISTENER_KEY", "MAX_HEADER_BYTES", "admin_listener", "is_operator_path", "router_middleware"]

MAX_HEADER_BYTES = 64 * 1024
"""Larger header sections get 431 (the C HTTP parser has no limit of its own)."""

PUBLIC_PATHS = frozenset({"/healthz", "/health", "/readyz"})
OPERATOR_PATHS = frozenset({"/metrics", "/dashboard", "/dashboard/data", "/schema"})
LISTENER_KEY = "router.listener"
"""ASGI scope key naming the listener a request came in on (``admin`` for the operator port)."""


def is_operator_path(path: str) -> bool:
    return path in OPERATOR_PATHS or path.startswith(("/schema/", "/admin/"))


def admin_listener(app: Any) -> Any:
    """The ASGI app for the admin port: the same app (same state), marked as the admin listener."""

    async def admin(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = dict(scope)
            scope[LISTENER_KEY] = "admin"
        await app(scope, receive, send)

    return admin


def router_middleware(app: Any) -> Any:
    async def middleware(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        litestar_app: Litestar = scope["app"]
        state: State = litestar_app.state
        path: str = scope.get("path", "")
        scope.setdefault("state", {})
        raw_headers = scope.get("headers", [])
        if sum(len(k) + len(v) for k, v in raw_headers) > MAX_HEADER_BYTES:
            err = RouterError("Request headers are too large.", code="headers_too_large")
            err.status_code, err.error_type = 431, "invalid_request_error"
            await send_error(send, err, path)
            return
        operator = is_operator_path(path)
        on_admin = scope.get(LISTENER_KEY) == "admin"
        if path.startswith("/admin/") and (on_admin or not state.admin_separate):
            # State-changing operator actions: an admin key, on either listener (an API key is not
            # one), and the body limits of any other request.
            refused = _admin_refusal(state.admin_keys, raw_headers)
            if refused is not None:
                await send_error(send, refused, path)
                return
            limit = state.service.policy.service.max_body_bytes
            await app(scope, _limited(receive, limit, state.body_timeout_s), send)
            return
        if on_admin:
            if not (operator or path in PUBLIC_PATHS):
                await send_error(send, _not_found(path))
                return
            await app(scope, receive, send)
            return
        if operator and state.admin_separate:
            await send_error(send, _not_found(path))
            return
        auth: Authenticator = state.auth
        telemetry: Telemetry = state.telemetry
        needs_auth = path not in PUBLIC_PATHS
        headers = (
            {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw_headers}
            if needs_auth or telemetry.tracing_enabled
            else {}
        )
        if needs_auth:
            caller = auth.authenticate(headers)
            if caller is None:
                err = AuthError(
                    "Incorrect or missing API key. Provide it as 'Authorization: Bearer <key>'"
                    " (or 'x-api-key: <key>')."
                )
                await send_error(send, err, path)
                return
            scope["state"]["caller"] = caller
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            limit = state.service.policy.service.max_body_bytes
            declared = headers.get("content-length") if headers else _header(raw_headers, b"content-length")
            if declared is not None and declared.strip().isdigit() and int(declared) > limit:
                await send_error(send, _too_large(), path)
                return
            receive = _limited(receive, limit, state.body_timeout_s)
        send = _with_server_timing(send)
        span = (
            telemetry.server_span(
                f"{scope.get('method', 'GET')} {path}",
                headers,
                {
                    "http.request.method": scope.get("method", ""),
                    "url.path": path,
                    "server.address": headers.get("host", ""),
                },
            )
            if path.startswith("/v1/")
            else None
        )
        if span is None:
            await app(scope, receive, send)
            return
        scope["state"]["span"] = span

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", message["status"])
                if message["status"] >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)

        try:
            # An ASGI app returns after the last body byte is sent, streams included: the server
            # span covers the whole response.
            await app(scope, receive, send_wrapper)
        finally:
            span.end()

    return middleware


def _header(raw: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for k, v in raw:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _admin_refusal(keys: AdminKeys, raw: list[tuple[bytes, bytes]]) -> RouterError | None:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}
    verdict = keys.check(headers)
    if verdict:
        return None
    if verdict is None:
        err = RouterError(
            "Admin actions are disabled: no admin key is configured (serve --admin-keys-file, or "
            "$TIERED_ROUTER_ADMIN_KEYS).",
            code="admin_disabled",
        )
        err.status_code, err.error_type = 403, "permission_error"
        return err
    return AuthError(
        "Incorrect or missing admin key. Provide it as 'Authorization: Bearer <key>'.",
        code="invalid_admin_key",
    )


def _not_found(path: str) -> RouterError:
    err = ModelNotFoundError(f"Unknown path '{path[:200]}'.", code="not_found")
    err.error_type = "invalid_request_error"
    return err


def _too_large() -> RouterError:
    return PayloadTooLargeError("Request body is too large.", code="request_too_large")


def _limited(receive: Any, limit: int, timeout_s: float) -> Any:
    """Count body bytes as they arrive (chunked bodies declare no length): past the live policy's
    ``max_body_bytes`` reading fails with 413, before the rest is buffered; a client pausing
    longer than ``timeout_s`` between chunks gets 408 (a slow body cannot hold a slot forever).
    Once the body is complete, later receives (the disconnect watch) pass straight through."""
    seen = 0
    complete = False

    async def wrapped() -> dict[str, Any]:
        nonlocal seen, complete
        if complete:
            return await receive()
        try:
            message: dict[str, Any] = await asyncio.wait_for(receive(), timeout_s)
        except TimeoutError:
            err = RouterError("Timed out reading the request body.", code="request_timeout")
            err.status_code, err.error_type = 408, "invalid_request_error"
            raise err from None
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _too_large()
            complete = not message.get("more_body", False)
        else:
            complete = True
        return message

    return wrapped


def _with_server_timing(send: Any) -> Any:
    """Add ``Server-Timing: app;dur=<ms>`` (time inside the app until the response starts), so
    clients and benchmarks can tell routing overhead from network and queueing."""
    started = time.perf_counter()

    async def wrapper(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            dur = (time.perf_counter() - started) * 1000
            headers = list(message.get("headers", []))
            value = f"app;dur={dur:.3f}".encode()
            for i, (k, v) in enumerate(headers):
                if k.lower() == b"server-timing":
                    headers[i] = (k, v + b", " + value)
                    break
            else:
                headers.append((b"server-timing", value))
            message = dict(message, headers=headers)
        await send(message)

    return wrapper


async def send_error(send: Any, err: RouterError, path: str = "") -> None:
    """``err`` in the shape of the API at ``path``: Anthropic's for ``/v1/messages``, else OpenAI's."""
    if path.startswith("/v1/messages"):
        body: dict[str, Any] = anthropic_error_body(err.status_code, err.message)
    else:
        body = err.to_body()
    await send_json(send, err.status_code, body, err.headers())


async def send_json(send: Any, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
