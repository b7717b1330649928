"""A tier served by an OpenAI-compatible server elsewhere (vLLM, TGI, another tiered-router).

This is how a tier outgrows one machine: the router keeps classification, policy, caching and
telemetry, and streams the upstream's tokens through. Requests are always sent with
``stream: true`` (and usage requested) so time-to-first-token is the upstream's, whatever the
client asked for.

Failures are reported the way an OpenAI client expects them (``RemoteError`` carries what the
service needs to answer):
- a 4xx from the upstream is the client's problem and passes through with its status and error
  body (a 400 for context length stays a 400; a 429 keeps its ``Retry-After``), never retried;
- transport errors (refused, reset, protocol errors) and 502/503/504 are retried with backoff,
  but only while nothing of the answer has been passed on - a partially streamed answer is never
  replayed; then refused/unavailable is a 503, anything else a 502, a timeout a 503;
- a stream that ends without ``[DONE]`` or a ``finish_reason`` is truncated: an error, never a
  ``stop`` (so it is never cached);
- a circuit breaker counts consecutive upstream failures (not 4xx): past ``circuit_failures`` the
  tier reports itself full for ``circuit_cooldown_s`` (the policy's fallback applies), then lets
  one trial request through, which closes it again or re-opens it.

The connection pool holds as many connections as the tier admits requests (``capacity``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from router.errors import RemoteError
from tiers.core.output import StepOutput

__all__ = ["CircuitBreaker", "RemoteTier"]

log = logging.getLogger(__name__)

_RETRY_STATUS = {502, 503, 504}
_MAX_ERROR_BODY = 64 * 1024
# Errors on an open connection: the request may not have reached the upstream, or its answer did
# not get back; safe to retry only while nothing was passed on.
_TRANSPORT_ERRORS = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.LocalProtocolError)
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


class CircuitBreaker:
    """closed -> (``failures`` in a row) -> open -> (``cooldown_s``) -> half-open: one trial."""

    def __init__(self, failures: int = 5, cooldown_s: float = 10.0) -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._consecutive = 0
        self._opened_at: float | None = None
        self._trial = False
        self._trials = 0
        """Trials handed out so far: names the current one, so only its holder can give it back."""

    def open_for(self) -> float | None:
        """Seconds the circuit stays open (None when requests may go through)."""
        if self._opened_at is None:
            return None
        left = self._opened_at + self.cooldown_s - time.monotonic()
        if left > 0:
            return left
        return 0.0 if self._trial else None  # half-open: free until the trial is taken

    def allow(self) -> bool:
        """Whether a request may go; in half-open the one that may holds the trial
        (``held_trial``), which it must settle: ``success``, ``failure``, or ``release`` when it
        ends without a verdict (cancelled, cut by a client deadline)."""
        if self._opened_at is None:
            return True
        if time.monotonic() - self._opened_at < self.cooldown_s or self._trial:
            return False
        self._trial = True  # the one request that probes the upstream
        self._trials += 1
        return True

    @property
    def held_trial(self) -> int:
        """The number of the trial in progress (0: none). Read right after ``allow``."""
        return self._trials if self._trial else 0

    def release(self, trial: int) -> None:
        """Give back an unsettled trial: the next request probes instead (never stuck half-open)."""
        if trial and self._trial and trial == self._trials:
            self._trial = False

    def success(self) -> None:
        if self._opened_at is not None:
            log.info("circuit closed: the upstream answered again")
        self._consecutive, self._opened_at, self._trial = 0, None, False

    def failure(self) -> None:
        self._consecutive += 1
        if self._trial or self._consecutive >= self.failures:
            if self._opened_at is None or self._trial:
                log.warning("circuit open for %.0fs after %d failure(s)", self.cooldown_s, self._consecutive)
            self._opened_at, self._trial = time.monotonic(), False


@dataclass(slots=True)
class RemoteLoad:
    in_flight: int
    capacity: int
    circuit_open_s: float | None = None
    """Seconds until an open circuit lets a trial through (None: closed or half-open)."""
    predicted_wait_s: float = 0.0
    """Unknown for an upstream: it queues on its own side (admission counts in-flight only)."""

    @property
    def is_full(self) -> bool:
        return self.in_flight >= self.capacity or self.circuit_open_s is not None


class RemoteTier:
    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        served_model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 2,
        capacity: int = 64,
        circuit_failures: int = 5,
        circuit_cooldown_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.served_model = served_model or name
        self.max_retries = max_retries
        self.capacity = capacity
        self.in_flight = 0
        self.circuit = CircuitBreaker(circuit_failures, circuit_cooldown_s)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        connect = min(10.0, timeout_s)
        self._client = httpx.AsyncClient(
            # pool: waiting for a free connection counts as connecting (the pool is as large as
            # what the tier admits, so a wait means the upstream holds every connection).
            timeout=httpx.Timeout(timeout_s, connect=connect, pool=connect),
            # One connection per request the tier admits: the pool never becomes the queue.
            limits=httpx.Limits(max_connections=capacity, max_keepalive_connections=capacity),
            headers=headers,
            transport=transport,
        )

    def load(self) -> RemoteLoad:
        return RemoteLoad(self.in_flight, self.capacity, self.circuit.open_for())

    async def aclose(self) -> None:
        await self._client.aclose()

    def generate(self, kind: str, body: dict[str, Any]) -> AsyncIterator[StepOutput]:
        """``kind``: ``chat`` or ``completion``; ``body``: the client's request with ``model`` rewritten.

        Admission happens here, at the call, not at the first read: the circuit's verdict
        (``RemoteError`` 503 when open) and a slot in ``in_flight``, so a burst is counted as it
        is admitted. The returned stream gives both back however it ends (exhausted, closed,
        cancelled, or dropped unread)."""
        path = "/chat/completions" if kind == "chat" else "/completions"
        payload = dict(body, model=self.served_model, stream=True, stream_options={"include_usage": True})
        if not self.circuit.allow():
            left = self.circuit.open_for() or self.circuit.cooldown_s
            raise RemoteError(f"tier '{self.name}' is unavailable (circuit open)", 503, retry_after=left)
        self.in_flight += 1
        return _Reserved(self, self._stream(path, payload, kind), self.circuit.held_trial)

    async def _stream(self, path: str, payload: dict[str, Any], kind: str) -> AsyncIterator[StepOutput]:
        attempt = 0
        yielded = False
        while True:
            try:
                async with self._client.stream("POST", self.base_url + path, json=payload) as resp:
                    if resp.status_code in _RETRY_STATUS and attempt < self.max_retries:
                        await resp.aread()
                        raise _Retry(f"upstream answered {resp.status_code}")
                    if resp.status_code >= 400:
                        raise await self._status_error(resp)
                    async for out in self._parse(resp, kind):
                        if out.finish_reason is not None:
                            # Before the yield: the consumer may close us at the final output.
                            self.circuit.success()
                        yielded = True
                        yield out
                    return
            except RemoteError as exc:
                if exc.status_code >= 500 or exc.started:
                    self.circuit.failure()
                else:
                    self.circuit.success()  # a 4xx: the upstream is alive and answering
                raise
            except (_Retry, *_CONNECT_ERRORS, *_TRANSPORT_ERRORS) as exc:
                if yielded:  # part of the answer is out: never replay it
                    self.circuit.failure()
                    raise RemoteError(
                        f"tier '{self.name}': the upstream connection broke mid-answer", 502, started=True
                    ) from exc
                if attempt >= self.max_retries:
                    self.circuit.failure()
                    if isinstance(exc, _TRANSPORT_ERRORS):
                        raise RemoteError(f"tier '{self.name}': upstream connection failed", 502) from exc
                    raise RemoteError(
                        f"tier '{self.name}': upstream unreachable", 503, retry_after=self.circuit.cooldown_s
                    ) from exc
                attempt += 1
                await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
            except httpx.PoolTimeout as exc:
                # Every connection is busy: this side is full, the upstream may be perfectly
                # healthy. Not a circuit failure (that would open it on load), a 503 to retry.
                raise RemoteError(
                    f"tier '{self.name}': at capacity (connection pool)", 503, retry_after=1.0
                ) from exc
            except httpx.TimeoutException as exc:  # read/write timeout: retrying would double the wait
                self.circuit.failure()
                raise RemoteError(
                    f"tier '{self.name}': upstream timed out", 503, retry_after=1.0, started=yielded
                ) from exc

    async def _status_error(self, resp: httpx.Response) -> RemoteError:
        """The error for an upstream status >= 400: 4xx keep status, body and Retry-After; 5xx
        become 502 (503 for 503/504) without the upstream's text (it may hold internals)."""
        status = resp.status_code
        retry_after = _retry_after(resp.headers.get("retry-after"))
        if status in (401, 403):
            # The router's own credentials were refused: a server-side fault, never the client's.
            # Neither the upstream's message nor its headers (``www-authenticate``) go out.
            await resp.aread()
            return RemoteError(
                f"tier '{self.name}': the upstream refused the router's credentials ({status})", 502
            )
        if status >= 500:
            await resp.aread()
            if status in (503, 504):
                return RemoteError(
                    f"tier '{self.name}': upstream unavailable", 503, retry_after=retry_after or 1.0
                )
            return RemoteError(f"tier '{self.name}': upstream error {status}", 502)
        raw = b""
        async for part in resp.aiter_bytes():
            raw += part
            if len(raw) > _MAX_ERROR_BODY:
                break
        body = _error_object(raw[:_MAX_ERROR_BODY])
        message = str(body.get("message") or f"upstream answered {status}")
        return RemoteError(message, status, body=body, retry_after=retry_after)

    async def _parse(self, resp: httpx.Response, kind: str) -> AsyncIterator[StepOutput]:
        """Upstream chunks as ``StepOutput``s: text, plus tool-call deltas and logprobs passed
        through as sent, each tagged with its choice ``index``; then one final output per choice
        (the first carries the usage of the whole answer)."""
        finish: dict[int, str] = {}
        usage: dict[str, Any] | None = None
        completion = 0
        done = saw_finish = False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                continue
            if "error" in chunk:
                raise RemoteError(
                    f"tier '{self.name}': the upstream failed mid-answer", 502, started=completion > 0
                )
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                index = int(choice.get("index") or 0)
                delta = choice.get("delta") or {}
                text = delta.get("content") if kind == "chat" else choice.get("text")
                tool_calls = delta.get("tool_calls") if kind == "chat" else None
                logprobs = choice.get("logprobs")
                finish.setdefault(index, "")
                if choice.get("finish_reason"):
                    saw_finish = True
                    finish[index] = choice["finish_reason"]
                if text or tool_calls or logprobs:
                    completion += 1
                    yield StepOutput(
                        text=text or "",
                        token_ids=[],
                        index=index,
                        tool_calls=tool_calls or None,
                        wire_logprobs=logprobs,
                    )
        if not done and not saw_finish:
            # The body ended (the upstream closed it cleanly) before the answer did.
            raise RemoteError(
                f"tier '{self.name}': the upstream stream ended early", 502, started=completion > 0
            )
        prompt_tokens = int((usage or {}).get("prompt_tokens", 0))
        completion_tokens = int((usage or {}).get("completion_tokens", completion))
        cached = int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0)
        for i, index in enumerate(sorted(finish) or [0]):
            yield StepOutput(
                text="",
                token_ids=[],
                finish_reason=finish.get(index) or "stop",
                num_prompt_tokens=prompt_tokens if i == 0 else 0,
                num_output_tokens=completion_tokens if i == 0 else 0,
                num_cached_tokens=cached if i == 0 else 0,
                index=index,
            )


class _Reserved:
    """An admitted answer's stream: on its end, however it comes, the tier's ``in_flight`` slot
    and (in half-open) the circuit's trial are given back, once."""

    def __init__(self, tier: RemoteTier, stream: AsyncIterator[StepOutput], trial: int) -> None:
        self._tier = tier
        self._stream = stream
        self._trial = trial
        self._held = True

    def __aiter__(self) -> _Reserved:
        return self

    async def __anext__(self) -> StepOutput:
        try:
            return await anext(self._stream)
        except BaseException:  # the end, an error, a cancellation (a client deadline)
            self._release()
            raise

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()  # type: ignore[attr-defined]
        finally:
            self._release()

    def _release(self) -> None:
        if self._held:
            self._held = False
            self._tier.in_flight -= 1
            self._tier.circuit.release(self._trial)

    def __del__(self) -> None:  # admitted, then dropped unread (an error before the first read)
        self._release()


class _Retry(Exception):
    pass


MAX_RETRY_AFTER_S = 3600.0
"""An upstream's ``Retry-After`` is capped here (``inf`` or a year would pass through otherwise)."""


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` value; None for a date, garbage, NaN or a negative."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None  # an HTTP date: rare from inference servers; the client's default applies
    if math.isnan(seconds) or seconds < 0:
        return None
    return min(seconds, MAX_RETRY_AFTER_S)


def _error_object(raw: bytes) -> dict[str, Any]:
    """The upstream's OpenAI-shaped ``error`` object, reduced to its four public fields."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        data = None
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, str):
        err = {"message": err}
    if not isinstance(err, dict):
        detail = data.get("detail") or data.get("message") if isinstance(data, dict) else None
        err = {"message": str(detail)[:1000] if detail else None}
    out: dict[str, Any] = {}
    for k in ("message", "type", "param", "code"):
        v = err.get(k)
        if v is not None and not isinstance(v, str | int):
            v = str(v)
        out[k] = v[:1000] if isinstance(v, str) else v
    return out
