"""Memory planning from configs alone: sizes, budgets, and ``policy plan`` on the GPU example."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.cli import main
from tiers.models.plan import parse_memory

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("spec", "total", "want"),
    [("512MiB", 0, 512 * 2**20), ("2GiB", 0, 2 * 2**30), ("1000", 0, 1000), ("0.25", 80 * 2**30, 20 * 2**30)],
)
def test_sizes_and_fractions(spec: str, total: int, want: int) -> None:
    assert parse_memory(spec, device_total=total) == want


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "0", "1.5TB"])
def test_bad_sizes_say_what_is_expected(bad: str) -> None:
    with pytest.raises(ValueError, match=r"size|fraction"):
        parse_memory(bad, device_total=1)


def test_the_gpu_ladder_fits_an_80gb_device(capsys: pytest.CaptureFixture[str]) -> None:
    """Offline: Qwen2.5 configs come from the built-in table, parameters from the meta device."""
    assert (
        main(["policy", "plan", str(ROOT / "policies/examples/gpu-qwen.yaml"), "--device-memory", "80GiB"])
        == 0
    )
    out = capsys.readouterr().out
    large = next(line for line in out.splitlines() if line.startswith("large"))
    weights_gib = float(large.split()[2].rstrip("G"))
    assert 13.5 < weights_gib < 15.0  # Qwen2.5-7B: 7.6B parameters in bf16


def test_a_policy_that_cannot_fit_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["policy", "plan", str(ROOT / "policies/examples/gpu-qwen.yaml"), "--device-memory", "40GiB"])
        == 2
    )
    assert "does not fit" in capsys.readouterr().err


def test_a_kv_budget_below_one_sequence_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (
        (ROOT / "policies/examples/gpu-qwen.yaml")
        .read_text()
        .replace('kv_cache_memory: "0.35"', "kv_cache_tokens: 1024")
    )
    policy = tmp_path / "p.yaml"
    policy.write_text(text)
    assert main(["policy", "plan", str(policy), "--device-memory", "80GiB"]) == 2
    assert "tiers.large" in capsys.readouterr().err


def test_an_fp32_cpu_tier_counts_its_packed_weight_copies() -> None:
    """The default's large tier (fp32 on the CPU) holds each linear's weight twice, plain and
    MKL-packed: about 2 x 135M x 4 bytes (measured RSS after /readyz rose 1.7 -> 2.2 GB)."""
    from router.policy.loader import load_policy
    from tiers.models.plan import plan_policy

    plans = {p.tier: p for p in plan_policy(load_policy(ROOT / "policies/default.yaml"))}
    assert 1.0e9 < plans["large"].weights_bytes < 1.15e9
    assert plans["small"].weights_bytes < 0.1e9  # int4: nothing packed twice
