"""router/pipeline/response_store.py: stored responses bounded in count, bytes and bytes per
partition, with a TTL, ids never shared across partitions."""

from __future__ import annotations

import json
from typing import Any

from router.pipeline.response_store import ResponseStore


def _size(response: dict[str, Any], conversation: list[dict[str, Any]]) -> int:
    """The independent reference for an entry's bytes: the JSON text of both, compactly."""
    return len(json.dumps([response, conversation], separators=(",", ":")))


def test_store_is_bounded_expires_and_is_partitioned() -> None:
    """Bug caught: an unbounded store (memory grows with every response), no TTL, or ids shared
    across partitions."""
    store = ResponseStore(max_entries=2, ttl_s=3600)
    for rid in ("r1", "r2", "r3"):
        store.put("t:a", {"id": rid}, [])
    assert len(store) == 2 and store.get("t:a", "r1") is None and store.get("t:a", "r3") is not None
    assert store.get("t:b", "r3") is None and not store.delete("t:b", "r3")
    expired = ResponseStore(ttl_s=0.0)
    expired.put("t:a", {"id": "r"}, [])
    assert expired.get("t:a", "r") is None and len(expired) == 0 and expired.bytes == 0


def test_one_partition_past_its_quota_loses_its_own_oldest_not_anothers() -> None:
    """Bugs it catches: a count-only bound (4,096 megabyte answers kept: gigabytes), one caller's
    large answers evicting every other tenant's conversations, byte counts that drift when an
    entry is replaced, deleted or expires."""
    big = "x" * 1000
    conv = [{"role": "user", "content": big}]
    one = _size({"id": "a0", "user": big}, conv)
    store = ResponseStore(max_entries=100, max_bytes=100 * one, max_partition_bytes=3 * one + 10)
    evicted: list[str] = []
    store.on_evict = evicted.append
    store.put("t:victim", {"id": "v0", "user": big}, conv)
    for i in range(10):
        store.put("t:noisy", {"id": f"a{i}", "user": big}, conv)
        assert store.partition_bytes("t:noisy") <= 3 * one + 10
    assert store.get("t:victim", "v0") is not None  # untouched by the noisy partition
    kept = [f"a{i}" for i in range(10) if store.get("t:noisy", f"a{i}") is not None]
    assert kept == ["a7", "a8", "a9"]  # its own oldest went first
    assert evicted == ["partition_quota"] * 7  # what /metrics counts
    assert store.bytes == 4 * one == store.partition_bytes("t:noisy") + store.partition_bytes("t:victim")
    store.put("t:noisy", {"id": "a9", "user": "short"}, [])  # replaced: the old size is released
    assert store.partition_bytes("t:noisy") == 2 * one + _size({"id": "a9", "user": "short"}, [])
    assert store.delete("t:noisy", "a8") and store.partition_bytes("t:noisy") == one + _size(
        {"id": "a9", "user": "short"}, []
    )
    assert not store.put("t:x", {"id": "huge", "user": "y" * (4 * one)}, [])  # alone over a quota
    assert store.get("t:x", "huge") is None and store.partition_bytes("t:x") == 0


def test_the_overall_byte_bound_drops_the_least_recently_used() -> None:
    conv: list[dict[str, Any]] = []
    one = _size({"id": "r0", "user": "z" * 500}, conv)
    store = ResponseStore(max_entries=100, max_bytes=3 * one, max_partition_bytes=10 * one)
    evicted: list[str] = []
    store.on_evict = evicted.append
    for i in range(3):
        store.put(f"t:{i}", {"id": f"r{i}", "user": "z" * 500}, conv)
    assert store.get("t:0", "r0") is not None  # r0 used: r1 is now the least recently used
    store.put("t:3", {"id": "r3", "user": "z" * 500}, conv)
    assert [store.get(f"t:{i}", f"r{i}") is not None for i in range(4)] == [True, False, True, True]
    assert store.bytes == 3 * one
    assert evicted == ["capacity"]
