"""A well-behaved tenant alone, then beside an abusive one (issue 37), side by side in one run.

The default policy (tenants from ``x-tenant``, open mode on loopback) serves two tenants. The
well-behaved one runs ``--polite`` closed-loop streaming clients (short prompts, ``model: auto``,
48 tokens). Phase 1: it runs alone for ``--seconds``. Phase 2: the same, while the abusive
tenant's ``--hostile`` clients loop over every hostile request issue 37 names: fresh
5,000-property schemas, fresh schemas just under the size bound (compiled off the loop), 1 MB
prompts, whole-vocabulary ``logit_bias``, n=16 answers of 256 tokens, and floods of
``/v1/route`` and ``/v1/feedback``; and issue 55's: a 5,000-digit ``logit_bias`` key,
``max_tokens: 10**30``, n=16 x 4,096 tokens, 100 metadata pairs, one 140 KB ``pattern``, 1 MB
``count_tokens`` bodies, 30,000 tool results, 1 MB stored responses, stored-response lookups and
model lists; two connections send a request head that never ends. A poller reads ``/healthz``
every 50 ms throughout.

Per phase: the polite tenant's TTFT p50/p99 and tok/s (completion tokens of complete answers per
second), ``/healthz`` latency p50/p99/max, and the hostile requests' status counts.

Acceptance: polite tok/s beside the abuser >= 80 % of alone; its TTFT p99 <= 2x alone;
``/healthz`` p99 <= 100 ms beside the abuser; no hostile request answered 5xx.

    flock /tmp/bench.lock python -m benchmarks.abuse [--seconds 30] [--port 8099]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.common import percentile, plot_path, serve, write_json

ROOT = Path(__file__).resolve().parents[1]
POLITE = {"x-tenant": "polite", "cache-control": "no-cache"}
HOSTILE = {"x-tenant": "hostile", "cache-control": "no-cache"}
MAX_TOKENS = 48


def bench_policy() -> Path:
    data = yaml.safe_load((ROOT / "policies/default.yaml").read_text())
    auth = data.setdefault("service", {}).setdefault("auth", {})
    auth.update({"mode": "open", "trust_tenant_header": True})
    auth.pop("api_keys_env", None)
    out = Path(tempfile.mkdtemp()) / "abuse.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def prompts() -> list[str]:
    rows = [json.loads(x) for x in (ROOT / "classifier/data/heldout.jsonl").read_text().splitlines() if x]
    random.Random(7).shuffle(rows)
    return [r["prompt"][:400] for r in rows]


async def polite_client(
    client: httpx.AsyncClient, url: str, texts: list[str], stop_at: float, log: list[dict[str, Any]]
) -> None:
    i = 0
    while time.monotonic() < stop_at:
        body = {
            "model": "auto",
            "messages": [{"role": "user", "content": texts[i % len(texts)]}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        i += 1
        started = time.monotonic()
        ttft = None
        tokens = 0
        status = 0
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=POLITE) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if (
                        ttft is None
                        and chunk.get("choices")
                        and chunk["choices"][0].get("delta", {}).get("content")
                    ):
                        ttft = time.monotonic() - started
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
        except httpx.HTTPError:
            status = -1
        log.append({"status": status, "ttft": ttft, "tokens": tokens, "end": time.monotonic()})
        if status != 200:
            await asyncio.sleep(1.0)


def _schema(props: int) -> dict[str, Any]:
    tag = random.getrandbits(40)  # fresh every time: no compile cache hit
    return {
        "type": "object",
        "properties": {f"p{tag}_{i}": {"type": "string"} for i in range(props)},
        "required": [],
    }


def hostile_requests(n: int) -> list[tuple[str, dict[str, Any]]]:
    """One round of every hostile request (path, body): issue 55's shapes first, then issue 37's."""
    chat = "/v1/chat/completions"
    msg = [{"role": "user", "content": "hi"}]
    return [
        # Issue 55's shapes: fields past their bounds, work hidden in one node, client-sized
        # work on other endpoints, the stored-response store.
        (chat, {"model": "auto", "messages": msg, "max_tokens": 2, "logit_bias": {"5" * 5000: 1}}),
        (chat, {"model": "auto", "messages": msg, "max_tokens": 10**30}),
        (chat, {"model": "auto", "messages": msg, "max_tokens": 4096, "n": 16}),
        (
            chat,
            {
                "model": "auto",
                "messages": msg,
                "max_tokens": 2,
                "metadata": {str(i): "v" for i in range(100)},
            },
        ),
        (
            chat,
            {
                "model": "small",
                "messages": msg,
                "max_tokens": 2,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "pattern",
                        "schema": {"type": "string", "pattern": "(a|b)*c" * 20_000},
                    },
                },
            },
        ),
        (
            "/v1/messages/count_tokens",
            {"model": "small", "messages": [{"role": "user", "content": "count " * 150_000}]},
        ),
        (
            "/v1/chat/completions",
            {
                "model": "auto",
                "max_tokens": 2,
                "messages": [
                    msg[0],
                    {"role": "assistant", "content": "", "tool_calls": [_CALL]},
                    *({"role": "tool", "tool_call_id": "c", "content": "r"} for _ in range(30_000)),
                ],
            },
        ),
        (
            "/v1/responses",
            {"model": "auto", "input": "keep " * 150_000, "max_output_tokens": 2, "store": True},
        ),
        ("GET /v1/responses/resp_" + f"{n:032x}", {}),
        ("GET /v1/models", {}),
        (
            chat,
            {
                "model": "auto",
                "messages": msg,
                "max_tokens": 8,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "big", "schema": _schema(5000)},
                },
            },
        ),
        (
            chat,
            {
                "model": "small",
                "messages": msg,
                "max_tokens": 8,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "edge", "schema": _schema(900)},
                },
            },
        ),
        (chat, {"model": "auto", "messages": [{"role": "user", "content": "x " * 480_000}], "max_tokens": 8}),
        (
            chat,
            {
                "model": "auto",
                "messages": msg,
                "max_tokens": 8,
                "logit_bias": {str(i): 1 for i in range(49152)},
            },
        ),
        ("/v1/route", {"messages": [{"role": "user", "content": "route " * 200}]}),
        ("/v1/feedback", {"id": f"chatcmpl-{n}", "score": 0.0}),
        # Last: a long n=16 answer (minutes on two cores) ends each round.
        (chat, {"model": "auto", "messages": msg, "max_tokens": 256, "n": 16, "ignore_eos": True}),
    ]


_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}


async def hostile_client(client: httpx.AsyncClient, url: str, stop_at: float, statuses: Counter[str]) -> None:
    n = 0
    while time.monotonic() < stop_at:
        for path, body in hostile_requests(n):
            if time.monotonic() >= stop_at:
                return
            n += 1
            try:
                if path.startswith("GET "):
                    r = await client.get(url + path[4:], headers=HOSTILE, timeout=60)
                else:
                    r = await client.post(url + path, json=body, headers=HOSTILE, timeout=60)
                statuses[f"{path.split('/resp_')[0]} {r.status_code}"] += 1
            except httpx.HTTPError as exc:
                statuses[f"{path} {type(exc).__name__}"] += 1


async def header_flood(url: str, stop_at: float, statuses: Counter[str]) -> None:
    """A request head that never ends: one header line written 8 KB at a time until the server
    cuts the connection (431 or a close), then again."""
    host, port = url.removeprefix("http://").split(":")
    while time.monotonic() < stop_at:
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Flood: ")
            sent = 0
            while time.monotonic() < stop_at:
                writer.write(b"a" * 8192)
                await writer.drain()
                sent += 8192
                if reader.at_eof():
                    break
            head = await asyncio.wait_for(reader.read(64), timeout=5)
            statuses[f"header flood {head[9:12].decode(errors='replace') or 'closed'}"] += 1
            writer.close()
        except (OSError, TimeoutError) as exc:
            statuses[f"header flood {type(exc).__name__}"] += 1
        await asyncio.sleep(0.05)


async def probe(client: httpx.AsyncClient, url: str, stop_at: float, out: list[float]) -> None:
    while time.monotonic() < stop_at:
        started = time.monotonic()
        with contextlib.suppress(httpx.HTTPError):
            await client.get(url + "/healthz", timeout=30)
        out.append((time.monotonic() - started) * 1000)
        await asyncio.sleep(0.05)


async def phase(url: str, seconds: float, polite: int, hostile: int) -> dict[str, Any]:
    texts = prompts()
    log: list[dict[str, Any]] = []
    health: list[float] = []
    statuses: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        started = time.monotonic()
        stop_at = started + seconds
        tasks = [polite_client(client, url, texts[i::polite], stop_at, log) for i in range(polite)]
        tasks += [hostile_client(client, url, stop_at, statuses) for _ in range(hostile)]
        tasks += [header_flood(url, stop_at, statuses) for _ in range(2 if hostile else 0)]
        tasks.append(probe(client, url, stop_at, health))
        await asyncio.gather(*tasks)
    # Every answer started in the phase counts, over the time until the last one ended.
    ok = [e for e in log if e["status"] == 200]
    ttfts = [e["ttft"] * 1000 for e in ok if e["ttft"] is not None]
    span = max([seconds, *(e["end"] - started for e in ok)])
    return {
        "polite_requests": len(log),
        "polite_ok": len(ok),
        "polite_statuses": dict(Counter(str(e["status"]) for e in log)),
        "polite_tok_s": sum(e["tokens"] for e in ok) / span,
        "polite_ttft_p50_ms": percentile(ttfts, 0.5),
        "polite_ttft_p99_ms": percentile(ttfts, 0.99),
        "healthz_p50_ms": percentile(health, 0.5),
        "healthz_p99_ms": percentile(health, 0.99),
        "healthz_max_ms": max(health) if health else float("nan"),
        "hostile_statuses": dict(sorted(statuses.items())),
    }


def plot(alone: dict[str, Any], beside: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, key, title in (
        (axes[0], "polite_tok_s", "well-behaved tok/s"),
        (axes[1], "polite_ttft_p99_ms", "well-behaved TTFT p99 (ms)"),
        (axes[2], "healthz_p99_ms", "/healthz p99 (ms)"),
    ):
        ax.bar(["alone", "beside abuser"], [alone[key], beside[key]], color=["#4c72b0", "#dd8452"])
        ax.set_title(title)
    fig.suptitle("Issue 37: a well-behaved tenant alone vs beside an abusive one (default policy)")
    fig.tight_layout()
    path = plot_path("abuse")
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--polite", type=int, default=2)
    parser.add_argument("--hostile", type=int, default=4)
    args = parser.parse_args()
    with serve(bench_policy(), args.port) as (url, _):
        alone = asyncio.run(phase(url, args.seconds, args.polite, 0))
        beside = asyncio.run(phase(url, args.seconds, args.polite, args.hostile))
    result = {
        "seconds": args.seconds,
        "polite_clients": args.polite,
        "hostile_clients": args.hostile,
        "alone": alone,
        "beside_abuser": beside,
        "tok_s_ratio": beside["polite_tok_s"] / alone["polite_tok_s"] if alone["polite_tok_s"] else None,
        "ttft_p99_ratio": beside["polite_ttft_p99_ms"] / alone["polite_ttft_p99_ms"],
        "five_xx": sum(
            v for k, v in beside["hostile_statuses"].items() if k.rsplit(" ", 1)[-1].startswith("5")
        ),
    }
    result["acceptance"] = {
        "tok_s_at_least_80pct": (result["tok_s_ratio"] or 0) >= 0.8,
        "ttft_p99_within_2x": result["ttft_p99_ratio"] <= 2.0,
        "healthz_p99_at_most_100ms": beside["healthz_p99_ms"] <= 100.0,
        "no_5xx": result["five_xx"] == 0,
    }
    print(json.dumps(result, indent=2))
    write_json("abuse", result)
    plot(alone, beside)


if __name__ == "__main__":
    main()
