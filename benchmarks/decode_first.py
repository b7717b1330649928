"""Decode first, measured from outside: guidellm at a constant rate against the default policy with
``max_decode_slowdown`` as shipped vs off (``null`` on every tier: a prompt chunk may take half a
step's budget), each arm a fresh server, interleaved A B B A so a drifting VM shifts both alike.

What it shows: the inter-token latency's tail (p95 against p50: a new prompt's prefill stalling
every running stream) and the time to first token (what chunking a prompt costs it), per arm,
with the medians over the arm's runs and each run's figures.

guidellm runs from a venv of its own (``benchmarks/guidellm_rates.py`` says how to build it).
Writes benchmarks/results/decode_first.json and decode_first.png.

    python -m benchmarks.decode_first --guidellm /tmp/glvenv/bin/guidellm [--rate 1] [--requests 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import machine, serve, write_json
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
        "errored": sum(int(r.get("errored") or 0) for r in runs),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["arms"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (label, keys) in zip(
        axes,
        (
            ("inter-token latency (ms)", ("itl_ms_p50", "itl_ms_p95")),
            ("time to first token (ms)", ("ttft_ms_p50", "ttft_ms_p95")),
        ),
        strict=True,
    ):
        width = 0.35
        for i, key in enumerate(keys):
            values = [result["arms"][a][key] or 0 for a in arms]
            ax.bar([x + i * width for x in range(len(arms))], values, width, label=key.rsplit("_", 1)[1])
        ax.set_xticks([x + width / 2 for x in range(len(arms))], arms)
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
            with serve(policy, args.port, ready_timeout_s=1800) as (url, _):
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
            run = {"order": i, **figures(report)}
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
