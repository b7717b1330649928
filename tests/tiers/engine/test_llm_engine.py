"""The engine on a tiny random Llama: continuous batching, cancellation, stops, errors, prefix cache."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures import make_engine
from tiers.core.sequence import SamplingParams
from tiers.engine.llm_engine import Engine, EngineFullError
from tiers.worker.device import DeviceWorker


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


async def test_a_step_failing_before_its_batch_forms_fails_the_waiting_requests_too(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches the failure path failing only running sequences: a step that raises before a batch
    # forms (here choosing k) with only a waiting request retried forever, logging each time, and
    # the request never finished (found when a test's stub of choose_k lacked a new argument).
    def broken() -> int:
        raise TypeError("injected fault")

    monkeypatch.setattr(engine, "_choose_k", broken)
    out = await asyncio.wait_for(collect(engine, prompts(1, seed=4)[0], greedy(6)), timeout=60)
    assert out[2] == "error" and "internal error" in (out[3].error or "")
    monkeypatch.undo()
    again = await collect(engine, prompts(1, seed=4)[0], greedy(6))  # the engine keeps serving
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


async def test_prefix_cache_serves_a_repeated_prompt_and_a_next_turn_to_the_token(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    """Past the last whole cached block, a copied block serves the rest of a repeated prompt (all
    but its last token) and of a chat's next turn (the previous answer up to its last computed
    token). Compared with an engine without a prefix cache (the reference). Catches KV copied from
    the wrong block, into a block the forward then zeroes, or shared and overwritten; and checks
    the copies happened (cached counts past whole blocks)."""
    eng = make_engine(worker, tiny_model_dir, prefix_caching=True, name="to-the-token")
    cold = make_engine(worker, tiny_model_dir, name="to-the-token-cold")
    assert isinstance(eng, Engine) and isinstance(cold, Engine)
    prompt = prompts(1, seed=41)[0][:22]  # 22 tokens: 5 whole blocks of 4 and 2 more
    first = await collect(eng, prompt, greedy(8))
    again = await collect(eng, prompt, greedy(8))
    assert first[3].num_cached_tokens == 0
    assert again[3].num_cached_tokens == len(prompt) - 1  # whole blocks alone: 20
    assert again[0] == first[0] == (await collect(cold, prompt, greedy(8)))[0]
    turn = [*prompt, *first[0], 9, 10, 11]  # 22 + 8 + 3 tokens; the KV held 22 + 7 of them
    warm = await collect(eng, turn, greedy(8))
    assert warm[3].num_cached_tokens == len(prompt) + len(first[0]) - 1  # whole blocks alone: 28
    assert warm[0] == (await collect(cold, turn, greedy(8)))[0]
    assert eng.runner.blocks.num_partial_hits == 2


# -- engine v2: paged KV, preemption, forks, hooks -----------------------------------------------


async def test_same_step_finish_and_prefill_store_the_right_kv(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    """Regression: with dense slots, a sequence finishing on its first token and another finishing
    prefill in the same step made the prefix cache map the second prompt to the first one's KV."""
    eng = make_engine(worker, tiny_model_dir, prefix_caching=True, name="same-step")
    cold_eng = make_engine(worker, tiny_model_dir, name="same-step-cold")
    assert isinstance(eng, Engine) and isinstance(cold_eng, Engine)
    a, b = prompts(2, seed=20)
    b = b * 3  # several full blocks
    await asyncio.gather(collect(eng, a, greedy(1)), collect(eng, b, greedy(4)))
    probe = [*b, 11, 12]
    warm = await collect(eng, probe, greedy(10))
    cold = await collect(cold_eng, probe, greedy(10))
    assert warm[3].num_cached_tokens > 0  # the prefix cache served it...
    assert warm[0] == cold[0]  # ...with the right KV


async def test_survivors_of_an_isolated_error_match_their_solo_runs(engine: Engine) -> None:
    ps = prompts(4, seed=21)
    solo = [await collect(engine, p, greedy(8)) for p in ps]
    poison = ps[1]

    def hook(batch: Any) -> None:
        if any(s.prompt_token_ids == poison for s in batch.seqs):
            raise RuntimeError("injected fault")

    engine.step_hook = hook
    try:
        results = await asyncio.gather(*(collect(engine, p, greedy(8)) for p in ps))
    finally:
        engine.step_hook = None
    assert results[1][2] == "error"
    assert [r[0] for i, r in enumerate(results) if i != 1] == [s[0] for i, s in enumerate(solo) if i != 1]


async def test_preemption_by_recompute_keeps_every_output_exact(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    """A pool far smaller than the batch needs: sequences are preempted and recomputed, none fails,
    and each output equals its run alone."""
    eng = make_engine(
        worker, tiny_model_dir, kv_tokens=320, max_model_len=256, max_num_seqs=8, name="tight", block_size=4
    )
    assert isinstance(eng, Engine)
    ps = prompts(8, seed=22)
    alone = [await collect(eng, p, greedy(30)) for p in ps]
    before = eng.scheduler.num_preemptions
    together = await asyncio.gather(*(collect(eng, p, greedy(30)) for p in ps))
    assert eng.scheduler.num_preemptions > before
    assert [t[0] for t in together] == [a[0] for a in alone]
    assert all(t[2] == "length" for t in together)
    assert eng.runner.blocks.num_used_blocks == 0


async def _collect_handle(handle: Any) -> tuple[list[int], Any]:
    tokens: list[int] = []
    last = None
    async for out in handle:
        tokens += out.token_ids
        last = out
    return tokens, last


async def test_n_branches_share_the_prompt_and_sample_independently(engine: Engine) -> None:
    ids = prompts(1, seed=23)[0] * 2
    solo = await collect(engine, ids, greedy(10))
    handles = engine.submit_n(ids, [greedy(10), greedy(10)])
    outs = await asyncio.gather(*(_collect_handle(h) for h in handles))
    assert [o[0] for o in outs] == [solo[0], solo[0]]
    # This engine has no prefix caching: the second branch's reused tokens come from the fork
    # (every full block of the prompt but the one holding its last token).
    assert outs[0][1].num_cached_tokens == 0
    assert outs[1][1].num_cached_tokens == (len(ids) - 1) // 4 * 4
    sampled = engine.submit_n(
        ids, [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    )
    a, b = await asyncio.gather(*(_collect_handle(h) for h in sampled))
    assert a[0] != b[0]  # each branch draws with its own seed


class AllowList:
    """A test constraint: only ``allowed`` tokens, then complete after ``length`` of them."""

    def __init__(self, allowed: list[int], length: int) -> None:
        self.allowed = allowed
        self.length = length
        self.accepted: list[int] = []
        self.rollbacks = 0

    def fill_mask(self, mask: Any) -> None:
        mask[self.allowed] = True

    def accept(self, token_id: int) -> bool:
        if token_id not in self.allowed or self.is_terminated:
            return False
        self.accepted.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        self.rollbacks += 1
        del self.accepted[len(self.accepted) - num_tokens :]

    @property
    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


async def test_constraint_masks_every_token_and_ends_the_sequence(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    eng = make_engine(
        worker, tiny_model_dir, draft_quantization="int8", speculative_tokens=3, name="constrained"
    )
    assert isinstance(eng, Engine)
    eng.spec.fixed_k = 3
    try:
        results = []
        for temperature in (0.0, 1.0):
            c = AllowList([40, 41, 42, 43], length=9)
            params = SamplingParams(max_tokens=50, temperature=temperature, constraint=c)
            results.append((c, await collect(eng, prompts(1, seed=24)[0], params)))
    finally:
        eng.spec.fixed_k = None
    for c, (tokens, _, reason, last) in results:
        assert reason == "stop" and tokens == c.accepted and len(tokens) == 9
        assert set(tokens) <= set(c.allowed)
        assert last.num_draft_tokens > 0  # drafts were checked against the grammar too


async def test_logprobs_match_an_independent_forward(engine: Engine, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = prompts(1, seed=25)[0]
    tokens: list[int] = []
    lps: list[Any] = []
    async for out in engine.submit(
        ids, SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    ):
        tokens += out.token_ids
        lps += out.logprobs or []
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids + tokens])).logits[0].float(), -1)
    assert len(lps) == 4
    for j, lp in enumerate(lps):
        row = ref[len(ids) - 1 + j]
        assert lp.token_id == tokens[j] == int(row.argmax())
        assert abs(lp.logprob - float(row[tokens[j]])) < 1e-3
        assert [t for t, _ in lp.top] == torch.topk(row, 3).indices.tolist()


async def test_logit_bias_forces_a_token(engine: Engine) -> None:
    tokens, *_ = await collect(
        engine,
        prompts(1, seed=26)[0],
        SamplingParams(max_tokens=5, temperature=0, logit_bias=((77, 100.0),), ignore_eos=True),
    )
    assert tokens == [77] * 5


async def test_generic_hf_path_gives_the_fast_paths_tokens(
    worker: DeviceWorker, tiny_model_dir: Path, engine: Engine
) -> None:
    """The generic path (HF's own modules over the paged cache) runs, and agrees with the lean one."""
    generic = make_engine(worker, tiny_model_dir, fast_path=False, name="generic")
    assert isinstance(generic, Engine) and generic.runner.fast is None and engine.runner.fast is not None
    ps = prompts(6, seed=27)
    a = await asyncio.gather(*(collect(generic, p, greedy(12)) for p in ps))
    b = await asyncio.gather(*(collect(engine, p, greedy(12)) for p in ps))
    assert [x[0] for x in a] == [y[0] for y in b]


async def test_a_fault_after_some_rows_were_delivered_never_repeats_their_tokens(engine: Engine) -> None:
    """A step that fails halfway through postprocessing: rows already delivered keep their tokens,
    the rest are retried alone; every stream equals its solo run, no token twice, none lost."""
    ps = prompts(4, seed=28)
    solo = [await collect(engine, p, greedy(6)) for p in ps]
    original = engine._postprocess
    fired = False

    def flaky(seq: Any, new: list[int], logprobs: Any = None) -> None:
        nonlocal fired
        if not fired and len(engine._delivered) == 2:
            fired = True
            raise RuntimeError("fault after two rows")
        original(seq, new, logprobs)

    engine._postprocess = flaky  # type: ignore[method-assign]
    try:
        results = await asyncio.gather(*(collect(engine, p, greedy(6)) for p in ps))
    finally:
        engine._postprocess = original  # type: ignore[method-assign]
    assert fired
    assert [r[0] for r in results] == [s[0] for s in solo]


async def test_prefix_cache_partitions_hit_within_and_never_across(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    """Regression: tables were salted with '' whatever the request's partition, so a tenant's
    blocks were published to the unsalted partition and never found under the tenant's own."""
    eng = make_engine(worker, tiny_model_dir, prefix_caching=True, name="salted")
    assert isinstance(eng, Engine)
    prompt = prompts(1, seed=29)[0] * 3

    async def cached(salt: str) -> int:
        last = None
        async for out in eng.submit([*prompt, 5], greedy(2), cache_salt=salt):
            last = out
        assert last is not None
        return last.num_cached_tokens

    assert await cached("tenant-a") == 0
    assert await cached("tenant-a") > 0  # hit within the partition
    assert await cached("tenant-b") == 0  # never across
    assert await cached("") == 0


async def test_a_light_caller_is_served_within_steps_of_a_flood_and_every_output_stays_exact(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    """One caller fills every batch slot and the queue; a second caller's request still gets its
    first token within a few steps (fairness preemption), is predicted to wait less than the flood,
    and the preempted flood requests recompute to exactly their solo outputs."""
    eng = make_engine(worker, tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=64, name="fair")
    assert isinstance(eng, Engine)
    ps = prompts(9, seed=31)
    alone = [await collect(eng, p, greedy(40)) for p in ps]
    flood = [eng.submit(p, greedy(40), caller="heavy") for p in ps[:8]]
    flood_runs = [asyncio.ensure_future(_collect_handle(h)) for h in flood]
    while eng.scheduler.num_running < 4 or not eng.scheduler.num_waiting:
        await asyncio.sleep(0.001)
    assert eng.predicted_wait("light") < eng.predicted_wait("heavy")
    before, steps = eng.scheduler.num_preemptions, eng.num_steps
    light = eng.submit(ps[8], greedy(40), caller="light")
    it = light.__aiter__()
    first = await anext(it)
    # Fairness admits it within a step or two; without it the first slot frees after a flood
    # request's 40 tokens (~40 steps, ~80 behind the queued flood). The steps are counted when
    # this coroutine resumes, so a busy event loop adds a few: 10 keeps both sides clear.
    assert eng.num_steps - steps <= 10, "the light request waited for the flood"
    assert eng.scheduler.num_preemptions > before
    rest = [o async for o in it]
    assert first.token_ids + [t for o in rest for t in o.token_ids] == alone[8][0]
    assert [(await r)[0] for r in flood_runs] == [a[0] for a in alone[:8]]


@pytest.mark.parametrize("backend", ["mkl", "onednn"])
async def test_packed_fp32_kernels_keep_hfs_greedy_output(
    worker: DeviceWorker, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """An fp32 tier with every linear on a packed GEMM, MKL's and oneDNN's (the tiny model's are
    below the size threshold, so it is lowered to 0) decodes a batch of 6 - steps of 6 rows, inside the packed
    range - token for token as plain greedy decoding with HF's unpacked model. Catches a packed
    layout used at a row count it does not fit, a head that lost its tie, or fused q/k/v/gate/up
    built from the wrong weights; and checks the packed kernel served the decode steps."""
    from transformers import AutoModelForCausalLM

    from tiers.layers import fp32_packed

    monkeypatch.setattr(fp32_packed, "PACKED_MIN_WEIGHT_ELEMENTS", 0)
    monkeypatch.setattr(fp32_packed, "fp32_gemm_backend", lambda: backend)
    rows_seen: list[int] = []
    real_forward = fp32_packed.PackedFp32Linear.forward

    def counting(self: fp32_packed.PackedFp32Linear, x: torch.Tensor) -> torch.Tensor:
        rows_seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real_forward(self, x)

    monkeypatch.setattr(fp32_packed.PackedFp32Linear, "forward", counting)
    # One- and two-row steps go to the fp32 GEMV kernel where it is built (on every such host
    # here, so the wiring is tested where the measured threshold is 0): count its calls.
    gemv_calls = [0]
    from tiers.kernels import cpu as cpu_kernels

    gemv_op = cpu_kernels.f32_linear_op() if backend == "onednn" else None
    if gemv_op is not None:
        monkeypatch.setattr(fp32_packed, "F32_GEMV_MAX_ROWS", max(fp32_packed.F32_GEMV_MAX_ROWS, 2))

        def counted(*args: object) -> torch.Tensor:
            gemv_calls[0] += 1
            return gemv_op(*args)

        monkeypatch.setattr(fp32_packed, "_f32_gemv_op", lambda: counted)
    packed = make_engine(worker, tiny_model_dir, name="packed")
    assert isinstance(packed, Engine)
    model = packed.runner.model
    assert isinstance(model.lm_head, fp32_packed.PackedFp32Linear) and model.lm_head.backend == backend
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
    ps = prompts(6, seed=31)
    rows_seen.clear()
    got = await asyncio.gather(*(collect(packed, p, greedy(10)) for p in ps))
    assert sum(r in model.lm_head.packed_rows for r in rows_seen) > 0
    alone = await collect(packed, ps[0], greedy(10))  # one sequence: one-row decode steps
    assert alone[0] == got[0][0]
    if gemv_op is not None:
        assert gemv_calls[0] > 0
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for p, g in zip(ps, got, strict=True):
        seq = list(p)
        with torch.no_grad():
            for _ in range(10):
                seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
        assert g[0] == seq[len(p) :]


async def test_a_steps_outputs_reach_the_event_loop_in_one_call(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight requests decoding together: each step hands all its outputs to the event loop at
    once (one wake-up, not eight that take the GIL from the step's own postprocessing), and every
    request still gets every token, in order. Catches a per-row push and an outbox never flushed."""
    loop = asyncio.get_running_loop()
    calls = [0]
    original = loop.call_soon_threadsafe

    def counting(callback: Any, *args: Any, **kw: Any) -> Any:
        # Only this engine's hand-offs: the loop's executor and futures call it too, and so may an
        # engine of an earlier test finishing a request its consumer dropped.
        name = getattr(callback, "__qualname__", "")
        if name == "RequestHandle._push_many":
            calls[0] += args[0][0][0].engine is engine
        elif name == "RequestHandle._push":
            calls[0] += callback.__self__.engine is engine
        return original(callback, *args, **kw)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    steps_before = engine.num_steps
    outs = await asyncio.gather(*(collect(engine, p, greedy(16)) for p in prompts(8, seed=5)))
    steps, pushed = engine.num_steps - steps_before, calls[0]
    # At most one a step; the last step's count may land after its outputs were handed over.
    assert steps >= 16 and pushed <= steps + 1
    assert all(len(o[0]) == 16 and o[2] == "length" for o in outs)
    alone = [await collect(engine, p, greedy(16)) for p in prompts(8, seed=5)]
    assert [o[0] for o in outs] == [a[0] for a in alone]


def test_decode_round_prices_a_non_drafting_engine_from_its_warm_up(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    # Catches: warm-up profiling only drafting engines, so a plain tier has no price until its
    # first real steps and drops out of load-aware routing (TierSet.routing_costs leaves
    # unmeasured tiers out). A fresh engine: nothing but its warm-up has run.
    engine: Engine = make_engine(worker, tiny_model_dir, name="fresh")  # type: ignore[assignment]
    assert engine.draft is None and engine.num_steps == 0
    assert engine.decode_round(0) == (0.0, 1.0)  # idle: nothing to price
    one, sixteen = engine.decode_round(1), engine.decode_round(16)
    assert one is not None and sixteen is not None
    assert one[1] == sixteen[1] == 1.0  # no draft: one token a row a step
    assert one[0] > 0.0 and sixteen[0] > 0.0
    # The price is the controller's plain-step estimate at that batch size.
    assert one[0] == engine.spec.best_round(1)[0]  # type: ignore[index]
    worker.remove_engine(engine)


async def test_warm_up_figures_are_provisional_until_measured_in_service(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    # Catches the warm-up not calling ``spec.seeded()``: a profile taken while the machine was
    # busy would then weigh on the cost model (the draft's cost for good, SpecController.provisional).
    engine: Engine = make_engine(worker, tiny_model_dir, draft_quantization="int8", name="seeded")  # type: ignore[assignment]
    spec = engine.spec
    assert spec.draft_cost and spec.target_cost
    assert {("draft_cost", k) for k in spec.draft_cost} <= spec.provisional
    assert {("target_cost", k) for k in spec.target_cost} <= spec.provisional
    assert ("catch_up_ratio", (0, 0)) in spec.provisional  # the draft reading a backlog, profiled
    spec.fixed_k = 2  # drafting from the first decode step, which catches the draft up on the prompt
    await collect(engine, prompts(1, seed=3)[0], greedy(12))
    spec.fixed_k = None
    assert ("target_cost", (1, 1)) not in spec.provisional  # its one-row decode steps measured it
    assert ("catch_up_ratio", (0, 0)) not in spec.provisional  # and that catch-up was priced
    worker.remove_engine(engine)
