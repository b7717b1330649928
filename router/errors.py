"""One exception hierarchy for the service; ``router.http.app`` maps it to OpenAI-shaped bodies in one place.

Every error a client can see carries ``status_code``, OpenAI's ``type``, the offending ``param``
(or None) and a machine-readable ``code``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RETRY_AFTER_S",
    "AuthError",
    "BadRequestError",
    "ModelNotFoundError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PolicyError",
    "PolicyIssue",
    "RateLimitError",
    "RemoteError",
    "RouterError",
    "UnavailableError",
    "anthropic_error_body",
    "remote_error",
]

RETRY_AFTER_S = 1.0
"""The ``Retry-After`` of a transient refusal (a full queue, a cancelled or unavailable answer)."""


class RouterError(Exception):
    status_code = 500
    error_type = "server_error"
    default_code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        spread_retries: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.retry_after = retry_after
        self.spread_retries = spread_retries
        """Spread the clients' retries (``headers``): for refusals of this service's own load,
        never for an upstream's Retry-After passed through."""

    def headers(self) -> dict[str, str]:
        """Response headers the error carries: ``Retry-After`` (whole seconds) and, as OpenAI's
        own API does, ``retry-after-ms``, which its SDKs read first. With ``spread_retries`` the
        milliseconds are spread over up to half again the wait, so the clients refused in one
        burst do not all come back in the same instant as a herd; Retry-After rounds that up."""
        out: dict[str, str] = {}
        if self.retry_after is not None:
            ms = max(1.0, self.retry_after) * 1000
            if self.spread_retries:
                ms *= random.uniform(1.0, 1.5)
                out["retry-after"] = str(math.ceil(ms / 1000))
            else:
                out["retry-after"] = str(max(1, round(self.retry_after)))
            out["retry-after-ms"] = str(round(ms))
        if self.status_code == 401:
            out["www-authenticate"] = "Bearer"
        return out

    def to_body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequestError(RouterError):
    status_code = 400
    error_type = "invalid_request_error"
    default_code = "invalid_value"


class AuthError(RouterError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class ModelNotFoundError(RouterError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class PayloadTooLargeError(RouterError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class RateLimitError(RouterError):
    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class OverloadedError(RateLimitError):
    """Every candidate tier's queue is full."""

    default_code = "tier_overloaded"


class UnavailableError(RouterError):
    """Not ready, draining, or a queue wait timed out."""

    status_code = 503
    error_type = "server_error"
    default_code = "service_unavailable"


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, object]:
    """The Anthropic Messages API's error shape, for the same status an OpenAI route would give."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


@dataclass(frozen=True, slots=True)
class PolicyIssue:
    path: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line is not None else ""
        return f"{where}{self.path}: {self.message}"


class PolicyError(Exception):
    """A policy file is invalid; ``issues`` lists every problem with its field path and line."""

    def __init__(self, source: str, issues: list[PolicyIssue]) -> None:
        self.source = source
        self.issues = issues
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"invalid policy {self.source}: {len(self.issues)} error(s)"]
        lines += [f"  {self.source}:{issue}" for issue in self.issues]
        return "\n".join(lines)


class RemoteError(RuntimeError):
    """A remote tier's failure (``router.backends.remote_client``), mapped to an OpenAI error by the
    writer; not a ``RouterError`` because its status and body come from the upstream."""

    def __init__(
        self,
        message: str,
        status_code: int = 502,
        *,
        body: dict[str, Any] | None = None,
        retry_after: float | None = None,
        started: bool = False,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body
        """A 4xx upstream's ``error`` object (message, type, param, code), passed to the client."""
        self.retry_after = retry_after
        self.started = started
        """True when part of the answer had already been passed on (the stream was cut)."""


def remote_error(exc: RemoteError) -> RouterError:
    """An upstream failure as the client should see it (see ``router.backends.remote_client``): a
    4xx keeps its status, error body and Retry-After; unavailable/timed out is a 503; anything
    else a 502."""
    if 400 <= exc.status_code < 500:
        body = exc.body or {}
        err = RouterError(
            str(body.get("message") or exc),
            param=body.get("param") if isinstance(body.get("param"), str) else None,
            code=str(body["code"]) if body.get("code") is not None else "upstream_error",
            retry_after=exc.retry_after
            if exc.retry_after is not None
            else (1.0 if exc.status_code == 429 else None),
        )
        err.status_code = exc.status_code
        default_type = "rate_limit_error" if exc.status_code == 429 else "invalid_request_error"
        err.error_type = str(body.get("type") or default_type)
        return err
    if exc.status_code == 503:
        retry = exc.retry_after if exc.retry_after is not None else RETRY_AFTER_S
        return UnavailableError(str(exc), code="upstream_unavailable", retry_after=retry)
    err = RouterError(str(exc), code="upstream_error")
    err.status_code = 502
    return err
