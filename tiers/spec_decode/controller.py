"""Speculative decoding's control: how many tokens a row may draft (``spec_budget``) and the
adaptive choice of k from measured step costs and acceptance (``SpecController``). The acceptance
rule itself is ``tiers.sample.rejection``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiers.core.sequence import Sequence

__all__ = ["NGRAM", "SpecController", "fastest", "spec_budget"]

NGRAM = "ngram"
"""The policy's ``draft`` value that drafts by n-gram lookup (``tiers.spec_decode.ngram``) instead of a
tier's model."""


def fastest(run: Callable[[], object], repeats: int = 2) -> float:
    """Seconds of the fastest of ``repeats`` calls (other work only ever adds time): a profile's figure."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def spec_budget(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many tokens ``seq`` may draft this step at the engine's ``k``: none for penalized
    requests (their logits depend on the tokens before them), for prompt-logprob ones (their
    prompt rows carry logits at every position already) and for seeded sampled ones (the
    documented contract: a seed reproduces a request's output, which a load-dependent k would
    not), never past max_tokens or the context."""
    p = seq.params
    if k == 0 or p.has_penalties or (p.seed is not None and not p.is_greedy) or p.prompt_logprobs is not None:
        return 0
    room = min(seq.num_remaining_tokens - 1, max_model_len - seq.num_tokens - 1)
    return max(0, min(k, room))


SPEC_MARGIN = 1.1
"""Keep speculating only while the model predicts at least this much more throughput than plain decoding."""
EXPLORE_STEPS = 4
"""Most steps one exploration takes (until a drafting round reports its acceptance)."""
SPEC_RESUME_MARGIN = 1.25
"""Start (or resume) speculating only above this: the draft first catches up on its backlog."""
LONG_EXPLORE_WAIT = 32
"""After ``explore_every`` x this many k = 0 steps in a row a tier explores whatever the draft's
backlog and a perfect draft's predicted rate (both gates read figures only drafting refreshes);
each such exploration doubles the wait, up to 8x this, until speculation resumes."""
EXPLORE_BUDGET = 0.02
"""An exploration first catches the drafts up (fed only while drafting, at one stream they start
each request a prompt behind): it runs once that catch-up, priced per token as measured, is at
most this share of the plain decoding since the last one. Gated at 8 tokens, drafting that stopped
once never came back (large); ungated, medium (whose draft never pays) fell to 0.88x."""
CATCH_UP = (0, 0)  # SpecController.catch_up_ratio's one key
PROFILE_TRUST = 1.5
"""A warm-up's plain step this far off (either way) from its first measurement in service marks
the whole profile suspect (``SpecController.recheck``)."""
ROW_PRIOR_TOKENS = 4
"""A row's own acceptance is its drafts' record shrunk toward the engine's average by this many
pseudo-drafts (``SpecController.row_acceptance``): a new row drafts at the average, one whose
first four drafts all fail drops to a fifth of it."""


@dataclass(slots=True)
class SpecController:
    """Chooses k per step to maximise expected tokens per second, k = 0 included.

    Expected tokens from one round with acceptance rate a: ``(1 - a**(k+1)) / (1 - a)``.
    Its cost: k draft forwards plus one target forward over k+1 tokens, at this batch size.
    Costs are moving averages of measured step times keyed by (batch size, tokens); acceptance
    is a moving average of accepted/drafted. A k + 1-token step and a draft forward are priced
    as ratios to the plain step at the same batch size, each ratio taken when it was measured:
    the plain step is measured on every plain step, so its cost follows the contexts as they
    grow, while a k not in use keeps its last (or warm-up, 32-token context) figure - which, as
    an absolute time, made speculation look cheaper the longer it stayed off. Because the choice
    compares against k = 0 with costs measured on this machine, speculation switches itself off
    where it would not pay (large batches on a CPU, where a step is compute-bound and k+1 tokens
    cost k+1 times one).
    """

    max_k: int
    acceptance: float = 0.8
    ema: float = 0.1
    explore_every: int = 64
    """After this many k = 0 steps, try the best k > 0 once to refresh the acceptance estimate."""
    target_cost: dict[tuple[int, int], float] = field(default_factory=dict)
    draft_cost: dict[tuple[int, int], float] = field(default_factory=dict)
    target_ratio: dict[tuple[int, int], float] = field(default_factory=dict)
    """(batch, tokens > 1) -> its cost over the plain step's (batch, 1) at the time."""
    draft_ratio: dict[tuple[int, int], float] = field(default_factory=dict)
    """(batch, 1) -> a draft forward's cost over the target's plain step at the time."""
    steps_without_spec: int = 0
    exploring: int = 0
    """Steps an exploration may still take before a drafting round reports its acceptance: its
    first step often only catches the idle draft up (no row drafts yet), and an exploration that
    ended there measured nothing, so plain decoding locked itself in."""
    fixed_k: int | None = None
    """Pin k (benchmarks and tests); None lets the cost model choose."""
    long_wait: int = LONG_EXPLORE_WAIT
    """Plain steps (in units of ``explore_every``) before the next exploration that ignores the
    backlog and the ceiling (``LONG_EXPLORE_WAIT``)."""
    catch_up_ratio: dict[tuple[int, int], float] = field(default_factory=dict)
    """``CATCH_UP`` -> seconds a model draft takes per backlog token it reads, over the one-row
    plain step at the time (``record_catch_up``); none: behind more than 8 tokens, no exploration."""
    recheck: bool = False
    """A seeded plain step was over ``PROFILE_TRUST`` x off its first measurement: the profile was
    taken on a busy machine, so the next k = 0 choice explores at once, whatever the gates."""
    provisional: set[tuple[str, tuple[int, int]]] = field(default_factory=set)
    """(table, key) figures the warm-up seeded (``seeded``): the first measurement in service
    replaces each (averaged, a busy warm-up's figure outlived the exploration that measured it)."""

    @staticmethod
    def _interp(points: list[tuple[int, float]], x: int, proportional: bool = True) -> float:
        """Piecewise-linear through ``points`` (sorted by x), extrapolated from the end segments;
        from a single point, in proportion to x (a time) or flat (``proportional=False``: a ratio)."""
        if len(points) == 1:
            x0, y0 = points[0]
            return y0 * x / x0 if x0 and proportional else y0
        if x <= points[0][0]:
            (x0, y0), (x1, y1) = points[0], points[1]
        elif x >= points[-1][0]:
            (x0, y0), (x1, y1) = points[-2], points[-1]
        else:
            (x0, y0), (x1, y1) = next((a, b) for a, b in itertools.pairwise(points) if a[0] <= x <= b[0])
        y = y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y0
        return max(y, 1e-9)

    def _cost(
        self, table: dict[tuple[int, int], float], batch: int, tokens: int, ratio: bool = False
    ) -> float | None:
        """Seconds of a forward over ``batch`` rows x ``tokens`` each, from measured points:
        interpolated in tokens at each measured batch size, then across batch sizes, so every
        batch size gets an estimate once any two are measured (none is left 'unprofiled').
        ``ratio``: the table holds ratios to the plain step, which a single measured batch size
        carries to the others unchanged (a time would scale with the rows)."""
        if (batch, tokens) in table:
            return table[(batch, tokens)]
        batches = sorted({b for b, _ in table})
        if not batches:
            return None
        per_batch = []
        for b in batches:
            pts = sorted((t, c) for (bb, t), c in table.items() if bb == b)
            per_batch.append((b, self._interp(pts, tokens)))
        return self._interp(per_batch, batch, proportional=not ratio)

    def _plain(self, batch_size: int) -> float | None:
        plain = {key: c for key, c in self.target_cost.items() if key[1] == 1}
        return self._cost(plain, batch_size, 1)

    def _target(self, batch_size: int, tokens: int) -> float | None:
        plain = self._plain(batch_size)
        if tokens == 1 or plain is None or not self.target_ratio:
            return plain if tokens == 1 else self._cost(self.target_cost, batch_size, tokens)
        ratios = {(b, 1): 1.0 for b, t in self.target_cost if t == 1} | self.target_ratio
        ratio = self._cost(ratios, batch_size, tokens, ratio=True)
        return None if ratio is None else plain * ratio

    def _draft(self, batch_size: int) -> float | None:
        plain = self._plain(batch_size)
        if plain is None or not self.draft_ratio:
            return self._cost(self.draft_cost, batch_size, 1)
        ratio = self._cost(self.draft_ratio, batch_size, 1, ratio=True)
        return None if ratio is None else plain * ratio

    def expected_rate(self, k: int, batch_size: int, acceptance: float | None = None) -> float | None:
        target = self._target(batch_size, k + 1)
        draft = self._draft(batch_size) if k else 0.0
        if target is None or draft is None:
            return None
        a = min(self.acceptance if acceptance is None else acceptance, 0.999)
        tokens = (1.0 - a ** (k + 1)) / (1.0 - a)
        return tokens / (target + k * draft)

    def best_round(self, batch_size: int) -> tuple[float, float] | None:
        """A decode step at ``batch_size`` rows with the k that maximises the expected rate (no
        exploration, no side effects): ``(seconds, expected tokens per row)``. ``None`` until the
        plain step at some batch size has been measured. What load-aware routing prices a
        sequence on this engine by (``tiers.core.sched.pacing.completion_seconds``)."""
        a = min(self.acceptance, 0.999)
        ks = [min(self.fixed_k, self.max_k)] if self.fixed_k is not None else range(self.max_k + 1)
        rounds: dict[int, tuple[float, float]] = {}
        for k in ks:
            target = self._target(batch_size, k + 1)
            draft = self._draft(batch_size) if k else 0.0
            if target is not None and draft is not None:
                rounds[k] = (target + k * draft, (1.0 - a ** (k + 1)) / (1.0 - a))
        if not rounds:
            return None
        best = max(rounds, key=lambda k: rounds[k][1] / rounds[k][0])
        # As choose_k: drafting only on a clear predicted win, so the round priced is the one run.
        if (
            best
            and 0 in rounds
            and rounds[best][1] / rounds[best][0] < SPEC_MARGIN * rounds[0][1] / rounds[0][0]
        ):
            best = 0
        return rounds[best]

    def row_acceptance(self, drafted: int, accepted: int) -> float:
        """A row's acceptance from its own drafts so far, shrunk toward the engine's average.

        Why per row: an n-gram lookup's acceptance is a property of the text (a row that repeats
        its prompt accepts most drafts, free prose almost none); the engine's average mixes the
        rows, so at batch 1 each request inherited the one before it - a repetitive request
        after a prose one never drafted, a prose one after a repetitive one drafted at a loss."""
        return (accepted + ROW_PRIOR_TOKENS * self.acceptance) / (drafted + ROW_PRIOR_TOKENS)

    def row_k(self, batch_size: int, k: int, acceptance: float) -> int:
        """The most one row accepted at ``acceptance`` should draft of the step's ``k`` when rows
        draft independently (n-gram lookups: some rows find a match, others do not).

        Each accepted token saves the row one later step, and what that saves the device is the
        row's share of a step: ``plain(B) - plain(B - 1)`` (the rest of the batch runs that step
        anyway), the whole plain step at batch 1. Its j drafted tokens add to this step what B
        rows feeding j + 1 tokens add over the plain step, per row. The j of the largest net
        saving, where the saving beats the cost by ``SPEC_MARGIN``; 0 where none does. Measured
        without it (small, n-gram, batch 4, acceptance 0.72): 0.90x plain, as the rate of a
        uniform round counted every row's gain for one row's drafts."""
        if k <= 0 or self.fixed_k is not None:
            return k
        plain = self._plain(batch_size)
        draft = self._draft(batch_size)
        if plain is None or draft is None:
            return k
        step_saved = plain if batch_size <= 1 else plain - (self._plain(batch_size - 1) or plain)
        a = min(acceptance, 0.999)
        best, best_net = 0, 0.0
        for j in range(1, k + 1):
            target = self._target(batch_size, j + 1)
            if target is None:
                return k
            cost = (target - plain) / batch_size + j * draft / batch_size
            saved = a * (1.0 - a**j) / (1.0 - a) * step_saved
            if saved >= SPEC_MARGIN * cost and saved - cost > best_net:
                best, best_net = j, saved - cost
        return best

    def choose_k(
        self,
        batch_size: int,
        draft_lag: int = 1,
        acceptance: float | None = None,
        draft_backlog: int | None = None,
    ) -> int:
        """``draft_lag``: most tokens any row's draft must catch up on before drafting;
        ``acceptance``: price the rounds at this instead of the engine's average (the best row's,
        for proposers that price each row: ``row_k``); ``draft_backlog``: the tokens all rows'
        drafts must read first (default ``draft_lag``), which an exploration pays."""
        if self.max_k <= 0:
            return 0
        if self.fixed_k is not None:
            return min(self.fixed_k, self.max_k)
        rates = {k: self.expected_rate(k, batch_size, acceptance) for k in range(self.max_k + 1)}
        if any(r is None for r in rates.values()):
            return self.max_k  # not profiled yet: measure by doing
        best = max(rates, key=lambda k: rates[k] or 0.0)
        # Speculate only on a clear predicted win: step costs are noisy, and a draft that has been
        # idle must first re-read its backlog, which the per-step model does not see.
        margin = SPEC_MARGIN if draft_lag <= 2 else SPEC_RESUME_MARGIN
        if best and (rates[best] or 0.0) < margin * (rates[0] or 0.0):
            best = 0
        if best == 0 and self.exploring:
            self.exploring -= 1
            return max(range(1, self.max_k + 1), key=lambda k: rates[k] or 0.0)
        if best == 0:
            self.steps_without_spec += 1
            # Explore (to refresh the acceptance estimate) only where speculation could win with a
            # perfect draft, and not while the draft would first re-read a long backlog.
            ceiling = max(
                self.expected_rate(k, batch_size, acceptance=0.999) or 0.0 for k in range(1, self.max_k + 1)
            )
            backlog = draft_lag if draft_backlog is None else draft_backlog
            short = ceiling > (rates[0] or 0.0) and self.steps_without_spec >= self.explore_every
            short = short and self._catch_up_pays(backlog, batch_size)  # priced only when due
            long = self.steps_without_spec >= self.explore_every * self.long_wait
            if self.recheck or short or long:
                if not (short or self.recheck):
                    self.long_wait = min(2 * self.long_wait, 8 * LONG_EXPLORE_WAIT)
                self.recheck = False
                self.steps_without_spec = 0
                self.exploring = EXPLORE_STEPS - 1
                return max(range(1, self.max_k + 1), key=lambda k: rates[k] or 0.0)
        else:
            self.steps_without_spec = 0
            self.long_wait = LONG_EXPLORE_WAIT
            self.recheck = False  # drafting measures its figures itself
        return best

    def _catch_up_pays(self, backlog: int, batch_size: int) -> bool:
        """An exploration's catch-up of ``backlog`` tokens is within ``EXPLORE_BUDGET`` of the plain
        steps run since the last one (unpriced: only a backlog of 8 tokens or less)."""
        ratio, one, plain = self.catch_up_ratio.get(CATCH_UP), self._plain(1), self._plain(batch_size)
        if ratio is None or one is None or plain is None:
            return backlog <= 8
        return ratio * one * backlog <= EXPLORE_BUDGET * self.steps_without_spec * plain

    def record_catch_up(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and (plain := self._plain(1)):
            self._record("catch_up_ratio", CATCH_UP, seconds / tokens / plain)

    def seeded(self) -> None:
        """The warm-up's figures are in: each stands only until its key is first measured in
        service (``provisional``)."""
        self.provisional = {
            (name, key)
            for name in ("target_cost", "draft_cost", "target_ratio", "draft_ratio", "catch_up_ratio")
            for key in getattr(self, name)
        }

    def record_target(self, batch_size: int, tokens: int, seconds: float) -> None:
        self._record("target_cost", (batch_size, tokens), seconds)
        plain = self.target_cost.get((batch_size, 1))
        if tokens > 1 and plain:
            self._record("target_ratio", (batch_size, tokens), seconds / plain)

    def record_draft(self, batch_size: int, tokens: int, seconds: float) -> None:
        self._record("draft_cost", (batch_size, tokens), seconds)
        plain = self.target_cost.get((batch_size, 1))
        if plain:
            self._record("draft_ratio", (batch_size, tokens), seconds / plain)

    def record_acceptance(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.acceptance += self.ema * (accepted / drafted - self.acceptance)
            self.exploring = 0

    def _record(self, name: str, key: tuple[int, int], seconds: float) -> None:
        table: dict[tuple[int, int], float] = getattr(self, name)
        old = table.get(key)
        if old is None or (name, key) in self.provisional:
            if old is not None and name == "target_cost" and key[1] == 1:
                self.recheck |= not old / PROFILE_TRUST <= seconds <= old * PROFILE_TRUST
            self.provisional.discard((name, key))
            table[key] = seconds
        else:
            table[key] = old + self.ema * (seconds - old)
