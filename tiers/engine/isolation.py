"""Failure isolation: a step that raises fails the request that caused it, not the batch.

The batch is undone for the rows it had not yet delivered (``Scheduler.restore``, and the
proposer's unsettled grammar steps), then each of them runs alone: an error inside one request's
generation fails that request only. Retrying is safe: a forward only writes KV at positions >=
``num_computed_tokens``, which nothing has read yet, and delivered tokens stand (a retry must
never emit them twice).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from tiers.core.sched.batch import ScheduledBatch
from tiers.core.sched.scheduler import Scheduler
from tiers.core.sequence import Sequence

if TYPE_CHECKING:
    from tiers.spec_decode.proposers import Proposer

__all__ = ["run_isolated"]

log = logging.getLogger(__name__)


def run_isolated(
    batch: ScheduledBatch,
    run: Callable[[ScheduledBatch], None],
    *,
    scheduler: Scheduler,
    proposer: Proposer | None,
    delivered: Callable[[], set[int]],
    fail: Callable[[Sequence, str], None],
    name: str,
) -> None:
    """``run(batch)``; if it raises, undo it and run each undelivered row alone. ``delivered()``:
    the rows of the latest run whose tokens were emitted."""

    def restore(rows: ScheduledBatch, snapshot: list[tuple[int, int, int]]) -> None:
        done = delivered()
        for seq, snap in zip(rows.seqs, snapshot, strict=True):
            if seq.seq_id in done:
                continue
            scheduler.restore(seq, snap)
            if proposer is not None:
                proposer.forget(seq)

    snapshot = scheduler.snapshot(batch.seqs)
    try:
        run(batch)
        return
    except Exception as exc:
        restore(batch, snapshot)
        if batch.num_seqs == 1:
            fail(batch.seqs[0], f"{type(exc).__name__}: {exc}")
            log.warning("engine %s: request failed: %s", name, traceback.format_exc(limit=3))
            return
    done = set(delivered())
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        if seq.is_finished or seq.seq_id in done:
            continue
        alone = ScheduledBatch([seq], [n], [0], [0], kind=batch.kind)
        try:
            run(alone)
        except Exception as exc:
            restore(alone, [snapshot[i]])
            log.warning("engine %s: request %d failed: %s", name, seq.seq_id, exc)
            fail(seq, f"{type(exc).__name__}: {exc}")
