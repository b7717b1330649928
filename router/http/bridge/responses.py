"""OpenAI's Responses API (``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``) at the
edge of the one pipeline.

A request is translated into the internal request type (``ChatCompletionRequest``) and answered by
``RouterService.chat``, so the classifier, the policy, the cache, admission, tenancy, traces and
metrics apply unchanged; the Chat Completions answer (one body, or its SSE chunks) is translated
back into a ``response`` object or the Responses API's typed event stream.

- ``input``: a string, or items: messages (``input_text``/``output_text`` parts), ``function_call``
  and ``function_call_output``; ``instructions`` is the system message of this turn only.
- ``tools`` (function tools) and ``tool_choice``; ``text.format`` (``json_schema``,
  ``json_object``) through the grammar engine; ``max_output_tokens``, ``temperature``, ``top_p``.
- ``store`` (default true) keeps the response and its conversation in memory, per caller partition
  (tenant, else API key), bounded in count and bytes (``router.pipeline.response_store``):
  ``previous_response_id`` continues one, ``GET``/``DELETE`` read or forget it. Another tenant's id
  is a 404, as an unknown one is.
- Fields this server cannot honour (built-in tools, background mode, reasoning, conversations,
  prompt templates...) are a 400 that names them; unknown fields are a 400 too.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from litestar import Request, Response, delete, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.status_codes import HTTP_200_OK

from router.errors import ModelNotFoundError
from router.http.bridge.chat import (
    EventTranslator,
    answer_through_chat,
    first_choice,
    typed_event,
)
from router.http.bridge.responses_request import ResponsesRequest, renamed, to_chat, validate
from router.http.routes import _ERRORS, _context, _respond, metered
from router.openai import api_types
from router.pipeline.calls import Completion
from router.pipeline.response_store import ResponseStore

__all__ = ["RESPONSES_ROUTES", "ResponsesRequest"]


# -- the store ------------------------------------------------------------------------------------
def _store(request: Request[Any, Any, Any]) -> ResponseStore:
    state = request.app.state
    store = state.get("response_store")
    if store is None:
        store = state["response_store"] = ResponseStore()
    return store


def _partition(request: Request[Any, Any, Any]) -> str:
    """Whose stored responses a caller sees: its tenant, else its API key's fingerprint."""
    ctx = _context(request)
    if ctx.tenant is not None:
        return "t:" + ctx.tenant
    return "k:" + ctx.principal if ctx.principal is not None else "-"


def _not_found(response_id: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"No response found with id '{response_id[:100]}'.", param="response_id", code="not_found"
    )


# -- answer translation ---------------------------------------------------------------------------
def _usage(chat_usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _envelope(req: ResponsesRequest, rid: str, created: int, model: str) -> dict[str, Any]:
    """The response object's request-echo fields (what OpenAI returns with every response)."""
    text = req.text if req.text and req.text.get("format") else {"format": {"type": "text"}}
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store is not False,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": text,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def _finish(body: dict[str, Any], finish_reason: str | None, usage: Mapping[str, Any] | None) -> None:
    if finish_reason == "length":
        body["status"] = "incomplete"
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        body["status"] = "completed"
    body["usage"] = _usage(usage)


def _assistant_turn(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a later turn continues from."""
    text = "".join(
        p["text"] for item in output if item["type"] == "message" for p in item["content"] if "text" in p
    )
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in output
        if i["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def response_body(req: ResponsesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    """A Chat Completions body as a ``response`` object."""
    created = int(chat.get("created") or time.time())
    body = _envelope(req, _item_id("resp"), created, chat["model"])
    text, calls, finish_reason = first_choice(chat)
    output: list[dict[str, Any]] = []
    if text or not calls:
        output.append(_message_item(_item_id("msg"), text))
    for call in calls:
        fn = call["function"]
        output.append(_call_item(_item_id("fc"), call["id"], fn["name"], fn["arguments"]))
    body["output"] = output
    _finish(body, finish_reason, chat.get("usage"))
    return body


class ResponsesEvents(EventTranslator):
    """Chat Completions chunks in, the Responses API's typed events out (``sequence_number`` in
    order): ``response.created``, ``response.in_progress``, per item ``output_item.added`` ->
    deltas -> ``...done``, then ``response.completed`` (or ``response.incomplete`` at
    ``max_output_tokens``, ``response.failed`` on an error)."""

    def __init__(
        self, req: ResponsesRequest, model: str, on_done: Callable[[dict[str, Any]], object]
    ) -> None:
        self.body = _envelope(req, _item_id("resp"), int(time.time()), model)
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        """The item being streamed (its ``output_index`` is ``len(self.output)``)."""
        self.on_done = on_done
        """Called with the finished response object (the store keeps it)."""

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return typed_event(kind, payload)

    def start(self) -> list[bytes]:
        return [
            self.event("response.created", response=dict(self.body)),
            self.event("response.in_progress", response=dict(self.body)),
        ]

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output)
        item["status"] = "completed"
        self.output.append(item)
        if item["type"] == "message":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            return [
                self.event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                self.event("response.content_part.done", **where, part=part),
                self.event("response.output_item.done", output_index=index, item=item),
            ]
        return [
            self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def text(self, delta: str) -> list[bytes]:
        out: list[bytes] = []
        index = len(self.output)
        if self.open is None or self.open["type"] != "message":
            out += self._close()
            index = len(self.output)
            self.open = _message_item(_item_id("msg"), "", "in_progress")
            added = dict(self.open, content=[])
            out.append(self.event("response.output_item.added", output_index=index, item=added))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=self.open["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        self.open["content"][0]["text"] += delta
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=self.open["id"],
                output_index=index,
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        )
        return out

    def call(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        fn = delta.get("function") or {}
        if delta.get("id"):  # a new call starts
            out += self._close()
            self.open = _call_item(_item_id("fc"), delta["id"], fn.get("name") or "", "", "in_progress")
            added = dict(self.open)
            out.append(self.event("response.output_item.added", output_index=len(self.output), item=added))
        if self.open is None or self.open["type"] != "function_call":
            return out
        fragment = fn.get("arguments") or ""
        if fragment:
            self.open["arguments"] += fragment
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=self.open["id"],
                    output_index=len(self.output),
                    delta=fragment,
                )
            )
        return out

    def finish(self) -> list[bytes]:
        # An empty answer is still one (empty) message, as in the non-streamed body.
        out = self.text("") if not self.output and self.open is None else []
        out += self._close()
        body = self.body
        body["output"] = self.output
        _finish(body, self.finish_reason, self.usage)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        out.append(self.event(kind, response=body))
        return out

    def fail(self, error: Mapping[str, Any]) -> list[bytes]:
        self.body["status"] = "failed"
        self.body["output"] = self.output
        self.body["error"] = {
            "code": error.get("code") or "server_error",
            "message": error.get("message", ""),
        }
        return [
            self.event(
                "error", code=error.get("code"), message=error.get("message", ""), param=error.get("param")
            ),
            self.event("response.failed", response=self.body),
        ]

    def done(self) -> None:
        self.on_done(self.body)


async def create_response(
    request: Request[Any, Any, Any], req: ResponsesRequest, store: ResponseStore
) -> Completion:
    """Translate, answer through ``RouterService.chat``, translate back (and store)."""
    validate(req)
    partition = _partition(request)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prior = store.get(partition, req.previous_response_id)
        if prior is None:
            err = _not_found(req.previous_response_id)
            err.param = "previous_response_id"
            raise err
        history = prior.conversation
    chat, conversation = to_chat(req, history)

    def remember(body: dict[str, Any]) -> dict[str, Any]:
        if req.store is not False:
            store.put(partition, body, [*conversation, *_assistant_turn(body["output"])])
        return body

    return await answer_through_chat(
        request,
        chat,
        renamed,
        lambda chat_body: remember(response_body(req, chat_body)),
        lambda model: ResponsesEvents(req, model, remember),
    )


# -- routes ---------------------------------------------------------------------------------------
@post(
    "/v1/responses",
    status_code=HTTP_200_OK,
    summary="Create a model response (OpenAI Responses API), routed like a chat completion",
    responses={
        200: ResponseSpec(
            api_types.ResponseObject, description="The response, or an SSE stream of typed events"
        ),
        **_ERRORS,
    },
)
async def create(request: Request[Any, Any, Any], data: ResponsesRequest) -> Response[Any]:
    return await _respond(request, create_response(request, data, _store(request)))


@get(
    "/v1/responses/{response_id:str}",
    summary="Retrieve a stored response",
    responses={200: ResponseSpec(api_types.ResponseObject), 404: _ERRORS[404]},
)
async def retrieve(request: Request[Any, Any, Any], response_id: str) -> Response[Any]:
    metered(request)
    item = _store(request).get(_partition(request), response_id)
    if item is None:
        raise _not_found(response_id)
    return Response(content=item.response, status_code=HTTP_200_OK)


@delete(
    "/v1/responses/{response_id:str}",
    status_code=HTTP_200_OK,
    summary="Delete a stored response",
    responses={200: ResponseSpec(api_types.DeletedResponse), 404: _ERRORS[404]},
)
async def remove(request: Request[Any, Any, Any], response_id: str) -> Response[Any]:
    metered(request)
    if not _store(request).delete(_partition(request), response_id):
        raise _not_found(response_id)
    body = {"id": response_id, "object": "response", "deleted": True}
    return Response(content=body, status_code=HTTP_200_OK)


RESPONSES_ROUTES = [create, retrieve, remove]
