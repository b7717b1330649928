"""The device worker: the one thread that runs every torch operation of the service.

Why one thread for all tiers, not a thread per engine: measured on this CPU, torch's OpenMP
kernels run at full speed only on the first thread that uses them. A second thread with its own
OpenMP pool oversubscribes the cores, libgomp falls back to short spin-waits, and the int8 kernel
that makes the lower tiers cheap ran 3x slower (30 us -> 90 us per call), which erased the
speculative speed-up. On a GPU the tiers share one device and its steps serialize anyway.

So model loading, warm-up and every engine step run here, round-robin across the engines that
have work: one step each per turn, so a busy tier cannot starve the others. While any engine
holds a protected caller's prompt (a caller below its fair share, ``Scheduler.protected_callers``),
a turn runs decodes and protected prompts only, for at most ``MAX_DEFERRED_TURNS`` turns in a row:
otherwise a light tenant's request waited for a whole turn of the other tiers' long prompt chunks
of a flood (measured: 3-6 s to the first token against a 5 s budget, so it was refused).

Device time is shared between callers too (``fairness.TurnBudget``): while a caller below its
share of the device's batch slots has work, callers over it sit out the turns that would slow the
light caller's steps by more than ``fair_slowdown`` (policy ``service.fair_slowdown``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from tiers.core.sched.fairness import TurnBudget

if TYPE_CHECKING:
    from tiers.core.sched.pacing import Backlog, Pace

__all__ = ["DeviceEngine", "DeviceWorker"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class DeviceEngine(Protocol):
    """What the worker drives (``tiers.engine.llm_engine.Engine``)."""

    name: str
    pace: Pace

    def has_work(self) -> bool: ...
    def has_protected_prefill(self) -> bool: ...
    def decoding(self) -> bool: ...
    def share(self) -> tuple[Counter[str], int]:
        """Sequences per caller held here (running or waiting), and the batch slots (device thread)."""
        ...

    def step(
        self,
        *,
        defer_unprotected_prompts: bool = False,
        hold_back: frozenset[str] = frozenset(),
        decodes_elsewhere: bool = False,
    ) -> bool: ...
    def abort_all(self) -> None: ...
    def backlog(self) -> Backlog:
        """Everything queued on the engine, as another engine's wait estimate sees it."""
        ...


E = TypeVar("E", bound=DeviceEngine)

MAX_DEFERRED_TURNS = 4
"""Turns in a row that may hold back unprotected prompts; then one runs them, so a stream of
protected arrivals slows a flood's prompts but never stops them."""


class DeviceWorker(Generic[E]):
    def __init__(self, name: str = "device") -> None:
        self.engines: list[E] = []
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stopping = False
        self._closed = False
        """Set by the thread as it ends (under ``_lock``): later calls fail at once instead of
        waiting forever on a queue nobody reads (a reload still building when the server stops)."""
        self._lock = threading.Lock()
        self._deferred_turns = 0
        self.turns = TurnBudget()
        """Device time between callers (``fairness.TurnBudget``); its ``slowdown`` is the policy's."""
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def backlogs(self, exclude: object = None) -> list[tuple[Pace, Backlog]]:
        """Each engine's pace and backlog, of those with work but ``exclude`` (any thread): what
        a wait estimate adds for the other tiers' steps on this device (``pacing.predict_wait``)."""
        return [(e.pace, e.backlog()) for e in self.engines if e is not exclude and e.has_work()]

    def add_engine(self, engine: E) -> None:
        self.engines = [*self.engines, engine]  # copy-on-write: the loop iterates without a lock
        self.wake()

    def remove_engine(self, engine: E) -> None:
        self.engines = [e for e in self.engines if e is not engine]

    def wake(self) -> None:
        self._wake.set()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the device thread between engine steps."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                fut.set_exception(RuntimeError("the device worker has stopped"))
                return fut
            self._calls.put((fn, fut))
        self.wake()
        return fut

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Blocking ``submit``; never call it from the device thread itself."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.submit(fn).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left in every engine and end the thread."""
        self._stopping = True
        self.wake()
        self._thread.join(timeout)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

    def _defer_this_turn(self) -> bool:
        try:
            urgent = any(e.has_protected_prefill() for e in self.engines if e.has_work())
        except Exception:  # a bookkeeping error must not stop the device: run a plain turn
            log.exception("checking for protected prompts failed")
            urgent = False
        if urgent and self._deferred_turns < MAX_DEFERRED_TURNS:
            self._deferred_turns += 1
            return True
        self._deferred_turns = 0
        return False

    def _decoding(self) -> list[E]:
        """The engines with a running sequence decoding, as this turn starts."""
        try:
            return [e for e in self.engines if e.has_work() and e.decoding()]
        except Exception:  # a bookkeeping error must not stop the device
            log.exception("checking for running decodes failed")
            return []

    def _hold_back(self) -> frozenset[str]:
        if self.turns.slowdown is None:
            return frozenset()
        try:
            held: Counter[str] = Counter()
            slots = 0
            for engine in self.engines:
                callers, seqs = engine.share()
                held.update(callers)
                slots += seqs
            return self.turns.plan(held, slots)
        except Exception:  # a bookkeeping error must not stop the device: hold no one back
            log.exception("sharing the device between callers failed")
            return frozenset()

    def _loop(self) -> None:
        import os

        import torch

        torch.set_grad_enabled(False)
        threads = os.environ.get("TIERED_ROUTER_TORCH_THREADS")
        if threads:
            # Intra-op threads of every kernel run here. Fewer than the cores leaves room for the
            # HTTP loop; 1 avoids OpenMP barrier stalls when the other cores are busy.
            torch.set_num_threads(max(1, int(threads)))
        while not self._stopping:
            self._run_calls()
            did_work = False
            defer = self._defer_this_turn()
            hold_back = self._hold_back()
            decoding = self._decoding()
            started = time.perf_counter()
            for engine in self.engines:
                if engine.has_work():
                    # Decode first across tiers: a stream on one engine waits for every other
                    # engine's step of the turn, prompt chunks included (Scheduler.schedule).
                    elsewhere = any(e is not engine for e in decoding)
                    try:
                        did_work = (
                            engine.step(
                                defer_unprotected_prompts=defer,
                                hold_back=hold_back,
                                decodes_elsewhere=elsewhere,
                            )
                            or did_work
                        )
                    except Exception:  # engine.step guards itself; this is the last line of defence
                        log.exception("engine %s: unhandled error in step", engine.name)
            self.turns.record(time.perf_counter() - started, did_work)
            if not did_work and not hold_back:
                self._wake.wait(0.05)
                self._wake.clear()
        with self._lock:
            self._closed = True
        self._run_calls()  # what was submitted before closing still runs
        for engine in self.engines:
            engine.abort_all()
