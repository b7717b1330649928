"""Routing overhead through ``POST /v1/route`` (HTTP parse + classify + decide, no generation),
against ``GET /healthz`` (the same server and HTTP stack doing nothing) as the baseline, at
1, 10 and 50 concurrent clients on loopback.

Three views per request: client-observed latency (includes the client and queueing on the same
two cores), time inside the app from ``Server-Timing: app;dur=`` (HTTP parse to response start,
including waits behind other requests on the event loop), and the decision itself from
``route;dur=`` (classify + decide + response body).
Writes benchmarks/results/routing_overhead.{json,png}.

    python -m benchmarks.routing_overhead [--policy policies/default.yaml] [--requests 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import percentile, plot_path, serve, write_json

ROOT = Path(__file__).resolve().parents[1]


def load_prompts(n: int = 400) -> list[str]:
    rows = [
        json.loads(line) for line in (ROOT / "classifier/data/heldout.jsonl").read_text().splitlines() if line
    ]
    random.Random(0).shuffle(rows)
    return [r["prompt"] for r in rows[:n]]


async def drive(
    url: str, method: str, path: str, bodies: list[Any] | None, concurrency: int, total: int
) -> dict[str, Any]:
    client_ms: list[float] = []
    server_ms: list[float] = []
    route_ms: list[float] = []
    errors = 0
    counter = iter(range(total))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(c: httpx.AsyncClient) -> None:
        nonlocal errors
        for i in counter:
            started = time.perf_counter()
            if method == "GET":
                r = await c.get(path)
            else:
                assert bodies is not None
                r = await c.post(path, json=bodies[i % len(bodies)])
            client_ms.append((time.perf_counter() - started) * 1000)
            if r.status_code != 200:
                errors += 1
            for part in r.headers.get("server-timing", "").split(","):
                name, _, dur = part.strip().partition(";dur=")
                if dur:
                    (server_ms if name == "app" else route_ms).append(float(dur))

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as c:
        await c.get("/healthz")
        started = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    out = {
        "requests": total,
        "errors": errors,
        "rps": total / elapsed,
        "client_p50_ms": percentile(client_ms, 0.5),
        "client_p99_ms": percentile(client_ms, 0.99),
    }
    if server_ms:
        out.update(
            {"server_p50_ms": percentile(server_ms, 0.5), "server_p99_ms": percentile(server_ms, 0.99)}
        )
    if route_ms:
        out.update(
            {"decision_p50_ms": percentile(route_ms, 0.5), "decision_p99_ms": percentile(route_ms, 0.99)}
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", default=str(ROOT / "policies/default.yaml"))
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--port", type=int, default=18080)
    args = parser.parse_args()
    with serve(args.policy, args.port) as (url, _):
        bodies = [{"messages": [{"role": "user", "content": p}]} for p in load_prompts()]
        rows = []
        for concurrency in (1, 10, 50):
            n = args.requests if concurrency > 1 else args.requests // 3
            base = asyncio.run(drive(url, "GET", "/healthz", None, concurrency, n))
            route = asyncio.run(drive(url, "POST", "/v1/route", bodies, concurrency, n))
            row = {
                "concurrency": concurrency,
                "healthz": base,
                "route": route,
                "client_p99_ratio": route["client_p99_ms"] / base["client_p99_ms"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_json(
        "routing_overhead", {"policy": args.policy, "rows": rows, "target": {"route_p99_ms_at_50": 3.0}}
    )
    _plot(rows)


def _plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [str(r["concurrency"]) for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    a1.plot(c, [r["route"]["server_p99_ms"] for r in rows], "o-", label="/v1/route server-side p99")
    a1.plot(c, [r["route"]["server_p50_ms"] for r in rows], "o--", label="/v1/route server-side p50")
    a1.plot(c, [r["healthz"].get("server_p99_ms", 0) for r in rows], "s:", label="/healthz server-side p99")
    a1.axhline(3.0, color="red", lw=0.8, label="target 3 ms")
    a1.set_xlabel("concurrent clients")
    a1.set_ylabel("ms")
    a1.set_title("Time inside the app")
    a1.legend(fontsize=8)
    a2.plot(c, [r["route"]["client_p99_ms"] for r in rows], "o-", label="/v1/route client p99")
    a2.plot(c, [r["healthz"]["client_p99_ms"] for r in rows], "s--", label="/healthz client p99 (baseline)")
    a2.set_xlabel("concurrent clients")
    a2.set_ylabel("ms")
    a2.set_title("Client-observed (client shares the 2 cores)")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot_path("routing_overhead"), dpi=120)


if __name__ == "__main__":
    main()
