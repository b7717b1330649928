"""The Responses API's stored responses (``store: true``): kept in memory per caller partition
(tenant, else API key fingerprint), bounded in count, in bytes overall and in bytes per
partition, with a TTL. One writer: the Responses handlers, on the event loop.

A partition past its own byte quota loses its own oldest responses, never another's: one caller
storing megabyte answers cannot push every other tenant's conversations out.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = ["MAX_PARTITION_BYTES", "MAX_STORED", "MAX_STORED_BYTES", "STORE_TTL_S", "ResponseStore", "Stored"]

MAX_STORED = 4096
"""Stored responses kept (all partitions together); the least recently used go first."""
MAX_STORED_BYTES = 256 * 1024 * 1024
"""Bytes of stored responses and their conversations, all partitions together."""
MAX_PARTITION_BYTES = 64 * 1024 * 1024
"""Bytes one partition (tenant or key) may keep; past it, its own oldest are dropped."""
STORE_TTL_S = 3600.0
"""A stored response is forgotten this long after it was created."""


@dataclass(slots=True)
class Stored:
    partition: str
    expires: float
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    """The chat-shaped messages up to and including this response's output (no instructions)."""
    size: int = 0
    """Its bytes as JSON (response and conversation): what the byte bounds count."""


class ResponseStore:
    """Stored responses by id, per caller partition, bounded (LRU) in count and bytes, with a TTL."""

    def __init__(
        self,
        max_entries: int = MAX_STORED,
        ttl_s: float = STORE_TTL_S,
        *,
        max_bytes: int = MAX_STORED_BYTES,
        max_partition_bytes: int = MAX_PARTITION_BYTES,
    ) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.max_partition_bytes = max_partition_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.on_evict: Callable[[str], None] | None = None
        """Told each response dropped before its TTL, with why: ``partition_quota`` or
        ``capacity`` (``router_stored_responses_evicted_total``)."""
        self._bytes = 0
        self._partition_bytes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

    def partition_bytes(self, partition: str) -> int:
        return self._partition_bytes.get(partition, 0)

    def put(self, partition: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep ``response``; False when it alone is larger than a partition may keep (not kept)."""
        size = len(msgspec.json.encode((response, conversation)))
        rid = response["id"]
        self._drop(rid)
        if size > min(self.max_partition_bytes, self.max_bytes):
            return False
        self._items[rid] = Stored(partition, time.monotonic() + self.ttl_s, response, conversation, size)
        self._bytes += size
        self._partition_bytes[partition] = self._partition_bytes.get(partition, 0) + size
        if self._partition_bytes[partition] > self.max_partition_bytes:
            own = [k for k, v in self._items.items() if v.partition == partition and k != rid]
            for key in own:  # oldest first
                if self._partition_bytes[partition] <= self.max_partition_bytes:
                    break
                self._evict(key, "partition_quota")
        while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
            self._evict(next(iter(self._items)), "capacity")
        return True

    def _evict(self, response_id: str, reason: str) -> None:
        self._drop(response_id)
        if self.on_evict is not None:
            self.on_evict(reason)

    def get(self, partition: str, response_id: str) -> Stored | None:
        """The stored response, or None when unknown, expired, or another partition's."""
        item = self._items.get(response_id)
        if item is None or item.partition != partition:
            return None
        if item.expires <= time.monotonic():
            self._drop(response_id)
            return None
        self._items.move_to_end(response_id)
        return item

    def delete(self, partition: str, response_id: str) -> bool:
        if self.get(partition, response_id) is None:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        item = self._items.pop(response_id, None)
        if item is None:
            return
        self._bytes -= item.size
        left = self._partition_bytes[item.partition] - item.size
        if left > 0:
            self._partition_bytes[item.partition] = left
        else:
            del self._partition_bytes[item.partition]
