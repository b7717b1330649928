"""``tiers.core.sequence``: ``SamplingParams`` validation at each bound and one past it (falsy values
that are legal kept), its documented defaults and derived flags, and a ``Sequence``'s progress
properties at the boundaries of prefill, decode and its output budget.

Compared against the ranges the docstrings state (OpenAI's and vLLM's meanings) and against counts
worked by hand.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from tiers.core.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

NAN, INF = math.nan, math.inf

LEGAL: list[tuple[str, Any]] = [
    ("max_tokens", 1),
    ("temperature", 0.0),
    ("temperature", 2.0),
    ("top_p", 1.0),
    ("top_p", 1e-9),
    ("top_k", 0),
    ("top_k", 1),
    ("presence_penalty", -2.0),
    ("presence_penalty", 2.0),
    ("frequency_penalty", -2.0),
    ("frequency_penalty", 2.0),
    ("repetition_penalty", 10.0),
    ("repetition_penalty", 1e-9),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("min_tokens", 0),
    ("logprobs", 0),
    ("logprobs", 20),
    ("logprobs", None),
    ("prompt_logprobs", 0),
    ("prompt_logprobs", 20),
    ("prompt_logprobs", None),
    ("logit_bias", ((3, -100.0), (4, 100.0))),
    ("logit_bias", ()),
]

ILLEGAL: list[tuple[str, Any]] = [
    ("max_tokens", 0),
    ("max_tokens", 1.5),
    ("temperature", -0.01),
    ("temperature", 2.01),
    ("temperature", NAN),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", NAN),
    ("top_k", -1),
    ("top_k", 1.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", 2.01),
    ("presence_penalty", NAN),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", INF),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 10.01),
    ("repetition_penalty", INF),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", NAN),
    ("min_tokens", -1),
    ("min_tokens", 1.5),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 1.5),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", 2.5),
    ("logit_bias", ((3, 100.01),)),
    ("logit_bias", ((3, -100.01),)),
    ("logit_bias", ((3, 0.0), (4, NAN))),
]


@pytest.mark.parametrize(("name", "value"), LEGAL, ids=[f"{n}={v!r}" for n, v in LEGAL])
def test_each_bound_is_accepted_and_kept(name: str, value: Any) -> None:
    """Bug it catches: ``<`` for ``<=`` (or ``>`` for ``>=``) at a closed end of a range, or a legal
    falsy value (temperature 0.0, top_k 0, logprobs 0) replaced - it is accepted and kept as given."""
    params = SamplingParams(**{name: value})
    assert getattr(params, name) == value
    assert type(getattr(params, name)) is type(value)


@pytest.mark.parametrize(("name", "value"), ILLEGAL, ids=[f"{n}={v!r}" for n, v in ILLEGAL])
def test_one_past_each_bound_is_refused_naming_the_field(name: str, value: Any) -> None:
    """Bug it catches: ``<=`` for ``<`` at an open end (top_p 0, repetition_penalty 0), a range
    widened by a changed constant, the integer or finite check dropped, or a check left out of the
    loop - the value is refused, and the message names the field and the value."""
    with pytest.raises(ValueError, match=rf"^{name} .*, got ") as info:
        SamplingParams(**{name: value})
    assert repr(value) in str(info.value)


def test_min_tokens_is_bounded_by_max_tokens() -> None:
    """Bug it catches: ``min_tokens < max_tokens`` for ``<=`` or the bound read from another field -
    min_tokens may equal max_tokens (load tools fix the length so), not exceed it."""
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, max_tokens\], got 6"):
        SamplingParams(max_tokens=5, min_tokens=6)


def test_refusal_message_wording() -> None:
    """Bug it catches: a changed reason string - the 400 a client sees names the rule it broke."""
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 0\.0$"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match=r"^max_tokens must be an integer >= 1, got 0$"):
        SamplingParams(max_tokens=0)


def test_documented_defaults() -> None:
    """Bug it catches: a changed default - OpenAI's neutral settings (temperature 1, top_p 1, no
    penalties, no top_k/min_p/bias) and the documented max_tokens of 256."""
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (256, 1.0, 1.0, 0, None)
    assert (p.stop, p.stop_token_ids, p.logit_bias) == ((), (), ())
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.ignore_eos, p.min_tokens, p.include_stop_str_in_output, p.min_p) == (False, 0, False, 0.0)
    assert (p.logprobs, p.prompt_logprobs, p.constraint) == (None, None, None)


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.0, "top_k": 5}, True),
        ({"top_k": 2}, False),
        ({"temperature": 0.01}, False),
        ({}, False),
    ],
)
def test_is_greedy(kwargs: dict[str, Any], greedy: bool) -> None:
    """Bug it catches: ``or`` made ``and``, or ``top_k == 1`` off by one - temperature 0 or top_k 1
    each make sampling an argmax."""
    assert SamplingParams(**kwargs).is_greedy is greedy


@pytest.mark.parametrize(
    ("kwargs", "penalised"),
    [
        ({}, False),
        ({"presence_penalty": 0.5}, True),
        ({"presence_penalty": -0.5}, True),
        ({"frequency_penalty": 0.1}, True),
        ({"repetition_penalty": 1.1}, True),
        ({"repetition_penalty": 0.9}, True),
        ({"repetition_penalty": 1.0, "presence_penalty": 0.0}, False),
    ],
)
def test_has_penalties(kwargs: dict[str, Any], penalised: bool) -> None:
    """Bug it catches: one penalty left out of ``has_penalties``, ``or`` made ``and``, or the neutral
    repetition penalty taken as 0 - any non-neutral penalty turns the penalty pass on."""
    assert SamplingParams(**kwargs).has_penalties is penalised


# -- SequenceStatus / FinishReason ---------------------------------------------------------------------


def test_terminal_statuses() -> None:
    """Bug it catches: ``>`` for ``>=`` in ``is_finished`` or the order changed - a stopped request is
    finished, waiting and running ones are not."""
    finished = {s for s in SequenceStatus if s.is_finished}
    assert finished == {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_ERROR,
    }


def test_finish_reason_strings_are_openais() -> None:
    """Bug it catches: a changed finish-reason string - callers see these words on the wire."""
    assert (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT, FinishReason.ERROR) == (
        "stop",
        "length",
        "abort",
        "error",
    )


# -- Sequence ------------------------------------------------------------------------------------------


def test_an_empty_prompt_is_refused() -> None:
    """Bug it catches: the empty-prompt check dropped or inverted."""
    with pytest.raises(ValueError, match="must not be empty"):
        Sequence([], SamplingParams())
    assert Sequence([0], SamplingParams()).num_prompt_tokens == 1  # token 0 is a token


def test_token_ids_start_as_a_copy_of_the_prompt() -> None:
    """Bug it catches: ``token_ids = prompt_token_ids`` (copy dropped) - appending output would grow
    the prompt."""
    seq = Sequence([5, 6, 7], SamplingParams())
    seq.token_ids.append(8)
    assert seq.prompt_token_ids == [5, 6, 7]
    assert (seq.num_prompt_tokens, seq.num_tokens, seq.num_output_tokens) == (3, 4, 1)
    assert seq.output_token_ids == [8]


def test_both_block_tables_take_the_cache_salt() -> None:
    """Bug it catches: the salt set on one table only, or not at all - blocks would be named in
    another tenant's partition."""
    seq = Sequence([1], SamplingParams(), cache_salt="tenant-a")
    assert seq.block_table.salt == "tenant-a"
    assert seq.draft_table.salt == "tenant-a"
    assert seq.block_table is not Sequence([1], SamplingParams()).block_table


def test_ids_are_unique_and_increasing() -> None:
    """Bug it catches: a shared or repeated id default - two sequences never share an id."""
    a, b = Sequence([1], SamplingParams()), Sequence([1], SamplingParams())
    assert b.seq_id > a.seq_id


def test_new_sequence_state() -> None:
    """Bug it catches: a changed default - a new sequence waits, with nothing computed, no finish and
    an arrival time taken now."""
    before = time.monotonic()
    seq = Sequence([1, 2], SamplingParams())
    after = time.monotonic()
    assert seq.status == SequenceStatus.WAITING and not seq.is_finished
    assert (seq.num_computed_tokens, seq.num_cached_tokens, seq.num_preemptions) == (0, 0, 0)
    assert (seq.finish_reason, seq.error, seq.finish_time, seq.first_token_time) == (None, None, None, None)
    assert before <= seq.arrival_time <= after
    assert seq.fork_of is None and seq.abort_requested is False


def test_is_prefilling_until_the_whole_prompt_is_computed() -> None:
    """Bug it catches: ``<=`` for ``<`` - with 3 of 4 prompt tokens computed it is prefilling, with 4
    it is not."""
    seq = Sequence([1, 2, 3, 4], SamplingParams())
    seq.num_computed_tokens = 3
    assert seq.is_prefilling
    seq.num_computed_tokens = 4
    assert not seq.is_prefilling


def test_is_decoding_exactly_one_token_behind() -> None:
    """Bug it catches: ``>= 1`` or ``== 0`` for ``== 1`` - decoding when exactly the last token is not
    in the cache; two behind (chunked prefill) or none behind is not."""
    seq = Sequence([1, 2, 3], SamplingParams())
    seq.token_ids.append(9)
    for computed, decoding in ((2, False), (3, True), (4, False)):
        seq.num_computed_tokens = computed
        assert seq.is_decoding is decoding, computed


def test_prompt_logprobs_pending_until_the_first_output() -> None:
    """Bug it catches: ``if params.prompt_logprobs`` (0 is falsy and still asks), ``and`` made ``or``,
    or the output check dropped - pending while nothing is out, not after."""
    asked = Sequence([1, 2], SamplingParams(prompt_logprobs=0))
    assert asked.prompt_logprobs_pending
    asked.token_ids.append(3)
    assert not asked.prompt_logprobs_pending
    assert not Sequence([1, 2], SamplingParams()).prompt_logprobs_pending


def test_remaining_tokens_count_down_to_zero() -> None:
    """Bug it catches: the remaining budget counted from ``num_tokens`` (prompt included) or off by one."""
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=2))
    assert seq.num_remaining_tokens == 2
    seq.token_ids.append(4)
    assert seq.num_remaining_tokens == 1
    seq.token_ids.append(5)
    assert seq.num_remaining_tokens == 0


def test_finish_records_status_reason_and_time() -> None:
    """Bug it catches: one of ``finish``'s three assignments dropped."""
    seq = Sequence([1], SamplingParams())
    before = time.monotonic()
    seq.finish(SequenceStatus.FINISHED_LENGTH, FinishReason.LENGTH)
    assert seq.status == SequenceStatus.FINISHED_LENGTH and seq.is_finished
    assert seq.finish_reason == "length"
    assert seq.finish_time is not None and seq.finish_time >= before
