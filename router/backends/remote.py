"""A tier served by an OpenAI-compatible URL (``router.backends.remote_client.RemoteTier``), as a ``Backend``:
the request is forwarded with the fields the client sent, the answer streams back as the engine's
``StepOutput`` so the same writer shapes it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from router.backends.base import Backend, Prepared, engine_key
from router.backends.local import system_fingerprint
from router.backends.remote_client import RemoteLoad, RemoteTier
from router.errors import RemoteError
from router.openai.writer import Served, first_within, remote_error
from tiers.core.output import StepOutput

if TYPE_CHECKING:
    from router.openai.request import Generation
    from router.policy.decide import Decision
    from router.policy.schema import TierConfig

log = logging.getLogger(__name__)

__all__ = ["RemoteBackend", "first_or_fallback", "upstream_body"]


class RemoteBackend:
    """A tier served by an OpenAI-compatible URL."""

    is_remote = True

    def __init__(self, name: str, cfg: TierConfig, client: RemoteTier) -> None:
        self.name = name
        self.cfg = cfg
        self.client = client
        self.key = engine_key(cfg)
        self.draft_tier: str | None = None
        self.retired = False
        """Set by a reload that replaced this tier: nothing new may be sent through it."""

    def is_full(self) -> bool:
        return self.client.load().is_full

    # -- the Backend protocol --------------------------------------------------------------
    def load(self) -> RemoteLoad:
        return self.client.load()

    def shadow_load(self) -> None:
        return None  # the upstream queues on its own device

    async def prepare(self, gen: Generation, prompt_tokens: int, *, grammar_timeout_s: float) -> Prepared:
        # The upstream honours best_of itself and returns the n winners: nothing to rank here
        # (and the ranking would need token logprobs it does not send).
        served = (
            Served(system_fingerprint(self.name, self.key), choices=gen.output.n)
            if gen.output is not None
            else Served()
        )
        return Prepared(self._forwarded(gen), prompt_tokens, served)

    def submit(self, gen: Generation, prepared: Prepared) -> list[AsyncIterator[StepOutput]]:
        try:  # admission: the circuit's verdict and an in-flight slot, taken now (not at first read)
            return [self.client.generate(gen.kind, prepared.payload)]
        except RemoteError as exc:
            raise remote_error(exc) from exc

    def stream(self, gen: Generation) -> AsyncIterator[StepOutput]:
        return self.submit(gen, Prepared(self._forwarded(gen), 0))[0]

    async def aclose(self) -> None:
        await self.client.aclose()

    def _forwarded(self, gen: Generation) -> Any:
        """The upstream's request body."""
        # Every field is forwarded as the client sent it (tools, response_format, logprobs, n...):
        # the upstream honours them, and its tool-call deltas and logprobs come back unchanged.
        return upstream_body(gen.request)


def upstream_body(obj: Any) -> Any:
    """A parsed request as JSON builtins for an upstream, with the fields the client left out
    left out: a struct field that is None was absent or null in the request, and strict servers
    (llama.cpp's) refuse ``"name": null`` in a message. Values that are raw JSON (a schema's
    ``"default": null``, tool parameters) pass through untouched."""
    import msgspec

    if isinstance(obj, msgspec.Struct):
        out = {}
        for f in msgspec.structs.fields(obj):
            value = getattr(obj, f.name)
            if value is not None:
                out[f.encode_name] = upstream_body(value)
        return out
    if isinstance(obj, list) and any(isinstance(v, msgspec.Struct) for v in obj):
        return [upstream_body(v) for v in obj]
    return msgspec.to_builtins(obj)


Streams = list[AsyncIterator[StepOutput]]


async def first_or_fallback(
    backends: Mapping[str, Backend],
    d: Decision,
    source: Streams,
    submitted: tuple[int, Served],
    timeout_s: float,
    fallback: Callable[[Decision, str], Decision | None],
    resubmit: Callable[[str], Awaitable[tuple[Streams, int, Served]]],
) -> tuple[Streams, Decision, int, Served]:
    """A remote tier's first output read before anything is written: a connect error or a 5xx
    before the first byte retries along ``routing.fallback`` (``fallback``: the policy's next
    tier, as an open circuit falls back at the decision; ``resubmit``: the request sent there),
    each tier once; past the first byte, or on a 4xx, the error is the answer. Returns the
    streams to answer from (the first output put back) and the decision that serves them.
    ``backends``: the tier set's, by name."""
    hint, served = submitted
    while True:
        stream = source[0]
        try:
            first = await first_within(stream, timeout_s)
        except StopAsyncIteration:
            return source, d, hint, served
        except RemoteError as exc:
            nxt = fallback(d, str(exc)) if exc.status_code >= 500 and not exc.started else None
            if nxt is None:
                raise remote_error(exc) from exc
            log.warning(
                "tier %s failed before its first byte (%s): falling back to %s", d.tier, exc, nxt.tier
            )
            d = nxt
            source, hint, served = await resubmit(d.tier)
            if not backends[d.tier].is_remote:
                return source, d, hint, served
            continue
        return [_prepended(first, stream)], d, hint, served


async def _prepended(first: StepOutput, rest: AsyncIterator[StepOutput]) -> AsyncIterator[StepOutput]:
    """``first`` then the rest of ``rest`` (closed with this stream)."""
    try:
        yield first
        async for out in rest:
            yield out
    finally:
        close = getattr(rest, "aclose", None)
        if close is not None:
            await close()
