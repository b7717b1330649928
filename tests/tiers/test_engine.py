"""The engine on a tiny random Llama: continuous batching, cancellation, stops, errors, prefix cache."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import make_engine
from tiers.device import DeviceWorker
from tiers.engine import Engine, EngineFullError
from tiers.sequence import SamplingParams


@pytest.fixture(scope="module")
def engine(worker: DeviceWorker, tiny_model_dir: Path) -> Engine:
    return make_engine(worker, tiny_model_dir, max_num_seqs=16, max_num_batched_tokens=64)  # type: ignore[return-value]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


async def collect(
    engine: Engine, ids: list[int], params: SamplingParams
) -> tuple[list[int], str, str | None, Any]:
    tokens: list[int] = []
    text = ""
    last = None
    async for out in engine.submit(ids, params):
        tokens += out.token_ids
        text += out.text
        last = out
    assert last is not None
    return tokens, text, last.finish_reason, last


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def test_batch_of_16_matches_each_request_alone(engine: Engine) -> None:
    ps = prompts(16)
    alone = [await collect(engine, p, greedy()) for p in ps]
    together = await asyncio.gather(*(collect(engine, p, greedy()) for p in ps))
    assert [t[0] for t in together] == [a[0] for a in alone]
    assert all(len(t[0]) == 12 and t[2] == "length" for t in together)


async def test_requests_join_mid_flight_and_leave_early(engine: Engine) -> None:
    ps = prompts(6, seed=1)
    alone = [await collect(engine, p, greedy(4 + 4 * i)) for i, p in enumerate(ps)]

    async def late(i: int) -> Any:
        await asyncio.sleep(0.01 * i)  # arrive while earlier ones decode
        return await collect(engine, ps[i], greedy(4 + 4 * i))

    mixed = await asyncio.gather(*(late(i) for i in range(6)))
    assert [m[0] for m in mixed] == [a[0] for a in alone]
    assert [len(m[0]) for m in mixed] == [4 + 4 * i for i in range(6)]


async def test_cancel_frees_the_slot_within_a_step(engine: Engine) -> None:
    handle = engine.submit(prompts(1, seed=2)[0], greedy(200))
    it = handle.__aiter__()
    await anext(it)  # running now
    assert engine.load().num_running == 1
    steps_before = engine.num_steps
    handle.abort()
    outs = [o async for o in it]
    assert outs[-1].finish_reason == "abort"
    for _ in range(100):
        if engine.load().num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.load().num_running == 0 and engine.runner.blocks.num_used_blocks == 0
    assert engine.num_steps - steps_before <= 2


async def test_consumer_going_away_aborts(engine: Engine) -> None:
    async def read_two() -> None:
        async for i, _ in _aenumerate(engine.submit(prompts(1, seed=3)[0], greedy(200))):
            if i == 1:
                break

    await read_two()
    for _ in range(100):
        if engine.load().num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.load().num_running == 0


async def _aenumerate(it: Any) -> Any:
    i = 0
    async for x in it:
        yield i, x
        i += 1


async def test_stop_string_ends_generation_and_is_not_returned(engine: Engine) -> None:
    ids = prompts(1, seed=4)[0]
    _, full, _, _ = await collect(engine, ids, greedy(30))
    assert len(full) > 4
    stop = full[2:4]
    _tokens, text, reason, _ = await collect(
        engine, ids, SamplingParams(max_tokens=30, temperature=0, stop=(stop,), ignore_eos=True)
    )
    assert reason == "stop"
    assert stop not in text
    assert full.startswith(text)
    assert text == full[: full.index(stop)]


async def test_seeded_sampling_is_reproducible_in_any_batch(engine: Engine) -> None:
    ids = prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    a = await collect(engine, ids, params)
    others = [
        collect(engine, p, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
        for p in prompts(5, 6)
    ]
    b, *_ = await asyncio.gather(collect(engine, ids, params), *others)
    assert a[0] == b[0]


async def test_penalties_change_the_output(engine: Engine) -> None:
    ids = prompts(1, seed=7)[0]
    plain = await collect(engine, ids, greedy(24))
    penalized = await collect(
        engine, ids, SamplingParams(max_tokens=24, temperature=0, frequency_penalty=2.0, ignore_eos=True)
    )
    assert len(set(penalized[0])) >= len(set(plain[0]))
    assert penalized[0] != plain[0] or len(set(plain[0])) == len(plain[0])


async def test_error_in_one_request_fails_only_that_request(engine: Engine) -> None:
    ps = prompts(4, seed=8)
    poison = ps[2]

    def hook(batch: Any) -> None:
        if any(s.prompt_token_ids == poison for s in batch.seqs):
            raise RuntimeError("injected fault")

    engine.step_hook = hook
    try:
        results = await asyncio.gather(*(collect(engine, p, greedy(6)) for p in ps))
    finally:
        engine.step_hook = None
    reasons = [r[2] for r in results]
    assert reasons[2] == "error" and "injected fault" in (results[2][3].error or "")
    assert [r for i, r in enumerate(reasons) if i != 2] == ["length"] * 3
    again = await collect(engine, ps[0], greedy(6))  # the engine keeps serving
    assert again[2] == "length"


async def test_queue_bound_raises_engine_full(worker: DeviceWorker, tiny_model_dir: Path) -> None:
    small = make_engine(worker, tiny_model_dir, max_num_seqs=1, max_waiting=1, name="bounded")
    assert isinstance(small, Engine)
    h1 = small.submit(prompts(1)[0], greedy(50))
    h2 = small.submit(prompts(1)[0], greedy(50))
    with pytest.raises(EngineFullError):
        small.submit(prompts(1)[0], greedy(50))
    h1.abort()
    h2.abort()
    async for _ in h1:
        pass
    async for _ in h2:
        pass


async def test_prompt_longer_than_context_is_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match="context"):
        engine.submit(list(range(3, 3 + 300)), greedy())


async def test_generation_stops_at_the_context_end(engine: Engine) -> None:
    ids = [5] * 250
    tokens, _, reason, _ = await collect(engine, ids, greedy(100))
    assert reason == "length" and len(ids) + len(tokens) == 256


async def test_prefix_cache_reuse_gives_identical_output(worker: DeviceWorker, tiny_model_dir: Path) -> None:
    eng = make_engine(worker, tiny_model_dir, prefix_caching=True, name="prefix")
    assert isinstance(eng, Engine)
    system = prompts(1, seed=9)[0] * 2
    first = await collect(eng, [*system, 7, 8, 9], greedy(10))
    second = await collect(eng, [*system, 7, 8, 10], greedy(10))
    cold_engine = make_engine(worker, tiny_model_dir, name="cold")
    assert isinstance(cold_engine, Engine)
    cold = await collect(cold_engine, [*system, 7, 8, 10], greedy(10))
    assert first[3].num_cached_tokens == 0
    assert second[3].num_cached_tokens >= len(system) // 4 * 4 - 4
    assert second[0] == cold[0]
