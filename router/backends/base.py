"""What the pipeline asks of a tier, wherever it runs: one ``Backend`` protocol.

A request goes to a backend in two steps - ``prepare`` (may await: tokenization and grammar
compilation off the event loop for an in-process tier) and ``submit`` (on the loop, no await) -
so that a reload that retires the backend in between is noticed before anything is submitted.
``stream`` is both steps inline, for answers already bounded (shadow answers). The local engine
tier (``router.backends.local``) and the remote OpenAI-compatible tier (``router.backends.remote``)
implement it; the pipeline never asks which one it holds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from router.openai.writer import NOTHING_SERVED, Served

if TYPE_CHECKING:
    from router.openai.request import Generation
    from router.policy.schema import TierConfig
    from tiers.core.output import StepOutput

__all__ = ["Backend", "Prepared", "engine_key", "model_key"]


@dataclass(slots=True)
class Prepared:
    """A request made ready for one backend; only that backend reads ``payload``."""

    payload: Any
    num_prompt_tokens: int
    """The prompt's length in tokens: counted by a local tier, estimated for a remote one."""
    served: Served = NOTHING_SERVED


class Backend(Protocol):
    name: str
    cfg: TierConfig
    key: tuple[Any, ...]
    """``engine_key(cfg)``: what a reload compares to reuse the backend."""
    draft_tier: str | None
    retired: bool
    """Set by a reload that replaced this backend: nothing new may be submitted to it."""
    is_remote: bool

    def is_full(self) -> bool: ...

    def load(self) -> Any:
        """The backend's current load (``EngineLoad`` or ``RemoteLoad``)."""
        ...

    def shadow_load(self) -> Any:
        """The load shadow admission judges (the shared device's), or None when the tier runs
        elsewhere and its queue is not this service's to judge."""
        ...

    async def prepare(self, gen: Generation, prompt_tokens: int, *, grammar_timeout_s: float) -> Prepared: ...

    def submit(self, gen: Generation, prepared: Prepared) -> list[AsyncIterator[StepOutput]]:
        """One output stream per choice."""
        ...

    def stream(self, gen: Generation) -> AsyncIterator[StepOutput]:
        """The first choice's stream, prepared and submitted inline."""
        ...

    async def aclose(self) -> None: ...


def engine_key(cfg: TierConfig) -> tuple[Any, ...]:
    """Everything that needs a new engine when it changes (routing-only edits reuse the engine):
    the loaded model's key, then the engine's own settings. Every tier field but ``defaults`` and
    ``max_queue_wait_s`` (read off the tier's config at each request) is one of them."""
    return (
        *model_key(cfg),
        cfg.max_num_seqs,
        cfg.max_queue,
        cfg.max_model_len,
        cfg.max_num_batched_tokens,
        cfg.max_decode_slowdown,
        cfg.draft,
        cfg.speculative_tokens,
        cfg.kv_cache_memory,
        cfg.kv_cache_tokens,
        cfg.block_size,
        cfg.prefix_caching,
        cfg.batch_invariant,
        cfg.cuda_graphs,
        cfg.served_model_name,
        cfg.api_key_env,
        cfg.timeout_s,
        cfg.max_retries,
        cfg.circuit_failures,
        cfg.circuit_cooldown_s,
    )


def model_key(cfg: TierConfig) -> tuple[Any, ...]:
    """What makes a loaded model: tiers with the same key share one."""
    return (
        cfg.model,
        cfg.dtype,
        cfg.quantization,
        cfg.quant_group_size,
        cfg.quantize_head,
        cfg.head_int8_tokens,
        cfg.activation_quantization,
        cfg.device,
        cfg.batch_invariant,
    )
