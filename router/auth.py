"""Optional API-key auth. Keys come from an environment variable or a file (a mounted Secret),
never from the policy in clear. Each key may name its tenant: ``key`` or ``key:tenant``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.policy.schema import Policy

__all__ = ["ApiKeys"]

log = logging.getLogger(__name__)


class ApiKeys:
    def __init__(self, entries: dict[str, str | None]) -> None:
        # Store digests: comparisons run over fixed-length values in constant time, and a heap dump
        # does not hold the keys themselves.
        self._entries = [(hashlib.sha256(k.encode()).digest(), tenant) for k, tenant in entries.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    @classmethod
    def parse(cls, text: str) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for raw in text.replace(",", "\n").splitlines():
            item = raw.strip()
            if not item or item.startswith("#"):
                continue
            key, _, tenant = item.partition(":")
            out[key.strip()] = tenant.strip() or None
        return out

    @classmethod
    def from_policy(cls, policy: Policy) -> ApiKeys:
        auth = policy.service.auth
        entries: dict[str, str | None] = {}
        if auth.api_keys_env:
            entries.update(cls.parse(os.environ.get(auth.api_keys_env, "")))
            if not entries:
                log.warning("auth: $%s is empty or unset; no keys from it", auth.api_keys_env)
        if auth.api_keys_file:
            try:
                entries.update(cls.parse(Path(auth.api_keys_file).read_text(encoding="utf-8")))
            except OSError as exc:
                log.error("auth: cannot read api_keys_file %s: %s", auth.api_keys_file, exc)
        return cls(entries)

    def authenticate(self, authorization: str | None) -> str | bool | None:
        """The key's tenant (or None when it names none), or False when the key is missing or wrong."""
        if not authorization:
            return False
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        digest = hashlib.sha256(token.strip().encode()).digest()
        match: str | bool | None = False
        for stored, tenant in self._entries:  # no early exit: time does not depend on which key matched
            if hmac.compare_digest(stored, digest):
                match = tenant
        return match
