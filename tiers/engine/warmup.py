"""An engine's warm-up: one real forward per model (the readiness bar), then a timing profile
that seeds the predicted wait (``pacing.Pace``) and the speculative cost model
(``controller.SpecController``) at batch sizes 1, 2, 4... and ``max_num_seqs``. Runs before the
engine's loop starts; its blocks are returned unnamed."""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING

from tiers.core.sched.batch import SchedulerConfig
from tiers.core.sched.pacing import Pace
from tiers.spec_decode.controller import SpecController, fastest
from tiers.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from tiers.spec_decode.proposers import Proposer

__all__ = ["warm_up"]

PROFILE_CONTEXT = 32
"""Tokens of context the profiled decode steps attend to."""


def warm_up(
    runner: ModelRunner, config: SchedulerConfig, pace: Pace, spec: SpecController, proposer: Proposer | None
) -> None:
    prompt = runner.tokenizer.encode("Hello, how are you today?") or [0]
    if runner.graphs is not None:
        # Captured before any request (and before the costs below are measured): a capture in
        # the middle of serving would stall every stream of the device for its duration.
        runner.graphs.capture_all()
    runner.forward_scratch([prompt])
    # A full-budget chunk too: the first forward of a new large shape pays one-off kernel
    # setup (seconds for oneDNN on the CPU), which the first long prompt must not.
    chunk = min(config.max_num_batched_tokens, config.max_model_len - 1)
    long_prompt = (prompt * (chunk // len(prompt) + 1))[:chunk]
    runner.forward_scratch([long_prompt])
    # Then the costs the predicted wait starts from (tiers/core/sched/pacing.py): a token of a prompt
    # chunk, and a decode step of a full batch.
    started = time.perf_counter()
    runner.forward_scratch([long_prompt])
    token_cost = (time.perf_counter() - started) / chunk
    started = time.perf_counter()
    runner.forward_scratch([prompt[:1]] * config.max_num_seqs, start=PROFILE_CONTEXT)
    pace.seed(token_cost=token_cost, decode_cost=time.perf_counter() - started)
    sizes = sorted({min(1 << i, config.max_num_seqs) for i in range(12)} | {config.max_num_seqs})
    if proposer is None or spec.max_k == 0:
        # The plain step at each batch size: what load-aware routing prices a row by.
        for b in sizes:
            rows = [prompt[:1]] * b
            spec.record_target(b, 1, fastest(partial(runner.forward_scratch, rows, start=PROFILE_CONTEXT)))
    else:
        decode_cost = proposer.profile(runner, prompt, sizes, PROFILE_CONTEXT)
        if decode_cost is not None:
            pace.seed(decode_cost=decode_cost)
    spec.seeded()
