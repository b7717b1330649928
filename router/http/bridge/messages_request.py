"""An Anthropic Messages request (``POST /v1/messages`` and ``count_tokens``): its body as the
reference declares it, the fields this server refuses, and its translation into a chat request
(content blocks, tools, ``output_config``, a prefilled assistant turn).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from router.errors import BadRequestError
from router.http.bridge.chat import (
    chat_request,
    rename_param,
)
from router.openai.schemas import MAX_STOP_LENGTH, MAX_STOP_SEQUENCES, ChatCompletionRequest

__all__ = [
    "CountTokensRequest",
    "MessagesRequest",
    "chat_messages",
    "convert",
    "count_tokens_body",
    "renamed",
    "to_chat",
    "validate",
]


class MessagesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/messages``: the fields of Anthropic's reference (as its SDK declares them), plus
    ``temperature``/``top_p``/``top_k`` (Anthropic's API has them; its newest SDK sends them as
    extra body fields)."""

    model: str
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    service_tier: str | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class CountTokensRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/messages/count_tokens``: a message request without generation settings."""

    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


def _refuse(param: str, why: str) -> None:
    raise BadRequestError(
        f"{param}: not supported by this server: {why}.", param=param, code="unsupported_value"
    )


def validate(req: MessagesRequest | CountTokensRequest) -> None:
    if isinstance(req, MessagesRequest):
        if req.max_tokens < 1:
            raise BadRequestError("max_tokens: must be at least 1.", param="max_tokens")
        if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
            raise BadRequestError("temperature: must be in [0, 1].", param="temperature")
        if req.container is not None:
            _refuse("container", "there is no code execution container")
        if req.diagnostics is not None:
            _refuse("diagnostics", "no diagnostics are collected")
        if req.inference_geo not in (None, "global"):
            _refuse("inference_geo", "the models run where this server runs")
        if req.service_tier not in (None, "auto", "standard_only"):
            _refuse("service_tier", "only 'auto' and 'standard_only' exist")
        stops = req.stop_sequences or []
        if len(stops) > MAX_STOP_SEQUENCES or any(len(x) > MAX_STOP_LENGTH for x in stops):
            raise BadRequestError(
                f"stop_sequences: at most {MAX_STOP_SEQUENCES} sequences of at most "
                f"{MAX_STOP_LENGTH} characters.",
                param="stop_sequences",
            )
        if req.metadata is not None and set(req.metadata) - {"user_id"}:
            name = f"metadata.{sorted(set(req.metadata) - {'user_id'})[0]}"
            raise BadRequestError(f"{name}: Extra inputs are not permitted", param=name)
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        _refuse("thinking", "the models are not reasoning models")
    if req.speed not in (None, "standard"):
        _refuse("speed", "there is no fast mode")
    if req.output_config is not None:
        extra = set(req.output_config) - {"format", "effort"}
        if extra:
            name = f"output_config.{sorted(extra)[0]}"
            raise BadRequestError(f"{name}: Extra inputs are not permitted", param=name)
        if req.output_config.get("effort") is not None:
            _refuse("output_config.effort", "the models have no effort control")
    if not req.messages:
        raise BadRequestError("messages: at least one message is required.", param="messages")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise BadRequestError(f"{where}: must be a string or a list of content blocks.", param=where)
    return content


def _text_of(content: Any, where: str) -> str:
    parts = []
    for j, block in enumerate(_blocks(content, where)):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            _refuse(f"{where}.{j}.type", f"'{block.get('type')}' blocks here (text blocks are)")
        parts.append(block["text"])
    return "".join(parts)


def chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """``system`` + ``messages`` as chat-shaped messages: ``tool_use`` blocks become an assistant's
    ``tool_calls``, ``tool_result`` blocks ``tool`` messages (before the user's own text)."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, message in enumerate(req.messages):
        role = message.get("role")
        where = f"messages.{i}"
        if role not in ("user", "assistant"):
            raise BadRequestError(
                f"{where}.role: must be 'user' or 'assistant', got {role!r}.", param=f"{where}.role"
            )
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(_blocks(message.get("content"), f"{where}.content")):
            kind = block.get("type")
            at = f"{where}.content.{j}"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                calls.append(
                    {
                        "id": str(block.get("id") or ""),
                        "type": "function",
                        "function": {"name": str(block.get("name") or ""), "arguments": arguments},
                    }
                )
            elif kind == "tool_result" and role == "user":
                content = block.get("content")
                text = "" if content is None else _text_of(content, f"{at}.content")
                if block.get("is_error"):
                    text = f"Error: {text}"
                results.append(
                    {"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""), "content": text}
                )
            else:
                _refuse(f"{at}.type", f"'{kind}' blocks in a {role} message (the models read text only)")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        else:
            out.extend(results)
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            _refuse(f"tools.{i}.type", f"'{tool.get('type')}' tools (only custom tools run here)")
        if "input_schema" not in tool:
            raise BadRequestError(f"tools.{i}.input_schema: Field required", param=f"tools.{i}.input_schema")
        fn: dict[str, Any] = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        if tool.get("strict"):
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """``tool_choice`` and ``parallel_tool_calls`` of the internal request."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, False
    raise BadRequestError(
        f"tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got {kind!r}.", param="tool_choice.type"
    )


def _response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise BadRequestError(
            "output_config.format: must be {'type': 'json_schema', 'schema': {...}}.",
            param="output_config.format",
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


_PARAMS = {
    "messages": "messages",
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "user": "metadata.user_id",
}


def renamed(param: str | None) -> str | None:
    return rename_param(param, _PARAMS, lambda _: "output_config.format")


def _prefilled(messages: list[dict[str, Any]]) -> bool | None:
    """Anthropic's prefill: a final assistant message (text, no tool call) is continued, not
    answered by a new turn."""
    last = messages[-1] if messages else {}
    return (last.get("role") == "assistant" and not last.get("tool_calls")) or None


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    choice, parallel = _chat_tool_choice(req.tool_choice)
    messages = chat_messages(req)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "continue_final_message": _prefilled(messages),
        "max_completion_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop": req.stop_sequences or None,
        # The stop sequence is kept in the text so that the answer can name it (stripped below).
        "include_stop_str_in_output": True if req.stop_sequences else None,
        "tools": _chat_tools(req.tools),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "response_format": _response_format(req.output_config),
        "user": (req.metadata or {}).get("user_id"),
        "stream": bool(req.stream),
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return convert(body)


def convert(body: dict[str, Any]) -> ChatCompletionRequest:
    """The internal request; a value it cannot hold is a 400 naming the Messages API's field."""
    return chat_request(body, _invalid)


def _invalid(exc: msgspec.ValidationError, path: str | None) -> BadRequestError:
    param = renamed(path or "messages")
    return BadRequestError(f"{param}: {exc}", param=param)


def count_tokens_body(req: CountTokensRequest) -> dict[str, Any]:
    """The chat request body a ``count_tokens`` request renders as (``convert`` types it)."""
    choice, parallel = _chat_tool_choice(req.tool_choice)
    messages = chat_messages(req)
    return {
        "model": req.model,
        "messages": messages,
        "continue_final_message": _prefilled(messages),
        "tools": _chat_tools(req.tools),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "response_format": _response_format(req.output_config),
    }
