"""What comes back out of the service: a ``Completion`` for the HTTP layer, a ``CachedAnswer``
from the response cache. The request going in is ``router.openai.request``'s ``Generation`` (with
its ``CallContext``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

__all__ = ["CachedAnswer", "Completion"]


@dataclass(slots=True)
class Completion:
    """What the HTTP layer needs: routing headers plus a body or an SSE byte stream."""

    headers: dict[str, str]
    body: dict[str, Any] | None = None
    stream: AsyncIterator[bytes] | None = None


@dataclass(slots=True, frozen=True)
class CachedAnswer:
    """A stored answer found by the response cache; the service turns it into a ``Completion``."""

    body: dict[str, Any]
    tier: str
    rule: str
    score: str
    kind: str  # exact | semantic
    similarity: float = 1.0
