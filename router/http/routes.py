"""The HTTP routes and the mapping of every exception to an OpenAI-shaped error body.

Handlers only parse, call ``RouterService`` and turn its ``Completion`` into a response; the
middleware (``router.http.middleware``) has already authenticated the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any

from litestar import Request, Response, get, post
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi.datastructures import ResponseSpec
from litestar.response import Stream
from litestar.status_codes import HTTP_200_OK
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.errors import AuthError, BadRequestError, ModelNotFoundError, PayloadTooLargeError, RouterError
from router.http.auth import Caller
from router.http.dashboard import DASHBOARD_HTML, dashboard_data
from router.openai import api_types
from router.openai.batch import merge_bodies, merge_headers, merge_streams
from router.openai.request import CallContext, Generation, parse_chat, parse_completions
from router.openai.schemas import ChatCompletionRequest, CompletionRequest, RouteBody
from router.openai.structured import content_text
from router.openai.writer import SSEStream
from router.pipeline.calls import Completion
from router.pipeline.feedback import feedback
from router.pipeline.service import RouterService
from router.telemetry import Telemetry

__all__ = ["ROUTES", "error_response"]

log = logging.getLogger(__name__)

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
    state = request.scope.get("state", {})
    # The tenant is the authenticated caller's (router.http.middleware): never the raw x-tenant header.
    caller: Caller | None = state.get("caller")
    cache_control = headers.get("cache-control", "").lower()
    return CallContext(
        headers=headers,
        tenant=caller.tenant if caller is not None else None,
        no_cache="no-cache" in cache_control or "no-store" in cache_control,
        span=state.get("span"),
        principal=caller.principal if caller is not None else None,
    )


def metered(request: Request[Any, Any, Any]) -> CallContext:
    """The caller's context, its rate limit applied: every API endpoint counts against it, not
    only generation (listing models, stored responses, token counts)."""
    ctx = _context(request)
    _service(request).check_caller(ctx)
    return ctx


def answer_body(
    request: Request[Any, Any, Any], data: ChatCompletionRequest | CompletionRequest
) -> Coroutine[Any, Any, Completion]:
    """The body parsed once into the typed request, here (a refusal raises before any work), and
    the pipeline's answer to it, to be awaited."""
    service, ctx = _service(request), _context(request)
    limits = service.policy.service.limits
    if isinstance(data, ChatCompletionRequest):
        return service.generate(parse_chat(data, limits, ctx), ctx)
    gens = parse_completions(data, limits, ctx, decode=service.decode_prompt)
    if len(gens) == 1:
        return service.generate(gens[0], ctx)
    return _answer_prompts(service, gens, ctx, data)


async def _answer_prompts(
    service: RouterService, gens: list[Generation], ctx: CallContext, data: CompletionRequest
) -> Completion:
    """A list of prompts: each answered by the pipeline at once, the answers merged into one
    (router.openai.batch). One prompt's refusal or failure before its first byte is the answer's;
    the other prompts' work is cancelled and their streams closed."""
    tasks = [asyncio.create_task(service.generate(gen, ctx)) for gen in gens]
    try:
        answers = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, Completion) and result.stream is not None:
                await _aclose_quietly(result.stream)
        raise
    headers = merge_headers([a.headers for a in answers])
    streams = [a.stream for a in answers if a.stream is not None]
    if not streams:
        return Completion(headers=headers, body=merge_bodies([a.body or {} for a in answers], data.model))
    tiers = [a.headers.get("x-router-tier", data.model) for a in answers]
    merged = merge_streams(streams, data.n or 1, tiers, data.model, gens[0].include_usage)
    return Completion(headers=headers, stream=SSEStream(merged, on_close=lambda: None))


async def _respond(request: Request[Any, Any, Any], answer: Coroutine[Any, Any, Completion]) -> Response[Any]:
    """Run ``answer`` while watching for a client disconnect, which cancels it (freeing the slot).

    The watch is started first, so it is listening before the answer's first step runs."""
    watcher = asyncio.create_task(_wait_disconnect(request))
    work = asyncio.create_task(answer)
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
def _generation(path: str, summary: str, answer: type, description: str) -> Callable[[Any], Any]:
    """The route of a generation endpoint: its 200 answer, and every error shape it can give."""
    return post(
        path,
        status_code=HTTP_200_OK,
        summary=summary,
        responses={200: ResponseSpec(answer, description=description), **_ERRORS},
    )


@_generation(
    "/v1/chat/completions",
    "Create a chat completion (routed by complexity when model is 'auto')",
    api_types.ChatCompletion,
    "Completion, or an SSE stream of chunks when stream=true",
)
async def chat_completions(request: Request[Any, Any, Any], data: ChatCompletionRequest) -> Response[Any]:
    return await _respond(request, answer_body(request, data))


@_generation(
    "/v1/completions",
    "Create a text completion",
    api_types.TextCompletion,
    "Completion, or an SSE stream when stream=true",
)
async def completions(request: Request[Any, Any, Any], data: CompletionRequest) -> Response[Any]:
    return await _respond(request, answer_body(request, data))


@get("/v1/models", summary="List models: 'auto' plus every tier and alias")
async def list_models(request: Request[Any, Any, Any]) -> api_types.ModelList:
    service = _service(request)
    metered(request)
    created = 1735689600
    return api_types.ModelList(
        data=[
            api_types.Model(id=name, created=created, owned_by="tiered-router")
            for name in service.model_names()
        ]
    )


@get("/v1/models/{model_id:str}", summary="Retrieve one model", responses={404: _ERRORS[404]})
async def retrieve_model(request: Request[Any, Any, Any], model_id: str) -> api_types.Model:
    metered(request)
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
        [{"role": m.role, "content": content_text(m.content)} for m in data.messages]
        if data.messages is not None
        else None
    )
    info = await service.route_info(_context(request), data.model, messages, data.prompt)
    headers = {
        "x-router-tier": info["tier"],
        "x-router-score": f"{info['score']:.4f}",
        "x-router-rule": info["rule"],
        # The decision's own cost (classify + decide), apart from the app's total in `app;dur`.
        "server-timing": f"route;dur={(time.perf_counter() - started) * 1000:.3f}",
    }
    return Response(content=info, headers=headers)


@get(["/healthz", "/health"], summary="Liveness (``/health`` is vLLM's and guidellm's path)")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz", summary="Readiness: every tier loaded and warmed up; 503 while loading or draining")
async def readyz(request: Request[Any, Any, Any]) -> Response[Any]:
    service = _service(request)
    state = request.app.state
    if service.ready:
        return Response(content={"status": "ready"}, status_code=200)
    # No exception text, tier names or paths: probes are unauthenticated. The cause is in the log.
    reason = "draining" if service.draining else ("failed" if state.load_error else "loading")
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
            m = _BACKTICK.search(message)
            if m and "unknown field" in message:
                # The unknown-field policy (router/openai/schemas.py): OpenAI's own message and param.
                name = m.group(1) if key == "data" else f"{key}.{m.group(1)}"
                return name, f"Unrecognized request argument supplied: {name}"
            if key == "data":  # "Object missing required field `model`"
                key = m.group(1) if m and "missing required field" in message else None
            return (str(key) if key else None), message
    return None, str(exc.detail)


def error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
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
    return Response(content=err.to_body(), status_code=err.status_code, headers=err.headers())


ROUTES = [
    chat_completions,
    completions,
    list_models,
    retrieve_model,
    route,
    feedback,
    healthz,
    readyz,
    metrics,
    dashboard,
    dashboard_json,
]
