"""API-key auth, fail-closed. The policy states the mode (``service.auth.mode``):

- ``keys`` (the default): every API request needs ``Authorization: Bearer <key>`` (or
  Anthropic's ``x-api-key: <key>``, the same keys and tenants). Keys come from
  an environment variable or a file (a mounted Secret), never from the policy in clear; each may
  name its tenant (``key`` or ``key:tenant``). With no key loaded the service refuses to start.
  The file is re-read when it changes, so a rotated or revoked key takes effect without a restart.
- ``open``: no auth, for a development server on loopback (``make run``).

The tenant comes from the key only. ``x-tenant`` is honoured solely behind an explicit
``trust_tenant_header`` (a gateway in front authenticates callers and sets it), and then only for
a gateway key: one whose tenant is ``*`` (``key:*``), which may act for any tenant. A key without
a tenant is its own caller whatever ``x-tenant`` says, so it can neither read another tenant's
partition nor mint a fresh rate bucket per header value.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from router.errors import PolicyError, PolicyIssue

if TYPE_CHECKING:
    from collections.abc import Mapping

    from router.policy.schema import AuthConfig, Policy

__all__ = [
    "ADMIN_KEYS_ENV",
    "GATEWAY_TENANT",
    "LOOPBACK",
    "AdminKeys",
    "ApiKeys",
    "Authenticator",
    "Caller",
    "refused_on_bind",
]

log = logging.getLogger(__name__)

MAX_TENANT_CHARS = 64
GATEWAY_TENANT = "*"
"""A key's tenant field that marks a gateway key (``key:*``): its tenant comes from ``x-tenant``."""
LOOPBACK = ("127.0.0.1", "::1", "localhost")
ADMIN_KEYS_ENV = "TIERED_ROUTER_ADMIN_KEYS"
"""Environment variable with admin keys (one per line or comma-separated), beside ``--admin-keys-file``."""


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str | None
    principal: str | None
    """The identity rate limits count against: the tenant, else the key's fingerprint."""


class ApiKeys:
    def __init__(self, entries: dict[str, str | None]) -> None:
        # Store digests: comparisons run over fixed-length values in constant time, and a heap dump
        # does not hold the keys themselves. The fingerprint (a digest prefix) names a tenant-less
        # key in rate limits without revealing it.
        self._entries = []
        for key, tenant in entries.items():
            digest = hashlib.sha256(key.encode()).digest()
            self._entries.append((digest, tenant, "key-" + digest.hex()[:12]))

    def __len__(self) -> int:
        return len(self._entries)

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
            if key.strip():
                out[key.strip()] = tenant.strip() or None
        return out

    @classmethod
    def from_policy(cls, policy: Policy) -> ApiKeys:
        entries, _ = load_entries(policy.service.auth)
        return cls(entries)

    def lookup(self, authorization: str | None) -> tuple[str | None, str] | None:
        """``(tenant, fingerprint)`` of the presented key, or None when it is missing or wrong."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip().encode()).digest()
        match: tuple[str | None, str] | None = None
        for stored, tenant, fingerprint in self._entries:  # no early exit: time does not say which matched
            if hmac.compare_digest(stored, digest):
                match = (tenant, fingerprint)
        return match

    def authenticate(self, authorization: str | None) -> str | bool | None:
        """The key's tenant (or None when it names none), or False when the key is missing or wrong."""
        found = self.lookup(authorization)
        return False if found is None else found[0]


def load_entries(auth: AuthConfig) -> tuple[dict[str, str | None], list[str]]:
    """Keys from every configured source, and a line per source that yielded none (and why)."""
    entries: dict[str, str | None] = {}
    problems: list[str] = []
    if auth.api_keys_env:
        found = ApiKeys.parse(os.environ.get(auth.api_keys_env, ""))
        if not found:
            problems.append(f"${auth.api_keys_env} is unset or empty")
        entries.update(found)
    if auth.api_keys_file:
        try:
            found = ApiKeys.parse(Path(auth.api_keys_file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(f"api_keys_file {auth.api_keys_file} cannot be read ({type(exc).__name__})")
        else:
            if not found:
                problems.append(f"api_keys_file {auth.api_keys_file} holds no key")
            entries.update(found)
    if not auth.api_keys_env and not auth.api_keys_file:
        problems.append("neither service.auth.api_keys_env nor service.auth.api_keys_file is set")
    return entries, problems


def refused_on_bind(auth: AuthConfig, host: str, allow_open: bool) -> str | None:
    """Why ``auth`` may not serve on ``host`` (None: it may): an open service on a non-loopback
    address without ``--allow-open``. The same rule at start and at every policy reload, so a
    reload can never open what start refused."""
    if auth.mode == "open" and host not in LOOPBACK and not allow_open:
        return (
            f"mode is 'open' on {host}: bind to 127.0.0.1, configure API keys (mode: keys), or "
            "start with --allow-open"
        )
    return None


class Authenticator:
    """The policy's auth mode with its live key set."""

    def __init__(self, auth: AuthConfig, keys: ApiKeys, source: str = "") -> None:
        self.config = auth
        self.keys = keys
        self.source = source
        self._file_text = self._read_file()

    @property
    def open(self) -> bool:
        return self.config.mode == "open"

    @classmethod
    def from_policy(cls, policy: Policy) -> Authenticator:
        """Raises ``PolicyError`` (naming the key sources) when keys are required and none loads."""
        auth = policy.service.auth
        if auth.mode == "open":
            return cls(auth, ApiKeys({}), policy.source)
        entries, problems = load_entries(auth)
        if not entries:
            raise PolicyError(
                policy.source,
                [
                    PolicyIssue(
                        "service.auth",
                        "mode is 'keys' but no API key could be loaded: "
                        + "; ".join(problems)
                        + " (set the keys, or mode: open for a loopback development server)",
                    )
                ],
            )
        for problem in problems:
            log.warning("auth: %s", problem)
        return cls(auth, ApiKeys(entries), policy.source)

    def _read_file(self) -> str | None:
        if not self.config.api_keys_file:
            return None
        try:
            return Path(self.config.api_keys_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None

    def refresh(self) -> bool:
        """Re-read the keys file when it changed; True when the key set was replaced.

        A file that cannot be read (mid-swap, briefly unmounted) keeps the current keys; a file that
        reads but holds no key revokes them all (fail closed: every request gets 401).
        """
        if self.open or not self.config.api_keys_file:
            return False
        # Read it whole each time (a few hundred bytes): a Kubernetes Secret update swaps a symlink,
        # which neither the path's mtime nor an inotify watch on it reliably shows.
        text = self._read_file()
        if text is None:
            if self._file_text is not None:
                log.error(
                    "auth: api_keys_file %s cannot be read; keeping the current keys",
                    self.config.api_keys_file,
                )
            self._file_text = None
            return False
        if text == self._file_text:
            return False
        self._file_text = text
        entries, _ = load_entries(self.config)
        if not entries:
            log.error("auth: %s holds no key; every request is refused", self.config.api_keys_file)
        self.keys = ApiKeys(entries)
        log.info("auth: %d API key(s) loaded from %s", len(self.keys), self.config.api_keys_file)
        return True

    def authenticate(self, headers: Mapping[str, str]) -> Caller | None:
        """The caller, or None when a key is required and missing or wrong (401)."""
        header_tenant = None
        if self.config.trust_tenant_header:
            raw = headers.get("x-tenant", "").strip()
            header_tenant = raw[:MAX_TENANT_CHARS] or None
        if self.open:
            return Caller(header_tenant, header_tenant)
        authorization = headers.get("authorization")
        if not authorization and headers.get("x-api-key"):  # Anthropic's header, same keys
            authorization = "Bearer " + headers["x-api-key"]
        found = self.keys.lookup(authorization)
        if found is None:
            return None
        tenant, fingerprint = found
        if tenant == GATEWAY_TENANT:  # a gateway acts for the tenant it names, else as itself
            tenant = header_tenant
        return Caller(tenant, tenant or fingerprint)


class AdminKeys:
    """The keys that may call state-changing admin endpoints (``/admin/...``): their own set, apart
    from the API keys, from a file (a mounted Secret, re-read on every admin call, so rotation needs
    no restart) and/or ``$TIERED_ROUTER_ADMIN_KEYS``. With none configured those endpoints are closed."""

    def __init__(self, file: str | None = None, env: str = ADMIN_KEYS_ENV) -> None:
        self.file = file
        self.env = env

    def _keys(self) -> ApiKeys:
        entries = ApiKeys.parse(os.environ.get(self.env, ""))
        if self.file:
            try:
                entries.update(ApiKeys.parse(Path(self.file).read_text(encoding="utf-8")))
            except (OSError, UnicodeDecodeError) as exc:
                log.error("auth: admin keys file %s cannot be read (%s)", self.file, type(exc).__name__)
        return ApiKeys(entries)

    def check(self, headers: Mapping[str, str]) -> bool | None:
        """True for a valid admin key, False for a missing or wrong one, None when no admin key is
        configured (admin actions disabled)."""
        keys = self._keys()
        if not keys.enabled:
            return None
        authorization = headers.get("authorization")
        if not authorization and headers.get("x-api-key"):
            authorization = "Bearer " + headers["x-api-key"]
        return keys.lookup(authorization) is not None
