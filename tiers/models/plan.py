"""Memory planning: KV budgets, and what a policy needs on a device, from model configs alone.

``tiered-router policy plan FILE [--device-memory 80GiB]`` prints, per tier, the weights, the KV
pool and an activation allowance, and how many tokens the pool holds, without loading weights:
parameter counts come from instantiating the model on PyTorch's ``meta`` device from its config.
Configs are read offline (a local directory, the Hugging Face cache, the embedded default); for
the public models the example policies name, the architecture figures of their published
``config.json`` are built in, so a plan works on a machine that has never downloaded them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["PlannedPolicy", "PlannedTier", "TierPlan", "kv_budget_tokens", "parse_memory", "plan_policy"]


class PlannedTier(Protocol):
    """What planning reads of a tier's configuration (the policy's ``TierConfig`` has it): the
    engine package plans from these fields alone and knows nothing of the policy that holds them."""

    @property
    def model(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def quantization(self) -> str: ...
    @property
    def quant_group_size(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def draft(self) -> str | None: ...
    @property
    def speculative_tokens(self) -> int: ...
    @property
    def kv_cache_memory(self) -> str | None: ...
    @property
    def kv_cache_tokens(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def is_remote(self) -> bool: ...


class PlannedPolicy(Protocol):
    """A set of named tiers to plan (a loaded policy is one)."""

    @property
    def tiers(self) -> Mapping[str, PlannedTier]: ...


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}

# Published architecture figures (config.json) of the models the example policies use.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen/qwen2.5-0.5b-instruct": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen/qwen2.5-1.5b-instruct": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen/qwen2.5-3b-instruct": dict(
        model_type="qwen2",
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen/qwen2.5-7b-instruct": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "qwen/qwen2.5-14b-instruct": dict(
        model_type="qwen2",
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


def parse_memory(spec: str, *, device_total: int) -> int:
    """``512MiB`` / ``2GiB`` / ``1000000`` -> bytes; ``0.25`` -> that fraction of ``device_total``."""
    text = str(spec).strip().lower()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmg]i?b|b)?", text)
    if m is None:
        raise ValueError(f"'{spec}' is neither a size (512MiB, 2GiB) nor a fraction of device memory (0.25)")
    value, unit = float(m.group(1)), m.group(2) or ""
    if not unit and value < 1.0:
        if value <= 0.0:
            raise ValueError("a fraction of device memory must be > 0")
        return int(value * device_total)
    return int(value * _UNITS[unit])


def device_memory(device: Any) -> int:
    """Total memory of a torch device in bytes (system RAM for the CPU)."""
    import os

    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def kv_budget_tokens(cfg: PlannedTier, bytes_per_token: int, device_total: int) -> int:
    """Tokens this tier's pool holds: ``kv_cache_memory`` when set, else ``kv_cache_tokens``."""
    if cfg.kv_cache_memory is None:
        return cfg.kv_cache_tokens
    return parse_memory(cfg.kv_cache_memory, device_total=device_total) // max(1, bytes_per_token)


def resolve_config(model: str) -> Any:
    """The model's HF config, offline."""
    from transformers import AutoConfig, PretrainedConfig

    if model.startswith("embedded:"):
        from tiers.models.loading import materialize_embedded

        return AutoConfig.from_pretrained(materialize_embedded(model.split(":", 1)[1]))
    try:
        return AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):
        known = KNOWN_CONFIGS.get(model.lower())
        if known is None:
            raise ValueError(
                f"no config for '{model}' offline: point model: at a local directory, or pre-pull it"
            ) from None
        from transformers import CONFIG_MAPPING

        kind = known["model_type"]
        cls: type[PretrainedConfig] = CONFIG_MAPPING[kind]
        return cls(**{k: v for k, v in known.items() if k != "model_type"})


@dataclass(slots=True)
class TierPlan:
    tier: str
    model: str
    weights_bytes: int
    kv_bytes: int
    kv_tokens: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes


def _weight_bytes(config: Any, cfg: PlannedTier, device: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    numel = {id(p): p.numel() for p in model.parameters()}  # tied weights counted once
    total = sum(numel.values())
    if cfg.quantization == "int4":
        return total // 2 + total // cfg.quant_group_size * 4  # nibbles + a bf16 scale/zero per group
    if cfg.quantization == "int8":
        return total
    width = 2 if _dtype_name(cfg, device) in ("bfloat16", "float16") else 4
    if width == 4 and device == "cpu":
        # fp32 on the CPU keeps a packed copy of every large linear's weight beside it
        # (``fp32_packed.PackedFp32Linear``), the output head included even when tied to the embedding.
        from tiers.layers.fp32_packed import PACKED_MIN_WEIGHT_ELEMENTS

        total += sum(
            m.weight.numel()
            for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m.weight.numel() >= PACKED_MIN_WEIGHT_ELEMENTS
        )
    return total * width


def _dtype_name(cfg: PlannedTier, device: str) -> str:
    if cfg.dtype != "auto":
        return cfg.dtype
    return "bfloat16" if device.startswith("cuda") or cfg.quantization != "none" else "float32"


def plan_policy(policy: PlannedPolicy, device_total: int | None = None) -> list[TierPlan]:
    """Per local tier: weights + KV pool + activations, from configs only (nothing is loaded)."""
    total = device_total or 0
    plans = []
    for name, cfg in policy.tiers.items():
        if cfg.is_remote:
            continue
        config = resolve_config(cfg.model)
        text = config.get_text_config()
        device = cfg.device if cfg.device != "auto" else ("cuda" if device_total else "cpu")
        width = 2 if _dtype_name(cfg, device) in ("bfloat16", "float16") else 4
        kv_heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        per_token = 2 * int(text.num_hidden_layers) * kv_heads * head_dim * width
        tokens = kv_budget_tokens(cfg, per_token, total) // cfg.block_size * cfg.block_size
        # Activations of one step: the widest hidden/MLP buffers over the token budget, plus fp32
        # logits for every row that samples (k + 1 positions each on a speculating tier).
        rows = cfg.max_num_seqs * (cfg.speculative_tokens + 1 if cfg.draft else 1)
        act = (
            cfg.max_num_batched_tokens * (4 * int(text.hidden_size) + 2 * int(text.intermediate_size)) * width
        )
        act += rows * int(text.vocab_size) * 4 * 3
        plans.append(
            TierPlan(name, cfg.model, _weight_bytes(config, cfg, device), tokens * per_token, tokens, act)
        )
    return plans
