"""Which ASGI server in front of the router: uvicorn as ``serve`` runs it (httptools + uvloop +
``router.http.server``'s guards), plain uvicorn, hypercorn and granian, on the same app (tiny tiers).

Per server: keep-alive throughput and latency over 32 connections for 5 s on ``/healthz`` (the
server and middleware alone) and ``/v1/models`` (a routed litestar handler), then a slow-loris
check: 300 connections from one address that never finish their request head - how many the
server still holds after 1 s and after its header timeout, and whether another client address is
served meanwhile.

hypercorn and granian are not project dependencies; install them aside for the measurement:

    .venv/bin/pip install --target /tmp/asgi granian==2.8.7 hypercorn==0.18.0
    flock /tmp/bench.lock env ASGI_EXTRA=/tmp/asgi .venv/bin/python -m benchmarks.asgi_servers
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import write_json

ROOT = Path(__file__).resolve().parents[1]

APP = """
import os
from router.http.app import create_app
app = create_app(os.environ["BENCH_POLICY"], watch_policy=False)
"""
GUARDED = """
import sys
import uvicorn
from app import app
from router.http.server import ServerLimits, uvicorn_config
cfg = uvicorn_config(app, "127.0.0.1", int(sys.argv[1]), ServerLimits(), lifespan="on", log_level="warning")
uvicorn.Server(cfg).run()
"""


def servers(py: str, tmp: Path) -> dict[str, Any]:
    uvicorn = [
        "-m",
        "uvicorn",
        "app:app",
        "--http",
        "httptools",
        "--loop",
        "uvloop",
        "--log-level",
        "warning",
        "--port",
    ]
    hypercorn = ["-m", "hypercorn", "app:app", "--read-timeout", "10", "--log-level", "warning", "--bind"]
    granian = [
        "-m",
        "granian",
        "--interface",
        "asgi",
        "--loop",
        "uvloop",
        "--http",
        "1",
        "--http1-header-read-timeout",
        "10000",
    ]
    granian += ["--log-level", "warning", "--host", "127.0.0.1", "--port"]
    return {
        "uvicorn (plain)": lambda p: [py, *uvicorn, str(p)],
        "uvicorn (guarded, serve)": lambda p: [py, str(tmp / "guarded.py"), str(p)],
        "hypercorn": lambda p: [py, *hypercorn, f"127.0.0.1:{p}"],
        "granian": lambda p: [py, *granian, str(p), "app:app"],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _conn(port: int, path: str, deadline: float, lat: list[float]) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    req = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        w.write(req)
        head = await r.readuntil(b"\r\n\r\n")
        n = next(
            (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")),
            0,
        )
        await r.readexactly(n)
        lat.append(time.perf_counter() - t)
    w.close()


async def load(port: int, path: str, conns: int = 32, secs: float = 5.0) -> dict[str, float]:
    lat: list[float] = []
    deadline = time.perf_counter() + secs
    await asyncio.gather(*(_conn(port, path, deadline, lat) for _ in range(conns)))
    lat.sort()
    return {
        "rps": round(len(lat) / secs),
        "p50_ms": round(lat[len(lat) // 2] * 1000, 2),
        "p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 2),
    }


def _alive(s: socket.socket) -> bool:
    """Still held by the server: no EOF (a 408/429 it wrote before closing is read and dropped)."""
    s.setblocking(False)
    try:
        while s.recv(65536):
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def slow_loris(port: int, n: int = 300, wait_s: float = 12.0) -> dict[str, Any]:
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        except OSError:
            break
    time.sleep(1.0)
    started = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0)) as c:
            c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            ok = c.recv(20).startswith(b"HTTP/1.1 200")
    except OSError:
        ok = False
    other_ms = round((time.perf_counter() - started) * 1000, 1)
    held_1s = sum(_alive(s) for s in socks)
    time.sleep(wait_s)
    held_after = sum(_alive(s) for s in socks)
    for s in socks:
        s.close()
    return {
        "opened": len(socks),
        "held_after_1s": held_1s,
        f"held_after_{wait_s + 1:.0f}s": held_after,
        "other_client_served": ok,
        "other_client_ms": other_ms,
    }


def main() -> None:
    from tests.fixtures import build_tiny_model, tiny_policy_yaml

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = build_tiny_model(tmp / "tiny")
        (tmp / "policy.yaml").write_text(tiny_policy_yaml(model, cache_enabled=False))
        (tmp / "app.py").write_text(APP)
        (tmp / "guarded.py").write_text(GUARDED)
        path = [str(tmp), str(ROOT)] + ([os.environ["ASGI_EXTRA"]] if os.environ.get("ASGI_EXTRA") else [])
        env = dict(os.environ, BENCH_POLICY=str(tmp / "policy.yaml"), PYTHONPATH=":".join(path))
        env["TIERED_ROUTER_TORCH_THREADS"] = "1"
        out: dict[str, Any] = {}
        for name, cmd in servers(sys.executable, tmp).items():
            port = free_port()
            proc = subprocess.Popen(
                cmd(port), env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                for _ in range(600):
                    try:
                        if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.1)
                else:
                    out[name] = {"error": "never became ready (not installed?)"}
                    continue
                out[name] = {
                    "healthz": asyncio.run(load(port, "/healthz")),
                    "models": asyncio.run(load(port, "/v1/models")),
                    "slow_loris": slow_loris(port),
                }
                print(name, out[name], flush=True)
            finally:
                proc.terminate()
                proc.wait(20)
    write_json("asgi_servers", {"servers": out})


if __name__ == "__main__":
    main()
