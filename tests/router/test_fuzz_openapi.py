"""Issue 55: schemathesis over the service's whole OpenAPI surface as a deployment runs it - keys
mode, the operator endpoints on an admin listener of their own (``admin_separate``), admin keys
configured - on both ports and as three callers: an API key on the API port, no key (or a wrong
one) on the API port, the admin key on the admin listener.

Every operation of the schema (read from the admin listener's ``/schema/openapi.json``; the API
port must not serve it) gets positive and negative data, derandomized and bounded. Asserted: no
5xx, every non-2xx body a clean error - OpenAI's ``{"error": {"message", "type", "param",
"code"}}``, Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on ``/v1/messages`` -
a caller without a key never gets past 401, and ``/healthz`` answers after each operation.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, free_port, start_server

KEYS_ENV = "TEST_FUZZ_OPENAPI_KEYS"
API_KEY = "sk-fuzz-openapi"
ADMIN_KEY = "sk-fuzz-admin"
PUBLIC = {"/healthz", "/health", "/readyz"}
OPERATOR = ("/metrics", "/dashboard", "/schema", "/admin/")
EXAMPLES = 8  # per operation, generation mode and caller: ~20 operations, bounded in time


@dataclass
class Deployment:
    api: Server
    admin_url: str


def _admin_listener(app: Any) -> Iterator[str]:
    import uvicorn

    from router.http.app import admin_listener

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(admin_listener(app), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def deployment(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from router.http.auth import AdminKeys

    root = tmp_path_factory.mktemp("fuzz-openapi")
    admin_keys = root / "admin-keys"
    admin_keys.write_text(ADMIN_KEY + "\n")
    os.environ[KEYS_ENV] = f"{API_KEY}:fuzz"
    policy = root / "policy.yaml"
    policy.write_text(
        tiny_policy_yaml(
            tiny_model_dir, cache_enabled=False, auth=f"{{mode: keys, api_keys_env: {KEYS_ENV}}}"
        )
        .replace("draft: small", "draft: null")
        .replace("draft: medium", "draft: null")
    )
    srv, stop = start_server(
        policy, watch_policy=False, admin_separate=True, admin_keys=AdminKeys(str(admin_keys))
    )
    try:
        for url in _admin_listener(srv.app):
            yield Deployment(srv, url)
    finally:
        stop()
        os.environ.pop(KEYS_ENV, None)


def clean_error(r: httpx.Response, *, anthropic: bool) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    err = body["error"]
    if anthropic:
        return (
            set(body) == {"type", "error"}
            and body["type"] == "error"
            and set(err) == {"type", "message"}
            and all(isinstance(v, str) and v for v in err.values())
        )
    return (
        set(body) == {"error"}
        and set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and bool(err["message"])
        and isinstance(err["type"], str)
        and all(err[k] is None or isinstance(err[k], str) for k in ("param", "code"))
    )


def _schema(dep: Deployment) -> Any:
    import schemathesis

    return schemathesis.openapi.from_url(dep.admin_url + "/schema/openapi.json")


def fuzz(
    dep: Deployment, base_url: str, headers: dict[str, str], *, admin_listener: bool = False
) -> tuple[list[str], dict[str, Counter[int]]]:
    """Every operation against ``base_url`` with ``headers``; the problems found and the statuses
    per operation."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    failures: list[str] = []
    statuses: dict[str, Counter[int]] = {}
    keyless = "authorization" not in headers and "x-api-key" not in headers
    for op in (r.ok() for r in _schema(dep).get_all_operations()):
        where = f"{op.method.upper()} {op.path}"
        seen = statuses.setdefault(where, Counter())
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES,
                derandomize=True,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(op.as_strategy(generation_mode=mode))
            def check(case: Any) -> None:
                resp = case.call(base_url=base_url, headers=headers, timeout=60)
                r = httpx.Response(resp.status_code, content=resp.content)
                seen[r.status_code] += 1  # noqa: B023 (check runs inside its own iteration)
                path: str = case.path
                # The Messages routes answer in Anthropic's shape where they are served: on the API
                # port. The admin listener does not serve them (404), in either shape.
                anthropic = path.startswith("/v1/messages") and not admin_listener
                what = f"{where} [{mode.value}]: {r.status_code} {r.text[:240]}"  # noqa: B023
                if r.status_code >= 500:
                    failures.append(what)
                elif r.status_code >= 300 and not (
                    clean_error(r, anthropic=anthropic)
                    or (admin_listener and clean_error(r, anthropic=not anthropic))
                    or (r.status_code in (304, 307, 308) and not r.content)
                ):
                    failures.append("unclean error body: " + what)
                elif keyless and path not in PUBLIC and r.status_code < 400:
                    failures.append("answered without a key: " + what)

            try:
                check()
            except Unsatisfiable:  # nothing to get wrong in a GET without parameters
                assert mode == schemathesis.GenerationMode.NEGATIVE, where
        health = httpx.get(dep.api.url + "/healthz", timeout=5)
        assert health.status_code == 200, f"/healthz after {where}: {health.status_code}"
    return failures, statuses


def test_the_schema_is_served_on_the_admin_listener_only(deployment: Deployment) -> None:
    paths = {op.ok().path for op in _schema(deployment).get_all_operations()}
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/models",
        "/healthz",
    } <= paths, paths
    for headers in ({}, {"authorization": f"Bearer {API_KEY}"}):
        r = httpx.get(deployment.api.url + "/schema/openapi.json", headers=headers, timeout=10)
        assert r.status_code == 404 and clean_error(r, anthropic=False), (r.status_code, r.text[:200])


def test_an_api_key_on_the_api_port(deployment: Deployment) -> None:
    failures, statuses = fuzz(deployment, deployment.api.url, {"authorization": f"Bearer {API_KEY}"})
    assert not failures, "\n".join(failures[:8])
    every = sum(statuses.values(), Counter())
    # Generated requests are answered (a 200 somewhere) and malformed ones told so (a 4xx).
    assert every[200] > 0 and any(400 <= s < 500 for s in every), statuses
    # Operator paths are not on the API port at all while the admin listener is separate.
    for where, seen in statuses.items():
        if where.split(" ", 1)[1].startswith(OPERATOR):
            assert set(seen) <= {404, 405}, (where, seen)
    deployment.api.wait_idle(30)


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer sk-wrong"}, {"x-api-key": ADMIN_KEY}],
    ids=["no-key", "wrong-key", "admin-key-is-no-api-key"],
)
def test_no_valid_key_on_the_api_port(deployment: Deployment, headers: dict[str, str]) -> None:
    """Catches any operation answered past auth, or a 401 that is not a clean error."""
    failures, statuses = fuzz(deployment, deployment.api.url, headers)
    assert not failures, "\n".join(failures[:8])
    for where, seen in statuses.items():
        path = where.split(" ", 1)[1]
        if path not in PUBLIC:
            assert set(seen) <= {401, 404, 405}, (where, seen)


def test_the_admin_key_on_the_admin_listener(deployment: Deployment) -> None:
    failures, statuses = fuzz(
        deployment, deployment.admin_url, {"authorization": f"Bearer {ADMIN_KEY}"}, admin_listener=True
    )
    assert not failures, "\n".join(failures[:8])
    for where, seen in statuses.items():
        path = where.split(" ", 1)[1]
        if not path.startswith(OPERATOR) and path not in PUBLIC:
            assert set(seen) <= {404, 405}, (where, seen)  # the API is not served here
    assert any(seen[200] for seen in statuses.values()), statuses


def test_no_key_on_the_admin_listener(deployment: Deployment) -> None:
    """Read-only operator endpoints stay open there; ``/admin/...`` is refused without its key."""
    failures, statuses = fuzz(deployment, deployment.admin_url, {}, admin_listener=True)
    # The read-only operator pages answer without a key by design: only /admin/ must refuse.
    failures = [f for f in failures if not (f.startswith("answered without a key") and "/admin/" not in f)]
    assert not failures, "\n".join(failures[:8])
    for where, seen in statuses.items():
        if where.split(" ", 1)[1].startswith("/admin/"):
            assert set(seen) <= {401, 403, 404, 405}, (where, seen)
