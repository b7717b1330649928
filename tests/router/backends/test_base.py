"""When a policy edit needs new engines (router/backends/base.py, ``engine_key`` / ``model_key``):
every tier field a built engine or model holds is part of the key, so changing it in a hot
reload rebuilds the tier instead of being silently ignored; only the fields read off the tier's
config at each request are left out, and only the model's own fields decide model sharing."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from router.backends.base import engine_key, model_key
from router.policy.schema import GenerationDefaults, TierConfig

PER_REQUEST = {"defaults", "max_queue_wait_s"}
"""Read off ``backend.cfg`` at each request; a reload swaps the config in place."""
MODEL = {
    "model",
    "dtype",
    "quantization",
    "quant_group_size",
    "quantize_head",
    "head_int8_tokens",
    "activation_quantization",
    "device",
    "batch_invariant",
}

CHANGED: dict[str, Any] = {
    "model": "other",
    "dtype": "bfloat16",
    "quantization": "int4",
    "quant_group_size": 64,
    "quantize_head": True,
    "head_int8_tokens": 64,
    "activation_quantization": "int8",
    "device": "cpu",
    "max_num_seqs": 3,
    "max_queue": 5,
    "max_model_len": 1024,
    "max_num_batched_tokens": 256,
    "max_decode_slowdown": 2.5,
    "draft": "small",
    "speculative_tokens": 2,
    "kv_cache_memory": "1GiB",
    "kv_cache_tokens": 4096,
    "block_size": 32,
    "prefix_caching": False,
    "batch_invariant": False,
    "cuda_graphs": True,
    "defaults": GenerationDefaults(max_tokens=7),
    "served_model_name": "up",
    "api_key_env": "UP_KEY",
    "timeout_s": 9.0,
    "max_retries": 0,
    "max_queue_wait_s": 1.0,
    "circuit_failures": 1,
    "circuit_cooldown_s": 1.0,
}


def test_every_tier_field_has_a_changed_value_here() -> None:
    """A new field must be classified: this fails until it is listed above."""
    assert {f.name for f in dataclasses.fields(TierConfig)} == set(CHANGED)


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_a_field_the_engine_holds_changes_the_engine_key(name: str) -> None:
    """Bug it catches: a field left out of the key (``cuda_graphs``, ``max_decode_slowdown`` were)
    - a reload that changes it keeps the old engine, and the edit silently does nothing."""
    base = TierConfig(model="m")
    changed = dataclasses.replace(base, **{name: CHANGED[name]})
    assert getattr(changed, name) != getattr(base, name)
    assert (engine_key(changed) != engine_key(base)) is (name not in PER_REQUEST), name
    assert (model_key(changed) != model_key(base)) is (name in MODEL), name
