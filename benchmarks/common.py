"""Shared helpers: machine facts, result files, plots. Every benchmark measures a baseline in the
same run and reports ratios, so figures compare across machines."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "Give me three tips for learning Python.",
    "Write a short story about a dragon who learns to cook.",
    "Describe the water cycle for a ten-year-old.",
    "What are the benefits of regular exercise?",
    "How do I make pancakes from scratch?",
    "Summarize the plot of Romeo and Juliet.",
    "Write a poem about autumn leaves.",
    "Explain what a neural network is.",
    "What should I pack for a weekend hiking trip?",
    "Compare cats and dogs as pets.",
    "Write an email asking my manager for a day off.",
    "What causes the seasons on Earth?",
    "Tell me a fun fact about octopuses.",
]


def tier_model(tier: str, policy: Path | None = None) -> dict[str, Any]:
    """``tiers.models.loading.load_model``'s keyword arguments for ``tier`` of ``policy`` (default: the
    shipped ``policies/default.yaml``), so an in-process benchmark measures the operating point the
    service runs, not a copy of it that drifts when the policy changes."""
    from router.policy.loader import load_policy

    cfg = load_policy(str(policy or RESULTS.parents[1] / "policies" / "default.yaml")).tiers[tier]
    return {
        "dtype": cfg.dtype,
        "quantization": cfg.quantization,
        "group_size": cfg.quant_group_size,
        "int4_head": cfg.quantize_head,
        "int8_head_rows": cfg.head_int8_tokens,
        "int8_activations": cfg.activation_quantization == "int8",
        "batch_invariant": cfg.batch_invariant,
    }


def encode_chat(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """Each prompt as a one-turn chat, through the model's own template."""
    out = []
    for p in prompts:
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(enc["input_ids"]))
    return out


def machine() -> dict[str, Any]:
    import torch

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        # "AMD EPYC" names both the Zen 1 (AVX2) and Zen 4 (AVX512) VMs, whose kernels differ.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def kernels_missing(op: Any) -> bool:
    """True (after saying why) when ``op``, one of ``tiers.kernels.cpu``' ``*_op()`` results, is
    ``None``: the kernel benchmarks then exit 2 instead of measuring torch against itself."""
    if op is not None:
        return False
    from tiers.kernels import cpu as cpu_kernels

    print(f"no CPU kernel build applies here ({cpu_kernels.library_path().name}); run `make kernels`")
    return True


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2))
    return path


def read_json(name: str) -> dict[str, Any]:
    """The last results ``write_json`` wrote under ``name``."""
    data: dict[str, Any] = json.loads((RESULTS / f"{name}.json").read_text())
    return data


def plot_path(name: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{name}.png"


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def slots(runner: Any, n: int = 16, tokens: int = 512) -> list[list[int]]:
    """``n`` block tables of ``tokens`` positions each in ``runner``'s pool, held for the whole
    benchmark (fixed rows to write contexts into and time steps over); their block lists."""
    from tiers.core.block_manager import BlockTable

    made = [BlockTable() for _ in range(n)]
    for t in made:
        assert runner.blocks.allocate(t, tokens), f"the pool cannot hold {n} x {tokens} tokens"
    return [t.blocks for t in made]


def greedy_agreement(runners: dict[str, Any], prompts: int = 8, tokens: int = 64) -> dict[str, float]:
    """Each runner's top-1 against the fp32 model's greedy continuation of the first ``prompts``
    chat prompts, ``tokens`` each, teacher-forced (every runner reads the fp32 text, so one early
    difference does not decide the rest). Call on the device thread the runners were built on."""
    import torch

    from tiers.models.loading import load_model
    from tiers.worker.model_runner import ModelRunner, RowInput

    ref = ModelRunner(
        load_model("embedded:smollm2-135m-instruct", dtype="float32"), num_blocks=64, max_model_len=512
    )
    tables = {id(r): slots(r, 1)[0] for r in [ref, *runners.values()]}
    agree = {n: 0 for n in runners}
    with torch.inference_mode():
        for ids in encode_chat(ref.tokenizer, PROMPTS[:prompts]):
            toks = list(ids)
            logits = ref.forward([RowInput(tables[id(ref)], 0, toks, "last")])[0]
            gen: list[int] = []
            for _ in range(tokens):
                assert logits is not None
                gen.append(int(logits[-1].argmax()))
                logits = ref.forward([RowInput(tables[id(ref)], len(toks), gen[-1:], "last")])[0]
                toks.append(gen[-1])
            for name, r in runners.items():
                out = r.forward([RowInput(tables[id(r)], 0, toks, "all")])[0]
                assert out is not None
                pred = out[len(ids) - 1 : len(ids) - 1 + tokens].argmax(-1).tolist()
                agree[name] += sum(a == b for a, b in zip(pred, gen, strict=True))
    return {n: round(a / (prompts * tokens), 4) for n, a in agree.items()}


def interleaved_forward_ms(
    runners: dict[str, Any], shapes: tuple[str, ...], rows: Any, repeats: int, calls: int = 5
) -> dict[str, dict[str, float]]:
    """Median ms per ``runner.forward(rows(name, shape))`` for every runner and shape, the runners
    interleaved within each repetition (so drift on a shared machine hits all of them), each
    timing a mean of ``calls`` forwards after one untimed."""
    import statistics

    times: dict[str, dict[str, list[float]]] = {n: {s: [] for s in shapes} for n in runners}
    for _ in range(repeats):
        for name, r in runners.items():
            for shape in shapes:
                batch = rows(name, shape)
                r.forward(batch)
                started = time.perf_counter()
                for _ in range(calls):
                    r.forward(batch)
                times[name][shape].append((time.perf_counter() - started) / calls * 1000)
    return {n: {s: round(statistics.median(v), 2) for s, v in t.items()} for n, t in times.items()}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@contextmanager
def serve(
    policy: str | Path,
    port: int,
    *,
    log_level: str = "warning",
    extra_args: tuple[str, ...] = (),
    ready_timeout_s: float = 600,
) -> Iterator[tuple[str, int]]:
    """Run ``tiered-router serve`` as a subprocess until every tier is ready (within
    ``ready_timeout_s``); yields (url, pid)."""
    import httpx

    root = Path(__file__).resolve().parents[1]
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OTEL_SDK_DISABLED="true")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.cli",
            "--log-level",
            log_level,
            "serve",
            "--policy",
            str(policy),
            "--port",
            str(port),
            # Operator endpoints (/metrics, /dashboard) on the API port unless a caller asks for
            # an admin listener: the benchmarks read them from the URL they were given.
            *(() if "--admin-port" in extra_args else ("--admin-port", "0")),
            *extra_args,
        ],
        cwd=root,
        env=env,
    )
    try:
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}")
            time.sleep(0.5)
        else:
            raise SystemExit("the server never became ready")
        yield url, server.pid
    finally:
        server.terminate()
        server.wait(120)


def load_tiers_at(rev: str) -> Any:
    """The ``tiers`` package as it was at git revision ``rev``, importable side by side with
    today's (as ``tiers_<rev>``): benchmarks compare an engine with its predecessor in one run."""
    import importlib
    import re
    import subprocess
    import sys
    import tempfile
    import types

    name = f"tiers_{rev}"
    if name in sys.modules:
        return sys.modules[name]
    root = Path(tempfile.mkdtemp(prefix="tiers-rev-"))
    pkg = root / name
    pkg.mkdir()
    files = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "tiers/"], check=True, capture_output=True, text=True
    ).stdout.split()
    for f in files:
        if not f.endswith(".py"):
            continue
        src = subprocess.run(["git", "show", f"{rev}:{f}"], check=True, capture_output=True, text=True).stdout
        (pkg / Path(f).name).write_text(re.sub(r"\btiers\.", f"{name}.", src))
    sys.path.insert(0, str(root))
    mod = importlib.import_module(name)
    ns = types.SimpleNamespace(
        **{
            m: importlib.import_module(f"{name}.{m}")
            for m in ("engine", "model_runner", "scheduler", "sequence", "device")
        }
    )
    ns.package = mod
    sys.modules[name] = ns  # type: ignore[assignment]
    return ns
