"""A lean forward pass for Llama-family decoders (Llama, Qwen2, Mistral), over HF's own modules.

Why: at the batch sizes a tier decodes, a step of a small model is dominated by Python and
dispatch overhead, not FLOPs. HF's layer stack spends ~10 ms per step of SmolLM2-135M on wrappers,
kwargs plumbing, mask helpers and unfused small ops - as much as the int4 matmuls themselves, so it
set the floor on how cheap a draft step could be. This path calls the same weights (the very
``nn.Linear``/quantized modules and the model's own rotary-embedding module, so every RoPE
variant HF supports is computed by HF), and attention laid out as HF's SDPA integration does it.

It reproduces HF's arithmetic op for op (fp32 RMSNorm statistics, the same rotary formula, SDPA
with the same mask), so logits match the generic path to float noise; ``tests/tiers`` checks that
on tiny Llama and Qwen2 models. Anything else - other architectures, sliding windows, attention
softcapping - keeps the generic path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["FastDecoder", "supports_fast_path"]

_SUPPORTED = {"llama", "qwen2", "mistral"}


def supports_fast_path(model: Any) -> bool:
    cfg = model.config.get_text_config()
    if cfg.model_type not in _SUPPORTED:
        return False
    if getattr(cfg, "sliding_window", None) and getattr(
        cfg, "use_sliding_window", cfg.model_type == "mistral"
    ):
        return False
    if getattr(cfg, "attn_logit_softcapping", None):
        return False
    base = model.base_model
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    return all(hasattr(base, n) for n in needed) and getattr(cfg, "hidden_act", "silu") == "silu"


class FastDecoder:
    def __init__(self, model: Any) -> None:
        self.base = model.base_model
        cfg = model.config.get_text_config()
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.scale = self.head_dim**-0.5
        self.group = self.num_heads // self.num_kv_heads
        self.layers = [
            (
                layer.input_layernorm.weight,
                layer.input_layernorm.variance_epsilon,
                layer.self_attn.q_proj,
                layer.self_attn.k_proj,
                layer.self_attn.v_proj,
                layer.self_attn.o_proj,
                layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.variance_epsilon,
                layer.mlp.gate_proj,
                layer.mlp.up_proj,
                layer.mlp.down_proj,
            )
            for layer in self.base.layers
        ]
        self.norm_weight = self.base.norm.weight
        self.norm_eps = self.base.norm.variance_epsilon

    @staticmethod
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # As HF: statistics in fp32, then back to the activation dtype before the weight.
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def __call__(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """input_ids, positions: [B, T]; mask: [B, 1, T, kv_len] bool -> hidden states [B, T, hidden]."""
        b, t = input_ids.shape
        h = self.base.embed_tokens(input_ids)
        cos, sin = self.base.rotary_emb(h, positions)  # [B, T, head_dim]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        gqa = self.num_kv_heads != self.num_heads
        for i, (w_in, eps_in, q_p, k_p, v_p, o_p, w_post, eps_post, gate, up, down) in enumerate(self.layers):
            x = self._rms_norm(h, w_in, eps_in)
            q = q_p(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
            k = k_p(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = v_p(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q = self._rotate(q, cos, sin)
            k = self._rotate(k, cos, sin)
            keys, values = cache.update(k, v, i)
            if gqa and t == 1:
                # One query per row: fold each KV head's query group into the query axis
                # ([B, kv_heads, group, D]) so attention reads K/V once, no per-group copies.
                attn = F.scaled_dot_product_attention(
                    q.reshape(b, self.num_kv_heads, self.group, self.head_dim),
                    keys,
                    values,
                    attn_mask=mask,
                    scale=self.scale,
                ).reshape(b, self.num_heads, 1, self.head_dim)
            else:
                if gqa:  # K/V per query head, as HF's repeat_kv (the CPU flash kernel takes no GQA)
                    keys = (
                        keys[:, :, None]
                        .expand(b, self.num_kv_heads, self.group, *keys.shape[2:])
                        .reshape(b, self.num_heads, *keys.shape[2:])
                    )
                    values = (
                        values[:, :, None]
                        .expand(b, self.num_kv_heads, self.group, *values.shape[2:])
                        .reshape(b, self.num_heads, *values.shape[2:])
                    )
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
            h = h + o_p(attn.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
            x = self._rms_norm(h, w_post, eps_post)
            h = h + down(F.silu(gate(x)) * up(x))
        return self._rms_norm(h, self.norm_weight, self.norm_eps)
