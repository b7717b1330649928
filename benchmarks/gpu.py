"""The GPU tiers measured against the memory-bandwidth limit: one prepared script for one device,
that cannot come back empty.

    PYTHONPATH=. python3 -m benchmarks.gpu --out DIR [--budget-s 330]   # on a CUDA device
    PYTHONPATH=. python3 -m benchmarks.gpu --dry-run --out DIR          # every stage on the CPU

It imports only torch, transformers and numpy (and this checkout's ``tiers``), downloads nothing
(models are built from Qwen2.5's published configs with random weights) and runs each job in its
own subprocess (its own compile budget and memory): the 7B shape, the mixed-tier stage, then the
1.5B and 0.5B shapes. Every stage's figures are appended to ``DIR/gpu_stages.jsonl`` and merged
into ``DIR/gpu_<job>.json`` and ``DIR/gpu.json`` the moment they exist (``--dry-run``: ``gpu_dry*``),
with a progress line and the elapsed time; a crash or a timeout loses only the stage it was in.

Stages per shape: the device-to-device copy bandwidth (the limit a decode step is held to,
measured in the same process); transformers' ``generate`` at batch 16 on the model as built
(unfused: the runner fuses q/k/v and gate/up in place, so it is timed first); the paged runner's
decode step at batch 1, 16 and 64 over a 512-token context beside its bandwidth limit (weights
plus the batch's KV over the copy bandwidth); host syncs of one decode and one verify step
(``torch.cuda.set_sync_debug_mode``: one warning per sync); verifying 4 drafted tokens against one
decode step; time to first token of a 512- and an 8k-token prompt. ``--budget-s``: the 8k prefill
and the largest batch are skipped when the time left is short. Mixed tiers: 0.5B / 1.5B / 7B shapes
at 60 / 25 / 15 % of 16 and 64 rows against all rows on the 7B shape, device-seconds per generated
token (the tiers' steps run in series, one after the other, as ``DeviceWorker`` steps them today).

``--dry-run`` runs the same stages on the CPU with tiny configs, attention through the *compiled*
FlexAttention path (``TIERED_ROUTER_ATTENTION=flex-compile``: inductor's CPU template).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-*-Instruct's published configs (the production ladder of policies/examples).
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}  # fmt: skip
TINY: dict[str, dict[str, Any]] = {  # one head layout: the compiled attention graphs are shared
    "tiny-a": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "tiny-b": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
    "tiny-c": dict(hidden_size=64, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}  # fmt: skip
MIX = (0.60, 0.25, 0.15)  # rows on the small, middle and large tier


def plan(dry: bool) -> dict[str, Any]:
    if dry:
        return dict(
            shapes=TINY,
            big="tiny-c",
            ladder=("tiny-a", "tiny-b", "tiny-c"),
            batches=(1, 4),
            context=48,
            prompts=(40, 200),
            generate_batch=4,
            generate_tokens=4,
            mib=16,
            mixed_rows=(4,),
            block=16,
            jobs=("tiny-c", "mixed", "tiny-a"),
        )
    return dict(shapes=SHAPES, big="7B", ladder=("0.5B", "1.5B", "7B"), batches=(1, 16, 64),
                context=512, prompts=(512, 8192), generate_batch=16, generate_tokens=64, mib=2048,
                mixed_rows=(16, 64), block=16, jobs=("7B", "mixed", "1.5B", "0.5B"))  # fmt: skip


class Recorder:
    """Each stage's figures, on disk as soon as they exist: a line in ``gpu_stages.jsonl`` and the
    job's and the run's JSON rewritten (atomically) with it."""

    def __init__(self, out: Path, prefix: str, job: str, started: float) -> None:
        self.out, self.prefix, self.job, self.started = out, prefix, job, started
        out.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        return self.out / f"{self.prefix}{name}.json"

    def stage(self, name: str, figures: Any) -> Any:
        elapsed = time.time() - self.started
        line = {"job": self.job, "stage": name, "elapsed_s": round(elapsed, 1), "figures": figures}
        with open(self.out / f"{self.prefix}_stages.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        for target in (self.path(f"_{self.job}"), self.path("")):
            data = read_json(target)
            node = data.setdefault("jobs", {}).setdefault(self.job, {})
            node[name] = figures
            write_json(target, data)
        print(f"[{elapsed:7.1f}s] {self.job} {name}: {json.dumps(figures)[:300]}", flush=True)
        return figures


def read_json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Any, device: torch.device, reps: int = 5) -> float:
    """Median seconds of ``fn()`` after one warm-up call (compiles, autotunes)."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted once each)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, reps=10)
    return 2 * src.numel() / seconds


def build(shape: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    """A random-weight Qwen2 model of ``shape``, built in ``dtype`` on ``device`` (older and newer
    transformers alike: only the config's plain fields)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**shape, max_position_embeddings=32768, use_sliding_window=False)
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # no fp32 copy of a 7B model on the way
    try:
        with torch.device(device):
            model: Any = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    return model.to(dtype).eval()


def runner_for(model: Any, device: torch.device, dtype: torch.dtype, tokens: int, block: int) -> Any:
    import inspect
    from types import SimpleNamespace

    from tiers.models.loading import LoadedModel
    from tiers.worker.model_runner import ModelRunner

    loaded = LoadedModel(model, SimpleNamespace(pad_token_id=0), device, dtype, "none", "random")  # type: ignore[arg-type]
    kw: dict[str, Any] = {}
    if device.type == "cuda" and "cuda_graphs" in inspect.signature(ModelRunner).parameters:
        kw["cuda_graphs"] = True
    return ModelRunner(loaded, num_blocks=tokens // block + 8, block_size=block, max_model_len=16384, **kw)


def weight_bytes(model: Any) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def host_syncs(fn: Any, device: torch.device) -> int | None:
    """Host syncs of one call of ``fn`` on CUDA (``set_sync_debug_mode``: a warning per sync)."""
    if device.type != "cuda":
        return None
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


class Job:
    """One subprocess's context: the plan, the device, the deadline, the recorder."""

    def __init__(self, p: dict[str, Any], device: torch.device, deadline: float, rec: Recorder) -> None:
        self.p, self.device, self.deadline, self.rec = p, device, deadline, rec
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def left(self) -> float:
        return self.deadline - time.time()

    def allocate(self, runner: Any, rows: int, tokens: int) -> list[Any]:
        from tiers.core.block_manager import BlockTable

        tables = []
        for _ in range(rows):
            t = BlockTable()
            assert runner.blocks.allocate(t, tokens)
            tables.append(t)
        return tables

    def step_fn(self, runner: Any, tables: list[Any], q: int) -> Any:
        """One step of ``tables``' rows feeding ``q`` tokens each, the chosen ids copied back once."""
        from tiers.worker.model_runner import RowInput

        ctx = self.p["context"]
        rows = [RowInput(t.blocks, ctx, [1] * q, "last" if q == 1 else "all") for t in tables]

        def step() -> list[int]:
            logits = runner.forward(rows)
            return torch.cat([x.argmax(-1) for x in logits if x is not None]).tolist()

        return step


def shape_job(name: str, job: Job) -> None:
    p, dev, rec = job.p, job.device, job.rec
    shape = p["shapes"][name]
    bandwidth = rec.stage("bandwidth", {"copy_gb_s": round(copy_bandwidth(dev, p["mib"]) / 1e9, 1)})
    bw = bandwidth["copy_gb_s"] * 1e9
    model = build(shape, dev, job.dtype)
    wbytes = weight_bytes(model)
    if name == p["big"]:  # before the runner fuses the projections in place
        vocab = int(model.config.vocab_size)
        b, n = p["generate_batch"], p["generate_tokens"]
        ids = torch.randint(1, min(1000, vocab), (b, p["context"]), device=dev)
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            sec = timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kw), dev, reps=2)
        rec.stage("generate_unfused", {"batch": b, "tokens": n, "tok_s": round(b * n / sec, 1)})
    batches = list(p["batches"])
    need = p["context"] + 8
    runner = runner_for(
        model, dev, job.dtype, max(batches) * (need + 16) + max(p["prompts"]) + 64, p["block"]
    )
    flex = bool(runner.fast and runner.fast.uses_flex)
    graphs = getattr(runner, "graphs", None) is not None
    rec.stage("runner", {"weights_gb": round(wbytes / 1e9, 3), "flex": flex, "cuda_graphs": graphs})
    with torch.inference_mode():
        for i, b in enumerate(batches):
            if i == len(batches) - 1 and i > 0 and job.left() < 0.35 * p["budget_s"]:
                rec.stage(f"decode_b{b}", {"skipped": f"budget: {job.left():.0f} s left"})
                continue
            tables = job.allocate(runner, b, need)
            step = timed(job.step_fn(runner, tables, 1), dev)
            limit = (wbytes + b * p["context"] * runner.kv_bytes_per_token) / bw
            figures = {"step_ms": round(step * 1e3, 3), "tok_s": round(b / step, 1),
                       "bandwidth_limit_ms": round(limit * 1e3, 3),
                       "of_limit": round(limit / step, 3)}  # fmt: skip
            gen = rec.path(f"_{rec.job}")
            generated = read_json(gen).get("jobs", {}).get(rec.job, {}).get("generate_unfused")
            if generated and b == generated["batch"]:
                figures["vs_generate_unfused"] = round(b / step / generated["tok_s"], 3)
            rec.stage(f"decode_b{b}", figures)
            for t in tables:
                runner.blocks.free(t)
        if name == p["big"]:
            tables = job.allocate(runner, 1, need)
            plain = timed(job.step_fn(runner, tables, 1), dev)
            verify = timed(job.step_fn(runner, tables, 5), dev)
            rec.stage("verify_k4_b1", {"plain_ms": round(plain * 1e3, 3), "k4_ms": round(verify * 1e3, 3),
                                       "ratio": round(verify / plain, 3)})  # fmt: skip
            rec.stage("host_syncs", {"decode_step": host_syncs(job.step_fn(runner, tables, 1), dev),
                                     "verify_step": host_syncs(job.step_fn(runner, tables, 5), dev),
                                     "note": None if dev.type == "cuda" else "CUDA only"})  # fmt: skip
            for t in tables:
                runner.blocks.free(t)
        from tiers.worker.model_runner import RowInput

        for i, n in enumerate(p["prompts"]):
            if i == len(p["prompts"]) - 1 and i > 0 and job.left() < 0.25 * p["budget_s"]:
                rec.stage(f"ttft_{n}", {"skipped": f"budget: {job.left():.0f} s left"})
                continue
            (t,) = job.allocate(runner, 1, n)
            prompt = [(7 * k) % (shape["vocab_size"] - 1) + 1 for k in range(n)]
            sec = timed(lambda t=t, x=prompt: runner.forward([RowInput(t.blocks, 0, x, "last")]), dev, 3)
            rec.stage(f"ttft_{n}", {"ms": round(sec * 1e3, 2)})
            runner.blocks.free(t)


def mixed_job(job: Job) -> None:
    """Rows split over the ladder's three shapes against all rows on the largest: device-seconds
    per generated token of one decode step each (the tiers step in series)."""
    p, dev, rec = job.p, job.device, job.rec
    runners = {}
    for name in p["ladder"]:
        model = build(p["shapes"][name], dev, job.dtype)
        runners[name] = runner_for(
            model, dev, job.dtype, max(p["mixed_rows"]) * (p["context"] + 24), p["block"]
        )
    big = runners[p["big"]]
    with torch.inference_mode():
        for rows in p["mixed_rows"]:
            split = [round(rows * f) for f in MIX[:2]]
            split.append(rows - sum(split))
            tier_s = {}
            for (name, r), n in zip(runners.items(), split, strict=True):
                tables = job.allocate(r, n, p["context"] + 8)
                tier_s[name] = timed(job.step_fn(r, tables, 1), dev)
                for t in tables:
                    r.blocks.free(t)
            tables = job.allocate(big, rows, p["context"] + 8)
            alone = timed(job.step_fn(big, tables, 1), dev)
            for t in tables:
                big.blocks.free(t)
            mixed = sum(tier_s.values())
            rec.stage(f"mixed_{rows}", {
                "rows": dict(zip(runners, split, strict=True)),
                "tier_step_ms": {k: round(v * 1e3, 3) for k, v in tier_s.items()},
                "mixed_device_s_per_token": mixed / rows, "all_big_device_s_per_token": alone / rows,
                "ratio": round(mixed / alone, 3), "how": "tiers stepped in series on one stream",
            })  # fmt: skip


def child(args: argparse.Namespace) -> None:
    p = plan(args.dry_run) | {"budget_s": args.budget_s}
    device = torch.device("cpu" if args.dry_run else "cuda")
    prefix = "gpu_dry" if args.dry_run else "gpu"
    job = Job(p, device, args.deadline, Recorder(Path(args.out), prefix, args.job, args.started))
    if args.job == "mixed":
        mixed_job(job)
    else:
        shape_job(args.job, job)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results", help="directory of the JSON files")
    ap.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget of the whole run")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, compiled flex attention")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the old name of --dry-run
    ap.add_argument("--job", help=argparse.SUPPRESS)  # internal: one subprocess's job
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--started", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dry_run = args.dry_run or args.tiny
    if args.job:
        return child(args)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run for the same stages on the CPU")
    started = time.time()
    deadline = started + args.budget_s
    p = plan(args.dry_run)
    out = Path(args.out)
    rec = Recorder(out, "gpu_dry" if args.dry_run else "gpu", "run", started)
    for stale in [rec.path(""), out / f"{rec.prefix}_stages.jsonl", *(rec.path(f"_{j}") for j in p["jobs"])]:
        stale.unlink(missing_ok=True)
    rec.stage("machine", {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "device": torch.cuda.get_device_name() if not args.dry_run else "cpu (dry run)",
        "budget_s": args.budget_s,
    })  # fmt: skip
    env = dict(os.environ)
    if args.dry_run:
        env["TIERED_ROUTER_ATTENTION"] = "flex-compile"
    for name in p["jobs"]:
        left = deadline - time.time()
        if left < 10:
            rec.stage(f"job_{name}", {"skipped": "budget spent"})
            continue
        cmd = [sys.executable, "-m", "benchmarks.gpu", "--job", name, "--out", str(out),
               "--budget-s", str(args.budget_s), "--deadline", str(deadline),
               "--started", str(started)]  # fmt: skip
        if args.dry_run:
            cmd.append("--dry-run")
        began = time.time()
        try:
            rc: int | str = subprocess.run(cmd, env=env, timeout=left, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        rec.stage(f"job_{name}", {"returncode": rc, "seconds": round(time.time() - began, 1)})
    rec.stage("done", {"seconds": round(time.time() - started, 1)})
    print(rec.path(""))


if __name__ == "__main__":
    main()
