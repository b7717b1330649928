"""The litestar app: routes, auth, error mapping, lifespan.

Resources (device worker, classifier, tiers, telemetry, policy watcher) are created in the
lifespan and live on ``app.state``; nothing is built at import time. Models load in the
background after the server starts, so ``/healthz`` answers at once and ``/readyz`` turns 200
when every tier is loaded and warmed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig
from litestar.openapi.datastructures import ResponseSpec
from litestar.response import Stream
from litestar.status_codes import HTTP_200_OK
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router import api_types
from router.auth import ApiKeys
from router.backends import TierSet, build_tiers
from router.dashboard import DASHBOARD_HTML, dashboard_data
from router.errors import AuthError, BadRequestError, ModelNotFoundError, PayloadTooLargeError, RouterError
from router.policy.loader import load_policy
from router.reload import PolicyWatcher
from router.schemas import ChatCompletionRequest, CompletionRequest, RouteBody, message_text
from router.service import CallContext, Completion, RouterService
from router.telemetry import Telemetry

__all__ = ["create_app"]

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
"""Larger header sections get 431 (the C HTTP parser has no limit of its own)."""

OPEN_PATHS = frozenset(
    {"/healthz", "/readyz", "/metrics", "/dashboard", "/dashboard/data", "/schema", "/schema/openapi.json"}
)

_ERRORS = {
    400: ResponseSpec(api_types.ErrorResponse, description="Invalid request (names the param)"),
    401: ResponseSpec(api_types.ErrorResponse, description="Missing or invalid API key"),
    404: ResponseSpec(api_types.ErrorResponse, description="Unknown model"),
    413: ResponseSpec(api_types.ErrorResponse, description="Body too large"),
    429: ResponseSpec(
        api_types.ErrorResponse, description="Tier at capacity or tenant rate limit (Retry-After)"
    ),
    503: ResponseSpec(
        api_types.ErrorResponse, description="Not ready, draining, or queue timeout (Retry-After)"
    ),
}


def _service(request: Request[Any, Any, Any]) -> RouterService:
    return request.app.state.service


def _context(request: Request[Any, Any, Any]) -> CallContext:
    headers = {k.lower(): v for k, v in request.headers.items()}
    tenant = request.scope.get("state", {}).get("tenant") or headers.get("x-tenant") or None
    cache_control = headers.get("cache-control", "").lower()
    return CallContext(
        headers=headers,
        tenant=tenant,
        no_cache="no-cache" in cache_control or "no-store" in cache_control,
        span=request.scope.get("state", {}).get("span"),
    )


async def _respond(request: Request[Any, Any, Any], work: asyncio.Task[Completion]) -> Response[Any]:
    """Await ``work`` while watching for a client disconnect, which cancels it (freeing the slot)."""
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                finished = await work
                if finished.stream is not None:  # done just as the client left: release it now
                    await _aclose_quietly(finished.stream)
            return Response(content=b"", status_code=499)
        result = work.result()
    finally:
        watcher.cancel()
    if result.stream is not None:
        return Stream(
            _closing(result.stream),
            media_type="text/event-stream",
            headers={**result.headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
        )
    return Response(content=result.body, headers=result.headers, status_code=HTTP_200_OK)


async def _closing(stream: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """Pass chunks through; whatever ends the response (a disconnect included) closes the source,
    which aborts the engine request."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        await _aclose_quietly(stream)


async def _aclose_quietly(stream: AsyncIterator[bytes]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


async def _wait_disconnect(request: Request[Any, Any, Any]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- routes ---------------------------------------------------------------------------------------
@post(
    "/v1/chat/completions",
    status_code=HTTP_200_OK,
    summary="Create a chat completion (routed by complexity when model is 'auto')",
    responses={
        200: ResponseSpec(
            api_types.ChatCompletion, description="Completion, or an SSE stream of chunks when stream=true"
        ),
        **_ERRORS,
    },
)
async def chat_completions(request: Request[Any, Any, Any], data: ChatCompletionRequest) -> Response[Any]:
    service = _service(request)
    return await _respond(request, asyncio.create_task(service.chat(data, _context(request))))


@post(
    "/v1/completions",
    status_code=HTTP_200_OK,
    summary="Create a text completion",
    responses={
        200: ResponseSpec(
            api_types.TextCompletion, description="Completion, or an SSE stream when stream=true"
        ),
        **_ERRORS,
    },
)
async def completions(request: Request[Any, Any, Any], data: CompletionRequest) -> Response[Any]:
    service = _service(request)
    return await _respond(request, asyncio.create_task(service.complete(data, _context(request))))


@get("/v1/models", summary="List models: 'auto' plus every tier and alias")
async def list_models(request: Request[Any, Any, Any]) -> api_types.ModelList:
    service = _service(request)
    created = 1735689600
    return api_types.ModelList(
        data=[
            api_types.Model(id=name, created=created, owned_by="tiered-router")
            for name in service.model_names()
        ]
    )


@get("/v1/models/{model_id:str}", summary="Retrieve one model", responses={404: _ERRORS[404]})
async def retrieve_model(request: Request[Any, Any, Any], model_id: str) -> api_types.Model:
    if model_id not in _service(request).model_names():
        raise ModelNotFoundError(f"The model '{model_id}' does not exist.", param="model")
    return api_types.Model(id=model_id, created=1735689600, owned_by="tiered-router")


@post(
    "/v1/route",
    status_code=HTTP_200_OK,
    summary="Show the routing decision for a prompt, without generating",
    responses={200: ResponseSpec(api_types.RouteDecision), **_ERRORS},
)
async def route(request: Request[Any, Any, Any], data: RouteBody) -> Response[Any]:
    started = time.perf_counter()
    service = _service(request)
    if data.messages is None and data.prompt is None:
        raise BadRequestError("Give 'messages' or 'prompt'.", param="messages")
    messages = (
        [{"role": m.role, "content": message_text(m.content)} for m in data.messages]
        if data.messages is not None
        else None
    )
    info = service.route_info(_context(request), data.model, messages, data.prompt)
    headers = {
        "x-router-tier": info["tier"],
        "x-router-score": f"{info['score']:.4f}",
        "x-router-rule": info["rule"],
        # The decision's own cost (classify + decide), apart from the app's total in `app;dur`.
        "server-timing": f"route;dur={(time.perf_counter() - started) * 1000:.3f}",
    }
    return Response(content=info, headers=headers)


@get("/healthz", summary="Liveness")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz", summary="Readiness: every tier loaded and warmed up; 503 while loading or draining")
async def readyz(request: Request[Any, Any, Any]) -> Response[Any]:
    service = _service(request)
    state = request.app.state
    if service.ready:
        return Response(content={"status": "ready", "tiers": list(service.policy.tiers)}, status_code=200)
    reason = (
        "draining" if service.draining else ("failed: " + state.load_error if state.load_error else "loading")
    )
    return Response(
        content={"status": "not ready", "reason": reason}, status_code=503, headers={"retry-after": "5"}
    )


@get("/metrics", summary="Prometheus metrics", media_type=CONTENT_TYPE_LATEST)
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    telemetry: Telemetry = request.app.state.telemetry
    return Response(content=generate_latest(telemetry.registry), media_type=CONTENT_TYPE_LATEST)


@get("/dashboard", summary="Live status page", media_type="text/html", include_in_schema=False)
async def dashboard() -> Response[str]:
    return Response(content=DASHBOARD_HTML, media_type="text/html")


@get("/dashboard/data", summary="Dashboard figures (JSON)", include_in_schema=False)
async def dashboard_json(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return dashboard_data(request.app.state.telemetry, _service(request))


# -- error mapping --------------------------------------------------------------------------------
_BACKTICK = re.compile(r"`([^`]+)`")


def _validation_param(exc: ValidationException) -> tuple[str | None, str]:
    extra = exc.extra if isinstance(exc.extra, list) else []
    for item in extra:
        if isinstance(item, dict):
            key = item.get("key")
            message = str(item.get("message", exc.detail))
            if key == "data":  # "Object missing required field `model`"
                m = _BACKTICK.search(message)
                key = m.group(1) if m and "missing required field" in message else None
            return (str(key) if key else None), message
    return None, str(exc.detail)


def _error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    if isinstance(exc, RouterError):
        err = exc
    elif isinstance(exc, RecursionError):  # msgspec refuses JSON nested deeper than it can decode
        err = BadRequestError("Invalid JSON body: nested too deeply.", code="invalid_json")
    elif isinstance(exc, ValidationException):
        param, message = _validation_param(exc)
        if "malformed" in message.lower() or ("json" in str(exc.detail).lower() and param is None):
            err = BadRequestError(f"Invalid JSON body: {exc.detail}", code="invalid_json")
        else:
            where = f" at '{param}'" if param else ""
            err = BadRequestError(f"Invalid request{where}: {message}", param=param)
    elif isinstance(exc, HTTPException):
        if exc.status_code == 413:
            err = PayloadTooLargeError("Request body is too large.", code="request_too_large")
        elif exc.status_code == 404:
            err = ModelNotFoundError(f"Unknown path '{request.url.path}'.", code="not_found")
            err.error_type = "invalid_request_error"
        elif exc.status_code == 401:
            err = AuthError(str(exc.detail))
        else:
            err = RouterError(str(exc.detail), code="http_error")
            err.status_code = exc.status_code
            err.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    else:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        err = RouterError("Internal server error.")
    headers = {}
    if err.retry_after is not None:
        headers["retry-after"] = str(max(1, round(err.retry_after)))
    if err.status_code == 401:
        headers["www-authenticate"] = "Bearer"
    return Response(content=err.to_body(), status_code=err.status_code, headers=headers)


# -- auth and tracing, as one ASGI middleware ------------------------------------------------------
def _middleware(app: Any) -> Any:
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
            await _send_json(send, 431, err.to_body(), {})
            return
        keys: ApiKeys = state.api_keys
        telemetry: Telemetry = state.telemetry
        needs_headers = keys.enabled or (telemetry.tracing_enabled and path.startswith("/v1/"))
        headers = (
            {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw_headers}
            if needs_headers
            else {}
        )
        if keys.enabled and path not in OPEN_PATHS:
            tenant = keys.authenticate(headers.get("authorization"))
            if tenant is False:
                err = AuthError("Incorrect or missing API key. Provide it as 'Authorization: Bearer <key>'.")
                await _send_json(send, err.status_code, err.to_body(), {"www-authenticate": "Bearer"})
                return
            if isinstance(tenant, str):
                scope["state"]["tenant"] = tenant
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


async def _send_json(send: Any, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    import json

    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


# -- lifespan -------------------------------------------------------------------------------------
def _load_tiers(app: Litestar) -> None:
    """Runs in a thread at startup: load every tier, then flip readiness."""
    state = app.state
    service: RouterService = state.service
    try:
        tiers = build_tiers(service.policy, state.worker, observer=state.telemetry)
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("tier loading failed; the service stays not-ready: %s", state.load_error)
        return
    service.tiers = tiers
    state.telemetry.ready.set(1)
    log.info("ready: tiers %s", ", ".join(tiers.tiers))


def create_app(
    policy_path: str | Path,
    *,
    classifier: Any = None,
    tiers: TierSet | None = None,
    watch_policy: bool = True,
    reload_interval_s: float = 0.5,
) -> Litestar:
    """Build the app for ``policy_path`` (validated now: a broken file raises ``PolicyError``).

    ``tiers`` lets tests inject prebuilt tiers; normally they load in the background at startup.
    """
    policy = load_policy(policy_path)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncGenerator[None, None]:
        from classifier import ComplexityClassifier
        from tiers.device import DeviceWorker

        state = app.state
        telemetry = Telemetry(record_content=policy.service.telemetry.record_content)
        state.telemetry = telemetry
        state.load_error = None
        state.worker = tiers.worker if tiers is not None and tiers.worker is not None else DeviceWorker()
        clf = classifier or ComplexityClassifier.load(policy.service.classifier.path)
        from router.cache import build_cache

        service = RouterService(policy, clf, telemetry, tiers=None, cache=build_cache(policy))
        state.service = service
        state.api_keys = ApiKeys.from_policy(policy)
        telemetry.watch_engines(
            lambda: {
                name: (b.engine.load() if hasattr(b, "engine") else b.client.load())
                for name, b in (service.tiers.tiers.items() if service.tiers else [])
            }
        )
        loader = None
        if tiers is not None:
            service.tiers = tiers
            telemetry.ready.set(1)
        else:
            loader = asyncio.create_task(asyncio.to_thread(_load_tiers, app))
        watcher = (
            PolicyWatcher(Path(policy_path), app, interval_s=reload_interval_s) if watch_policy else None
        )
        if watcher is not None:
            watcher.start()
        try:
            yield
        finally:
            if watcher is not None:
                await watcher.stop()
            if not service.draining:
                await service.drain(0.1)
            if loader is not None and not loader.done():
                loader.cancel()
            await asyncio.to_thread(state.worker.stop)
            if service.tiers is not None:
                await service.tiers.aclose()
            if service.cache is not None:
                await service.cache.aclose()
            telemetry.shutdown()

    return Litestar(
        route_handlers=[
            chat_completions,
            completions,
            list_models,
            retrieve_model,
            route,
            healthz,
            readyz,
            metrics,
            dashboard,
            dashboard_json,
        ],
        lifespan=[lifespan],
        middleware=[_middleware],
        exception_handlers={Exception: _error_response},
        request_max_body_size=policy.service.max_body_bytes,
        openapi_config=OpenAPIConfig(title="tiered-router", version="0.1.0", path="/schema"),
        state=State({"policy_path": str(policy_path)}),
        debug=False,
    )
