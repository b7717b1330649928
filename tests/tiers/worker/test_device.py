"""The device worker's turn policy, without models (fake engines)."""

from __future__ import annotations

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
