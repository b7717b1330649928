"""The device worker's turn policy, without models (fake engines)."""

from __future__ import annotations

from tiers.device import MAX_DEFERRED_TURNS, DeviceWorker


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
