"""``tiers.engine.postprocess``: what a step hands each request (text, token ids, finish reason,
counts, logprobs, prompt logprobs, timings) and how finished requests leave the engine.

Under test: ``Postprocessor`` over a real ``Scheduler`` (its ``append_tokens`` checks the stops) and a
real ``IncrementalDetokenizer``, with a byte-level stand-in tokenizer whose pieces are known, so
every expected text is worked out by hand from the pieces (or from the tokenizer's own ``decode``).
The pace, proposer, observer and handle are recorders: what reaches them is compared with what
each call should have passed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tiers.core.block_manager import BlockManager
from tiers.core.output import IncrementalDetokenizer, StepOutput, TokenLogprob
from tiers.core.sched.batch import SchedulerConfig
from tiers.core.sched.scheduler import Scheduler
from tiers.core.sequence import SamplingParams, Sequence, SequenceStatus
from tiers.engine.postprocess import Postprocessor, timings
from tiers.engine.request import Tracked

EOS = 0
VOCAB: dict[int, bytes] = {
    EOS: b"<eos>",  # special: decodes to nothing with skip_special_tokens
    1: b"Hel",
    2: b"lo",
    3: b" wor",
    4: b"ld",
    5: b"E",
    6: b"N",
    7: b"D",
    8: b"!",
    9: b"\xc3",  # the first byte of "\u00e9" ...
    10: b"\xa9",  # ... and its last
    11: b"EN",
    12: b"D!",
}
SPECIAL = {EOS}


class ByteTokenizer:
    """Concatenates the pieces' bytes; an incomplete UTF-8 tail decodes to U+FFFD (as BPE tokenizers do)."""

    def decode(
        self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = True
    ) -> str:
        data = b"".join(VOCAB[i] for i in ids if not (skip_special_tokens and i in SPECIAL))
        return data.decode("utf-8", errors="replace")


TOKENIZER = ByteTokenizer()


def text_of(ids: list[int]) -> str:
    """The reference: the tokenizer's own decode of the ids, as a caller would read them."""
    return TOKENIZER.decode(ids, skip_special_tokens=True)


class RecordingPace:
    def __init__(self) -> None:
        self.observed: list[tuple[float, float, bool]] = []
        self.finished: list[int] = []

    def observe(self, predicted: float, actual: float, unprotected: bool) -> None:
        self.observed.append((predicted, actual, unprotected))

    def on_finish(self, output_tokens: int) -> None:
        self.finished.append(output_tokens)


class RecordingProposer:
    def __init__(self) -> None:
        self.forgotten: list[Sequence] = []

    def forget(self, seq: Sequence) -> None:
        self.forgotten.append(seq)


class RecordingObserver:
    def __init__(self) -> None:
        self.finished: list[tuple[str, Sequence, str | None]] = []

    def on_finish(self, tier: str, seq: Sequence) -> None:
        self.finished.append((tier, seq, seq.finish_reason))


class RecordingHandle:
    def __init__(self) -> None:
        self.outputs: list[StepOutput] = []

    def _push_threadsafe(self, out: StepOutput) -> None:
        self.outputs.append(out)


@dataclass
class Rig:
    post: Postprocessor
    scheduler: Scheduler
    pace: RecordingPace
    proposer: RecordingProposer
    observer: RecordingObserver
    handles: dict[int, RecordingHandle] = field(default_factory=dict)

    def track(
        self,
        prompt: tuple[int, ...] = (1, 2),
        *,
        predicted: tuple[float, bool] | None = None,
        include_stop: bool = False,
        **params: Any,
    ) -> Tracked:
        p = SamplingParams(**params)
        seq = Sequence(list(prompt), p, eos_token_ids=frozenset({EOS}))
        seq.status = SequenceStatus.RUNNING
        self.scheduler.running.append(seq)
        handle = RecordingHandle()
        detok = IncrementalDetokenizer(TOKENIZER, p.stop, include_stop, p.min_tokens)
        tracked = Tracked(seq, handle, detok, None, predicted_wait=predicted)  # type: ignore[arg-type]
        self.post.tracked[seq.seq_id] = tracked
        self.handles[seq.seq_id] = handle
        return tracked

    def outputs(self, tracked: Tracked) -> list[StepOutput]:
        return self.handles[tracked.seq.seq_id].outputs


def rig(max_model_len: int = 64, *, name: str = "tierA") -> Rig:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=max_model_len),
        BlockManager(32, 4),
    )
    pace, proposer, observer = RecordingPace(), RecordingProposer(), RecordingObserver()
    post = Postprocessor(name, scheduler, pace, proposer, observer)  # type: ignore[arg-type]
    return Rig(post, scheduler, pace, proposer, observer)


def run(r: Rig, tracked: Tracked, steps: list[list[int]]) -> list[StepOutput]:
    for tokens in steps:
        r.post.deliver(tracked.seq, tokens)
    return r.outputs(tracked)


def joined(outs: list[StepOutput]) -> tuple[str, list[int]]:
    return "".join(o.text for o in outs), [t for o in outs for t in o.token_ids]


def lp(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -0.1 * token_id, [(token_id, -0.1 * token_id)])


# -- the last characters of the text, at every finish reason ----------------------------------------


def test_length_finish_releases_a_held_back_stop_prefix() -> None:
    """Bug it catches: ``take(final=finish_reason is None)`` (or ``final`` dropped) in ``emit`` - the
    answer loses its last characters: "EN" looks like the start of the stop string "END" and is held
    back while streaming, and must come out whole when ``max_tokens`` ends the request."""
    r = rig()
    t = r.track(max_tokens=5, stop=("END",))
    outs = run(r, t, [[1], [2], [3], [5], [6]])
    text, ids = joined(outs)
    assert text == text_of([1, 2, 3, 5, 6]) == "Hello worEN"
    assert ids == [1, 2, 3, 5, 6]
    assert outs[-1].finish_reason == "length"
    assert [o.finish_reason for o in outs[:-1]] == [None] * (len(outs) - 1)
    # while streaming, the possible stop prefix was never sent early
    assert "".join(o.text for o in outs[:-1]) == "Hello wor"


def test_eos_finish_releases_the_held_back_tail_and_keeps_the_eos_id() -> None:
    """Bug it catches: the final ``take`` not final, or ``new_tokens[:kept]`` off by one - at EOS the
    held-back "E" (a prefix of "END") is lost, or the EOS id is dropped from ``token_ids``."""
    r = rig()
    t = r.track(max_tokens=10, stop=("END",))
    outs = run(r, t, [[1, 2], [5], [EOS]])
    text, ids = joined(outs)
    assert text == text_of([1, 2, 5, EOS]) == "HelloE"
    assert ids == [1, 2, 5, EOS]
    assert outs[-1].finish_reason == "stop"
    assert t.seq.status == SequenceStatus.FINISHED_STOPPED


def test_stop_string_split_across_tokens_is_cut_and_never_streamed() -> None:
    """Bug it catches: the stop string's pieces streamed before it completes, or the text before it
    lost - "E", "N", "D" arrive one per step; the answer is what precedes "END", no more, no less."""
    r = rig()
    t = r.track(max_tokens=20, stop=("END",))
    outs = run(r, t, [[1], [2], [3], [5], [6], [7], [8]])
    text, ids = joined(outs)
    assert text == "Hello wor"
    assert ids == [1, 2, 3, 5, 6, 7]  # the token after the stop is never delivered
    assert outs[-1].finish_reason == "stop"
    assert not any(c in o.text for o in outs for c in "END")


def test_stop_string_kept_when_asked_includes_its_last_characters() -> None:
    """Bug it catches: the final delta cut short with ``include_stop_str_in_output`` - the text ends
    with the whole stop string "END" and nothing of the token that completed it beyond it ("!")."""
    r = rig()
    t = r.track(max_tokens=20, stop=("END",), include_stop=True)
    outs = run(r, t, [[1, 2], [11], [12]])
    assert joined(outs) == ("HelloEND", [1, 2, 11, 12])
    assert outs[-1].finish_reason == "stop"


def test_stop_token_id_finishes_and_its_text_is_left_out() -> None:
    """Bug it catches: the text before a stop token id lost, or the stop id missing from token_ids -
    as vLLM does, the stop token's own text ("!") is not in the answer, but its id is."""
    r = rig()
    t = r.track(max_tokens=20, stop_token_ids=(8,))
    outs = run(r, t, [[1, 2], [3, 4], [8]])
    assert joined(outs) == ("Hello wor" + "ld", [1, 2, 3, 4, 8])
    assert outs[-1].finish_reason == "stop"


def test_a_stop_token_ids_text_is_kept_with_include_stop_str_in_output() -> None:
    """Bug it catches: the stop token's text dropped although the caller asked for it - vLLM keeps
    a stop id's text when ``include_stop_str_in_output`` is set (its stop checker removes it only
    without the flag), and an EOS (special: no text) still adds nothing."""
    r = rig()
    t = r.track(max_tokens=20, stop_token_ids=(8,), include_stop=True, include_stop_str_in_output=True)
    outs = run(r, t, [[1, 2], [8]])
    assert joined(outs) == ("Hello!", [1, 2, 8])
    assert outs[-1].finish_reason == "stop"
    e = r.track(max_tokens=20, include_stop=True, include_stop_str_in_output=True)
    assert joined(run(r, e, [[1, 2], [EOS]])) == ("Hello", [1, 2, EOS])


def test_speculative_step_keeps_only_the_tokens_up_to_the_stop() -> None:
    """Bug it catches: ``pending_tokens.extend(new_tokens)`` (``[:kept]`` dropped or off by one) - a
    step of several tokens past a stop string hands back only those up to the one that completed it."""
    r = rig()
    t = r.track(max_tokens=20, stop=("END",), logprobs=0)
    r.post.deliver(t.seq, [3, 5, 6, 7, 8, 4], [lp(i) for i in (3, 5, 6, 7, 8, 4)])
    (out,) = r.outputs(t)
    assert out.token_ids == [3, 5, 6, 7]
    assert out.text == " wor"
    assert out.finish_reason == "stop"
    assert out.logprobs is not None
    assert [x.token_id for x in out.logprobs] == [3, 5, 6, 7]
    assert t.seq.output_token_ids == [3, 5, 6, 7]


def test_max_tokens_inside_a_speculative_step_keeps_exactly_max_tokens() -> None:
    """Bug it catches: off-by-one in the tokens kept at a length finish - 3 tokens allowed, 5 offered."""
    r = rig()
    t = r.track(max_tokens=3)
    r.post.deliver(t.seq, [1, 2, 3, 4, 8])
    (out,) = r.outputs(t)
    assert (out.text, out.token_ids, out.finish_reason) == ("Hello wor", [1, 2, 3], "length")
    assert out.num_output_tokens == 3


def test_incomplete_utf8_is_held_then_sent_with_its_token_ids() -> None:
    """Bug it catches: ``not text and not pending_tokens`` with ``or`` (or the early return widened) -
    a step whose token decodes to no text yet (half a UTF-8 character) still hands out its token id,
    and the character comes whole with the next step."""
    r = rig()
    t = r.track(max_tokens=3)
    outs = run(r, t, [[9], [10], [8]])
    assert [(o.text, o.token_ids) for o in outs] == [("", [9]), ("\u00e9", [10]), ("!", [8])]
    assert "".join(o.text for o in outs) == text_of([9, 10, 8])


def test_a_step_with_nothing_new_emits_nothing() -> None:
    """Bug it catches: the early return in ``emit`` dropped or its ``and`` made ``or`` - an empty
    delivery must not push an empty non-final output."""
    r = rig()
    t = r.track(max_tokens=3)
    r.post.deliver(t.seq, [])
    assert r.outputs(t) == []
    r.post.deliver(t.seq, [1])
    assert [(o.text, o.token_ids) for o in r.outputs(t)] == [("Hel", [1])]


def test_each_output_carries_only_its_own_new_tokens_and_logprobs() -> None:
    """Bug it catches: ``pending_tokens = []`` / ``pending_logprobs = []`` removed - every output would
    repeat the tokens of the ones before it."""
    r = rig()
    t = r.track(max_tokens=4, logprobs=2)
    r.post.deliver(t.seq, [1], [lp(1)])
    r.post.deliver(t.seq, [2, 3], [lp(2), lp(3)])
    r.post.deliver(t.seq, [4], [lp(4)])
    outs = r.outputs(t)
    assert [o.token_ids for o in outs] == [[1], [2, 3], [4]]
    assert [[x.token_id for x in o.logprobs or []] for o in outs] == [[1], [2, 3], [4]]
    assert [o.text for o in outs] == ["Hel", "lo wor", "ld"]


def test_logprobs_zero_is_kept_and_none_gives_none() -> None:
    """Bug it catches: ``if seq.params.logprobs`` for ``is not None`` - ``logprobs=0`` (the sampled
    token's logprob, no alternatives) is falsy and must still return logprobs; ``None`` returns none."""
    r = rig()
    zero = r.track(max_tokens=2, logprobs=0)
    r.post.deliver(zero.seq, [1], [lp(1)])
    assert r.outputs(zero)[0].logprobs == [lp(1)]
    none = r.track(max_tokens=2)
    r.post.deliver(none.seq, [1], [lp(1)])
    assert r.outputs(none)[0].logprobs is None


def test_output_counts_are_the_sequences_own() -> None:
    """Bug it catches: a count taken from the wrong field (cached/draft/accepted swapped, prompt for
    output) - each is set to a distinct value and read back from the output."""
    r = rig()
    t = r.track((1, 2, 3), max_tokens=10)
    t.seq.num_cached_tokens, t.seq.num_draft_tokens, t.seq.num_accepted_tokens = 2, 7, 5
    r.post.deliver(t.seq, [4, 5])
    (out,) = r.outputs(t)
    assert (out.num_prompt_tokens, out.num_output_tokens) == (3, 2)
    assert (out.num_cached_tokens, out.num_draft_tokens, out.num_accepted_tokens) == (2, 7, 5)
    assert out.error is None


# -- the first token: its time, and the wait calibration ------------------------------------------------


def test_first_token_calibrates_the_pace_with_the_actual_wait() -> None:
    """Bug it catches: ``observe`` not called, its arguments swapped, or the wait computed as
    ``arrival - first_token`` - the pace is told (predicted, first_token - arrival, unprotected) once."""
    r = rig()
    t = r.track(max_tokens=5, predicted=(0.5, True))
    t.seq.arrival_time = time.monotonic() - 5.0
    r.post.deliver(t.seq, [1])
    r.post.deliver(t.seq, [2])
    assert t.seq.first_token_time is not None
    assert r.pace.observed == [(0.5, t.seq.first_token_time - t.seq.arrival_time, True)]
    assert r.pace.observed[0][1] >= 5.0


def test_no_calibration_without_a_prediction() -> None:
    """Bug it catches: ``predicted_wait is not None and ...`` as ``or`` / ``is None`` - a request with
    no prediction (a fork of ``n > 1``) tells the pace nothing, but still gets its first-token time."""
    r = rig()
    t = r.track(max_tokens=5, predicted=None)
    r.post.deliver(t.seq, [1])
    assert r.pace.observed == []
    assert t.seq.first_token_time is not None


def test_no_calibration_after_a_preemption() -> None:
    """Bug it catches: ``not seq.num_preemptions`` with the ``not`` dropped - a request preempted
    before its first token waited for a reason the estimate could not see; one never preempted
    (``num_preemptions == 0``) is observed, one preempted once is not."""
    r = rig()
    kept = r.track(max_tokens=5, predicted=(1.0, False))
    preempted = r.track(max_tokens=5, predicted=(1.0, False))
    preempted.seq.num_preemptions = 1
    r.post.deliver(kept.seq, [1])
    r.post.deliver(preempted.seq, [1])
    assert len(r.pace.observed) == 1
    assert r.pace.observed[0][0] == 1.0 and r.pace.observed[0][2] is False


def test_first_token_time_is_set_once() -> None:
    """Bug it catches: ``if seq.first_token_time is not None`` - a later step would move the first
    token's time (and calibrate again)."""
    r = rig()
    t = r.track(max_tokens=5, predicted=(0.5, False))
    t.seq.first_token_time = 123.0
    r.post.deliver(t.seq, [1])
    assert t.seq.first_token_time == 123.0
    assert r.pace.observed == []


def test_delivered_rows_are_recorded() -> None:
    """Bug it catches: ``delivered.add`` removed or reached by untracked rows - the engine's
    step-failure recovery relies on it to know which rows already got their tokens."""
    r = rig()
    t = r.track(max_tokens=5)
    stranger = Sequence([1], SamplingParams())
    r.post.deliver(t.seq, [1])
    r.post.deliver(stranger, [1])
    assert r.post.delivered == {t.seq.seq_id}
    assert stranger.token_ids == [1]


def test_finished_or_untracked_rows_are_ignored() -> None:
    """Bug it catches: ``tracked is None or seq.is_finished`` as ``and`` (or the return dropped) - a
    row already finished (aborted mid-step) gets no tokens appended and no output."""
    r = rig()
    t = r.track(max_tokens=5)
    t.seq.finish(SequenceStatus.FINISHED_ABORTED, "abort")
    r.post.deliver(t.seq, [1, 2])
    assert t.seq.output_token_ids == []
    assert r.outputs(t) == []
    assert r.post.delivered == set()


# -- prompt logprobs ----------------------------------------------------------------------------------


def test_prompt_logprobs_gathered_by_position_and_sent_once() -> None:
    """Bug it catches: ``range(0, n)`` / ``range(1, n + 1)`` for the positions, ``update`` replaced,
    the dict reset per chunk, or the prompt logprobs repeated on later outputs - a prompt of 5 tokens
    gets ``[None, lp@1, lp@2 (recomputed), lp@3, None]`` on its first output only."""
    r = rig()
    t = r.track((1, 2, 3, 4, 5), max_tokens=5, prompt_logprobs=0)
    stranger = Sequence([1], SamplingParams())
    a, b, b2, c = lp(1), lp(2), lp(12), lp(3)
    r.post.record_prompt_logprobs({t.seq.seq_id: [(1, a), (2, b)], stranger.seq_id: [(1, a)]})
    r.post.record_prompt_logprobs({t.seq.seq_id: [(2, b2), (3, c)]})
    r.post.deliver(t.seq, [1])
    r.post.deliver(t.seq, [2])
    first, second = r.outputs(t)
    assert first.prompt_logprobs == [None, a, b2, c, None]
    assert first.prompt_token_ids == [1, 2, 3, 4, 5]
    assert second.prompt_logprobs is None and second.prompt_token_ids is None
    assert t.prompt_logprobs is None


def test_prompt_token_ids_are_a_copy() -> None:
    """Bug it catches: ``out.prompt_token_ids = seq.prompt_token_ids`` (``list()`` dropped) - a caller
    editing the output would edit the sequence's prompt."""
    r = rig()
    t = r.track((1, 2), max_tokens=5, prompt_logprobs=0)
    r.post.record_prompt_logprobs({t.seq.seq_id: [(1, lp(2))]})
    r.post.deliver(t.seq, [3])
    out = r.outputs(t)[0]
    assert out.prompt_token_ids == [1, 2]
    assert out.prompt_token_ids is not None
    out.prompt_token_ids.append(99)
    assert t.seq.prompt_token_ids == [1, 2]


def test_no_prompt_logprobs_when_none_recorded() -> None:
    """Bug it catches: ``if tracked.prompt_logprobs is not None`` flipped - a request that did not ask
    gets no prompt logprobs (and would crash on ``None.get``)."""
    r = rig()
    t = r.track(max_tokens=5)
    r.post.deliver(t.seq, [1])
    out = r.outputs(t)[0]
    assert out.prompt_logprobs is None and out.prompt_token_ids is None


# -- leaving the engine ---------------------------------------------------------------------------------


def test_finish_releases_the_request_everywhere() -> None:
    """Bug it catches: a step of ``finish`` removed (scheduler not told, proposer state kept, tracked
    entry left, observer not told) - a request finishing by length leaves the scheduler, the proposer
    and ``tracked``, and the observer hears of it under the engine's name."""
    r = rig(name="tierA")
    t = r.track(max_tokens=1)
    t.seq.first_scheduled_time = time.monotonic()
    r.post.deliver(t.seq, [1])
    assert t.seq not in r.scheduler.running
    assert t.seq.status == SequenceStatus.FINISHED_LENGTH and t.seq.finish_reason == "length"
    assert r.proposer.forgotten == [t.seq]
    assert t.seq.seq_id not in r.post.tracked
    assert r.observer.finished == [("tierA", t.seq, "length")]
    assert r.pace.finished == [1]


def test_finish_without_proposer_or_observer() -> None:
    """Bug it catches: ``if self.proposer is not None`` / ``if self.observer is not None`` flipped - an
    engine with neither still finishes requests (no AttributeError on None)."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8), BlockManager(8, 4))
    pace = RecordingPace()
    post = Postprocessor("t", scheduler, pace, None, None)  # type: ignore[arg-type]
    seq = Sequence([1], SamplingParams(max_tokens=1))
    handle = RecordingHandle()
    post.tracked[seq.seq_id] = Tracked(seq, handle, IncrementalDetokenizer(TOKENIZER), None)  # type: ignore[arg-type]
    post.deliver(seq, [2])
    assert [(o.text, o.finish_reason) for o in handle.outputs] == [("lo", "length")]
    assert seq.seq_id not in post.tracked


def test_output_length_learned_only_from_requests_that_ran() -> None:
    """Bug it catches: ``first_scheduled_time is not None or num_output_tokens`` as ``and`` / ``is
    None`` / the check dropped - an abort before scheduling says nothing of output length; one
    scheduled (at time 0.0, falsy) with no output counts 0; one with output counts it."""
    r = rig()
    never = r.track(max_tokens=5)
    scheduled = r.track(max_tokens=5)
    scheduled.seq.first_scheduled_time = 0.0
    produced = r.track(max_tokens=5)
    r.post.deliver(produced.seq, [1, 2])
    r.post.abort_all()
    assert sorted(r.pace.finished) == [0, 2]
    assert r.outputs(never)[-1].finish_reason == "abort"
    assert len(r.observer.finished) == 3


def test_fail_sends_the_error_as_the_final_output() -> None:
    """Bug it catches: ``error`` dropped on its way to ``emit`` or to ``seq.error``, or the wrong
    status/reason - a failed request ends with finish_reason "error" and the message, and its text so
    far (here a held-back stop prefix "EN") is not lost."""
    r = rig()
    t = r.track(max_tokens=10, stop=("END",))
    r.post.deliver(t.seq, [1, 11])
    r.post.fail(t.seq, "boom")
    outs = r.outputs(t)
    assert joined(outs) == ("HelEN", [1, 11])
    last = outs[-1]
    assert (last.finish_reason, last.error) == ("error", "boom")
    assert all(o.error is None for o in outs[:-1])
    assert t.seq.status == SequenceStatus.FINISHED_ERROR and t.seq.error == "boom"
    assert t.seq.seq_id not in r.post.tracked


def test_fail_of_an_untracked_sequence_is_a_no_op() -> None:
    """Bug it catches: ``if tracked is not None`` flipped in ``fail`` - failing a request the engine
    no longer holds (already finished) must not raise or finish it twice."""
    r = rig()
    t = r.track(max_tokens=1)
    r.post.deliver(t.seq, [1])
    r.post.fail(t.seq, "late")
    assert [o.finish_reason for o in r.outputs(t)] == ["length"]
    assert t.seq.error is None


def test_abort_all_finishes_every_request_with_abort() -> None:
    """Bug it catches: ``abort_all`` iterating the dict it empties (RuntimeError) or finishing with the
    wrong reason/status - both requests get one final "abort" output and the engine holds none."""
    r = rig()
    a, b = r.track(max_tokens=5), r.track(max_tokens=5)
    r.post.deliver(a.seq, [1])
    r.post.abort_all()
    assert [o.finish_reason for o in r.outputs(a)] == [None, "abort"]
    assert [o.finish_reason for o in r.outputs(b)] == ["abort"]
    assert r.outputs(b)[0].token_ids == [] and r.outputs(b)[0].text == ""
    assert r.post.tracked == {}
    assert a.seq.status == b.seq.status == SequenceStatus.FINISHED_ABORTED


def test_timings_only_on_the_final_output() -> None:
    """Bug it catches: ``if finish_reason is not None`` flipped or dropped before ``timings`` - only
    the final output carries the phases, with the sequence's own timestamps."""
    r = rig()
    t = r.track(max_tokens=2)
    t.seq.first_scheduled_time = t.seq.arrival_time + 1.0
    outs = run(r, t, [[1], [2]])
    assert outs[0].timings == {}
    seq = t.seq
    assert outs[1].timings == {
        "arrival": seq.arrival_time,
        "scheduled": seq.first_scheduled_time,
        "first_token": seq.first_token_time,
        "finish": seq.finish_time,
    }


def test_outbox_collects_outputs_instead_of_pushing() -> None:
    """Bug it catches: ``if self.outbox is not None`` flipped - during a step, outputs go to the
    outbox (one hand-off per step) with their handle, not straight to the handle."""
    r = rig()
    t = r.track(max_tokens=5)
    r.post.outbox = []
    r.post.deliver(t.seq, [1])
    assert r.outputs(t) == []
    assert [(h, o.text) for h, o in r.post.outbox] == [(t.handle, "Hel")]
    r.post.outbox = None
    r.post.deliver(t.seq, [2])
    assert [o.text for o in r.outputs(t)] == ["lo"]


# -- timings() ----------------------------------------------------------------------------------------


def test_timings_keep_only_the_phases_reached() -> None:
    """Bug it catches: ``if value is not None`` as ``if value`` (a 0.0 timestamp dropped), or a phase
    put under the wrong name - arrival always, the others only when set."""
    seq = Sequence([1], SamplingParams())
    seq.arrival_time = 5.0
    assert timings(seq) == {"arrival": 5.0}
    seq.first_scheduled_time = 0.0
    seq.finish_time = 9.0
    assert timings(seq) == {"arrival": 5.0, "scheduled": 0.0, "finish": 9.0}
    seq.first_token_time = 7.0
    assert timings(seq) == {"arrival": 5.0, "scheduled": 0.0, "first_token": 7.0, "finish": 9.0}
