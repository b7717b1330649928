"""Operator actions on the admin port: ``POST /admin/classifier/reload``.

Swaps the routing score without a restart - the last step of the learning loop (shadow answers
judged by ``classifier judge``, a new artifact from ``classifier train --outcomes ... --extra
...``). The body is optional: ``{"path": DIR_OR_ONNX}`` loads that artifact, no body reloads the
policy's ``service.classifier.path`` (the shipped artifact when unset) from disk. The new model is
loaded off the event loop and must score a probe before it replaces the old one, so a broken or
missing file answers 400 and leaves routing as it was. Requests already past classification keep
the score they got; the next ones use the new model (one attribute swap, atomic for readers).
A later policy reload keeps the swapped model unless the policy's ``classifier.path`` changes.

Like ``/metrics``, the path lives on the admin listener (``serve``'s default; with ``--admin-port
0`` on the API port), and on either it needs an admin key (``serve --admin-keys-file``,
``$TIERED_ROUTER_ADMIN_KEYS``; an API key is not one): with none configured it answers 403. A
failed load answers one message whatever the cause, so it never tells whether a path exists.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from litestar import Request, post
from litestar.status_codes import HTTP_200_OK

from router.errors import BadRequestError

__all__ = ["ADMIN_ROUTES", "reload_classifier"]

log = logging.getLogger(__name__)

PROBE = "Reload probe: is this model able to score a prompt?"


def _describe(clf: Any) -> dict[str, Any]:
    return {"path": str(getattr(clf, "path", None)), "version": getattr(clf, "version", None)}


def _load(path: str | None, device: str = "cpu") -> Any:
    from classifier import ComplexityClassifier

    clf = ComplexityClassifier.load(path, device=device)
    clf.score(PROBE)  # fails here, not on the next user's request
    return clf


@post(
    "/admin/classifier/reload",
    status_code=HTTP_200_OK,
    summary="Load a routing-score artifact and swap it in without a restart",
)
async def reload_classifier(request: Request[Any, Any, Any]) -> dict[str, Any]:
    service = request.app.state.service
    raw = await request.body()
    path: str | None = None
    if raw.strip():
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise BadRequestError(f"The body is not JSON: {exc}") from None
        if not isinstance(body, dict) or not isinstance(body.get("path", ""), str):
            raise BadRequestError("Expected {'path': 'model directory or .onnx'}.", param="path")
        path = body.get("path") or None
    if path is None:
        path = service.policy.service.classifier.path
    previous = service.classifier
    try:
        fresh = await asyncio.to_thread(_load, path, service.policy.service.classifier.device)
    except Exception:  # any load or probe failure: keep the current model
        # One answer for a missing file, an unreadable one and a broken model: the caller learns
        # nothing about the server's filesystem; the log has the cause.
        log.warning("classifier reload from %r failed", path, exc_info=True)
        raise BadRequestError(
            "Could not load a routing-score model from that path; the current model is kept.", param="path"
        ) from None
    service.classifier = fresh
    telemetry = getattr(request.app.state, "telemetry", None)
    counter = getattr(telemetry, "classifier_reloads", None)
    if counter is not None:
        counter.inc()
    return {"reloaded": True, **_describe(fresh), "previous": _describe(previous)}


ADMIN_ROUTES = [reload_classifier]
