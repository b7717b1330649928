"""The one writer of OpenAI answers: engine outputs in, one JSON body or an SSE stream out (live
or replayed from the cache), with what each answer cost recorded - usage, metrics, phase spans.

``ResponseWriter`` drives one answer: it waits for the first output, then collects a JSON body or
writes an SSE stream, and records what the answer cost once it ends. Each choice's items are built
by ``choices.ChoiceBuilder``, the choices' streams merged by ``merge.Merged``, and the wire shapes
(envelopes, chunks, usage, SSE framing, the guaranteed ``[DONE]``) written by ``sse``.

Local tiers give one output stream per choice (``Engine.submit_n``) with token logprobs; remote
tiers give one stream whose outputs carry their choice ``index`` and the upstream's own
tool-call deltas and logprobs objects, passed through unchanged.

``ResponseWriter`` is an object the service owns. It knows nothing of the cache: a caller that
wants a complete answer stored passes ``on_complete``, which runs once an answer finished with
``stop`` (never for truncated, errored or cancelled ones).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from router.errors import RETRY_AFTER_S, RemoteError, RouterError, UnavailableError, remote_error
from router.openai.logprobs import (
    TokenTexts,
)
from router.openai.request import completion_id
from router.openai.structured import OutputSpec
from router.openai.writer.choices import ChoiceBuilder, aggregate
from router.openai.writer.merge import Merged
from router.openai.writer.sse import DONE, SSEStream, completion_body, now, object_name, sse_event, usage_body
from tiers.core.output import StepOutput

if TYPE_CHECKING:
    from router.openai.request import Generation
    from router.policy.decide import Decision
    from router.telemetry import Telemetry

__all__ = [
    "NOTHING_SERVED",
    "RETRY_AFTER_S",
    "InFlight",
    "OnComplete",
    "ResponseWriter",
    "Served",
    "first_within",
    "remote_error",
]

T = TypeVar("T")


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
            return await first_within(source, timeout_s)
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


async def first_within(source: AsyncIterator[T], timeout_s: float) -> T:
    """``source``'s first item within ``timeout_s`` (a 503 ``queue_timeout`` past it, the source
    closed); ``StopAsyncIteration`` when it is empty."""
    try:
        return await asyncio.wait_for(anext(source), timeout=timeout_s)
    except TimeoutError:
        close = getattr(source, "aclose", None)
        if close is not None:
            await close()
        raise UnavailableError(
            "Timed out waiting for capacity; retry shortly.",
            code="queue_timeout",
            retry_after=RETRY_AFTER_S,
        ) from None
