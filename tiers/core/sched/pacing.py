"""How long a request submitted now waits for its first token: an engine's measured pace and the
work queued ahead of the request (no torch: the engine feeds it numbers).

Why a work model, not a queue length: on a CPU a 500-token prompt costs as much as a hundred
decode steps, and every tier of the process shares one device thread (``device.py``). A burst of
long prompts on an idle service looked cheap to a step-count estimate (the steps measured so far
were light ones), so far more was admitted than could start in time: the overload benchmark saw
accepted requests wait 34 s for their first token against a 5 s budget. Here the wait is the
prompt tokens that must be computed before this request's last one, at the measured cost of a
token, plus the steps the other engines on the device take in between, plus, for a request that
must queue for a batch slot, the time running sequences take to free one.

All costs are an engine's own step times (``elapsed``), not the period between its steps, so a
tier's estimate does not double count the other tiers' steps; those are added explicitly from
their own backlogs (round-robin: each turn of the device thread, every engine with work takes
one step).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from tiers.core.sched.fairness import fair_share, protected_callers

if TYPE_CHECKING:
    from tiers.core.sequence import Sequence

__all__ = [
    "Backlog",
    "Pace",
    "Reused",
    "RoutingCost",
    "predict_wait",
    "prefill_cap",
    "queue_backlog",
    "routing_cost",
]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

REUSE_S = 0.01
"""How long a snapshot (an engine's backlog, a priced decode round) serves the estimates asking
for it: every admission asks each tier about every other one, and a burst of requests would
otherwise rescan the same sequences hundreds of times a second."""

PREFILL_STEP_TOKENS = 64
"""A step feeding at least this many tokens measures the cost of a token (its fixed overhead is
small beside them); smaller steps measure the cost of a decode step."""

MIN_PREFILL_CHUNK = 16
"""The smallest prompt chunk ``prefill_cap`` allows beside decodes: a prompt always progresses."""


CORRECTION_RANGE = (0.5, 4.0)
"""How far the measured ratio of actual to predicted waits may scale an estimate."""
CALIBRATION_FLOOR_S = 1.0
"""Added to both waits before taking their ratio (``Pace.observe``)."""
CORRECTION_MEMORY_S = 30.0
"""Time constant over which a ratio not confirmed by new waits relaxes back to 1: a ratio
learned under one load said little about the next (measured: the large tier's protected ratio,
learned at 2.4 in a single-tenant flood, stayed there into a two-tenant phase whose protected
requests waited 0.3-1.3 s against estimates of 0.8-1.5 s, and so refused them at ~6 s)."""


@dataclass(frozen=True, slots=True)
class Backlog:
    """What one engine has queued, as seen from a new request (a snapshot; any thread)."""

    prefill_tokens: int
    """Prompt tokens not yet computed that run before the new request's own."""
    decoding: int
    """Sequences decoding now: each turn of the device spends a decode step on them."""
    slots_ahead: int
    """Sequences that must get a batch slot before the new request does (0: it gets one at once)."""
    protected: bool = False
    """The caller is below its fair share: it gets a slot at once, by preemption if need be, so
    no later arrival can push it back (anyone else's wait also depends on who comes next)."""
    slot_steps: float = 0.0
    """Steps of this engine until a slot frees for the new request (from the running sequences'
    remaining lengths), when ``slots_ahead``."""
    protected_prefill_tokens: int = 0
    """Of ``prefill_tokens``, those of protected callers' prompts (the engine's whole backlog
    only): while one is pending, the engines on the device run no one else's prompts."""


class Reused(Generic[K, V]):
    """Values computed on demand and reused for ``REUSE_S`` (any thread: each entry is replaced
    whole)."""

    def __init__(self) -> None:
        self._entries: dict[K, tuple[float, V]] = {}

    def get(self, key: K, compute: Callable[[], V]) -> V:
        now = time.monotonic()
        cached = self._entries.get(key)
        if cached is not None and now - cached[0] < REUSE_S:
            return cached[1]
        value = compute()
        self._entries[key] = (now, value)
        return value


class Pace:
    """An engine's measured step costs (written by the device thread, read by any thread: plain
    floats, each replaced whole)."""

    def __init__(self, max_num_seqs: int, budget_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.budget_tokens = max(1, budget_tokens)
        self.token_cost = 0.0
        """Seconds of this engine's own step per token fed, over steps of many tokens."""
        self.decode_cost = 0.0
        """Seconds of this engine's own decode step (few tokens)."""
        self.decode_step = 0.0
        """Seconds of a step of running decodes only (no prompt chunk beside them): the step a
        prompt chunk may slow by at most ``max_decode_slowdown`` (``prefill_cap``)."""
        self.loaded_period = 0.0
        """Seconds between this engine's steps with the batch at least half full: the pace at
        which running sequences finish and free slots (other tiers' steps included)."""
        self.correction = {False: 1.0, True: 1.0}
        """Actual over predicted waits (a moving average of the ratio, kept within
        ``CORRECTION_RANGE``), keyed by ``unprotected``: protected requests (``Backlog.protected``)
        under ``False``, the rest under ``True``:
        what the model misses - a draft's share of a step, the CPU the HTTP side takes, cache
        hits, how slots really turn over - is learned from the requests themselves. Kept apart
        because the errors differ: a protected request's wait is its prompt's, anyone else's is
        mostly the slot's and grows when lighter callers arrive after it. One ratio for both
        (measured: 4x, from a flood overtaken by a light tenant) refused the light tenant."""
        self._corrected_at = {False: 0.0, True: 0.0}
        self.output_len = 32.0
        """Output tokens a sequence produces (moving average over finished ones)."""
        self._last_start = 0.0

    @staticmethod
    def _ema(old: float, new: float, weight: float = 0.1) -> float:
        return new if old == 0.0 else (1 - weight) * old + weight * new

    def seed(self, *, token_cost: float | None = None, decode_cost: float | None = None) -> None:
        """Warm-up measurements, before any real step (``None`` keeps what was seeded)."""
        if token_cost is not None:
            self.token_cost = token_cost
        if decode_cost is not None:
            self.decode_cost = decode_cost
            self.decode_step = decode_cost

    def on_step(
        self,
        started: float,
        elapsed: float,
        tokens: int,
        num_seqs: int,
        busy_after: bool,
        kind: str | None = None,
    ) -> None:
        """One step's time; ``kind``: the batch's (``decode``: running decodes, no prompt chunk)."""
        if tokens >= PREFILL_STEP_TOKENS:
            self.token_cost = self._ema(self.token_cost, elapsed / tokens)
        elif tokens > 0:
            self.decode_cost = self._ema(self.decode_cost, elapsed)
        if kind == "decode" and tokens > 0:
            self.decode_step = self._ema(self.decode_step, elapsed)
        gap = started - self._last_start if self._last_start else 0.0
        if 0.0 < gap < 10.0 and 2 * num_seqs >= self.max_num_seqs:
            self.loaded_period = self._ema(self.loaded_period, gap)
        # Only while busy: after an idle spell the gap measures idleness, not the device's pace.
        self._last_start = started if busy_after else 0.0

    def on_finish(self, output_tokens: int) -> None:
        self.output_len = self._ema(self.output_len, max(1, output_tokens), 0.05)

    def observe(self, predicted: float, actual: float, unprotected: bool, now: float | None = None) -> None:
        """A request waited ``actual`` seconds for its first token; ``predicted`` was the
        uncalibrated estimate at its submission (``unprotected``: not ``Backlog.protected``). The ratio is
        taken over both plus ``CALIBRATION_FLOOR_S``: a short wait's error is mostly where in the
        device's turn the request landed, an offset, and as a ratio it would scale every longer
        estimate by it (measured: 0.3 s predicted, 1.3 s waited in a burst)."""
        if predicted <= 0.0:
            return
        now = time.monotonic() if now is None else now
        ratio = (actual + CALIBRATION_FLOOR_S) / (predicted + CALIBRATION_FLOOR_S)
        low, high = CORRECTION_RANGE
        old = self.ratio(unprotected, now)
        self.correction[unprotected] = min(high, max(low, self._ema(old, ratio, 0.2)))
        self._corrected_at[unprotected] = now

    def ratio(self, unprotected: bool, now: float | None = None) -> float:
        """The correction now: the learned ratio, relaxed towards 1 by its age
        (``CORRECTION_MEMORY_S``)."""
        age = (time.monotonic() if now is None else now) - self._corrected_at[unprotected]
        return 1.0 + (self.correction[unprotected] - 1.0) * math.exp(-max(0.0, age) / CORRECTION_MEMORY_S)

    def calibrated(self, predicted: float, unprotected: bool, now: float | None = None) -> float:
        scaled = (predicted + CALIBRATION_FLOOR_S) * self.ratio(unprotected, now)
        return max(0.0, scaled - CALIBRATION_FLOOR_S)

    def prefill_seconds(self, tokens: int) -> float:
        return tokens * self.token_cost


def queue_backlog(
    running: list[Sequence],
    waiting: list[Sequence],
    max_num_seqs: int,
    budget_tokens: int,
    caller: str | None,
    inbox: int = 0,
    inbox_tokens: int = 0,
    expected_len: float = 32.0,
    *,
    inbox_mine: int = 0,
    inbox_mine_tokens: int = 0,
) -> Backlog:
    """What a new request from ``caller`` finds ahead of it in one engine's scheduler (a
    snapshot of its ``running`` and ``waiting`` sequences; any thread), with
    ``inbox`` requests of ``inbox_tokens`` prompt tokens not yet handed to the scheduler
    (``inbox_mine`` of them, of ``inbox_mine_tokens`` tokens, the caller's own).
    ``caller=None``: a request that holds no share (the whole backlog is ahead of it).

    A caller below its fair share gets a slot at once (free, or preempted from a caller over
    its share) and its prompt runs after the running prefills of callers no heavier and after
    its own earlier requests (a caller's requests keep their order); any other
    request also waits for the queued prompts of callers running no more than its own (all of
    them for ``None``), and for a slot once the batch is full: the steps until the
    running sequences have finished often enough (``expected_len``: output tokens a sequence
    is expected to produce, capped by each one's ``max_tokens``)."""
    decoding = sum(1 for s in running if s.is_decoding)
    running_prefill = sum(s.num_tokens - s.num_computed_tokens for s in running if not s.is_decoding)
    if caller is not None:
        per_caller = Counter(s.caller for s in running)
        mine = sum(1 for s in [*running, *waiting] if s.caller == caller)
        callers = per_caller.keys() | {s.caller for s in waiting} | {caller}
        # A lone caller is protected by nothing: any caller arriving after it is lighter and
        # goes first. (Counted as protected, a flood's requests, pushed back by a light
        # tenant's, taught the protected calibration a 4x ratio that then refused that tenant.)
        if len(callers) > 1 and mine + inbox_mine < fair_share(max_num_seqs, len(callers)):
            # Its prompt goes before those of callers running more than it does.
            ahead = sum(
                s.num_tokens - s.num_computed_tokens
                for s in running
                if not s.is_decoding and per_caller[s.caller] <= mine + 1
            )
            ahead += sum(s.num_tokens - s.num_computed_tokens for s in waiting if s.caller == caller)
            return Backlog(ahead + inbox_mine_tokens, decoding, 0, protected=True)
        # Free slots go to the waiting caller running the fewest (``fairness.next_waiting``): only
        # the queued requests of callers running no more than this one are ahead of it.
        waiting = [s for s in waiting if per_caller[s.caller] <= per_caller[caller]]
    queued = sum(s.num_tokens - s.num_computed_tokens for s in waiting)
    protected = protected_callers([*running, *waiting], max_num_seqs) if caller is None else set()
    protected_prefill = sum(
        s.num_tokens - s.num_computed_tokens
        for s in [*running, *waiting]
        if s.caller in protected and not s.is_decoding
    )
    slots_ahead = max(0, len(running) + len(waiting) + inbox + 1 - max_num_seqs)
    slot_steps = 0.0
    if slots_ahead:
        # The k-th slot frees when the k-th shortest remaining sequence ends, among those
        # holding the batch's slots once the free ones are taken: the running ones, and the
        # first of the queue ahead for their whole lives. (Counting only the running ones
        # left a burst that landed on an idle engine with no slot wait at all: measured, 70
        # requests in 0.3 s were all admitted to the small tier and the last waited 24 s.)
        # Beyond the batch, slots turn over once per expected lifetime.
        budget = budget_tokens
        left = [_steps_left(s, expected_len, budget) for s in running]
        free = max(0, max_num_seqs - len(running))
        left += [_steps_left(s, expected_len, budget) for s in waiting[:free]]
        left += [1.0 + max(1.0, expected_len)] * min(inbox, free - min(free, len(waiting)))
        left.sort()
        laps, k = divmod(slots_ahead - 1, len(left))
        slot_steps = left[k] + laps * max(1.0, expected_len)
    return Backlog(
        running_prefill + queued + inbox_tokens,
        decoding,
        slots_ahead,
        slot_steps=slot_steps,
        protected_prefill_tokens=protected_prefill,
    )


def _steps_left(seq: Sequence, expected_len: float, budget: int) -> float:
    """Steps until ``seq`` ends: what is left of its prompt (in budget-sized chunks), then its
    expected length (capped by ``max_tokens``) less what it has produced; a sequence already past
    that is assumed halfway through what it may still add."""
    prefill = -(-max(0, seq.num_prompt_tokens - seq.num_computed_tokens) // max(1, budget))
    out = seq.num_output_tokens
    expected = min(float(seq.params.max_tokens), expected_len)
    if out < expected:
        return prefill + expected - out
    return max(1.0, seq.num_remaining_tokens / 2)


def prefill_cap(pace: Pace, slowdown: float | None) -> int | None:
    """Prompt tokens one step may feed beside running decodes, so that the step costs at most
    ``slowdown`` times a step of the decodes alone: a chunk of ``c`` tokens adds ``c x token_cost``
    to the decodes' ``decode_step``, so ``c <= (slowdown - 1) x decode_step / token_cost`` (vLLM
    caps a chunk by ``long_prefill_token_threshold`` tokens; this picks the threshold from the
    tier's own measured costs, and follows them as they change). At least ``MIN_PREFILL_CHUNK``;
    None (no cap) when ``slowdown`` is None or nothing is measured yet."""
    if slowdown is None or pace.token_cost <= 0.0 or pace.decode_step <= 0.0:
        return None
    return max(MIN_PREFILL_CHUNK, int((slowdown - 1.0) * pace.decode_step / pace.token_cost))


def predict_wait(pace: Pace, own: Backlog, prompt_tokens: int, others: list[tuple[Pace, Backlog]]) -> float:
    """Seconds until a request of ``prompt_tokens`` submitted now gets its first token.

    ``own``: this engine's backlog ahead of the request; ``others``: the other engines on the same
    device thread with theirs. Unmeasured (no warm-up, no step yet): 0.
    """
    if pace.token_cost <= 0.0:
        return 0.0
    tokens = own.prefill_tokens + max(1, prompt_tokens)
    prefill_budget = max(1, pace.budget_tokens - own.decoding)
    turns = max(1, math.ceil(tokens / prefill_budget))
    own_s = pace.prefill_seconds(tokens + turns * own.decoding)
    # Round-robin: each turn every other engine with work takes a step, a chunk of up to its
    # budget of its own queued prompts and a decode step for its running rows. A protected
    # request's prompt holds back the others' prompts but protected callers' (``Scheduler.schedule``).
    others_s = sum(
        p.prefill_seconds(
            min(b.protected_prefill_tokens if own.protected else b.prefill_tokens, turns * p.budget_tokens)
        )
        + (turns * p.decode_cost if b.decoding else 0.0)
        for p, b in others
    )
    slot_s = 0.0
    if own.slots_ahead:
        # Until then every step is a full batch's: the period measured at that load, or one
        # decode step of every engine on the device.
        period = pace.loaded_period or pace.decode_cost + sum(p.decode_cost for p, b in others if b.decoding)
        slot_s = own.slot_steps * period
    return slot_s + own_s + others_s


@dataclass(frozen=True, slots=True)
class RoutingCost:
    """What one more request costs on one engine of a shared device (seconds)."""

    completion_s: float
    """Until its last token: its wait for the first, then one device turn per step it needs."""
    delay_s: float
    """What it adds to the sequences already decoding on the device, summed over them."""

    @property
    def total_s(self) -> float:
        return self.completion_s + self.delay_s


def routing_cost(
    *,
    wait_s: float,
    output_tokens: float,
    joined: tuple[float, float],
    before_s: float,
    others_s: float,
    rows: int,
    prefill_s: float = 0.0,
) -> RoutingCost:
    """The price of sending a request to an engine that shares its device with others.

    ``joined``: ``(seconds, tokens per row)`` of the engine's decode step with the request in its
    batch (``Engine.decode_round(1)``); ``before_s``: the step's seconds now, without it (0 when
    the engine is idle); ``others_s``: the other engines' steps in one turn of the device worker
    (each engine with work takes one step a turn); ``rows``: sequences decoding on the device now;
    ``prefill_s``: the device time its prompt takes on this engine.

    The request needs ``output_tokens / tokens per row`` steps, each a whole turn of the device:
    that is its own time. Every step it adds ``joined - before`` to a turn, and every other row
    waits for that too (an upper bound: as if they all outlived it), as they wait for its prompt.
    On an idle device the cheapest engine wins; once an engine runs a large batch, one more row
    there costs a sliver of its step while a step of an idle engine is added whole to every turn,
    so requests join the running batch instead of splitting the device three ways.
    """
    seconds, tokens = joined
    steps = output_tokens / max(tokens, 1e-6)
    added = max(0.0, seconds - before_s)
    return RoutingCost(
        completion_s=wait_s + steps * (seconds + others_s),
        delay_s=rows * (steps * added + prefill_s),
    )
