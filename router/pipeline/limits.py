"""Bounds on what one request may ask (policy ``service.limits``), checked before any work.

Everything here bounds work that grows with the request and that the rest of the traffic would
otherwise pay for: a ``logit_bias`` entry is applied to every row at every engine step, a JSON
schema node becomes grammar states compiled before the first token, a tool adds to the prompt
and to the tool-call grammar. Each refusal is a 400 in OpenAI's shape naming the field and the
limit (``code``: ``limit_exceeded``), so a client can tell which bound it hit and by how much.

``TenantLimiter`` bounds how often: each caller's requests and tokens per minute (a tenant's
``rate_limit_rpm`` / ``rate_limit_tpm``), checked before routing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from router.errors import BadRequestError
from router.openai.schemas import ChatCompletionRequest

if TYPE_CHECKING:
    from router.openai.schemas import CompletionRequest
    from router.policy.schema import LimitsConfig

__all__ = ["TenantLimiter", "check_limits", "schema_size"]


def _refuse(param: str, what: str, limit: int, key: str) -> BadRequestError:
    return BadRequestError(
        f"'{param}' {what}; the limit is {limit} (service.limits.{key}).",
        param=param,
        code="limit_exceeded",
    )


def schema_size(schema: Any, max_nodes: int, max_depth: int) -> tuple[int, int, int]:
    """``(nodes, depth, widest)`` of a JSON value (``widest``: the most ``properties`` of one
    object); counting stops once nodes or depth pass their bound (so a huge schema costs no more
    than ``max_nodes`` steps to refuse)."""
    nodes = 0
    deepest = 0
    widest = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        deepest = max(deepest, depth)
        if nodes > max_nodes or deepest > max_depth:
            break
        if isinstance(value, dict):
            props = value.get("properties")
            if isinstance(props, dict):
                widest = max(widest, len(props))
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return nodes, deepest, widest


def _check_schema(param: str, schema: Any, limits: LimitsConfig) -> None:
    nodes, depth, widest = schema_size(schema, limits.max_schema_nodes, limits.max_schema_depth)
    if nodes > limits.max_schema_nodes:
        raise _refuse(param, "has too many schema nodes", limits.max_schema_nodes, "max_schema_nodes")
    if depth > limits.max_schema_depth:
        raise _refuse(param, "is nested too deeply", limits.max_schema_depth, "max_schema_depth")
    if widest > limits.max_schema_properties:
        why = f"has an object of {widest} properties"
        raise _refuse(param, why, limits.max_schema_properties, "max_schema_properties")


def check_limits(req: ChatCompletionRequest | CompletionRequest, limits: LimitsConfig) -> None:
    """Raise ``BadRequestError`` naming the first bound ``req`` exceeds."""
    if req.logit_bias is not None and len(req.logit_bias) > limits.max_logit_bias:
        raise _refuse(
            "logit_bias", f"has {len(req.logit_bias)} entries", limits.max_logit_bias, "max_logit_bias"
        )
    if not isinstance(req, ChatCompletionRequest):
        return
    if req.tools is not None:
        if len(req.tools) > limits.max_tools:
            raise _refuse("tools", f"has {len(req.tools)} tools", limits.max_tools, "max_tools")
        # All tools together: the tool-call grammar is compiled from their union.
        _check_schema("tools", req.tools, limits)
    fmt = req.response_format
    if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema is not None:
        _check_schema("response_format.json_schema.schema", fmt.json_schema.schema, limits)


class TenantLimiter:
    """Per-caller token buckets: requests (``rate_limit_rpm``) and tokens (``rate_limit_tpm``)."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}

    def check(self, key: str, per_minute: int, cost: float = 1.0) -> float | None:
        """None when allowed (``cost`` is charged); otherwise the seconds until it would be.

        A cost above the bucket's size passes once the bucket is full and leaves it in debt, so a
        large request is possible but paid for by the wait of the next ones."""
        t = time.monotonic()
        tokens, last = self._buckets.get(key, (float(per_minute), t))
        tokens = min(float(per_minute), tokens + (t - last) * per_minute / 60.0)
        need = min(cost, float(per_minute))
        if tokens < need:
            self._buckets[key] = (tokens, t)
            return (need - tokens) * 60.0 / per_minute
        self._buckets[key] = (tokens - cost, t)
        return None
