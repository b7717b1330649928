"""Memory of the default policy under the paged engine: resident set after ``/readyz``, and while
64 requests per tier run at once (the batch gauge must reach 64), short chats and then long
prompts, so RSS is seen to follow live tokens rather than ``max_num_seqs x max_model_len``.

Baseline in the same run: what the dense-slot design would have reserved for the same policy
(target + draft + prefix pools of ``max_num_seqs x max_model_len`` tokens), computed from the
models' KV bytes per token. Writes benchmarks/results/engine_memory.{json,png}.

    python -m benchmarks.engine_memory [--port 8093]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import PROMPTS, plot_path, serve, write_json

POLICY = Path(__file__).resolve().parents[1] / "policies" / "default.yaml"


def patient_policy() -> Path:
    """The default policy with 64-sequence batches and admission's queue bounds lifted: this
    benchmark measures memory with 64 sequences per tier running at once and every request
    admitted (at 64 long prompts per tier the predicted wait exceeds the default bound and
    admission rightly answers 503 at once). Memory is set by the KV budget, which is unchanged."""
    import tempfile

    import yaml

    data = yaml.safe_load(POLICY.read_text())
    for tier in data["tiers"].values():
        tier["max_queue_wait_s"] = 900
        tier["max_num_seqs"] = 64
    data.setdefault("service", {})["queue_timeout_s"] = 900
    out = Path(tempfile.mkdtemp()) / "default-patient.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def rss_of(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def gauge(text: str, name: str, tier: str) -> float:
    m = re.search(rf'^{name}{{tier="{tier}"}} ([0-9.e+-]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def load_tier(
    url: str, tier: str, prompts: list[str], max_tokens: int, admin: str | None = None
) -> dict[str, Any]:
    import httpx

    peak_running = 0.0
    peak_kv = 0.0
    done = False

    async def watch(client: httpx.AsyncClient) -> None:
        nonlocal peak_running, peak_kv
        while not done:
            text = (await client.get((admin or url) + "/metrics")).text
            peak_running = max(peak_running, gauge(text, "router_running_requests", tier))
            peak_kv = max(peak_kv, gauge(text, "router_kv_cache_usage_ratio", tier))
            await asyncio.sleep(0.2)

    async def one(client: httpx.AsyncClient, i: int) -> int:
        r = await client.post(
            url + "/v1/chat/completions",
            json={
                "model": tier,
                "messages": [{"role": "user", "content": f"{prompts[i % len(prompts)]} (#{i})"}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
            headers={"Cache-Control": "no-cache"},
        )
        return r.status_code

    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        watcher = asyncio.create_task(watch(client))
        started = time.perf_counter()
        codes = await asyncio.gather(*(one(client, i) for i in range(64)))
        elapsed = time.perf_counter() - started
        done = True
        await watcher
    return {
        "ok": sum(c == 200 for c in codes),
        "codes": sorted(set(codes)),
        "peak_running": peak_running,
        "peak_kv_usage": round(peak_kv, 3),
        "seconds": round(elapsed, 1),
    }


def dense_equivalent_mb() -> float:
    """KV the dense-slot engine reserved for the default policy: per tier, target and draft pools
    of max_num_seqs x max_model_len tokens plus the prefix pool (8,192 tokens)."""
    from router.policy.loader import load_policy
    from tiers.models.plan import resolve_config

    policy = load_policy(str(POLICY))
    total = 0
    cfg = resolve_config("embedded:smollm2-135m-instruct").get_text_config()
    per_token_fp32 = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    )
    for t in policy.tiers.values():
        width = 1.0 if t.dtype == "float32" else 0.5
        pools = 2 if t.draft else 1
        total += (pools * 16 * t.max_model_len + 8192) * per_token_fp32 * width  # 16 slots then
    return total / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8093)
    args = parser.parse_args()
    long_prompts = [
        p + " Please answer in detail. " + ("Context: the quick brown fox. " * 40) for p in PROMPTS
    ]
    admin = f"http://127.0.0.1:{args.port + 1}"
    with serve(patient_policy(), args.port, extra_args=("--admin-port", str(args.port + 1))) as (url, pid):
        time.sleep(2)
        ready = rss_of(pid)
        print("rss after readyz", ready, flush=True)
        peak = ready
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, rss_of(pid))
                time.sleep(0.1)

        sampler = threading.Thread(target=sample)
        sampler.start()
        tiers: dict[str, Any] = {}
        phases = []
        for label, prompts, max_tokens in (("short", PROMPTS, 32), ("long", long_prompts, 16)):
            for tier in ("small", "medium", "large"):
                r = asyncio.run(load_tier(url, tier, prompts, max_tokens, admin))
                r["rss_peak_mb"] = round(peak, 1)
                tiers[f"{tier}/{label}"] = r
                phases.append((f"{tier}\n{label}", peak))
                print(tier, label, r, flush=True)
        stop.set()
        sampler.join()
    data = {
        "policy": "policies/default.yaml (same KV budgets) with max_num_seqs 64 and the queue bounds "
        "(max_queue_wait_s, queue_timeout_s) lifted to 900 s so every request is admitted",
        "rss_after_ready_mb": round(ready, 1),
        "rss_peak_mb": round(peak, 1),
        "dense_design_kv_mb": round(dense_equivalent_mb(), 1),
        "runs": tiers,
        "targets": {"rss_after_ready_mb_max": 2560, "concurrent_per_tier_min": 64},
    }
    write_json("engine_memory", data)
    _plot(ready, phases, data["dense_design_kv_mb"])


def _plot(ready: float, phases: list[tuple[str, float]], dense_kv: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = ["ready", *[p[0] for p in phases]]
    values = [ready, *[p[1] for p in phases]]
    ax.bar(labels, values, color="tab:blue", label="paged engine: RSS (peak so far)")
    ax.axhline(2560, color="tab:red", ls="--", label="target 2.5 GB")
    ax.axhline(ready + dense_kv, color="tab:gray", ls=":", label="dense design: ready + its KV reservation")
    ax.set_ylabel("MB")
    ax.set_title("Default policy memory, 64 concurrent requests per tier")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot_path("engine_memory"), dpi=120)


if __name__ == "__main__":
    main()
