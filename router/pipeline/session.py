"""Session-aware routing: a conversation that went to a tier never drops below it on a follow-up.

No server-side sessions are needed. A conversation is recognised by what the client resends:

* an explicit ``x-session-id`` header, when the client sends one; otherwise
* a hash of the conversation *before* its last user turn. Only system, developer and user
  turns are hashed: assistant turns are the service's own output, which clients often trim or
  reformat, while the asks that led to them come back verbatim. So turn 2 ``[u1, a1, u2]``
  finds what turn 1 ``[u1]`` stored, and turn 3 ``[u1, a1, u2, a2, u3]`` what turn 2 stored
  under ``[u1, u2]``.

Keys are scoped by the caller's partition (its tenant, else its key's fingerprint), so one
caller cannot steer another's routing by sending its messages. Memory is bounded: at most
``max_entries`` keys (least recently used go first), each forgotten ``ttl_s`` after its last use.
One entry is a 16-byte digest, a tier name and a time: 100,000 conversations cost about 20 MB.

A follow-up with a remembered tier is decided as usual, then ``floor`` mode raises a decision
below the remembered tier to it (the default: a conversation only escalates) and ``pin`` mode
keeps it on the remembered tier either way (the tier whose prefix cache holds the context).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["SESSION_HEADER", "SessionMemory", "prior_key", "record_key"]

SESSION_HEADER = "x-session-id"
_HASHED_ROLES = frozenset({"system", "developer", "user"})


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts carry the ask
        return "\n".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, Mapping) and p.get("type", "text") == "text"
        )
    return str(content)


def _digest(scope: str, messages: Sequence[Mapping[str, Any]]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(scope.encode("utf-8", "surrogatepass"))
    for m in messages:
        role = m.get("role")
        if role not in _HASHED_ROLES:
            continue
        # Length-prefixed fields: no two different conversations serialise to the same bytes.
        for part in (str(role), _content(m.get("content"))):
            data = part.encode("utf-8", "surrogatepass")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    return h.digest()


def _last_user(messages: Sequence[Mapping[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    return -1


def _scope(partition: str | None) -> str:
    return f"p:{partition if partition is not None else '-'}\x00"


def prior_key(
    messages: Sequence[Mapping[str, Any]] | None, headers: Mapping[str, str], partition: str | None
) -> bytes | None:
    """The key a follow-up looks up: its explicit session id, else its conversation before the last ask.

    None for a first turn without a session id (nothing before it to remember).
    """
    sid = headers.get(SESSION_HEADER)
    if sid:
        return _digest(_scope(partition) + "sid\x00" + sid, [])
    if not messages:
        return None
    last = _last_user(messages)
    prior = messages[:last] if last >= 0 else list(messages)
    if not any(m.get("role") == "user" for m in prior):
        return None
    return _digest(_scope(partition) + "conv\x00", prior)


def record_key(
    messages: Sequence[Mapping[str, Any]] | None, headers: Mapping[str, str], partition: str | None
) -> bytes | None:
    """The key this request's tier is stored under: what its next turn will look up."""
    sid = headers.get(SESSION_HEADER)
    if sid:
        return _digest(_scope(partition) + "sid\x00" + sid, [])
    if not messages or not any(m.get("role") == "user" for m in messages):
        return None
    return _digest(_scope(partition) + "conv\x00", messages)


class SessionMemory:
    """Bounded LRU of conversation key -> tier, with a time to live. Thread-safe."""

    def __init__(
        self, max_entries: int = 100_000, ttl_s: float = 3600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("max_entries must be >= 1 and ttl_s > 0")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes | None) -> str | None:
        if key is None:
            return None
        now = self._clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            tier, stamp = entry
            if now - stamp > self.ttl_s:
                del self._entries[key]
                return None
            # A use counts as activity: the time to live runs from the last turn, not the first.
            self._entries[key] = (tier, now)
            self._entries.move_to_end(key)
            return tier

    def recall(
        self, messages: Sequence[Mapping[str, Any]] | None, headers: Mapping[str, str], partition: str | None
    ) -> str | None:
        """The tier this conversation went to on its previous turn (``prior_key``), if remembered."""
        return self.get(prior_key(messages, headers, partition))

    def record(
        self,
        messages: Sequence[Mapping[str, Any]] | None,
        headers: Mapping[str, str],
        partition: str | None,
        tier: str,
    ) -> None:
        """Remember ``tier`` for this conversation's next turn (``record_key``)."""
        self.put(record_key(messages, headers, partition), tier)

    def put(self, key: bytes | None, tier: str) -> None:
        if key is None:
            return
        now = self._clock()
        with self._lock:
            self._entries[key] = (tier, now)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.evictions += 1
