"""A step of the fast path blocks the host once: the copy of its chosen tokens.

On CUDA an operation blocks the host when it reads a device value (``.item()``, ``bool(t)``,
``.tolist()``: ``aten._local_scalar_dense`` or a copy to the CPU), sizes an output by data
(``nonzero``, boolean-mask indexing, ``masked_select``), or copies to the CPU. On the CPU the
"device" is the host, so these cost nothing here; ``HostSyncs`` counts them anyway, by name, at
both levels torch offers: the dispatcher (aten ops) and the Python API (``tolist``, ``cpu``, ``to``
with a CPU target, which on a CPU tensor never reach the dispatcher).

Measured: a decode step of the engine (greedy, sampled, seeded, penalised rows) and a verify step
(the target over drafted tokens, then the acceptance rule, greedy and sampled) each make exactly
one such call; before the device sampler a decode step of 3 rows made 2 (``logits.cpu()``, then
the argmax's ``tolist``) plus one ``.tolist()``/``bool()`` per ... see ``test_counts_before``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.fixtures import make_engine
from tiers.core.block_manager import BlockTable
from tiers.core.sequence import SamplingParams, Sequence
from tiers.engine.llm_engine import Engine
from tiers.sample import sampler
from tiers.sample.sampler import Draft, sample_rows
from tiers.worker.device import DeviceWorker
from tiers.worker.model_runner import ModelRunner, RowInput

T = TypeVar("T")

_READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select"}
_INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _is_cpu(x: Any) -> bool:
    return isinstance(x, torch.device | str) and torch.device(x).type == "cpu"


class _Dispatch(TorchDispatchMode):
    def __init__(self, seen: Counter[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _READS:
            self.seen[name] += 1
        elif name in _INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                self.seen[f"{name}(bool mask)"] += 1
        elif name in ("aten::_to_copy", "aten::copy_"):
            src, dst_cpu = (
                (args[1], args[0].device.type == "cpu")
                if name == "aten::copy_"
                else (args[0], _is_cpu(kwargs.get("device")))
            )
            if dst_cpu and isinstance(src, torch.Tensor) and src.device.type != "cpu":
                self.seen[f"{name}(to cpu)"] += 1
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, seen: Counter[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("tolist", "cpu"):
            self.seen[f"Tensor.{name}"] += 1
        elif name == "to" and "cpu" in (*args[1:], kwargs.get("device")):
            # An explicit ``.to("cpu")``; ``.to(device=x.device)`` (HF's rotary tables) moves to
            # the device a tensor already computes on, which on this host happens to be the CPU.
            self.seen["Tensor.to(cpu)"] += 1
        return func(*args, **kwargs)


class HostSyncs:
    """Counts, while entered on this thread, the calls that would block the host on CUDA."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()
        self._modes = (_Function(self.seen), _Dispatch(self.seen))

    @property
    def total(self) -> int:
        return sum(self.seen.values())

    def __enter__(self) -> HostSyncs:
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)


def test_the_counter_sees_each_kind_of_host_sync() -> None:
    """The counter itself: scalar reads, data-sized outputs, boolean masks and the explicit copy
    calls each count once; index arithmetic on the device does not."""
    x = torch.arange(6.0)
    cases: list[Callable[[], object]] = [
        x[0].item, lambda: bool(x.any()), x.tolist, x.nonzero,
        lambda: x[x > 2], lambda: x.masked_select(x > 2), x.cpu, lambda: x.to("cpu"),
    ]  # fmt: skip
    for case in cases:
        with HostSyncs() as c:
            case()
        assert c.total == 1, (case, c.seen)
    with HostSyncs() as c:
        idx = torch.tensor([0, 2])
        x.index_select(0, idx).argmax().view(1)
        torch.where(x > 2, x, 0.0)
    assert c.total == 0, c.seen


# -- the steps --------------------------------------------------------------------------------

SETTINGS = [
    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True),
    SamplingParams(
        max_tokens=8, temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.1,
        logit_bias=((5, 1.5),), ignore_eos=True,
    ),
]  # fmt: skip


def _on_device(worker: DeviceWorker, fn: Callable[[], T]) -> T:
    return worker.call(fn, timeout=60)


def _decode_step_syncs(worker: DeviceWorker, engine: Engine) -> Counter[str]:
    """Steps ``engine`` (detached from the worker's loop) until every row decodes, then counts
    one decode step."""
    kinds: list[str] = []
    engine.step_hook = lambda batch: kinds.append(batch.kind)
    for _ in range(20):
        kinds.clear()
        _on_device(worker, engine.step)
        if kinds == ["decode"] and all(s.num_output_tokens > 0 for s in engine.scheduler.running):
            break
    kinds.clear()
    counter = HostSyncs()

    def counted() -> bool:
        with counter:
            return engine.step()

    assert _on_device(worker, counted)
    assert kinds == ["decode"] and engine.scheduler.num_running == len(SETTINGS)
    return counter.seen


@pytest.fixture(scope="module")
def detached(worker: DeviceWorker, tiny_model_dir: Path) -> Engine:
    engine: Engine = make_engine(worker, tiny_model_dir, max_num_seqs=8, name="syncs")  # type: ignore[assignment]
    worker.remove_engine(engine)  # stepped by the test alone, on the device thread
    return engine


async def _submit(engine: Engine) -> list[Any]:
    handles = [engine.submit(list(range(3 + i, 40 + 3 * i)), p) for i, p in enumerate(SETTINGS)]
    await asyncio.sleep(0)
    return handles


async def test_an_engine_decode_step_syncs_once(worker: DeviceWorker, detached: Engine) -> None:
    """Catches a host read anywhere in a decode step: the runner's input staging, logits brought
    to the host, sampling decisions read back (``bool(t.any())``), the acceptance rule's counts
    read row by row. Rows: greedy, top-k/top-p/min-p, seeded, penalties with logit bias."""
    handles = await _submit(detached)
    seen = _decode_step_syncs(worker, detached)
    assert sum(seen.values()) <= 1, seen
    assert seen == Counter({"Tensor.tolist": 1})
    for h in handles:
        detached.abort(h.seq)
    _on_device(worker, detached.step)


async def test_a_planted_item_in_the_step_is_caught(
    worker: DeviceWorker, detached: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test can fail: one ``.item()`` planted in the sampler's draw shows as a second sync."""
    real = sampler.draw

    def draw(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(*args, **kwargs)
        out[0].item()
        return out

    monkeypatch.setattr(sampler, "draw", draw)
    handles = await _submit(detached)
    seen = _decode_step_syncs(worker, detached)
    assert seen["aten::_local_scalar_dense"] == 1 and sum(seen.values()) == 2, seen
    for h in handles:
        detached.abort(h.seq)
    _on_device(worker, detached.step)


def test_a_verify_step_syncs_once(tiny_model_dir: Path) -> None:
    """The target over drafted tokens (three and two drafts, and a row without), then the
    acceptance rule for greedy and sampled rows and the next tokens: one copy back. Catches the
    acceptance counts read per row (``int(num_acc[row])``), the greedy comparison done on the
    host, and draft laws brought over one by one."""
    from tiers.models.loading import load_model

    r = ModelRunner(
        load_model(str(tiny_model_dir), device="cpu"), num_blocks=64, block_size=4, max_model_len=256
    )
    assert r.fast is not None
    params = [SETTINGS[0], SETTINGS[1], SETTINGS[2]]
    seqs = [Sequence(list(range(5 + i, 20 + i)), p) for i, p in enumerate(params)]
    tables = []
    for s in seqs:
        t = BlockTable()
        assert r.blocks.allocate(t, s.num_tokens + 4)
        tables.append(t.blocks)
    r.forward([RowInput(t, 0, s.token_ids[:-1], "none") for t, s in zip(tables, seqs, strict=True)])
    law = torch.full((r.vocab_size,), 1.0 / r.vocab_size)
    drafts: list[Draft | None] = [Draft([7, 8, 9]), Draft([4, 5], [law, law]), None]
    rows = [
        RowInput(t, s.num_tokens - 1, [s.token_ids[-1], *(d.tokens if d else [])], "all" if d else "last")
        for t, s, d in zip(tables, seqs, drafts, strict=True)
    ]
    shared, seeded = torch.Generator().manual_seed(0), torch.Generator().manual_seed(7)
    with HostSyncs() as c:
        logits = r.forward(rows)
        out = sample_rows(seqs, logits, drafts, [None, None, seeded], shared, frozenset({0}))
    assert all(o is not None for o in out)
    assert c.total <= 1, c.seen
    assert c.seen == Counter({"Tensor.tolist": 1})
