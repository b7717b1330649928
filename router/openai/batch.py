"""A completions request with a list of prompts (OpenAI's and vLLM's batch form) answered as one.

Each prompt is its own request through the pipeline - scored and routed on its own text, admitted,
cached and answered on its own - and this module merges the answers into the one body or SSE
stream the client asked for: prompt ``i``'s choice ``j`` is choice ``i * n + j`` (OpenAI's order),
usage is summed over the prompts, and the routing headers list each prompt's value in prompt
order (one value when they agree). A prompt that fails fails the whole answer: before the first
byte as its own error, mid-stream as an error event then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

from router.openai.request import completion_id
from router.openai.writer import DONE, ERROR_PREFIX, now, sse_event

__all__ = ["merge_bodies", "merge_headers", "merge_streams", "sum_usage"]

# Headers that are one value per answer, not per prompt.
_SHARED = ("content-type",)


def sum_usage(usages: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """Field-by-field sum of usage objects (nested details included); None when there is none."""
    present = [u for u in usages if u]
    if not present:
        return None
    out: dict[str, Any] = {}
    for usage in present:
        for key, value in usage.items():
            if isinstance(value, Mapping):
                out[key] = sum_usage([out.get(key), value])
            elif isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
            elif key not in out:
                out[key] = value
    return out


def merge_headers(headers: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """Each header once: its value when every prompt's answer agrees, else the values in prompt
    order, comma-separated (HTTP's list form); a header some answers lack is left out."""
    out: dict[str, str] = {}
    for name in headers[0]:
        values = [h.get(name) for h in headers]
        if any(v is None for v in values):
            continue
        if name in _SHARED or len(set(values)) == 1:
            out[name] = str(values[0])
        else:
            out[name] = ", ".join(str(v) for v in values)
    return out


def _model(models: Sequence[str], alias: str) -> str:
    """The tier that answered every prompt, or the model the client asked for when tiers differ."""
    return models[0] if len(set(models)) == 1 else alias


def merge_bodies(bodies: Sequence[dict[str, Any]], alias: str) -> dict[str, Any]:
    """One ``text_completion`` body from one body per prompt, in prompt order."""
    first = bodies[0]
    choices: list[dict[str, Any]] = []
    for body in bodies:
        for choice in body["choices"]:
            choices.append({**choice, "index": len(choices)})
    out = {
        **first,
        "id": completion_id("cmpl"),
        "created": min(int(b["created"]) for b in bodies),
        "model": _model([b["model"] for b in bodies], alias),
        "choices": choices,
        "usage": sum_usage([b.get("usage") for b in bodies]),
    }
    fingerprints = {b.get("system_fingerprint") for b in bodies}
    if len(fingerprints) != 1:
        out.pop("system_fingerprint", None)
    return out


async def merge_streams(
    streams: Sequence[AsyncIterator[bytes]], n: int, models: Sequence[str], alias: str, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    """One SSE stream from one stream per prompt (``n`` choices each), events passed on as they
    come: chunks re-indexed and given one id and model, each stream's usage chunk held back and
    summed into one at the end, one ``[DONE]``. Closing it closes every source (aborting their
    engine requests)."""
    cid, created, model = completion_id("cmpl"), now(), _model(models, alias)
    queue: asyncio.Queue[tuple[int, bytes | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[bytes]) -> None:
        try:
            async for event in stream:
                await queue.put((index, event))
            await queue.put((index, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # told to the client as this prompt's failure
            await queue.put((index, exc))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    usage: dict[int, dict[str, Any]] = {}
    fingerprints: set[str] = set()
    open_streams = len(streams)
    try:
        while open_streams:
            index, item = await queue.get()
            if item == DONE:
                continue  # the pump's None follows it: one count per stream
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if item.startswith(ERROR_PREFIX):
                yield item
                yield DONE
                return
            event = json.loads(item[len(b"data: ") :])
            if event.get("system_fingerprint"):
                fingerprints.add(event["system_fingerprint"])
            if event.get("usage"):
                usage[index] = event["usage"]
                if not event.get("choices"):
                    continue  # the prompt's final usage chunk: summed at the end
                event["usage"] = sum_usage(list(usage.values()))  # continuous usage: all prompts so far
            for choice in event.get("choices", []):
                choice["index"] = index * n + choice.get("index", 0)
            event["id"], event["created"], event["model"] = cid, created, model
            yield sse_event(event)
        if include_usage:
            total = sum_usage([usage[i] for i in sorted(usage)])
            envelope = {"id": cid, "object": "text_completion", "created": created, "model": model}
            if len(fingerprints) == 1:  # as a single answer's usage chunk carries its tier's
                envelope["system_fingerprint"] = fingerprints.pop()
            yield sse_event({**envelope, "choices": [], "usage": total})
        yield DONE
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for stream in streams:
            close = getattr(stream, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
