"""A Responses API request (``POST /v1/responses``): its body as OpenAI's reference declares it,
the fields this server refuses, and its translation into a chat request (input items, tools,
``text.format``) with the conversation it continues.
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
from router.openai.schemas import ChatCompletionRequest

__all__ = ["ResponsesRequest", "input_messages", "renamed", "to_chat", "validate"]


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/responses``: every field of OpenAI's reference (as its SDK declares them)."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    background: bool | None = None
    background_options: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    prompt: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    access_programs: Any = None


def _refuse(param: str, why: str) -> None:
    raise BadRequestError(
        f"'{param}' is not supported by this server: {why}.", param=param, code="unsupported_value"
    )


def validate(req: ResponsesRequest) -> None:
    """Every field this server cannot honour is a 400 that names it."""
    if req.background:
        _refuse("background", "responses are answered in the request (no background mode)")
    for name, why in (
        ("background_options", "there is no background mode"),
        ("conversation", "conversations are not stored; use 'previous_response_id'"),
        ("context_management", "there is no context compaction"),
        ("prompt", "there are no stored prompt templates"),
        ("moderation", "there is no moderation model"),
        ("image", "the models answer in text only"),
        ("access_programs", "there are no access programs"),
        ("max_tool_calls", "the number of tool calls is not capped"),
        ("top_logprobs", "token logprobs are served on /v1/chat/completions"),
    ):
        if getattr(req, name) is not None:
            _refuse(name, why)
    if req.include:
        _refuse("include", f"no extra output data is produced ({req.include[0]!r})")
    if req.reasoning is not None and req.reasoning.get("effort") not in (None, "none"):
        _refuse("reasoning", "the models are not reasoning models")
    if req.truncation not in (None, "disabled"):
        _refuse("truncation", "the input is never truncated (a too long input is a 400)")
    if req.stream_options is not None:
        if not req.stream:
            raise BadRequestError(
                "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
            )
        unknown = set(req.stream_options) - {"include_obfuscation"}
        if unknown:
            name = f"stream_options.{sorted(unknown)[0]}"
            raise BadRequestError(f"Unrecognized request argument supplied: {name}", param=name)
        if req.stream_options.get("include_obfuscation"):
            _refuse("stream_options.include_obfuscation", "events are sent without padding")
    if req.input is None and req.previous_response_id is None:
        raise BadRequestError("'input' is required.", param="input")


# -- request translation --------------------------------------------------------------------------
def _part_text(content: Any, where: str) -> str:
    """A message's content (a string or parts) as text; non-text parts are a 400 naming them."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequestError(f"'{where}' must be a string or a list of parts.", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal":
            continue
        else:
            _refuse(f"{where}[{j}].type", f"'{kind}' parts (the models read text only)")
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Responses ``input`` as chat-shaped messages (tool calls and results included)."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequestError(
                    f"'{where}.role' must be 'user', 'assistant', 'system' or 'developer', got {role!r}.",
                    param=f"{where}.role",
                )
            out.append({"role": role, "content": _part_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, call = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call, str):
                raise BadRequestError(
                    f"'{where}' needs 'name' and 'call_id' strings.", param=f"{where}.call_id"
                )
            arguments = item.get("arguments", "{}")
            fn = {
                "name": name,
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
            }
            tool_call = {"id": call, "type": "function", "function": fn}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(tool_call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [tool_call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            call = item.get("call_id")
            if not isinstance(call, str):
                raise BadRequestError(f"'{where}.call_id' is required.", param=f"{where}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _part_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call, "content": text})
        else:
            _refuse(f"{where}.type", f"'{kind}' items (messages, function calls and their outputs are)")
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            _refuse(f"tools[{i}].type", f"'{kind}' tools (only function tools run here)")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    _refuse("tool_choice", f"'{choice.get('type')}' choices (built-in tools do not exist here)")
    return None


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    if set(text) - {"format", "verbosity"}:
        name = f"text.{sorted(set(text) - {'format', 'verbosity'})[0]}"
        raise BadRequestError(f"Unrecognized request argument supplied: {name}", param=name)
    if text.get("verbosity") not in (None, "medium"):
        _refuse("text.verbosity", "the models have no verbosity control")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise BadRequestError("'text.format' must be an object.", param="text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        if "name" not in schema:
            raise BadRequestError("'text.format.name' is required.", param="text.format.name")
        return {"type": "json_schema", "json_schema": schema}
    raise BadRequestError(
        f"'text.format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
        param="text.format.type",
    )


_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "stream_options": "stream_options",
}


def renamed(param: str | None) -> str | None:
    """A chat field named in an error, as the Responses API calls it."""
    return rename_param(param, _PARAMS, _format_param)


def _format_param(rest: str) -> str:
    rest = rest.removeprefix("json_schema.").removeprefix("json_schema")
    return "text.format" + ("." + rest if rest else "")


def to_chat(
    req: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The internal request, and the conversation it continues plus its new input (to store)."""
    conversation = [*history, *input_messages(req.input)]
    if not conversation:
        raise BadRequestError("'input' must contain at least one item.", param="input")
    messages = conversation
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}, *conversation]
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": _chat_tools(req.tools),
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
        "user": req.user,
        "safety_identifier": req.safety_identifier,
        "metadata": req.metadata,
        "prompt_cache_key": req.prompt_cache_key,
        "prompt_cache_options": req.prompt_cache_options,
        "prompt_cache_retention": req.prompt_cache_retention,
        "service_tier": req.service_tier,
        "stream": bool(req.stream),
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return chat_request(body, _invalid), conversation


def _invalid(exc: msgspec.ValidationError, path: str | None) -> BadRequestError:
    return BadRequestError(f"Invalid request: {exc}", param=renamed(path))
