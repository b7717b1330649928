"""Policy hot reload: watch the file, validate, build what changed, swap atomically.

The file is polled by content hash, which also sees Kubernetes ConfigMap updates (an atomic swap
of the ``..data`` symlink: the path stays, its target changes). Everything the policy configures
is rebuilt from the new file before anything is swapped: the API keys (a keys mode with no key
loadable rejects the edit), tier engines when a tier's engine changed (model, precision, sizes,
draft: built in the background while the old ones keep serving, retired when their last request
is done), the response cache when its settings changed, the classifier when its path changed, and
telemetry's ``record_content``; ``max_body_bytes`` and routing are read live from the policy. Then
all of it is swapped in one step on the event loop. A broken edit changes nothing: the errors are
logged and ``router_policy_reload_failures_total`` rises; so does an edit that start would have
refused on this bind (auth ``open`` on a public address without ``--allow-open``). A classifier
swapped in through the admin port while an edit builds stays unless the edit changes
``service.classifier``. Requests already decided keep their
tier and finish under the policy they started with (their cache entry is keyed on that decision).

A loop of its own re-reads the API keys file, so rotated and revoked keys apply within a tick,
even while a policy edit's engines are being built. A replaced engine is marked retired in the
swap, so a request that picked it before the swap but had not submitted yet goes to the new one;
it is removed once no request is left on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from router.backends.base import engine_key
from router.backends.local import LocalTier
from router.backends.tierset import build_tiers
from router.errors import PolicyError, PolicyIssue
from router.http.auth import Authenticator, refused_on_bind
from router.policy.loader import parse_policy

if TYPE_CHECKING:
    from router.pipeline.service import RouterService
    from router.policy.schema import Policy

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
    """Swap ``new`` in, with everything it configures built first. Raises on failure (a
    ``PolicyError`` for a policy that cannot run, e.g. keys mode with no key), changing nothing."""
    state = app.state
    service: RouterService = state.service
    old_policy = service.policy
    old_tiers = service.tiers
    bind = getattr(state, "bind", None)  # (host, allow_open) of the API listener, set by ``serve``
    refusal = refused_on_bind(new.service.auth, *bind) if bind is not None else None
    if refusal is not None:
        raise PolicyError(new.source, [PolicyIssue("service.auth.mode", refusal)])
    auth = Authenticator.from_policy(new)  # first: a keys mode without keys must not swap anything
    cache = service.cache
    if new.service.cache != old_policy.service.cache:
        from router.pipeline.cache import build_cache

        cache = await asyncio.to_thread(build_cache, new, state.telemetry)
    classifier = None  # None: the policy does not change it; keep whatever serves at the swap
    if new.service.classifier != old_policy.service.classifier and not getattr(
        state, "classifier_injected", False
    ):
        from classifier import ComplexityClassifier

        wanted = new.service.classifier
        classifier = await asyncio.to_thread(ComplexityClassifier.load, wanted.path, device=wanted.device)
    tiers = old_tiers
    retired: list[Any] = []
    if old_tiers is not None and _needs_new_engines(old_policy, new):
        log.info("policy reload: tier engines changed; building them in the background")
        tiers = await asyncio.to_thread(
            build_tiers, new, state.worker, observer=state.telemetry, reuse=old_tiers
        )
        kept = {id(b) for b in tiers.tiers.values()}
        retired = [b for b in old_tiers.tiers.values() if id(b) not in kept]
    # The swap: no await from here on, so no request sees half of it.
    if tiers is not None:
        for name, backend in tiers.tiers.items():
            backend.cfg = new.tiers[name]  # generation defaults may have changed
    for backend in retired:
        # A request that picked it before the swap and has not submitted yet (tokenizing, compiling
        # a grammar) sees this and goes to the new tier instead (RouterService._submit).
        backend.retired = True
    old_cache = service.cache
    service.policy, service.tiers, service.cache = new, tiers, cache
    if classifier is not None:
        # Only a changed ``classifier`` setting replaces the model: one swapped in through the
        # admin port while this reload built its tiers stays.
        service.classifier = classifier
    state.auth = auth
    state.telemetry.record_content = new.service.telemetry.record_content
    loop = asyncio.get_running_loop()
    for backend in retired:
        _background(loop.create_task(_retire(state.worker, backend)))
    if old_cache is not None and old_cache is not cache:
        _background(loop.create_task(old_cache.aclose()))


_TASKS: set[asyncio.Task[Any]] = set()


def _background(task: asyncio.Task[Any]) -> None:
    """Keep a reference until done (the loop holds only weak ones)."""
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


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
    def __init__(self, path: Path, app: Any, interval_s: float = 0.5, *, watch_policy: bool = True) -> None:
        self.path = path
        self.app = app
        self.interval_s = interval_s
        self.watch_policy = watch_policy
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
        # Keys on their own loop: a revoked key must not stay valid while a policy edit's engines
        # build (minutes for a large model).
        keys = asyncio.get_running_loop().create_task(self._run_keys())
        try:
            while self.watch_policy:
                await asyncio.sleep(self.interval_s)
                try:
                    await self.check()
                except Exception:  # never let the watcher die
                    log.exception("policy watcher error")
            await keys
        finally:
            keys.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keys

    async def _run_keys(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.app.state.auth.refresh()
            except Exception:
                log.exception("API key refresh error")

    async def check(self) -> bool:
        """Reload when the file's content changed; returns True when a new policy was applied."""
        current = _digest(self.path)
        if current is None or current[0] == self._seen:
            return False
        state = self.app.state
        if state.service.tiers is None and state.load_error is None:
            # The first tiers are still loading from the old policy: swapping now could leave a
            # new tier name without an engine. The edit stays unseen and applies once they are up.
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
