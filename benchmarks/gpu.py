"""The GPU tiers measured against the memory-bandwidth limit, one prepared script for one device.

What it runs, with nothing downloaded (models are built from configs with random weights in
bf16 on the device; the token ids are arbitrary, which is all a timing needs):
- the device-to-device copy bandwidth, measured here: the limit a decode step is held to;
- per model shape (Qwen2.5-0.5B / 1.5B / 7B), the paged runner (``tiers.worker.model_runner``, the fast
  path, FlexAttention over the pool on CUDA) at batch 1, 16 and 64 over a 512-token context:
  decode step time and tokens per second, beside the bandwidth limit of that step (weight bytes
  plus the batch's KV bytes, divided by the copy bandwidth);
- time to first token of a 512- and an 8k-token prompt (one prefill forward);
- speculation's cost on the 7B shape: verifying k = 4 drafted tokens (one forward over 5 tokens
  per row) against a plain decode step at batch 1 and 16, and the speed-up those costs imply with
  a 1.5B draft at 80 % acceptance (random weights never accept, so the rate is an input);
- transformers' ``generate`` on the same model and device at batch 16 (greedy, 64 tokens), the
  baseline the runner is compared with.

    python -m benchmarks.gpu                  # on a CUDA device (8 minutes at most on an H200)
    python -m benchmarks.gpu --tiny           # a dry run of the same code on the CPU, seconds

Writes benchmarks/results/gpu.json and gpu.png (``--tiny``: gpu_tiny.*).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.common import machine, plot_path, write_json

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-*-Instruct's published configs (the production ladder of policies/examples).
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}  # fmt: skip
TINY: dict[str, dict[str, Any]] = {
    "tiny-a": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "tiny-b": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}  # fmt: skip
BLOCK = 16


@dataclass
class Setup:
    device: torch.device
    batches: tuple[int, ...]
    context: int
    prompts: tuple[int, ...]
    generate_batch: int
    generate_tokens: int
    shapes: dict[str, dict[str, Any]]
    spec_shape: str
    draft_shape: str


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
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**shape, max_position_embeddings=32768, rope_theta=1e6, use_sliding_window=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    return model.eval()


def runner_for(model: Any, device: torch.device, dtype: torch.dtype, tokens: int) -> Any:
    from tiers.models.loading import LoadedModel
    from tiers.worker.model_runner import ModelRunner

    tok = SimpleNamespace(pad_token_id=0)
    loaded = LoadedModel(model, tok, device, dtype, "none", "random")  # type: ignore[arg-type]
    return ModelRunner(loaded, num_blocks=tokens // BLOCK + 8, block_size=BLOCK, max_model_len=16384)


def weight_bytes(model: Any) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def measure_shape(name: str, shape: dict[str, Any], s: Setup, bandwidth: float) -> dict[str, Any]:
    from tiers.core.block_manager import BlockTable
    from tiers.worker.model_runner import RowInput

    dtype = torch.bfloat16 if s.device.type == "cuda" else torch.float32
    model = build(shape, s.device, dtype)
    rows = max(*s.batches, 16)  # the verify measurement runs 16 rows
    runner = runner_for(model, s.device, dtype, rows * (s.context + 8 + BLOCK) + max(s.prompts) + 64)
    wbytes = weight_bytes(model)
    out: dict[str, Any] = {"weights_gb": round(wbytes / 1e9, 3), "decode": {}, "ttft_ms": {}}
    with torch.inference_mode():
        for b in s.batches:
            tables = []
            for _ in range(b):
                t = BlockTable()
                assert runner.blocks.allocate(t, s.context + 8)
                tables.append(t)
            # The context's KV (its values do not matter to the timing; the pool holds them).
            rows = [RowInput(t.blocks, s.context, [1], "last") for t in tables]
            step = timed(lambda rows=rows: runner.forward(rows), s.device)
            kv = b * s.context * runner.kv_bytes_per_token
            limit = (wbytes + kv) / bandwidth
            out["decode"][str(b)] = {
                "step_ms": round(step * 1e3, 3),
                "tok_s": round(b / step, 1),
                "bandwidth_limit_ms": round(limit * 1e3, 3),
                "of_limit": round(limit / step, 3),
            }
            for t in tables:
                runner.blocks.free(t)
        for n in s.prompts:
            t = BlockTable()
            assert runner.blocks.allocate(t, n)
            ids = [(7 * i) % (shape["vocab_size"] - 1) + 1 for i in range(n)]
            out["ttft_ms"][str(n)] = round(
                timed(lambda t=t, ids=ids: runner.forward([RowInput(t.blocks, 0, ids, "last")]), s.device, 3)
                * 1e3,
                2,
            )
            runner.blocks.free(t)
        if name == s.spec_shape:
            out["verify"] = {}
            for b in (1, 16):
                tables = []
                for _ in range(b):
                    t = BlockTable()
                    assert runner.blocks.allocate(t, s.context + 8)
                    tables.append(t)
                plain = timed(lambda tables=tables: runner.forward(
                    [RowInput(t.blocks, s.context, [1], "last") for t in tables]), s.device)  # fmt: skip
                verify = timed(lambda tables=tables: runner.forward(
                    [RowInput(t.blocks, s.context, [1] * 5, "all") for t in tables]), s.device)  # fmt: skip
                out["verify"][str(b)] = {"plain_ms": round(plain * 1e3, 3), "k4_ms": round(verify * 1e3, 3),
                                         "ratio": round(verify / plain, 3)}  # fmt: skip
                for t in tables:
                    runner.blocks.free(t)
        if name == s.spec_shape or s.device.type != "cuda":
            out["generate"] = _generate(model, s)
            out["runner_vs_generate"] = round(
                out["decode"][str(s.generate_batch)]["tok_s"] / out["generate"]["tok_s"], 3
            ) if str(s.generate_batch) in out["decode"] else None  # fmt: skip
    return out


def _generate(model: Any, s: Setup) -> dict[str, Any]:
    """transformers' generate, greedy, at ``generate_batch`` rows over a ``context``-token prompt."""
    vocab = int(model.config.vocab_size)
    ids = torch.randint(1, min(1000, vocab), (s.generate_batch, s.context), device=s.device)
    kw = dict(
        max_new_tokens=s.generate_tokens, min_new_tokens=s.generate_tokens, do_sample=False, pad_token_id=0
    )
    seconds = timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kw), s.device, reps=2)
    return {"batch": s.generate_batch, "tokens": s.generate_tokens,
            "tok_s": round(s.generate_batch * s.generate_tokens / seconds, 1)}  # fmt: skip


def speculative_estimate(
    result: dict[str, Any], s: Setup, acceptance: float = 0.8, k: int = 4
) -> dict[str, Any]:
    """Tokens per second per row with a draft (its decode step ``k`` times, then the target's
    k+1-token verify) against plain decoding, from the costs measured above."""
    target = result["shapes"][s.spec_shape]
    draft = result["shapes"][s.draft_shape]
    out = {}
    for b, v in target.get("verify", {}).items():
        d = draft["decode"].get(b) or draft["decode"][str(min(s.batches))]
        tokens = (1 - acceptance ** (k + 1)) / (1 - acceptance)
        spec = tokens / ((k * d["step_ms"] + v["k4_ms"]) / 1e3)
        plain = 1 / (v["plain_ms"] / 1e3)
        out[b] = {"acceptance": acceptance, "k": k, "speedup": round(spec / plain, 3)}
    return out


def _plot(data: dict[str, Any], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for shape, r in data["shapes"].items():
        bs = sorted(int(b) for b in r["decode"])
        ax.plot(bs, [r["decode"][str(b)]["of_limit"] for b in bs], marker="o", label=shape)
    ax.axhline(0.6, ls="--", color="grey", label="target at batch 1 (7B)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("bandwidth limit / measured step")
    ax.set_title(f"decode step vs the memory-bandwidth limit ({data['device']})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(plot_path(name), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a dry run of the code")
    args = ap.parse_args()
    if args.tiny:
        s = Setup(torch.device("cpu"), (1, 4), 64, (64, 256), 4, 8, TINY, "tiny-b", "tiny-a")
        mib = 64
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --tiny for a dry run on the CPU")
        s = Setup(torch.device("cuda"), (1, 16, 64), 512, (512, 8192), 16, 64, SHAPES, "7B", "1.5B")
        mib = 2048
    started = time.perf_counter()
    bandwidth = copy_bandwidth(s.device, mib)
    data: dict[str, Any] = {
        "machine": machine(),
        "device": torch.cuda.get_device_name() if s.device.type == "cuda" else "cpu",
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "context_tokens": s.context,
        "shapes": {},
    }
    for name, shape in s.shapes.items():
        print(f"{name} ...", flush=True)
        data["shapes"][name] = measure_shape(name, shape, s, bandwidth)
        if s.device.type == "cuda":
            torch.cuda.empty_cache()  # the shape's model and pool are gone with measure_shape's frame
        print(f"  {data['shapes'][name]}", flush=True)
    data["speculative"] = speculative_estimate(data, s)
    data["seconds"] = round(time.perf_counter() - started, 1)
    name = "gpu_tiny" if args.tiny else "gpu"
    print(write_json(name, data))
    _plot(data, name)


if __name__ == "__main__":
    main()
