"""``tiers.engine.intake``: what ``submit`` builds for each sequence of a request (fork, generator,
detokenizer settings, predicted wait, handle), and the counts the inbox keeps while requests wait
in it (prompt tokens once per request, per caller, drained one entry at a time).

Compared against hand-worked counts and against objects built directly (a ``torch.Generator``
seeded by hand, the prompt as given).
"""

from __future__ import annotations

import asyncio

import torch

from tiers.core.sequence import SamplingParams, Sequence
from tiers.engine.intake import Intake
from tiers.engine.request import Tracked


class FakeTokenizer:
    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class FakeEngine:
    def __init__(self) -> None:
        self.aborted: list[Sequence] = []

    def abort(self, seq: Sequence) -> None:
        self.aborted.append(seq)


def submit(
    intake: Intake,
    prompt: list[int],
    params: list[SamplingParams],
    *,
    caller: str = "alice",
    salt: str = "tenant",
    predicted: tuple[float, bool] = (0.25, True),
    eos: frozenset[int] = frozenset({7}),
) -> list[Tracked]:
    engine = FakeEngine()

    async def go() -> list[Tracked]:
        return intake.submit(engine, prompt, params, eos, salt, caller, predicted)

    return asyncio.run(go())


def test_each_params_entry_gets_its_own_sequence_forking_the_first() -> None:
    """Bug it catches: ``fork_of = items[-1].seq`` (or ``None`` always, or the first forking itself) -
    with n = 3 the first sequence forks nothing and the second and third both fork the first."""
    intake = Intake(FakeTokenizer())
    items = submit(intake, [1, 2, 3], [SamplingParams(max_tokens=i + 1) for i in range(3)])
    assert len(items) == 3
    first = items[0].seq
    assert first.fork_of is None
    assert items[1].seq.fork_of is first
    assert items[2].seq.fork_of is first
    assert [t.seq.params.max_tokens for t in items] == [1, 2, 3]
    assert len({t.seq.seq_id for t in items}) == 3


def test_sequences_carry_the_request_fields_and_a_copy_of_the_prompt() -> None:
    """Bug it catches: eos ids, cache salt or caller not passed on, or the caller's prompt list shared
    (``list(prompt)`` dropped) - editing the prompt afterwards must not change any sequence."""
    intake = Intake(FakeTokenizer())
    prompt = [4, 5]
    items = submit(intake, prompt, [SamplingParams(), SamplingParams()], caller="bob", salt="s1")
    prompt.append(6)
    for t in items:
        assert t.seq.prompt_token_ids == [4, 5]
        assert t.seq.eos_token_ids == frozenset({7})
        assert t.seq.cache_salt == "s1"
        assert t.seq.caller == "bob"
    assert items[0].seq.prompt_token_ids is not items[1].seq.prompt_token_ids


def test_seed_zero_gets_a_generator_seeded_with_zero() -> None:
    """Bug it catches: ``if p.seed`` for ``is not None`` (seed 0 is falsy and must still seed), or the
    seed not applied - draws match a generator seeded by hand; no seed means no generator."""
    intake = Intake(FakeTokenizer())
    items = submit(intake, [1], [SamplingParams(seed=0), SamplingParams(seed=12345), SamplingParams()])
    gens = [t.generator for t in items]
    assert gens[2] is None
    for gen, seed in zip(gens[:2], (0, 12345), strict=True):
        assert gen is not None
        expected = torch.rand(4, generator=torch.Generator("cpu").manual_seed(seed))
        assert torch.equal(torch.rand(4, generator=gen), expected)
    assert gens[0] is not None and gens[0].device == torch.device("cpu")


def test_detokenizer_gets_each_sequences_stop_settings() -> None:
    """Bug it catches: stop strings, ``include_stop_str_in_output`` or ``min_tokens`` not handed to the
    detokenizer (or swapped) - each sequence's detokenizer has its own params' values."""
    tok = FakeTokenizer()
    intake = Intake(tok)
    params = [
        SamplingParams(stop=("x", "yz"), include_stop_str_in_output=True, min_tokens=3, max_tokens=5),
        SamplingParams(),
    ]
    a, b = submit(intake, [1], params)
    assert (a.detok.stop, a.detok.include_stop, a.detok.min_tokens) == (("x", "yz"), True, 3)
    assert (b.detok.stop, b.detok.include_stop, b.detok.min_tokens) == ((), False, 0)
    assert a.detok.tokenizer is tok


def test_only_the_first_sequence_carries_the_predicted_wait() -> None:
    """Bug it catches: ``wait = predicted if items else None`` (inverted) or every sequence carrying it
    - the pace calibrates once per request, on its first sequence only."""
    intake = Intake(FakeTokenizer())
    items = submit(intake, [1], [SamplingParams()] * 3, predicted=(0.0, False))
    assert [t.predicted_wait for t in items] == [(0.0, False), None, None]


async def test_handles_belong_to_the_running_loop_and_the_engine() -> None:
    """Bug it catches: a handle bound to the wrong sequence, engine or loop - its abort reaches the
    engine with its own sequence, and it lives on the loop that submitted."""
    intake = Intake(FakeTokenizer())
    engine = FakeEngine()
    items = intake.submit(engine, [1, 2], [SamplingParams()] * 2, frozenset(), "", "c", (0.1, True))
    for t in items:
        assert t.handle.seq is t.seq
        assert t.handle._loop is asyncio.get_running_loop()
        assert t.handle.request_id == t.seq.seq_id
    items[1].handle.abort()
    assert engine.aborted == [items[1].seq]


def test_counts_take_a_requests_prompt_once_and_each_sequence_per_caller() -> None:
    """Bug it catches: prompt tokens counted per sequence (``n > 1`` forks share the prompt), callers
    counted once per request instead of per sequence, or ``submitted`` counted per sequence."""
    intake = Intake(FakeTokenizer())
    submit(intake, [1, 2, 3], [SamplingParams()] * 3, caller="alice")
    submit(intake, [1, 2], [SamplingParams()], caller="bob")
    assert intake.counts("alice") == (5, 3, 3)
    assert intake.counts("bob") == (5, 1, 2)
    assert intake.counts("carol") == (5, 0, 0)
    assert intake.counts(None) == (5, 0, 0)
    assert intake.qsize() == 4
    assert not intake.empty()
    assert intake.submitted == 2


def test_drain_yields_in_order_and_uncounts_each_entry_as_it_goes() -> None:
    """Bug it catches: a fork's prompt tokens subtracted (``if seq.fork_of is None`` flipped or
    dropped), a caller's count decremented by more than one, or counts changed before the entry is
    taken - draining one entry at a time, the counts follow by hand."""
    intake = Intake(FakeTokenizer())
    a = submit(intake, [1, 2, 3], [SamplingParams()] * 2, caller="alice")
    b = submit(intake, [1, 2], [SamplingParams()], caller="alice")
    intake.abort(a[0].seq)
    entries = intake.drain()
    assert next(entries) == ("add", a[0])
    assert intake.counts("alice") == (2, 2, 2)  # a's prompt left; its fork and b remain
    assert next(entries) == ("add", a[1])
    assert intake.counts("alice") == (2, 1, 2)  # the fork took no tokens with it
    assert next(entries) == ("add", b[0])
    assert intake.counts("alice") == (0, 0, 0)
    assert next(entries) == ("abort", a[0].seq)
    assert list(entries) == []
    assert intake.empty() and intake.qsize() == 0


def test_a_caller_with_nothing_waiting_is_forgotten() -> None:
    """Bug it catches: ``if not self.callers[...]`` flipped (an entry deleted while the caller still
    waits, or kept at zero) - the counters name exactly the callers with something in the inbox."""
    intake = Intake(FakeTokenizer())
    submit(intake, [1], [SamplingParams()], caller="alice")
    submit(intake, [1, 2], [SamplingParams()], caller="bob")
    submit(intake, [1, 2, 3], [SamplingParams()], caller="bob")
    entries = intake.drain()
    next(entries)
    assert dict(intake.callers) == {"bob": 2}
    assert dict(intake.caller_tokens) == {"bob": 5}
    next(entries)
    assert dict(intake.callers) == {"bob": 1}
    assert dict(intake.caller_tokens) == {"bob": 3}
    next(entries)
    assert dict(intake.callers) == {} and dict(intake.caller_tokens) == {}
    assert intake.tokens == 0


def test_add_of_nothing_changes_nothing() -> None:
    """Bug it catches: the ``if not items: return`` guard dropped (``items[0]`` on an empty list)."""
    intake = Intake(FakeTokenizer())
    intake.add([])
    assert intake.empty() and intake.counts(None) == (0, 0, 0)


def test_device_defaults_to_cpu_and_is_a_torch_device() -> None:
    """Bug it catches: the device kept as a string or defaulted elsewhere - seeded generators draw on it."""
    assert Intake(FakeTokenizer()).device == torch.device("cpu")
    assert Intake(FakeTokenizer(), "cpu").device.type == "cpu"
