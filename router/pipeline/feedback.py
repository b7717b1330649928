"""``POST /v1/feedback``: a score for an answer this service issued (router/pipeline/shadow.py logs it)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import msgspec
from litestar import Request, post
from litestar.status_codes import HTTP_200_OK

from router.errors import BadRequestError, RouterError
from router.openai.request import CallContext
from router.pipeline.shadow import MAX_SCORES_PER_ID, FeedbackConflictError, thumbs_score

__all__ = ["ConflictError", "FeedbackBody", "NotFoundError", "feedback"]

MAX_ID_CHARS = 100
"""Longer than any id this service issues (``chatcmpl-`` + 24 hex digits)."""


class FeedbackBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: str
    """The ``x-router-response-id`` header of the response being scored."""
    score: float | None = None
    """How good the answer was, in [0, 1]."""
    thumbs: str | None = None
    """``up`` (1.0) or ``down`` (0.0), instead of ``score``."""


class NotFoundError(RouterError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ConflictError(RouterError):
    status_code = 409
    error_type = "invalid_request_error"
    default_code = "conflict"


def _score(data: FeedbackBody) -> float:
    if (data.score is None) == (data.thumbs is None):
        raise BadRequestError("Give exactly one of 'score' (0..1) or 'thumbs' ('up'/'down').", param="score")
    if data.thumbs is not None:
        try:
            return thumbs_score(data.thumbs)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="thumbs") from None
    assert data.score is not None
    if not math.isfinite(data.score) or not 0.0 <= data.score <= 1.0:
        raise BadRequestError("'score' must be a number in [0, 1].", param="score")
    return float(data.score)


@post("/v1/feedback", status_code=HTTP_200_OK, summary="Score an answer this service gave")
async def feedback(request: Request[Any, Any, Any], data: FeedbackBody) -> dict[str, Any]:
    """Only the caller that received the answer may score it (its partition: tenant, else key);
    another caller's id is a 404 like an unknown one. A new score replaces the previous one (the
    later line wins when outcomes merge by id), the same score again writes nothing, and past
    ``MAX_SCORES_PER_ID`` different scores the answer is closed (409). Rate limited like the
    generation endpoints; the line is written off the event loop."""
    service = request.app.state.service
    caller = request.scope.get("state", {}).get("caller")
    headers = {k.lower(): v for k, v in request.headers.items()}
    ctx = CallContext(
        headers=headers,
        tenant=caller.tenant if caller is not None else None,
        principal=caller.principal if caller is not None else None,
    )
    service.check_caller(ctx)
    log = service.feedback_log()
    if log is None:
        raise NotFoundError("Feedback is turned off (service.feedback.enabled).", code="feedback_disabled")
    if len(data.id) > MAX_ID_CHARS:
        raise BadRequestError(f"'id' is longer than {MAX_ID_CHARS} characters.", param="id")
    score = _score(data)
    try:
        row = await asyncio.to_thread(log.record, data.id, score, ctx.partition)
    except FeedbackConflictError:
        raise ConflictError(
            f"Answer '{data.id}' has already been scored {MAX_SCORES_PER_ID} times.",
            param="id",
            code="feedback_closed",
        ) from None
    if row is None:
        raise NotFoundError(
            f"No answer with id '{data.id}' was issued to this caller recently.",
            param="id",
            code="unknown_response_id",
        )
    return {"id": row["id"], "recorded": True, "tier": next(iter(row["outcomes"])), "score": score}
