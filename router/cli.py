"""``tiered-router`` command line: serve, route, policy check, classifier, models."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.http.server import ServerLimits
    from router.policy.schema import Policy

__all__ = ["main"]

log = logging.getLogger("tiered-router")

DEFAULT_POLICY = "policies/default.yaml"


def _policy_error_exit(exc: Exception) -> int:
    print(str(exc), file=sys.stderr)
    return 2


def _load_policy(path: str) -> Policy | None:
    """The validated policy, or None after printing every error (callers exit 2)."""
    from router.errors import PolicyError
    from router.policy.loader import load_policy

    try:
        return load_policy(path)
    except PolicyError as exc:
        _policy_error_exit(exc)
        return None


def cmd_policy_check(args: argparse.Namespace) -> int:

    policy = _load_policy(args.file)
    if policy is None:
        return 2
    for warning in _unknown_key_tenants(policy):
        print(f"warning: {warning}", file=sys.stderr)
    print(
        f"{args.file}: valid (version {policy.version}, tiers: {', '.join(policy.tiers)}, "
        f"{len(policy.routing.rules)} rules)"
    )
    return 0


def _unknown_key_tenants(policy: Policy) -> list[str]:
    """A line per tenant that the keys (where readable here) name but ``tenants`` does not: it
    gets ``tenants.default``'s caps, or the tiers every named tenant shares (never all of them)."""
    from router.http.auth import GATEWAY_TENANT, load_entries
    from router.policy.decide import unknown_tenant_tiers

    auth = policy.service.auth
    if auth.mode != "keys":
        return []
    entries, _ = load_entries(auth)
    named = {t for t in entries.values() if t is not None and t != GATEWAY_TENANT}
    unknown = sorted(named - set(policy.tenants))
    tiers = unknown_tenant_tiers(policy)
    caps = "all tiers" if tiers is None else "tiers " + ", ".join(tiers)
    return [f"tenants.{t}: named by an API key but not in the policy; it gets {caps}" for t in unknown]


def cmd_policy_plan(args: argparse.Namespace) -> int:
    """Weights + KV + activations per tier from configs alone; exit 2 when it cannot fit."""
    from tiers.models.plan import parse_memory, plan_policy

    policy = _load_policy(args.file)
    if policy is None:
        return 2
    total = parse_memory(args.device_memory, device_total=1) if args.device_memory else None
    try:
        plans = plan_policy(policy, total)
    except ValueError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 2
    gib = 1024**3
    print(f"{'tier':<10} {'model':<34} {'weights':>9} {'kv':>9} {'act':>8} {'total':>9} {'kv tokens':>10}")
    for t in plans:
        print(
            f"{t.tier:<10} {t.model[-34:]:<34} {t.weights_bytes / gib:8.2f}G {t.kv_bytes / gib:8.2f}G "
            f"{t.activation_bytes / gib:7.2f}G {t.total_bytes / gib:8.2f}G {t.kv_tokens:>10}"
        )
    need = sum(t.total_bytes for t in plans)
    print(f"{'all':<10} {'':<34} {'':>9} {'':>9} {'':>8} {need / gib:8.2f}G")
    problems = [
        f"tiers.{t.tier}: the KV pool holds {t.kv_tokens} tokens, less than max_model_len "
        f"{policy.tiers[t.tier].max_model_len}"
        for t in plans
        if t.kv_tokens < policy.tiers[t.tier].max_model_len
    ]
    if total is not None and need > total:
        problems.append(f"needs {need / gib:.2f} GiB, the device has {total / gib:.2f} GiB")
    for msg in problems:
        print(f"{args.file}: does not fit: {msg}", file=sys.stderr)
    return 2 if problems else 0


def cmd_route(args: argparse.Namespace) -> int:
    from classifier import ComplexityClassifier
    from router.errors import RouterError
    from router.policy.decide import RouteRequest, decide

    policy = _load_policy(args.policy)
    if policy is None:
        return 2
    clf = ComplexityClassifier.load(policy.service.classifier.path, device=policy.service.classifier.device)
    score = clf.score(args.prompt)
    headers = dict(h.lower().split(":", 1) for h in args.header) if args.header else {}
    request = RouteRequest(
        model=args.model,
        headers={k.strip(): v.strip() for k, v in headers.items()},
        tenant=args.tenant,
        prompt_tokens=len(args.prompt) // 4,
        text=args.prompt,  # what keyword and language conditions test
    )
    try:
        d = decide(policy, request, score)
    except RouterError as exc:
        print(json.dumps(exc.to_body()), file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "tier": d.tier,
                "score": round(score.value, 4),
                "rule": d.rule,
                "reason": d.reason,
                "predicted": score.tier,
                "probabilities": {k: round(v, 4) for k, v in score.probabilities.items()},
            },
            indent=2,
        )
    )
    return 0


def cmd_models_prepare(args: argparse.Namespace) -> int:
    from tiers.models.loading import ModelLoadError, materialize_embedded

    policy = _load_policy(args.policy)
    if policy is None:
        return 2
    names = sorted(
        {t.model.removeprefix("embedded:") for t in policy.tiers.values() if t.model.startswith("embedded:")}
    )
    for name in names:
        try:
            path = materialize_embedded(name)
        except ModelLoadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"embedded:{name} ready at {path}")
    if not names:
        print("no embedded models in this policy; nothing to prepare")
    return 0


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The ``serve`` options' HTTP limits (both listeners take them; the admin one uncapped)."""
    from router.http.server import ServerLimits

    return ServerLimits(
        header_timeout_s=args.header_timeout,
        max_head_bytes=args.max_header_bytes,
        body_timeout_s=args.body_timeout,
        keep_alive_s=args.keep_alive_timeout,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        trusted_proxies=frozenset(p.strip() for p in (args.trusted_proxies or "").split(",") if p.strip()),
    )


def admin_host(args: argparse.Namespace) -> str:
    """The admin listener's address: loopback unless ``--admin-host`` says otherwise (its read-only
    endpoints need no key, so a public bind must be asked for)."""
    return str(args.admin_host or "127.0.0.1")


def cmd_serve(args: argparse.Namespace) -> int:
    from router.errors import PolicyError
    from router.http.app import admin_listener, create_app
    from router.http.auth import AdminKeys, refused_on_bind
    from router.http.server import uvicorn_config

    admin = args.admin_port > 0
    limits = server_limits(args)
    try:
        app = create_app(
            args.policy,
            admin_separate=admin,
            body_timeout_s=limits.body_timeout_s,
            admin_keys=AdminKeys(args.admin_keys_file),
        )
    except PolicyError as exc:
        return _policy_error_exit(exc)
    app.state.bind = (args.host, args.allow_open)  # policy reloads are held to the same rule
    if refused_on_bind(app.state.auth.config, args.host, args.allow_open):
        print(
            f"refusing to serve {args.policy} without auth on {args.host}: its service.auth.mode is "
            "'open'. Bind to 127.0.0.1, configure API keys (mode: keys), or pass --allow-open.",
            file=sys.stderr,
        )
        return 2
    common = {"log_level": args.log_level, "timeout_graceful_shutdown": 10}
    config = uvicorn_config(
        app, args.host, args.port, limits, lifespan="on", access_log=args.access_log, **common
    )
    admin_config = (
        uvicorn_config(
            admin_listener(app),
            admin_host(args),
            args.admin_port,
            dataclasses.replace(limits, max_connections_per_client=0),  # operators are never capped
            lifespan="off",
            **common,
        )
        if admin
        else None
    )
    server = DrainingServer(config, app, admin_config)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(server.serve())
    return 0


def _loop_factory() -> Any:
    """uvloop when installed (a faster event loop for the HTTP side), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class DrainingServer:
    """uvicorn with Kubernetes-friendly SIGTERM handling.

    On SIGTERM/SIGINT: ``/readyz`` turns 503 and new generations get 503 while the socket stays
    open, in-flight requests get ``service.drain_timeout_s`` to finish, then the server stops; the
    lifespan cancels what is left and flushes telemetry. A second signal stops at once.
    """

    def __init__(self, config: Any, app: Any, admin_config: Any = None) -> None:
        import uvicorn

        self.app = app
        self.server = uvicorn.Server(config)
        self.admin = uvicorn.Server(admin_config) if admin_config is not None else None
        self._signals = 0

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        # uvicorn installs its own handlers inside serve(); ours replace them once it started.
        task = loop.create_task(self.server.serve())
        while not self.server.started and not task.done():
            await asyncio.sleep(0.05)
        admin_task = None
        if self.admin is not None and not task.done():
            admin_task = loop.create_task(self._serve_admin())
            while not self.admin.started and not admin_task.done():
                await asyncio.sleep(0.05)
            if admin_task.done():
                # The admin port could not be bound (e.g. another instance holds it): keep serving,
                # with the operator endpoints back on the API port behind auth - never silently open.
                log.error(
                    "admin port %s unavailable; /metrics, /dashboard and /schema are served on the API "
                    "port behind auth instead",
                    self.admin.config.port,
                )
                self.app.state.admin_separate = False
                admin_task = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        await task
        if admin_task is not None:
            self.admin.should_exit = True  # type: ignore[union-attr]
            await admin_task

    async def _serve_admin(self) -> None:
        assert self.admin is not None
        # uvicorn exits (SystemExit) when it cannot bind; that must not take the API down.
        with contextlib.suppress(SystemExit):
            await self.admin.serve()

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals > 1:
            for server in (self.server, self.admin):
                if server is not None:
                    server.force_exit = server.should_exit = True
            return
        asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        service = self.app.state.service
        timeout = service.policy.service.drain_timeout_s
        log.info("draining: waiting up to %.0fs for %d in-flight request(s)", timeout, service.in_flight)
        finished = await service.drain(timeout)
        if not finished:
            log.warning("drain timeout: cancelling %d request(s)", service.in_flight)
        self.server.should_exit = True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiered-router", description="A tiered model router with one OpenAI-compatible endpoint."
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    p.add_argument("--policy", default=DEFAULT_POLICY, help="policy YAML (hot-reloaded on change)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument(
        "--admin-port",
        type=int,
        default=8081,
        help="port for /metrics, /dashboard, /schema (unauthenticated there, 404 on the API port); "
        "0 = serve them on the API port behind auth",
    )
    p.add_argument(
        "--admin-host",
        default=None,
        help="address of the admin port (default: 127.0.0.1; set it to let a scraper in)",
    )
    p.add_argument(
        "--admin-keys-file",
        default=None,
        help="file of admin keys (one per line) for POST /admin/... (also $TIERED_ROUTER_ADMIN_KEYS); "
        "without one those endpoints answer 403",
    )
    p.add_argument(
        "--allow-open",
        action="store_true",
        help="allow a policy with service.auth.mode: open on a non-loopback address",
    )
    p.add_argument(
        "--header-timeout", type=float, default=10.0, help="seconds to receive a request head (408)"
    )
    p.add_argument(
        "--max-header-bytes",
        type=int,
        default=64 * 1024,
        help="largest request head (request line + headers) in bytes, counted as it arrives (431)",
    )
    p.add_argument("--body-timeout", type=float, default=30.0, help="longest pause between body chunks (408)")
    p.add_argument(
        "--keep-alive-timeout", type=int, default=5, help="idle keep-alive connections close after"
    )
    p.add_argument("--max-connections", type=int, default=1024, help="connections + requests; 503 beyond")
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        default=0,
        help="connections one client may hold (0 = no cap, the default; behind a proxy, set "
        "--trusted-proxies so its clients are told apart)",
    )
    p.add_argument(
        "--trusted-proxies",
        default="",
        help="comma-separated proxy addresses whose X-Forwarded-For names the client",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("route", help="print the routing decision for a prompt as JSON")
    p.add_argument("prompt")
    p.add_argument("--policy", default=DEFAULT_POLICY)
    p.add_argument("--model", default="auto")
    p.add_argument("--tenant", default=None)
    p.add_argument("--header", action="append", help="NAME:VALUE, repeatable")
    p.set_defaults(func=cmd_route)

    p = sub.add_parser("policy", help="policy tools")
    psub = p.add_subparsers(dest="policy_command", required=True)
    c = psub.add_parser("check", help="validate a policy file (exit 2 with every error)")
    c.add_argument("file")
    c.set_defaults(func=cmd_policy_check)
    c = psub.add_parser("plan", help="memory per tier (weights, KV, activations) without loading weights")
    c.add_argument("file")
    c.add_argument("--device-memory", default=None, help="e.g. 80GiB; fractions in the policy refer to it")
    c.set_defaults(func=cmd_policy_plan)

    p = sub.add_parser("models", help="model tools")
    msub = p.add_subparsers(dest="models_command", required=True)
    c = msub.add_parser("prepare", help="materialize the embedded models a policy uses into the cache")
    c.add_argument("--policy", default=DEFAULT_POLICY)
    c.set_defaults(func=cmd_models_prepare)

    from classifier.cli import register
    from router.policy.thresholds import write_thresholds

    register(sub, policy_writer=write_thresholds)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "policy" and not Path(args.file).exists():
        print(f"invalid policy {args.file}: file not found", file=sys.stderr)
        return 2
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
