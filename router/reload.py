"""Policy hot reload: watch the file, validate, build what changed, swap atomically.

The file is polled by content hash, which also sees Kubernetes ConfigMap updates (an atomic swap
of the ``..data`` symlink: the path stays, its target changes). A valid edit that only touches
routing, tenants or service settings swaps the policy object at once; an edit that changes a
tier's engine (model, precision, sizes, draft) builds the new engines in the background while the
old ones keep serving, then swaps, then retires the old engines when their last request is done.
A broken edit changes nothing: the errors are logged and ``router_policy_reload_failures_total``
rises. Requests already decided keep their tier and finish under the policy they started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from router.auth import ApiKeys
from router.backends import LocalTier, build_tiers, engine_key
from router.errors import PolicyError
from router.policy.loader import parse_policy

if TYPE_CHECKING:
    from router.policy.schema import Policy
    from router.service import RouterService

__all__ = ["PolicyWatcher", "apply_policy"]

log = logging.getLogger(__name__)


def _digest(path: Path) -> tuple[str, str] | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return hashlib.sha256(text.encode()).hexdigest(), text


def _needs_new_engines(old: Policy, new: Policy) -> bool:
    if list(old.tiers) != list(new.tiers):
        return True
    return any(engine_key(old.tiers[n]) != engine_key(new.tiers[n]) for n in new.tiers)


async def apply_policy(app: Any, new: Policy) -> None:
    """Swap ``new`` in (building engines first when needed). Raises on failure, changing nothing."""
    state = app.state
    service: RouterService = state.service
    old_policy = service.policy
    old_tiers = service.tiers
    if old_tiers is not None and _needs_new_engines(old_policy, new):
        log.info("policy reload: tier engines changed; building them in the background")
        tiers = await asyncio.to_thread(
            build_tiers, new, state.worker, observer=state.telemetry, reuse=old_tiers
        )
        service.policy, service.tiers = new, tiers
        kept = {id(b) for b in tiers.tiers.values()}
        retired = [b for b in old_tiers.tiers.values() if id(b) not in kept]
        for backend in retired:
            asyncio.get_running_loop().create_task(_retire(state.worker, backend))
    else:
        if old_tiers is not None:
            for name, backend in old_tiers.tiers.items():
                backend.cfg = new.tiers[name]  # generation defaults may have changed
        service.policy = new
    state.api_keys = ApiKeys.from_policy(new)


async def _retire(worker: Any, backend: Any) -> None:
    """Drop an old engine once it has no request left (in-flight ones finish on it)."""
    if isinstance(backend, LocalTier):
        while backend.engine.has_work():
            await asyncio.sleep(0.2)
        worker.remove_engine(backend.engine)
    else:
        while backend.client.in_flight:
            await asyncio.sleep(0.2)
        await backend.client.aclose()


class PolicyWatcher:
    def __init__(self, path: Path, app: Any, interval_s: float = 0.5) -> None:
        self.path = path
        self.app = app
        self.interval_s = interval_s
        current = _digest(path)
        self._seen = current[0] if current else None
        self._task: asyncio.Task[None] | None = None
        self.last_error: PolicyError | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception:  # never let the watcher die
                log.exception("policy watcher error")

    async def check(self) -> bool:
        """Reload when the file's content changed; returns True when a new policy was applied."""
        current = _digest(self.path)
        if current is None or current[0] == self._seen:
            return False
        digest, text = current
        self._seen = digest
        telemetry = self.app.state.telemetry
        try:
            policy = parse_policy(text, str(self.path))
            await apply_policy(self.app, policy)
        except PolicyError as exc:
            self.last_error = exc
            telemetry.policy_reload_failures.inc()
            log.error("policy reload rejected; the previous policy stays in force.\n%s", exc.render())
            return False
        except Exception as exc:
            telemetry.policy_reload_failures.inc()
            log.error(
                "policy reload failed while building tiers; the previous policy stays in force: %s", exc
            )
            return False
        self.last_error = None
        telemetry.policy_reloads.inc()
        log.info("policy reloaded from %s (%s)", self.path, digest[:12])
        return True
