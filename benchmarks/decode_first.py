"""Decode first, measured from outside: guidellm at a constant rate against the default policy with
``max_decode_slowdown`` as shipped vs off (``null`` on every tier: a prompt chunk may take half a
step's budget), each arm a fresh server, interleaved A B B A so a drifting VM shifts both alike.

What it shows: guidellm's inter-token latency (a request's mean gap, p50 / p95 over requests) and
time to first token (what chunking a prompt costs it); and, from a probe client streaming long
answers throughout each run, every gap between two chunks of a running stream (p50 / p99 / max):
the stall a new prompt's prefill puts into the streams already running, which a per-request mean
spreads out. Per arm, the medians over its runs, and each run's figures.

guidellm runs from a venv of its own (``benchmarks/guidellm_rates.py`` says how to build it).
Writes benchmarks/results/decode_first.json and decode_first.png.

    python -m benchmarks.decode_first --guidellm /tmp/glvenv/bin/guidellm [--rate 1] [--requests 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.common import machine, percentile, serve, write_json
from benchmarks.guidellm_rates import run_guidellm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def policy_without_cap(source: Path, dest: Path) -> Path:
    """``source`` with ``max_decode_slowdown: null`` on every tier."""
    data = yaml.safe_load(source.read_text())
    for tier in data["tiers"].values():
        tier["max_decode_slowdown"] = None
    dest.write_text(yaml.safe_dump(data, sort_keys=False))
    return dest


def _dist(bench: dict[str, Any], metric: str) -> dict[str, float | None]:
    """p50 / p95 / p99 over successful requests of one of guidellm's distribution metrics."""
    summary = (bench.get("metrics", {}).get(metric) or {}).get("successful") or {}
    pct = summary.get("percentiles") or {}

    def get(key: str) -> float | None:
        value = pct.get(key)
        return round(float(value), 2) if value is not None else None

    return {"p50": get("p50") or summary.get("median"), "p95": get("p95"), "p99": get("p99")}


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """One run's figures (its single benchmark: one rate)."""
    (bench,) = report["benchmarks"]
    totals = bench.get("metrics", {}).get("request_totals") or {}
    itl = _dist(bench, "inter_token_latency_ms")
    ttft = _dist(bench, "time_to_first_token_ms")
    ratio = itl["p95"] / itl["p50"] if itl["p50"] and itl["p95"] else None
    return {
        "successful": totals.get("successful"),
        "errored": totals.get("errored"),
        "itl_ms": itl,
        "ttft_ms": ttft,
        "itl_p95_over_p50": round(ratio, 2) if ratio is not None else None,
    }


class GapProbe:
    """Streams greedy answers of ``tokens`` tokens one after another until stopped, recording the
    time between consecutive chunks of each stream (the first chunk, its prefill, excluded)."""

    def __init__(self, url: str, tokens: int = 128) -> None:
        self.url = url
        self.tokens = tokens
        self.gaps_ms: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GapProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        body = {
            "model": "auto",
            "messages": [{"role": "user", "content": "Count slowly from one to one hundred."}],
            "max_tokens": self.tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                last: float | None = None
                with client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            self.gaps_ms.append((now - last) * 1000)
                        last = now

    def figures(self) -> dict[str, float | int | None]:
        g = self.gaps_ms
        if not g:
            return {"gaps": 0, "p50": None, "p99": None, "max": None}
        return {
            "gaps": len(g),
            "p50": round(percentile(g, 0.5), 2),
            "p99": round(percentile(g, 0.99), 2),
            "max": round(max(g), 2),
        }


def _median(runs: list[dict[str, Any]], path: tuple[str, ...]) -> float | None:
    values = []
    for run in runs:
        node: Any = run
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            values.append(float(node))
    return round(statistics.median(values), 2) if values else None


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "runs": len(runs),
        "itl_ms_p50": _median(runs, ("itl_ms", "p50")),
        "itl_ms_p95": _median(runs, ("itl_ms", "p95")),
        "itl_p95_over_p50": _median(runs, ("itl_p95_over_p50",)),
        "ttft_ms_p50": _median(runs, ("ttft_ms", "p50")),
        "ttft_ms_p95": _median(runs, ("ttft_ms", "p95")),
        "stream_gap_ms_p50": _median(runs, ("stream_gap_ms", "p50")),
        "stream_gap_ms_p99": _median(runs, ("stream_gap_ms", "p99")),
        "stream_gap_ms_max": _median(runs, ("stream_gap_ms", "max")),
        "errored": sum(int(r.get("errored") or 0) for r in runs),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["arms"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (label, keys) in zip(
        axes,
        (
            ("guidellm inter-token latency (ms)", ("itl_ms_p50", "itl_ms_p95")),
            ("time to first token (ms)", ("ttft_ms_p50", "ttft_ms_p95")),
            (
                "gap between a running stream's chunks (ms)",
                ("stream_gap_ms_p50", "stream_gap_ms_p99", "stream_gap_ms_max"),
            ),
        ),
        strict=True,
    ):
        width = 0.8 / len(keys)
        for i, key in enumerate(keys):
            values = [result["arms"][a][key] or 0 for a in arms]
            ax.bar([x + i * width for x in range(len(arms))], values, width, label=key.rsplit("_", 1)[1])
        ax.set_xticks([x + width * (len(keys) - 1) / 2 for x in range(len(arms))], arms)
        ax.set_title(label)
        ax.legend()
    fig.suptitle(f"decode first: guidellm at {result['rate']} req/s on the default policy (medians of runs)")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--guidellm", default="guidellm")
    parser.add_argument("--policy", type=Path, default=ROOT / "policies/default.yaml")
    parser.add_argument("--port", type=int, default=8094)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--prompt-tokens", type=int, default=158)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--order", default="ABBA", help="A: as shipped, B: max_decode_slowdown null")
    parser.add_argument("--name", default="decode_first")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"shipped": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        off_policy = policy_without_cap(args.policy, Path(tmp) / "off.yaml")
        for i, arm in enumerate(args.order):
            name, policy = ("shipped", args.policy) if arm == "A" else ("off", off_policy)
            with serve(policy, args.port, ready_timeout_s=1800) as (url, _), GapProbe(url) as probe:
                report = run_guidellm(
                    args.guidellm,
                    url,
                    rates=[args.rate],
                    requests=args.requests,
                    prompt_tokens=args.prompt_tokens,
                    output_tokens=args.output_tokens,
                    request_format="chat",
                    out=Path(tmp) / f"run{i}.json",
                )
            run = {"order": i, **figures(report), "stream_gap_ms": probe.figures()}
            runs[name].append(run)
            print(name, json.dumps(run), flush=True)
    result = {
        "machine": machine(),
        "policy": str(args.policy.resolve().relative_to(ROOT))
        if args.policy.resolve().is_relative_to(ROOT)
        else str(args.policy),
        "rate": args.rate,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "order": args.order,
        "arms": {name: summary(r) for name, r in runs.items()},
        "runs": runs,
    }
    print(json.dumps(result["arms"], indent=2))
    write_json(args.name, result)
    plot(result, RESULTS / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
