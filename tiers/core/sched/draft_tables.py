"""The draft side of a speculative tier's blocks, as the scheduler grows and frees them.

Draft-side KV follows the target: a sequence's draft table is grown for the chunk the draft will
feed this step (a prompt chunk, or its catch-up and the k proposals of a decode that speculates),
and a sequence whose draft cannot get blocks simply does not speculate (drafting is an
optimisation; it never preempts anything). While speculation is off for a sequence its draft is
not fed and holds none of the lower tier's pool (that tier's own requests need it): its full
blocks keep their names and are found again, by a prefix match, when speculation resumes.

A mixin of ``Scheduler`` (the one writer of sequence state): these are its methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tiers.core.block_manager import BlockManager

if TYPE_CHECKING:
    from tiers.core.sched.batch import SchedulerConfig
    from tiers.core.sequence import Sequence

__all__ = ["DraftTables"]


class DraftTables:
    config: SchedulerConfig
    draft_blocks: BlockManager | None
    spec_budget: Callable[[Sequence], int] | None

    def _draft_row(self, seq: Sequence, n: int, k: int, follow_draft: bool) -> tuple[int, int]:
        """``(k, tokens the draft feeds)`` for a row feeding the target ``n`` tokens with ``k``
        speculative ones; ``k`` falls to 0 when the draft's blocks cannot be had."""
        if self.draft_blocks is not None and not k and not self._may_speculate(seq):
            # Speculation is off for this row: the draft is not fed (work for nothing while it
            # stays off) and holds none of the lower tier's pool.
            self._release_draft(seq)
            return 0, 0
        draft_n = self._draft_feed(seq, n, k) if follow_draft else 0
        if k and draft_n < 0:
            k, draft_n = 0, self._draft_feed(seq, n, 0)
        return k, max(0, draft_n)

    def _spec_wanted(self, seq: Sequence) -> int:
        if self.spec_budget is None or self.draft_blocks is None or not seq.is_decoding:
            return 0
        return self.spec_budget(seq)

    def _draft_feed(self, seq: Sequence, n: int, k: int) -> int:
        """Tokens the draft feeds this step: with ``k``, its whole backlog (then it proposes k);
        without, up to the target's chunk end, at most one step budget. -1 when its blocks
        cannot be had (the row then runs without drafting)."""
        if self.draft_blocks is None:
            return 0
        if not seq.draft_table.blocks and seq.num_draft_computed_tokens == 0:
            self._attach_draft_prefix(seq)  # released while speculation was off: find its blocks
        dc = seq.num_draft_computed_tokens
        if k:
            end = seq.num_tokens
        else:
            end = min(
                seq.num_computed_tokens + n, seq.num_tokens - 1, dc + self.config.max_num_batched_tokens
            )
        feed = max(0, end - dc)
        if feed == 0 and k == 0:
            return 0
        if not self.draft_blocks.allocate(seq.draft_table, dc + feed + max(0, k - 1)):
            return -1
        return feed

    def _may_speculate(self, seq: Sequence) -> bool:
        """The engine speculates this step and ``seq`` may draft (no ``spec_budget``: always)."""
        return self.spec_budget is None or self.spec_budget(seq) > 0

    def _release_draft(self, seq: Sequence) -> None:
        assert self.draft_blocks is not None
        if seq.draft_table.blocks:
            self.draft_blocks.free(seq.draft_table, seq.token_ids, seq.num_draft_computed_tokens)
        seq.num_draft_computed_tokens = 0

    def _attach_draft_prefix(self, seq: Sequence) -> None:
        """A prefix-cache hit in the draft's pool skips the draft's prefill of those tokens too."""
        if self.draft_blocks is None or seq.draft_table.blocks:
            return
        hit = self.draft_blocks.match_prefix(seq.token_ids, seq.cache_salt, max_tokens=seq.num_tokens - 1)
        if hit and self.draft_blocks.allocate(seq.draft_table, len(hit) * self.draft_blocks.block_size, hit):
            seq.num_draft_computed_tokens = len(hit) * self.draft_blocks.block_size
