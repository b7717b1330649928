"""A forward's integer inputs (token ids, positions, slots, block tables...) in one copy to the device.

On CUDA every list goes into one pinned host buffer and over in one non-blocking copy: a pageable
``torch.tensor(list, device="cuda")`` blocks the host until the copy is done (``memcpy_and_sync``),
six of them a forward. The pinned buffers are a ring; each records an event after its copy and the
next use of that buffer waits for it (long done by then: a step syncs once at its end). On the
CPU the "device" is the host: one ``torch.tensor`` of the concatenated lists, no buffer, no copy.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from itertools import chain
from typing import Any

import torch

__all__ = ["HostStager", "to_device"]

RING = 4
"""Pinned buffers in turn: forwards of one step (draft forwards, then the target's) each take one."""


class HostStager:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda" and torch.cuda.is_available()
        self._buffers: list[torch.Tensor | None] = [None] * RING
        self._events: list[Any] = [None] * RING
        self._turn = 0
        self.num_copies = 0
        """Host-to-device copies made (tests: one per ``stage`` call on the device)."""

    def stage(self, parts: Seq[Seq[int]]) -> list[torch.Tensor]:
        """``parts`` as int64 tensors on the device, views of one tensor (one copy)."""
        sizes = [len(p) for p in parts]
        flat = list(chain.from_iterable(parts))
        if not self.pinned:
            return list(torch.tensor(flat, dtype=torch.long, device=self.device).split(sizes))
        slot = self._turn
        self._turn = (self._turn + 1) % RING
        buf = self._buffers[slot]
        if buf is None or buf.numel() < len(flat):
            if self._events[slot] is not None:
                self._events[slot].synchronize()
            buf = torch.empty(max(len(flat), 4096) * 2, dtype=torch.long, pin_memory=True)
            self._buffers[slot] = buf
        elif self._events[slot] is not None:
            self._events[slot].synchronize()  # the copy of RING forwards ago (done long since)
        host = buf[: len(flat)]
        host.numpy()[:] = flat
        dev = host.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[slot] = event
        self.num_copies += 1
        return list(dev.split(sizes))

    def one(self, values: Seq[int]) -> torch.Tensor:
        return self.stage([values])[0]


def to_device(values: Seq[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device`` without blocking the host: on CUDA through a
    pinned buffer of torch's caching host allocator (it holds the buffer until the copy is done)
    and a non-blocking copy; on the CPU a plain ``torch.tensor``."""
    t = torch.tensor(list(values), dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
