"""Shadow mode's cost to real traffic: the same workload with shadowing off and at 100 %.

    python -m benchmarks.shadow [--policy policies/default.yaml] [--requests 48] [--concurrency 4]

Both runs serve the given policy (the embedded default: three real tiers); the second adds a
``shadow:`` section that samples every request routed by a score rule (``sample: 1.0``) for the
tier above, with the shipped caps (``max_concurrent: 2``, ``max_busy_fraction: 0.5``). The
workload is identical: held-out corpus prompts, greedy, ``Cache-Control: no-cache``, a fixed
number of clients. Reported: client latency percentiles per run, the share of answers identical
between the runs (greedy decoding; batching differences can flip rare ties), and the shadow
counters (started / recorded / preempted / skipped) from ``/metrics``. Shadowing runs twice: with
``preempt`` (the default: a real request cancels running shadow answers) and without.
Writes benchmarks/results/shadow.json and shadow.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.common import percentile, plot_path, serve, write_json

ROOT = Path(__file__).resolve().parents[1]


def prompts(n: int) -> list[str]:
    rows = [json.loads(x) for x in (ROOT / "classifier/data/heldout.jsonl").read_text().splitlines() if x]
    random.Random(1).shuffle(rows)
    return [r["prompt"] for r in rows if len(r["prompt"]) < 400][:n]


async def workload(url: str, items: list[str], concurrency: int, max_tokens: int) -> list[dict[str, Any]]:
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for i, p in enumerate(items):
        queue.put_nowait((i, p))
    results: list[dict[str, Any]] = [{} for _ in items]

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            i, prompt = queue.get_nowait()
            start = time.perf_counter()
            r = await http.post(
                url + "/v1/chat/completions",
                json={
                    "model": "auto",
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                },
                headers={"cache-control": "no-cache"},
            )
            body = r.json()
            results[i] = {
                "latency_s": time.perf_counter() - start,
                "status": r.status_code,
                "tier": r.headers.get("x-router-tier"),
                "text": body["choices"][0]["message"]["content"] if r.status_code == 200 else None,
            }

    async with httpx.AsyncClient(timeout=300) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return results


def shadow_counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("router_shadow_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            result = labels.split('result="')[1].split('"')[0]
            out[result] = out.get(result, 0.0) + float(value)
    return out


def run(policy: Path, items: list[str], concurrency: int, max_tokens: int, port: int) -> dict[str, Any]:
    admin = port + 100  # /metrics lives on the operator port
    with serve(policy, port, extra_args=("--admin-port", str(admin))) as (url, _):
        asyncio.run(workload(url, items[:concurrency], concurrency, max_tokens))  # warm-up
        start = time.perf_counter()
        results = asyncio.run(workload(url, items, concurrency, max_tokens))
        wall = time.perf_counter() - start
        time.sleep(2.0)  # let the last shadow answers finish before reading the counters
        counters = shadow_counters(f"http://127.0.0.1:{admin}")
    lat = [r["latency_s"] for r in results if r["status"] == 200]
    return {
        "wall_s": round(wall, 2),
        "ok": len(lat),
        "p50_s": round(percentile(lat, 0.5), 3),
        "p90_s": round(percentile(lat, 0.9), 3),
        "p99_s": round(percentile(lat, 0.99), 3),
        "mean_s": round(sum(lat) / max(1, len(lat)), 3),
        "shadow": counters,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shadow", description=__doc__)
    parser.add_argument("--policy", default=str(ROOT / "policies/default.yaml"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--port", type=int, default=18471)
    args = parser.parse_args(argv)

    items = prompts(args.requests)
    base = yaml.safe_load(Path(args.policy).read_text())
    score_rules = [r["name"] for r in base["routing"]["rules"] if "score" in r["name"]]
    with tempfile.TemporaryDirectory() as tmp:
        off_path, on_path = Path(tmp) / "off.yaml", Path(tmp) / "on.yaml"
        off_path.write_text(yaml.safe_dump(base, sort_keys=False))
        base["shadow"] = {
            "enabled": True,
            "sample": 1.0,
            "rules": score_rules,
            "max_concurrent": 2,
            "max_busy_fraction": 0.5,
            "max_tokens": args.max_tokens,
            "log_path": str(Path(tmp) / "shadow.jsonl"),
            "record_content": False,
        }
        on_path.write_text(yaml.safe_dump(base, sort_keys=False))
        base["shadow"]["preempt"] = False
        base["shadow"]["log_path"] = str(Path(tmp) / "shadow-nopreempt.jsonl")
        keep_path = Path(tmp) / "on-nopreempt.yaml"
        keep_path.write_text(yaml.safe_dump(base, sort_keys=False))
        off = run(off_path, items, args.concurrency, args.max_tokens, args.port)
        on = run(on_path, items, args.concurrency, args.max_tokens, args.port + 1)
        keep = run(keep_path, items, args.concurrency, args.max_tokens, args.port + 2)
        logged = {
            name: sum(1 for _ in f.open()) if f.exists() else 0
            for name, f in (
                ("preempt", Path(tmp) / "shadow.jsonl"),
                ("no_preempt", Path(tmp) / "shadow-nopreempt.jsonl"),
            )
        }

    def compare(other: dict[str, Any]) -> dict[str, Any]:
        pairs = list(zip(off["results"], other["results"], strict=True))
        return {
            **{k: v for k, v in other.items() if k != "results"},
            "identical_answers": f"{sum(a['text'] == b['text'] for a, b in pairs)}/{len(pairs)}",
            "identical_tiers": f"{sum(a['tier'] == b['tier'] for a, b in pairs)}/{len(pairs)}",
            "p50_change_pct": round(100 * (other["p50_s"] / off["p50_s"] - 1), 1),
            "p90_change_pct": round(100 * (other["p90_s"] / off["p90_s"] - 1), 1),
        }

    summary = {
        "requests": len(items),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "shadow_off": {k: v for k, v in off.items() if k != "results"},
        "shadow_on_preempt": compare(on),
        "shadow_on_no_preempt": compare(keep),
        "shadow_lines_logged": logged,
    }
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for name, r in (("shadow off", off), ("shadow 100 %, preempt", on), ("shadow 100 %, no preempt", keep)):
        lat = sorted(x["latency_s"] for x in r["results"] if x["status"] == 200)
        ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=f"{name}: p50 {r['p50_s']} s")
    ax.set_xlabel("client latency (s)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"{len(items)} requests, {args.concurrency} clients, embedded default tiers")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(plot_path("shadow"))
    path = write_json("shadow", summary)
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
