"""The litestar app: ``create_app`` wires routes (``router.http.routes``), the middleware
(``router.http.middleware``) and the lifespan (``router.http.lifespan``).

``create_app`` validates the policy and the API keys it configures before anything starts: a
broken policy, or ``auth.mode: keys`` with no key loadable, raises ``PolicyError`` (``serve`` exits
non-zero naming the source).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Litestar
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig

from router.backends.tierset import TierSet
from router.http.admin import ADMIN_ROUTES
from router.http.auth import AdminKeys, Authenticator
from router.http.bridge.messages import MESSAGES_ROUTES
from router.http.bridge.responses import RESPONSES_ROUTES
from router.http.lifespan import make_lifespan
from router.http.middleware import admin_listener, router_middleware
from router.http.routes import ROUTES, error_response
from router.pipeline.response_store import ResponseStore
from router.policy.loader import load_policy

__all__ = ["admin_listener", "create_app"]


def create_app(
    policy_path: str | Path,
    *,
    classifier: Any = None,
    tiers: TierSet | None = None,
    watch_policy: bool = True,
    reload_interval_s: float = 0.5,
    admin_separate: bool = False,
    body_timeout_s: float = 30.0,
    admin_keys: AdminKeys | None = None,
) -> Litestar:
    """Build the app for ``policy_path`` (validated now: a broken file raises ``PolicyError``).

    ``tiers`` lets tests inject prebuilt tiers; normally they load in the background at startup.
    ``admin_separate``: operator endpoints (``/metrics``, ``/dashboard``, ``/schema``) are served
    only through ``admin_listener(app)`` on another port; otherwise they need an API key.
    ``body_timeout_s``: longest pause between two request body chunks (408 past it).
    ``admin_keys``: who may call ``/admin/...`` (classifier reload), on either port; by default
    only ``$TIERED_ROUTER_ADMIN_KEYS``, and with no key set those endpoints are closed (403).
    """
    policy = load_policy(policy_path)
    auth = Authenticator.from_policy(policy)
    lifespan = make_lifespan(
        policy,
        Path(policy_path),
        classifier=classifier,
        tiers=tiers,
        watch_policy=watch_policy,
        reload_interval_s=reload_interval_s,
    )
    return Litestar(
        route_handlers=[*ROUTES, *RESPONSES_ROUTES, *MESSAGES_ROUTES, *ADMIN_ROUTES],
        lifespan=[lifespan],
        middleware=[router_middleware],
        exception_handlers={Exception: error_response},
        # The middleware enforces the live policy's service.max_body_bytes (it follows reloads).
        request_max_body_size=None,
        openapi_config=OpenAPIConfig(title="tiered-router", version="0.1.0", path="/schema"),
        state=State(
            {
                "policy_path": str(policy_path),
                "auth": auth,
                "admin_separate": admin_separate,
                "body_timeout_s": body_timeout_s,
                "admin_keys": admin_keys or AdminKeys(),
                "response_store": ResponseStore(),
            }
        ),
        debug=False,
    )
