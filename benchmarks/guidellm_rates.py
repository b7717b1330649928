"""guidellm (the vLLM project's load tool) against the service: a constant-rate benchmark at two
rates, over the API a team coming from vLLM points it at. guidellm sends vLLM's extensions
(``stream_options.continuous_usage_stats``, ``ignore_eos``); before they were honoured every one of
its requests was a 400. The run passes when no request errored.

guidellm is not a dependency of the service (it pins its own stack: datasets, sanic, pydantic...):
install it into a venv of its own (``python -m venv /tmp/glvenv && /tmp/glvenv/bin/pip install
torch==2.13.0 guidellm``) and name its executable with ``--guidellm``.

Writes benchmarks/results/guidellm.json.

    python -m benchmarks.guidellm_rates --guidellm /tmp/glvenv/bin/guidellm \
        [--policy policies/default.yaml] [--rates 0.5,1] [--requests 12] [--format chat|text|responses]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import machine, serve, write_json

ROOT = Path(__file__).resolve().parents[1]
FORMATS = {"chat": "/v1/chat/completions", "text": "/v1/completions", "responses": "/v1/responses"}


def _tokenizer_dir() -> Path:
    from tiers.models.loading import materialize_embedded

    return materialize_embedded("smollm2-135m-instruct")


def run_guidellm(
    guidellm: str,
    url: str,
    *,
    rates: list[float],
    requests: int,
    prompt_tokens: int,
    output_tokens: int,
    request_format: str,
    out: Path,
) -> dict[str, Any]:
    """One guidellm run (one benchmark per rate); returns its JSON report."""
    cmd = [
        guidellm,
        "run",
        "--backend",
        f"kind=openai_http,target={url},model=auto,request_format={FORMATS[request_format]}",
        "--profile",
        "kind=constant",
        "--override",
        "profile.rate",
        ",".join(str(r) for r in rates),
        "--constraint",
        f"kind=max_requests,count={requests}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
        "--tokenizer",
        f"kind=huggingface_auto,model={_tokenizer_dir()}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    env = dict(os.environ, GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL="WARNING")
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def _median(bench: dict[str, Any], metric: str) -> float | None:
    """The median over successful requests of one of guidellm's distribution metrics."""
    summary = (bench.get("metrics", {}).get(metric) or {}).get("successful") or {}
    value = summary.get("median")
    return round(float(value), 3) if value is not None else None


def _errors(requests: list[Any], keep: int = 3) -> dict[str, int]:
    """How often each error message (status and body, as guidellm recorded it) occurred; at most
    ``keep`` distinct messages, each cut to 200 characters."""
    counts: dict[str, int] = {}

    def walk(node: Any) -> str | None:
        if isinstance(node, dict):
            if isinstance(node.get("error"), str):
                return str(node["error"])
            for value in node.values():
                found = walk(value)
                if found is not None:
                    return found
        return None

    for request in requests:
        message = (walk(request) or "unknown")[:200]
        if message in counts or len(counts) < keep:
            counts[message] = counts.get(message, 0) + 1
    return counts


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per benchmark (one per rate): the strategy's rate and the request counts by outcome."""
    rows = []
    for bench in report.get("benchmarks", []):
        totals = bench.get("metrics", {}).get("request_totals") or bench.get("request_totals") or {}
        strategy = bench.get("config", {}).get("strategy", {}) or bench.get("scheduler", {}).get(
            "strategy", {}
        )
        rows.append(
            {
                "rate": strategy.get("rate"),
                "successful": totals.get("successful"),
                "errored": totals.get("errored"),
                "incomplete": totals.get("incomplete"),
                "total": totals.get("total"),
                "ttft_ms_p50": _median(bench, "time_to_first_token_ms"),
                "latency_s_p50": _median(bench, "request_latency"),
                "output_tokens_p50": _median(bench, "output_token_count"),
                "errors": _errors((bench.get("requests") or {}).get("errored") or []),
            }
        )
    return rows


def _shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--guidellm", default="guidellm", help="the guidellm executable")
    parser.add_argument("--policy", default=str(ROOT / "policies/default.yaml"))
    parser.add_argument("--port", type=int, default=8093)
    parser.add_argument("--rates", default="0.5,1")
    parser.add_argument("--requests", type=int, default=12, help="requests per rate")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--format", choices=sorted(FORMATS), default="chat")
    parser.add_argument("--name", default="guidellm", help="results file name (benchmarks/results/NAME.json)")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    # A shared, busy machine may take many minutes to load and warm up three tiers.
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve(args.policy, args.port, ready_timeout_s=1800) as (url, _),
    ):
        report = run_guidellm(
            args.guidellm,
            url,
            rates=rates,
            requests=args.requests,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            request_format=args.format,
            out=Path(tmp) / "report.json",
        )
    rows = summarize(report)
    result = {
        "machine": machine(),
        "policy": _shown(Path(args.policy)),
        "endpoint": FORMATS[args.format],
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "benchmarks": rows,
        "errored": sum(r["errored"] or 0 for r in rows),
        "ok": bool(rows) and all((r["errored"] or 0) == 0 and (r["successful"] or 0) > 0 for r in rows),
    }
    print(json.dumps(result, indent=2))
    write_json(args.name, result)
    if not result["ok"]:
        raise SystemExit("guidellm saw errored requests (or none succeeded)")


if __name__ == "__main__":
    main()
