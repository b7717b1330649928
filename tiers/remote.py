"""A tier served by an OpenAI-compatible server elsewhere (vLLM, TGI, another tiered-router).

This is how a tier outgrows one machine: the router keeps classification, policy, caching and
telemetry, and streams the upstream's tokens through. Requests are always sent with
``stream: true`` (and usage requested) so time-to-first-token is the upstream's, whatever the
client asked for. Connect errors and 502/503/504 are retried with backoff, but only before the
first byte of an answer arrived - a partially streamed answer is never replayed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from tiers.output import StepOutput

__all__ = ["RemoteError", "RemoteTier"]

log = logging.getLogger(__name__)

_RETRY_STATUS = {502, 503, 504}


class RemoteError(RuntimeError):
    def __init__(self, message: str, status_code: int = 502) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass(slots=True)
class RemoteLoad:
    in_flight: int
    capacity: int

    @property
    def is_full(self) -> bool:
        return self.in_flight >= self.capacity


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
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.served_model = served_model or name
        self.max_retries = max_retries
        self.capacity = capacity
        self.in_flight = 0
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            headers=headers,
            transport=transport,
        )

    def load(self) -> RemoteLoad:
        return RemoteLoad(self.in_flight, self.capacity)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def generate(self, kind: str, body: dict[str, Any]) -> AsyncIterator[StepOutput]:
        """``kind``: ``chat`` or ``completion``; ``body``: the client's request with ``model`` rewritten."""
        path = "/chat/completions" if kind == "chat" else "/completions"
        payload = dict(body, model=self.served_model, stream=True, stream_options={"include_usage": True})
        self.in_flight += 1
        try:
            async for out in self._stream(path, payload, kind):
                yield out
        finally:
            self.in_flight -= 1

    async def _stream(self, path: str, payload: dict[str, Any], kind: str) -> AsyncIterator[StepOutput]:
        attempt = 0
        while True:
            try:
                async with self._client.stream("POST", self.base_url + path, json=payload) as resp:
                    if resp.status_code in _RETRY_STATUS and attempt < self.max_retries:
                        await resp.aread()
                        raise _Retry(f"upstream answered {resp.status_code}")
                    if resp.status_code >= 400:
                        text = (await resp.aread()).decode(errors="replace")[:500]
                        raise RemoteError(
                            f"tier '{self.name}' upstream error {resp.status_code}: {text}", resp.status_code
                        )
                    async for out in self._parse(resp, kind):
                        yield out
                    return
            except (_Retry, httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if attempt >= self.max_retries:
                    raise RemoteError(f"tier '{self.name}' upstream unreachable: {exc}", 503) from exc
                attempt += 1
                await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
            except httpx.TimeoutException as exc:
                raise RemoteError(f"tier '{self.name}' upstream timed out", 504) from exc

    async def _parse(self, resp: httpx.Response, kind: str) -> AsyncIterator[StepOutput]:
        """Upstream chunks as ``StepOutput``s: text, plus tool-call deltas and logprobs passed
        through as sent, each tagged with its choice ``index``; then one final output per choice
        (the first carries the usage of the whole answer)."""
        finish: dict[int, str] = {}
        usage: dict[str, Any] | None = None
        completion = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                continue
            if "error" in chunk:
                raise RemoteError(f"tier '{self.name}' upstream error: {chunk['error']}")
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


class _Retry(Exception):
    pass
