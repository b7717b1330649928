"""benchmarks/gpu.py on the CPU: the dry run completes every stage through the compiled
FlexAttention path and leaves per-job JSON behind; the script imports nothing the GPU machine
lacks (it has torch, transformers and numpy, none of this project's install)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_writes_every_stage_per_job(tmp_path: Path) -> None:
    # Catches a stage that raises (the run would come back with holes), figures written only at
    # the end (each job's JSON must exist on its own), a dry run that bypasses the compiled flex
    # path, and the unfused-generate baseline timed after the runner fused the model.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=420, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_dry.json").read_text())["jobs"]
    for job in ("tiny-c", "mixed", "tiny-a"):
        assert data["run"][f"job_{job}"]["returncode"] == 0, job
        assert (tmp_path / f"gpu_dry_{job}.json").exists()
    big = data["tiny-c"]
    stages = ["bandwidth", "generate_unfused", "runner", "decode_b1", "decode_b4", "verify_k4_b1",
              "host_syncs", "ttft_40", "ttft_200"]  # fmt: skip
    assert all(s in big for s in stages), sorted(big)
    assert big["runner"]["flex"] is True
    assert big["decode_b4"]["vs_generate_unfused"] > 0
    assert list(big) == [s for s in big if s in stages]
    assert set(data["mixed"]["mixed_4"]["rows"].values()) == {2, 1}
    lines = (tmp_path / "gpu_dry_stages.jsonl").read_text().splitlines()
    assert len(lines) >= len(stages) + 4 and all("elapsed_s" in json.loads(x) for x in lines)
    assert "generate_unfused" in proc.stdout  # a progress line per stage


def test_imports_only_what_the_gpu_machine_has() -> None:
    # Catches a module-level import of a project dependency (litestar, onnxruntime, ...) on the
    # path from benchmarks.gpu to the runner: the GPU machine has none of them.
    code = """
import sys
import torch, numpy, transformers
from transformers import Qwen2Config, Qwen2ForCausalLM
base = {m.split('.')[0] for m in sys.modules}
import benchmarks.gpu
from tiers.worker.model_runner import ModelRunner, RowInput
from tiers.models.loading import LoadedModel
from tiers.core.block_manager import BlockTable
new = {m.split('.')[0] for m in sys.modules} - base - set(sys.stdlib_module_names)
print(sorted(new - {'tiers', 'benchmarks'}))
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
