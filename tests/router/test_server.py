"""``tiered-router serve`` as a process: the admin listener, the open-mode guard, and the HTTP
limits (slow-loris heads, slow bodies, connections per client)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
KEYED = "{mode: keys, api_keys_env: TEST_SERVE_KEYS}"


def wait_ready(url: str, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"serve exited {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}"
            )
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server never became ready")


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    policy = tmp_path_factory.mktemp("serve") / "policy.yaml"
    policy.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False, auth=KEYED))
    port, admin = free_port(), free_port()
    env = dict(os.environ, TEST_SERVE_KEYS="sk-serve", TIERED_ROUTER_TORCH_THREADS="1")
    args = ["--port", str(port), "--admin-port", str(admin), "--header-timeout", "1", "--body-timeout", "1"]
    args += ["--max-connections-per-client", "4"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--policy", str(policy), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
    try:
        wait_ready(url, proc)
        yield url, admin_url
    finally:
        proc.terminate()
        proc.wait(30)


KEY = {"authorization": "Bearer sk-serve"}


def test_operator_endpoints_live_on_the_admin_port_only(served: tuple[str, str]) -> None:
    url, admin = served
    for path in ("/metrics", "/dashboard", "/dashboard/data", "/schema/openapi.json"):
        assert httpx.get(url + path).status_code == 404, path
        assert httpx.get(url + path, headers=KEY).status_code == 404, path  # not even with a key
        assert httpx.get(admin + path).status_code == 200, path
    assert "router_requests_total" in httpx.get(admin + "/metrics").text
    assert httpx.get(admin + "/v1/models").status_code == 404  # the API is not on the admin port
    assert httpx.get(url + "/v1/models", headers=KEY).status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    data = httpx.get(admin + "/dashboard/data").text
    assert "/tmp" not in data and "http://" not in data  # no paths or upstream URLs


def test_a_slow_loris_client_holds_at_most_its_share(served: tuple[str, str]) -> None:
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    held = []
    for _ in range(10):  # trickle a request head that never completes
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        held.append(s)
    refused = 0
    for s in held:
        # Over the cap: a 429 once the head is overdue (never a close before a request could be
        # sent); within it: the 408 of the header timeout.
        s.settimeout(5)
        try:
            first = s.recv(4096)
        except TimeoutError:
            continue
        refused += first.startswith(b"HTTP/1.1 429")
    assert refused == 6  # 4 per client address
    # Another client (another loopback address) is served meanwhile.
    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    assert other.get(url + "/v1/models", headers=KEY).status_code == 200
    # The held heads time out (408) after --header-timeout, freeing the client's share.
    time.sleep(1.2)
    for s in held:
        s.settimeout(1)
        try:
            data = s.recv(4096)
        except (TimeoutError, ConnectionError):
            data = b""
        assert data == b"" or data.startswith((b"HTTP/1.1 408", b"HTTP/1.1 429"))
        s.close()
    assert httpx.get(url + "/v1/models", headers=KEY).status_code == 200


def test_a_stalled_body_is_cut_with_408(served: tuple[str, str]) -> None:
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-serve\r\n"
            b'Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"model":'
        )
        s.settimeout(5)
        started = time.monotonic()
        data = b""
        while b'"request_timeout"' not in data and (part := s.recv(4096)):
            data += part
        assert data.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 3
        assert b'"request_timeout"' in data


def test_open_mode_is_refused_on_a_public_address(tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            "--policy",
            str(policy),
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 2 and "mode is 'open'" in res.stderr.replace(
        "service.auth.mode is 'open'", "mode is 'open'"
    )


@pytest.mark.parametrize(
    ("auth", "env", "named"),
    [
        (KEYED, "", "$TEST_SERVE_KEYS"),
        ("{mode: keys, api_keys_file: /nonexistent/keys}", None, "/nonexistent/keys"),
        ("{mode: keys}", None, "api_keys_env"),
    ],
)
def test_keys_mode_without_keys_refuses_to_start(
    tiny_model_dir: Path, tmp_path: Path, auth: str, env: str | None, named: str
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False, auth=auth))
    environ = dict(os.environ)
    environ.pop("TEST_SERVE_KEYS", None)
    if env is not None:
        environ["TEST_SERVE_KEYS"] = env
    res = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--policy", str(policy), "--port", str(free_port())],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 2, res.stderr
    assert "service.auth" in res.stderr and named in res.stderr


def test_a_taken_admin_port_moves_operator_endpoints_behind_auth(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False, auth=KEYED))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "router.cli",
                "serve",
                "--policy",
                str(policy),
                "--port",
                str(port),
                "--admin-port",
                str(taken.getsockname()[1]),
            ],
            cwd=ROOT,
            env=dict(os.environ, TEST_SERVE_KEYS="sk-serve", TIERED_ROUTER_TORCH_THREADS="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc)
            assert httpx.get(url + "/metrics").status_code == 401
            assert httpx.get(url + "/metrics", headers=KEY).status_code == 200
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=30)
        assert "admin port" in out and "behind auth" in out


def _exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` on a fresh connection and read until the server closes or 5 s pass."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(request)
        s.settimeout(5)
        data = b""
        try:
            while part := s.recv(65536):
                data += part
                if b"\r\n\r\n" in data and b"content-length: 0" not in data.lower():
                    head, _, body = data.partition(b"\r\n\r\n")
                    length = [ln for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length:")]
                    if length and len(body) >= int(length[0].split(b":")[1]):
                        break
        except (TimeoutError, ConnectionError):
            pass
        return data


def test_over_the_client_cap_a_request_gets_a_whole_429_and_probes_still_pass(
    served: tuple[str, str],
) -> None:
    """Issue 37: the per-client cap wrote a raw 429 and closed connections before their request
    was sent (clients read a reset), and refused the readiness probe too, so a busy pod behind a
    proxy (one client address) was marked unready."""
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]  # the cap: 4
    try:
        for s in held:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # heads still coming
        refused = _exchange(
            port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-serve\r\n\r\n"
        )
        assert refused.startswith(b"HTTP/1.1 429"), refused[:200]
        head, _, body = refused.partition(b"\r\n\r\n")
        assert b"retry-after: 1" in head.lower()
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        for probe in (b"/readyz", b"/healthz"):
            answer = _exchange(port, b"GET " + probe + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200"), (probe, answer[:200])
    finally:
        for s in held:
            s.close()
