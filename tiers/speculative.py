"""Speculative decoding: the acceptance rule and the adaptive choice of k.

The draft model proposes k tokens; the target scores all k+1 positions in one forward. The rule
below keeps the output distribution exactly the target's (Leviathan et al. 2023, Chen et al. 2023);
for greedy requests both distributions are one-hot, so it reduces to "accept while the target's
argmax agrees".
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from tiers.sampling import sample_rows

__all__ = ["SpecController", "accept_draft"]


def accept_draft(
    draft_tokens: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> list[int]:
    """Return the tokens to append: the accepted prefix of ``draft_tokens`` plus one more.

    draft_probs:  [k, V]   p_i, the distribution draft token i was drawn from
    target_probs: [k+1, V] q_i, the target's distribution at the same positions (+ the bonus one)
    """
    out: list[int] = []
    for i, x in enumerate(draft_tokens):
        q, p = float(target_probs[i, x]), float(draft_probs[i, x])
        # q >= p: always accept; otherwise accept with probability q/p.
        u = float(torch.rand((), generator=generator))
        if p > 0.0 and u * p <= q and q > 0.0:
            out.append(x)
            continue
        # Rejected: draw from the residual norm(max(0, q - p)), which restores the target's law.
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0.0 else target_probs[i]
        out.append(int(sample_rows(dist[None], generator)[0]))
        return out
    # Every draft accepted: the target's distribution after them gives a free extra token.
    out.append(int(sample_rows(target_probs[len(draft_tokens)][None], generator)[0]))
    return out


SPEC_MARGIN = 1.1
"""Keep speculating only while the model predicts at least this much more throughput than plain decoding."""
SPEC_RESUME_MARGIN = 1.25
"""Start (or resume) speculating only above this: the draft first catches up on its backlog."""


def _bucket(batch_size: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, batch_size))))


@dataclass(slots=True)
class SpecController:
    """Chooses k per step to maximise expected tokens per second, k = 0 included.

    Expected tokens from one round with acceptance rate a: ``(1 - a**(k+1)) / (1 - a)``.
    Its cost: k draft forwards plus one target forward over k+1 tokens, at this batch size.
    Costs are moving averages of measured step times keyed by (batch bucket, tokens); acceptance
    is a moving average of accepted/drafted. Because the choice compares against k = 0 with costs
    measured on this machine, speculation switches itself off where it would not pay (large
    batches on a CPU, where a step is compute-bound and k+1 tokens cost k+1 times one).
    """

    max_k: int
    acceptance: float = 0.8
    ema: float = 0.1
    explore_every: int = 64
    """After this many k = 0 steps, try the best k > 0 once to refresh the acceptance estimate."""
    target_cost: dict[tuple[int, int], float] = field(default_factory=dict)
    draft_cost: dict[tuple[int, int], float] = field(default_factory=dict)
    steps_without_spec: int = 0
    fixed_k: int | None = None
    """Pin k (benchmarks and tests); None lets the cost model choose."""

    def _cost(self, table: dict[tuple[int, int], float], bucket: int, tokens: int) -> float | None:
        if (bucket, tokens) in table:
            return table[(bucket, tokens)]
        # Interpolate linearly in tokens between measured points at this bucket.
        known = sorted((t, c) for (b, t), c in table.items() if b == bucket)
        if not known:
            return None
        if tokens <= known[0][0]:
            return known[0][1]
        for (t0, c0), (t1, c1) in itertools.pairwise(known):
            if t0 <= tokens <= t1:
                return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)
        (t0, c0), (t1, c1) = (known[-2], known[-1]) if len(known) > 1 else (known[0], known[0])
        slope = (c1 - c0) / (t1 - t0) if t1 != t0 else c0 / max(t0, 1)
        return c1 + slope * (tokens - t1)

    def expected_rate(self, k: int, batch_size: int, acceptance: float | None = None) -> float | None:
        b = _bucket(batch_size)
        target = self._cost(self.target_cost, b, k + 1)
        draft = self._cost(self.draft_cost, b, 1) if k else 0.0
        if target is None or draft is None:
            return None
        a = min(self.acceptance if acceptance is None else acceptance, 0.999)
        tokens = (1.0 - a ** (k + 1)) / (1.0 - a)
        return tokens / (target + k * draft)

    def choose_k(self, batch_size: int, draft_lag: int = 1) -> int:
        """``draft_lag``: most tokens any row's draft must catch up on before drafting."""
        if self.max_k <= 0:
            return 0
        if self.fixed_k is not None:
            return min(self.fixed_k, self.max_k)
        rates = {k: self.expected_rate(k, batch_size) for k in range(self.max_k + 1)}
        if any(r is None for r in rates.values()):
            return self.max_k  # not profiled yet: measure by doing
        best = max(rates, key=lambda k: rates[k] or 0.0)
        # Speculate only on a clear predicted win: step costs are noisy, and a draft that has been
        # idle must first re-read its backlog, which the per-step model does not see.
        margin = SPEC_MARGIN if draft_lag <= 2 else SPEC_RESUME_MARGIN
        if best and (rates[best] or 0.0) < margin * (rates[0] or 0.0):
            best = 0
        if best == 0:
            self.steps_without_spec += 1
            # Explore (to refresh the acceptance estimate) only where speculation could win with a
            # perfect draft, and not while the draft would first re-read a long backlog.
            ceiling = max(
                self.expected_rate(k, batch_size, acceptance=0.999) or 0.0 for k in range(1, self.max_k + 1)
            )
            if (
                self.steps_without_spec >= self.explore_every
                and ceiling > (rates[0] or 0.0)
                and draft_lag <= 8
            ):
                self.steps_without_spec = 0
                return max(range(1, self.max_k + 1), key=lambda k: rates[k] or 0.0)
        else:
            self.steps_without_spec = 0
        return best

    def record_target(self, batch_size: int, tokens: int, seconds: float) -> None:
        self._record(self.target_cost, (_bucket(batch_size), tokens), seconds)

    def record_draft(self, batch_size: int, tokens: int, seconds: float) -> None:
        self._record(self.draft_cost, (_bucket(batch_size), tokens), seconds)

    def record_acceptance(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.acceptance += self.ema * (accepted / drafted - self.acceptance)

    def _record(self, table: dict[tuple[int, int], float], key: tuple[int, int], seconds: float) -> None:
        old = table.get(key)
        table[key] = seconds if old is None else old + self.ema * (seconds - old)
