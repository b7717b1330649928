"""The routing policy's typed schema. Each field's docstring is its documentation (README mirrors it).

The ``service:`` section's types live in ``service_schema`` (importable from here too). These
are plain dataclasses built by ``loader.load_policy`` from YAML, which reports every
unknown key, wrong type and cross-field error with its field path and line number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from router.policy.service_schema import (
    AuthConfig,
    CacheConfig,
    ClassifierConfig,
    FeedbackConfig,
    LimitsConfig,
    SemanticCacheConfig,
    ServiceConfig,
    TelemetryConfig,
    state_file,
)

__all__ = [
    "AuthConfig",
    "CacheConfig",
    "ClassifierConfig",
    "Condition",
    "EscalationConfig",
    "FeedbackConfig",
    "GenerationDefaults",
    "LimitsConfig",
    "LoadAwareConfig",
    "Policy",
    "Routing",
    "Rule",
    "SemanticCacheConfig",
    "ServiceConfig",
    "SessionConfig",
    "ShadowConfig",
    "TelemetryConfig",
    "TenantConfig",
    "TierConfig",
    "state_file",
]

SUPPORTED_VERSIONS = (1,)


@dataclass(slots=True)
class GenerationDefaults:
    max_tokens: int = 256
    """Used when a request sets neither ``max_tokens`` nor ``max_completion_tokens``."""
    temperature: float = 1.0
    """Used when a request omits ``temperature`` (OpenAI's default is 1)."""
    top_p: float = 1.0


NGRAM = "ngram"
"""``draft: ngram``: draft by n-gram lookup (``tiers.spec_decode.ngram.NgramProposer``), not a tier."""


@dataclass(slots=True)
class TierConfig:
    model: str
    """``embedded:smollm2-135m-instruct``, a local HF directory, a ``.gguf`` file, a hub id, or an
    ``http(s)://`` URL of an OpenAI-compatible server (a remote tier, e.g. vLLM or TGI)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """``auto``: bf16 on GPUs; on CPUs fp32, or bf16 activations for quantized weights."""
    quantization: Literal["none", "int8", "int4"] = "none"
    """Weight-only quantization applied at load."""
    quant_group_size: int = 32
    """int4: input channels sharing one scale/zero (32, 64 or 128); larger is cheaper and coarser."""
    quantize_head: bool = False
    """int4: quantize the output head to int4 too (default int8: it decides every token)."""
    head_int8_tokens: int = 0
    """int4 with ``quantize_head``: the vocabulary's first N rows of the head stay int8 (a BPE
    vocabulary's low ids are its frequent tokens), the rest int4; a multiple of 64. The default
    medium tier keeps 16,384: the int8 head's greedy agreement at two thirds of its bytes
    (``tiers.layers.quantization.mixed_head.MixedHead``)."""
    activation_quantization: Literal["none", "int8"] = "none"
    """int4: ``int8`` quantizes each row's activations to int8 per weight group at run time (W4A8,
    llama.cpp's Q8 activations) and runs integer dot products: ~2.5x faster int4 projections on
    the CPU, with W4A8 numbers rather than the bf16 ones; an int8 head (``quantize_head: false``)
    then takes int8 activations too (W8A8, ``tiers.layers.quantization.int8.Int8WeightOnlyLinear``).
    ``none``: bf16
    activations."""
    device: str = "auto"
    """``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:1``..."""
    max_num_seqs: int = 16
    """Sequences decoded together (bounds the batch; memory is bounded by the KV budget)."""
    max_queue: int = 64
    """Requests allowed to wait for a slot; beyond it the fallback applies, else 429."""
    max_model_len: int = 2048
    """Context length (prompt + output tokens) per sequence."""
    max_num_batched_tokens: int = 512
    """Prefill chunk budget per step: long prompts are split so decodes keep flowing."""
    max_decode_slowdown: float | None = None
    """Decode first: while sequences decode on the device (any tier), the prompt chunks fed beside
    them keep a step within this multiple of a step of the decodes alone (the chunk size follows
    the tier's measured step costs: ``tiers.core.sched.pacing.prefill_cap``). Must be > 1. null
    (the default): a prompt chunk may take half the step's token budget - measured on the default
    policy at 1 req/s (``benchmarks/decode_first``), 2.5 cut a running stream's p99 gap between
    chunks 0.83x but cost new prompts 1.7x their TTFT."""
    draft: str | None = None
    """Tier whose model drafts speculative tokens for this one (usually the tier below); ``ngram``
    drafts by n-gram lookup in the sequence's own prompt and output (no model, no KV); null = off."""
    speculative_tokens: int = 4
    """Most tokens drafted per step; the engine picks 0..this each step by measured cost."""
    kv_cache_memory: str | None = None
    """KV budget of this tier's block pool: a size (``512MiB``, ``2GiB``) or a fraction of the
    device's memory (``0.25``). Unset: ``kv_cache_tokens``. The pool holds this tier's sequences,
    its prefix cache (free blocks that keep their KV) and the drafts of the tier above, which
    drafts with this tier's model."""
    kv_cache_tokens: int = 16384
    """KV budget in tokens, used when ``kv_cache_memory`` is not set."""
    block_size: int = 16
    """Tokens per KV block (the unit of allocation and of prefix sharing)."""
    prefix_caching: bool = True
    """Keep full blocks findable by their prefix after their sequence ends (cross-request reuse)."""
    batch_invariant: bool = True
    """A temperature-0 answer that does not depend on other traffic: on the CPU fast path one
    attention kernel (the paged one) serves every query length, so a prompt computed whole, in
    chunks, or from the prefix cache gives the same logits (measured cost on a 512-token prefill:
    within 3%, noise), and fp32 linears take one packed GEMM at every row count, from the library
    (MKL or oneDNN) checked batch-invariant on this CPU at load (``tiers.layers.fp32_packed``). The
    quantized GEMM paths are row-independent already. false: prompt chunks over 64 tokens take
    gather + SDPA, and fp32 switches kernels by row count where that measured faster (MKL's
    packed GEMM at 4-16 rows on Intel, the one/two-row GEMV on AVX512 AMD)."""
    cuda_graphs: bool = False
    """On a CUDA device, decode steps of the fast path replay CUDA graphs captured at warm-up for
    batch sizes 1, 2, 4 ... 64 (a step padded up to its bucket; larger batches run eagerly): the
    host launches one graph instead of ~25 kernels a layer. Ignored on the CPU."""
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    served_model_name: str | None = None
    """Remote tiers: the ``model`` value sent upstream (default: the tier name)."""
    api_key_env: str | None = None
    """Remote tiers: environment variable holding the upstream API key."""
    timeout_s: float = 120.0
    """Remote tiers: per-request timeout."""
    max_retries: int = 2
    """Remote tiers: retries on connect errors and 502/503/504 before any byte is streamed."""
    max_queue_wait_s: float = 5.0
    """Admission: a request whose predicted wait for its first token on this tier exceeds this
    (or the client's deadline) is sent to the fallback tier, else answered 429 at once."""
    circuit_failures: int = 5
    """Remote tiers: consecutive failures that open the circuit (requests skip the tier)."""
    circuit_cooldown_s: float = 10.0
    """Remote tiers: how long an open circuit stays open before one trial request is let through."""

    @property
    def is_remote(self) -> bool:
        return self.model.startswith(("http://", "https://"))


@dataclass(slots=True)
class Condition:
    """Every field that is set must hold (AND). Leave ``when`` out for an always-matching rule."""

    score_below: float | None = None
    """Complexity score (0..1) strictly below this."""
    score_at_least: float | None = None
    """Complexity score at least this."""
    predicted: list[str] | None = None
    """The classifier's most likely class is one of these (small/medium/large)."""
    confidence_below: float | None = None
    """The classifier's top probability is below this."""
    prompt_tokens_above: int | None = None
    prompt_tokens_at_most: int | None = None
    headers: dict[str, str | list[str]] | None = None
    """Request header equals the value (or one of the values); names are case-insensitive."""
    model: list[str] | None = None
    """The request's ``model`` field is one of these."""
    tenant: list[str] | None = None
    """The caller's tenant (from its API key, else the ``x-tenant`` header)."""
    has_tools: bool | None = None
    """The request offers tools (``tools`` non-empty) - or, with false, offers none."""
    response_format: list[Literal["text", "json_object", "json_schema"]] | None = None
    """The request's ``response_format.type`` is one of these (absent counts as ``text``)."""
    logprobs: bool | None = None
    """The request asks for log probabilities (``logprobs: true``) - or, with false, does not."""
    turns_at_least: int | None = None
    """At least this many user turns in the conversation (a completion counts as 1)."""
    turns_at_most: int | None = None
    """At most this many user turns."""
    keywords: list[str] | None = None
    """The last user turn contains one of these words or phrases (case-insensitive, whole words)."""
    language: list[str] | None = None
    """The last user turn's language is one of these ISO 639-1 codes (``en``, ``de``, ``zh``...; a
    script and stop-word heuristic, ``und`` when unsure - see router/policy/signals.py)."""
    any_of: list[Condition] | None = None
    """At least one of these conditions holds."""
    all_of: list[Condition] | None = None
    """Every one of these conditions holds."""
    not_: Condition | None = field(default=None, metadata={"key": "not"})
    """YAML key ``not``: this condition does not hold."""

    @property
    def uses_score(self) -> bool:
        direct = any(
            v is not None
            for v in (self.score_below, self.score_at_least, self.predicted, self.confidence_below)
        )
        nested = [*(self.any_of or []), *(self.all_of or []), *([self.not_] if self.not_ is not None else [])]
        return direct or any(c.uses_score for c in nested)

    @property
    def is_score_only(self) -> bool:
        """Only ``score_below`` / ``score_at_least`` are set (the rules calibrate writes)."""
        return (self.score_below is not None or self.score_at_least is not None) and all(
            getattr(self, f) is None for f in self.__slots__ if f not in ("score_below", "score_at_least")
        )


@dataclass(slots=True)
class Rule:
    name: str
    """Shown in ``x-router-rule``, ``/v1/route``, spans and metrics."""
    tier: str
    when: Condition | None = None
    priority: int = 0
    """Rules are evaluated by descending priority; equal priorities keep their order in the file."""


@dataclass(slots=True)
class SessionConfig:
    """Session-aware routing (router/pipeline/session.py): follow-ups of a conversation keep its tier."""

    enabled: bool = True
    mode: Literal["floor", "pin"] = "floor"
    """``floor``: a follow-up may go up but never below the tier the conversation had; ``pin``:
    it stays on that tier (whose prefix cache holds the context) either way."""
    max_entries: int = 100_000
    """Conversations remembered (least recently used are forgotten first); ~200 bytes each."""
    ttl_s: float = 3600.0
    """A conversation idle this long is forgotten."""


@dataclass(slots=True)
class EscalationConfig:
    confidence_below: float | None = None
    """When a score-based rule fired and the classifier's top probability is below this, route one
    tier up (the uncertain prompt gets the stronger model). null = off."""


@dataclass(slots=True)
class LoadAwareConfig:
    """``routing.mode: load_aware``: among the tiers a rule's answer allows, pick by the device's
    live load (``router/policy/decide.py``)."""

    rules: list[str] | None = None
    """Rules whose tier is a floor that load may raise; null = every rule whose condition uses the
    score (the quality rules: their tier is the cheapest the score allows, every tier above it
    is acceptable too). Tiers forced by name or alias never move."""
    up_tolerance: float = 0.05
    """A higher acceptable tier is preferred while its predicted cost is within this fraction of
    the cheapest: the same time buys the stronger model."""
    join_running: bool = True
    """Before pricing: the highest acceptable tier whose batch is running with a free slot takes
    the request. The tiers take turns on one device, so a row added to a running batch costs a
    sliver of a step, while every row kept on a lower tier keeps that tier's whole step in each
    turn; pricing alone, one request at a time, keeps a batch that already split alive."""
    min_device_rows: int = 4
    """Below this many sequences held on the device in all (every local tier's running, waiting
    and just-decided ones, now or as a recent peak that fades over ~20 s), the rule's tier
    stands: at light load each tier's small batch is cheap and drafts well (large at 1-4 rows:
    1.6x with medium's drafts), and moving requests up costs what the split saves. The recent
    peak keeps a closed loop's waves consolidated: each wave's first arrivals see a nearly empty
    device. 4 keeps 1-4 clients on the rules' split (``benchmarks/routing_gain.py``: at 16
    clients, 8 cost 0.82x always-large and 4 0.92x, without the peak). 0 applies load
    everywhere."""


@dataclass(slots=True)
class Routing:
    mode: Literal["static", "load_aware"] = "static"
    """``static``: the rule's tier. ``load_aware``: the rule's tier or any above it (within the
    tenant's tiers), whichever costs least on the shared device now - the request's own
    predicted completion time plus the delay it adds to the sequences already decoding
    (``tiers/core/sched/pacing.py``): cheap tiers at light load, the running batch of a busy tier instead
    of a fresh batch on an idle one under load. ``x-router-rule`` is ``load:<rule>`` when load
    raised the tier."""
    load_aware: LoadAwareConfig = field(default_factory=LoadAwareConfig)
    rules: list[Rule] = field(default_factory=list)
    """Evaluated in order; the first match wins. The last rule must have no ``when`` (the default)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """``model`` names that force a tier, e.g. ``fast: small``."""
    fallback: dict[str, str | None] = field(default_factory=dict)
    """When a tier's queue is full, try this tier instead; null (or absent) = reject with 429."""
    escalation: EscalationConfig = field(default_factory=EscalationConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)

    @property
    def ordered_rules(self) -> list[tuple[int, Rule]]:
        """``(index in the file, rule)`` in evaluation order: descending priority, then file order."""
        return sorted(enumerate(self.rules), key=lambda ir: -ir[1].priority)


@dataclass(slots=True)
class TenantConfig:
    allowed_tiers: list[str] | None = None
    """Tiers this tenant may use (default: all). A decision above them is capped to the highest allowed."""
    rate_limit_rpm: int | None = None
    """Requests per minute for this tenant (token bucket); null = unlimited."""
    rate_limit_tpm: int | None = None
    """Tokens per minute for this tenant: each generation costs its prompt tokens plus
    n x max_tokens, charged at admission (a request larger than the bucket passes only when the
    bucket is full, and leaves it in debt); null = unlimited."""
    priority: Literal["low", "normal", "high"] = "normal"
    """Admission under load: the wait a request may be predicted to have is half the tier's
    ``max_queue_wait_s`` for ``low`` (shed first), twice it for ``high``."""


@dataclass(slots=True)
class ShadowConfig:
    """Shadow mode (router/pipeline/shadow.py): also answer a sample of requests on another tier, off the
    critical path and only in idle capacity, and log both answers for judging."""

    enabled: bool = False
    sample: float = 0.0
    """Share of eligible requests shadowed, in [0, 1]."""
    tier: str | None = None
    """The shadow tier; null = the tier above the one that served the request."""
    rules: list[str] | None = None
    """Only requests decided by these rules (null = any rule)."""
    tenants: list[str] | None = None
    """Only these tenants' requests (null = any caller)."""
    max_concurrent: int = 2
    """Shadow generations running at once, service-wide; more are skipped, never queued."""
    max_busy_fraction: float = 0.5
    """Start one only while the target tier has nobody waiting and at most this share of its
    sequence slots busy."""
    max_tokens: int = 256
    """Output cap of a shadow answer."""
    preempt: bool = True
    """A real request arriving cancels the running shadow answers (counted as ``preempted``): on
    shared CPUs, free sequence slots are not free compute. Off where tiers have spare devices."""
    log_path: str = field(default_factory=lambda: state_file("shadow.jsonl"))
    """JSONL of shadow answers. Default: ``shadow.jsonl`` in the state directory (``state_file``);
    a relative path is relative to the working directory."""
    record_content: bool | None = None
    """Write prompts and answers; null = ``service.telemetry.record_content``."""


@dataclass(slots=True)
class Policy:
    tiers: dict[str, TierConfig]
    """Ordered from cheapest to strongest: escalation moves one step along this order."""
    routing: Routing
    version: int = 1
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    source: str = ""
    """Where it was loaded from (set by the loader, not a YAML key)."""
    digest: str = ""
    """sha256 of the file's bytes: the policy version in cache keys and logs (set by the loader)."""

    @property
    def tier_names(self) -> list[str]:
        return list(self.tiers)

    @property
    def rule_models(self) -> frozenset[str]:
        """Model names that rules match on (``when.model``): requests naming them are routed by rules."""
        return frozenset(m for r in self.routing.rules if r.when is not None for m in (r.when.model or []))

    @property
    def model_names(self) -> list[str]:
        """What ``/v1/models`` lists and requests may name."""
        names = ["auto", *self.tiers, *self.routing.aliases]
        return names + sorted(self.rule_models - set(names))

    def tier_above(self, tier: str) -> str | None:
        names = self.tier_names
        i = names.index(tier)
        return names[i + 1] if i + 1 < len(names) else None
