"""The scheduler's writer side without a model: ``update_from_output`` (computed counts, drafts
accepted, the grammar, delivery) and ``append_tokens`` (every stop condition, the computed counts
clipped to the kept tokens, blocks named), each against counts worked out by hand."""

from __future__ import annotations

from typing import Any

from tiers.core.block_manager import BlockManager
from tiers.core.sched.batch import ModelOutput, RowOutput, ScheduledBatch, SchedulerConfig
from tiers.core.sched.scheduler import Scheduler
from tiers.core.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

BS = 4


def make(**cfg: int) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(32, BS), BlockManager(32, BS))


class Grammar:
    """A matcher that accepts the ids in ``allowed`` and reports terminated once told to."""

    def __init__(self, allowed: set[int], terminated: bool = False) -> None:
        self.allowed = allowed
        self.terminated = terminated
        self.accepted: list[int] = []

    def fill_mask(self, mask: Any) -> None:
        for t in self.allowed:
            mask[t] = True

    def accept(self, token_id: int) -> bool:
        if token_id not in self.allowed:
            return False
        self.accepted.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    @property
    def is_terminated(self) -> bool:
        return self.terminated


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, int, Any]] = []

    def on_accept(self, seq: Sequence, num_accepted: int) -> None:
        self.events.append(("accept", seq.seq_id, num_accepted))

    def deliver(self, seq: Sequence, tokens: list[int], logprobs: list[Any] | None) -> None:
        self.events.append(("deliver", seq.seq_id, (list(tokens), logprobs)))

    def fail(self, seq: Sequence, message: str) -> None:
        self.events.append(("fail", seq.seq_id, message))


def running(sched: Scheduler, prompt: list[int], params: SamplingParams | None = None, **kw: Any) -> Sequence:
    """A sequence in the batch, its prompt computed but for the last token, blocks allocated."""
    s = Sequence(prompt, params or SamplingParams(max_tokens=64), **kw)
    s.status = SequenceStatus.RUNNING
    sched.running.append(s)
    assert sched.blocks.allocate(s.block_table, len(prompt) + 8)
    assert sched.draft_blocks is not None and sched.draft_blocks.allocate(s.draft_table, len(prompt) + 8)
    s.num_computed_tokens = len(prompt) - 1
    s.num_draft_computed_tokens = len(prompt) - 1
    return s


# -- update_from_output ------------------------------------------------------------------------


def test_update_applies_each_rows_counts_drafts_and_delivers_its_tokens() -> None:
    """A prompt chunk that chose nothing advances by its fed tokens and names the blocks it filled;
    a plain decode advances by one; a drafting row's target KV holds the fed token plus the m
    accepted drafts, its draft KV no more than that, and the totals count drafting rows only.
    Catches computed counts taken from the wrong row or drafts, totals mixed up, a chunk's blocks
    left unnamed (no prefix hit for the next request), delivery of another row's tokens."""
    sched = make()
    chunk = running(sched, list(range(1, 11)))
    chunk.num_computed_tokens = 0
    chunk.num_draft_computed_tokens = 0
    plain = running(sched, [20, 21, 22])
    spec = running(sched, [30, 31, 32, 33, 34])
    spec.num_draft_computed_tokens = 4
    half = running(sched, [40, 41, 42])
    batch = ScheduledBatch([chunk, plain, spec, half], [8, 1, 1, 1], [0, 0, 3, 2], [8, 0, 1, 0])
    lp = ["lp-a", "lp-b"]
    out = ModelOutput(
        rows=[
            None,
            RowOutput([7]),
            RowOutput([100, 101, 102], num_drafted=3, num_accepted=2),
            RowOutput([200, 201], num_drafted=2, num_accepted=1, logprobs=lp),
        ],
        draft_fed=[8, 0, 4, 1],
    )
    sink = Sink()
    assert sched.update_from_output(batch, out, sink) == (5, 3)
    assert chunk.num_computed_tokens == 8 and chunk.num_draft_computed_tokens == 8
    assert len(sched.blocks.match_prefix(list(range(1, 11)))) == 2  # the chunk's 2 full blocks named
    assert plain.num_computed_tokens == 3 and plain.num_draft_computed_tokens == 2
    # base = 5 tokens: the fed last token and 2 accepted drafts are computed; the draft was fed 4
    # of them (4 + 4 = 8), clipped to what the target keeps.
    assert spec.num_computed_tokens == 7 and spec.num_draft_computed_tokens == 7
    assert (spec.num_draft_tokens, spec.num_accepted_tokens) == (3, 2)
    assert half.num_computed_tokens == 4 and half.num_draft_computed_tokens == 3
    assert (half.num_draft_tokens, half.num_accepted_tokens) == (2, 1)
    assert (plain.num_draft_tokens, plain.num_accepted_tokens) == (0, 0)
    assert sink.events == [
        ("deliver", plain.seq_id, ([7], None)),
        ("deliver", spec.seq_id, ([100, 101, 102], None)),
        ("deliver", half.seq_id, ([200, 201], lp)),
    ]
    assert plain.token_ids == [20, 21, 22]  # delivery appends, not update_from_output


def test_update_runs_the_grammar_over_each_rows_outcome() -> None:
    """Constrained rows: the drafter hears the accepted count first; drafts that completed the
    grammar drop the target's bonus token; a sampled token the grammar refuses fails the row (no
    delivery) unless it ends the sequence; an accepted one is delivered. Catches the bonus token
    kept after a complete grammar, a refusal delivered, an EOS failed, the drafter not told."""
    sched = make()
    done = running(sched, [1, 2, 3], SamplingParams(constraint=Grammar({5}, terminated=True)))
    bad = running(sched, [4, 5, 6], SamplingParams(constraint=Grammar({9})), eos_token_ids=frozenset({0}))
    eos = running(sched, [7, 8, 9], SamplingParams(constraint=Grammar({9})), eos_token_ids=frozenset({0}))
    good_grammar = Grammar({9, 11})
    good = running(sched, [10, 11, 12], SamplingParams(constraint=good_grammar))
    plain_done = running(sched, [13, 14, 15], SamplingParams(constraint=Grammar({3}, terminated=True)))
    batch = ScheduledBatch([done, bad, eos, good, plain_done], [1] * 5, [2, 0, 0, 1, 0], [0] * 5)
    out = ModelOutput(
        rows=[
            RowOutput([5, 5, 6], num_drafted=2, num_accepted=2),
            RowOutput([3]),
            RowOutput([0]),
            RowOutput([11, 9], num_drafted=1, num_accepted=1),
            RowOutput([3]),
        ],
        draft_fed=[0] * 5,
    )
    sink = Sink()
    assert sched.update_from_output(batch, out, sink) == (3, 3)
    assert sink.events == [
        ("accept", done.seq_id, 2),
        ("deliver", done.seq_id, ([5, 5], None)),
        ("accept", bad.seq_id, 0),
        ("fail", bad.seq_id, "the grammar rejected a sampled token"),
        ("accept", eos.seq_id, 0),
        ("deliver", eos.seq_id, ([0], None)),
        ("accept", good.seq_id, 1),
        ("deliver", good.seq_id, ([11, 9], None)),
        ("accept", plain_done.seq_id, 0),
        ("deliver", plain_done.seq_id, ([3], None)),
    ]
    assert good_grammar.accepted == [9]  # the target's own token went through the matcher


# -- append_tokens ----------------------------------------------------------------------------


def test_append_stops_at_eos_unless_ignored_and_at_stop_ids_always() -> None:
    sched = make()
    s = running(sched, [1, 2, 3], eos_token_ids=frozenset({9}))
    assert sched.append_tokens(s, [4, 9, 5]) == (2, (SequenceStatus.FINISHED_STOPPED, FinishReason.STOP))
    assert s.token_ids == [1, 2, 3, 4, 9]
    s = running(
        sched, [1, 2, 3], SamplingParams(ignore_eos=True, stop_token_ids=(6,)), eos_token_ids=frozenset({9})
    )
    assert sched.append_tokens(s, [9, 4]) == (2, None)
    assert sched.append_tokens(s, [6, 7]) == (1, (SequenceStatus.FINISHED_STOPPED, FinishReason.STOP))
    assert s.token_ids == [1, 2, 3, 9, 4, 6]


def test_append_stops_where_the_detokenizer_sees_a_stop_string() -> None:
    sched = make()
    s = running(sched, [1, 2, 3])
    seen: list[int] = []

    def text_stop(tok: int) -> bool:
        seen.append(tok)
        return tok == 8

    assert sched.append_tokens(s, [4, 8, 5], text_stop) == (
        2,
        (SequenceStatus.FINISHED_STOPPED, FinishReason.STOP),
    )
    assert seen == [4, 8] and s.token_ids[-2:] == [4, 8]


def test_append_ends_a_complete_grammar_after_the_last_token_only() -> None:
    """A grammar that is complete ends the sequence once every delivered token is in (the engine
    advanced the matcher over all of them), not at the first."""
    sched = make()
    s = running(sched, [1, 2, 3], SamplingParams(constraint=Grammar({4}, terminated=True)))
    assert sched.append_tokens(s, [4, 5, 6]) == (3, (SequenceStatus.FINISHED_STOPPED, FinishReason.STOP))
    s = running(sched, [1, 2, 3], SamplingParams(constraint=Grammar({4}, terminated=False)))
    assert sched.append_tokens(s, [4, 5, 6]) == (3, None)


def test_append_stops_at_max_tokens_and_at_the_context_exactly() -> None:
    """max_tokens counts output tokens only (the prompt does not use them up); the context counts
    prompt and output; each binds at exactly its value, not one past."""
    sched = make(max_model_len=12)
    s = running(sched, [1, 2, 3], SamplingParams(max_tokens=4))
    assert sched.append_tokens(s, [5, 6, 7]) == (3, None)
    assert sched.append_tokens(s, [8, 9, 10]) == (1, (SequenceStatus.FINISHED_LENGTH, FinishReason.LENGTH))
    assert s.num_output_tokens == 4
    s = running(sched, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=64))
    assert sched.append_tokens(s, [11]) == (1, None)
    assert sched.append_tokens(s, [12, 13]) == (1, (SequenceStatus.FINISHED_LENGTH, FinishReason.LENGTH))
    assert s.num_tokens == 12


def test_append_clips_computed_counts_to_the_kept_tokens_and_names_blocks() -> None:
    """KV computed past the kept tokens (drafts the stop cut off) is not counted; the blocks the
    kept tokens filled are named for later prefix hits, on the target and the draft pools."""
    sched = make()
    s = running(sched, [1, 2, 3, 4, 5, 6], eos_token_ids=frozenset({0}))
    s.num_computed_tokens = 10  # as if 4 drafts were verified
    s.num_draft_computed_tokens = 9
    assert sched.append_tokens(s, [7, 0, 8, 9]) == (2, (SequenceStatus.FINISHED_STOPPED, FinishReason.STOP))
    assert s.num_tokens == 8
    assert s.num_computed_tokens == 7 and s.num_draft_computed_tokens == 7
    assert len(sched.blocks.match_prefix([1, 2, 3, 4, 5, 6, 7, 0])) == 1
    assert (
        sched.draft_blocks is not None and len(sched.draft_blocks.match_prefix([1, 2, 3, 4, 5, 6, 7, 0])) == 1
    )
    s = running(sched, [1, 2, 3])
    s.num_computed_tokens, s.num_draft_computed_tokens = 2, 1
    sched.append_tokens(s, [4])
    assert (s.num_computed_tokens, s.num_draft_computed_tokens) == (2, 1)  # not raised by the clip


def test_snapshot_restore_and_kv_tokens() -> None:
    """A failed step is undone from its snapshot (counts and tokens); the KV in use is counted in
    whole blocks of the target's pool."""
    sched = make()
    s = running(sched, [1, 2, 3])
    assert sched.num_kv_tokens() == 3 * BS  # room for 11 tokens: 3 blocks of 4
    snap = Scheduler.snapshot([s])
    assert snap == [(2, 2, 3)]
    s.num_computed_tokens, s.num_draft_computed_tokens = 5, 4
    sched.append_tokens(s, [4, 5, 6])
    Scheduler.restore(s, snap[0])
    assert (s.num_computed_tokens, s.num_draft_computed_tokens, s.token_ids) == (2, 2, [1, 2, 3])
