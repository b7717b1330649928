"""Batch invariance from outside (issue 34): a temperature-0 answer must not depend on other traffic.

The default policy is served as ``make run`` serves it. For each tier (forced by ``model``), 8
chat prompts sharing one system prompt (~150 tokens, so prompts run past the 64-query attention
switch and as prefix-cache hits) are answered three times: **alone** (one at a time), **inside a
burst** of 32 concurrent requests (the 8, plus 24 fillers of other lengths with ``max_tokens`` 1
or 24: other batch sizes, chunk boundaries and draft lengths around them) and **after** it (their
prompts now mostly served from the prefix cache). ``temperature: 0``, ``max_tokens: 32``,
``Cache-Control: no-cache`` (the response cache would answer the repeats without a model).

Per tier: how many of the 8 answers are identical alone vs in the burst vs after, and the prefix
tokens served from the cache after. Under the burst the router may move a request to the next tier
(its predicted wait past ``max_queue_wait_s``: the policy's load fallback); such an answer is
compared with the alone answer of the tier that served it (``x-router-tier``), and the moves are
counted (``burst_served_by``). Writes benchmarks/results/invariance.json.

    python -m benchmarks.invariance [--port 8095]
"""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import serve, write_json

ROOT = Path(__file__).resolve().parents[1]
TIERS = ("small", "medium", "large")
SYSTEM = (
    "You are a careful assistant for a public library. Answer in plain English, in at most three "
    "sentences, without lists or headings. When a question is about opening hours, say that they "
    "change on public holidays and point to the front desk. When a question is about borrowing, "
    "say that a library card is free for residents and that books are lent for three weeks, with "
    "two renewals unless another reader has reserved the book. Never invent a book title, an "
    "author or a date. If you do not know, say so and suggest asking a librarian."
)
QUESTIONS = [
    "Can I renew a book twice?",
    "What should I bring to get a library card?",
    "Is the library open on New Year's Day?",
    "How long can I keep a novel?",
    "Can my child borrow books on my card?",
    "What happens if I return a book late?",
    "Do you lend e-readers?",
    "Where can I print a document?",
]
FILLERS = [
    "Write one sentence about the sea.",
    "List three colours.",
    "Explain gravity to a child in two sentences.",
    "Translate 'good morning' into French.",
    "What is 17 times 3?",
    "Name a famous painter and one painting.",
]


def body(tier: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"model": tier, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def asked(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


async def answer(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> dict[str, Any]:
    while True:  # a refusal under the burst is retried after its Retry-After, as SDKs do
        r = await client.post(
            url + "/v1/chat/completions", json=payload, headers={"cache-control": "no-cache"}, timeout=600
        )
        if r.status_code != 429:
            break
        await asyncio.sleep(float(r.headers.get("retry-after-ms", 1000)) / 1000)
    r.raise_for_status()
    data = r.json()
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "text": data["choices"][0]["message"]["content"],
        "cached": details.get("cached_tokens", 0),
        "tier": r.headers.get("x-router-tier", payload["model"]),
    }


async def alone_run(url: str, tier: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient() as client:
        return [await answer(client, url, body(tier, asked(q), 32)) for q in QUESTIONS]


async def tier_run(
    url: str, tier: str, rng: random.Random, alone: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """The burst and after-runs for ``tier``. A request the router moved to another tier (its
    predicted wait past ``max_queue_wait_s``: the policy's load fallback) is compared with that
    tier's alone answer: the invariance is of a tier's numbers, the fallback is routing."""
    async with httpx.AsyncClient() as client:
        burst: list[dict[str, Any]] = [body(tier, asked(q), 32) for q in QUESTIONS]
        for i in range(24):
            filler = rng.choice(FILLERS) + " " * (i % 5)
            burst.append(body(tier, [{"role": "user", "content": filler}], rng.choice([1, 24])))
        order = list(range(len(burst)))
        rng.shuffle(order)
        results = await asyncio.gather(*(answer(client, url, burst[i]) for i in order))
        together = [results[order.index(i)] for i in range(len(QUESTIONS))]
        after = [await answer(client, url, body(tier, asked(q), 32)) for q in QUESTIONS]

    def same(i: int, got: dict[str, Any]) -> bool:
        ref = alone.get(got["tier"])
        return ref is not None and ref[i]["text"] == got["text"]

    return {
        "prompts": len(QUESTIONS),
        "identical_in_burst": sum(same(i, b) for i, b in enumerate(together)),
        "identical_after": sum(same(i, c) for i, c in enumerate(after)),
        "burst_served_by": {
            t: sum(b["tier"] == t for b in together) for t in TIERS if any(b["tier"] == t for b in together)
        },
        "cached_tokens_after": [a["cached"] for a in after],
        "differing": [
            {
                "question": q,
                "alone": alone[tier][i]["text"],
                "burst": b["text"],
                "burst_tier": b["tier"],
                "after": c["text"],
            }
            for i, (q, b, c) in enumerate(zip(QUESTIONS, together, after, strict=True))
            if not (same(i, b) and same(i, c))
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8095)
    parser.add_argument("--policy", type=Path, default=ROOT / "policies/default.yaml")
    parser.add_argument("--tiers", nargs="+", choices=TIERS, default=list(TIERS))
    parser.add_argument("--no-write", action="store_true", help="print only (diagnosis runs)")
    args = parser.parse_args()
    out: dict[str, Any] = {}
    with serve(args.policy, args.port) as (url, _pid):
        # Every tier's alone answers first: a burst request the router moves to another tier is
        # compared with that tier's.
        alone = {tier: asyncio.run(alone_run(url, tier)) for tier in TIERS}
        for i, tier in enumerate(TIERS):
            if tier not in args.tiers:
                continue
            out[tier] = asyncio.run(tier_run(url, tier, random.Random(34 + i), alone))
            print(tier, {k: v for k, v in out[tier].items() if k != "differing"}, flush=True)
    if args.no_write:
        return
    write_json(
        "invariance",
        {
            "policy": "policies/default.yaml (batch_invariant on every tier, the default)",
            "tiers": out,
            "all_identical": all(
                r["identical_in_burst"] == r["prompts"] == r["identical_after"] for r in out.values()
            ),
        },
    )


if __name__ == "__main__":
    main()
