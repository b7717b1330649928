"""Open ``/dashboard`` of a running service in a real headless browser (Debian's chromium) after
some traffic, and save a screenshot to benchmarks/results/dashboard.png.

    python -m benchmarks.dashboard_screenshot [--policy policies/default.yaml]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx

from benchmarks.common import plot_path, serve

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "hi!",
    "What is the capital of France?",
    "Explain how vaccines train the immune system, in a paragraph.",
    "Prove that there are infinitely many primes, step by step.",
    "Write a haiku about autumn.",
    "Design a rate limiter for a multi-tenant API and discuss trade-offs.",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", default=str(ROOT / "policies/default.yaml"))
    parser.add_argument("--port", type=int, default=18083)
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("chromium is not installed: apt-get install -y chromium")
    with serve(args.policy, args.port, log_level="warning") as (url, _):
        with httpx.Client(base_url=url, timeout=300) as c:
            for i, q in enumerate(QUESTIONS * 2):
                c.post(
                    "/v1/chat/completions",
                    json={
                        "model": "auto",
                        "max_tokens": 24,
                        "temperature": 0,
                        "messages": [{"role": "user", "content": q}],
                    },
                )
                if i % 4 == 0:
                    c.post(
                        "/v1/chat/completions",
                        json={
                            "model": "large",
                            "max_tokens": 32,
                            "messages": [{"role": "user", "content": q}],
                        },
                    )
        out = plot_path("dashboard")
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [
                    browser,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    f"--user-data-dir={profile}",
                    "--window-size=1280,1100",
                    "--virtual-time-budget=4000",
                    f"--screenshot={out}",
                    url + "/dashboard",
                ],
                check=True,
                timeout=120,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        print(f"saved {out}")


if __name__ == "__main__":
    main()
