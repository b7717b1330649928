"""The torch-free scheduler: which sequences run this step, and with how many tokens.

KV memory is a fixed pool of *slots*, one per running sequence, each ``max_model_len`` tokens long
(see ``model_runner.py`` for why). Slots are kept dense - running sequences own slots
``0..n-1`` - so a decode batch usually reads the cache through a view instead of a gather; when a
sequence leaves, the last slot's owner moves into the hole and the scheduler reports that move for
the runner to copy.

A step is either a *prefill* step (prompt chunks, bounded by ``max_num_batched_tokens`` padded
tokens) or a *decode* step (every sequence whose prompt is done, one token each plus speculative
tokens). Mixing both in one ``[batch, tokens]`` forward would pad every decode row to the chunk
length; alternating the two instead bounds a running decode's stall to one chunk, which is what
chunked prefill is for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from tiers.sequence import Sequence, SequenceStatus

__all__ = ["ScheduledBatch", "Scheduler", "SchedulerConfig", "SlotMove", "SlotTable"]

SlotMove = tuple[int, int, Sequence]
"""``(src, dst, moved sequence)``: copy the sequence's KV from slot src to dst."""


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    """Concurrent sequences (= KV slots)."""
    max_num_batched_tokens: int = 512
    """Padded tokens one prefill step may feed (batch rows x longest chunk)."""
    max_model_len: int = 2048
    """Prompt plus output tokens a sequence may hold (= slot length)."""
    max_waiting: int = 64
    """Sequences allowed to wait for a slot; the engine refuses more."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")


class SlotTable:
    """Dense slot allocation: owners of slots ``0..num_used-1`` are the running sequences."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.owners: list[Sequence] = []

    @property
    def num_used(self) -> int:
        return len(self.owners)

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self.owners)

    def allocate(self, seq: Sequence) -> bool:
        if not self.num_free:
            return False
        seq.slot = len(self.owners)
        self.owners.append(seq)
        return True

    def free(self, seq: Sequence) -> SlotMove | None:
        """Release ``seq``'s slot; returns the move when the last slot's owner moved into it."""
        slot = seq.slot
        assert slot is not None
        assert self.owners[slot] is seq
        seq.slot = None
        last = self.owners.pop()
        if last is seq:
            return None
        self.owners[slot] = last
        src = last.slot
        last.slot = slot
        assert src is not None
        return src, slot, last


@dataclass(slots=True)
class ScheduledBatch:
    kind: Literal["prefill", "decode"]
    seqs: list[Sequence]
    num_new_tokens: list[int]
    """Tokens fed per sequence this step, speculative tokens not included."""
    admitted: list[Sequence] = field(default_factory=list)
    """Sequences that got a slot this step."""

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, on_admit: Callable[[Sequence], None] | None = None) -> None:
        """``on_admit`` runs when a sequence gets its slot, before its first chunk is sized: the
        engine loads prefix-cache hits there (advancing ``num_computed_tokens``)."""
        self.config = config
        self.on_admit = on_admit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.slots = SlotTable(config.max_num_seqs)
        self._pending_moves: list[SlotMove] = []
        self._last_kind: str = "decode"

    # -- intake ---------------------------------------------------------------------------------
    def can_accept(self) -> bool:
        return len(self.waiting) < self.config.max_waiting + self.slots.num_free

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def num_kv_tokens(self) -> int:
        return sum(s.num_computed_tokens for s in self.running)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's batch; ``None`` when there is nothing to run."""
        admitted = self._admit()
        decoding = [s for s in self.running if not s.is_prefilling]
        prefilling = [s for s in self.running if s.is_prefilling]
        # Alternate when both kinds wait, so neither starves the other.
        if prefilling and (not decoding or self._last_kind == "decode"):
            batch = self._prefill_batch(prefilling)
        elif decoding:
            batch = ScheduledBatch(
                "decode", decoding, [s.num_tokens - s.num_computed_tokens for s in decoding]
            )
        else:
            batch = None
        if batch is None:
            return None
        self._last_kind = batch.kind
        batch.admitted = admitted
        return batch

    def _admit(self) -> list[Sequence]:
        admitted = []
        while self.waiting and self.slots.num_free:
            seq = self.waiting.popleft()
            if seq.is_finished:  # aborted while waiting
                continue
            self.slots.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            if self.on_admit is not None:
                self.on_admit(seq)
        return admitted

    def _prefill_batch(self, prefilling: list[Sequence]) -> ScheduledBatch:
        """FIFO chunks under the padded-token budget: rows x longest chunk <= max_num_batched_tokens.

        The first row always gets a chunk, so one long prompt progresses alone in budget-sized pieces.
        """
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        chunks: list[int] = []
        longest = 0
        for seq in prefilling:
            remaining = seq.num_tokens - seq.num_computed_tokens
            chunk = min(remaining, budget)
            new_longest = max(longest, chunk)
            if seqs and new_longest * (len(seqs) + 1) > budget:
                break
            seqs.append(seq)
            chunks.append(chunk)
            longest = new_longest
        return ScheduledBatch("prefill", seqs, chunks)

    # -- after the step -------------------------------------------------------------------------
    def finish(self, seq: Sequence, status: SequenceStatus, reason: str) -> None:
        """Mark ``seq`` finished wherever it is; a running sequence's slot is released at once
        (the resulting move is applied before the next forward)."""
        if not seq.is_finished:
            seq.finish(status, reason)
        if seq.slot is not None:
            move = self.slots.free(seq)
            if move is not None:
                self._pending_moves.append(move)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def take_pending_moves(self) -> list[SlotMove]:
        """KV copies owed since the last call, in order. Apply them before the next ``schedule()``:
        a new sequence may be admitted into a slot that is the source of a pending move."""
        moves, self._pending_moves = self._pending_moves, []
        return moves
