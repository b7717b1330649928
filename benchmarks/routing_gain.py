"""Does routing pay off at every load? ``auto`` (static and load-aware routing) against always
``small`` and always ``large``, on one server, side by side at 1, 4, 16 and 48 clients.

The workload is bundled below: 24 open questions and 12 maths word problems, 64 tokens each,
greedy, ``Cache-Control: no-cache`` (every request generates). A closed loop of N clients sends
the prompts (the list twice at 48 clients, so every client has work); at each load the four
modes run back to back, ``--reps`` times (3), each time in a rotated order, and every figure is
the median over repetitions of the ratio to always-large measured in the same repetition: this
VM's speed drifts by up to 2x within minutes, and paired ratios cancel most of it.
The two ``auto`` modes are the default policy with ``routing.mode`` set to ``static`` or
``load_aware``: the server hot-reloads the file between phases (routing only: the engines stay).
Before the first measured phase every tier serves the prompts once at 1 and at 16 clients
(unmeasured): the speculation controller and the pacing model learn their step costs online, and
a cold first phase was 20-30 % slower than the same phase later, whichever mode it was.

Clients retry a 429/503 after its Retry-After (capped at 5 s), up to ten times. Reported
per load and mode: wall time, mean and p90 latency (retries included), completion tokens per
second, requests answered and goodput (answered per second), retries, the share of requests per
tier, and the quality proxy the policy implies - the share of prompts served below the tier their
score asks for (the static rules' tier, from ``/v1/route``).

    python -m benchmarks.routing_gain [--loads 1,4,16,48] [--reps 3] [--modes static,load_aware,small,large]
                                      [--merge] [--no-write] [--policy policies/default.yaml]

Writes benchmarks/results/routing_gain.json and routing_gain.png.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.common import machine, percentile, plot_path, read_json, serve, write_json

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 64
# A refused request (429/503) is retried after its Retry-After (capped), up to RETRIES times.
RETRIES = 10
RETRY_WAIT_CAP_S = 5.0
NO_CACHE = {"cache-control": "no-cache"}
MODES = ("static", "load_aware", "small", "large")

OPEN_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Give me a synonym for 'happy'.",
    "What does a thermometer measure?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Suggest a name for a pet goldfish.",
    "What is the opposite of 'ancient'?",
    "How many days are there in a leap year?",
    "Describe the taste of a lemon in one sentence.",
    "Translate 'good morning' into Spanish.",
    "List two benefits of regular exercise.",
    "Explain the difference between weather and climate.",
    "Compare the economic policies of Keynes and Hayek and their relevance today.",
    "Explain how public-key cryptography lets two strangers agree on a secret.",
    "Discuss the causes of the fall of the Western Roman Empire.",
    "How does a transformer neural network process a sentence?",
    "What are the trade-offs between microservices and a monolith?",
    "Explain why quicksort is fast on average but slow in the worst case.",
    "Analyse the ethical issues of using facial recognition in public spaces.",
    "How do vaccines train the immune system?",
    "Describe how a bill becomes a law in the United States.",
    "What would happen to Earth's climate if the Moon disappeared?",
    "Explain the central limit theorem with an example.",
]
WORD_PROBLEMS = [
    "Tom has 3 apples and buys 5 more. He gives 2 to his sister. How many apples does he have now?",
    "A train travels 60 km per hour for 2.5 hours. How far does it go?",
    "A shirt costs $20 and is on sale for 15% off. What is the sale price?",
    "Sara reads 12 pages a day. How many days does she need to finish a 180-page book?",
    "A rectangle is 8 cm long and 5 cm wide. What is its area and its perimeter?",
    "If 4 pencils cost $1.20, how much do 10 pencils cost?",
    "A baker makes 144 cookies and packs them in boxes of 12. How many boxes does he fill?",
    "Mike is twice as old as his son. In 10 years the sum of their ages will be 74. How old is Mike?",
    "A tank holds 500 litres and leaks 4% of its water every hour. How much is left after 3 hours?",
    "Two workers paint a fence in 6 hours together; one alone takes 10 hours. How long does the "
    "other take alone?",
    "A store sells notebooks at 3 for $4. Jenny spends $28 on notebooks. How many does she buy?",
    "The average of five numbers is 18. Four of them are 12, 20, 15 and 25. What is the fifth?",
]
PROMPTS = OPEN_QUESTIONS + WORD_PROBLEMS


def _set_mode(src: Path, dst: Path, mode: str) -> str:
    """Write ``src`` with ``routing.mode: mode`` to ``dst``; returns the policy's digest prefix."""
    doc = yaml.safe_load(src.read_text())
    doc.setdefault("routing", {})["mode"] = mode
    text = yaml.safe_dump(doc, sort_keys=False)
    dst.write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _route_body(prompt: str) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": prompt}]}


async def _await_policy(client: httpx.AsyncClient, digest: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = await client.post(
            "/v1/route", json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]}
        )
        if r.status_code == 200 and r.json().get("policy") == digest:
            return
        await asyncio.sleep(0.5)
    raise SystemExit(f"the server did not load policy {digest} within {timeout_s} s")


async def _floors(client: httpx.AsyncClient) -> dict[str, str]:
    """Each prompt's tier by its score (the static rules), from /v1/route."""
    out = {}
    for p in PROMPTS:
        r = await client.post(
            "/v1/route", json={"model": "auto", "messages": [{"role": "user", "content": p}]}
        )
        r.raise_for_status()
        out[p] = r.json()["tier"]
    return out


async def _phase(client: httpx.AsyncClient, clients: int, model: str, prompts: list[str]) -> dict[str, Any]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    latencies: list[float] = []
    served: list[tuple[str, str]] = []
    rules: Counter[str] = Counter()
    status: Counter[int] = Counter()
    tokens = 0
    answered = 0
    retries = 0

    async def worker() -> None:
        nonlocal tokens, answered, retries
        while True:
            try:
                prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            }
            started = time.perf_counter()
            for attempt in range(RETRIES + 1):
                r = await client.post("/v1/chat/completions", json=body, headers=NO_CACHE)
                status[r.status_code] += 1
                if r.status_code not in (429, 503) or attempt == RETRIES:
                    break
                # What the OpenAI SDKs do with a refusal: wait as told, then ask again.
                retries += 1
                await asyncio.sleep(min(float(r.headers.get("retry-after", "1")), RETRY_WAIT_CAP_S))
            latencies.append(time.perf_counter() - started)
            if r.status_code == 200:
                answered += 1
                tokens += r.json()["usage"]["completion_tokens"]
                served.append((prompt, r.headers["x-router-tier"]))
                rules[r.headers["x-router-rule"]] += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - started
    return {
        "wall_s": round(wall, 2),
        "mean_latency_s": round(sum(latencies) / len(latencies), 3),
        "p90_latency_s": round(percentile(latencies, 0.9), 3),
        "tokens_per_s": round(tokens / wall, 1),
        "requests": len(prompts),
        "answered": answered,
        "goodput_rps": round(answered / wall, 3),
        "retries": retries,
        "status": dict(status),
        "served": served,
        "rules": dict(rules.most_common(8)),
    }


async def _warm_up(client: httpx.AsyncClient, tiers: list[str]) -> None:
    for tier in tiers:
        print(f"warm-up {tier}", flush=True)
        await _phase(client, 1, tier, PROMPTS[:6])
        await _phase(client, 16, tier, PROMPTS)


async def run(
    policy: Path,
    loads: list[int],
    port: int,
    modes: tuple[str, ...] = MODES,
    reps: int = 1,
    on_load: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every load's phases; ``on_load`` gets the result so far after each load (a run cut
    short keeps what it measured)."""
    tiers = list(yaml.safe_load(policy.read_text())["tiers"])
    with tempfile.TemporaryDirectory() as tmp:
        live = Path(tmp) / "policy.yaml"
        _set_mode(policy, live, "static")
        with serve(live, port) as (url, _pid):
            async with httpx.AsyncClient(base_url=url, timeout=600) as client:
                await _await_policy(client, hashlib.sha256(live.read_bytes()).hexdigest()[:12])
                floors = await _floors(client)
                await _warm_up(client, tiers)
                rows = []
                turn = 0
                for clients in loads:
                    prompts = list(floors) * (2 if clients > len(floors) else 1)
                    for rep in range(reps):
                        # Rotating order: a drift in the machine's speed favours no mode.
                        for mode in modes[turn % len(modes) :] + modes[: turn % len(modes)]:
                            if mode in ("static", "load_aware"):
                                await _await_policy(client, _set_mode(policy, live, mode))
                            model = "auto" if mode in ("static", "load_aware") else mode
                            print(f"clients={clients} rep={rep} mode={mode}", flush=True)
                            res = await _phase(client, clients, model, prompts)
                            served = res.pop("served")
                            shares = Counter(t for _, t in served)
                            below = sum(1 for p, t in served if tiers.index(t) < tiers.index(floors[p]))
                            res |= {
                                "clients": clients,
                                "rep": rep,
                                "mode": mode,
                                "tier_share": {t: round(shares[t] / max(1, len(served)), 3) for t in tiers},
                                "below_score_share": round(below / max(1, len(served)), 3),
                            }
                            print(
                                f"  wall {res['wall_s']} s, mean {res['mean_latency_s']} s, "
                                f"{res['tokens_per_s']} tok/s, tiers {res['tier_share']}",
                                flush=True,
                            )
                            rows.append(res)
                        turn += 1
                    if on_load is not None:
                        on_load({"floors": dict(Counter(floors.values())), "rows": rows})
    return {"floors": dict(Counter(floors.values())), "rows": rows}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per load and mode, the median over repetitions of each repetition's ratio to always-large
    measured in the same rotation (paired: the machine's drift cancels within a repetition),
    and the range of those ratios."""
    out: dict[str, Any] = {}
    for clients in sorted({r["clients"] for r in rows}):
        reps = sorted({r["rep"] for r in rows if r["clients"] == clients})
        by = {(r["rep"], r["mode"]): r for r in rows if r["clients"] == clients}
        out[str(clients)] = {}
        for mode in sorted({m for _, m in by if m != "large"}):
            ratios: dict[str, list[float]] = {"wall": [], "mean_latency": [], "goodput": []}
            answered = []
            for rep in reps:
                large, row = by[(rep, "large")], by[(rep, mode)]
                ratios["wall"].append(large["wall_s"] / row["wall_s"])
                ratios["mean_latency"].append(large["mean_latency_s"] / row["mean_latency_s"])
                ratios["goodput"].append(row["goodput_rps"] / max(large["goodput_rps"], 1e-9))
                answered.append(f"{row['answered']}/{row['requests']}")
            out[str(clients)][mode] = {
                **{f"{k}_vs_large": round(statistics.median(v), 3) for k, v in ratios.items()},
                "wall_vs_large_range": [round(min(ratios["wall"]), 3), round(max(ratios["wall"]), 3)],
                "answered": answered,
            }
    return out


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Speed-up over always-large per load (the median of the paired ratios, bars: their range):
    absolute times would mix the machine's drift between repetitions into the comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = _summary(rows)
    loads = sorted(int(c) for c in summary)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode in ("load_aware", "static", "small"):
        got = [summary[str(c)].get(mode) for c in loads]
        xs = [c for c, g in zip(loads, got, strict=True) if g is not None]
        ys = [g for g in got if g is not None]
        if not ys:
            continue
        low = [g["wall_vs_large"] - g["wall_vs_large_range"][0] for g in ys]
        high = [g["wall_vs_large_range"][1] - g["wall_vs_large"] for g in ys]
        axes[0].errorbar(
            xs, [g["wall_vs_large"] for g in ys], yerr=[low, high], marker="o", capsize=3, label=mode
        )
        axes[1].plot(xs, [g["mean_latency_vs_large"] for g in ys], marker="o", label=mode)
    titles = ("wall time: speed-up over always-large", "mean latency: speed-up over always-large")
    for ax, title in zip(axes, titles, strict=True):
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads, [str(c) for c in loads])
        ax.set_xlabel("clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(
        f"routing_gain: {len(PROMPTS)} prompts x {MAX_TOKENS} tokens, greedy; "
        "median of paired ratios (higher is better)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default=str(ROOT / "policies/default.yaml"))
    ap.add_argument("--loads", default="1,4,16,48")
    ap.add_argument("--port", type=int, default=8093)
    ap.add_argument("--modes", default=",".join(MODES), help="a subset of " + ",".join(MODES))
    ap.add_argument("--reps", type=int, default=3, help="rotations per load (medians of paired ratios)")
    ap.add_argument("--no-write", action="store_true", help="print only (diagnosis runs)")
    ap.add_argument("--merge", action="store_true", help="keep the other loads' rows of the last results")
    args = ap.parse_args()
    loads = [int(x) for x in args.loads.split(",")]
    modes = tuple(m for m in args.modes.split(",") if m)
    if "large" not in modes or set(modes) - set(MODES):
        ap.error(f"--modes: a subset of {','.join(MODES)} that includes large (the baseline)")
    previous: list[dict[str, Any]] = []
    if args.merge:  # a rerun of some loads replaces those and keeps the others' rows
        previous = [r for r in read_json("routing_gain")["rows"] if r["clients"] not in loads]

    def report(result: dict[str, Any]) -> dict[str, Any]:
        rows = previous + result["rows"]
        data = {
            "machine": machine(),
            "workload": {
                "prompts": len(PROMPTS),
                "open_questions": len(OPEN_QUESTIONS),
                "word_problems": len(WORD_PROBLEMS),
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            },
            "reps": args.reps,
            "floors": result["floors"],
            "rows": rows,
            "vs_large": _summary(rows),
        }
        if not args.no_write:
            write_json("routing_gain", data)
            _plot(rows, plot_path("routing_gain"))
        return data

    data = report(asyncio.run(run(Path(args.policy), loads, args.port, modes, args.reps, report)))
    print(json.dumps(data["vs_large"], indent=1))


if __name__ == "__main__":
    main()
