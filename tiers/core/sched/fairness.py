"""Fair sharing of batch slots between callers (``Sequence.caller``: tenant or key), torch-free.

Batch slots go first to the caller with the fewest running sequences, each caller's own requests
in arrival order, and when the batch is full a caller below its share (``max_num_seqs`` / busy
callers) preempts the newest sequence of the caller furthest over it. One caller's flood therefore
never holds a lighter caller's request longer than a step or two, and the flood's own queue keeps
its order (its waits stay predictable). The scheduler applies these choices; the wait prediction
(``pacing.queue_backlog``) reads them.

Slots are not the whole story on a device where each row costs compute (a CPU: a step of 16 rows
costs several times a step of 2), so ``TurnBudget`` also shares device *time*, across every
engine on the device: while a caller below its share of the device's slots has work, callers over
it get the turns that keep the light caller's steps within ``slowdown`` of what they would take
without them (deficit round robin on measured turn times). On a GPU, where extra rows are nearly
free, held-back turns are cheap and the heavy callers lose little.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiers.core.sequence import Sequence

__all__ = [
    "TurnBudget",
    "fair_share",
    "fairness_victims",
    "has_protected_prefill",
    "light_and_heavy",
    "next_waiting",
    "protected_callers",
]


def fair_share(max_num_seqs: int, num_callers: int) -> int:
    """Batch slots each of ``num_callers`` busy callers is entitled to."""
    return max(1, max_num_seqs // max(1, num_callers))


def protected_callers(seqs: Iterable[Sequence], max_num_seqs: int) -> set[str]:
    """Callers below their fair share while another caller is busy too (``seqs``: the running and
    waiting sequences): their prompts go before anyone else's."""
    held = Counter(s.caller for s in seqs if not s.is_finished)
    if len(held) < 2:
        return set()
    share = fair_share(max_num_seqs, len(held))
    return {c for c, n in held.items() if n < share}


def has_protected_prefill(seqs: list[Sequence], max_num_seqs: int) -> bool:
    """A protected caller's prompt is not yet computed (waiting or running)."""
    callers = protected_callers(seqs, max_num_seqs)
    return bool(callers) and any(
        s.caller in callers and not s.is_decoding and not s.is_finished for s in seqs
    )


def next_waiting(
    waiting: Iterable[Sequence],
    running: Counter[str],
    only: set[str] | None = None,
    passed: set[int] | None = None,
) -> Sequence | None:
    """Fair queuing between callers: the waiting sequence of the caller with the fewest running
    sequences goes next; within one caller, queue order (its preempted sequences, then its
    arrivals). A caller's own requests therefore never overtake each other, so the wait admission
    predicted for one is not stretched by the same caller's later arrivals. ``only``: among these
    callers' (``None`` when none of theirs waits); ``passed``: sequence ids not to pick (branches
    waiting for their first branch's prompt)."""
    best: Sequence | None = None
    for seq in waiting:
        if (only is not None and seq.caller not in only) or (passed and seq.seq_id in passed):
            continue
        if best is None or running[seq.caller] < running[best.caller]:
            best = seq
    return best


def fairness_victims(
    running: list[Sequence], waiting: Iterable[Sequence], max_num_seqs: int
) -> list[Sequence]:
    """The running sequences to preempt so that callers below their fair share, waiting while the
    batch is full, get slots: each time the newest sequence of the caller furthest over its share
    (it has done the least work; its full blocks stay named in the prefix cache, so its recompute
    is mostly cache hits). Without this a flooding caller keeps every slot and a light caller
    waits for the flood's answers to finish (vLLM's priority preemption, with the caller's share
    as the priority)."""
    waiting = list(waiting)
    if len(running) < max_num_seqs or not waiting:
        return []
    held = list(running)
    per_caller = Counter(s.caller for s in held)
    queued = Counter(s.caller for s in waiting if not s.is_finished)
    share = fair_share(max_num_seqs, len(per_caller.keys() | queued.keys()))
    victims: list[Sequence] = []
    for caller in list(queued):
        while queued[caller] and per_caller[caller] < share:
            victim_caller, count = per_caller.most_common(1)[0]
            if count <= share:
                return victims
            victim = next(s for s in reversed(held) if s.caller == victim_caller)
            held.remove(victim)
            victims.append(victim)
            per_caller[victim_caller] -= 1
            per_caller[caller] += 1  # the slot it frees is this caller's (``next_waiting``)
            queued[caller] -= 1
    return victims


def light_and_heavy(held: Counter[str], slots: int) -> tuple[set[str], set[str]]:
    """Callers below and above an equal split of ``slots`` (the device's batch slots, every engine
    together) by the sequences each ``held`` (running or waiting); both empty for one caller."""
    callers = [c for c, n in held.items() if n > 0]
    if len(callers) < 2:
        return set(), set()
    share = slots / len(callers)
    return {c for c in callers if held[c] < share}, {c for c in callers if held[c] > share}


@dataclass(slots=True)
class TurnBudget:
    """Which callers sit out the device's next turn (``DeviceWorker``), so that callers below
    their share keep their pace beside callers over it.

    While both kinds have work, every turn earns the heavy callers ``(slowdown - 1)`` x the
    duration of a turn without them (measured on held-back turns: ``light_turn_s``, a moving
    average), and a turn that lets them in spends what it took beyond that; they are let in
    while the credit is not negative. Over time the light callers' turns therefore last at most
    ``slowdown`` times as long as without the heavy ones, and the heavy ones still get that
    share of the device, in full batches. ``slowdown`` None: no holding back."""

    slowdown: float | None = 1.25
    credit: float = 0.0
    light_turn_s: float | None = None
    held_back: frozenset[str] = frozenset()
    contended: bool = False

    def plan(self, held: Counter[str], slots: int) -> frozenset[str]:
        """The callers to hold back this turn, from what each caller holds on the device now."""
        light, heavy = light_and_heavy(held, slots) if self.slowdown is not None else (set(), set())
        self.contended = bool(light and heavy)
        if not self.contended:
            # No credit is banked while nobody needs protecting, but a debt stays: a light caller
            # between two requests (a closed-loop client) must not hand the heavy callers a free
            # turn each time it comes back.
            self.credit = min(self.credit, 0.0)
            self.held_back = frozenset()
        else:
            self.held_back = frozenset(heavy) if self.credit < 0 else frozenset()
        return self.held_back

    def record(self, seconds: float, did_work: bool) -> None:
        """The turn just planned took ``seconds``; ``did_work``: some engine ran a step."""
        if not self.contended or self.slowdown is None:
            return
        if self.held_back:
            if not did_work:  # the light callers had nothing runnable: no reason to wait
                self.credit = 0.0
                return
            ema = self.light_turn_s
            self.light_turn_s = seconds if ema is None else ema + 0.2 * (seconds - ema)
            self.credit += (self.slowdown - 1.0) * seconds
        else:  # the light callers' part of this turn earns credit too; the rest spends it
            light = self.light_turn_s or 0.0
            self.credit += (self.slowdown - 1.0) * light - max(0.0, seconds - light)
