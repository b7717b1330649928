"""Turning engine outputs into OpenAI responses - one JSON body, or an SSE stream - and recording
what each answer cost: usage, metrics, phase spans.

``ResponseWriter`` is an object the service owns. It knows nothing of the cache: a caller that
wants a complete answer stored passes ``on_complete``, which runs once an answer finished with
``stop`` (never for truncated, errored or cancelled ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from router.errors import RouterError, UnavailableError
from router.schemas import completion_id, now, usage_body
from router.sse import SSEStream, chunk, completion_body, object_name, sse_event
from tiers.output import StepOutput
from tiers.remote import RemoteError

if TYPE_CHECKING:
    from router.calls import Generation, Routed
    from router.policy.decide import Decision
    from router.telemetry import Telemetry

__all__ = ["RETRY_AFTER_S", "InFlight", "OnComplete", "ResponseWriter", "aclose_quietly", "remote_error"]

RETRY_AFTER_S = 1.0

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

    async def _first(self, source: AsyncIterator[StepOutput], timeout_s: float) -> StepOutput:
        """The first output, bounded by the queue timeout (waiting for a slot counts)."""
        try:
            return await asyncio.wait_for(anext(source), timeout=timeout_s)
        except TimeoutError:
            await aclose_quietly(source)
            raise UnavailableError(
                "Timed out waiting for capacity; retry shortly.",
                code="queue_timeout",
                retry_after=RETRY_AFTER_S,
            ) from None
        except RemoteError as exc:
            raise remote_error(exc) from exc

    def span_attributes(self, gen: Generation, d: Decision, routed: Routed) -> dict[str, Any]:
        req = gen.request
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat" if gen.kind == "chat" else "text_completion",
            "gen_ai.request.model": req.model,
            "gen_ai.response.model": d.tier,
            "router.tier": d.tier,
            "router.rule": d.rule,
            "router.score": routed.score.value,
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

    async def collect(
        self,
        gen: Generation,
        d: Decision,
        source: AsyncIterator[StepOutput],
        span_attrs: dict[str, Any],
        prompt_hint: int,
        *,
        timeout_s: float,
        on_complete: OnComplete | None = None,
    ) -> dict[str, Any]:
        self._enter()
        try:
            parts: list[str] = []
            out = await self._first(source, timeout_s)
            while True:
                parts.append(out.text)
                if out.finish_reason is not None:
                    break
                try:
                    out = await anext(source)
                except RemoteError as exc:
                    raise remote_error(exc) from exc
            text = "".join(parts)
            if out.finish_reason == "error":
                self._count(gen, d, "error")
                raise RouterError(
                    f"Generation failed: {out.error or 'internal error'}", code="generation_error"
                )
            if out.finish_reason == "abort":
                self._count(gen, d, "cancelled")
                raise UnavailableError(
                    "Generation was cancelled.", code="cancelled", retry_after=RETRY_AFTER_S
                )
            usage = self._finish_record(gen, d, out, "ok", span_attrs, prompt_hint, text)
            body = completion_body(gen.kind, d.tier, text, out.finish_reason, usage)
            if on_complete is not None and out.finish_reason == "stop":
                await on_complete(body)
            return body
        finally:
            await aclose_quietly(source)
            self._leave()

    async def sse(
        self,
        gen: Generation,
        d: Decision,
        source: AsyncIterator[StepOutput],
        span_attrs: dict[str, Any],
        prompt_hint: int,
        *,
        timeout_s: float,
        on_complete: OnComplete | None = None,
    ) -> AsyncIterator[bytes]:
        # Wait for the first token before the response starts, so a queue timeout is still a 503.
        self._enter()
        try:
            first = await self._first(source, timeout_s)
        except BaseException:
            await aclose_quietly(source)
            self._leave()
            raise
        return SSEStream(
            self._sse_body(gen, d, source, first, span_attrs, prompt_hint, on_complete), self._leave
        )

    async def _sse_body(
        self,
        gen: Generation,
        d: Decision,
        source: AsyncIterator[StepOutput],
        first: StepOutput,
        span_attrs: dict[str, Any],
        prompt_hint: int,
        on_complete: OnComplete | None,
    ) -> AsyncGenerator[bytes, None]:
        cid = completion_id("chatcmpl" if gen.kind == "chat" else "cmpl")
        created = now()
        texts: list[str] = []
        try:
            if gen.kind == "chat":
                yield sse_event(
                    chunk(gen.kind, cid, created, d.tier, {"role": "assistant", "content": ""}, None)
                )
            out = first
            while True:
                if out.finish_reason == "error":
                    self._count(gen, d, "error")
                    err = RouterError(
                        f"Generation failed: {out.error or 'internal error'}", code="generation_error"
                    )
                    yield sse_event(err.to_body())
                    return
                if out.text:
                    texts.append(out.text)
                    delta = {"content": out.text} if gen.kind == "chat" else out.text
                    yield sse_event(chunk(gen.kind, cid, created, d.tier, delta, None))
                if out.finish_reason is not None:
                    break
                try:
                    out = await anext(source)
                except RemoteError as exc:
                    yield sse_event(remote_error(exc).to_body())
                    return
            if out.finish_reason == "abort":
                self._count(gen, d, "cancelled")
                return
            text = "".join(texts)
            usage = self._finish_record(gen, d, out, "ok", span_attrs, prompt_hint, text)
            empty: Any = {} if gen.kind == "chat" else ""
            yield sse_event(chunk(gen.kind, cid, created, d.tier, empty, out.finish_reason))
            if gen.include_usage:
                yield sse_event(
                    {
                        "id": cid,
                        "object": object_name(gen.kind, chunk=True),
                        "created": created,
                        "model": d.tier,
                        "choices": [],
                        "usage": usage,
                    }
                )
            yield b"data: [DONE]\n\n"
            if on_complete is not None and out.finish_reason == "stop":
                await on_complete(completion_body(gen.kind, d.tier, text, out.finish_reason, usage))
        finally:
            await aclose_quietly(source)  # client gone mid-stream: this aborts the engine request


async def aclose_quietly(source: AsyncIterator[StepOutput]) -> None:
    close = getattr(source, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()


def remote_error(exc: RemoteError) -> RouterError:
    if exc.status_code in (503, 504):
        return UnavailableError(str(exc), code="upstream_unavailable", retry_after=RETRY_AFTER_S)
    err = RouterError(str(exc), code="upstream_error")
    err.status_code = 502
    return err
