"""The device worker's turn policy, without models (fake engines)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from tiers.worker.device import MAX_DEFERRED_TURNS, DeviceWorker


class _Engine:
    def __init__(self, protected_prefill: bool) -> None:
        self.protected_prefill = protected_prefill

    def has_work(self) -> bool:
        return True

    def has_protected_prefill(self) -> bool:
        return self.protected_prefill

    def abort_all(self) -> None:
        pass


def test_unprotected_prompts_are_deferred_for_a_bounded_number_of_turns() -> None:
    """A stream of protected arrivals must slow a flood's prompts, never stop them: after
    MAX_DEFERRED_TURNS deferred turns one runs everyone's."""
    worker = DeviceWorker()
    worker.stop()  # the loop is not under test: drive the turn policy by hand
    pending = _Engine(protected_prefill=True)
    worker.engines = [_Engine(protected_prefill=False), pending]  # type: ignore[list-item]
    turns = [worker._defer_this_turn() for _ in range(2 * (MAX_DEFERRED_TURNS + 1))]
    assert turns == ([True] * MAX_DEFERRED_TURNS + [False]) * 2
    pending.protected_prefill = False
    assert not worker._defer_this_turn()


def test_a_call_after_the_worker_stopped_fails_instead_of_waiting_forever() -> None:
    # Catches: a call queued after the thread's last drain waits on a future nobody completes.
    # A reload still building engines when the server stops did that, and the non-daemon
    # executor thread it ran in kept the process from exiting.
    worker: DeviceWorker[Any] = DeviceWorker(name="stopping")
    assert worker.call(lambda: 41 + 1, timeout=10) == 42  # served while running
    worker.stop()
    assert not worker.is_alive
    with pytest.raises(RuntimeError, match="stopped"):
        worker.call(lambda: 1, timeout=10)  # a hang would end in TimeoutError instead


class _Stepping:
    """Steps a few times, recording the options each step got; ``decodes``: runs decodes."""

    def __init__(self, name: str, decodes: bool, steps: int = 3) -> None:
        self.name, self.decodes, self.left = name, decodes, steps
        self.options: list[dict[str, Any]] = []
        self.pace = None

    def has_work(self) -> bool:
        return self.left > 0

    def has_protected_prefill(self) -> bool:
        return False

    def decoding(self) -> bool:
        return self.decodes

    def share(self) -> tuple[Counter[str], int]:
        return Counter(), 1

    def step(self, **options: Any) -> bool:
        self.options.append(options)
        self.left -= 1
        return True

    def abort_all(self) -> None:
        pass


def test_each_engine_is_told_whether_another_engine_on_the_device_decodes() -> None:
    """Bug it catches: the decode-first cap told only about the engine's own decodes - a large
    tier's whole prompt runs in one step while the small tier's streams wait through it (the
    device steps tiers in series, so every other tier's step is in a stream's inter-token gap)."""
    worker: DeviceWorker[Any] = DeviceWorker(name="decode-first")
    try:
        small, large, idle = _Stepping("small", True), _Stepping("large", False), _Stepping("idle", False, 0)
        for engine in (small, large, idle):
            worker.add_engine(engine)
        deadline = time.monotonic() + 10
        while (small.left or large.left) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        worker.stop()
    assert [o["decodes_elsewhere"] for o in large.options] == [True, True, True]  # small decodes
    assert [o["decodes_elsewhere"] for o in small.options] == [False, False, False]  # only itself
    assert idle.options == []
