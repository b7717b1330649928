"""Prompt logprobs (completions ``echo`` with ``logprobs``, what lm-evaluation-harness's
loglikelihood tasks read): each prompt token's logprob from the engine, checked against the
Hugging Face model's own forward over the whole prompt - across prefill chunks, past a warm prefix
cache and beside a speculating draft."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures import make_engine
from tiers.core.sequence import SamplingParams
from tiers.engine.llm_engine import Engine
from tiers.worker.device import DeviceWorker

PROMPT = [(7 * i + 3) % 350 + 5 for i in range(41)]  # 41 tokens: several chunks of 16


def _reference(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """log p(ids[p] | ids[:p]) for p >= 1, from transformers' forward over the whole prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


async def _first(engine: Engine, ids: list[int], params: SamplingParams) -> tuple[Any, list[Any]]:
    outs = [out async for out in engine.submit(ids, params)]
    return outs[0], outs


def _params(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 3, "temperature": 0, "ignore_eos": True, **kw})


@pytest.mark.parametrize("chunk", [16, 128])
async def test_prompt_logprobs_match_the_models_own_forward(
    worker: DeviceWorker, tiny_model_dir: Path, chunk: int
) -> None:
    """Bugs it catches: a position's logprob given to the wrong token (off by one), chunks after
    the first dropped or misplaced, the sampled row's logits taken from the prompt's first
    position, or processed (temperature, penalties) instead of raw logits."""
    engine = make_engine(worker, tiny_model_dir, max_num_batched_tokens=chunk, name=f"plp-{chunk}")
    assert isinstance(engine, Engine)
    first, outs = await _first(engine, PROMPT, _params(prompt_logprobs=2, repetition_penalty=1.3))
    got = first.prompt_logprobs
    assert got is not None and len(got) == len(PROMPT) and got[0] is None
    assert all(out.prompt_logprobs is None for out in outs[1:])  # once, on the first output
    want = _reference(tiny_model_dir, PROMPT)
    assert [e.token_id for e in got[1:]] == PROMPT[1:]
    assert torch.allclose(torch.tensor([e.logprob for e in got[1:]]), want, atol=1e-4)
    assert all(len(e.top) == 2 and e.top[0][1] >= e.logprob - 1e-6 for e in got[1:])
    # The answer itself is what the same request without prompt logprobs gets.
    plain = [
        t
        for out in [o async for o in engine.submit(PROMPT, _params(repetition_penalty=1.3))]
        for t in out.token_ids
    ]
    assert [t for out in outs for t in out.token_ids] == plain


async def test_a_warm_prefix_cache_and_a_draft_do_not_skip_prompt_positions(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    """Bug it catches: the prompt served from the prefix cache (its positions never computed, so
    their logprobs missing), or a draft's tokens verified in the prompt rows' logits."""
    engine = make_engine(
        worker, tiny_model_dir, prefix_caching=True, draft_quantization="int8", name="plp-warm"
    )
    assert isinstance(engine, Engine)
    warm, _ = await _first(engine, PROMPT, _params())
    again, _ = await _first(engine, PROMPT, _params())
    assert again.num_cached_tokens > 0 and warm.prompt_logprobs is None  # the cache is warm
    first, _ = await _first(engine, PROMPT, _params(prompt_logprobs=0))
    assert first.num_cached_tokens == 0 and first.num_draft_tokens == 0
    got = first.prompt_logprobs
    assert got is not None and all(e is not None and e.top == [] for e in got[1:])
    want = _reference(tiny_model_dir, PROMPT)
    assert torch.allclose(torch.tensor([e.logprob for e in got[1:]]), want, atol=1e-4)


async def test_a_long_prompt_is_scored_in_bounded_chunks(worker: DeviceWorker, tiny_model_dir: Path) -> None:
    """Bug it catches: a long prompt's logits at every position taken in one step of the whole
    budget (a ``[tokens, vocab]`` float block: gigabytes for a large vocabulary on a GPU budget),
    or the chunks of a capped prompt stitched out of place."""
    from tiers.core.sched.scheduler import PROMPT_LOGPROBS_CHUNK

    engine = make_engine(
        worker, tiny_model_dir, max_num_batched_tokens=1024, max_model_len=1024, name="plp-long"
    )
    assert isinstance(engine, Engine)
    chunks: list[int] = []
    engine.step_hook = lambda batch: chunks.extend(batch.num_new_tokens)
    prompt = [(5 * i + 11) % 350 + 5 for i in range(PROMPT_LOGPROBS_CHUNK + 90)]
    first, _ = await _first(engine, prompt, _params(prompt_logprobs=0, max_tokens=1))
    assert chunks[:2] == [PROMPT_LOGPROBS_CHUNK, 90]  # the budget alone would feed it in one step
    got = first.prompt_logprobs
    assert got is not None
    want = _reference(tiny_model_dir, prompt)
    assert torch.allclose(torch.tensor([e.logprob for e in got[1:]]), want, atol=1e-4)
