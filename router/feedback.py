"""``POST /v1/feedback``: a score for an answer this service issued (router/shadow.py logs it)."""

from __future__ import annotations

import math
from typing import Any

import msgspec
from litestar import Request, post
from litestar.status_codes import HTTP_200_OK

from router.errors import BadRequestError, RouterError
from router.shadow import thumbs_score

__all__ = ["FeedbackBody", "NotFoundError", "feedback"]


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
    service = request.app.state.service
    log = service.feedback_log()
    if log is None:
        raise NotFoundError("Feedback is turned off (service.feedback.enabled).", code="feedback_disabled")
    score = _score(data)
    row = log.record(data.id, score)
    if row is None:
        raise NotFoundError(
            f"No answer with id '{data.id[:80]}' was issued here recently.",
            param="id",
            code="unknown_response_id",
        )
    return {"id": row["id"], "recorded": True, "tier": next(iter(row["outcomes"])), "score": score}
