"""Bounds on what one request may ask (``service.limits``): they bound work that grows with the
request and that the rest of the traffic would otherwise pay for - a ``logit_bias`` entry is
applied to every row at every engine step, a JSON schema node becomes grammar states compiled
before the first token, a tool adds to the prompt and to the tool-call grammar. Each refusal is a
400 in OpenAI's shape naming the field and the limit (``code``: ``limit_exceeded``), so a client
can tell which bound it hit and by how much.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from router.errors import BadRequestError
from router.openai.schemas import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from router.policy.schema import LimitsConfig

__all__ = ["check_limits", "limit_refusal", "schema_size"]


def limit_refusal(param: str, what: str, limit: int, key: str) -> BadRequestError:
    return BadRequestError(
        f"'{param}' {what}; the limit is {limit} (service.limits.{key}).",
        param=param,
        code="limit_exceeded",
    )


def schema_size(
    schema: Any, max_nodes: int, max_depth: int, max_chars: int | None = None
) -> tuple[int, int, int, int]:
    """``(nodes, depth, widest, chars)`` of a JSON value (``widest``: the most ``properties`` of
    one object; ``chars``: the length of every key and string in it - one huge ``pattern`` or
    ``enum`` value is a large grammar in a single node); counting stops once a bound is passed
    (so a huge schema costs no more than ``max_nodes`` steps to refuse)."""
    nodes = 0
    deepest = 0
    widest = 0
    chars = 0
    char_bound = max_chars if max_chars is not None else float("inf")
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        deepest = max(deepest, depth)
        if nodes > max_nodes or deepest > max_depth or chars > char_bound:
            break
        if isinstance(value, dict):
            props = value.get("properties")
            if isinstance(props, dict):
                widest = max(widest, len(props))
            chars += sum(len(k) for k in value if isinstance(k, str))
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str):
            chars += len(value)
    return nodes, deepest, widest, chars


def _check_schema(param: str, schema: Any, limits: LimitsConfig) -> None:
    nodes, depth, widest, chars = schema_size(
        schema, limits.max_schema_nodes, limits.max_schema_depth, limits.max_schema_chars
    )
    if nodes > limits.max_schema_nodes:
        raise limit_refusal(param, "has too many schema nodes", limits.max_schema_nodes, "max_schema_nodes")
    if depth > limits.max_schema_depth:
        raise limit_refusal(param, "is nested too deeply", limits.max_schema_depth, "max_schema_depth")
    if widest > limits.max_schema_properties:
        why = f"has an object of {widest} properties"
        raise limit_refusal(param, why, limits.max_schema_properties, "max_schema_properties")
    if chars > limits.max_schema_chars:
        why = "has more text (keys, patterns, enum values, descriptions) than allowed"
        raise limit_refusal(param, why, limits.max_schema_chars, "max_schema_chars")


def check_limits(req: ChatCompletionRequest | CompletionRequest, limits: LimitsConfig) -> None:
    """Raise ``BadRequestError`` naming the first bound ``req`` exceeds."""
    if req.logit_bias is not None and len(req.logit_bias) > limits.max_logit_bias:
        raise limit_refusal(
            "logit_bias", f"has {len(req.logit_bias)} entries", limits.max_logit_bias, "max_logit_bias"
        )
    asked, param = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        asked, param = req.max_completion_tokens, "max_completion_tokens"
    if asked is not None:
        choices = max(req.n or 1, getattr(req, "best_of", None) or 1)
        # One choice is bounded by the serving tier's context window instead (service.generate).
        if choices > 1 and choices * asked > limits.max_request_tokens:
            what = f"asks for {choices} x {asked} = {choices * asked} output tokens (n x max_tokens)"
            raise limit_refusal(param, what, limits.max_request_tokens, "max_request_tokens")
    if not isinstance(req, ChatCompletionRequest):
        return  # a completion's prompts are counted once known (parse_completions)
    if req.tools is not None:
        if len(req.tools) > limits.max_tools:
            raise limit_refusal("tools", f"has {len(req.tools)} tools", limits.max_tools, "max_tools")
        # All tools together: the tool-call grammar is compiled from their union.
        _check_schema("tools", req.tools, limits)
    fmt = req.response_format
    if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema is not None:
        _check_schema("response_format.json_schema.schema", fmt.json_schema.schema, limits)
