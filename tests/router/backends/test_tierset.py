"""Building tiers from a policy: shared models, draft validation, remote tiers."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.backends.local import LocalTier
from router.backends.remote import RemoteBackend
from router.backends.tierset import build_tiers
from router.errors import PolicyError
from router.policy.loader import parse_policy
from tests.fixtures import build_tiny_model
from tiers.worker.device import DeviceWorker


@pytest.fixture(scope="module")
def other_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("other-vocab"), vocab_size=320, seed=1)


def test_draft_with_another_vocabulary_is_rejected_naming_both_tiers(
    worker: DeviceWorker, tiny_model_dir: Path, other_vocab_model: Path
) -> None:
    policy = parse_policy(f"""
version: 1
tiers:
  small: {{model: {other_vocab_model}}}
  large: {{model: {tiny_model_dir}, draft: small}}
routing:
  rules: [{{name: d, tier: large}}]
""")
    with pytest.raises(PolicyError) as info:
        build_tiers(policy, worker)
    issue = info.value.issues[0]
    assert issue.path == "tiers.large.draft"
    assert "'small'" in issue.message and "'large'" in issue.message and "vocabular" in issue.message


def test_tiers_share_loaded_models_and_drafts_share_weights(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    policy = parse_policy(f"""
version: 1
tiers:
  small: {{model: {tiny_model_dir}, quantization: int8, max_num_seqs: 2}}
  medium: {{model: {tiny_model_dir}, quantization: int8, draft: small, max_num_seqs: 2}}
  remote: {{model: "http://127.0.0.1:9/v1"}}
routing:
  rules: [{{name: d, tier: small}}]
""")
    tiers = build_tiers(policy, worker)
    try:
        small, medium = tiers.get("small"), tiers.get("medium")
        assert isinstance(small, LocalTier) and isinstance(medium, LocalTier)
        assert small.engine.runner.model is medium.engine.runner.model  # one copy of the weights
        assert medium.engine.draft is not None and medium.engine.draft.model is small.engine.runner.model
        # The draft runs on the small tier's runner: its KV blocks are budgeted in small's pool.
        assert medium.engine.draft is small.engine.runner
        assert medium.engine.scheduler.draft_blocks is small.engine.runner.blocks
        assert isinstance(tiers.get("remote"), RemoteBackend)
    finally:
        for engine in tiers.engines():
            worker.remove_engine(engine)


def test_an_ngram_draft_builds_a_lookup_drafter_with_its_own_bookkeeping(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    from tiers.spec_decode.ngram import NgramProposer

    policy = parse_policy(f"""
version: 1
tiers:
  small: {{model: {tiny_model_dir}, draft: ngram, speculative_tokens: 3, max_num_seqs: 2}}
  plain: {{model: {tiny_model_dir}, max_num_seqs: 2}}
routing:
  rules: [{{name: d, tier: small}}]
""")
    tiers = build_tiers(policy, worker)
    try:
        small, plain = tiers.get("small"), tiers.get("plain")
        assert isinstance(small, LocalTier) and isinstance(plain, LocalTier)
        draft = small.engine.draft
        assert isinstance(draft, NgramProposer)
        # No KV pool is taken from any tier: the scheduler's draft tables are bookkeeping only.
        assert small.engine.scheduler.draft_blocks is draft.blocks
        assert draft.blocks is not small.engine.runner.blocks
        assert small.engine.spec.max_k == 3 and (1, 4) in small.engine.spec.target_cost
        assert plain.engine.draft is None
    finally:
        for engine in tiers.engines():
            worker.remove_engine(engine)


async def test_int8_activations_are_their_own_model_and_answer(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    """Two int4 tiers on one model, one with int8 activations: each gets its own loaded model (the
    same weights quantized once per numerics - sharing one would serve one tier the other's), and
    the W4A8 tier answers through its engine."""
    from tiers.core.sequence import SamplingParams
    from tiers.layers.quantization.int4 import Int4WeightOnlyLinear

    policy = parse_policy(f"""
version: 1
tiers:
  small: {{model: {tiny_model_dir}, quantization: int4, activation_quantization: int8, max_num_seqs: 2}}
  medium: {{model: {tiny_model_dir}, quantization: int4, max_num_seqs: 2}}
routing:
  rules: [{{name: d, tier: small}}]
""")
    tiers = build_tiers(policy, worker)
    try:
        small, medium = tiers.get("small"), tiers.get("medium")
        assert isinstance(small, LocalTier) and isinstance(medium, LocalTier)
        assert small.engine.runner.model is not medium.engine.runner.model

        def int4(tier: LocalTier) -> list[Int4WeightOnlyLinear]:
            return [m for m in tier.engine.runner.model.modules() if isinstance(m, Int4WeightOnlyLinear)]

        assert int4(small) and all(m.int8_activations for m in int4(small))
        assert int4(medium) and not any(m.int8_activations for m in int4(medium))
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        tokens = [
            t for out in [o async for o in small.engine.submit([5, 6, 7], params)] for t in out.token_ids
        ]
        assert len(tokens) == 6
    finally:
        for engine in tiers.engines():
            worker.remove_engine(engine)


def test_the_cuda_graphs_key_reaches_the_runner_and_graphs_are_captured_at_warm_up(
    worker: DeviceWorker, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bugs it catches: ``tiers.<name>.cuda_graphs`` parsed but never given to the model runner
    (no tier could turn graphs on), and graphs captured lazily at the first decode step of each
    bucket mid-serving (a capture stalls every stream on the device) instead of at warm-up. On
    the CPU the runner ignores the switch; the capture is observed through a stand-in."""
    from tiers.worker import model_runner

    seen: list[bool] = []
    captured: list[str] = []
    real_init = model_runner.ModelRunner.__init__

    class Graphs:
        def capture_all(self) -> None:
            captured.append("all")

        def serves(self, rows: object) -> bool:
            return False  # every step takes the plain path

    def init(self: model_runner.ModelRunner, *args: object, cuda_graphs: bool = False, **kw: object) -> None:
        seen.append(cuda_graphs)
        real_init(self, *args, cuda_graphs=cuda_graphs, **kw)  # type: ignore[arg-type]
        assert self.graphs is None  # no CUDA here: the switch is ignored
        if cuda_graphs:
            self.graphs = Graphs()  # type: ignore[assignment]

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", init)
    policy = parse_policy(f"""
version: 1
tiers:
  small: {{model: {tiny_model_dir}, quantization: int8, max_num_seqs: 2}}
  large: {{model: {tiny_model_dir}, max_num_seqs: 2, cuda_graphs: true}}
routing:
  rules: [{{name: d, tier: small}}]
""")
    tiers = build_tiers(policy, worker)
    try:
        assert sorted(seen) == [False, True]
        large = tiers.get("large")
        assert isinstance(large, LocalTier) and isinstance(large.engine.runner.graphs, Graphs)
        assert captured == ["all"]  # once, during the large tier's warm-up
    finally:
        for engine in tiers.engines():
            worker.remove_engine(engine)


def test_the_decode_slowdown_key_reaches_each_engines_scheduler(
    worker: DeviceWorker, tiny_model_dir: Path
) -> None:
    """Bug it catches: ``tiers.<name>.max_decode_slowdown`` parsed but not handed to the tier's
    scheduler - every tier keeps the default (or none), and a prompt stalls the running streams
    however the policy sets it."""
    policy = parse_policy(f"""
version: 1
tiers:
  small: {{model: {tiny_model_dir}, quantization: int8, max_num_seqs: 2, max_decode_slowdown: 4.0}}
  large: {{model: {tiny_model_dir}, max_num_seqs: 2, max_decode_slowdown: null}}
routing:
  rules: [{{name: d, tier: small}}]
""")
    tiers = build_tiers(policy, worker)
    try:
        small, large = tiers.get("small"), tiers.get("large")
        assert isinstance(small, LocalTier) and isinstance(large, LocalTier)
        assert small.engine.scheduler.config.max_decode_slowdown == 4.0
        assert large.engine.scheduler.config.max_decode_slowdown is None
        assert small.engine.scheduler.pace is small.engine.pace  # the costs it caps chunks by
        assert small.engine.pace.decode_step > 0 and small.engine.pace.token_cost > 0  # measured at warm-up
    finally:
        for engine in tiers.engines():
            worker.remove_engine(engine)
