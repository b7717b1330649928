"""Load harness: async httpx clients on loopback drive the service (a subprocess) with a realistic
prompt mix (the classifier's held-out prompts, so every tier gets traffic), mixed lengths and
streaming/non-streaming, at rising concurrency. Bounded in count and time; stops by itself.

Modes:
  (default)   rising concurrency 1, 4, 16, 48; per-level throughput, TTFT/e2e p50/p95/p99 per tier,
              rejections by status, errors.
  --overload  runs ``benchmarks/overload.py``: 1x then 4x the configured capacity side by side,
              goodput, accepted TTFT, rejection latency, fairness between two tenants.
  --soak      steady load for --seconds while sampling the server's RSS: memory must stay flat.

Writes benchmarks/results/load.json (+ load.png), overload.json or soak.json (+ png).

    python -m benchmarks.load [--overload | --soak] [--seconds N] [--policy FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import percentile, plot_path, serve, write_json

ROOT = Path(__file__).resolve().parents[1]


def prompts() -> list[str]:
    rows = [json.loads(x) for x in (ROOT / "classifier/data/heldout.jsonl").read_text().splitlines() if x]
    random.Random(1).shuffle(rows)
    return [r["prompt"][:4000] for r in rows]


class Stats:
    def __init__(self) -> None:
        self.status: Counter[int] = Counter()
        self.problems: list[str] = []
        self.ttft: dict[str, list[float]] = defaultdict(list)
        self.e2e: dict[str, list[float]] = defaultdict(list)
        self.tokens = 0

    def summary(self, elapsed: float) -> dict[str, Any]:
        tiers = sorted(set(self.e2e) | set(self.ttft))
        return {
            "seconds": round(elapsed, 1),
            "requests": sum(self.status.values()),
            "status": dict(self.status),
            "ok_rps": self.status[200] / elapsed,
            "tokens_per_s": self.tokens / elapsed,
            "problems": self.problems[:10],
            "num_problems": len(self.problems),
            "per_tier": {
                t: {
                    "n": len(self.e2e[t]),
                    "ttft_p50_s": percentile(self.ttft[t], 0.5),
                    "ttft_p95_s": percentile(self.ttft[t], 0.95),
                    "ttft_p99_s": percentile(self.ttft[t], 0.99),
                    "e2e_p50_s": percentile(self.e2e[t], 0.5),
                    "e2e_p95_s": percentile(self.e2e[t], 0.95),
                    "e2e_p99_s": percentile(self.e2e[t], 0.99),
                }
                for t in tiers
            },
        }


async def one(c: httpx.AsyncClient, prompt: str, rng: random.Random, stats: Stats) -> None:
    stream = rng.random() < 0.5
    max_tokens = rng.choice([16, 32, 64])
    body = {
        "model": "auto",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": rng.choice([0.0, 0.7]),
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    started = time.perf_counter()
    try:
        if stream:
            async with c.stream(
                "POST", "/v1/chat/completions", json=body, headers={"cache-control": "no-cache"}
            ) as r:
                first = None
                lines = []
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        if first is None and '"content":"' in line and '"content":""' not in line:
                            first = time.perf_counter() - started
                status, headers = r.status_code, r.headers
                text = "\n".join(lines)
        else:
            r = await c.post("/v1/chat/completions", json=body, headers={"cache-control": "no-cache"})
            status, headers, text, first = r.status_code, r.headers, r.text, None
    except httpx.HTTPError as exc:
        stats.problems.append(f"transport error: {type(exc).__name__}: {exc}")
        stats.status[-1] += 1
        return
    elapsed = time.perf_counter() - started
    stats.status[status] += 1
    tier = headers.get("x-router-tier", "?")
    if status == 200:
        if stream:
            if not text.rstrip().endswith("data: [DONE]") or '"error"' in text:
                stats.problems.append("stream ended without [DONE] or with an error")
                return
            usage = json.loads(text.rstrip().splitlines()[-2][5:])["usage"]
            stats.ttft[tier].append(first if first is not None else elapsed)
        else:
            usage = json.loads(text)["usage"]
            stats.ttft[tier].append(elapsed)
        stats.tokens += usage["completion_tokens"]
        stats.e2e[tier].append(elapsed)
        if usage["completion_tokens"] < 1 or usage["completion_tokens"] > max_tokens:
            stats.problems.append(f"bad completion size {usage['completion_tokens']}")
    elif status in (429, 503):
        if "retry-after" not in headers:
            stats.problems.append(f"{status} without Retry-After")
    else:
        stats.problems.append(f"unexpected status {status}: {text[:200]}")


async def run_level(url: str, concurrency: int, seconds: float, pool: list[str], seed: int) -> dict[str, Any]:
    stats = Stats()
    deadline = time.monotonic() + seconds
    not_ready = 0

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=180) as c:
            while time.monotonic() < deadline:
                await one(c, rng.choice(pool), rng, stats)

    async def watch() -> None:
        nonlocal not_ready
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            while time.monotonic() < deadline:
                if (await c.get("/readyz")).status_code != 200:
                    not_ready += 1
                await asyncio.sleep(1)

    started = time.perf_counter()
    await asyncio.gather(watch(), *(client(i) for i in range(concurrency)))
    out = stats.summary(time.perf_counter() - started)
    out.update({"concurrency": concurrency, "readyz_not_200": not_ready})
    return out


def server_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(("router_running_requests{", "router_waiting_requests{")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", default=str(ROOT / "policies/default.yaml"))
    parser.add_argument("--overload", action="store_true")
    parser.add_argument("--soak", action="store_true")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--port", type=int, default=18082)
    args = parser.parse_args()
    if args.overload:
        from benchmarks import overload

        overload.run(seconds=args.seconds, port=args.port)
        return
    pool = prompts()
    with serve(args.policy, args.port) as (url, pid):
        asyncio.run(run_level(url, 4, 5, pool, seed=99))  # warm-up
        warm_rss = server_rss_mb(pid)
        if args.soak:
            samples: list[tuple[float, float]] = []

            async def sample() -> None:
                t0 = time.monotonic()
                while time.monotonic() - t0 < args.seconds:
                    samples.append((time.monotonic() - t0, server_rss_mb(pid)))
                    await asyncio.sleep(2)

            async def both() -> dict[str, Any]:
                res, _ = await asyncio.gather(run_level(url, 16, args.seconds, pool, seed=11), sample())
                return res

            result = asyncio.run(both())
            time.sleep(2)
            result.update(
                {
                    "rss_after_warmup_mb": warm_rss,
                    "rss_samples": samples,
                    "gauges_after": gauges(url),
                    "rss_growth_pct": 100 * (samples[-1][1] - warm_rss) / warm_rss,
                }
            )
            write_json("soak", result)
            _plot_soak(samples)
            print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}, indent=2))
        else:
            levels = []
            for c in (1, 4, 16, 48):
                res = asyncio.run(run_level(url, c, args.seconds / 2, pool, seed=c))
                print(
                    json.dumps({k: res[k] for k in ("concurrency", "ok_rps", "tokens_per_s", "status")}),
                    flush=True,
                )
                levels.append(res)
            write_json("load", {"policy": args.policy, "levels": levels})
            _plot_levels(levels)


def _plot_levels(levels: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [lv["concurrency"] for lv in levels]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    a1.plot(c, [lv["tokens_per_s"] for lv in levels], "o-", label="generated tokens/s")
    a1.plot(c, [lv["ok_rps"] * 10 for lv in levels], "s--", label="completed requests/s x10")
    a1.set_xlabel("concurrent clients")
    a1.legend(fontsize=8)
    a1.set_title("Throughput")
    for tier in ("small", "medium", "large"):
        a2.plot(
            c,
            [lv["per_tier"].get(tier, {}).get("ttft_p95_s", float("nan")) for lv in levels],
            "o-",
            label=f"{tier} TTFT p95",
        )
    a2.set_xlabel("concurrent clients")
    a2.set_ylabel("s")
    a2.set_yscale("log")
    a2.legend(fontsize=8)
    a2.set_title("Time to first token p95 by tier")
    fig.tight_layout()
    fig.savefig(plot_path("load"), dpi=120)


def _plot_soak(samples: list[tuple[float, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s[0] for s in samples], [s[1] for s in samples])
    ax.set_xlabel("seconds")
    ax.set_ylabel("server RSS, MB")
    ax.set_title("Soak: RSS under steady load")
    ax.set_ylim(0, max(s[1] for s in samples) * 1.2)
    fig.tight_layout()
    fig.savefig(plot_path("soak"), dpi=120)


if __name__ == "__main__":
    main()
