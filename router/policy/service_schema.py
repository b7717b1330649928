"""The policy's ``service:`` section, typed: authentication, the response cache, the classifier,
telemetry, feedback, per-request limits and the service's own timeouts. Each field's docstring is
its documentation (README mirrors it); ``router.policy.schema`` re-exports every name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = [
    "AuthConfig",
    "CacheConfig",
    "ClassifierConfig",
    "FeedbackConfig",
    "LimitsConfig",
    "SemanticCacheConfig",
    "ServiceConfig",
    "TelemetryConfig",
    "state_file",
]


@dataclass(slots=True)
class AuthConfig:
    mode: Literal["keys", "open"] = "keys"
    """``keys``: every API request needs a Bearer key, and ``serve`` refuses to start when no key
    loads. ``open``: no auth at all - for a loopback development server (``make run``)."""
    api_keys_env: str | None = None
    """Environment variable with ``key`` or ``key:tenant`` entries, comma-separated."""
    api_keys_file: str | None = None
    """File with one ``key`` or ``key:tenant`` per line (a mounted Kubernetes Secret); re-read on
    change, so rotation and revocation need no restart."""
    trust_tenant_header: bool = False
    """Take the tenant from ``x-tenant`` when the caller's key names none (or in ``open`` mode).
    Only behind a gateway that authenticates callers and sets the header itself."""
    rate_limit_rpm: int | None = None
    """Requests per minute for each caller (tenant, or key without a tenant) that has no
    ``tenants.<name>.rate_limit_rpm`` of its own; null = unlimited."""
    rate_limit_tpm: int | None = None
    """Tokens per minute (prompt + n x max_tokens) for each caller without a
    ``tenants.<name>.rate_limit_tpm`` of its own; null = unlimited."""


@dataclass(slots=True)
class SemanticCacheConfig:
    enabled: bool = False
    threshold: float = 0.92
    """Cosine similarity of the last user turn's embedding needed for a hit."""


@dataclass(slots=True)
class CacheConfig:
    enabled: bool = True
    ttl_s: float = 600.0
    max_entries: int = 10000
    backend: Literal["memory", "redis"] = "memory"
    redis_url_env: str = "REDIS_URL"
    """Environment variable with the Redis URL (backend: redis)."""
    redis_timeout_s: float = 0.25
    """Redis connect and socket timeout: past it a lookup is a miss and Redis is skipped briefly."""
    cache_sampled: bool = False
    """Also cache requests with temperature > 0 (off: only deterministic requests are cached)."""
    semantic: SemanticCacheConfig = field(default_factory=SemanticCacheConfig)


@dataclass(slots=True)
class ClassifierConfig:
    path: str | None = None
    """Directory with ``model.onnx`` + ``metadata.json``; null = the shipped artifact."""
    context_chars: int = 2000
    """Characters of earlier turns scored with the last user turn."""
    device: Literal["cpu", "auto", "cuda"] = "cpu"
    """onnxruntime provider: ``cpu`` (the graph scores in ~0.2 ms on one thread; on a GPU node the
    CUDA provider would open a second CUDA context and arena beside the tiers'), ``auto`` (CUDA
    where a GPU is visible) or ``cuda``."""


@dataclass(slots=True)
class TelemetryConfig:
    record_content: bool = False
    """Put prompts and outputs on spans. Off by default: traces often leave the trust boundary."""


def state_file(name: str) -> str:
    """``name`` in the service's state directory: ``$TIERED_ROUTER_STATE_DIR``, else
    ``$XDG_STATE_HOME/tiered-router``, else ``~/.local/state/tiered-router`` (XDG's place for logs
    a program keeps) - never the working directory, which a deployment may not be able to write
    and a development checkout should not collect logs in."""
    base = os.environ.get("TIERED_ROUTER_STATE_DIR")
    if not base:
        base = str(Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local/state") / "tiered-router")
    return str(Path(base) / name)


@dataclass(slots=True)
class FeedbackConfig:
    """``POST /v1/feedback`` (router/pipeline/shadow.py): scores for answers this service issued."""

    enabled: bool = True
    log_path: str = field(default_factory=lambda: state_file("feedback.jsonl"))
    """JSONL of outcome lines ``{"id", "prompt"?, "outcomes": {tier: score}}``; the prompt only
    with ``service.telemetry.record_content``. Default: ``feedback.jsonl`` in the state directory
    (``state_file``); a relative path is relative to the working directory."""
    max_ids: int = 100_000
    """Issued response ids remembered for feedback (least recent forgotten first)."""
    ttl_s: float = 86_400.0
    """Feedback on an answer older than this is refused (404)."""


@dataclass(slots=True)
class LimitsConfig:
    """What one request may ask of the service, checked as the body is parsed
    (router/openai/bounds.py); past a bound it is a 400 that names the limit. Each bounds work
    that grows with the request and that no client should be able to make everyone else wait for."""

    max_logit_bias: int = 300
    """Entries in ``logit_bias`` (OpenAI's own cap): each is applied to every row at every step."""
    max_tools: int = 128
    """Tools in one request (OpenAI's cap); each adds to the prompt and to the tool-call grammar."""
    max_schema_nodes: int = 2000
    """Objects, arrays and values in one JSON schema (``response_format`` or a tool's
    ``parameters``), counted together: the grammar compiled from it grows with it."""
    max_schema_depth: int = 24
    """Nesting depth of one JSON schema."""
    max_schema_properties: int = 300
    """Properties of one object in a schema: the grammar's parser row grows with the optional
    properties it may take next (llguidance's limit was passed at ~550 of them, a failed
    generation)."""
    max_schema_chars: int = 65_536
    """Characters of every key and string in one JSON schema together: a single huge ``pattern``
    or ``enum`` value is one node but a large grammar (compiled before the first token)."""
    max_request_tokens: int = 65_536
    """Output tokens one request may ask for, ``max(n, best_of) x max_tokens`` (each choice is a
    sequence in the batch: 16 choices of 4,096 tokens are 65,536 decode rows-steps)."""
    max_prompts: int = 32
    """Prompts in one completions request (a list of prompts): each is a request of its own to
    route, admit and answer, merged into one response."""
    grammar_timeout_s: float = 5.0
    """Wall-clock budget for compiling one schema's grammar (off the event loop); past it, 400."""


@dataclass(slots=True)
class ServiceConfig:
    max_body_bytes: int = 1_048_576
    """Request bodies above this get 413 before they are read in full."""
    queue_timeout_s: float = 30.0
    """A request waiting this long for its first token is answered 503."""
    max_request_timeout_s: float = 600.0
    """Largest deadline a client may ask for with ``x-request-timeout`` (seconds)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, in-flight work gets this long to finish before it is cancelled."""
    fair_slowdown: float | None = 1.25
    """Device time between callers (tenant, or key without one): while a caller holding fewer
    sequences than an equal split of the device's batch slots has work, callers holding more sit
    out the turns that would make the light caller's steps take more than this many times as long
    as without them (they still get that share of the device, in full batches). null: slots are
    shared, time is not (on a GPU extra rows cost little either way; on a CPU each costs compute)."""
    auth: AuthConfig = field(default_factory=AuthConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    classifier: ClassifierConfig = field(default_factory=ClassifierConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
