"""The one writer of OpenAI answers: engine outputs in, one JSON body or an SSE stream out (live
or replayed from the cache), with what each answer cost recorded - usage, metrics, phase spans.

Every wire shape of a chat or text completion is assembled here - the envelope, each choice's
items (message content or ``tool_calls``, ``logprobs`` objects, ``finish_reason``), stream chunks
and their SSE framing, usage, the stream's guaranteed ``[DONE]`` - so an answer's bytes are
written by one module, which reaches out only for leaf helpers (token logprobs, tool-call
parsing) and, once the answer ends, telemetry. It is long for that reason: split, one answer's
outputs would bounce between modules at every token.

Local tiers give one output stream per choice (``Engine.submit_n``) with token logprobs; remote
tiers give one stream whose outputs carry their choice ``index`` and the upstream's own
tool-call deltas and logprobs objects, passed through unchanged.

``ResponseWriter`` is an object the service owns. It knows nothing of the cache: a caller that
wants a complete answer stored passes ``on_complete``, which runs once an answer finished with
``stop`` (never for truncated, errored or cancelled ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.errors import RemoteError, RouterError, UnavailableError
from router.openai.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
    prompt_completion_logprobs,
)
from router.openai.request import completion_id
from router.openai.structured import OutputSpec
from router.openai.tools import ToolCallStreamer, parse_tool_calls
from tiers.core.output import StepOutput

if TYPE_CHECKING:
    from router.openai.request import Generation
    from router.policy.decide import Decision
    from router.telemetry import Telemetry

__all__ = [
    "DONE",
    "ERROR_PREFIX",
    "NOTHING_SERVED",
    "RETRY_AFTER_S",
    "ChoiceBuilder",
    "InFlight",
    "Merged",
    "OnComplete",
    "ResponseWriter",
    "SSEStream",
    "Served",
    "aggregate",
    "completion_body",
    "now",
    "remote_error",
    "replay",
    "sse_event",
    "usage_body",
]

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0


def now() -> int:
    """An answer's ``created``: Unix seconds."""
    return int(time.time())


@dataclass(frozen=True, slots=True)
class Served:
    """What the answer writer learns from the backend that took a request (the request's own
    ``OutputSpec`` stays what the caller asked for)."""

    system_fingerprint: str | None = None
    """The tier's serving configuration (OpenAI's ``system_fingerprint``)."""
    token_texts: TokenTexts | None = None
    """The local tier's token texts, for logprobs; None for remote tiers, which send theirs."""
    choices: int | None = None
    """Choices the backend returns, where it settles ``best_of`` itself (a remote upstream ranks
    its candidates and sends the ``n`` winners); None: ``max(n, best_of)``, ranked here."""


NOTHING_SERVED = Served()

OnComplete = Callable[[dict[str, Any]], Awaitable[None]]
"""Called with the finished body of an answer that ended with ``stop`` (the cache stores it)."""


class InFlight:
    """Requests between admission and their last byte; draining waits for this to reach zero."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count <= 0:
            self.count = 0
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


@dataclass(slots=True)
class _Answer:
    """One answer being written: its request and decision, its merged outputs and choices, and
    what its end reports (span attributes, the prompt's length when no output says it, the
    store)."""

    gen: Generation
    d: Decision
    served: Served
    merged: Merged
    choices: list[ChoiceBuilder]
    span_attrs: dict[str, Any]
    prompt_hint: int
    on_complete: OnComplete | None


class ResponseWriter:
    def __init__(self, telemetry: Telemetry, in_flight: InFlight) -> None:
        self.telemetry = telemetry
        self.in_flight = in_flight

    def _enter(self) -> None:
        self.in_flight.enter()

    def _leave(self) -> None:
        self.in_flight.leave()

    def _count(self, gen: Generation, d: Decision, outcome: str) -> None:
        tenant = gen.ctx.tenant_label if gen.ctx is not None else "-"
        self.telemetry.count_request(gen.kind, d.tier, d.rule, outcome, tenant)

    async def _first(self, source: Merged, timeout_s: float) -> tuple[int, StepOutput]:
        """The first output, bounded by the queue timeout (waiting for a slot counts)."""
        try:
            return await asyncio.wait_for(anext(source), timeout=timeout_s)
        except TimeoutError:
            await source.aclose()
            raise UnavailableError(
                "Timed out waiting for capacity; retry shortly.",
                code="queue_timeout",
                retry_after=RETRY_AFTER_S,
            ) from None
        except RemoteError as exc:
            raise remote_error(exc) from exc

    def span_attributes(self, gen: Generation, d: Decision, score: float) -> dict[str, Any]:
        req = gen.request
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat" if gen.kind == "chat" else "text_completion",
            "gen_ai.request.model": req.model,
            "gen_ai.response.model": d.tier,
            "router.tier": d.tier,
            "router.rule": d.rule,
            "router.score": score,
            "router.reason": d.reason,
        }
        for key, value in (
            ("temperature", req.temperature),
            ("top_p", req.top_p),
            ("max_tokens", req.max_tokens),
            ("seed", req.seed),
        ):
            if value is not None:
                attrs[f"gen_ai.request.{key}"] = value
        if self.telemetry.record_content:
            attrs["gen_ai.prompt"] = (
                json.dumps(gen.messages) if gen.messages is not None else (gen.prompt or "")
            )
        return attrs

    def _finish_record(
        self,
        gen: Generation,
        d: Decision,
        last: StepOutput,
        outcome: str,
        span_attrs: dict[str, Any],
        prompt_hint: int,
        text: str,
    ) -> dict[str, Any]:
        prompt_tokens = last.num_prompt_tokens or prompt_hint
        self._count(gen, d, outcome)
        if last.timings:
            self.telemetry.record_generation(
                d.tier, last.timings, prompt_tokens, last.num_output_tokens, last.num_cached_tokens
            )
            if "arrival" in last.timings and "finish" in last.timings:
                self.telemetry.e2e.labels(d.tier).observe(last.timings["finish"] - last.timings["arrival"])
        attrs = dict(span_attrs)
        attrs.update(
            {
                "gen_ai.usage.input_tokens": prompt_tokens,
                "gen_ai.usage.output_tokens": last.num_output_tokens,
                "gen_ai.response.finish_reasons": [last.finish_reason or ""],
                "router.spec.draft_tokens": last.num_draft_tokens,
                "router.spec.accepted_tokens": last.num_accepted_tokens,
                "router.cached_tokens": last.num_cached_tokens,
            }
        )
        if self.telemetry.record_content:
            attrs["gen_ai.completion"] = text
        parent = gen.ctx.span if gen.ctx is not None else None
        if parent is not None:
            parent.set_attributes(attrs)
        self.telemetry.phase_spans(last.timings, attrs, parent=parent)
        return usage_body(
            prompt_tokens,
            last.num_output_tokens,
            last.num_cached_tokens,
            last.num_draft_tokens,
            last.num_accepted_tokens,
        )

    def _choices(self, gen: Generation, served: Served) -> list[ChoiceBuilder]:
        spec = gen.output if gen.output is not None else OutputSpec()
        count = served.choices if served.choices is not None else max(spec.n, spec.best_of)
        return [ChoiceBuilder(i, gen.kind, spec, served.token_texts, gen.prompt or "") for i in range(count)]

    def _envelope(
        self, gen: Generation, served: Served, cid: str, created: int, model: str, *, stream: bool
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": cid,
            "object": object_name(gen.kind, chunk=stream),
            "created": created,
            "model": model,
        }
        if served.system_fingerprint:
            body["system_fingerprint"] = served.system_fingerprint
        return body

    @staticmethod
    def _failure(choices: list[ChoiceBuilder]) -> StepOutput | None:
        for c in choices:
            if c.last is not None and c.last.finish_reason in ("error", "abort"):
                return c.last
        return None

    def _settle(
        self,
        gen: Generation,
        d: Decision,
        choices: list[ChoiceBuilder],
        span_attrs: dict[str, Any],
        prompt_hint: int,
    ) -> tuple[StepOutput, str, dict[str, Any]]:
        """A whole answer's accounting, recorded: ``(total, every choice's text, usage body)``."""
        total = aggregate(choices)
        text = "".join(c.text for c in choices)
        return total, text, self._finish_record(gen, d, total, "ok", span_attrs, prompt_hint, text)

    async def answer(
        self,
        gen: Generation,
        d: Decision,
        source: AsyncIterator[StepOutput] | list[AsyncIterator[StepOutput]],
        span_attrs: dict[str, Any],
        prompt_hint: int,
        *,
        served: Served = NOTHING_SERVED,
        timeout_s: float,
        on_complete: OnComplete | None = None,
    ) -> tuple[dict[str, Any] | None, AsyncIterator[bytes] | None]:
        """``(body, None)`` for a collected answer, ``(None, SSE stream)`` for a streamed one; the
        first output must come within ``timeout_s`` (waiting for a slot counts)."""
        merged = Merged(source if isinstance(source, list) else [source])
        choices = self._choices(gen, served)
        self._enter()
        try:
            first = await self._first(merged, timeout_s)
        except BaseException:
            try:
                await merged.aclose()
            finally:
                self._leave()
            raise
        answer = _Answer(gen, d, served, merged, choices, span_attrs, prompt_hint, on_complete)
        if gen.stream:
            # The first token came before the response starts, so a queue timeout is still a 503.
            return None, SSEStream(self._sse_body(answer, first), self._leave)
        try:
            return await self._collect(answer, first), None
        finally:
            # Left even when the close is itself cancelled (anyio re-delivers a cancelled scope's
            # cancellation at every await): otherwise draining would wait for this request forever.
            try:
                await merged.aclose()
            finally:
                self._leave()

    async def _collect(self, a: _Answer, first: tuple[int, StepOutput]) -> dict[str, Any]:
        gen, d, merged, choices = a.gen, a.d, a.merged, a.choices
        index, out = first
        while True:
            if index < len(choices):
                choices[index].add(out)
            if self._failure(choices) is not None:
                break
            following = await _next(merged)
            if following is None:
                break
            index, out = following
        failed = self._failure(choices)
        if failed is not None and failed.finish_reason == "error":
            self._count(gen, d, "error")
            raise _generation_failed(failed)
        if failed is not None:
            self._count(gen, d, "cancelled")
            raise UnavailableError("Generation was cancelled.", code="cancelled", retry_after=RETRY_AFTER_S)
        total, _, usage = self._settle(gen, d, choices, a.span_attrs, a.prompt_hint)
        kept = _best(gen, choices)
        body = self._envelope(gen, a.served, completion_id(_prefix(gen)), now(), d.tier, stream=False)
        body["choices"] = [dict(c.body(), index=i) for i, c in enumerate(kept)]
        body["usage"] = usage
        if a.on_complete is not None and _storable(gen, total):
            await a.on_complete(body)
        return body

    async def _sse_body(self, a: _Answer, first: tuple[int, StepOutput]) -> AsyncGenerator[bytes, None]:
        gen, d, merged, choices, prompt_hint = a.gen, a.d, a.merged, a.choices, a.prompt_hint
        envelope = self._envelope(gen, a.served, completion_id(_prefix(gen)), now(), d.tier, stream=True)
        options = gen.request.stream_options
        # vLLM's continuous_usage_stats: each chunk carries the usage so far (all choices together).
        running: dict[int, StepOutput] | None = (
            {} if options is not None and options.continuous_usage_stats else None
        )

        def event(items: list[dict[str, Any]]) -> bytes:
            if running is None:
                return sse_event({**envelope, "choices": items})
            return sse_event({**envelope, "choices": items, "usage": _usage_so_far(running, prompt_hint)})

        try:
            index, out = first
            if running is not None:
                running[index] = out
            for c in choices:
                for item in c.first_items():
                    yield event([item])
            while True:
                if running is not None:
                    running[index] = out
                if out.finish_reason == "error":
                    self._count(gen, d, "error")
                    yield sse_event(_generation_failed(out).to_body())
                    return
                if out.finish_reason == "abort":
                    self._count(gen, d, "cancelled")
                    return
                if index < len(choices):
                    c = choices[index]
                    for item in c.add(out):
                        yield event([item])
                    if c.finished:
                        for item in c.final_items():
                            yield event([item])
                try:
                    following = await _next(merged)
                except RouterError as err:
                    yield sse_event(err.to_body())
                    return
                if following is None:
                    break
                index, out = following
            total, text, usage = self._settle(gen, d, choices, a.span_attrs, prompt_hint)
            if gen.include_usage:
                yield sse_event({**envelope, "choices": [], "usage": usage})
            yield DONE
            if a.on_complete is not None and _storable(gen, total):
                body = completion_body(gen.kind, d.tier, text, total.finish_reason, usage)
                if a.served.system_fingerprint:
                    body["system_fingerprint"] = a.served.system_fingerprint
                await a.on_complete(body)
        finally:
            await merged.aclose()  # client gone mid-stream: this aborts the engine requests


async def _next(merged: Merged) -> tuple[int, StepOutput] | None:
    """The next ``(choice index, output)``, None once every source ended; an upstream failure as
    the client should see it."""
    try:
        return await anext(merged)
    except StopAsyncIteration:
        return None
    except RemoteError as exc:
        raise remote_error(exc) from exc


def _generation_failed(out: StepOutput) -> RouterError:
    return RouterError(f"Generation failed: {out.error or 'internal error'}", code="generation_error")


def _storable(gen: Generation, total: StepOutput) -> bool:
    """Only plain answers that ended by themselves are stored (see ``OnComplete``)."""
    return (gen.output is None or gen.output.is_plain) and total.finish_reason == "stop"


def _usage_so_far(latest: dict[int, StepOutput], prompt_hint: int) -> dict[str, Any]:
    """Usage after the latest output of each choice (the counters in a step output are totals)."""
    outs = list(latest.values())
    prompt = next((o.num_prompt_tokens for o in outs if o.num_prompt_tokens), prompt_hint)
    completion = sum(o.num_output_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _prefix(gen: Generation) -> str:
    return "chatcmpl" if gen.kind == "chat" else "cmpl"


def _best(gen: Generation, choices: list[ChoiceBuilder]) -> list[ChoiceBuilder]:
    """Completions ``best_of``: the ``n`` choices with the highest mean token logprob, in their
    original order; otherwise every choice."""
    spec = gen.output
    if spec is None or len(choices) <= spec.n:
        return choices  # nothing to rank (or the backend ranked: ``Served.choices``)
    if any(not c.entries for c in choices):
        raise RouterError(
            "best_of needs token logprobs, which this tier did not report.", code="generation_error"
        )
    ranked = sorted(choices, key=lambda c: c.mean_logprob, reverse=True)[: spec.n]
    return sorted(ranked, key=lambda c: c.index)


def remote_error(exc: RemoteError) -> RouterError:
    """An upstream failure as the client should see it (see ``router.backends.remote_client``): a 4xx keeps
    its
    status, error body and Retry-After; unavailable/timed out is a 503; anything else a 502."""
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


# -- choices --------------------------------------------------------------------------------------
class Merged:
    """``(choice index, output)`` pairs from one stream per choice, in arrival order, or from a
    single stream whose outputs say their own index (a remote tier). Ends when every stream has."""

    def __init__(self, sources: list[AsyncIterator[StepOutput]]) -> None:
        self.sources = sources
        self._queue: asyncio.Queue[tuple[int, StepOutput | BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._live = len(sources)

    def __aiter__(self) -> Merged:
        return self

    async def _pump(self, index: int, source: AsyncIterator[StepOutput]) -> None:
        try:
            async for out in source:
                self._queue.put_nowait((index, out))
        except BaseException as exc:  # handed to the reader, which raises it
            self._queue.put_nowait((index, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._queue.put_nowait((index, None))

    async def __anext__(self) -> tuple[int, StepOutput]:
        if len(self.sources) == 1:
            out = await anext(self.sources[0])  # StopAsyncIteration ends us too
            return out.index, out
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self.sources)]
        while self._live:
            index, item = await self._queue.get()
            if item is None:
                self._live -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return index, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        # Every source is closed (each close aborts its engine request), even if this task is
        # cancelled while closing one of them; the cancellation is raised after the last.
        cancelled: asyncio.CancelledError | None = None
        for source in self.sources:
            close = getattr(source, "aclose", None)
            if close is None:
                continue
            try:
                await close()
            except asyncio.CancelledError as exc:
                cancelled = exc
            except Exception:
                pass
        if cancelled is not None:
            raise cancelled


@dataclass
class _RemoteCall:
    id: str | None = None
    name: str = ""
    arguments: str = ""


@dataclass
class ChoiceBuilder:
    """The state of one choice. ``add`` returns the stream chunks' ``choices`` items it makes."""

    index: int
    kind: str  # chat | completion
    spec: OutputSpec
    texts: TokenTexts | None
    prompt_text: str = ""
    """The prompt, for completions ``echo``."""
    parts: list[str] = field(default_factory=list)
    entries: list[Any] = field(default_factory=list)
    wire_logprobs: list[Any] = field(default_factory=list)
    remote_calls: dict[int, _RemoteCall] = field(default_factory=dict)
    last: StepOutput | None = None
    streamer: ToolCallStreamer | None = None
    streamed_calls: bool = False
    _offset: int = 0

    def __post_init__(self) -> None:
        if self.kind == "chat" and self.spec.parses_tool_calls:
            self.streamer = ToolCallStreamer(self.spec.tools)
        if self.spec.echo:
            self._offset = len(self.prompt_text)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None

    @property
    def mean_logprob(self) -> float:
        if not self.entries:
            return float("-inf")
        return sum(e.logprob for e in self.entries) / len(self.entries)

    def _logprobs_of(self, out: StepOutput) -> Any:
        if out.wire_logprobs is not None:
            return out.wire_logprobs
        if self.spec.logprobs is None or not out.logprobs or self.texts is None:
            return None
        if self.kind == "chat":
            return {"content": chat_logprobs(self.texts, out.logprobs, self.spec.logprobs), "refusal": None}
        lp = completion_logprobs(self.texts, list(out.logprobs), self.spec.logprobs, self._offset)
        self._offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else self._offset
        return lp

    def add(self, out: StepOutput) -> list[dict[str, Any]]:
        self.last = out
        if out.text:
            self.parts.append(out.text)
        if out.logprobs:
            self.entries.extend(out.logprobs)
        logprobs = self._logprobs_of(out)
        if out.prompt_logprobs is not None and self.texts is not None and self.spec.logprobs is not None:
            # Echo with logprobs: the prompt's tokens come first, with the first output.
            head = prompt_completion_logprobs(
                self.texts, out.prompt_token_ids or [], out.prompt_logprobs, self.spec.logprobs
            )
            logprobs = head if logprobs is None else merge_completion_logprobs([head, logprobs])
        if logprobs is not None:
            self.wire_logprobs.append(logprobs)
        items: list[dict[str, Any]] = []
        if self.kind != "chat":
            if out.text or logprobs is not None:
                items.append(self._item(out.text, logprobs))
            return items
        deltas: list[dict[str, Any]] = []
        if out.tool_calls:
            self._add_remote_calls(out.tool_calls)
            deltas.append({"tool_calls": out.tool_calls})
        if self.streamer is not None:
            deltas.extend(self.streamer.feed(out.text, final=out.finish_reason is not None))
        elif out.text:
            deltas.append({"content": out.text})
        if any("tool_calls" in d for d in deltas):
            self.streamed_calls = True
        for i, delta in enumerate(deltas):
            items.append(self._item(delta, logprobs if i == 0 else None))
        if not deltas and logprobs is not None:
            items.append(self._item({}, logprobs))
        return items

    def _add_remote_calls(self, calls: list[dict[str, Any]]) -> None:
        for c in calls:
            call = self.remote_calls.setdefault(int(c.get("index", 0)), _RemoteCall())
            call.id = c.get("id") or call.id
            fn = c.get("function") or {}
            call.name += fn.get("name") or ""
            call.arguments += fn.get("arguments") or ""

    def _item(self, delta: Any, logprobs: Any, finish: str | None = None) -> dict[str, Any]:
        item: dict[str, Any] = {"index": self.index}
        item["delta" if self.kind == "chat" else "text"] = delta
        item["logprobs"] = logprobs
        item["finish_reason"] = finish
        return item

    def finish_reason(self, has_calls: bool) -> str | None:
        reason = self.last.finish_reason if self.last is not None else None
        # OpenAI: "tool_calls" when the model called a tool; a call cut by max_tokens stays "length".
        return "tool_calls" if has_calls and reason == "stop" else reason

    def first_items(self) -> list[dict[str, Any]]:
        """Stream chunks that open the choice: the role (chat), the echoed prompt (completions)."""
        if self.kind == "chat":
            return [self._item({"role": "assistant", "content": ""}, None)]
        if self.spec.echo and self.prompt_text:
            return [self._item(self.prompt_text, None)]
        return []

    def final_items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if self.streamer is not None:
            for delta in self.streamer.feed("", final=True):
                items.append(self._item(delta, None))
                self.streamed_calls = self.streamed_calls or "tool_calls" in delta
        has_calls = self.streamed_calls or bool(self.remote_calls)
        items.append(self._item({} if self.kind == "chat" else "", None, self.finish_reason(has_calls)))
        return items

    def body(self) -> dict[str, Any]:
        """The choice of a non-streamed answer."""
        text = self.text
        logprobs: Any = None
        if self.kind == "chat":
            if self.wire_logprobs:
                content: list[Any] = []
                for lp in self.wire_logprobs:
                    content.extend((lp or {}).get("content") or [])
                logprobs = {"content": content, "refusal": None}
            calls: list[dict[str, Any]] = []
            content_text: str | None = text
            if self.remote_calls:
                calls = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for _, c in sorted(self.remote_calls.items())
                ]
            elif self.spec.parses_tool_calls:
                content_text, calls = parse_tool_calls(text, self.spec.tools)
            message: dict[str, Any] = {"role": "assistant", "content": content_text, "refusal": None}
            if calls:
                message["tool_calls"] = calls
            return {
                "index": self.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": self.finish_reason(bool(calls)),
            }
        if self.wire_logprobs:
            logprobs = merge_completion_logprobs(self.wire_logprobs)
        if self.spec.echo:
            text = self.prompt_text + text
        finish = self.finish_reason(False)
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def aggregate(choices: list[ChoiceBuilder]) -> StepOutput:
    """One ``StepOutput`` with the whole answer's accounting: the prompt once, every choice's
    generated, drafted and accepted tokens summed; timings of the first choice."""
    lasts = [c.last for c in choices if c.last is not None]
    first = lasts[0] if lasts else StepOutput("", [])
    return StepOutput(
        text="",
        token_ids=[],
        finish_reason=first.finish_reason,
        num_prompt_tokens=max((o.num_prompt_tokens for o in lasts), default=0),
        num_output_tokens=sum(o.num_output_tokens for o in lasts),
        num_cached_tokens=max((o.num_cached_tokens for o in lasts), default=0),
        num_draft_tokens=sum(o.num_draft_tokens for o in lasts),
        num_accepted_tokens=sum(o.num_accepted_tokens for o in lasts),
        timings=first.timings,
    )


# -- wire shapes ----------------------------------------------------------------------------------
DONE = b"data: [DONE]\n\n"


def usage_body(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, drafted: int = 0, accepted: int = 0
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if drafted:
        # Extension: speculative decoding stats of this response.
        body["speculative"] = {"draft_tokens": drafted, "accepted_tokens": accepted}
    return body


def object_name(kind: str, *, chunk: bool) -> str:
    if kind == "chat":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def chunk(kind: str, cid: str, created: int, model: str, delta: Any, finish: str | None) -> dict[str, Any]:
    """One streamed chunk: ``delta`` is a chat delta dict, or the text for completions."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
    choice["delta" if kind == "chat" else "text"] = delta
    return {
        "id": cid,
        "object": object_name(kind, chunk=True),
        "created": created,
        "model": model,
        "choices": [choice],
    }


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def completion_body(
    kind: str, model: str, text: str, finish: str | None, usage: dict[str, Any]
) -> dict[str, Any]:
    """The non-streaming response body."""
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    cid = completion_id("chatcmpl" if kind == "chat" else "cmpl")
    return {
        "id": cid,
        "object": object_name(kind, chunk=False),
        "created": now(),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


async def replay(kind: str, body: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    """A stored answer as the same SSE sequence a live stream produces (the cache stores plain
    one-choice text answers only: no tool calls, logprobs or n > 1)."""
    cid, created, model = body["id"], body["created"], body["model"]
    extra = {"system_fingerprint": body["system_fingerprint"]} if body.get("system_fingerprint") else {}
    first = body["choices"][0]
    text = first["message"]["content"] if kind == "chat" else first["text"]

    def event(delta: Any, finish: str | None) -> bytes:
        return sse_event({**chunk(kind, cid, created, model, delta, finish), **extra})

    if kind == "chat":
        yield event({"role": "assistant", "content": ""}, None)
    yield event({"content": text} if kind == "chat" else text, None)
    yield event({} if kind == "chat" else "", first["finish_reason"])
    if include_usage:
        usage_chunk = {"id": cid, "object": object_name(kind, chunk=True), "created": created, "model": model}
        yield sse_event({**usage_chunk, **extra, "choices": [], "usage": body["usage"]})
    yield DONE


ERROR_PREFIX = b'data: {"error"'
"""How an SSE error event starts (one an answer wrote itself, told apart from a chunk)."""


class SSEStream:
    """An SSE body whose end is accounted exactly once, however the response ends, and whose
    last event is always ``[DONE]``.

    The HTTP layer may drop a response before iterating it (the client left while the first token
    was being produced); an async generator that never started runs no ``finally``, so the
    in-flight count would leak. ``on_close`` runs on exhaustion, on ``aclose()``, or at the latest
    when the object is collected. (The engine request itself is aborted by the source generator's
    own cleanup, which asyncio runs for started generators that are dropped.)

    Once the first byte is out the status is 200 for good, so every failure after it must be told
    in the stream: a body that raises gets an OpenAI error event, and one that ends without
    ``[DONE]`` (an engine abort, an error event it wrote itself) gets the missing error event and
    ``[DONE]``, so a client never mistakes a cut answer for a whole one, nor waits for more.
    """

    def __init__(self, body: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> None:
        self._body = body
        self._on_close: Callable[[], None] | None = on_close
        self._tail: list[bytes] = []
        self._ended = False
        self._done = False
        self._errored = False

    def __aiter__(self) -> SSEStream:
        return self

    async def __anext__(self) -> bytes:
        if self._tail:
            return self._tail.pop(0)
        if self._ended:
            raise StopAsyncIteration
        try:
            data = await anext(self._body)
        except StopAsyncIteration:
            await self.aclose()
            self._end(None)
            if not self._tail:
                raise
            return self._tail.pop(0)
        except Exception as exc:
            await self.aclose()
            self._end(exc)
            return self._tail.pop(0)
        except BaseException:  # cancelled, or closed by the server: nobody is reading any more
            await self.aclose()
            raise
        if data == DONE:
            self._done = True
        elif data.startswith(ERROR_PREFIX):
            self._errored = True
        return data

    def _end(self, exc: Exception | None) -> None:
        """Queue what the stream still owes its client: an error event unless one was sent, then
        ``[DONE]`` unless it was."""
        self._ended = True
        if self._done:
            return
        if not self._errored:
            if isinstance(exc, RouterError):
                err: RouterError = exc
            elif exc is not None:
                log.error("stream failed after its first byte", exc_info=exc)
                err = RouterError("The answer failed mid-stream.", code="stream_error")
            else:
                err = UnavailableError("The answer was cut short: generation was aborted.", code="aborted")
            self._tail.append(sse_event(err.to_body()))
        self._tail.append(DONE)
        self._done = True

    def _close_sync(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    async def aclose(self) -> None:
        try:
            await self._body.aclose()
        finally:
            self._close_sync()

    def __del__(self) -> None:
        self._close_sync()
