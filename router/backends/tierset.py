"""The policy's tiers as running backends: local engines (on the one device worker) or remote servers.

``build_tiers`` loads models, wires each tier's draft to the tier below's model object (shared,
not copied), warms every engine and returns a ``TierSet``. When a reloaded policy changes only
some tiers, the unchanged ones are reused as they are.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.backends.base import Backend, engine_key, model_key
from router.backends.local import LocalTier
from router.backends.remote import RemoteBackend
from router.backends.remote_client import RemoteTier
from router.errors import PolicyError, PolicyIssue
from router.policy.decide import TierBatch
from router.policy.schema import NGRAM
from tiers.core.sched.pacing import RoutingCost, routing_cost
from tiers.engine.llm_engine import Engine, EngineObserver

if TYPE_CHECKING:
    from router.policy.schema import Policy, TierConfig
    from tiers.models.loading import LoadedModel
    from tiers.worker.device import DeviceWorker

__all__ = ["TierSet", "build_tiers"]

log = logging.getLogger(__name__)

SHARE_EMA = 0.1
"""Weight of each routing decision in a tier's moving share of them (``TierSet.batches``)."""
DECIDED_TTL_S = 2.0
"""How long a load-aware decision counts toward its tier's batch before its request reaches the
engine: preparing a request (tokenization, cache lookup, grammar) takes milliseconds to a second."""
LOAD_MEMORY_S = 20.0
"""Time constant over which the device's recent peak of held sequences fades (``TierSet.observe``):
under sustained load the batches are refilled within a second, so a wave of arrivals right after
the previous one drained still counts as load (a 16-row peak stays above 8 rows for ~14 s)."""


@dataclass
class TierSet:
    tiers: dict[str, Backend]
    worker: DeviceWorker | None
    models: dict[tuple[Any, ...], LoadedModel] = field(default_factory=dict)
    ready: bool = False
    _decided: dict[str, deque[float]] = field(default_factory=dict)
    """Per local tier, when requests routed to it in load-aware mode were decided, until its
    engine's submission count shows them (oldest first): between the decision and the submission
    a request awaits its tokenization and the cache, and a burst of decisions made meanwhile must
    see the batch the earlier ones are about to join."""
    _landed: dict[str, int] = field(default_factory=dict)
    _share: dict[str, float] = field(default_factory=dict)
    """Per local tier, a moving average of the share of routing decisions that went there."""
    _peak: tuple[float, float] = (0.0, 0.0)
    """The device's recent peak of held sequences and when it was seen (``observe``)."""
    token_bytes: int | None = None
    """The most UTF-8 bytes one token of the counting tokenizer stands for (``max_token_bytes``):
    a text of N bytes has at least N / token_bytes tokens, which refuses a prompt too long for
    every tier without tokenizing it."""

    def get(self, name: str) -> Backend:
        return self.tiers[name]

    def load_map(self) -> dict[str, bool]:
        return {name: b.is_full() for name, b in self.tiers.items()}

    def routing_costs(
        self, waits: Mapping[str, float], output_tokens: Mapping[str, int], prompt_tokens: int
    ) -> dict[str, RoutingCost]:
        """Per local tier, what one more request costs on the shared device now
        (``tiers.core.sched.pacing.routing_cost``): ``waits`` are the predicted waits for its first token
        (admission's), ``output_tokens`` its expected length on each tier. Tiers not yet measured,
        and remote tiers (they run on their own devices), are left out."""
        engines = self.worker.engines if self.worker is not None else self.engines()
        rounds = {id(e): e.decode_round(0) if e.has_work() else (0.0, 1.0) for e in engines}
        step_s = {key: r[0] if r is not None else 0.0 for key, r in rounds.items()}
        rows = sum(e.scheduler.num_running for e in engines)
        costs: dict[str, RoutingCost] = {}
        for name, b in self.tiers.items():
            if not isinstance(b, LocalTier) or name not in waits:
                continue
            engine = b.engine
            joined = engine.decode_round(1)
            if joined is None or rounds.get(id(engine), (0.0, 1.0)) is None:
                continue
            costs[name] = routing_cost(
                wait_s=waits[name],
                output_tokens=output_tokens.get(name, b.cfg.defaults.max_tokens),
                joined=joined,
                before_s=step_s.get(id(engine), 0.0),
                others_s=sum(s for key, s in step_s.items() if key != id(engine)),
                rows=rows,
                prefill_s=prompt_tokens * engine.pace.token_cost,
            )
        return costs

    def batches(self, now: float | None = None) -> dict[str, TierBatch]:
        """Per local tier, its ``TierBatch`` (``observe``'s first half)."""
        return self.observe(now)[0]

    def observe(self, now: float | None = None) -> tuple[dict[str, TierBatch], float]:
        """The local tiers' batches and the device's rows, in one look.

        The device's rows are its load as load-aware routing's guard (``min_device_rows``) reads
        it: the sequences the batches hold, or the recent peak fading with time constant
        ``LOAD_MEMORY_S`` when that is higher. A closed loop of N clients refills the batches as
        fast as they drain, and its requests arrive in waves: each wave's first decisions see an
        almost empty device, and routing them by the rules split the device between tiers for
        their whole answers (measured at 16 clients: 4 of 36 requests on small for 64 tokens
        each cost 8 % of the wall time against always-large).

        Per local tier, its ``TierBatch``: sequences it holds (running, waiting, just
        submitted, and decided but not yet submitted: ``decided``) against ``max_num_seqs`` -
        what load-aware routing joins while there is room - and, for an idle tier, how likely it
        runs anyway: the chance that at least one of the other requests on the device would go
        there, at its recent share of decisions. The others are those held now or, when higher,
        the device's recent peak (the rows above): the first request of a closed loop's next
        wave finds the device empty, and routed to an idle small tier it kept small's step in
        every turn of the wave (measured: one such request cost 5-8 % at 16 clients). One
        client alone holds nothing else, so once a busy spell has faded an idle tier stays idle
        to it; a burst's requests see each other."""
        now = time.monotonic() if now is None else now
        held: dict[str, tuple[int, int]] = {}
        for name, b in self.tiers.items():
            if isinstance(b, LocalTier):
                load = b.engine.load(predicted=False)
                n = load.num_running + load.num_waiting + self._pending(name, load.submitted, now)
                held[name] = (n, load.max_num_seqs)
        rows = self._observe_rows(sum(n for n, _ in held.values()), now)
        out = {}
        for name, (n, slots) in held.items():
            share = self._share.get(name, 1.0 / len(held))
            out[name] = TierBatch(n, slots, 1.0 if n else round(1.0 - (1.0 - share) ** (rows - n), 3))
        return out, rows

    def _observe_rows(self, rows: int, now: float | None) -> float:
        """``max(rows, faded peak)``; ``rows`` at or above it becomes the new peak."""
        now = time.monotonic() if now is None else now
        peak, seen = self._peak
        faded = peak * math.exp(-max(0.0, now - seen) / LOAD_MEMORY_S)
        if rows >= faded:
            self._peak = (float(rows), now)
            return float(rows)
        return faded

    def decided(self, tier: str, now: float | None = None) -> None:
        """A request was routed to ``tier`` and will be submitted shortly (every mode: the shares and
        the batches load-aware routing reads are those of the traffic, whichever mode routed it)."""
        b = self.tiers.get(tier)
        if isinstance(b, LocalTier):
            now = time.monotonic() if now is None else now
            self._pending(tier, b.engine.load(predicted=False).submitted, now)  # sync before adding
            self._decided[tier].append(now)
        local = [name for name, t in self.tiers.items() if isinstance(t, LocalTier)]
        for name in local:
            old = self._share.get(name, 1.0 / len(local))
            self._share[name] = old + SHARE_EMA * (float(name == tier) - old)

    def _pending(self, name: str, submitted: int, now: float) -> int:
        """Decisions for ``name`` its engine has not received yet. Each submission the engine
        counted since the last look lands the oldest; one that never comes (a cache hit, an
        error, a client gone) is forgotten after ``DECIDED_TTL_S``."""
        times = self._decided.setdefault(name, deque())
        landed, self._landed[name] = submitted - self._landed.get(name, submitted), submitted
        for _ in range(min(landed, len(times))):
            times.popleft()
        while times and now - times[0] > DECIDED_TTL_S:
            times.popleft()
        return len(times)

    def counting_tokenizer(self) -> Any:
        """The tokenizer used to count prompt tokens for routing rules: the first local tier's."""
        for b in self.tiers.values():
            if isinstance(b, LocalTier):
                return b.tokenizer
        return None

    def engines(self) -> list[Engine]:
        return [b.engine for b in self.tiers.values() if isinstance(b, LocalTier)]

    async def aclose(self) -> None:
        for b in self.tiers.values():
            await b.aclose()


def _check_draft_compatible(
    policy_source: str, tier: str, draft: str, target: LoadedModel, drafter: LoadedModel
) -> None:
    """A draft must share the target's tokenizer: its token ids are fed to the target as they are.
    Its output head may be narrower (Qwen2.5-1.5B has 151,936 logits, 7B 152,064, padding the same
    vocabulary): the engine pads draft logits and never proposes ids the draft cannot produce."""
    t_vocab = target.tokenizer.get_vocab()
    d_vocab = drafter.tokenizer.get_vocab()
    t_size = target.model.get_output_embeddings().out_features
    d_size = drafter.model.get_output_embeddings().out_features
    if t_vocab != d_vocab or d_size > t_size:
        raise PolicyError(
            policy_source,
            [
                PolicyIssue(
                    f"tiers.{tier}.draft",
                    f"tier '{draft}' cannot draft for tier '{tier}': their tokenizers/vocabularies differ "
                    f"({len(d_vocab)} vs {len(t_vocab)} tokens, {d_size} vs {t_size} logits)",
                )
            ],
        )


def build_tiers(
    policy: Policy,
    worker: DeviceWorker,
    *,
    observer: EngineObserver | None = None,
    reuse: TierSet | None = None,
) -> TierSet:
    """Load and warm every tier of ``policy`` (blocking; runs model work on ``worker``).

    Tiers whose ``engine_key`` is unchanged in ``reuse`` are taken over as they are; so are loaded
    models with the same (model, dtype, quantization, device).
    """
    from tiers.core.sched.scheduler import SchedulerConfig
    from tiers.models.loading import load_model
    from tiers.models.plan import device_memory, kv_budget_tokens
    from tiers.spec_decode.ngram import NgramProposer
    from tiers.worker.model_runner import ModelRunner, kv_bytes_per_token

    started = time.monotonic()
    models: dict[tuple[Any, ...], LoadedModel] = {}
    old_models = reuse.models if reuse is not None else {}
    for cfg in policy.tiers.values():
        if cfg.is_remote:
            continue
        key = model_key(cfg)
        if key in models:
            continue
        if key in old_models:
            models[key] = old_models[key]
            continue
        log.info(
            "loading model %s (dtype=%s, quantization=%s, device=%s)",
            cfg.model,
            cfg.dtype,
            cfg.quantization,
            cfg.device,
        )

        def load(cfg: TierConfig = cfg) -> LoadedModel:
            return load_model(
                cfg.model,
                device=cfg.device,
                dtype=cfg.dtype,
                quantization=cfg.quantization,
                group_size=cfg.quant_group_size,
                int4_head=cfg.quantize_head,
                int8_head_rows=cfg.head_int8_tokens,
                int8_activations=cfg.activation_quantization == "int8",
                batch_invariant=cfg.batch_invariant,
            )

        models[key] = worker.call(load)
    backends: dict[str, Backend] = {}
    new_engines: list[Engine] = []
    to_build: list[str] = []
    for name, cfg in policy.tiers.items():
        old = reuse.tiers.get(name) if reuse is not None else None
        if (
            old is not None
            and old.key == engine_key(cfg)
            and (
                cfg.draft in (None, NGRAM)
                or (
                    reuse is not None
                    and reuse.tiers.get(cfg.draft) is not None
                    and reuse.tiers[cfg.draft].key == engine_key(policy.tiers[cfg.draft])
                )
            )
        ):
            # Taken over as it is; its cfg is swapped with the policy (router.http.reload), not here:
            # a build that fails later must leave the serving tiers untouched.
            backends[name] = old
            continue
        if cfg.is_remote:
            api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
            client = RemoteTier(
                name,
                cfg.model,
                served_model=cfg.served_model_name,
                api_key=api_key,
                timeout_s=cfg.timeout_s,
                max_retries=cfg.max_retries,
                capacity=cfg.max_num_seqs + cfg.max_queue,
                circuit_failures=cfg.circuit_failures,
                circuit_cooldown_s=cfg.circuit_cooldown_s,
            )
            backends[name] = RemoteBackend(name, cfg, client)
            continue
        loaded = models[model_key(cfg)]
        if cfg.draft not in (None, NGRAM):
            assert cfg.draft is not None
            _check_draft_compatible(
                policy.source, name, cfg.draft, loaded, models[model_key(policy.tiers[cfg.draft])]
            )
        to_build.append(name)
    # Pools first (one per local tier), then engines: a tier's draft runs on the pool and model of
    # the tier it names, so the drafts' KV is budgeted there and shares its prefix cache.
    runners: dict[str, ModelRunner] = {
        n: b.engine.runner for n, b in backends.items() if isinstance(b, LocalTier)
    }
    for name in to_build:
        cfg = policy.tiers[name]

        def make_runner(cfg: TierConfig = cfg) -> ModelRunner:
            loaded = models[model_key(cfg)]
            per_token = kv_bytes_per_token(loaded.model.config, loaded.dtype)
            tokens = kv_budget_tokens(cfg, per_token, device_memory(loaded.device))
            return ModelRunner(
                loaded,
                num_blocks=max(1, tokens // cfg.block_size),
                block_size=cfg.block_size,
                max_model_len=cfg.max_model_len,
                enable_prefix_caching=cfg.prefix_caching,
                batch_invariant=cfg.batch_invariant,
                cuda_graphs=cfg.cuda_graphs,
            )

        try:
            runners[name] = worker.call(make_runner)
        except ValueError as exc:  # e.g. a sliding-window model the paged engine refuses
            raise PolicyError(policy.source, [PolicyIssue(f"tiers.{name}.model", str(exc))]) from exc
    for name in to_build:
        cfg = policy.tiers[name]
        sched = SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            max_waiting=cfg.max_queue,
            max_decode_slowdown=cfg.max_decode_slowdown,
        )

        def make_engine(name: str = name, cfg: TierConfig = cfg, sched: SchedulerConfig = sched) -> Engine:
            draft: ModelRunner | NgramProposer | None = None
            if cfg.draft == NGRAM and cfg.speculative_tokens > 0:
                own = runners[name]
                # Bookkeeping blocks for the scheduler's draft tables: enough for every sequence
                # at full length plus its lookahead, so the lookup never runs short of them.
                per_seq = -(-(cfg.max_model_len + cfg.speculative_tokens) // own.block_size)
                draft = NgramProposer(max(own.blocks.num_blocks, cfg.max_num_seqs * per_seq), own.block_size)
            elif cfg.draft is not None and cfg.speculative_tokens > 0:
                draft = runners[cfg.draft]
            engine = Engine(
                name,
                runners[name],
                sched,
                draft_runner=draft,
                speculative_tokens=cfg.speculative_tokens,
                observer=observer,
            )
            engine.warmup()
            return engine

        try:
            engine = worker.call(make_engine)
        except ValueError as exc:  # the KV budget cannot hold one max_model_len sequence
            raise PolicyError(
                policy.source, [PolicyIssue(f"tiers.{name}.kv_cache_tokens", str(exc))]
            ) from exc
        new_engines.append(engine)
        backends[name] = LocalTier(name, cfg, engine, cfg.draft)
    for engine in new_engines:
        engine.attach(worker)
    log.info("tiers ready in %.1fs: %s", time.monotonic() - started, ", ".join(backends))
    worker.turns.slowdown = policy.service.fair_slowdown
    tiers = TierSet(backends, worker, models, ready=True)
    tok = tiers.counting_tokenizer()
    tiers.token_bytes = max_token_bytes(tok) if tok is not None else None
    return tiers


def max_token_bytes(tokenizer: Any) -> int | None:
    """An upper bound on the text bytes one token covers: the longest vocabulary entry in UTF-8
    bytes, doubled. A byte-level BPE entry spells each byte it covers with one character of one
    or more bytes, a sentencepiece or byte-fallback entry is never shorter than its text, and the
    factor 2 leaves room for a normalizer that expands a character (NFKC). None when the tokenizer
    exposes no vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab()
    if not vocab:
        return None
    return 2 * max(len(str(t).encode("utf-8", "surrogatepass")) for t in vocab)
