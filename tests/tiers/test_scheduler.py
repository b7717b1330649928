"""The scheduler alone: requests from tiny factories, assertions on its output, no model."""

from __future__ import annotations

import pytest

from tiers.scheduler import Scheduler, SchedulerConfig, SlotTable
from tiers.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus


def seq(n_prompt: int = 4, max_tokens: int = 8) -> Sequence:
    return Sequence(list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def run_prefill(sched: Scheduler, batch_seqs: list[Sequence], chunks: list[int]) -> None:
    """What the engine does after a prefill step: advance, and sample a token where the prompt completed."""
    for s, n in zip(batch_seqs, chunks, strict=True):
        s.num_computed_tokens += n
        if not s.is_prefilling:
            s.token_ids.append(0)


def run_decode(batch_seqs: list[Sequence]) -> None:
    for s in batch_seqs:
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(0)


def test_admits_up_to_max_num_seqs_and_queues_the_rest() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_waiting=4))
    seqs = [seq() for _ in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch is not None and batch.kind == "prefill"
    assert batch.seqs == seqs[:2]
    assert [s.slot for s in seqs[:2]] == [0, 1]
    assert sched.num_waiting == 1 and seqs[2].status == SequenceStatus.WAITING


def test_long_prompt_is_chunked_under_the_token_budget() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16))
    long = seq(n_prompt=40)
    sched.add(long)
    chunks = []
    while long.is_prefilling:
        batch = sched.schedule()
        assert batch is not None and batch.kind == "prefill"
        chunks.append(batch.num_new_tokens[0])
        run_prefill(sched, batch.seqs, batch.num_new_tokens)
    assert chunks == [16, 16, 8]


def test_padded_prefill_budget_limits_rows() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32))
    for n in (10, 10, 10, 10):
        sched.add(seq(n_prompt=n))
    batch = sched.schedule()
    assert batch is not None
    # 3 rows x 10 padded tokens fit in 32; a 4th would need 40.
    assert batch.num_seqs == 3


def test_prefill_and_decode_alternate_so_decodes_never_stall() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8))
    first = seq(n_prompt=4)
    sched.add(first)
    batch = sched.schedule()
    assert batch is not None
    run_prefill(sched, batch.seqs, batch.num_new_tokens)
    sched.add(seq(n_prompt=30))  # a long prompt arrives while `first` decodes
    kinds = []
    for _ in range(6):
        batch = sched.schedule()
        assert batch is not None
        kinds.append(batch.kind)
        if batch.kind == "prefill":
            run_prefill(sched, batch.seqs, batch.num_new_tokens)
        else:
            assert first in batch.seqs
            run_decode(batch.seqs)
    assert kinds == ["decode", "prefill", "decode", "prefill", "decode", "prefill"]


def test_decode_batch_feeds_one_token_per_sequence() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    seqs = [seq(n_prompt=3), seq(n_prompt=5)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch is not None
    run_prefill(sched, batch.seqs, batch.num_new_tokens)
    batch = sched.schedule()
    assert batch is not None and batch.kind == "decode"
    assert batch.num_new_tokens == [1, 1]


def test_finish_frees_the_slot_at_once_and_keeps_slots_dense() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64))
    a, b, c = seq(), seq(), seq()
    for s in (a, b, c):
        sched.add(s)
    sched.schedule()
    assert (a.slot, b.slot, c.slot) == (0, 1, 2)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED, FinishReason.ABORT)
    assert a.slot is None and a.is_finished
    assert c.slot == 0 and b.slot == 1  # the last owner moved into the hole
    assert sched.slots.num_free == 1
    assert sched.take_pending_moves() == [(2, 0, c)]
    assert sched.take_pending_moves() == []
    d = seq()
    sched.add(d)
    batch = sched.schedule()
    assert batch is not None
    assert d.slot == 2 and d in batch.admitted


def test_abort_while_waiting_removes_it() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=1))
    a, b = seq(), seq()
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(b, SequenceStatus.FINISHED_ABORTED, FinishReason.ABORT)
    assert sched.num_waiting == 0 and b.finish_reason == "abort"


def test_can_accept_is_bounded_by_free_slots_plus_queue() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_waiting=1))
    accepted = 0
    while sched.can_accept():
        sched.add(seq())
        accepted += 1
    assert accepted == 3


def test_nothing_to_do_returns_none() -> None:
    assert Scheduler(SchedulerConfig()).schedule() is None


@pytest.mark.parametrize("n", [1, 3, 8])
def test_slot_table_allocate_free_roundtrip(n: int) -> None:
    table = SlotTable(n)
    seqs = [seq() for _ in range(n)]
    assert all(table.allocate(s) for s in seqs)
    assert not table.allocate(seq())
    for s in reversed(seqs):
        table.free(s)
    assert table.num_free == n


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


def test_sampling_params_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
