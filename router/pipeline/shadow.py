"""Collecting outcomes in production: shadow answers from another tier, and user feedback.

**Shadow mode** (policy ``shadow:``). A sampled share of routed requests (optionally only some
rules or tenants) is also answered by a second tier - by default the one above the tier that
served it - and both answers go to a JSONL log for later judging. It never touches the user's
answer or its latency:

* it starts only after the user's answer has finished streaming (whatever the finish reason;
  not after a disconnect), as a background task;
* it is admitted only into idle capacity: the target tier must have nobody waiting and at most
  ``max_busy_fraction`` of its sequence slots busy, and at most ``max_concurrent`` shadow
  generations run at once; otherwise it is skipped (counted, never queued). A shadow request
  therefore never waits in a queue ahead of a real one, and never holds more than a small,
  fixed share of a tier's slots;
* its output is capped at ``max_tokens``, and with ``preempt`` (the default) any real request
  that arrives cancels the running shadow answers at once: on shared CPUs a free sequence slot is
  not free compute, and the user's request must not share the cores with a shadow.

**Feedback** (``POST /v1/feedback``): ``{"id": ..., "score": 0..1}`` or ``{"id", "thumbs":
"up"|"down"}`` for an answer this service issued, named by the ``x-router-response-id`` header
of its response (remembered for ``service.feedback.ttl_s``, at most ``max_ids`` of them).

Both logs use the outcome-row shape ``classifier train --outcomes`` reads: ``{"id", "prompt",
"outcomes": {tier: score}}``. A shadow line carries both answers and empty outcomes until a
judge (a person or a grader model) fills them; feedback lines carry the served tier's score.
Lines sharing an ``id`` are merged at training time (classifier/outcomes.py, ``merge_by_id``),
so feedback on the served answer plus a judged shadow answer makes one weak/strong pair.
Prompts and answers are written only where ``record_content`` allows; without them a line keeps
ids, tiers, rule, tenant and lengths (useful for load and agreement statistics, not training).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from router.openai.request import Generation
    from router.policy.decide import Decision
    from router.policy.schema import FeedbackConfig, Policy, ShadowConfig
    from tiers.core.output import StepOutput

__all__ = [
    "MAX_SCORES_PER_ID",
    "FeedbackConflictError",
    "FeedbackLog",
    "IssuedAnswers",
    "ShadowRecorder",
    "then_shadow",
    "thumbs_score",
]

log = logging.getLogger(__name__)


def _stamp() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat()


class _JsonlWriter:
    """Appends one JSON object per line; a lock keeps concurrent writers' lines whole."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def write(self, row: dict[str, Any]) -> None:
        line = json.dumps(row, ensure_ascii=False) + "\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write(line)


def _prompt_text(gen: Generation) -> str:
    """What the routing score scores: the last user turn with bounded earlier context."""
    if gen.messages is not None:
        from classifier.inference import message_text

        return message_text(gen.messages)[0]
    return gen.prompt or ""


class IssuedAnswers:
    """Response id -> what feedback needs to record about it (bounded, with a time to live)."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.ttl_s, self._clock = max_entries, ttl_s, clock
        self._items: OrderedDict[str, tuple[dict[str, Any], float]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, ids: list[str], info: dict[str, Any]) -> None:
        now = self._clock()
        with self._lock:
            for rid in ids:
                self._items[rid] = (info, now)
                self._items.move_to_end(rid)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def get(self, rid: str) -> dict[str, Any] | None:
        with self._lock:
            item = self._items.get(rid)
            if item is None:
                return None
            info, stamp = item
            if self._clock() - stamp > self.ttl_s:
                del self._items[rid]
                return None
            return info


def thumbs_score(thumbs: str) -> float:
    if thumbs not in ("up", "down"):
        raise ValueError("'thumbs' must be 'up' or 'down'")
    return 1.0 if thumbs == "up" else 0.0


MAX_SCORES_PER_ID = 4
"""Different scores one answer may receive (a user changing their mind), each one line."""


class FeedbackConflictError(Exception):
    """An answer that has already received ``MAX_SCORES_PER_ID`` different scores."""


class FeedbackLog:
    """``POST /v1/feedback``: one outcome line per piece of feedback on an issued answer."""

    def __init__(self, cfg: FeedbackConfig, record_content: bool, registry: Any = None) -> None:
        self.cfg = cfg
        self.record_content = record_content
        self.issued = IssuedAnswers(cfg.max_ids, cfg.ttl_s)
        self._claim = threading.Lock()
        self._writer = _JsonlWriter(cfg.log_path)
        self.received = Counter(
            "router_feedback", "Feedback received, by result", ["result"], registry=registry
        )

    def remember(self, ids: list[str], gen: Generation, d: Decision) -> None:
        partition = gen.ctx.partition if gen.ctx is not None else "-"
        info: dict[str, Any] = {"tier": d.tier, "rule": d.rule, "id": ids[0], "partition": partition}
        if self.record_content:
            info["prompt"] = _prompt_text(gen)
        self.issued.put(ids, info)

    def record(self, rid: str, score: float, partition: str = "-") -> dict[str, Any] | None:
        """The written line, or None for an id this service did not issue to ``partition`` (or has
        forgotten): another caller's answer is as unknown as one never issued.

        A second score for an id replaces the first (the later line wins when outcomes are merged
        by id); the same score again writes nothing, and past ``MAX_SCORES_PER_ID`` different
        scores ``FeedbackConflictError`` is raised (409). Blocking (file I/O): call it off the loop.
        """
        info = self.issued.get(rid)
        if info is None or info.get("partition", "-") != partition:
            self.received.labels("unknown_id").inc()
            return None
        row: dict[str, Any] = {
            "id": info["id"],
            "time": _stamp(),
            "kind": "feedback",
            "rule": info["rule"],
            "partition": partition,
            "outcomes": {info["tier"]: score},
        }
        if "prompt" in info:
            row["prompt"] = info["prompt"]
        with self._claim:
            scores: list[float] = info.setdefault("scores", [])
            if scores and scores[-1] == score:
                self.received.labels("repeated").inc()
                return row
            if len(scores) >= MAX_SCORES_PER_ID:
                self.received.labels("conflict").inc()
                raise FeedbackConflictError(rid)
            scores.append(score)
        self._writer.write(row)
        self.received.labels("recorded").inc()
        return row


class ShadowRecorder:
    """Samples routed requests, runs them on a second tier in idle capacity, logs both answers."""

    def __init__(self, registry: Any = None, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._running = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.requests = Counter(
            "router_shadow_requests",
            "Shadow requests by result: started, recorded, failed, preempted (a real request "
            "arrived), skipped_busy (target tier had a queue or too few free slots), "
            "skipped_concurrency (max_concurrent reached)",
            ["tier", "result"],
            registry=registry,
        )
        self.in_flight = Gauge("router_shadow_in_flight", "Shadow generations running", registry=registry)
        self.tokens = Counter(
            "router_shadow_completion_tokens",
            "Tokens generated for shadow answers",
            ["tier"],
            registry=registry,
        )

    def target(self, policy: Policy, d: Decision, tenant: str | None) -> str | None:
        """The shadow tier for this decision when it is sampled, else None."""
        cfg = policy.shadow
        if not cfg.enabled or cfg.sample <= 0.0 or d.rejected:
            return None
        if cfg.rules is not None and d.rule not in cfg.rules:
            return None
        if cfg.tenants is not None and tenant not in cfg.tenants:
            return None
        tier = cfg.tier if cfg.tier is not None else policy.tier_above(d.tier)
        if tier is None or tier == d.tier or tier not in policy.tiers:
            return None
        if self._rng.random() >= cfg.sample:
            return None
        return tier

    def admit(self, cfg: ShadowConfig, tier: str, load: Any) -> bool:
        """Idle capacity only: no queue on the tier, enough free slots, under max_concurrent."""
        if self._running >= cfg.max_concurrent:
            self.requests.labels(tier, "skipped_concurrency").inc()
            return False
        if load is not None:
            busy = getattr(load, "num_running", 0) / max(1, getattr(load, "max_num_seqs", 1))
            queued = getattr(load, "num_waiting", 0) > 0 or getattr(load, "is_full", False)
            if queued or busy > cfg.max_busy_fraction:
                self.requests.labels(tier, "skipped_busy").inc()
                return False
        return True

    def launch(
        self,
        cfg: ShadowConfig,
        tier: str,
        load: Any,
        stream: Callable[[], AsyncIterator[StepOutput]],
        row: dict[str, Any],
        record_content: bool,
    ) -> bool:
        """Start the shadow generation in the background; False when it was not admitted."""
        if not self.admit(cfg, tier, load):
            return False
        self._running += 1
        self.in_flight.inc()
        self.requests.labels(tier, "started").inc()
        task = asyncio.get_running_loop().create_task(self._run(cfg, tier, stream, row, record_content))
        self._tasks.add(task)  # a reference until it finishes: the loop only keeps weak ones
        task.add_done_callback(self._tasks.discard)
        return True

    async def _run(
        self,
        cfg: ShadowConfig,
        tier: str,
        stream: Callable[[], AsyncIterator[StepOutput]],
        row: dict[str, Any],
        record_content: bool,
    ) -> None:
        parts: list[str] = []
        tokens = 0
        finish = None
        try:
            async for out in stream():
                if out.error:
                    raise RuntimeError(out.error)
                parts.append(out.text)
                tokens += len(out.token_ids)
                finish = out.finish_reason or finish
            text = "".join(parts)
            answers = row.setdefault("answers", {})
            answers[tier] = text if record_content else {"chars": len(text)}
            row["shadow"] = {"tier": tier, "finish_reason": finish, "completion_tokens": tokens}
            _JsonlWriter(cfg.log_path).write(row)
            self.tokens.labels(tier).inc(tokens)
            self.requests.labels(tier, "recorded").inc()
        except asyncio.CancelledError:
            # Preempted by real traffic: the engine request was aborted as the stream closed.
            self.requests.labels(tier, "preempted").inc()
            raise
        except Exception:  # a shadow failure is logged and counted, never the user's problem
            log.warning("shadow generation on tier %s failed", tier, exc_info=True)
            self.requests.labels(tier, "failed").inc()
        finally:
            self._running -= 1
            self.in_flight.dec()

    def preempt(self) -> int:
        """Cancel every running shadow answer (a real request needs the capacity); how many."""
        running = [t for t in self._tasks if not t.done()]
        for task in running:
            task.cancel()
        return len(running)

    async def drain(self, timeout: float) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)


def shadow_row(
    rid: str, gen: Generation, d: Decision, tenant: str | None, answer: str, record_content: bool
) -> dict[str, Any]:
    """The log line's start: the served answer; ShadowRecorder adds the shadow tier's."""
    row: dict[str, Any] = {
        "id": rid,
        "time": _stamp(),
        "kind": "shadow",
        "tenant": tenant,
        "rule": d.rule,
        "served": d.tier,
        "answers": {d.tier: answer if record_content else {"chars": len(answer)}},
        "outcomes": {},
    }
    if record_content:
        row["prompt"] = _prompt_text(gen)
    return row


async def then_shadow(
    source: AsyncIterator[StepOutput], start: Callable[[str], None]
) -> AsyncIterator[StepOutput]:
    """The user's stream, unchanged; once it has finished, ``start`` is given the answer's first
    choice and starts the shadow answer.

    Not after a disconnect (the generator is closed mid-way) or an error: only answers the
    user actually got are compared.
    """
    parts: list[str] = []
    finished = False
    try:
        async for out in source:
            if out.index == 0:
                parts.append(out.text)
                finished = finished or out.finish_reason is not None
            yield out
    finally:
        # The writer closes the stream once it has the last output, without reading past it:
        # the finished answer is known here, at the close.
        if finished:
            start("".join(parts))
